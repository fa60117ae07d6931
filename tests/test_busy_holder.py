"""A busy holder is not a dead one (issue 31): a daemon whose loop is late but whose liveness
thread still publishes ``daemon.busy`` keeps its jobs past ``daemon_dead_s`` and the lease, up
to a loop lag of ``daemon_hung_s``; past that, or silent altogether, it is presumed dead as
before. Real head daemons (events, router, gateway) with a scripted holder (the harness of
tests/test_heartbeat_listing.py). On the code before ``daemon.busy`` the job was re-dispatched
~2 s into the busy period ("went silent"). Wall time ~25 s.
"""
from __future__ import annotations

import time

from rolloutd.bus import codec
from rolloutd.gateway.client import RolloutClient

from tests.test_heartbeat_listing import head  # noqa: F401 - the fixture

_ = head


def busy(h, lag: float, daemon: str = "init") -> None:
    body = {"daemon": daemon, "node": "sim", "pid": 1, "incarnation": "i1", "ts": time.time(), "loop_lag_s": lag}
    h.pub.send_multipart([b"daemon.busy", codec.pack(body)])


def test_a_busy_holder_keeps_its_jobs_until_its_loop_lag_passes_daemon_hung_s(head):  # noqa: F811
    h = head("gateway.daemon_dead_s=2", "gateway.lease_timeout_s=3", "gateway.daemon_hung_s=8")
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c)
        h.pump(1.0, {"init": {"jobs": [job]}})
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6.0:  # heartbeats stop; the liveness thread reports the lag
            busy(h, 1.0 + time.monotonic() - t0)
            h.pump(0.5, {})
        assert h.redispatched() == [], h.redispatched()  # past daemon_dead_s (2) and the lease (3)
        assert any(d["daemon"] == "init" for d in c.status()["daemons"])
        while time.monotonic() - t0 < 12.0:  # the lag passes daemon_hung_s: hung, treated as dead
            busy(h, 1.0 + time.monotonic() - t0)
            h.pump(0.5, {})
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and r["attempt"] == 2, r
        gw = (h.dir / "gateway.log").read_text(errors="replace")
        assert "daemon_busy" in gw and "daemon_presumed_dead" in gw, gw
