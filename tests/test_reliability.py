"""Nothing lost: the journal, re-dispatch, exactly-once delivery, timeouts, retention."""
from __future__ import annotations

import os
import signal
import time

from rolloutd.bus import codec
from rolloutd.bus.messages import Result, empty_trajectory
from rolloutd.bus.sockets import Sockets
from tests.conftest import synthetic


def slow(i, run=1.0, **kw):
    return synthetic(i, run={"dist": "constant", "value": run}, **kw)


def test_gateway_kill9_recovers_from_the_journal(up_factory, tmp_path):
    up = up_factory(f"gateway.journal={tmp_path}/journal.db", "run.pool=8")
    with up.client(timeout_s=3.0, retries=10) as c:
        ids = c.submit([slow(i, run=0.2 + 0.05 * (i % 10)) for i in range(60)])
        got = []
        while len(got) < 10:
            got += c.poll(wait_s=1.0)
        victim = up.daemon_pid("gateway")
        os.kill(victim, signal.SIGKILL)
        # in flight: jobs in daemons, results travelling to a dead gateway, results done but unacked
        rest = list(c.gather(timeout_s=90))
        assert up.daemon_pid("gateway") != victim
        all_ids = [r["job_id"] for r in got + rest]
        assert sorted(all_ids) == sorted(ids), "every job delivered exactly once"
        assert all(r["status"] == "ok" for r in got + rest)
        more = c.submit([slow(100, run=0.0)])
        assert more[0] > max(ids)  # ids stay unique across the restart
        assert list(c.gather(more, timeout_s=30))[0]["status"] == "ok"


def test_submit_retried_with_the_same_key_returns_the_same_jobs(up):
    with up.client() as c:
        a = c.submit([synthetic(1), synthetic(2)], idempotency_key="batch-7")
        b = c.submit([synthetic(1), synthetic(2)], idempotency_key="batch-7")
        assert a == b
        assert sorted(r["job_id"] for r in c.gather(a, timeout_s=30)) == sorted(a)
        assert c.status()["totals"]["submitted"] == 2


def test_dead_run_daemon_jobs_are_redispatched(up_factory):
    up = up_factory("run.pool=4", "gateway.daemon_dead_s=3")
    with up.client() as c:
        ids = c.submit([slow(i, run=1.5) for i in range(4)])
        time.sleep(0.8)  # all four are in the run phase
        os.kill(up.daemon_pid("run"), signal.SIGKILL)
        results = list(c.gather(ids, timeout_s=60))
    assert sorted(r["job_id"] for r in results) == sorted(ids)
    assert all(r["status"] == "ok" and r["attempts"] == 2 for r in results)
    assert "job_redispatched" in up.log()


def test_attempts_are_bounded(up_factory):
    up = up_factory("run.pool=2", "gateway.max_attempts=1", "gateway.daemon_dead_s=3")
    with up.client() as c:
        ids = c.submit([slow(i, run=2.0) for i in range(2)])
        time.sleep(0.8)
        os.kill(up.daemon_pid("run"), signal.SIGKILL)
        results = list(c.gather(ids, timeout_s=60))
    assert all(r["status"] == "failed" and r["error"]["type"] == "AttemptsExhausted" for r in results)


def test_late_result_of_a_superseded_attempt_is_discarded(up):
    with up.client() as c:
        (jid,) = c.submit([slow(1, run=1.5, reward=0.75)])
        time.sleep(0.5)
        fake = empty_trajectory(jid, "forged", 0)
        fake.update(reward=99.0)
        s = Sockets(asyncio=False, linger_ms=2000)
        try:
            push = s.connect("PUSH", up.gateway.replace("gateway.sock", "gateway_results.sock"))
            push.send_multipart(codec.encode(Result(job_id=jid, attempt=7, trajectory=fake).to_wire()))
        finally:
            s.close()
        (r,) = list(c.gather([jid], timeout_s=30))
    assert r["reward"] == 0.75 and r["instance_id"] == "i1"
    assert "late_result_discarded" in up.log()


def test_budget_counts_phase_time_not_queue_time(up_factory):
    up = up_factory("run.pool=1")
    with up.client() as c:
        # Each job runs 0.6 s with a 1.2 s budget; the last waits ~1.8 s for the single run slot.
        ids = c.submit([dict(slow(i, run=0.6), timeout_s=1.2) for i in range(4)])
        over = c.submit([dict(slow(9, run=5.0), timeout_s=1.0)])
        phase = c.submit([dict(synthetic(10, init={"dist": "constant", "value": 3.0}), phase_timeouts={"init": 0.3})])
        results = {r["job_id"]: r for r in c.gather(ids + over + phase, timeout_s=60)}
    assert all(results[j]["status"] == "ok" for j in ids)
    assert max(results[j]["timing"]["queue"] for j in ids) > 1.2  # waited longer than its budget, harmlessly
    r = results[over[0]]
    assert r["status"] == "timeout" and r["failed_phase"] == "run" and r["error"]["type"] == "PhaseTimeout"
    assert 0.9 < r["timing"]["run"] < 2.0 and r["timing"]["init"] >= 0  # the partial trajectory keeps its timing
    r = results[phase[0]]
    assert r["status"] == "timeout" and r["failed_phase"] == "init" and r["timing"]["init"] < 1.0


def test_unclaimed_results_are_dropped_after_retention(up_factory):
    up = up_factory("gateway.retention_s=1")
    with up.client() as c:
        ids = c.submit([synthetic(i) for i in range(3)])
        deadline = time.monotonic() + 20
        while c.status()["done_unacked"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    time.sleep(3.0)  # the client went away
    with up.client() as other:
        st = other.status()
    assert st["done_unacked"] == 0 and "unclaimed_results_dropped" in up.log()
