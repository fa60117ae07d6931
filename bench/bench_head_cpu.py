"""CPU per heartbeat and per lease operation of the head's gateway and router (issue 29 item 3).

    python bench/bench_head_cpu.py --quick          # 200 nodes of state, 3 rounds (~30 s)
    python bench/bench_head_cpu.py                  # 1,000 nodes of state (648,000+ jobs), 5 rounds, every variant
    python bench/bench_head_cpu.py --listing both   # list and packed listings side by side (same run)
    python bench/bench_head_cpu.py --listing node   # three heartbeats per node vs one carrying all three

``bench_control_plane.py`` measures the head end to end, but on two cores shared with its own
load generator and other people's tests the head gets what CPU is left, so its figures move with
the machine. This one runs the real ``Gateway`` and ``Router`` objects in this process (no event
loop: their handlers are called as their loops call them) on the exact wire frames their sockets
deliver, and reads this thread's CPU clock around each step. CPU time (not wall time) of one
thread is what the head would spend whatever else runs beside it, so figures from a loaded run are
comparable with a quiet one (caches and frequency scaling still move them by some percent).

State (as at ``--nodes`` nodes x 512 run slots): every node's init, run and eval daemon holding
its pool plus prefetch (36, 576, 36 jobs) as dispatched jobs in the gateway's table, and their
leases in the router (one per run slot, adopted from ``run.leases`` events). Heartbeats, as
``daemons/phase.py`` builds them and ``bus.events.Publisher`` packs them, reach the gateway's SUB
socket over tcp on loopback; per heartbeat the figures split ``recv`` (``recv_now``, pyzmq frame
objects) from the handler (``Gateway._on_event``: parse, validate, rebuild the held set, renew).
Per second each run daemon lists changes (``job_s`` churn: ``run_pool / job_s`` in and out) and a
full listing every ``full_listing_s`` (5 s), init and eval full listings (<= 128 jobs). The router:
single ``lease`` and ``release`` requests (the protocol before issue 29's batching, still served)
beside ``lease_batch`` messages of k releases + k leases built as ``RouterClient`` builds them
(``Router._on_request``: decode, release, pick, reply, ``backend.load``; the reply's send is not
timed), and ``run.leases`` events. ``--only router`` skips the gateway (~10 s).

``--listing packed`` sends the listings as packed little-endian int64 pairs (docs/EVENTS.md,
heartbeat listings); ``both`` measures the two encodings on the same state, one after the other.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: F401 - puts the checkout on sys.path

import zmq
import zmq.asyncio

from rolloutd.bus import codec, events
from rolloutd.bus.config import DEFAULTS
from rolloutd.bus.messages import Lease, LeaseBatch, Release
from rolloutd.bus.sockets import Sockets, recv_now
from rolloutd.daemons import lease_rows
from rolloutd.daemons.phase import default_prefetch
from rolloutd.daemons.router_client import lease_member
from rolloutd.daemons.supervisor import config_from_args

# what each phase daemon holds by default: its pool plus its backlog
HELD = {p: DEFAULTS[p]["pool"] + default_prefetch(DEFAULTS[p]["pool"]) for p in ("init", "run", "eval")}
COUNTS = {"done": 0, "failed": 0, "timeout": 0, "cancelled": 0, "forwarded": 0, "malformed": 0}
cpu = time.thread_time


def _sets(extra):
    return config_from_args(None, None, ["logging.level=warning", "node=head", *extra])


def _pub_sockets() -> Sockets:
    """Sockets whose ``events_in`` is an inproc address nobody binds: a daemon's Publisher packs and
    sends as in a real head, and the events go nowhere."""
    s = Sockets(asyncio=False, linger_ms=0)
    s.endpoints = types.SimpleNamespace(events_in=f"inproc://bench-events-{id(s)}")
    return s


class Cluster:
    """The listings of ``nodes`` simulated nodes and the gateway state that matches them."""

    def __init__(self, nodes: int, job_s: float, packed: bool, per_node: bool = False):
        from rolloutd.gateway.daemon import Gateway
        from rolloutd.gateway.jobs import JobRecord

        self.gw = Gateway(_sets(["gateway.lease_timeout_s=3600"]))
        self.packed, self.per_node = packed, per_node
        self.churn = max(1, round(512 / job_s))
        self.sockets = _pub_sockets()
        self.gw.events = events.Publisher(self.sockets, "gateway", "head")  # a PUB nobody reads: real packing cost
        self.holders = []  # (who, base body, held list, reserve list)
        jid = 0
        for n in range(nodes):
            node = f"sim{n:05d}"
            for phase, k in HELD.items():
                inc = f"{100000 + n}-1"
                extra = 6 * self.churn if phase == "run" else 0
                ids = list(range(jid + 1, jid + 1 + k + extra))
                jid += k + extra
                for j in ids:
                    self.gw.table.add(JobRecord(j, "bench", {}, state="dispatched", holder=f"{phase}@{node}#{inc}",
                                                last_seen=time.monotonic()))
                base = {"daemon": phase, "node": node, "pid": 100000 + n, "incarnation": inc, "uptime_s": 1.0,
                        "phase": phase, "pool": k, "inflight": k, "counts": COUNTS}
                self.holders.append([f"{phase}@{node}", base, ids[:k], ids[k:], 0])
        self.gw.table.unvouched.clear()  # as named by their holders' last full listings (bench_lease_sweep.py)

    def _pairs(self, ids):
        if self.packed:
            return events.pack_listing({j: 1 for j in ids})
        return [[j, 1] for j in ids]

    def frames(self, rnd: int, active: int) -> list[tuple[str, list]]:
        """One second of heartbeats of the first ``active`` nodes: (kind, [topic, body]). With
        ``per_node``, one message per node: the run daemon's body carrying the init and eval
        daemons' bodies of its node (``carried``), as one heartbeat per node would send them."""
        out = []
        node_bodies = []
        for h in self.holders[:3 * active]:
            who, base, held, reserve, seq = h
            seq += 1
            h[4] = seq
            body = dict(base, ts=time.time(), jobs_seq=seq)
            node_i = int(base["node"][3:])
            if base["phase"] != "run" or rnd % 5 == node_i % 5 or seq == 1:
                body["jobs"] = self._pairs(held)
                kind = f"{base['phase']} full ({len(held)} jobs)"
            else:
                gone, new = held[:self.churn], reserve[:self.churn]
                h[2] = held = held[self.churn:] + new
                h[3] = reserve[self.churn:] + gone
                body["jobs_added"], body["jobs_removed"] = self._pairs(new), self._pairs(gone)
                kind = f"run changes (+{len(new)} -{len(gone)})"
            if not self.per_node:
                out.append((kind, [b"daemon.heartbeat", codec.pack(body)]))
                continue
            node_bodies.append((kind, body))
            if len(node_bodies) == 3:  # init, run, eval of one node (HELD's order)
                (_, init), (run_kind, run), (_, ev) = node_bodies
                node_bodies = []
                out.append((f"node: {run_kind} + init, eval", [b"daemon.heartbeat", codec.pack(dict(run, carried=[init, ev]))]))
        return out

    def close(self):
        self.sockets.close()


