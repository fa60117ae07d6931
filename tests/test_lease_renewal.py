"""Lease renewal by ``run.leases`` listings: what a run daemon lists lives, what it stops listing or
never listed expires ``lease_ttl_s`` after its last renewal, and the packed form of the listing
carries the same rows as the list form (docs/EVENTS.md, ``run.leases``)."""
from __future__ import annotations

import time

import msgpack
import pytest

from rolloutd.bus import codec
from rolloutd.daemons import lease_rows
from rolloutd.daemons.routing import Pool

TTL = 30.0


def pool():
    p = Pool("least_inflight")
    for i in range(2):
        p.add(f"http://b{i}", capacity=0)
        p.mark(f"http://b{i}", True)
    return p


def test_listed_leases_live_and_what_a_requester_leaves_out_expires_a_ttl_after_its_last_listing():
    p, t = pool(), time.monotonic()
    a = [p.lease(j, requester="run@n1").lease_id for j in range(4)]
    p.vouch("run@n1", set(a), now=t + 20)
    late = p.lease(9, requester="run@n1")  # granted after that listing
    late.created = late.renewed = t + 21
    late = late.lease_id
    assert p.expire(TTL, now=t + 45) == [] and len(p.leases) == 5
    # The next listing leaves a[0] out (released on its side, the release lost) and never lists `late`.
    p.vouch("run@n1", set(a[1:]), now=t + 40)
    assert p.expire(TTL, now=t + 49.5) == []
    assert [r.lease_id for r in p.expire(TTL, now=t + 50.5)] == [a[0]]  # last listed at t+20
    assert [r.lease_id for r in p.expire(TTL, now=t + 51.5)] == [late]  # granted at t+21, never listed
    assert set(p.leases) == set(a[1:])
    assert p.expire(TTL, now=t + 69) == []  # listed at t+40: renewed until t+70
    gone = p.expire(TTL, now=t + 71)  # the requester went silent: its last listing was at t+40
    assert sorted(r.lease_id for r in gone) == sorted(a[1:]) and p.leases == {}
    assert all(b.inflight == 0 for b in p.backends.values())


def test_a_requester_does_not_renew_another_requesters_lease():
    p, t = pool(), time.monotonic()
    mine = p.lease(1, requester="run@n1").lease_id
    theirs = p.lease(2, requester="run@n2").lease_id
    assert p.vouch("run@n1", {mine, theirs}, now=t + 25) == {theirs}  # not held by n1: the caller decides
    assert [r.lease_id for r in p.expire(TTL, now=t + 31)] == [theirs]
    assert set(p.leases) == {mine}


def test_a_lease_released_then_listed_by_a_stale_snapshot_is_not_held_again():
    p, t = pool(), time.monotonic()
    lid = p.lease(1, requester="run@n1").lease_id
    p.release(lid)
    assert p.vouch("run@n1", {lid}, now=t + 1) == {lid}
    p.adopt(lid, "http://b0", 1, "run@n1", 0)  # what the router does with ids it does not hold
    assert p.leases == {} and p.backends["http://b0"].inflight == 0


def test_leases_of_a_requester_that_never_lists_expire_a_ttl_after_their_grant():
    p, t = pool(), time.monotonic()
    lid = p.lease(1, requester="").lease_id  # a raw client's single lease message
    assert p.expire(TTL, now=t + 29) == []
    assert [r.lease_id for r in p.expire(TTL, now=t + 31)] == [lid]


def _rows(n):
    return [[f"L7-{i}", f"http://b{i % 3}", 1000 + i, i % 2] for i in range(n)]


@pytest.mark.parametrize("n", [0, 3, lease_rows.PACK_MIN, lease_rows.PACK_MIN + 1, 512])
def test_packed_and_listed_rows_read_the_same_after_the_wire(n):
    rows = _rows(n)
    field = lease_rows.pack(rows)
    assert isinstance(field, dict) == (n > lease_rows.PACK_MIN)
    got = lease_rows.unpack(codec.unpack(codec.pack({"leases": field}))["leases"])
    assert got.ids == [r[0] for r in rows]
    assert [list(got.row(i)) for i in range(n)] == [r[1:] for r in rows]


def test_an_id_with_a_newline_is_sent_as_rows():
    rows = _rows(40)
    rows[5][0] = "L7-\n5"
    assert lease_rows.pack(rows) == rows


@pytest.mark.parametrize("field", [
    {"ids": "a\nb", "backends": ["x"], "rows": b"\0" * 47},             # not one row per id
    {"ids": "a\nb", "backends": "x", "rows": b"\0" * 48},               # backends not a list
    {"ids": ["a", "b"], "backends": ["x"], "rows": b"\0" * 48},         # ids not one string
    {"ids": "a\nb", "backends": [1], "rows": b"\0" * 48},
    "L1-1",
])
def test_a_malformed_leases_field_is_ignored(field):
    assert lease_rows.unpack(field) is None


def test_a_row_naming_a_backend_past_the_table_is_not_adopted():
    field = lease_rows.pack(_rows(20))
    raw = bytearray(field["rows"])
    raw[0:8] = (99).to_bytes(8, "little")
    got = lease_rows.unpack(dict(field, rows=bytes(raw)))
    assert got.row(0) is None and got.row(1) == ("http://b1", 1001, 1)


def test_list_rows_of_the_wrong_shape_are_dropped_and_the_rest_kept():
    rows = _rows(3) + [["x", "y", "not an int", 0], ["x"], "z"]
    got = lease_rows.unpack(msgpack.unpackb(msgpack.packb(rows)))
    assert got.ids == ["L7-0", "L7-1", "L7-2"]


def test_a_silent_requester_loses_what_it_listed_a_ttl_after_the_listing_and_later_grants_a_ttl_after_theirs():
    p, t = pool(), time.monotonic()
    a = [p.lease(j, requester="run@n1").lease_id for j in range(3)]
    p.vouch("run@n1", set(a), now=t + 10)
    late = p.lease(7, requester="run@n1")
    late.created = late.renewed = t + 15
    assert p.expire(TTL, now=t + 39) == []
    assert sorted(r.lease_id for r in p.expire(TTL, now=t + 41)) == sorted(a)
    assert p.expire(TTL, now=t + 44) == []
    assert [r.lease_id for r in p.expire(TTL, now=t + 46)] == [late.lease_id]
