"""A spent ``max_llm_calls`` ends every preset's run at once (issue 37 item 5). Measured before:
the final 429 was retried for minutes (Gemini CLI 10 refusals over 208.7 s then exit 173,
OpenCode 6 over 88 s, Pi 4). Now a chat request past the budget gets a last assistant message
(no calls, ``stop``): every CLI ends its headless run on it, exit 0, and the job goes on to eval.

Each preset plays the first swe task with ``max_llm_calls: 1`` (mini-swe-agent and openai-tools stop
at their own step limit, which is ``max_llm_calls``): the oracle's first reply applies the
fix through the preset's own tools, the next call gets the budget's message. Real CLIs in a real
bwrap sandbox through ``rolloutd up``, the scripted backend with the tiny model's tokenizer."""
from __future__ import annotations

import json

import pytest

from tests.harness.conftest import harness_deployment, long_prompt_backend
from tests.harness.test_harness_live import gather, swe_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PRESETS = ["mini-swe-agent", "openai-tools", "claude-code", "codex", "gemini-cli", "qwen-code", "opencode", "pi"]


@pytest.fixture(scope="module")
def backend(tok_dir):
    from rolloutd.handlers.harness_presets import HarnessOracle

    pol = HarnessOracle(wrong_every=2)
    pol.warm()
    yield from long_prompt_backend(tok_dir, pol)


@pytest.fixture(scope="module")
def results(module_up_factory, tok_dir, sandbox_root, agent_venv, backend, swe_built):
    up = harness_deployment(module_up_factory, tok_dir, sandbox_root, agent_venv, backend.url)
    task = swe_ids()[0]
    tasks = [{"handler": "harness", "instance_id": p, "instance": {
        "preset": p, "setup": {"domain": "swe", "instance": {"task_id": task}},
        # opencode's session title is a call of its own: one more for it
        "limits": {"max_llm_calls": 2 if p == "opencode" else 1, "wall_s": 600}}} for p in PRESETS]
    return {r["instance_id"]: r for r in gather(up, tasks, timeout_s=1200)}


@pytest.mark.parametrize("preset", PRESETS)
def test_a_spent_budget_ends_the_run(preset, results):
    r = results[preset]
    agent = r["eval_details"].get("agent") or {}
    m = r["metrics"]
    print(f"\n{preset}: exit {agent.get('exit_code')}, agent {agent.get('duration_s')} s, llm_calls {m['llm_calls']}, "
          f"budget_replies {m['budget_replies']}, refused {m['refused_by_status']}, status {r['status']}")
    assert m["llm_calls"] == (2 if preset == "opencode" else 1) and m["refused_calls"] == 0, m
    if preset == "openai-tools":  # its --max-turns is max_llm_calls: out of turns it exits 3 (documented),
        # after an answered call, so its workspace is graded (no abstention, docs/RELIABILITY.md)
        assert r["status"] == "ok" and agent["exit_code"] == 3 and m["budget_replies"] == 0, r["error"]
        assert "exit code 3" in r["eval_details"]["reason"]
        return
    assert r["status"] == "ok", (r["error"], agent.get("output_tail", "")[-2000:])
    assert agent["exit_code"] == 0
    # the fix went in with the one call; eval ran as after any run (qwen-code, then gemini-cli, got 0
    # once in a CI run and passed alone: the message says what eval and the CLI saw, in full -- a
    # message that is not a str is cut to 240 characters by pytest)
    assert r["reward"] == 1.0, "eval: {}\nthe CLI's output tail:\n{}".format(
        json.dumps({k: v for k, v in r["eval_details"].items() if k != "agent"}, indent=1, default=str),
        agent.get("output_tail", "")[-3000:])
    # mini-swe-agent stops at its own step limit (= max_llm_calls) before asking again
    assert (m["budget_replies"] == 0) if preset == "mini-swe-agent" else (1 <= m["budget_replies"] <= 2), m
