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


def wait_run_holds(up, n: int, timeout_s: float = 30.0):
    """Until a heartbeat of the run daemon lists ``n`` jobs (started or prefetched)."""
    from rolloutd.bus.events import Subscriber

    deadline = time.monotonic() + timeout_s
    with Subscriber(up.events, ["daemon.heartbeat"]) as sub:
        while True:
            assert time.monotonic() < deadline, f"the run daemon never listed {n} jobs"
            ev = sub.next(0.5)
            if ev is not None and ev[1].get("daemon") == "run" and len(ev[1].get("jobs", ())) == n:
                return


def test_sigterm_drains_jobs_in_flight(up_factory):
    # Slow heartbeats: when the run daemon's stop notice arrives, the jobs it handed to eval are
    # still listed as its own in the gateway's view (stale ownership). They must not be re-run.
    up = up_factory("daemon.heartbeat_s=2", "gateway.daemon_dead_s=20", "gateway.lease_timeout_s=40")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 4.0},
                                  eval={"dist": "constant", "value": 1.0}) for i in range(4)])
        wait_run_holds(up, 4)
        os.kill(up.daemon_pid("run"), signal.SIGTERM)
        results = list(c.gather(ids, timeout_s=40))
    assert sorted(r["job_id"] for r in results) == sorted(ids)
    assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
    assert [r["attempts"] for r in results] == [1, 1, 1, 1]  # drained, not re-run
    assert [e["inflight"] for e in up.logged("draining")] == [4], up.log()[-3000:]
    assert not up.logged("job_redispatched")


def test_drain_hands_back_its_prefetched_backlog(up_factory):
    # One slot and two prefetched: at SIGTERM one job runs and two wait in the backlog. The two
    # go back to the gateway at once and run again elsewhere; that is no failed attempt, so even
    # max_attempts=1 lets them finish.
    up = up_factory("run.pool=1", "run.prefetch=2", "gateway.max_attempts=1", "daemon.heartbeat_s=0.2")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 2.0}) for i in range(3)])
        wait_run_holds(up, 3)  # one running, two prefetched
        os.kill(up.daemon_pid("run"), signal.SIGTERM)
        results = list(c.gather(ids, timeout_s=40))
    assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
    assert sorted(r["attempts"] for r in results) == [1, 2, 2]  # the running one drained
    [handed] = up.logged("backlog_handed_back")
    assert len(handed["jobs"]) == 2, up.log()[-3000:]
    causes = [e["cause"] for e in up.logged("job_redispatched")]
    assert len(causes) == 2 and all("handed back unstarted by run@" in c for c in causes), causes
    assert not up.logged("drain_deadline_passed")


def test_ctrl_c_stops_daemons_in_pipeline_order_with_events_last():
    """A terminal's Ctrl-C signals the whole foreground process group. Only the supervisor may
    act on it: it stops init, run, eval, gateway, router in turn and events last, so each stop
    notice is published."""
    import shutil
    import subprocess
    import sys

    from rolloutd.bus.events import Subscriber
    from rolloutd.daemons.supervisor import wait_ready

    from tests.conftest import REPO, children_of, short_tmpdir

    rd = short_tmpdir()
    run = rd / "run"
    with open(rd / "up.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(run),
                                 "--set", "daemon.heartbeat_s=0.2"], stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=REPO,
                                start_new_session=True)  # its own group, as a shell job is
    kids: list[int] = []
    try:
        wait_ready(f"ipc://{run}/gateway.sock")
        kids = children_of(proc.pid)
        stopped = []
        with Subscriber(f"ipc://{run}/events_out.sock", ["daemon.stopped", "daemon.heartbeat"]) as sub:
            while (ev := sub.next(5.0)) is None or ev[0] != "daemon.heartbeat":
                assert proc.poll() is None  # wait until the subscription is live
            os.killpg(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 60
            while proc.poll() is None or (ev := sub.next(0.5)) is not None:
                assert time.monotonic() < deadline, "rolloutd up did not stop"
                ev = sub.next(0.2)
                if ev is not None and ev[0] == "daemon.stopped":
                    stopped.append(ev[1]["daemon"])
        assert proc.wait(5) == 0
        assert stopped == ["init", "run", "eval", "gateway", "router"], stopped
        assert not [p for p in kids if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for p in kids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(rd, ignore_errors=True)
