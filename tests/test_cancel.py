"""Cancel a job while queued in the gateway or in a phase: the result is ``cancelled``.
A retried cancel gives the same answer: the job's outcome, not what the call did."""
from __future__ import annotations

import time

from rolloutd.bus.messages import Cancel
from tests.conftest import synthetic, wait_for


def run_inflight(c) -> int:
    return next((d.get("inflight", 0) for d in c.status()["daemons"] if d["daemon"] == "run"), 0)


def test_cancel_queued_running_unknown_and_finished(up_factory, tmp_path):
    up = up_factory("init.pool=1", "run.pool=1", f"gateway.journal={tmp_path}/journal.db")
    with up.client() as c:
        done = c.rollout("synthetic", {}, timeout_s=30)
        slow = [synthetic(i, run={"dist": "constant", "value": 30}) for i in range(12)]
        ids = c.submit(slow)
        # The first is in run, a few wait in init and the pipes, the rest queue in the gateway.
        wait_for(lambda: run_inflight(c) == 1, what="the first job in the run phase")
        asked = ids + [987654321, done["job_id"]]
        out = c.request(Cancel(job_ids=asked))
        assert out["jobs"][str(987654321)] == "not_found"
        assert out["jobs"][str(done["job_id"])] == "already_finished" and out["outcome"][str(done["job_id"])] == "ok"
        assert out["jobs"][str(ids[0])] == "cancelling"
        assert out["jobs"][str(ids[-1])] == "cancelled"  # never left the gateway
        assert out["outcome"][str(ids[-1])] == "cancelled"
        # A client that lost that reply asks again and learns the same (or, for a job that has
        # finished meanwhile, what it finished as).
        again = c.request(Cancel(job_ids=asked))
        for jid, first in out["jobs"].items():
            assert again["jobs"][jid] == first or (first, again["jobs"][jid]) == ("cancelling", "cancelled"), jid
        # gather's budget is below the 30 s run: nobody waited it out.
        results = {r["job_id"]: r for r in c.gather(ids, timeout_s=20)}
        c.poll()  # acknowledge them all
        assert set(c.cancel(ids).values()) == {"already_finished"}  # acknowledged: known from the journal
    assert set(results) == set(ids)
    assert all(r["status"] == "cancelled" for r in results.values())
    assert results[ids[0]]["failed_phase"] == "run"
    assert results[ids[-1]]["failed_phase"] == "queue"


def test_cancel_mid_llm_call_closes_the_connection(up, backends):
    b = backends(latency=20.0)  # a call that would take 20 s
    with up.client() as c:
        c.add_backend(b.url)
        (jid,) = c.submit([{"handler": "synthetic_llm", "instance": {"llm_calls": 1}}])
        deadline = time.monotonic() + 20
        while b.stats["requests"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.cancel([jid])[str(jid)] == "cancelling"
        (r,) = list(c.gather([jid], timeout_s=15))  # below the call's 20 s: the cancel cut it short
        assert r["status"] == "cancelled" and r["failed_phase"] == "run"
        deadline = time.monotonic() + 10
        while b.num_running > 0:  # the server saw the client go away (that is vLLM's abort)
            assert time.monotonic() < deadline, "the LLM request was not aborted"
            time.sleep(0.05)
        body = c.list_backends()
        assert body["leases"] == 0  # the lease went with the job