async def _receive(sub, n: int, recv_us: list) -> list:
    """``n`` messages as the gateway's loop takes them (``recv_now`` on a zmq.asyncio socket), each
    recv's CPU time appended to ``recv_us``."""
    got = []
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        if not await sub.poll(1000):
            continue
        while len(got) < n:
            c0 = cpu()
            fr = recv_now(sub)
            c1 = cpu()
            if fr is None:
                break
            got.append(fr)
            recv_us.append((c1 - c0) * 1e6)
    return got


def measure_gateway(nodes: int, active: int, rounds: int, job_s: float, listings: tuple) -> dict:
    """Per variant (``list``, ``packed`` listings; ``node``: packed, one message per node), one
    gateway with the same state; their rounds alternate (list round 1, packed round 1, list round
    2, ...) so a change in the machine's load lands on all alike."""
    t0 = time.monotonic()
    cls = {enc: Cluster(nodes, job_s, enc != "list", enc == "node") for enc in listings}
    built = time.monotonic() - t0
    ctx, actx = zmq.Context(), zmq.asyncio.Context()  # the gateway's sockets are zmq.asyncio ones
    pub, sub = ctx.socket(zmq.PUB), actx.socket(zmq.SUB)
    for s in (pub, sub):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"daemon.")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the PUB
    per_kind = {enc: {} for enc in listings}
    recv_us = {enc: [] for enc in listings}
    sizes: dict = {}
    try:
        for rnd in range(rounds + 1):  # round 0 lists every holder in full: the warm-up
            for enc, cl in cls.items():
                batch = cl.frames(rnd, active)
                for _, f in batch:
                    pub.send_multipart(f)
                got = asyncio.run(_receive(sub, len(batch), recv_us[enc] if rnd else []))
                if len(got) < len(batch):
                    raise RuntimeError(f"only {len(got)} of {len(batch)} heartbeats arrived")
                for (kind, raw), fr in zip(batch, got):
                    c0 = cpu()
                    cl.gw._on_event(fr)
                    c1 = cpu()
                    if rnd:
                        per_kind[enc].setdefault(kind, []).append((c1 - c0) * 1e6)
                        sizes[enc, kind] = len(raw[1])
        out = {}
        for enc, cl in cls.items():
            c0 = cpu()
            cl.gw._sweep_leases(time.monotonic())
            sweep_us = (cpu() - c0) * 1e6
            kinds = {k: {"median_us": common.median(v), "n": len(v), "bytes": sizes[enc, k]} for k, v in per_kind[enc].items()}
            per_node_s = sum(v["median_us"] * v["n"] for v in kinds.values()) / (active * rounds)
            per_node_s += common.median(recv_us[enc]) * (1 if cl.per_node else 3)
            out[enc] = {"built_s": round(built, 1), "kinds": kinds, "recv_us": common.median(recv_us[enc]),
                        "per_node_s_us": per_node_s, "sweep_ms": sweep_us / 1e3,
                        "malformed": cl.gw.malformed.get("events", 0)}
        return out
    finally:
        pub.close()
        sub.close()
        ctx.term()
        actx.term()
        for cl in cls.values():
            cl.close()


