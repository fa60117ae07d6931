"""``rolloutd demo --backend vllm``: the demo's batch on the session's real vLLM, and its view page.

``--vllm-url`` points the demo at the session's server (one vLLM start per session); the demo's own
start (``--backend vllm`` alone) is the same ``VLLMServer`` the fixture uses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import REPO, tagged_pids
from tests.domains.conftest import need_bwrap, swe_built  # noqa: F401

pytestmark = pytest.mark.slow


def test_demo_on_vllm_and_its_view_page(tmp_path, vllm_server, need_bwrap, swe_built):  # noqa: F811
    out = tmp_path / "traj.jsonl"
    tag = f"vllm-demo-{uuid.uuid4().hex}"
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "demo", "--backend", "vllm",
                        "--vllm-url", vllm_server.url, "--vllm-model", vllm_server.model_dir, "--per-domain", "1",
                        "--runtime", "bwrap", "--no-progress", "--out", str(out), "--deadline", "240"],
                       cwd=REPO, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, COLUMNS="160", ROLLOUTD_TEST_DEMO_TAG=tag))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert f"tiny random model on vLLM at {vllm_server.url}" in " ".join(p.stdout.split())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["handler"] for r in rows} == {"math", "code", "swe"} and len(rows) == 3
    for r in rows:
        assert r["status"] == "ok", (r["instance_id"], r["error"])
        assert len(r["response_ids"]) > 0 and all(t["backend"] == vllm_server.url for t in r["turns"])
    assert not tagged_pids(tag)
    flat = " ".join(p.stdout.split())
    cmd = flat[flat.index("rolloutd view "):].split()[:5]
    assert cmd == ["rolloutd", "view", str(out), "--tokenizer", vllm_server.model_dir], cmd
    html = tmp_path / "traj.html"
    v = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", *cmd[1:], "--out", str(html)], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout) == {"out": str(html), "jobs": 3, "by_status": {"ok": 3}}
    assert html.stat().st_size > 0
