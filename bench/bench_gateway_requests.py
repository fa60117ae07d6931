#!/usr/bin/env python3
"""How long the worst request of each kind holds the gateway's loop (issue 38, item 3).

A real ``rolloutd up`` with a journal. A pinger thread sends ``status`` every 10 ms from its
own socket; while one request is in the gateway, the pinger's slowest answer is what that
request cost every other client (the loop answers nothing else meanwhile). Baseline: the
pinger's p50 and max while nothing else runs, in the same run. The requests are the worst each
bound of docs/PROTOCOL.md ("Bounds") lets through, plus the refused ones just over them::

    python bench/bench_gateway_requests.py            # one line per request: wall, worst status

``--quick`` (make bench-smoke) runs the same: each request is sent once already.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rolloutd.bus.messages import Cancel, Submit  # noqa: E402
from rolloutd.gateway.client import GatewayError, RolloutClient  # noqa: E402
from tests.conftest import _up_factory  # noqa: E402


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same run (each request is sent once already)")
    ap.parse_args()
    gen = _up_factory()
    make = next(gen)
    j = tempfile.mkdtemp(prefix="rd-bench-gw-")
    try:
        run(make(f"gateway.journal={j}/journal.db"))
    finally:  # rolloutd up stopped and its directories removed, whatever broke
        for _ in gen:
            pass
        shutil.rmtree(j, ignore_errors=True)


def run(up) -> None:
    lat: list[tuple[float, float]] = []
    stop = threading.Event()

    def ping():
        with RolloutClient(up.gateway, timeout_s=120) as c:
            while not stop.is_set():
                t = time.monotonic()
                c.status()
                lat.append((t, time.monotonic() - t))
                time.sleep(0.01)

    th = threading.Thread(target=ping, daemon=True)
    th.start()
    time.sleep(2.0)
    idle = [x for _, x in lat]
    print(f"baseline status: p50 {statistics.median(idle) * 1000:.1f} ms, max {max(idle) * 1000:.1f} ms "
          f"({len(idle)} pings)", flush=True)

    def worst(label, fn):
        t0 = time.monotonic()
        try:
            out = fn()
        except GatewayError as e:
            out = f"refused {e.code}"
        t1 = time.monotonic()
        time.sleep(0.3)  # the ping in flight at t1 returns
        m = max([x for t, x in lat if t0 - 0.02 <= t <= t1] or [0.0])
        print(f"{label:48s} {(t1 - t0) * 1000:8.0f} ms wall, worst concurrent status {m * 1000:6.0f} ms  ({out})",
              flush=True)

    with RolloutClient(up.gateway, timeout_s=300) as c:
        big = lambda k: [{"handler": "synthetic", "instance": {}, "n": 4096}] * k  # noqa: E731
        c.pause()
        one = lambda tasks: c.request(Submit(client_id=c.client_id, tasks=tasks))["job_ids"]  # noqa: E731
        worst("submit 4,096 jobs (the cap, one task)", lambda: len(one(big(1))))
        worst("submit 4,096 tasks of n=1 (the cap)", lambda: len(one(
            [{"handler": "synthetic", "instance": {"seed": i, "run": 0.001}} for i in range(4096)])))
        worst("submit 4,097 jobs (refused)", lambda: len(one(big(1) + [{"handler": "synthetic", "instance": {}}])))
        queued = one(big(1))
        queued += one(big(1)) + one(big(1))
        worst("cancel 10,000 queued jobs (the cap)", lambda: len(c.request(Cancel(job_ids=queued[:10000]))["jobs"]))
        worst("cancel 10,000 unknown ids (the cap)", lambda: len(c.request(Cancel(job_ids=list(range(10**15, 10**15 + 10000))))["jobs"]))
        worst("cancel 1,000,000 unknown ids (refused)", lambda: len(c.request(Cancel(job_ids=list(range(10**15, 10**15 + 10**6))))["jobs"]))
        c.cancel(c.status() and queued)  # let the queue go (the client splits it)
        c.resume()
        done = c.submit([{"handler": "synthetic", "instance": {}, "n": 1024}])  # 256 per poll at most
        while c.status()["done_unacked"] < len(done):
            time.sleep(0.1)
        worst("poll max_results=10**9 (cut to 256)", lambda: len(c.poll(max_results=10**9)))
        worst("status", lambda: len(c.status()))
        worst("add_llm_server", lambda: c.add_backend("http://127.0.0.1:9", policy_version=1)["address"])
        worst("list_llm_servers", lambda: len(c.list_backends()["backends"]))
        worst("clear_llm_server", lambda: len(c.clear_backends()))
        worst("stop", lambda: c.pause())
        worst("start", lambda: c.resume())
    stop.set()
    th.join()


if __name__ == "__main__":
    main()
