"""Gateway requests are bounded by work, not only bytes (issue 38, item 3): a request that would
hold the gateway's loop for seconds is refused by count with a clear error (cancel, submit, any
request holding too many values to decode) or cut (poll), and the largest request each bound lets
through is answered whole, worked through in slices (submit, cancel) while other requests are
answered. Before issue 38 a cancel naming 1,000,000 unknown ids (within max_request_bytes) took
16 s with a journal and the gateway was presumed dead. What each worst request costs the loop is
measured in bench/bench_gateway_requests.py (docs/PROTOCOL.md, "Bounds"). Real ``rolloutd up``
with a journal, except where a test says otherwise.
"""
from __future__ import annotations

import os
import signal
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


STATUS = {"kind": "status"}


def test_the_largest_submits_are_made_in_slices_and_other_requests_are_answered_meanwhile(up_factory, tmp_path):
    """4,096 one-sample tasks, and one task of n=4,096: checked, then made and journalled, 512 a
    loop turn, answered after the last (before, either was one turn of 70-215 ms). A status sent
    after either on the same DEALER is answered first; the jobs are all there, each once."""
    up = up_factory(f"gateway.journal={tmp_path}/j.db")
    with up.client() as c:
        c.pause()
        cid = c.client_id
        many = {"kind": "submit", "client_id": cid, "tasks": [synthetic(i) for i in range(4096)]}
        one = {"kind": "submit", "client_id": cid, "tasks": [dict(synthetic(0), n=4096)]}
        for big in (many, one):
            replies = in_order(up, big, STATUS)
            assert [r["req_id"] for r in replies] == [2, 1], [(r["req_id"], r["kind"]) for r in replies]
            assert replies[1]["kind"] == "reply" and len(replies[1]["body"]["job_ids"]) == 4096
        st = c.status()
        assert st["queued"] == 8192 and st["totals"]["submitted"] == 8192


def test_a_retry_while_the_submit_is_being_made_gets_the_same_jobs(up_factory, tmp_path):
    """Same (client_id, idempotency_key) while the first try is still in slices: answered with the
    first's job ids (duplicate) when the first is, and nothing is made twice."""
    up = up_factory(f"gateway.journal={tmp_path}/j.db")
    with up.client() as c:
        c.pause()
        sub = {"kind": "submit", "client_id": c.client_id, "idempotency_key": "k1",
               "tasks": [synthetic(i) for i in range(4096)]}
        status, *subs = in_order(up, sub, sub, STATUS)
        assert status["req_id"] == 3 and status["body"]["totals"].get("submitted", 0) == 0  # answered meanwhile
        a, b = sorted(subs, key=lambda r: r["req_id"])
        assert a["body"]["job_ids"] == b["body"]["job_ids"] and len(set(a["body"]["job_ids"])) == 4096
        assert (a["body"]["duplicate"], b["body"]["duplicate"]) == (False, True)
        again = c.request(Submit(client_id=c.client_id, idempotency_key="k1", tasks=[synthetic(0)]))
        assert again == {"job_ids": a["body"]["job_ids"], "duplicate": True}
        assert c.status()["totals"]["submitted"] == 4096


def test_a_submit_refused_in_its_last_slice_makes_nothing(up_factory, tmp_path):
    """Every task is checked before any job is made: a bad last task (checked in the eighth slice)
    refuses the whole submit, its retry included, and nothing is queued or journalled."""
    up = up_factory(f"gateway.journal={tmp_path}/j.db")
    with up.client() as c:
        c.pause()
        tasks = [synthetic(i) for i in range(4095)] + [{"handler": "nope", "instance": {}}]
        sub = {"kind": "submit", "client_id": c.client_id, "idempotency_key": "k2", "tasks": tasks}
        replies = in_order(up, sub, sub, STATUS)
        assert replies[0]["req_id"] == 3  # the status, first
        for r in replies[1:]:
            assert r["kind"] == "error" and r["code"] == "unknown_handler" and "tasks[4095]" in r["message"], r
        over = {"kind": "submit", "client_id": c.client_id, "tasks": [dict(synthetic(0), n=4096), synthetic(1)]}
        (r,) = in_order(up, over)
        assert r["code"] == "invalid" and "4097 jobs" in r["message"]
        st = c.status()
        assert st["queued"] == 0 and st["totals"].get("submitted", 0) == 0
        ok = c.submit([synthetic(0)], idempotency_key="k2")  # the key was not taken by the refused submit
        assert c.status()["totals"]["submitted"] == 1 and len(ok) == 1
    import sqlite3
    db = sqlite3.connect(f"file:{tmp_path}/j.db?mode=ro", uri=True)
    try:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 1
        assert db.execute("SELECT COUNT(*) FROM open_submits").fetchone()[0] == 0
    finally:
        db.close()


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


