"""examples/train_tiny_grpo.py end to end: a real GRPO loop on CPU through ``rolloutd up`` and
``rolloutd serve-hf``, swapping checkpoints through the gateway after every update."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the example trains a torch policy (pip install torch==2.13.0)")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_tiny_grpo.py"
pytestmark = pytest.mark.slow


def processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(n in cmd for n in needles):
            out.append((int(d.name), cmd[:200]))
    return out


def parse(stdout: str) -> tuple[list[dict], dict | None]:
    steps = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("STEP ")]
    summary = next((json.loads(line[8:]) for line in stdout.splitlines() if line.startswith("SUMMARY ")), None)
    return steps, summary


@pytest.mark.timeout(600)  # ~80 s here, mostly six serve-hf start-ups (one per checkpoint)
def test_grpo_reward_rises_on_policy_with_checkpoint_swaps(tmp_path):
    out = tmp_path / "run"
    steps_n = 6
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(steps_n), "--seed", "0", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=560)
    steps, summary = parse(proc.stdout)
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0 and summary is not None, detail
    assert summary["failures"] == [] and summary["steps"] == steps_n, detail
    # every trajectory of step k came from policy version k: the swap went through the gateway
    assert [s["trained_on_versions"] for s in steps] == [[k] for k in range(steps_n)], detail
    assert all(s["n_ok"] == s["n"] == 64 for s in steps), detail
    # on-policy: the service's logprobs are the trainer's (temperature 1): importance ratio 1
    assert summary["max_logprob_diff"] < 1e-3, detail
    curve = summary["reward_curve"]
    assert sum(curve[-2:]) / 2 > sum(curve[:2]) / 2 + 0.05, curve
    assert (out / "metrics.jsonl").read_text().count("\n") == steps_n
    # everything it started is gone: rolloutd up, its daemons, every serve-hf
    assert not Path(summary["runtime_dir"]).exists()
    assert processes_mentioning(str(out), summary["runtime_dir"]) == []


def test_sigterm_stops_everything(tmp_path):
    out = tmp_path / "run"
    # --swap reload: the in-place reload if serve-hf has /update_weights_from_disk, else the fallback restart
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", "100", "--swap", "reload", "--out", str(out)],
                            cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    runtime_dir = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("rolloutd up: gateway ipc://"):
                runtime_dir = str(Path(line.split("ipc://", 1)[1].strip()).parent.parent)
            if line.startswith("STEP "):
                break
        assert runtime_dir and lines and lines[-1].startswith("STEP "), "".join(lines[-50:])
        assert json.loads(lines[-1][5:])["swap"] in ("reload", "restart")
        assert processes_mentioning(str(out)), "a serve-hf should be running"
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    time.sleep(0.5)
    assert processes_mentioning(str(out), runtime_dir) == []
    assert not Path(runtime_dir).exists()
