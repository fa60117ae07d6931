"""Daemons log JSON lines (structlog) on stderr when it is not a terminal (systemd, srun)."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .helpers import rolloutd_bin


def run_daemon(name: str) -> tuple[str, str, int]:
    """Start one daemon, stop it with SIGTERM once it said it started (on stderr, or on stdout
    when the logging set-up regressed), return (stdout, stderr, rc)."""
    d = Path(tempfile.mkdtemp(prefix="rtd-log-"))
    try:
        p = subprocess.Popen([rolloutd_bin(), name, "--runtime-dir", str(d), "--set", "node=lognode",
                              "--set", "daemon.heartbeat_s=0.2"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        try:
            early = {p.stdout: b"", p.stderr: b""}
            deadline = time.monotonic() + 60
            while not any(b"daemon_started" in v for v in early.values()) and time.monotonic() < deadline:
                ready, _, _ = select.select(list(early), [], [], 1.0)
                for f in ready:
                    early[f] += os.read(f.fileno(), 65536)
                if p.poll() is not None:
                    break
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=20)
            out, err = early[p.stdout] + out, early[p.stderr] + err
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=5)
        return out.decode(), err.decode(), p.returncode
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("name", ["events", "router"])
def test_daemon_stderr_is_json_with_daemon_and_node(name):
    out, err, rc = run_daemon(name)
    assert rc == 0, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, f"nothing on stderr; stdout was:\n{out}"
    events = []
    for ln in lines:
        rec = json.loads(ln)            # every line is one JSON object
        assert rec["daemon"] == name and rec["node"] == "lognode", rec
        assert "timestamp" in rec and "level" in rec
        events.append(rec["event"])
    assert "daemon_started" in events and "daemon_stopped" in events
    assert out.strip() == "", f"stdout should stay empty, got:\n{out}"