def test_a_task_run_many_times_keeps_one_instance_in_the_journal_and_across_a_restart(up_factory, tmp_path):
    """One task of n=512 with a 256 KiB instance: the journal stores the instance once (per job it
    wrote 128 MiB), a gateway killed with the jobs queued recovers them sharing it, and every job
    runs with it."""
    up = up_factory(f"gateway.journal={tmp_path}/j.db")
    seed = "s" * (256 << 10)
    with up.client(timeout_s=5.0, retries=10) as c:
        c.pause()
        ids = c.submit([{"handler": "synthetic", "instance": {"seed": seed, "reward": 0.25}, "n": 512}])
        size = sum(p.stat().st_size for p in tmp_path.glob("j.db*"))
        assert size < 16 << 20, f"journal {size >> 20} MiB for one 256 KiB instance"
        victim = up.daemon_pid("gateway")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _restarted(up, victim), 60, "the gateway restarted")
        c.resume()
        got = {r["job_id"]: r for r in c.gather(ids, timeout_s=180)}
    assert sorted(got) == sorted(ids)
    assert {(r["status"], r["reward"]) for r in got.values()} == {("ok", 0.25)}


def _restarted(up, victim) -> bool:
    try:
        return up.daemon_pid("gateway") != victim
    except LookupError:
        return False


def test_a_submit_cut_off_part_way_is_rolled_back_at_recovery(tmp_path):
    """A gateway that stops between two slices of a submit (kill -9: the rows of the slices done
    are committed) never answered it: recovery deletes those rows (and the task's stored
    instance), so the client's retry makes the jobs once. The real gateway and journal, in-process,
    stopped at a chosen slice."""
    from rolloutd.bus.config import Config
    from rolloutd.bus.messages import from_wire
    from rolloutd.gateway.daemon import Gateway

    cfg = Config({"gateway": {"journal": str(tmp_path / "j.db")}})
    g = Gateway(cfg)
    g._recover()
    g.submits.start([b"r"], from_wire({"v": 1, "kind": "submit", "client_id": "c", "idempotency_key": "k",
                                       "tasks": [dict(synthetic(0), n=3000), synthetic(1)]}))
    while not g.submits.queue[0].made:  # the tasks checked, then the first jobs made
        g.submits.work()
        assert g.journal.commit()
    made = len(g.submits.queue[0].made)
    assert 0 < made < 3001 and not g.table.jobs and not g.replies  # part-way: nothing answered, nothing in the table
    db = g.journal.db
    assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == made
    assert db.execute("SELECT COUNT(*) FROM instances").fetchone()[0] == 1
    db.close()  # the process dies here

    g2 = Gateway(cfg)
    g2._recover()
    db = g2.journal.db
    assert [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("jobs", "instances", "open_submits")] == [0, 0, 0]
    assert not g2.table.jobs and not g2.table.idem
    g2.submits.start([b"r"], from_wire({"v": 1, "kind": "submit", "client_id": "c", "idempotency_key": "k",
                                        "tasks": [dict(synthetic(0), n=3000), synthetic(1)]}))
    while g2.submits:
        g2.submits.work()
        assert g2.journal.commit()
    assert len(g2.table.jobs) == 3001 and db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 3001
    g2.journal.close()


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
