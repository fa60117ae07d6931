"""Lease throughput of K router shards against one router, same machine, same run.

Real router processes (``rolloutd router --shard i``, ``router.shards = K``) and the events daemon;
backends are addresses of one local HTTP server that answers every health check. One load
process plays ``--nodes`` run daemons, each with its own DEALER connected to its node's shard
(``shard_of(node, K)``, as ``RunDaemon`` does), sending ``lease_batch`` messages as ``RouterClient``
does: the releases of what its previous batch was granted plus ``--leases`` new leases, one batch
in flight, no sooner than the ``batch_s`` each reply sets. Offered load is above what one router
process serves, so the figure is each configuration's capacity: lease operations (grants +
releases) answered per second, and the routers' CPU per operation.

On a machine with C free cores K shards can reach min(K, C) times one router, less the load
process's own CPU; on 2 cores (shared with the load process) expect well under 2x.

    python bench/bench_router_shards.py --quick      # K = 1 then 2, 3 s windows (~30 s)
    python bench/bench_router_shards.py              # K = 1, 2, 1, 2, 8 s windows (~1.5 min)
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import zmq  # noqa: E402

from rolloutd.bus import codec  # noqa: E402
from rolloutd.bus.endpoints import Endpoints, router_address, shard_of  # noqa: E402


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /health and /metrics of every "backend": 200, empty
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def health_server() -> tuple[http.server.ThreadingHTTPServer, int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def backend_addresses(port: int, k: int, per_shard: int) -> list[str]:
    """``per_shard`` addresses owned by each shard (the hash decides: pick until each has its share)."""
    got: dict[int, list] = {i: [] for i in range(k)}
    i = 0
    while min(len(v) for v in got.values()) < per_shard:
        a = f"http://127.0.0.1:{port}/b{i}"
        if len(got[shard_of(a, k)]) < per_shard:
            got[shard_of(a, k)].append(a)
        i += 1
    return [a for v in got.values() for a in v]


def run_delay_s(pid: int) -> float:
    """Seconds the process's main thread spent runnable but waiting for a CPU (schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Stack:
    """events + K routers, started by pid and stopped by pid."""

    def __init__(self, k: int):
        self.k = k
        self.tmp = common.short_tmpdir("rs-")
        self.ep = Endpoints.local(self.tmp / "run")
        sets = ["--runtime-dir", str(self.tmp / "run"), "--set", f"router.shards={k}", "--set", "logging.level=warning",
                "--set", "node=head"]
        self.log = open(self.tmp / "daemons.log", "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "rolloutd.daemons.cli"]
        self.procs = {"events": subprocess.Popen(cmd + ["events"] + sets, stdout=self.log, stderr=subprocess.STDOUT,
                                                 cwd=common.REPO, stdin=subprocess.DEVNULL,
                                                 preexec_fn=common.die_with_parent)}
        for i in range(k):
            self.procs[f"router{i}"] = subprocess.Popen(cmd + ["router", "--shard", str(i)] + sets, stdout=self.log,
                                                        stderr=subprocess.STDOUT, cwd=common.REPO,
                                                        stdin=subprocess.DEVNULL, preexec_fn=common.die_with_parent)

    def stop(self):
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.log.close()
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)


def ask(sock, msg: dict, timeout_s: float = 20.0) -> dict:
    sock.send_multipart([b""] + codec.encode(dict(msg, v=1, req_id=1)))
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no answer to {msg['kind']}")
    return codec.decode(sock.recv_multipart()[1:])


