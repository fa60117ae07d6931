"""A harness job cancelled or timed out after several calls keeps every turn it sampled (issue 28
item 3, the harness handler: its endpoint's trajectory is copied on every path). Real
``rolloutd up``, bwrap, the real ``openai`` SDK inside the sandbox, the oracle backend."""
from __future__ import annotations

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
