"""``rolloutd demo --domains swe,harness``: the demo's harness section (mini-swe-agent on swe tasks,
oracle backend) end to end, in a child process like a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import require_bwrap, tagged_pids

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_demo_harness_section(tmp_path, agent_venv, swe_built):
    require_bwrap()
    out = tmp_path / "traj.jsonl"
    tag = f"harness-demo-{uuid.uuid4().hex}"  # inherited by everything the demo starts
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "demo", "--domains", "swe,harness",
                        "--per-domain", "2", "--no-progress", "--agent-venv", agent_venv, "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=360,
                       env=dict(os.environ, COLUMNS="160", ROLLOUTD_TEST_DEMO_TAG=tag))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    harness = [r for r in rows if r["handler"] == "harness"]
    assert len(rows) == 4 and len(harness) == 2
    assert all(r["status"] == "ok" for r in rows)
    # the oracle (wrong_every=3) solves keys 0 and 1; mini-swe-agent fixed, tested, submitted
    assert [r["reward"] for r in harness] == [1.0, 1.0], [r["eval_details"] for r in harness]
    assert all(len(r["turns"]) == 3 and r["eval_details"]["agent"]["exit_code"] == 0 for r in harness)
    assert "harness" in p.stdout
    # nothing the demo started survives it (found by the tag in their environment: other
    # demos may run on this machine at the same time)
    left = tagged_pids(tag)
    assert not left, left