def run(k: int, a, port: int) -> dict:
    stack = Stack(k)
    ctx = zmq.Context()
    try:
        admin = [ctx.socket(zmq.DEALER) for _ in range(k)]
        for i, s in enumerate(admin):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router_address(stack.ep, i))
        for addr in backend_addresses(port, k, a.backends // k):
            ask(admin[shard_of(addr, k)], {"kind": "add_llm_server", "address": addr})
        deadline = time.monotonic() + 30
        while not all(all(b["healthy"] for b in ask(s, {"kind": "list_llm_servers"})["body"]["backends"]) for s in admin):
            if time.monotonic() > deadline:
                raise TimeoutError("backends not admitted")
            time.sleep(0.1)
        # The simulated run daemons.
        names = [f"sim{i:05d}" for i in range(a.nodes)]
        socks = []
        for name in names:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10000)
            s.connect(router_address(stack.ep, shard_of(name, k)))
            socks.append(s)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        index = {s: i for i, s in enumerate(socks)}
        held = [[] for _ in names]     # granted, released with the node's next batch
        out = [False] * len(names)     # a batch in flight
        last = [0.0] * len(names)
        pace = [0.0] * len(names)
        req = 0
        ops = [0]

        def send(i, now):
            nonlocal req
            members = []
            for _ in range(a.leases):
                req += 1
                members.append({"job_id": req, "wait_s": 0.0, "req_id": req})
            req += 1
            msg = {"v": 1, "kind": "lease_batch", "requester": f"run@{names[i]}", "node": names[i],
                   "leases": members, "releases": held[i], "req_id": req}
            held[i] = []
            socks[i].send_multipart([b""] + codec.encode(msg), zmq.NOBLOCK)
            out[i], last[i] = True, now

        pids = {n: p.pid for n, p in stack.procs.items()}
        pids["load"] = os.getpid()
        t_end = time.monotonic() + a.warmup + a.seconds
        t_measure = time.monotonic() + a.warmup
        meter = None
        base_ops = 0
        while True:
            now = time.monotonic()
            if meter is None and now >= t_measure:
                meter = common.CpuMeter(pids).start()
                delay0 = {n: run_delay_s(p) for n, p in pids.items()}
                base_ops = ops[0]
            if now >= t_end:
                break
            for i in range(len(names)):
                if not out[i] and now - last[i] >= pace[i]:
                    send(i, now)
            for s, _ in poller.poll(5):
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    h = codec.decode(frames[1:])
                    body = h.get("body") or {}
                    i = index[s]
                    if "granted" in body:
                        out[i] = False
                        pace[i] = body.get("batch_s") or 0.0
                        held[i].extend(g["lease_id"] for g in body["granted"])
                        ops[0] += len(body["granted"]) + int(body.get("released") or 0)
                    elif "lease_id" in body:  # a member that waited: released next time
                        held[i].append(body["lease_id"])
                        ops[0] += 1
        cpu = meter.stop()
        waited = {n: run_delay_s(p) - delay0[n] for n, p in pids.items()}
        n = ops[0] - base_ops
        routers = sum(v for name, v in cpu.items() if name.startswith("router"))
        return {"shards": k, "ops_per_s": n / meter.wall, "router_cpu_us_per_op": routers / n * 1e6 if n else None,
                "router_cores": routers / meter.wall, "load_cores": cpu["load"] / meter.wall,
                "events_cores": cpu["events"] / meter.wall, "wall_s": meter.wall,
                # a router runnable but not running this share of the window: the machine, not it, is the limit
                "router_cpu_wait": max(v for n, v in waited.items() if n.startswith("router")) / meter.wall,
                "load_cpu_wait": waited["load"] / meter.wall}
    finally:
        ctx.destroy(linger=0)
        stack.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K = 1 then 2, short windows")
    ap.add_argument("--shards", default="1,2", help="comma list of K, each compared with the first")
    ap.add_argument("--rounds", type=int, default=2, help="the list measured this many times, interleaved")
    ap.add_argument("--nodes", type=int, default=400, help="simulated run daemons")
    ap.add_argument("--leases", type=int, default=32, help="new leases per batch (plus the previous batch's releases)")
    ap.add_argument("--backends", type=int, default=8, help="backends in all (split evenly over the shards)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.warmup, a.nodes = 1, 3.0, 1.0, 200
    ks = list(dict.fromkeys(int(x) for x in a.shards.split(",")))
    srv, port = health_server()
    rows = []
    try:
        for r in range(a.rounds):
            for k in ks:
                row = run(k, a, port)
                row["round"] = r
                rows.append(row)
                print(f"  K={k} round {r}: {row['ops_per_s']:9,.0f} lease ops/s   routers {row['router_cores']:.2f} cores "
                      f"({row['router_cpu_us_per_op']:.1f} us/op)   load process {row['load_cores']:.2f} cores   "
                      f"events {row['events_cores']:.2f}   waiting for a CPU: router {row['router_cpu_wait']:.0%} "
                      f"load {row['load_cpu_wait']:.0%}", flush=True)
    finally:
        srv.shutdown()
    base = common.median(r["ops_per_s"] for r in rows if r["shards"] == ks[0])
    print(f"\nlease operations answered per second (median of {a.rounds}), {a.nodes} simulated run daemons, "
          f"batches of {a.leases} leases + releases, {os.cpu_count()} cores:")
    for k in ks:
        mine = [r for r in rows if r["shards"] == k]
        ops = common.median(r["ops_per_s"] for r in mine)
        us = common.median(r["router_cpu_us_per_op"] for r in mine)
        print(f"  K={k}: {ops:9,.0f} ops/s  ({ops / base:.2f}x K={ks[0]})   router CPU {us:.1f} us per operation")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
