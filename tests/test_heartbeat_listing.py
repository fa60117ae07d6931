"""Heartbeats that list changes instead of every held job (issue 16, docs/PROTOCOL.md).

The listing rules (events.HeldJobs) on their own, then a real ``rolloutd up`` forced to send
changes only (``daemon.full_listing_max=0``, a full listing only every 60 s) with a lease
timeout shorter than the jobs: the gateway must keep jobs alive from a holder's rebuilt set
(a job listed once and never removed), not only from the jobs a heartbeat names. Without
``Gateway._still_held`` the jobs are re-dispatched at the lease timeout (checked by disabling
the call: the lease test fails with 12 re-dispatches for 6 jobs).
"""
from __future__ import annotations

import os
import signal

from rolloutd.bus import codec, events

from tests.conftest import synthetic


def hb(**fields):
    return [b"daemon.heartbeat", codec.pack(dict({"daemon": "run", "node": "n1"}, **fields))]


def test_changes_rebuild_the_set_and_a_gap_invalidates_it_until_a_full_listing():
    t = events.HeldJobs("inc-1")
    assert t.apply(events.parse(hb(jobs=[[1, 1], [2, 1]], jobs_seq=1))[1]) == [[1, 1], [2, 1]]
    assert t.apply(events.parse(hb(jobs_added=[[3, 1]], jobs_removed=[[1, 1]], jobs_seq=2))[1]) == [[3, 1]]
    assert t.jobs == {2: 1, 3: 1} and t.valid
    # A removal of another attempt does not remove the current one.
    t.apply(events.parse(hb(jobs_added=[], jobs_removed=[[2, 7]], jobs_seq=3))[1])
    assert t.jobs == {2: 1, 3: 1}
    # seq 4 was dropped on the stream: the set is stale until the next full listing.
    assert t.apply(events.parse(hb(jobs_added=[[9, 1]], jobs_removed=[], jobs_seq=5))[1]) is None
    assert not t.valid and 9 not in t.jobs
    assert t.apply(events.parse(hb(jobs_added=[[9, 1]], jobs_removed=[], jobs_seq=6))[1]) is None
    assert t.apply(events.parse(hb(jobs=[[9, 1]], jobs_seq=7))[1]) == [[9, 1]]
    assert t.valid and t.jobs == {9: 1}


def test_malformed_listings_are_not_events():
    assert events.parse(hb(jobs_added=[[1, 1]], jobs_removed=[])) is None            # no jobs_seq
    assert events.parse(hb(jobs_added=[[1, "1"]], jobs_removed=[], jobs_seq=2)) is None
    assert events.parse(hb(jobs_removed=[1], jobs_seq=2)) is None
    assert events.parse(hb(jobs=[[1, 1]], jobs_added=[[2, 1]], jobs_seq=2)) is None  # both at once
    assert events.parse(hb(jobs=[[1, 1]], jobs_seq="2")) is None
    assert events.parse(hb(jobs=[[1, 1]])) is not None                                 # the old form


def test_jobs_outliving_the_lease_are_not_redispatched_when_heartbeats_carry_changes(up_factory):
    up = up_factory("daemon.full_listing_max=0", "daemon.full_listing_s=60", "gateway.lease_timeout_s=3",
                    "run.pool=4")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 6.0}) for i in range(6)])
        results = c.gather(ids, timeout_s=120)
        assert sorted(r["job_id"] for r in results) == sorted(ids)
        assert all(r["status"] == "ok" and r["attempts"] == 1 for r in results), [
            (r["job_id"], r["status"], r["attempts"]) for r in results]
        assert c.status()["totals"].get("redispatched", 0) == 0, (
            up.logged("job_redispatched"), up.logged("heartbeat_gap"), up.logged("daemon_presumed_dead"))


def test_a_killed_holder_listed_by_changes_has_its_jobs_redispatched(up_factory):
    """Re-dispatch on holder death: the gateway knows what the dead run daemon held from its
    rebuilt set, and every job still completes exactly once."""
    up = up_factory("daemon.full_listing_max=0", "daemon.full_listing_s=60", "run.pool=4")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 3.0}) for i in range(6)])
        with events.Subscriber(up.events, ["daemon.heartbeat"]) as sub:
            while True:  # until a change-only heartbeat of run lists something
                ev = sub.next(30)
                assert ev is not None, "no heartbeat"
                if ev[1].get("daemon") == "run" and ev[1].get("jobs_added"):
                    pid = ev[1]["pid"]
                    break
        os.kill(pid, signal.SIGKILL)
        results = c.gather(ids, timeout_s=180)
        assert sorted(r["job_id"] for r in results) == sorted(ids)
        assert all(r["status"] == "ok" for r in results), [(r["job_id"], r["status"]) for r in results]
        assert c.status()["totals"].get("redispatched", 0) >= 1
