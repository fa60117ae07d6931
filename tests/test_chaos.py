"""Chaos: kill -9 each daemon in turn during a 1,000-job run; nothing is lost or duplicated."""
from __future__ import annotations

import collections
import os
import signal
import threading
import time

from tests.conftest import synthetic


def test_kill9_each_daemon_during_1000_jobs(up_factory, tmp_path):
    up = up_factory(f"gateway.journal={tmp_path}/journal.db", "gateway.daemon_dead_s=2", "gateway.lease_timeout_s=6",
                    "gateway.max_attempts=6", "run.pool=32", "init.pool=16", "eval.pool=16", "daemon.heartbeat_s=0.5")
    tasks = [synthetic(i, init={"dist": "uniform", "low": 0, "high": 0.02},
                       run={"dist": "lognormal", "mu": -1.0, "sigma": 0.6},
                       eval={"dist": "uniform", "low": 0, "high": 0.02}) for i in range(1000)]
    killed = []
    stop = threading.Event()

    def chaos():
        for name in ["run", "eval", "init", "router", "gateway"]:
            if stop.wait(1.5):
                return
            try:
                pid = up.daemon_pid(name)
            except LookupError:
                continue
            os.kill(pid, signal.SIGKILL)
            killed.append(name)

    with up.client(timeout_s=3.0, retries=20) as c:
        ids = c.submit(tasks)
        t = threading.Thread(target=chaos)
        t.start()
        try:
            results = list(c.gather(ids, timeout_s=240))
        finally:
            stop.set()
            t.join()
    assert killed == ["run", "eval", "init", "router", "gateway"], killed
    counts = collections.Counter(r["job_id"] for r in results)
    assert not [j for j, n in counts.items() if n > 1], "a result was delivered twice"
    assert set(counts) == set(ids), f"missing: {len(set(ids) - set(counts))}"
    assert all(r["status"] in ("ok", "failed") for r in results)
    statuses = collections.Counter(r["status"] for r in results)
    assert statuses["ok"] >= 990, statuses  # failures only from exhausted attempts, if ever
    assert max(r["attempts"] for r in results) >= 2  # the kills really hit jobs in flight
    assert up.log().count("daemon_restarted") >= 5
