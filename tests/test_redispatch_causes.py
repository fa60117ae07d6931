"""The causes a SIGSTOPped holder's jobs are re-dispatched with are the ones docs/EVENTS.md lists
(issue 28 item 6: the outside trial saw only "...went silent; unlisted by every live daemon since"
after a SIGSTOP, never the plain "went silent" the page names first)."""
from __future__ import annotations

import os
import signal

from tests.conftest import wait_for
from tests.test_reliability import phase, stopped


def test_a_sigstopped_run_daemon_s_listed_jobs_come_back_as_went_silent(up_factory):
    up = up_factory("run.pool=4", "gateway.daemon_dead_s=3", "gateway.lease_timeout_s=300")
    with up.client() as c:
        ids = c.submit([{"handler": "synthetic", "instance_id": f"s{i}", "instance": {"run": 20.0, "seed": i}}
                        for i in range(4)])
        # the run daemon holds all four and its heartbeat has listed them
        wait_for(lambda: (phase(c, "run") or {}).get("inflight") == 4, timeout_s=60, what="run holding four jobs")
        run = up.daemon_pid("run")
        os.kill(run, signal.SIGSTOP)
        try:
            wait_for(lambda: stopped(run), what="the run daemon to stop")
            wait_for(lambda: c.status()["totals"].get("redispatched", 0) >= 4, timeout_s=60,
                     what="the four jobs re-dispatched")
        finally:
            os.kill(run, signal.SIGCONT)
        c.cancel(ids)
    causes = [r["cause"] for r in up.logged("job_redispatched")]
    assert len(causes) >= 4
    assert all(c.endswith(" went silent") and c.startswith("run@") for c in causes[:4]), causes
