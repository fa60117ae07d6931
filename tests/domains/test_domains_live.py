"""The three task domains through the whole system: ``rolloutd up`` (real daemons), real bwrap
sandboxes, the tiny model's real tokenizer, and the oracle on a scripted vLLM-API backend.

The oracle runs with ``wrong_every=2``: tasks with an even key are solved correctly (reward 1),
odd keys wrongly (reward 0). Keys: math item index (or question hash), HumanEval number,
position of the swe task in the sorted task list.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TRAJ_KEYS = {"job_id", "instance_id", "sample_index", "handler", "status", "failed_phase", "error", "reward",
             "eval_details", "prompt_ids", "response_ids", "loss_mask", "logprobs", "turns", "metrics", "timing",
             "attempts", "policy_version", "stale", "node"}


def _swe_ids():
    from rolloutd.handlers.swe_tasks import task_ids

    return sorted(task_ids())


def _well_formed(r):
    assert TRAJ_KEYS <= set(r), TRAJ_KEYS - set(r)
    n = len(r["response_ids"])
    assert len(r["loss_mask"]) == len(r["logprobs"]) == n
    for t in r["turns"]:
        s, e = t["span"] if "span" in t else (t["start"], t["end"])
        assert 0 <= s <= e <= n
        assert np.all(np.asarray(r["loss_mask"])[s:e] == 1)
    for k in ("init", "run", "eval"):
        assert k in r["timing"] or r["status"] != "ok"


def _gather(up, tasks, timeout_s=150):
    with up.client() as c:
        ids = c.submit(tasks)
        res = {r["job_id"]: r for r in c.gather(ids, timeout_s=timeout_s)}
    return [res[i] for i in ids]


def test_right_and_wrong_in_every_domain(domains_up, swe_built, jsonl_rows):
    from rolloutd.handlers.tasks import question_key

    swe = _swe_ids()
    tasks = [
        {"handler": "math", "instance_id": "m0", "instance": {"dataset": "basic_arithmetic", "seed": 5, "index": 0}},
        {"handler": "math", "instance_id": "m1", "instance": {"dataset": "basic_arithmetic", "seed": 5, "index": 1}},
        {"handler": "math", "instance_id": "m2", "instance": {"dataset": "gsm_symbolic", "seed": 3, "index": 2}},
        {"handler": "math", "instance_id": "m3", "instance": {"dataset": "chain_sum", "seed": 3, "index": 3}},
        {"handler": "code", "instance_id": "c0", "instance": {"task_id": "HumanEval/0"}},
        {"handler": "code", "instance_id": "c1", "instance": {"task_id": "HumanEval/1"}},
        {"handler": "code", "instance_id": "c32", "instance": {"task_id": "HumanEval/32"}},
        {"handler": "swe", "instance_id": "s0", "instance": {"task_id": swe[0]}},
        {"handler": "swe", "instance_id": "s1", "instance": {"task_id": swe[1]}},
    ]
    for row in jsonl_rows:
        tasks.append({"handler": "math", "instance_id": "q" + question_key(row["question"]), "instance": row})
    results = _gather(domains_up, tasks)
    by = {r["instance_id"]: r for r in results}
    for r in results:
        assert r["status"] == "ok", (r["instance_id"], r["failed_phase"], r["error"])
        _well_formed(r)
        assert r["metrics"]["tool_calls"] >= 1, r["instance_id"]
        assert len(r["turns"]) >= 2, r["instance_id"]
        assert all(t["policy_version"] == 0 for t in r["turns"])
    expect = {"m0": 1.0, "m1": 0.0, "m2": 1.0, "m3": 0.0, "c0": 1.0, "c1": 0.0, "c32": 1.0, "s0": 1.0, "s1": 0.0}
    for row in jsonl_rows:
        k = question_key(row["question"])
        expect["q" + k] = 0.0 if int(k, 16) % 2 == 1 else 1.0
    got = {i: by[i]["reward"] for i in expect}
    assert got == expect, {i: by[i]["eval_details"] for i in expect if got[i] != expect[i]}
    # details a trainer can use
    assert by["m0"]["eval_details"]["answer"] is not None and by["m1"]["eval_details"]["expected"]
    assert by["c0"]["eval_details"]["passed"] is True and by["c1"]["eval_details"]["passed"] is False
    s0, s1 = by["s0"]["eval_details"], by["s1"]["eval_details"]
    assert s0["resolved"] and s0["counts"]["f2p_passed"] == s0["counts"]["f2p_total"] > 0
    assert not s1["resolved"] and s1["FAIL_TO_PASS_failed"]
    assert s0["patch"] and "diff --git" in s0["patch"]
    # math's sandbox was freed after run (eval needs none); code and swe evaluated inside theirs
    assert by["m0"]["metrics"]["stop_reason"] == "no_tool_call"


@pytest.mark.parametrize("phase", ["init", "run", "eval"])
def test_a_fault_in_each_phase_is_a_well_formed_failure(domains_up, swe_built, phase):
    swe = _swe_ids()
    instances = {"math": {"dataset": "basic_arithmetic", "seed": 1, "index": 0},
                 "code": {"task_id": "HumanEval/2"}, "swe": {"task_id": swe[2]}}
    tasks = [{"handler": h, "instance_id": f"{h}-{phase}", "instance": dict(inst, inject_fault=phase)}
             for h, inst in instances.items()]
    for r in _gather(domains_up, tasks):
        _well_formed(r)
        assert r["status"] == "failed", r
        assert r["failed_phase"] == phase
        assert r["error"]["type"] == "InjectedFault" and phase in r["error"]["message"]
        assert r["reward"] == 0.0
        assert r["eval_details"]["task"].startswith(r["handler"] + ":")
        if phase != "init":
            assert len(r["turns"]) >= 2  # the agent loop ran; its tokens come back with the failure


def test_bad_instances_fail_in_init(domains_up):
    tasks = [{"handler": "math", "instance": {"dataset": "no_such_dataset", "seed": 0, "index": 0}},
             {"handler": "math", "instance": {"nothing": 1}},
             {"handler": "code", "instance": {"task_id": "HumanEval/999"}},
             {"handler": "swe", "instance": {"task_id": "no-such-task"}}]
    for r in _gather(domains_up, tasks, timeout_s=60):
        _well_formed(r)
        assert r["status"] == "failed" and r["failed_phase"] == "init", r
        assert r["error"]["message"]
