#!/usr/bin/env python3
"""How long the worst request of each kind holds the gateway's loop (issue 38, item 3).

Two parts, one run:

1. **Loop turns, in-process** (the real ``Gateway`` class and SQLite journal, no sockets): what
   each turn of the worst requests costs, timed turn by turn. The baseline is the same work in
   one turn (a submit worked with an unbounded slice: what the gateway did before submits were
   sliced; a decode with no value bound: before ``gateway.max_request_values``), measured in the
   same run, alternated with the new way, median of the repeats.
2. **Live** (a real ``rolloutd up`` with a journal): a pinger thread sends ``status`` every
   10 ms from its own socket; while one request is in the gateway, the pinger's slowest answer
   is what that request cost every other client. Baseline: the pinger's p50 and max while
   nothing else runs, in the same run. The requests are the worst each bound of
   docs/PROTOCOL.md ("Bounds") lets through, plus the refused ones just over them::

    python bench/bench_gateway_requests.py            # part 1: 7 repeats; part 2: each request 3x
    python bench/bench_gateway_requests.py --quick    # 2 repeats, each request once (bench-smoke)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rolloutd.bus import codec  # noqa: E402
from rolloutd.bus.messages import Cancel, Submit  # noqa: E402
from rolloutd.gateway.client import GatewayError, RolloutClient  # noqa: E402
from tests.conftest import _up_factory  # noqa: E402

M = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats in-process, each live request once (bench-smoke)")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    turns(2 if a.quick else 7)
    gen = _up_factory()
    make = next(gen)
    j = tempfile.mkdtemp(prefix="rd-bench-gw-")
    try:
        live(make(f"gateway.journal={j}/journal.db"), 1 if a.quick else 3)
    finally:  # rolloutd up stopped and its directories removed, whatever broke
        for _ in gen:
            pass
        shutil.rmtree(j, ignore_errors=True)


# ---- 1. loop turns, in-process ---------------------------------------------------------------
class _Nowhere:
    """The front socket and the events publisher: replies and events go nowhere."""

    def send(self, *a, **kw):  # bus.sockets sends frame by frame
        pass

    def publish(self, *a, **kw):
        pass


def _gateway(path: str):
    from rolloutd.bus.config import Config
    from rolloutd.gateway.daemon import Gateway

    g = Gateway(Config({"gateway": {"journal": path}}))
    g._recover()
    g.front = g.events = _Nowhere()
    return g


def _submit_turns(g, body: dict, whole: bool) -> list[float]:
    """Seconds per loop turn of one submit, turns as ``Gateway.serve`` makes them: received
    (decoded, head checked), then worked a slice per turn and committed. ``whole``: all of it in
    the first turn (what the gateway did before submits were sliced)."""
    import zmq

    from rolloutd.gateway import submits

    frames = [zmq.Frame(b"client"), zmq.Frame(b"")] + [zmq.Frame(bytes(f)) for f in codec.encode(body)]
    out, first = [], True
    while first or g.submits:
        t0 = time.perf_counter()
        if first:
            g._on_request(frames)
            first = False
        if whole:  # every task checked in one step, every job made in one (one executemany, as before)
            step, submits.STEP = submits.STEP, 10**9
            try:
                g.submits.work(10**9, until=float("inf"))
            finally:
                submits.STEP = step
        else:
            g.submits.work(until=t0 + submits.SLICE_S)
        g._commit()
        g._flush_replies()
        out.append(time.perf_counter() - t0)
    return out


def _decode_s(body: dict, max_values: int | None) -> tuple[float, str]:
    frames = codec.encode(body)
    t0 = time.perf_counter()
    try:
        codec.decode(frames, max_values=max_values)
        verdict = "decoded"
    except codec.CodecError as e:
        verdict = e.code
    return time.perf_counter() - t0, verdict


def turns(repeats: int) -> None:
    import gc

    from rolloutd.bus.config import DEFAULTS

    gc.freeze()  # as the daemon does after its setup
    cap = DEFAULTS["gateway"]["max_request_values"]
    d = tempfile.mkdtemp(prefix="rd-bench-turns-")
    try:
        g = _gateway(f"{d}/journal.db")
        cid = "bench"
        shapes = {
            "submit 4,096 tasks of n=1": lambda: [{"handler": "synthetic", "instance": {"seed": i, "run": 0.001}}
                                                  for i in range(4096)],
            "submit 1 task of n=4,096": lambda: [{"handler": "synthetic", "instance": {"seed": 1}, "n": 4096}],
            "submit 1 task of n=4,096, 1 MiB instance": lambda: [{"handler": "synthetic",
                                                                  "instance": {"seed": "s" * M}, "n": 4096}],
            "submit 4,096 tasks, 520k values": lambda: [{"handler": "synthetic", "instance": {"seed": list(range(96))}}
                                                        for i in range(4096)],
        }
        print(f"\n1. loop turns in-process (median of {repeats}; one turn: the same work unsliced, as before;"
              " slices: now)", flush=True)
        for label, tasks in shapes.items():
            one, sliced = [], []
            for _ in range(repeats):  # alternated: both see the same machine
                body = {"v": 1, "kind": "submit", "client_id": cid, "tasks": tasks()}
                t = _submit_turns(g, body, True)
                one.append(max(t))
                body = {"v": 1, "kind": "submit", "client_id": cid, "tasks": tasks()}
                t = _submit_turns(g, body, False)
                sliced.append((max(t), statistics.median(t), len(t)))
                g.table = type(g.table)()  # forget the jobs (the journal keeps growing, as it would)
            mx = statistics.median(s[0] for s in sliced)
            print(f"  {label:44s} one turn {statistics.median(one) * 1000:7.1f} ms | slices: longest turn "
                  f"{mx * 1000:6.1f} ms, median turn {statistics.median(s[1] for s in sliced) * 1000:5.1f} ms, "
                  f"{sliced[0][2]} turns  (x{statistics.median(one) / mx:.1f})", flush=True)
        g.journal.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    refused = {
        "cancel 1,000,000 ids": {"v": 1, "kind": "cancel", "req_id": 1, "job_ids": list(range(10**15, 10**15 + 10**6))},
        "submit: 15 M empty maps (15 MiB)": {"v": 1, "kind": "submit", "req_id": 1, "client_id": "x", "tasks": [
            {"handler": "synthetic", "instance": {"m": [[{}] * 1000 for _ in range(15000)]}}]},
        "submit: 4 M 4-byte strings (16 MiB)": {"v": 1, "kind": "submit", "req_id": 1, "client_id": "x", "tasks": [
            {"handler": "synthetic", "instance": {"m": [["abc"] * 1000 for _ in range(3900)]}}]},
        "submit: 1.7 M floats (15 MiB)": {"v": 1, "kind": "submit", "req_id": 1, "client_id": "x", "tasks": [
            {"handler": "synthetic", "instance": {"m": [[0.5] * 1000 for _ in range(1700)]}}]},
    }
    print(f"\n   decode of a header (max_request_values {cap}; none = before; median of {repeats})", flush=True)
    for label, body in refused.items():
        before, now, verdicts = [], [], set()
        for i in range(repeats):
            if i < 2 or "empty maps" not in label:  # seconds each: twice is enough
                before.append(_decode_s(body, None)[0])
            t, v = _decode_s(body, cap)
            now.append(t)
            verdicts.add(v)
        b, n = statistics.median(before), statistics.median(now)
        print(f"  {label:44s} none {b * 1000:8.1f} ms | bounded {n * 1000:6.1f} ms ({'/'.join(sorted(verdicts))})"
              f"  (x{b / n:.0f})", flush=True)


# ---- 2. live -----------------------------------------------------------------------------------
def _ping(address: str, conn) -> None:
    """In its own process (the requests this bench encodes would hold a thread's GIL): a status
    every 10 ms until told to stop, then every (sent at, seconds to the answer) back."""
    lat = []
    with RolloutClient(address, timeout_s=120) as c:
        while not conn.poll():
            t = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
            c.status()
            lat.append((t, time.monotonic() - t))
            time.sleep(0.01)
    conn.send(lat)


def live(up, repeats: int) -> None:
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    here, there = mp.Pipe()
    pinger = mp.Process(target=_ping, args=(up.gateway, there), daemon=True)
    pinger.start()
    time.sleep(3.0)  # spawned: imports first
    idle_from = time.monotonic() - 1.5
    time.sleep(1.5)
    idle_to = time.monotonic()
    windows: list[tuple[str, float, float, object]] = []

    def worst(label, fn):
        t0 = time.monotonic()
        try:
            out = fn()
        except GatewayError as e:
            out = f"refused {e.code}"
        windows.append((label, t0, time.monotonic(), out))
        time.sleep(0.3)  # the ping in flight at the end returns

    try:
        for _ in range(repeats):
            series(up, worst)
    finally:
        here.send("stop")
        lat = here.recv() if here.poll(130) else []
        pinger.join(10)
    idle = [x for t, x in lat if idle_from <= t <= idle_to]
    print(f"\n2. live: baseline status p50 {statistics.median(idle) * 1000:.1f} ms, max {max(idle) * 1000:.1f} ms "
          f"({len(idle)} pings, nothing else running; pinger in its own process); each request {repeats}x: "
          "median (max) of the worst concurrent status")
    by: dict[str, list] = {}
    for label, t0, t1, out in windows:
        m = max([x for t, x in lat if t0 - 0.02 <= t <= t1] or [0.0])
        by.setdefault(label, []).append((t1 - t0, m, out))
    for label, xs in by.items():
        w, m = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        print(f"  {label:48s} {w * 1000:7.0f} ms wall, worst concurrent status {m * 1000:5.0f} ms "
              f"({max(x[1] for x in xs) * 1000:4.0f}; x{m / max(idle):.1f} idle max)  ({xs[-1][2]})")


def series(up, worst) -> None:
    """Each worst request once (the pinger watches the gateway meanwhile)."""
    with RolloutClient(up.gateway, timeout_s=300) as c:
        big = lambda k: [{"handler": "synthetic", "instance": {}, "n": 4096}] * k  # noqa: E731
        c.pause()
        made: list[int] = []

        def one(tasks):
            ids = c.request(Submit(client_id=c.client_id, tasks=tasks))["job_ids"]
            made.extend(ids)
            return ids

        worst("submit 4,096 jobs (the cap, one task)", lambda: len(one(big(1))))
        worst("submit 4,096 tasks of n=1 (the cap)", lambda: len(one(
            [{"handler": "synthetic", "instance": {"seed": i, "run": 0.001}} for i in range(4096)])))
        worst("submit 4,096 jobs of a 1 MiB instance", lambda: len(one(
            [{"handler": "synthetic", "instance": {"seed": "s" * M}, "n": 4096}])))
        worst("submit 4,096 tasks, 520k values (near the cap)", lambda: len(one(
            [{"handler": "synthetic", "instance": {"seed": list(range(96))}} for i in range(4096)])))
        worst("submit 4,097 jobs (refused)", lambda: len(one(big(1) + [{"handler": "synthetic", "instance": {}}])))
        worst("submit 15 M empty maps (refused)", lambda: len(one(
            [{"handler": "synthetic", "instance": {"m": [[{}] * 1000 for _ in range(15000)]}}])))
        queued = one(big(1))
        queued += one(big(1)) + one(big(1))
        worst("cancel 10,000 queued jobs (the cap)", lambda: len(c.request(Cancel(job_ids=queued[:10000]))["jobs"]))
        worst("cancel 10,000 unknown ids (the cap)", lambda: len(c.request(Cancel(job_ids=list(range(10**15, 10**15 + 10000))))["jobs"]))
        worst("cancel 1,000,000 unknown ids (refused)", lambda: len(c.request(Cancel(job_ids=list(range(10**15, 10**15 + 10**6))))["jobs"]))
        c.cancel(made)  # nothing queued so far runs (4,096 jobs of a 1 MiB instance, ...)
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


if __name__ == "__main__":
    main()
