"""Issue 35 items 3 and 6 and issue 38's output_tail through the whole system: ``rolloutd up`` (real
daemons), real bwrap sandboxes, harness jobs whose agent is a shell command (no LLM call):

* ``reward: "stdout"`` with the agent's own module printing nan, inf, -inf, 1e308: status ok,
  reward 0 with the reason (before: an ok job with reward NaN / inf, end to end);
* an agent that leaves a 1,100-deep a/a/... tree in a swe workspace: status ok, reward 0, the reason
  (before: the conftest sweep raised RecursionError and the job was ``failed``, dropped from training);
* ``eval_details.agent.output_tail`` is the last 16 KiB of the agent's output, as HARNESS.md says
  (before: 4,000 characters).
"""
from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def gather(up, tasks, timeout_s=300):
    with up.client() as c:
        ids = c.submit(tasks)
        res = {r["job_id"]: r for r in c.gather(ids, timeout_s=timeout_s)}
    return [res[i] for i in ids]


def shell_job(i, script, ev, **setup):
    return {"handler": "harness", "instance_id": f"g{i}", "instance": {
        "command": ["sh", "-c", script], "task": "grade me", "task_via": "stdin", "setup": setup, "eval": ev,
        "limits": {"wall_s": 120}}}


def test_stdout_rewards_are_finite_and_output_tail_is_16_kib(harness_up):
    printed = ["nan", "inf", "-inf", "1e308", "0.5"]
    jobs = [shell_job(i, "head -c 20000 /dev/zero | tr '\\0' x; echo; echo TAIL-END; "
                         f"echo 'print(\"{p}\")' > score.py",
                      {"command": ["python3", "score.py"], "reward": "stdout", "timeout_s": 60})
            for i, p in enumerate(printed)]
    results = gather(harness_up, jobs)
    for p, r in zip(printed, results):
        assert r["status"] == "ok", (p, r["error"])
        assert math.isfinite(r["reward"]), (p, r["reward"])
        tail = r["eval_details"]["agent"]["output_tail"]
        assert len(tail) == 16384 and tail.endswith("TAIL-END\n"), (len(tail), tail[-40:])
        assert r["eval_details"]["agent"]["output_bytes"] == 20000 + 1 + 9
    assert [r["reward"] for r in results] == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert all("last stdout line" in r["eval_details"]["reason"] for r in results[:4]), [r["eval_details"] for r in results]
    assert "reason" not in results[4]["eval_details"]


DEEP = ("python3 -c \"import os\nfor i in range(1100):\n    os.mkdir('a'); os.chdir('a')\n"
        "os.symlink('.', 'loop')\nprint('deep')\"")


def test_a_deep_tree_in_a_swe_workspace_is_scored_zero_not_failed(harness_up, swe_built):
    from rolloutd.handlers.swe_tasks import task_ids

    task_id = sorted(task_ids())[0]
    (r,) = gather(harness_up, [shell_job(0, DEEP, {"scorer": "swe"}, domain="swe",
                                          instance={"task_id": task_id})])
    assert r["status"] == "ok" and r["reward"] == 0.0, (r["status"], r["error"], r["eval_details"])
    assert "directories deep" in r["eval_details"]["reason"], r["eval_details"]
    assert "deep" in r["eval_details"]["agent"]["output_tail"]
