"""Gateway requests are bounded by work, not only bytes (issue 38, item 3): a request that would
hold the gateway's loop for seconds is refused by count with a clear error (cancel, submit) or
cut (poll), and the largest request each bound lets through is answered whole. Before issue 38 a
cancel naming 1,000,000 unknown ids (within max_request_bytes) took 16 s with a journal and the
gateway was presumed dead. What each worst request costs the loop is measured in
bench/bench_gateway_requests.py (docs/PROTOCOL.md, "Bounds"). Real ``rolloutd up`` with a journal.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rolloutd.bus import codec
from rolloutd.bus.messages import Cancel, Submit
from rolloutd.bus.sockets import Sockets
from rolloutd.gateway.client import GatewayError

from tests.conftest import synthetic, wait_for


def in_order(up, *requests: dict) -> list[dict]:
    """Send ``requests`` back to back on one DEALER; their replies in the order they came."""
    with Sockets(asyncio=False, linger_ms=0) as s:
        d = s.connect("DEALER", up.gateway)
        for req_id, body in enumerate(requests, 1):
            d.send_multipart([b""] + codec.encode(dict({"v": 1, "req_id": req_id}, **body)))
        replies = []
        for _ in requests:
            assert d.poll(120_000), f"no reply after {[r['req_id'] for r in replies]}"
            replies.append(codec.decode(d.recv_multipart()[1:]))
    return replies


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_over_the_caps_refused_with_the_cap_named_and_nothing_applied(up_factory, tmp_path):
    up = up_factory(f"gateway.journal={tmp_path}/j.db", "gateway.max_request_ids=100",
                    "gateway.max_request_jobs=50", "gateway.max_poll_results=5")
    with up.client() as c:
        with pytest.raises(GatewayError) as e:
            c.submit([dict(synthetic(0), n=26), dict(synthetic(1), n=25)])
        assert e.value.code == "invalid" and "51 jobs" in str(e.value) and "gateway.max_request_jobs" in str(e.value)
        assert c.status()["totals"].get("submitted", 0) == 0  # nothing created
        ids = c.submit([dict(synthetic(0), n=25), dict(synthetic(1), n=25)])  # at the cap: accepted
        assert len(ids) == 50

        with pytest.raises(GatewayError) as e:  # the client splits at the default cap (1,000): ask directly
            c.request(Cancel(job_ids=ids + list(range(10**15, 10**15 + 51))))
        assert e.value.code == "invalid" and "101 entries" in str(e.value) and "gateway.max_request_ids" in str(e.value)
        with pytest.raises(GatewayError) as e:
            c.request(Submit(client_id=c.client_id, tasks=[synthetic(i) for i in range(51)]))
        assert e.value.code == "invalid" and "51 entries" in str(e.value) and "gateway.max_request_jobs" in str(e.value)
        got = {}
        def drained():
            got.update({r["job_id"]: r for r in c.poll(max_results=1000)})
            return len(got) == 50
        wait_for(drained, 60, "50 results")
        assert all(r["status"] == "ok" for r in got.values())  # the refused cancel cancelled none
        assert c.poll() == []  # acknowledges the last of them

        # poll: max_results beyond max_poll_results is cut, the rest stays ready
        more = c.submit([dict(synthetic(2), n=8)])
        wait_for(lambda: c.status()["done_unacked"] == 8, 60, "8 results ready")
        first = c.poll(max_results=1000)
        assert len(first) == 5 and c.poll(max_results=1000) and len({r["job_id"] for r in first} & set(more)) == 5


def test_the_largest_cancel_of_unknown_and_acknowledged_ids_is_answered_whole(up_factory, tmp_path):
    """At the default cap (10,000 ids) with a journal: one batched journal lookup per 500 ids
    instead of a commit and a query per id, 256 ids per loop turn."""
    up = up_factory(f"gateway.journal={tmp_path}/j.db")
    with up.client() as c:
        done = c.submit([synthetic(i) for i in range(20)])
        got = []
        wait_for(lambda: got.extend(c.poll(max_results=100)) or len(got) == 20, 60, "20 results")
        c.poll()  # acknowledges them: the gateway keeps only their journal rows
        unknown = list(range(10**15, 10**15 + 10000 - len(done) - 1)) + [2**64 - 1]
        r = c.request(Cancel(job_ids=done + unknown))["jobs"]
        assert len(r) == 10000
        assert all(r[str(j)] == "already_finished" for j in done), r
        assert all(r[str(j)] == "not_found" for j in unknown)
        with pytest.raises(GatewayError) as e:
            c.request(Cancel(job_ids=unknown + done + [1]))
        assert e.value.code == "invalid"
        assert len(c.cancel(unknown * 3)) == len(unknown)  # the client splits what is over the cap


def test_a_large_cancel_lets_other_requests_through_and_dispatches_none_of_its_jobs(up_factory):
    """A cancel is answered after its last slice, other requests meanwhile (before issue 38 the
    gateway answered nothing else until the whole cancel was done). A cancelled queued job is left
    in the dispatch queue and skipped (removing each one walked the whole queue)."""
    up = up_factory()
    with up.client() as c:
        c.pause()
        ids = c.submit([dict(synthetic(0), n=4096), dict(synthetic(1), n=4096)])
        keep = c.submit([synthetic(2)])
        # One DEALER: the cancel of 8,192 queued jobs, then a status. The cancel is worked through
        # 256 ids per loop turn, so the status (answered in its turn) comes back first.
        with Sockets(asyncio=False, linger_ms=0) as s:
            d = s.connect("DEALER", up.gateway)
            d.send_multipart([b""] + codec.encode({"v": 1, "kind": "cancel", "req_id": 1, "job_ids": ids}))
            d.send_multipart([b""] + codec.encode({"v": 1, "kind": "status", "req_id": 2}))
            replies = []
            for _ in range(2):
                assert d.poll(60000), "no reply"
                replies.append(codec.decode(d.recv_multipart()[1:]))
        assert [x["req_id"] for x in replies] == [2, 1], [(x["req_id"], x["kind"]) for x in replies]
        r = replies[1]["body"]["jobs"]
        assert set(r.values()) == {"cancelled"} and len(r) == 8192
        c.resume()
        got = {}
        wait_for(lambda: got.update({x["job_id"]: x for x in c.poll(max_results=1024)}) or len(got) == 8193, 120,
                 "every result")
        assert {got[j]["status"] for j in ids} == {"cancelled"} and got[keep[0]]["status"] == "ok"
        assert all("init" not in got[j]["timing"] for j in ids)  # none of them reached a daemon


def test_requests_too_costly_to_decode_are_refused_before_they_are_built(up_factory):
    """Bytes do not bound a decode: 15 MiB of empty maps are 15 million objects (seconds and a
    GiB of the gateway's memory to build). Refused ``too_large`` naming gateway.max_request_values,
    the request's req_id echoed, the gateway's peak memory barely moved; so is a cancel of
    1,000,000 ids (refused from its list header, no id built) and the shipped client gets the error."""
    up = up_factory()
    pid = up.daemon_pid("gateway")
    with up.client() as c:
        before = peak_rss_mb(pid)
        maps = {"kind": "submit", "client_id": "x", "tasks": [{"handler": "synthetic", "instance": {
            "m": [[{}] * 1000 for _ in range(15000)]}}]}
        (r,) = in_order(up, maps)
        assert r["kind"] == "error" and r["code"] == "too_large" and r["req_id"] == 1, r
        assert "gateway.max_request_values" in r["message"] and "numpy" in r["message"]
        with pytest.raises(GatewayError) as e:
            c.request(Cancel(job_ids=list(range(10**15, 10**15 + 10**6))))
        assert e.value.code == "too_large" and "1000000 entries" in e.value.message
        grown = peak_rss_mb(pid) - before
        assert grown < 150, f"the gateway's peak memory grew {grown:.0f} MB"
        assert c.status()["malformed"]["requests"] == 2


def test_the_client_splits_a_submit_by_values_the_gateway_would_refuse_whole(up_factory):
    """4,096 tasks of ten-message instances hold ~660k values, over gateway.max_request_values:
    sent as one request it is refused ``too_large`` (and the shipped client gets that error back,
    not a timeout: its req_id is read from the header's first entries); ``submit`` splits it."""
    up = up_factory()
    msgs = [{"role": "user", "content": "x"}] * 10
    tasks = [{"handler": "synthetic", "instance_id": f"d{i}", "instance": {"messages": msgs}} for i in range(4096)]
    with up.client(retries=0) as c:
        c.pause()
        with pytest.raises(GatewayError) as e:
            c.request(Submit(client_id=c.client_id, tasks=tasks))
        assert e.value.code == "too_large" and "gateway.max_request_values" in e.value.message
        ids = c.submit(tasks)
        assert len(set(ids)) == 4096 and c.status()["totals"]["submitted"] == 4096
