"""Packed heartbeat listings (issue 29, docs/EVENTS.md): a holder with more than
``events.PACK_MIN`` jobs sends its [id, attempt] pairs as little-endian int64 in one msgpack bin.
The gateway (``events.parse``) and the init daemon (raw bodies into ``HeldJobs.apply``) read it as
the list form; a bin that is not whole pairs is not an event. Sub-second, no processes."""
from __future__ import annotations

import numpy as np

from rolloutd.bus import codec, events
from rolloutd.gateway.daemon import Gateway
from rolloutd.gateway.jobs import JobRecord
from rolloutd.daemons.supervisor import config_from_args


def hb(**fields):
    return [b"daemon.heartbeat", codec.pack(dict({"daemon": "run", "node": "n1", "incarnation": "i1"}, **fields))]


HELD = {10**15 + k: 1 + k % 3 for k in range(40)}  # ids as the clock makes them without a journal


def test_large_listings_are_packed_and_parse_back_to_the_same_pairs():
    packed = events.pack_listing(HELD)
    assert isinstance(packed, bytes) and len(packed) == 16 * len(HELD)
    assert events.pack_listing({1: 1, 2: 1}) == [[1, 1], [2, 1]]  # few jobs: the list form, as before
    _, body = events.parse(hb(jobs=packed, jobs_seq=1))
    assert [tuple(p) for p in body["jobs"]] == list(HELD.items())
    t = events.HeldJobs("i1")
    t.apply(body)
    assert t.jobs == HELD and t.valid
    # The init daemon applies bodies unpacked without parse: the bin itself must work there too.
    raw = codec.unpack(hb(jobs_added=events.pack_listing({7: 1} | {100 + k: 1 for k in range(20)}),
                          jobs_removed=events.pack_listing({10**15: 1} | {200 + k: 1 for k in range(20)}), jobs_seq=2)[1])
    assert t.apply(raw) is not None and 7 in t.jobs and 10**15 not in t.jobs and t.seq == 2


def test_a_packed_listing_that_is_not_whole_pairs_is_not_an_event():
    packed = events.pack_listing(HELD)
    for bad in (packed[:-8], packed[:-1], b"\x01"):
        assert events.parse(hb(jobs=bad, jobs_seq=1)) is None
        assert events.parse(hb(jobs_added=bad, jobs_removed=[], jobs_seq=2)) is None
    assert events.parse(hb(jobs=b"", jobs_seq=1)) is not None  # an empty holder


def test_the_gateway_renews_and_hands_on_jobs_from_packed_listings():
    gw = Gateway(config_from_args(None, None, ["logging.level=warning"]))
    for j, a in HELD.items():
        gw.table.add(JobRecord(j, "c", {}, attempt=a, state="dispatched", holder="init@n1#x", last_seen=0.0))
    gw._on_event(hb(jobs=events.pack_listing(HELD), jobs_seq=1))
    assert gw.malformed["events"] == 0
    assert all(gw.table.jobs[j].holder == "run@n1#i1" and gw.table.jobs[j].last_seen > 0 for j in HELD)
    assert not gw.table.unvouched  # the holder vouches for every job it listed
    gone = dict(list(HELD.items())[:20])
    gw._on_event(hb(jobs_added=[], jobs_removed=events.pack_listing(gone), jobs_seq=2))
    assert gw.table.unvouched == set(gone)  # handed on: their lease clocks restart
    assert np.array_equal(sorted(gw.held["run@n1"].jobs), sorted(set(HELD) - set(gone)))


def test_the_gateway_keeps_a_heartbeat_without_its_listing():
    """The last body of each daemon is kept for ``status``; its listing lives in ``held`` only
    (kept in the body too, 3,000 heartbeats a second filled the collector's young generation:
    docs/SCALING.md section 8)."""
    gw = Gateway(config_from_args(None, None, ["logging.level=warning"]))
    gw._on_event(hb(jobs=events.pack_listing(HELD), jobs_seq=1, pool=64))
    gw._on_event(hb(jobs_added=[[7, 1]], jobs_removed=[], jobs_seq=2, pool=64))
    body = gw.daemons["run@n1"]
    assert body["pool"] == 64 and body["jobs_seq"] == 2
    assert not {"jobs", "jobs_added", "jobs_removed"} & set(body)
    assert gw.held["run@n1"].jobs == HELD | {7: 1}


def test_heartbeats_carried_by_their_nodes_run_daemon_count_as_their_own():
    """One message per node (docs/EVENTS.md, ``carried``): the run daemon's heartbeat carries its
    node's init and eval heartbeats; the gateway reads each as that daemon's own, its listing
    renewing that daemon's jobs, and keeps none of them in the carrier's body."""
    gw = Gateway(config_from_args(None, None, ["logging.level=warning"]))
    init_jobs = dict(list(HELD.items())[:20])
    for j, a in init_jobs.items():
        gw.table.add(JobRecord(j, "c", {}, attempt=a, state="dispatched", holder=None, last_seen=0.0))
    init = {"daemon": "init", "node": "n1", "incarnation": "i2", "ts": 1.0, "jobs": events.pack_listing(init_jobs),
            "jobs_seq": 1}
    ev = {"daemon": "eval", "node": "n1", "incarnation": "i3", "ts": 1.0, "jobs": [[5, 1]], "jobs_seq": 1}
    gw._on_event(hb(jobs=[], jobs_seq=1, carried=[init, ev]))
    assert gw.malformed["events"] == 0
    assert {"run@n1", "init@n1", "eval@n1"} <= set(gw.daemons) and "carried" not in gw.daemons["run@n1"]
    assert gw.held["init@n1"].jobs == init_jobs and gw.held["eval@n1"].jobs == {5: 1}
    assert all(gw.table.jobs[j].holder == "init@n1#i2" and gw.table.jobs[j].last_seen > 0 for j in init_jobs)
    # the next one carries init's changes: applied in its own sequence
    gone = dict(list(init_jobs.items())[:5])
    init2 = dict(init, jobs_seq=2, jobs_added=[], jobs_removed=events.pack_listing(gone))
    del init2["jobs"]
    gw._on_event(hb(jobs=[], jobs_seq=2, carried=[init2]))
    assert gw.held["init@n1"].jobs == {j: a for j, a in init_jobs.items() if j not in gone}
    assert gw.table.unvouched == set(gone)


def test_a_carried_heartbeat_from_elsewhere_is_dropped():
    """A daemon vouches only for its own node's daemons, never in its own name or a router's, and
    each carried body is checked as one on the stream; the good ones beside a bad one still count."""
    gw = Gateway(config_from_args(None, None, ["logging.level=warning"]))
    good = {"daemon": "eval", "node": "n1", "incarnation": "i3", "ts": 1.0, "jobs": [[5, 1]], "jobs_seq": 1}
    bad = [dict(good, node="n2"),                     # another node's
           dict(good, daemon="run"),                  # the carrier's own name
           dict(good, daemon="router", backends=[]),  # a router's: the backends are the router's to say
           dict(good, daemon="init", jobs=b"\x01"),   # not whole pairs
           dict(good, daemon="init", jobs_added=[[1, 1]], jobs_seq=None),  # changes without their place
           "not a body"]
    gw._on_event(hb(jobs=[], jobs_seq=1, carried=bad + [good]))
    assert gw.malformed["events"] == len(bad)
    assert set(gw.daemons) == {"run@n1", "eval@n1"} and gw.held["eval@n1"].jobs == {5: 1}
    gw._on_event(hb(jobs=[], jobs_seq=2, carried={"init": good}))  # not a list
    assert gw.malformed["events"] == len(bad) + 1