async def _turns(gw, turns: int) -> dict:
    """One loop turn's receive work as ``Gateway.serve`` does it (drain 5 sockets) with one heartbeat
    waiting on the events socket and the other four empty, as at a few thousand heartbeats/s spread
    over the second. Before: receive until it comes back empty (each empty one a raised
    zmq.Again); now: ``Gateway._drain``, whose ``recv_now`` asks the socket first. Alternated turn by turn."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    socks = []
    for i in range(5):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"daemon." if i == 3 else b"nothing")
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    await asyncio.sleep(0.3)
    frame = [b"daemon.heartbeat", codec.pack({"daemon": "x", "node": "y"})]
    times = ([], [])
    try:
        for k in range(turns):
            await pub.send_multipart(frame)
            while not await socks[3].poll(1000):
                pass
            before = k % 2
            c0 = cpu()
            for s in socks:
                if before:  # the old recv_now: receive until zmq.Again says the socket is empty
                    for _ in range(512):
                        try:
                            s.recv_multipart(zmq.NOBLOCK, copy=False).result()
                        except zmq.Again:
                            break
                else:
                    gw._drain(s, lambda f: None)
            times[before].append((cpu() - c0) * 1e6)
    finally:
        for s in socks + [pub]:
            s.close(0)
        ctx.term()
    return {"now_us": common.median(times[0]), "before_us": common.median(times[1])}


def measure_router(nodes: int, ops: int, backends: int) -> dict:
    from rolloutd.daemons.router import Router

    r = Router(_sets([]))
    sockets = _pub_sockets()
    r.events = events.Publisher(sockets, "router", "head")
    try:
        for i in range(backends):
            b = r.pool.add(f"http://127.0.0.1:{30000 + i}", api="vllm", capacity=0)
            r.pool.mark(b.id, True)
        ids = list(r.pool.backends)
        # Every run slot's lease, adopted from run.leases events as after a router restart (timed: a
        # restart's cost per event). The run daemon packs its rows (daemons/lease_rows.py).
        def lease_event(n, packed):
            rows = [[f"Lsim{n}-{i}", ids[i % len(ids)], n * 1000 + i, 0] for i in range(512)]
            body = {"daemon": "run", "node": f"sim{n:05d}", "pid": 1, "ts": time.time(), "incarnation": "i",
                    "leases": lease_rows.pack(rows) if packed else rows}
            return [zmq.Frame(b"run.leases"), zmq.Frame(codec.pack(body))]

        adopt_us = []
        for n in range(nodes):
            f = lease_event(n, True)
            c0 = cpu()
            e = events.parse(f)
            r._on_heartbeat(e[1])
            adopt_us.append((cpu() - c0) * 1e6)
        # Steady state, every node's next event (what the router does 1,000 times a second at 5,000
        # nodes): the per-row walk of the rows this replaced (kept below as the baseline, same state),
        # and today's renewal of the same rows as lists and packed; interleaved node by node.
        ev_us = {"before": [], "rows": [], "packed": []}
        for n in range(nodes):
            f_rows, f_packed = lease_event(n, False), lease_event(n, True)
            for kind, f in (("before", f_rows), ("rows", f_rows), ("packed", f_packed)):
                c0 = cpu()
                e = events.parse(f)
                (_renew_rows_before if kind == "before" else type(r)._on_heartbeat)(r, e[1])
                ev_us[kind].append((cpu() - c0) * 1e6)
        ident = zmq.Frame(b"run@sim00000#i")

        def frames(msg):
            return [ident, zmq.Frame(b"")] + [zmq.Frame(bytes(x)) for x in codec.encode(msg.to_wire())]

        def reply():
            out = [codec.decode([bytes(x) for x in f[2:]]) for f in r.out]
            r.out.clear()
            return out

        # Single lease + release messages (before: one message per operation) and batches of k
        # releases + k leases as RouterClient sends them (lease_member, LeaseBatch), interleaved
        # round by round so a change in the machine's load lands on every variant alike.
        sizes = (1, 4, 16, 64)
        lease_us, release_us, grant = [], [], 0
        batch_us = {k: [] for k in sizes}
        held = {k: [] for k in sizes}  # lease ids granted by the last batch of size k: its next releases
        rid = 0
        rounds = max(1, ops // 2 // (1 + len(sizes)))
        for _ in range(rounds):
            rid += 1
            req = frames(Lease(job_id=10**9 + rid, requester="run@sim00000", node="sim00000", wait_s=0.0, req_id=rid))
            c0 = cpu()
            r._on_request(req)
            lease_us.append((cpu() - c0) * 1e6)
            lid = (reply()[-1].get("body") or {}).get("lease_id")
            grant += lid is not None
            rel = frames(Release(lease_id=lid or "x", req_id=rid))
            c0 = cpu()
            r._on_request(rel)
            release_us.append((cpu() - c0) * 1e6)
            r.out.clear()
            for k in sizes:
                members = []
                for _ in range(k):
                    rid += 1
                    members.append(lease_member(Lease(job_id=10**9 + rid, requester="run@sim00000", node="sim00000",
                                                      wait_s=0.0, req_id=rid), "run@sim00000", "sim00000"))
                rid += 1
                msg = LeaseBatch(requester="run@sim00000", node="sim00000", leases=members, releases=held[k], req_id=rid)
                f = frames(msg)
                c0 = cpu()
                r._on_request(f)
                batch_us[k].append((cpu() - c0) * 1e6)
                body = reply()[-1].get("body") or {}
                held[k] = [g["lease_id"] for g in body.get("granted", [])]
                grant += len(held[k])
        c0 = cpu()
        r.pool.expire(3600.0)
        expire_ms = (cpu() - c0) * 1e3
        c0 = cpu()
        _expire_before(r.pool, 3600.0)
        expire_before_ms = (cpu() - c0) * 1e3
    finally:
        sockets.close()
    return {"lease_us": common.median(lease_us), "release_us": common.median(release_us), "granted": grant,
            "batch_us": {k: common.median(v) for k, v in batch_us.items()}, "rounds": rounds,
            "leases_event_us": common.median(ev_us["packed"]), "leases_event_rows_us": common.median(ev_us["rows"]),
            "leases_event_before_us": common.median(ev_us["before"]), "adopt_event_us": common.median(adopt_us),
            "leases": len(r.pool.leases), "expire_ms": expire_ms, "expire_before_ms": expire_before_ms,
            "backends": backends}


def _renew_rows_before(router, hb: dict):
    """``Router._on_heartbeat`` before the rows were packed and renewed by set (795b1da^): the baseline."""
    leases = hb.get("leases")
    if not leases or hb.get("daemon") != "run" or not isinstance(leases, list):
        return
    requester = f"run@{hb.get('node')}"
    held, pool, now = router.pool.leases, router.pool, time.monotonic()
    for row in leases:
        if (row.__class__ is not list or len(row) != 4 or not isinstance(row[0], str)
                or not isinstance(row[1], str) or not isinstance(row[3], int)):
            continue
        rec = held.get(row[0])
        if rec is None:
            pool.adopt(row[0], row[1], row[2], requester, row[3])
        elif rec.requester == requester:
            rec.renewed = now


def _expire_before(pool, ttl_s: float):
    """``Pool.expire`` before renewal by set: a walk of every lease each second (the baseline)."""
    now = time.monotonic()
    return [r for r in pool.leases.values() if now - r.renewed > ttl_s]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", type=int, default=None, help="nodes of state (default 1000; quick 200)")
    ap.add_argument("--active", type=int, default=None, help="nodes whose heartbeats are timed (default 200)")
    ap.add_argument("--rounds", type=int, default=None, help="seconds of heartbeats timed (default 5; quick 3)")
    ap.add_argument("--job-s", type=float, default=30.0, help="run-phase length (sets the churn and lease rate)")
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--ops", type=int, default=None, help="lease+release pairs timed (default 5000; quick 2000)")
    ap.add_argument("--listing", default="all", choices=("all", "list", "packed", "both", "node"),
                    help="node: packed listings as three messages per node and as one (the run daemon's "
                         "heartbeat carrying its node's init and eval bodies); all (default): list, packed and node, same run")
    ap.add_argument("--only", default="all", choices=("all", "gateway", "router"))
    a = ap.parse_args()
    nodes = a.nodes or (200 if a.quick else 1000)
    active = min(nodes, a.active or 200)
    rounds = a.rounds or (3 if a.quick else 5)
    ops = a.ops or (2000 if a.quick else 5000)
    print(f"head CPU per operation (this thread's CPU clock): {nodes} nodes of state, {active} heartbeating, "
          f"{rounds} rounds, job_s {a.job_s:.0f}, tree {common.revision(common.REPO)}, {common.machine()}, "
          f"load {common.loadavg()}", flush=True)
    lease_rate = 512 / a.job_s  # lease + release per node per second
    gws = {} if a.only == "router" else measure_gateway(nodes, active, rounds, a.job_s, {"all": ("list", "packed", "node"), "both": ("list", "packed"),
                                                                          "node": ("packed", "node")}.get(a.listing, (a.listing,)))
    for listing, g in gws.items():
        print(f"  gateway, {'packed listings, one message per node' if listing == 'node' else listing + ' listings'} (state built in {g['built_s']} s, {g['malformed']} malformed):")
        for k, v in sorted(g["kinds"].items()):
            print(f"    {k:<28} {v['median_us']:8.1f} us per message (median of {v['n']}, {v['bytes']:,} bytes)")
        print(f"    recv_now (per message)       {g['recv_us']:8.1f} us")
        print(f"    per node-second: {g['per_node_s_us']:.0f} us -> {g['per_node_s_us'] * 1000 / 1e6:.1%} of a core at "
              f"1,000 nodes | lease sweep {g['sweep_ms']:.2f} ms | load {common.loadavg()}", flush=True)
    if "node" in gws:
        print(f"  one message per node / three: {gws['node']['per_node_s_us'] / gws['packed']['per_node_s_us']:.2f}x "
              "per node-second (handlers and recv_now; the loop turn around each message not included)")
    if a.only != "router":
        from rolloutd.gateway.daemon import Gateway

        t = asyncio.run(_turns(Gateway(_sets([])), 4000 if a.quick else 10000))
        print(f"  a loop turn's receive work (5 sockets, one heartbeat waiting): {t['now_us']:.1f} us "
              f"(before: {t['before_us']:.1f} us, an empty recv per socket)", flush=True)
    if a.only == "gateway":
        return
    r = measure_router(nodes, ops, a.backends)
    single = lease_rate * (r["lease_us"] + r["release_us"]) + r["leases_event_before_us"] / 5.0
    print(f"  router ({r['backends']} backends, {r['leases']:,} leases held; medians of {r['rounds']} rounds, "
          f"{r['granted']} leases granted):")
    print(f"    run.leases event, 512 rows, renewal: before (per-row walk) {r['leases_event_before_us']:.0f} us, "
          f"now as rows {r['leases_event_rows_us']:.0f} us, now packed {r['leases_event_us']:.0f} us "
          f"(packed / before {r['leases_event_us'] / r['leases_event_before_us']:.2f}x); adopting 512 (router "
          f"restart) {r['adopt_event_us']:.0f} us")
    print(f"    expiry sweep (once a second): before (every lease) {r['expire_before_ms']:.1f} ms, "
          f"now {r['expire_ms']:.2f} ms")
    print(f"    single messages (before): lease {r['lease_us']:.1f} us, release {r['release_us']:.1f} us -> per node-second "
          f"({lease_rate:.1f} leases + releases, a run.leases event per 5 s as before) {single:.0f} us = "
          f"{single * 1000 / 1e6:.1%} of a core at 1,000 nodes")
    for k, us in r["batch_us"].items():
        per_op = us / (2 * k)
        per_node = lease_rate * 2 * per_op + r["leases_event_us"] / 5.0
        print(f"    lease_batch of {k:>2} releases + {k:>2} leases: {us:7.1f} us per batch, {per_op:5.1f} us per operation "
              f"-> per node-second {per_node:.0f} us = {per_node * 1000 / 1e6:.1%} of a core at 1,000 nodes")
    print(f"    (handler CPU only: receive, reply send and loop turn are per message, not per operation) | load {common.loadavg()}")

if __name__ == "__main__":
    main()
