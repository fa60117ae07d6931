"""The gateway's job table keeps its per-state counts as jobs move (no walk of the table per
heartbeat): after any sequence of submits, dispatches, re-queues, results, acks and dropped
clients, counts() equals a recount of the table."""
from __future__ import annotations

import collections
import random

import pytest

from rolloutd.gateway.jobs import JobRecord, JobTable


def recount(t: JobTable) -> dict:
    by = collections.Counter(r.state for r in t.jobs.values())
    return {"queued": by["queued"], "dispatched": by["dispatched"], "done_unacked": by["done"]}


@pytest.mark.parametrize("seed", range(20))
def test_counts_follow_every_state_change(seed):
    rng = random.Random(seed)
    t = JobTable()
    next_id = 1
    for _ in range(400):
        op = rng.choice(["submit", "submit", "dispatch", "requeue", "finish", "ack", "drop", "recover"])
        cid = rng.choice(["a", "b", "c"])
        by_state = collections.defaultdict(list)
        for r in t.jobs.values():
            by_state[r.state].append(r)
        if op == "submit":
            t.add(JobRecord(next_id, cid, {}))
            next_id += 1
        elif op == "recover":  # a result recovered from the journal, with its old sequence number
            c = t.client(cid)
            rec = JobRecord(next_id, cid, {}, state="done", seq=c.next_seq)
            c.next_seq += 1
            t.add(rec)
            next_id += 1
        elif op == "dispatch" and by_state["queued"]:
            t.dispatch(rng.choice(by_state["queued"]))
        elif op == "requeue" and by_state["dispatched"]:
            t.requeue(rng.choice(by_state["dispatched"]))
        elif op == "finish" and (by_state["dispatched"] or by_state["queued"]):
            rec = rng.choice(by_state["dispatched"] + by_state["queued"])
            if rec.job_id in t.queue:
                t.queue.remove(rec.job_id)   # the gateway's cancel-while-queued path
            t.finish(rec, [b"r"], "ok")
        elif op == "ack" and cid in t.clients:
            c = t.clients[cid]
            t.ack(cid, rng.randint(c.acked, c.next_seq))
        elif op == "drop" and cid in t.clients and not t.clients[cid].pending:
            t.drop_results(cid)
        assert t.counts() == recount(t), (seed, op)
    assert sum(t.counts().values()) == len(t.jobs)


def test_dispatched_jobs_start_unvouched_and_forgotten_ones_leave():
    """The lease sweep walks ``unvouched`` only: every dispatched job enters it (also one recovered
    from the journal in flight), and a forgotten job leaves it."""
    t = JobTable()
    a, b = JobRecord(1, "c", {}), JobRecord(2, "c", {}, state="dispatched")
    t.add(a)
    t.add(b)
    assert t.unvouched == {2}
    t.dispatch(a)
    assert t.unvouched == {1, 2}
    t.finish(a, [b"r"], "ok")
    t.client("c").sent = 1
    t.ack("c", 1)
    assert t.unvouched == {2} and 1 not in t.jobs
