"""``rolloutd up`` supervises its daemons and leaves nothing behind."""
from __future__ import annotations

import os
import signal
import time

from tests.conftest import alive, synthetic


def test_stop_leaves_no_processes_or_ipc_files(up_factory):
    up = up_factory()
    kids = list(up.children)
    assert len(kids) == 6
    ipc = list(up.runtime_dir.glob("*.sock"))
    assert len(ipc) >= 7
    assert up.stop() == 0
    assert not [p for p in kids if alive(p)]
    assert not up.runtime_dir.exists() or not any(up.runtime_dir.iterdir())


def test_killed_daemon_is_restarted_and_the_restart_logged(up_factory):
    up = up_factory()
    victim = up.daemon_pid("eval")
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while "daemon_restarted" not in up.log():
        assert time.monotonic() < deadline, up.log()[-2000:]
        time.sleep(0.1)
    assert up.daemon_pid("eval") != victim
    with up.client() as c:  # the pipeline works again through the new eval daemon
        r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=30)
        assert r["status"] == "ok"


def test_killed_supervisor_leaves_no_orphans(up_factory):
    up = up_factory()
    kids = list(up.children)
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(5)
    deadline = time.monotonic() + 15  # PR_SET_PDEATHSIG sends them SIGTERM; they drain and exit
    while [p for p in kids if alive(p)]:
        assert time.monotonic() < deadline, [p for p in kids if alive(p)]
        time.sleep(0.1)


def test_sigterm_drains_jobs_in_flight(up_factory):
    up = up_factory()
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 1.0}) for i in range(4)])
        time.sleep(0.5)  # in the run phase now
        os.kill(up.daemon_pid("init"), signal.SIGTERM)  # an idle daemon stops at once
        results = list(c.gather(ids, timeout_s=30))
    assert sorted(r["job_id"] for r in results) == sorted(ids)
    assert all(r["status"] == "ok" for r in results)
