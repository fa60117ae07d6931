"""The gateway's lease sweep at cluster scale (issue 16, docs/SCALING.md step (c)).

    python bench/bench_lease_sweep.py --quick     # 100 and 1,000 nodes, 8 sweeps each
    python bench/bench_lease_sweep.py             # 100, 1,000 and 5,000 nodes, 30 sweeps each

Once a second the gateway looks for jobs whose lease ran out. Before step (c) it walked its whole
job table (648,000 dispatched jobs at 1,000 nodes x 512 run slots) and re-validated, through the
holder's rebuilt set, each job whose last renewal was a lease old. Now a holder whose heartbeats
are complete and current vouches for its jobs without the sweep touching them, and the sweep walks
only the unvouched ones (in transit, or whose holder stopped listing them, had a gap or went quiet).

Both run here on the same state, built in a real ``Gateway`` object (no sockets): every node's
init, run and eval daemon holding its pool plus prefetch, each job's last renewal spread over the
lease (a steady state), heartbeats arriving every second, and per second the churn of jobs
handed from one holder to the next that ``job_s`` implies. The baseline is the whole-table walk as
it was at 78e55de (reproduced below). Figures: per-sweep time (median, max) for each and the
ratio; a sweep is a stall of the gateway's loop, so its max lands on poll latency.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: F401 - puts the checkout on sys.path

from rolloutd.bus import events
from rolloutd.daemons.phase import default_prefetch
from rolloutd.daemons.supervisor import config_from_args
from rolloutd.gateway.daemon import Gateway
from rolloutd.gateway.jobs import JobRecord

POOLS = {"init": 32, "run": 512, "eval": 32}
NEXT = {"init": "run", "run": "eval", "eval": None}


def build(nodes: int, lease: float, seed: int) -> Gateway:
    gw = Gateway(config_from_args(None, None, [f"gateway.lease_timeout_s={lease}", "logging.level=warning"]))
    rnd = random.Random(seed)
    now = time.monotonic()
    jid = 0
    for n in range(nodes):
        for phase, pool in POOLS.items():
            who = f"{phase}@sim{n:05d}"
            t = gw.held[who] = events.HeldJobs("i1")
            t.valid, t.seq = True, 1
            gw.hb_seen[who] = now
            for _ in range(pool + default_prefetch(pool)):
                jid += 1
                rec = JobRecord(jid, "bench", {}, state="dispatched", holder=f"{who}#i1",
                                last_seen=now - rnd.uniform(0.0, lease))
                gw.table.add(rec)
                t.jobs[jid] = 1
    gw.table.unvouched.clear()  # every job named by its holder's last full listing (Gateway._on_event)
    return gw


def walk_whole_table(gw: Gateway, now: float):
    """The lease sweep before step (c) (78e55de): the same-run baseline."""
    lease = float(gw.gcfg["lease_timeout_s"])
    for rec in list(gw.table.jobs.values()):
        if rec.state == "dispatched" and now - rec.last_seen > lease and not _still_held(gw, rec, now, lease):
            gw._redispatch(rec.job_id, rec.attempt, "lease")


def _still_held(gw: Gateway, rec: JobRecord, now: float, lease: float) -> bool:
    who, _, inc = rec.holder.rpartition("#")
    t = gw.held.get(who)
    if t is None or not t.valid or t.incarnation != inc or t.jobs.get(rec.job_id) != rec.attempt:
        return False
    rec.last_seen = max(rec.last_seen, gw.hb_seen.get(who, 0.0))
    return now - rec.last_seen <= lease


def advance(gw: Gateway, now: float, churn: int, rnd: random.Random):
    """One second of cluster life: every holder's heartbeat arrived, ``churn`` jobs per run and
    init holder moved on to the next phase (removed by one holder, named by the next, as
    Gateway._on_event applies it)."""
    for who in gw.held:
        gw.hb_seen[who] = now - rnd.uniform(0.0, 1.0)
    for who, t in gw.held.items():
        phase, _, node = who.partition("@")
        nxt = NEXT[phase]
        if nxt is None:
            continue
        moving = rnd.sample(list(t.jobs), min(churn, len(t.jobs)))
        holder = f"{who}#i1"
        gw._unvouch(holder, [(j, 1) for j in moving], now)
        for j in moving:
            del t.jobs[j]
        dst = gw.held[f"{nxt}@{node}"]
        for j in moving:  # the next holder's heartbeat names them
            dst.jobs[j] = 1
            rec = gw.table.jobs[j]
            rec.holder, rec.last_seen = f"{nxt}@{node}#i1", now
            gw.table.unvouched.discard(j)


def measure(nodes: int, sweeps: int, lease: float, job_s: float) -> dict:
    churn = max(1, round(POOLS["run"] / job_s))
    out = {}
    for name, sweep in (("whole-table walk (before)", walk_whole_table), ("unvouched only (now)", Gateway._sweep_leases)):
        gw = build(nodes, lease, seed=nodes)
        rnd = random.Random(1)
        now = time.monotonic()
        times = []
        for _ in range(sweeps):
            now += 1.0
            advance(gw, now, churn, rnd)
            t0 = time.perf_counter()
            sweep(gw, now)
            times.append(time.perf_counter() - t0)
        out[name] = {"median_ms": common.median(times) * 1e3, "max_ms": max(times) * 1e3,
                     "redispatched": gw.table.totals["redispatched"], "jobs": len(gw.table.jobs)}
        del gw
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", default=None, help="comma-separated sizes")
    ap.add_argument("--sweeps", type=int, default=None)
    ap.add_argument("--lease", type=float, default=10.0, help="gateway.lease_timeout_s (the default)")
    ap.add_argument("--job-s", type=float, default=60.0, help="seconds a job spends in run (sets the churn)")
    a = ap.parse_args()
    sizes = [int(x) for x in (a.nodes or ("100,1000" if a.quick else "100,1000,5000")).split(",")]
    sweeps = a.sweeps or (8 if a.quick else 30)
    print(f"lease sweep: {sweeps} sweeps per size, lease {a.lease:.0f} s, job_s {a.job_s:.0f}, "
          f"tree {common.revision(common.REPO)}, {common.machine()}, load {common.loadavg()}")
    for n in sizes:
        r = measure(n, sweeps, a.lease, a.job_s)
        (bn, b), (nn, c) = r.items()
        print(f"  {n:5d} nodes ({b['jobs']:,} dispatched jobs): {bn} median {b['median_ms']:.1f} ms max "
              f"{b['max_ms']:.1f} ms | {nn} median {c['median_ms']:.2f} ms max {c['max_ms']:.2f} ms | "
              f"ratio {b['median_ms'] / max(c['median_ms'], 1e-6):.0f}x | redispatched {b['redispatched']} / "
              f"{c['redispatched']} | load {common.loadavg()}", flush=True)


if __name__ == "__main__":
    main()
