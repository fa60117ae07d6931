"""A harness job cancelled or timed out after several calls keeps every turn it sampled (issue 28
item 3, the harness handler: its endpoint's trajectory is copied on every path). Real
``rolloutd up``, bwrap, the real ``openai`` SDK inside the sandbox, the oracle backend."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.conftest import wait_for

LOOP = ("from openai import OpenAI\n"
        "c = OpenAI(max_retries=0)\n"
        "msgs = [{'role': 'user', 'content': 'say something'}]\n"
        "while True:\n"
        "    r = c.chat.completions.create(model='rolloutd', messages=msgs, max_tokens=8)\n"
        "    msgs += [{'role': 'assistant', 'content': r.choices[0].message.content or ''},\n"
        "             {'role': 'user', 'content': 'and more'}]\n"
        "    print('call', len(msgs) // 2, flush=True)\n")


def task(iid, **limits):
    return {"handler": "harness", "instance_id": iid, "instance": {
        "command": ["python", "-c", LOOP], "task": "x", "task_via": "stdin", "limits": limits,
        "eval": {"command": ["true"]}}}


def check(r, at_least):
    turns = r["turns"]
    assert len(turns) >= at_least and r["metrics"]["llm_calls"] >= len(turns), (len(turns), r["metrics"])
    mask = np.asarray(r["loss_mask"])
    assert int(mask.sum()) == sum(e - s for s, e in (t["span"] for t in turns)) > 0
    assert len(r["response_ids"]) == len(mask) == len(r["logprobs"]) and len(r["prompt_ids"]) > 0


def test_cancelled_and_timed_out_harness_jobs_keep_their_turns(harness_up, oracle_backend):
    with harness_up.client() as c:
        start = oracle_backend.stats["completed"]
        (jid,) = c.submit([task("cancel-me", wall_s=600)])
        wait_for(lambda: oracle_backend.stats["completed"] - start >= 3, timeout_s=120, what="three sampled calls")
        c.cancel([jid])
        (r,) = c.gather([jid], timeout_s=60)
        assert r["status"] == "cancelled", r["error"]
        check(r, 3)
        (r,) = c.gather(c.submit([task("time-me-out", wall_s=20)]), timeout_s=120)
        assert r["status"] == "timeout" and r["failed_phase"] == "run", r["error"]
        check(r, 1)


# Two short calls, then one request whose translation (parse, tokenize, place: 100,000 messages)
# keeps an endpoint thread busy for seconds; the job is cancelled while it runs. urllib, not the
# SDK, for the big one: its own validation of 100,000 messages would add seconds of agent time.
HEAVY = ("import json, os, urllib.request\n"
         "from openai import OpenAI\n"
         "c = OpenAI(max_retries=0)\n"
         "msgs = [{'role': 'user', 'content': 'say something'}]\n"
         "for _ in range(2):\n"
         "    r = c.chat.completions.create(model='rolloutd', messages=msgs, max_tokens=8)\n"
         "    msgs += [{'role': 'assistant', 'content': r.choices[0].message.content or ''},\n"
         "             {'role': 'user', 'content': 'and more'}]\n"
         "msgs += [{'role': ('assistant', 'user')[i % 2], 'content': f'message number {i}'} for i in range(1, 100000)]\n"
         "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',\n"
         "    data=json.dumps({'model': 'rolloutd', 'messages': msgs, 'max_tokens': 8}).encode(),\n"
         "    headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
         "urllib.request.urlopen(req, timeout=600).read()\n")


def test_job_cancelled_while_its_request_is_translated_waits_for_the_thread(harness_up, oracle_backend):
    """A cancel that lands while an endpoint thread translates the job's request: the request never
    reaches the backend, the job ends cancelled with its two turns, and its trajectory is copied
    after the thread ended (the thread's CPU, counted when it ends, is in the job's metrics;
    copied at the cancel they would hold the two short calls' milliseconds). docs/ARCHITECTURE.md,
    "Threads beside the loop"."""
    inst = {"command": ["python", "-c", HEAVY], "task": "x", "task_via": "stdin",
            "limits": {"wall_s": 600, "max_context": 1 << 22}, "eval": {"command": ["true"]}}
    with harness_up.client() as c:
        start, requests = oracle_backend.stats["completed"], oracle_backend.stats["requests"]
        (jid,) = c.submit([{"handler": "harness", "instance_id": "cancel-in-thread", "instance": inst}])
        wait_for(lambda: oracle_backend.stats["completed"] - start >= 2, timeout_s=120, what="two sampled calls")
        run = harness_up.daemon_pid("run")
        cpu0 = _cpu_s(run)
        wait_for(lambda: _cpu_s(run) - cpu0 >= 0.3, timeout_s=120, what="the run daemon translating the big request")
        c.cancel([jid])
        spent = _cpu_s(run) - cpu0  # most of it the thread's (the loop only received the body)
        (r,) = c.gather([jid], timeout_s=120)
    assert r["status"] == "cancelled", r["error"]
    assert oracle_backend.stats["requests"] - requests == 2, "the big request reached the backend before the cancel"
    check(r, 2)
    assert len(r["turns"]) == 2 and "trajectory_error" not in r["metrics"], r["metrics"]
    # The thread stops at its next check of the cancel (a 503 it counts) or at its end: either
    # way its CPU is counted when it ends, before the copy (without the wait: 0.012 s, checked).
    assert r["metrics"]["endpoint_cpu_s"] >= 0.5 * spent, (spent, r["metrics"])
    assert not harness_up.logged("endpoint_thread_work_outlived_job")


def _cpu_s(pid: int) -> float:
    """User + system CPU of one process (not its children: the sandboxed agent is one)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
