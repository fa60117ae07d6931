"""A discrete-event model of the router's lease policies (pure Python, no daemons, no sockets).

It mirrors the live benchmark (``bench/bench_router.py``): a closed loop of ``slots`` run
slots (``run.pool``) fed from a queue of ``len(durations)`` jobs submitted at once, in job
order. A job leases one backend when it starts and holds the lease for its whole duration
(the run phase); when it ends its slot takes the next queued job at once (``refill``
ticks later if given). The duration of job ``i`` on backend ``b`` is
``durations[i] * slowdown[b]`` (``slowdown`` defaults to 1 everywhere; the unequal-speed
case makes half the backends 3x slower, which is what ``llm_calls`` x a 3x per-call
latency gives).

Policies, written independently of ``daemons/routing.py`` so the model can disagree with it:

* ``round_robin``: a counter advanced once per lease, never looking at load (what the
  reference paper's code shipped);
* ``least_inflight``: the backend with the fewest leases; ties are broken by a rotating
  counter, as ``Pool.pick`` does.

Metrics over a time window: the time-averaged busiest-minus-idlest in-flight gap
``mean(max_b n_b(t) - min_b n_b(t))``, the peak per-backend in-flight ``max_{b,t} n_b(t)``,
and the makespan (last end).
"""
from __future__ import annotations

import dataclasses
import heapq
import random

POLICIES = ("round_robin", "least_inflight")


@dataclasses.dataclass
class Trace:
    """Per-backend in-flight as a step function: ``loads[k]`` holds on ``[times[k], times[k+1])``."""

    times: list[float]
    loads: list[tuple[int, ...]]
    starts: list[float]          # per job: when it got its lease
    ends: list[float]            # per job: when it released it
    backend: list[int]           # per job: which backend it ran on

    @property
    def makespan(self) -> float:
        return max(self.ends) if self.ends else 0.0

    def window_steady(self, slots: int) -> tuple[float, float]:
        """From the moment every slot is busy to the moment the last job starts (the queue is
        empty): the stretch where the loop is closed and the policy alone shapes the loads."""
        order = sorted(self.starts)
        return order[min(slots, len(order)) - 1], order[-1]


def _pick_rr(state, loads):
    b = state["rr"] % len(loads)
    state["rr"] += 1
    return b


def _pick_li(state, loads):
    best = min(loads)
    close = [b for b, n in enumerate(loads) if n == best]
    state["rr"] += 1
    return close[state["rr"] % len(close)]


