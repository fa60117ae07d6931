"""The events fan-out to one run and one init daemon: every heartbeat vs their own (issue 40).

    python bench/bench_event_fanout.py --quick        # 1,000 nodes, 4 s (~10 s)
    python bench/bench_event_fanout.py                # 1,000 nodes, 15 s
    python bench/bench_event_fanout.py --nodes 5000

N simulated nodes (an init, a run and an eval daemon each) plus the router and the gateway publish
one heartbeat a second through a real events daemon (the XSUB/XPUB proxy), with bodies the size of
real ones (the run daemon's 576 held jobs listed whole every 5th second, else the changes; init's
and eval's 36 whole). Subscribed meanwhile, in the same run:

* ``old``: ``daemon.heartbeat``, what every run and init daemon subscribed to before;
* ``run``: ``RunDaemon.heartbeat_topics`` (the router's heartbeat, any node);
* ``init``: ``InitDaemon.heartbeat_topics`` of one node (that node's run and eval heartbeats).

Each reports messages and bytes received per second; the ratios new/old are measured against the
``old`` subscriber of the same run, and the last lines scale both to the cluster's 2 x N run and
init daemons (what the events daemon sends them each second).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the checkout on sys.path

import zmq

from rolloutd.bus import codec, events
from rolloutd.bus.endpoints import Endpoints
from rolloutd.daemons.phase import InitDaemon, RunDaemon, default_prefetch

POOLS = {"init": 32, "run": 512, "eval": 32}
FULL_EVERY = 5  # daemon.full_listing_s: the run daemon lists all its jobs every 5 s
CHURN = 17      # jobs a run daemon starts (and ends) per second: 512 slots / 30 s run phases


def node_name(i: int) -> str:
    return f"sim{i:05d}"


def bodies(i: int) -> dict:
    """Heartbeat bodies of node i's daemons, as ``Daemon`` and ``PhaseDaemon`` fill them:
    {daemon: [body of second 0, second 1, ...]} (cycled)."""
    node, base = node_name(i), i * 10_000
    out = {}
    for d, pool in POOLS.items():
        held = {base + j: 1 for j in range(pool + default_prefetch(pool))}
        common_f = {"daemon": d, "node": node, "pid": 4000 + i, "ts": time.time(), "incarnation": f"{i}-1",
                    "uptime_s": 100.0, "phase": d, "pool": pool, "inflight": pool, "counts": {"done": 1000}}
        if d != "run":
            out[d] = [codec.pack(dict(common_f, jobs_seq=1, jobs=events.pack_listing(held)))]
            continue
        added = {base + 9000 + j: 1 for j in range(CHURN)}
        removed = dict(list(held.items())[:CHURN])
        out[d] = [codec.pack(dict(common_f, jobs_seq=s, jobs=events.pack_listing(held))) if s % FULL_EVERY == 0
                  else codec.pack(dict(common_f, jobs_seq=s, jobs_added=events.pack_listing(added),
                                       jobs_removed=events.pack_listing(removed)))
                  for s in range(FULL_EVERY)]
    return out


class Counter(threading.Thread):
    """One subscriber: messages and bytes (topic + body frames) received."""

    def __init__(self, ctx: zmq.Context, address: str, topics: list[bytes]):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, events.EVENTS_HWM)
        for t in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, t)
        self.sock.connect(address)
        self.msgs = self.bytes = 0
        self.senders: set = set()
        self.counting = False
        self.stop = False

    def run(self):
        while not self.stop:
            if not self.sock.poll(100):
                continue
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if self.counting:
                    self.msgs += 1
                    self.bytes += sum(len(f) for f in frames)
                    self.senders.add(bytes(frames[0]))
        self.sock.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds")
    p.add_argument("--quick", action="store_true", help="4 measured seconds")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.quick:
        a.seconds = 4.0
    n = a.nodes
    rd = Path(tempfile.mkdtemp(prefix="fanout-", dir="/tmp"))
    ep = Endpoints.local(rd / "run")
    log = open(rd / "events.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "events", "--runtime-dir", str(rd / "run")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO, preexec_fn=common.die_with_parent)
    ctx = zmq.Context()
    counters = {}
    try:
        deadline = time.monotonic() + 60
        while not Path(ep.events_in[6:]).exists() or not Path(ep.events_out[6:]).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the events daemon did not start:\n{(rd / 'events.log').read_text()[-2000:]}")
            time.sleep(0.05)
        own = node_name(0)
        counters = {"old": Counter(ctx, ep.events_out, [events.HEARTBEAT.encode()]),
                    "run": Counter(ctx, ep.events_out, RunDaemon.heartbeat_topics(own)),
                    "init": Counter(ctx, ep.events_out, InitDaemon.heartbeat_topics(own))}
        for c in counters.values():
            c.start()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.connect(ep.events_in)
        frames = []  # (topic frame, [bodies by second], offset) of every simulated daemon
        for i in range(n):
            for d, bs in bodies(i).items():
                frames.append((events.heartbeat_topic(d, node_name(i)).encode(), bs, i))  # full listings staggered
        for d in ("router", "gateway"):
            frames.append((events.heartbeat_topic(d, "head").encode(),
                           [codec.pack({"daemon": d, "node": "head", "pid": 1, "ts": time.time(),
                                        "incarnation": "1-1", "uptime_s": 100.0})], 0))
        time.sleep(0.5)  # subscriptions reach the proxy and the publisher
        slices = 20  # each second's heartbeats spread over it, as 3N daemons' timers are
        per = (len(frames) + slices - 1) // slices
        warm, sent, sent_bytes = 1, 0, 0
        t_start = time.monotonic()
        total_s = warm + a.seconds
        sec = 0
        while True:
            t_sec = t_start + sec
            if sec == warm:
                for c in counters.values():
                    c.counting = True
                sent, sent_bytes, t_count = 0, 0, time.monotonic()
            if sec >= total_s:
                t_end = time.monotonic()
                break
            for k in range(slices):
                for topic, bs, off in frames[k * per:(k + 1) * per]:
                    body = bs[(sec + off) % len(bs)]
                    try:
                        pub.send_multipart([topic, body], zmq.NOBLOCK)
                        sent += 1
                        sent_bytes += len(topic) + len(body)
                    except zmq.Again:
                        pass
                pause = t_sec + (k + 1) / slices - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            sec += 1
        time.sleep(0.3)  # the last slice crosses the proxy
        for c in counters.values():
            c.counting = False
        elapsed = t_end - t_count
        behind = elapsed - a.seconds
        out = {"nodes": n, "seconds": round(elapsed, 2), "published_per_s": round(sent / elapsed, 1),
               "published_bytes_per_s": round(sent_bytes / elapsed), "subscribers": {}}
        for name, c in counters.items():
            out["subscribers"][name] = {"msgs_per_s": round(c.msgs / elapsed, 2), "bytes_per_s": round(c.bytes / elapsed),
                                        "senders": len(c.senders)}
        old = out["subscribers"]["old"]
        print(f"{n:,} nodes, {len(frames):,} heartbeats/s published ({sent / elapsed:,.0f}/s measured, "
              f"{sent_bytes / elapsed / 1e6:.2f} MB/s), {elapsed:.1f} s measured through a real events daemon"
              + (f" (publisher {behind:.1f} s behind)" if behind > 0.5 else ""))
        print(f"{'subscriber':<52} {'msgs/s':>10} {'bytes/s':>14} {'senders':>8} {'msgs new/old':>13} {'bytes new/old':>14}")
        labels = {"old": "old: daemon.heartbeat (each run and init before)",
                  "run": "run: " + " + ".join(t.decode() for t in RunDaemon.heartbeat_topics(own)),  # router's
                  "init": f"init@{own}: its run + eval"}
        for name, s in out["subscribers"].items():
            r_m = s["msgs_per_s"] / old["msgs_per_s"] if old["msgs_per_s"] else float("nan")
            r_b = s["bytes_per_s"] / old["bytes_per_s"] if old["bytes_per_s"] else float("nan")
            s["msgs_ratio"], s["bytes_ratio"] = round(r_m, 6), round(r_b, 6)
            ratio = "" if name == "old" else f"{r_m:13.5f} {r_b:14.5f}"
            print(f"{labels[name]:<52} {s['msgs_per_s']:>10,.1f} {s['bytes_per_s']:>14,} {s['senders']:>8,} {ratio}")
        subs = 2 * n  # a run and an init daemon per node
        before = subs * old["bytes_per_s"]
        after = n * (out["subscribers"]["run"]["bytes_per_s"] + out["subscribers"]["init"]["bytes_per_s"])
        out["cluster_bytes_per_s"] = {"before": before, "after": after}
        print(f"the events daemon to all {subs:,} run and init daemons: {before / 1e9:,.2f} GB/s before, "
              f"{after / 1e6:,.2f} MB/s now ({after / before if before else float('nan'):.6f} of it)")
        if old["senders"] < len(frames):
            print(f"warning: the old subscriber heard {old['senders']} of {len(frames)} senders (dropped at the HWM?)")
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    finally:
        for c in counters.values():
            c.stop = True
        for c in counters.values():
            c.join(2)
        common.stop_procs([proc], [log], wait_s=10)
        ctx.destroy(linger=0)
        shutil.rmtree(rd, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
