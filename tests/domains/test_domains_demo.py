"""``rolloutd demo`` end to end, and the domains on the (unisolated) local runtime."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import tagged_pids

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_code_and_swe_on_the_local_runtime(up_factory, domain_sets, oracle_backend, swe_built):
    """No binds there: pytest reaches the sandbox through a directory of symlinks."""
    from rolloutd.handlers.swe_tasks import task_ids

    up = up_factory(*domain_sets("local"))
    swe = sorted(task_ids())
    tasks = [{"handler": "swe", "instance_id": "s2", "instance": {"task_id": swe[2]}},   # even: right
             {"handler": "swe", "instance_id": "s3", "instance": {"task_id": swe[3]}},   # odd: wrong
             {"handler": "code", "instance_id": "c4", "instance": {"task_id": "HumanEval/4"}},
             {"handler": "math", "instance_id": "m0", "instance": {"dataset": "chain_sum", "seed": 9, "index": 0}}]
    with up.client() as c:
        c.add_backend(oracle_backend.url)
        ids = c.submit(tasks)
        by = {r["instance_id"]: r for r in c.gather(ids, timeout_s=120)}
    for r in by.values():
        assert r["status"] == "ok", (r["instance_id"], r["error"])
    assert {k: r["reward"] for k, r in by.items()} == {"s2": 1.0, "s3": 0.0, "c4": 1.0, "m0": 1.0}, \
        {k: r["eval_details"] for k, r in by.items()}


def test_demo_runs_the_mixed_batch(tmp_path, domain_entry_points, need_bwrap, swe_built):
    out = tmp_path / "traj.jsonl"
    tag = f"domains-demo-{uuid.uuid4().hex}"  # inherited by everything the demo starts
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "demo", "--per-domain", "2", "--no-progress",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, COLUMNS="160", ROLLOUTD_TEST_DEMO_TAG=tag))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "results by domain" in p.stdout and str(out) in p.stdout.replace("\n", "")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    assert {r["handler"] for r in rows} == {"math", "code", "swe"}
    assert all(r["status"] == "ok" for r in rows)
    # the oracle (wrong_every=3) solves keys 0 and 1 of every domain
    assert all(r["reward"] == 1.0 for r in rows), [(r["instance_id"], r["eval_details"]) for r in rows]
    # nothing the demo started survives it (found by the tag in their environment)
    left = tagged_pids(tag)
    assert not left, left
    # the demo says how to view what it wrote, and that command works on it (tests/viewer: the page)
    flat = " ".join(p.stdout.split())
    cmd = flat[flat.index("rolloutd view "):].split()[:5]
    assert cmd[:3] == ["rolloutd", "view", str(out)] and cmd[3] == "--tokenizer", cmd
    html = tmp_path / "traj.html"
    v = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", *cmd[1:], "--out", str(html)], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout) == {"out": str(html), "jobs": 6, "by_status": {"ok": 6}}
    assert f"tokenizer {cmd[4]}" in v.stderr
