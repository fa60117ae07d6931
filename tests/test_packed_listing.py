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
