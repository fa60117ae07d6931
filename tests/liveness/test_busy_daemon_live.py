"""A busy daemon is not a dead one, through a real ``rolloutd up`` (issue 38, item 1): a run
daemon whose event loop a handler blocks for longer than ``daemon_dead_s`` and the lease keeps
every job it holds, because its liveness thread publishes ``daemon.busy`` on the real events
stream. Until issue 38 the liveness thread published through the daemon's asyncio sockets from
a plain thread and died at its first try ("There is no current event loop in thread
'liveness'"): nothing reached the stream, the run daemon was presumed dead and its jobs ran
again. Wall time ~25 s.
"""
from __future__ import annotations

import time

from rolloutd.bus.events import Subscriber

from tests.conftest import synthetic

STALL_S = 9.0  # > daemon_dead_s (3) + a heartbeat, and > lease_timeout_s (4)


def test_a_stalled_run_daemon_publishes_daemon_busy_and_keeps_its_jobs(loop_staller_entry_point, up_factory):
    up = up_factory("daemon.heartbeat_s=0.5", "gateway.daemon_dead_s=3", "gateway.lease_timeout_s=4",
                    "gateway.daemon_hung_s=30")
    with Subscriber(up.events, ["daemon.busy", "job.redispatched"]) as sub, up.client() as c:
        # Neighbours in the run phase for the whole stall, then the job that blocks the loop.
        ids = c.submit([synthetic(i, run=2.0) for i in range(3)])
        ids += c.submit([{"handler": "loop_staller", "instance": {"stall_s": STALL_S}}])
        busy, redispatched, results = [], [], {}
        deadline = time.monotonic() + STALL_S + 60
        while len(results) < len(ids) and time.monotonic() < deadline:
            ev = sub.next(0.2)
            while ev is not None:
                (busy if ev[0] == "daemon.busy" else redispatched).append(ev[1])
                ev = sub.next(0)
            for r in c.poll(wait_s=0.2):
                results[r["job_id"]] = r
        assert sorted(results) == sorted(ids), f"missing results: {set(ids) - set(results)}\n{up.log()[-3000:]}"
        assert redispatched == [], ([r.get("cause") for r in redispatched], busy)
        for r in results.values():
            assert r["status"] == "ok" and r["attempts"] == 1, r
        run_busy = [b for b in busy if b["daemon"] == "run"]
        assert run_busy, f"no daemon.busy from the stalled run daemon: {busy}\n{up.log()[-3000:]}"
        assert max(b["loop_lag_s"] for b in run_busy) > 3.0, run_busy  # past daemon_dead_s, still alive
    assert not up.logged("daemon_presumed_dead"), up.logged("daemon_presumed_dead")
    assert up.logged("daemon_busy"), "the gateway never judged the run daemon busy"
    assert "no current event loop" not in up.log()
