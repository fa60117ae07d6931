"""An agent program that ends non-zero cannot abstain (issue 35 item 6, docs/RELIABILITY.md "No
abstention"): after an answered LLM call, with no backend or endpoint failure, its workspace is
graded as it was left (status ``ok``, the eval's reward, ``eval_details.reason``), whoever ended
it: the program itself (exit 1) or the model's ``kill -9 $PPID``. A backend failure it exited
of, or an exit before any answered call, still fails the job (``AgentExited``).

Real daemons (``rolloutd up``), real bwrap sandboxes, the tiny model's real tokenizer, a scripted
vLLM-API backend whose policy echoes the last message and fails (HTTP 500) on ``BACKEND-FAIL``.
"""
from __future__ import annotations

import pytest

from tests.conftest import require_bwrap
from tests.harness.conftest import harness_sets
from tests.harness.test_endpoint_isolation import run_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A stdlib agent: asks the model for the answer (the echo policy repeats it), writes it into the
# workspace, then ends the way ``mode`` says. A wrong workspace gets 41 instead of 42.
AGENT = r'''
import json, os, subprocess, sys, urllib.error, urllib.request

mode, answer = sys.argv[1], sys.argv[2]

def call(text):
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"].strip()

if mode == "early":  # exits before any LLM call
    sys.exit(1)
got = call(answer)
print("MODEL SAID", got, flush=True)
with open("answer.txt", "w") as f:
    f.write(got + "\n")
if mode == "backend":  # the backend fails on the next call: the program gives up
    try:
        call("BACKEND-FAIL")
    except urllib.error.HTTPError as e:
        print("SECOND CALL", e.code, e.read().decode()[:300], flush=True)
    sys.exit(1)
if mode == "kill":  # what a model's shell command can do to the harness that runs it
    subprocess.run(["sh", "-c", "kill -9 $PPID"])
    print("still alive", flush=True)
sys.exit(1)
'''

EVAL = {"command": ["python3", "-c", "import sys; sys.exit(open('answer.txt').read().strip() != '42')"]}


def job(mode: str, answer: str = "42") -> dict:
    return {"handler": "harness", "instance_id": f"{mode}-{answer}", "instance": {
        "command": ["python3", "agent.py", mode, answer], "task": "answer", "task_via": "stdin",
        "setup": {"files": {"agent.py": AGENT}},
        "limits": {"max_llm_calls": 10, "wall_s": 300, "max_context": 4096},
        "eval": EVAL}}


@pytest.fixture(scope="module")
def failing_echo(tok_dir):
    from rolloutd.backends.policies import EchoPolicy
    from rolloutd.backends.scripted import ScriptedBackend

    class EchoUnlessFail(EchoPolicy):
        def reply(self, request):
            text = super().reply(request)
            if "BACKEND-FAIL" in text:
                raise RuntimeError("scripted backend failure")
            return text

    b = ScriptedBackend(tok_dir, policy=EchoUnlessFail())
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def exit_up(module_up_factory, tok_dir, sandbox_root, failing_echo):
    require_bwrap()  # a stdlib agent: no agent venv
    up = module_up_factory(*harness_sets(tok_dir, sandbox_root, ""))
    with up.client() as c:
        c.add_backend(failing_echo.url)
    return up


def test_an_agent_that_exits_or_is_killed_after_a_call_is_graded_not_failed(exit_up):
    results = run_batch(exit_up, [job("exit1"), job("exit1", "41"), job("kill"), job("kill", "41")])
    for r, reward in zip(results, (1.0, 0.0, 1.0, 0.0)):
        agent = r["eval_details"]["agent"]
        assert r["status"] == "ok" and r["error"] is None, (r["instance_id"], r["error"], agent)
        assert r["reward"] == reward, (r["instance_id"], r["eval_details"])
        assert "MODEL SAID" in agent["output_tail"], agent
        assert len(r["turns"]) == 1 and len(r["response_ids"]) > 0  # the answered call is in the trajectory
        reason = r["eval_details"]["reason"]
        assert "after 1 answered LLM call;" in reason and "graded" in reason, reason
    exit1, kill = results[0], results[2]
    assert exit1["eval_details"]["agent"]["exit_code"] == 1
    assert "exit code 1" in exit1["eval_details"]["reason"]
    assert kill["eval_details"]["agent"]["exit_code"] == -9  # killed by its child's kill $PPID
    assert "killed by signal 9" in kill["eval_details"]["reason"]
    assert "still alive" not in kill["eval_details"]["agent"]["output_tail"]


def test_a_backend_failure_or_no_answered_call_still_fails_the_job(exit_up, failing_echo):
    backend, early = run_batch(exit_up, [job("backend"), job("early")])
    for r in (backend, early):
        assert r["status"] == "failed" and r["failed_phase"] == "run", (r["instance_id"], r["status"], r["error"])
        assert r["error"]["type"] == "AgentExited" and "exit code 1" in r["error"]["message"], r["error"]
        assert "reason" not in r["eval_details"], r["eval_details"]
    # the program wrote the right answer before the backend failed: still not graded
    assert "MODEL SAID 42" in backend["eval_details"]["agent"]["output_tail"]
    assert "SECOND CALL 5" in backend["eval_details"]["agent"]["output_tail"], backend["eval_details"]["agent"]
    assert any(k.startswith("5") for k in backend["metrics"]["refused_by_status"]), backend["metrics"]
    assert early["metrics"]["llm_calls"] == 0
