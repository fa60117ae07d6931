"""Cancel a job while queued in the gateway or in a phase: the result is ``cancelled``."""
from __future__ import annotations

import time

from tests.conftest import synthetic


def test_cancel_queued_running_unknown_and_finished(up_factory):
    up = up_factory("init.pool=1", "run.pool=1")
    with up.client() as c:
        done = c.rollout("synthetic", {}, timeout_s=30)
        slow = [synthetic(i, run={"dist": "constant", "value": 30}) for i in range(12)]
        ids = c.submit(slow)
        time.sleep(1.0)  # the first is in run, one waits in init/pipes, the rest queue in the gateway
        out = c.cancel(ids + [987654321, done["job_id"]])
        assert out[str(987654321)] == "not_found"
        assert out[str(done["job_id"])] == "already_finished"
        assert out[str(ids[0])] == "cancelling"
        assert out[str(ids[-1])] == "cancelled"  # never left the gateway
        t0 = time.monotonic()
        results = {r["job_id"]: r for r in c.gather(ids, timeout_s=20)}
        assert time.monotonic() - t0 < 10  # nobody waited out the 30 s run
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
        t0 = time.monotonic()
        assert c.cancel([jid])[str(jid)] == "cancelling"
        (r,) = list(c.gather([jid], timeout_s=15))
        assert time.monotonic() - t0 < 5
        assert r["status"] == "cancelled" and r["failed_phase"] == "run"
        deadline = time.monotonic() + 10
        while b.num_running > 0:  # the server saw the client go away (that is vLLM's abort)
            assert time.monotonic() < deadline, "the LLM request was not aborted"
            time.sleep(0.05)
        body = c.list_backends()
        assert body["leases"] == 0  # the lease went with the job
