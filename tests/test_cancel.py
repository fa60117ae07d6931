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