def simulate(durations, backends: int = 8, slots: int = 64, policy: str = "least_inflight",
             slowdown=None, refill: float = 0.0, order=None) -> Trace:
    """``order``: job indices in the order they take a free slot (default: submission order; the
    live benchmark can replay the order it observed, since the pipeline may shuffle jobs a little)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    pick = _pick_rr if policy == "round_robin" else _pick_li
    slow = list(slowdown) if slowdown is not None else [1.0] * backends
    state = {"rr": 0}
    loads = [0] * backends
    n = len(durations)
    order = list(range(n)) if order is None else list(order)
    assert sorted(order) == list(range(n)), "order must be a permutation of the jobs"
    starts, ends, where = [0.0] * n, [0.0] * n, [0] * n
    events: list = []   # (time, seq, kind, job): kind 0 = end, 1 = start; ends first at a tie
    seq = 0
    nxt = 0
    for _ in range(min(slots, n)):
        heapq.heappush(events, (0.0, seq, 1, order[nxt]))
        seq += 1
        nxt += 1
    times, trace = [0.0], [tuple(loads)]
    while events:
        t, _, kind, j = heapq.heappop(events)
        if kind == 1:
            b = pick(state, loads)
            loads[b] += 1
            starts[j], where[j] = t, b
            heapq.heappush(events, (t + durations[j] * slow[b], seq, 0, j))
            seq += 1
        else:
            loads[where[j]] -= 1
            ends[j] = t
            if nxt < n:
                heapq.heappush(events, (t + refill, seq, 1, order[nxt]))
                seq += 1
                nxt += 1
        if t == times[-1]:
            trace[-1] = tuple(loads)
        else:
            times.append(t)
            trace.append(tuple(loads))
    return Trace(times, trace, starts, ends, where)


def metrics(times, loads, t0: float | None = None, t1: float | None = None) -> dict:
    """Time-averaged max-min gap, time-averaged per-backend mean, and peak, over ``[t0, t1]``
    of a step function (``loads[k]`` holds from ``times[k]`` to ``times[k+1]``; the last
    value holds to ``t1``)."""
    if not times:
        return {"gap": float("nan"), "peak": 0, "span": 0.0, "mean": float("nan")}
    t0 = times[0] if t0 is None else t0
    t1 = times[-1] if t1 is None else t1
    area = total = mean_area = 0.0
    peak = 0
    for k, l in enumerate(loads):
        a = max(times[k], t0)
        b = min(times[k + 1] if k + 1 < len(times) else t1, t1)
        if b <= a:
            continue
        area += (max(l) - min(l)) * (b - a)
        mean_area += sum(l) / len(l) * (b - a)
        total += b - a
        peak = max(peak, max(l))
    return {"gap": area / total if total else float("nan"), "peak": peak, "span": total,
            "mean": mean_area / total if total else float("nan")}


# ---- the scenarios, in ticks ------------------------------------------------------------
def durations_for(scenario: str, n: int, seed: int, *, const: float = 32.0, mu: float = 2.5, sigma: float = 1.4,
                  short: float = 12.0, long_factor: float = 12.0, period: int = 8, calls: int = 4,
                  call_ticks: float = 6.0) -> list[float]:
    """(a) ``constant``; (b) ``lognormal`` (mu, sigma in log-ticks); (c) ``periodic``: every
    ``period``-th job (i % period == 0) is ``long_factor`` x ``short``; (d) ``unequal``:
    ``calls`` LLM calls of ``call_ticks`` each on a full-speed backend."""
    if scenario == "constant":
        return [const] * n
    if scenario == "lognormal":
        rng = random.Random(seed)
        return [rng.lognormvariate(mu, sigma) for _ in range(n)]
    if scenario == "periodic":
        return [short * (long_factor if i % period == 0 else 1.0) for i in range(n)]
    if scenario == "unequal":
        return [calls * call_ticks] * n
    raise ValueError(scenario)


def predict(scenario: str, n: int, seeds, *, backends: int = 8, slots: int = 64, slowdown=None,
            window: str = "steady", **kw) -> dict:
    """Model medians over ``seeds`` for both policies: gap, peak and makespan (ticks)."""
    out = {}
    for policy in POLICIES:
        rows = []
        for s in seeds:
            d = durations_for(scenario, n, s, **kw)
            tr = simulate(d, backends, slots, policy, slowdown)
            t0, t1 = tr.window_steady(slots) if window == "steady" else (0.0, tr.makespan)
            m = metrics(tr.times, tr.loads, t0, t1)
            m["peak_all"] = metrics(tr.times, tr.loads)["peak"]
            m["makespan"] = tr.makespan
            rows.append(m)
        out[policy] = {k: _median([r[k] for r in rows]) for k in rows[0]}
    return out


def _median(xs):
    xs = sorted(xs)
    k = len(xs)
    return xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2])


def stationary_lognormal(mu=2.5, sigma=1.4, jobs=20000, seeds=range(5), backends=8, slots=64) -> dict:
    """Long-run time-averaged gap under (b), whole batch including the drain (the regime in which
    the issue's model quotes ~4.9 vs ~1.1)."""
    out = {}
    for policy in POLICIES:
        gs = []
        for s in seeds:
            rng = random.Random(s)
            d = [rng.lognormvariate(mu, sigma) for _ in range(jobs)]
            tr = simulate(d, backends, slots, policy)
            gs.append(metrics(tr.times, tr.loads)["gap"])
        out[policy] = _median(gs)
    return out


if __name__ == "__main__":  # a quick look at the model alone
    for sc, n in (("constant", 384), ("lognormal", 1024), ("periodic", 512)):
        p = predict(sc, n, range(5))
        print(sc, {pol: {k: round(v, 2) for k, v in m.items()} for pol, m in p.items()})
    p = predict("unequal", 256, range(1), slowdown=[1, 3] * 4, window="all")
    print("unequal", {pol: {k: round(v, 2) for k, v in m.items()} for pol, m in p.items()})
    print("lognormal, whole batch of 20000, incl. drain:", stationary_lognormal())
