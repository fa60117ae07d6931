"""The ``harness`` handler through the whole system: ``rolloutd up`` (real daemons), real bwrap
sandboxes without a network, the tiny model's real tokenizer, agent programs from PyPI
(mini-swe-agent, the openai SDK) in a read-only venv, and the oracle on a scripted vLLM-API
backend (``wrong_every=2``: even keys right, odd keys wrong).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAJ_KEYS = {"job_id", "instance_id", "sample_index", "handler", "status", "failed_phase", "error", "reward",
             "eval_details", "prompt_ids", "response_ids", "loss_mask", "logprobs", "turns", "metrics", "timing",
             "attempts", "policy_version", "stale", "node"}


def swe_ids():
    from rolloutd.handlers.swe_tasks import task_ids

    return sorted(task_ids())


def well_formed(r, tok=None):
    assert TRAJ_KEYS <= set(r), TRAJ_KEYS - set(r)
    n = len(r["response_ids"])
    assert len(r["loss_mask"]) == len(r["logprobs"]) == n
    mask = np.asarray(r["loss_mask"])
    covered = np.zeros(n, bool)
    for t in r["turns"]:
        s, e = t["span"]
        assert 0 <= s <= e <= n
        assert np.all(mask[s:e] == 1)
        covered[s:e] = True
    assert np.all(mask[~covered] == 0)  # observations and template tokens are masked out
    assert np.all(np.asarray(r["logprobs"])[~covered] == 0)


def turn_texts(r, tok):
    return [tok.decode([int(x) for x in r["response_ids"][t["span"][0]:t["span"][1]]], skip_special_tokens=True)
            for t in r["turns"]]


def gather(up, tasks, timeout_s=240):
    with up.client() as c:
        ids = c.submit(tasks)
        res = {r["job_id"]: r for r in c.gather(ids, timeout_s=timeout_s)}
    return [res[i] for i in ids]


def mini_task(i, task_id, **extra):
    inst = dict({"preset": "mini-swe-agent", "setup": {"domain": "swe", "instance": {"task_id": task_id}},
                 "limits": {"max_llm_calls": 6, "wall_s": 180}}, **extra)
    return {"handler": "harness", "instance_id": f"mini{i}", "instance": inst}


def test_mini_swe_agent_solves_swe_tasks_as_the_oracle_dictates(harness_up, swe_built, tiny_tokenizer):
    ids = swe_ids()
    results = gather(harness_up, [mini_task(0, ids[0]), mini_task(1, ids[1])])
    for r in results:
        assert r["status"] == "ok", (r["instance_id"], r["failed_phase"], r["error"], r["eval_details"].get("agent"))
        well_formed(r)
        assert r["eval_details"]["agent"]["exit_code"] == 0
        # fix, test, submit: three assistant turns in one segment, every earlier reply reused by id
        assert len(r["turns"]) == 3 and "segments" not in r
        assert r["metrics"]["segments"] == 1 and r["metrics"]["llm_calls"] == 3
        assert r["metrics"]["assistant_tokens_reencoded"] == 0 and r["metrics"]["assistant_tokens_reused"] > 0
        texts = turn_texts(r, tiny_tokenizer)
        assert all("```mswea_bash_command" in t for t in texts), texts
        assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in texts[-1]
        assert all(t["policy_version"] == 0 for t in r["turns"])
    right, wrong = results
    assert right["reward"] == 1.0 and right["eval_details"]["resolved"] is True
    assert wrong["reward"] == 0.0 and wrong["eval_details"]["resolved"] is False
    assert right["eval_details"]["patch"] and wrong["eval_details"]["patch"]  # both edited the repository


def tools_task(i, index, **extra):
    inst = dict({"preset": "openai-tools",
                 "setup": {"domain": "math", "instance": {"dataset": "basic_arithmetic", "seed": 5, "index": index}},
                 "limits": {"wall_s": 120}}, **extra)
    return {"handler": "harness", "instance_id": f"tools{i}", "instance": inst}


def test_openai_sdk_tool_loop_on_math(harness_up, tiny_tokenizer):
    results = gather(harness_up, [tools_task(0, 0), tools_task(1, 1)])
    for r in results:
        assert r["status"] == "ok", (r["instance_id"], r["failed_phase"], r["error"], r["eval_details"].get("agent"))
        well_formed(r)
        # a python tool call (structured tool_calls sent back by the SDK), then the answer
        assert len(r["turns"]) == 2 and r["metrics"]["segments"] == 1
        assert r["metrics"]["assistant_tokens_reencoded"] == 0
        first, last = turn_texts(r, tiny_tokenizer)
        assert "<tool_call>" in first and "\\boxed{" in last
        assert r["eval_details"]["agent"]["output_tail"].strip().endswith(last.strip().split("\n")[-1].strip()[-20:])
    assert [r["reward"] for r in results] == [1.0, 0.0]


def test_agent_that_crashes_after_a_call_is_graded_with_exit_code_tail_and_tokens(harness_up):
    # A program bug after an answered call is graded, not failed (docs/RELIABILITY.md, "No
    # abstention"): the eval decides the reward (``true``: 1), the exit is the reason.
    script = ("from openai import OpenAI\n"
              "r = OpenAI(max_retries=0).chat.completions.create(model='rolloutd', "
              "messages=[{'role': 'user', 'content': 'say something'}])\n"
              "print('got a reply of', len(r.choices[0].message.content or ''), 'chars')\n"
              "raise RuntimeError('agent bug after the first call')\n")
    task = {"handler": "harness", "instance_id": "crash", "instance": {
        "command": ["python", "-c", script], "task": "anything", "task_via": "stdin",
        "eval": {"command": ["true"]}}}
    (r,) = gather(harness_up, [task])
    assert r["status"] == "ok" and r["failed_phase"] is None and r["error"] is None, r
    assert "exit code 1 after 1 answered LLM call;" in r["eval_details"]["reason"], r["eval_details"]
    agent = r["eval_details"]["agent"]
    assert agent["exit_code"] == 1 and "RuntimeError: agent bug after the first call" in agent["output_tail"]
    assert "got a reply of" in agent["output_tail"]
    assert len(r["turns"]) == 1 and len(r["response_ids"]) > 0  # the tokens sampled before the crash
    well_formed(r)
    assert r["reward"] == 1.0 and r["eval_details"]["eval_exit_code"] == 0


def test_bad_instances_fail_in_init_with_a_clear_error(harness_up):
    tasks = [{"handler": "harness", "instance_id": "b0", "instance": {"preset": "mini-swe-agent", "colour": "red",
                                                                      "task": "x", "eval": {"command": ["true"]}}},
             {"handler": "harness", "instance_id": "b1", "instance": {"command": ["agent"], "task": "x",
                                                                      "eval": {"command": ["true"]}}},
             {"handler": "harness", "instance_id": "b2", "instance": {"command": ["agent", "{task}"], "task": "x"}}]
    results = gather(harness_up, tasks)
    msgs = [r["error"]["message"] for r in results]
    assert all(r["status"] == "failed" and r["failed_phase"] == "init" for r in results), msgs
    assert all(r["error"]["type"] == "HarnessInstanceError" for r in results)
    assert "unknown instance keys ['colour']" in msgs[0]
    assert "'{task}' placeholder" in msgs[1]
    assert "'eval' is required" in msgs[2]


def _host_procs_with(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_agent_that_ignores_its_wall_budget_is_killed_with_its_tree(harness_up):
    marker = f"98765{os.getpid() % 1000}"
    cmd = ["bash", "-c", f"(sleep {marker} &); sleep {marker} & sleep {marker}; echo never"]
    task = {"handler": "harness", "instance_id": "slow", "instance": {
        "command": cmd, "task": "ignored", "task_via": "stdin", "limits": {"wall_s": 2},
        "eval": {"command": ["true"]}}}
    (r,) = gather(harness_up, [task])
    assert r["status"] == "timeout" and r["failed_phase"] == "run", r
    assert r["eval_details"]["agent"]["timed_out"] is True
    assert r["eval_details"]["agent"]["exit_code"] == -9
    # The tree is killed before the result is sent, but a loaded machine may still list the
    # dying processes for a moment (as in the cancel test below): wait on the state.
    wait_for(lambda: not _host_procs_with(f"sleep {marker}"), 15, what="the agent's sleep tree to be gone")


def test_cancel_mid_llm_call_kills_the_agent_and_aborts_the_backend_request(harness_up, oracle_backend):
    marker = f"cancel-probe-{os.getpid()}"
    script = ("import sys\nfrom openai import OpenAI\n"
              f"# {marker}\n"
              "OpenAI(max_retries=0, timeout=600).chat.completions.create(model='rolloutd', "
              "messages=[{'role': 'user', 'content': 'hang please'}])\n")
    task = {"handler": "harness", "instance_id": "cancel", "instance": {
        "command": ["python", "-c", script], "task": "x", "task_via": "stdin", "eval": {"command": ["true"]}}}
    before = oracle_backend.stats["disconnects"]
    oracle_backend.inject("hang")
    with harness_up.client() as c:
        (jid,) = c.submit([task])
        assert oracle_backend.wait_for(lambda b: b.num_running >= 1, timeout=60), "the call never arrived"
        assert _host_procs_with(marker)
        c.cancel([jid])
        (r,) = c.gather([jid], timeout_s=60)
    assert r["status"] == "cancelled", r
    assert oracle_backend.wait_for(lambda b: b.stats["disconnects"] > before, timeout=15)
    end = time.monotonic() + 15
    while _host_procs_with(marker) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _host_procs_with(marker)


def test_32_concurrent_harness_jobs(harness_up, tiny_tokenizer):
    script = ("import sys\nfrom openai import OpenAI\nc = OpenAI(max_retries=0)\n"
              "msgs = [{'role': 'user', 'content': sys.stdin.read()}]\n"
              "for _ in range(2):\n"
              "    m = c.chat.completions.create(model='rolloutd', messages=msgs).choices[0].message\n"
              "    msgs += [{'role': 'assistant', 'content': m.content}, {'role': 'user', 'content': 'and again'}]\n"
              "print('done')\n")
    tasks = [{"handler": "harness", "instance_id": f"c{i}", "instance": {
        "command": ["python", "-c", script], "task": f"job {i}: no task tag here", "task_via": "stdin",
        "eval": {"command": ["test", "-f", ".rolloutd_agent.log"]}}} for i in range(32)]
    results = gather(harness_up, tasks, timeout_s=600)
    for r in results:
        assert r["status"] == "ok", (r["instance_id"], r["error"], r["eval_details"].get("agent"))
        well_formed(r)
        assert len(r["turns"]) == 2 and r["metrics"]["segments"] == 1
        assert r["metrics"]["assistant_tokens_reencoded"] == 0
        assert r["reward"] == 1.0
    assert len({r["job_id"] for r in results}) == 32


def test_task_by_file_and_a_stdout_reward(harness_up):
    cmd = ["bash", "-c", 'cat "$ROLLOUTD_TASK_FILE" > seen.txt; cat {task_file} >> seen.txt; pwd >> seen.txt']
    task = {"handler": "harness", "instance_id": "file", "instance": {
        "command": cmd, "task": "hello task\n", "task_via": "file",
        "setup": {"files": {"notes/readme.txt": "workspace file\n"}},
        "eval": {"command": ["bash", "-c", "cat notes/readme.txt seen.txt; grep -c 'hello task' seen.txt"],
                 "reward": "stdout", "timeout_s": 30}}}
    (r,) = gather(harness_up, [task])
    assert r["status"] == "ok", r
    assert r["reward"] == 2.0  # the task file, read twice (by $ROLLOUTD_TASK_FILE and by {task_file})
    out = r["eval_details"]["eval_output"]
    assert out.startswith("workspace file\nhello task\nhello task\n/workspace\n"), out
    assert r["eval_details"]["eval_exit_code"] == 0
    assert len(r["turns"]) == 0 and r["metrics"]["llm_calls"] == 0  # an agent that never called the LLM
