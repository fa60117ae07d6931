"""Fixtures of the ops tests (issue 8): a local `rolloutd up`, process tracking, namespaces."""
from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from .helpers import PY, Procs, rolloutd_bin


@pytest.fixture
def procs():
    with Procs() as p:
        yield p


@pytest.fixture(scope="session")
def session_procs():
    with Procs() as p:
        yield p


@pytest.fixture(scope="session")
def local_up(session_procs):
    """A one-machine deployment (`rolloutd up` over ipc://) shared by the monitor and exporter tests."""
    from rolloutd.daemons.supervisor import wait_ready

    d = Path(tempfile.mkdtemp(prefix="rtd-ops-"))
    rt = d / "rt"
    log = d / "up.log"
    proc = session_procs.start([rolloutd_bin(), "up", "--runtime-dir", str(rt), "--set", "daemon.heartbeat_s=0.3",
                               "--set", "daemon.drain_s=2"], name="rolloutd-up", log_path=log)
    try:
        wait_ready(f"ipc://{rt}/gateway.sock", timeout_s=30)
    except Exception:
        proc.stop()
        raise RuntimeError(f"rolloutd up did not come up:\n{log.read_text()[-3000:]}")
    info = {"dir": d, "runtime_dir": rt, "gateway": f"ipc://{rt}/gateway.sock",
            "events": f"ipc://{rt}/events_out.sock", "proc": proc, "log": log}
    yield info
    proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def python():
    return PY
