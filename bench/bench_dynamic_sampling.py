#!/usr/bin/env python3
"""Step time of whole-group sampling strategies on a long-tailed task mix (one run, one service).

A GRPO step needs ``--groups`` N groups of ``--n`` samples. Tasks are synthetic-handler jobs
(no LLM, no sandbox: the service's own overhead plus the drawn latencies) with a long tail:
each task's median run latency is drawn from a lognormal (``--median-s``, sigma
``--task-sigma``) and each sample's from a lognormal around it (sigma 0.5). Outcome: each task
has a solve rate p (40% of tasks p=1, 30% p=0, 30% p=0.5); an unsolved sample is one whose
eval phase fails (the synthetic handler's ``fail.eval``), so a group is *usable* for GRPO when
its samples are mixed (some solved, some not): DAPO's "non-zero reward variance" filter, with
solved/unsolved standing in for the reward.

Strategies, each ``--steps`` times, interleaved (so load drifts hit all alike), medians:

* ``gather``: submit N groups, gather all of them (the step waits for the slowest sample);
* ``overprovision``: submit N * (1 + ``--extra``) groups, keep the first N complete, cancel the rest;
* ``gather_dapo``: DAPO by rounds: submit N groups, gather all, keep the usable ones, repeat
  until N usable groups (what a trainer does with plain gather and the filter);
* ``dynamic``: ``BatchClient.dynamic_sample``: N groups in flight, each rejected group
  replaced at once, stop (and cancel the rest) at N usable groups;
* ``dynamic_2x``: the same with 2N groups in flight (dynamic sampling + over-provisioning).

``gather`` is the baseline of ``overprovision`` and ``gather_dapo`` that of the two dynamic
ones; ratios are step-time medians over the baseline's, same run. Also reported: jobs
submitted per step and jobs cancelled per step (work thrown away).

    python bench/bench_dynamic_sampling.py --quick          # ~1 min
    python bench/bench_dynamic_sampling.py                  # ~5 min
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Rolloutd, loadavg, machine, median, revision  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def usable(group) -> bool:
    """Mixed outcomes: some samples solved (ok), some not (eval failed)."""
    solved = sum(t["status"] == "ok" for t in group)
    return 0 < solved < len(group)


def task_stream(rng: random.Random, median_s: float, task_sigma: float, tag: str):
    for k in itertools.count():
        med = median_s * math.exp(rng.gauss(0.0, task_sigma))
        p = rng.choices([1.0, 0.0, 0.5], weights=[0.4, 0.3, 0.3])[0]
        yield {"handler": "synthetic", "instance_id": f"{tag}-{k}", "timeout_s": 300.0,
               "instance": {"run": {"dist": "lognormal", "mu": math.log(med), "sigma": 0.5},
                            "fail": {"eval": 1.0 - p}}}


def run_gather(c, tasks, N, n):
    t0 = time.monotonic()
    b = c.submit([next(tasks) for _ in range(N)], n=n, deadline_s=600)
    c.gather(b)
    return time.monotonic() - t0, len(b), 0


def run_gather_dapo(c, tasks, N, n):
    t0 = time.monotonic()
    kept = jobs = 0
    while kept < N:
        b = c.submit([next(tasks) for _ in range(N)], n=n, deadline_s=600)
        trajs = c.gather(b)
        jobs += len(b)
        groups = [trajs[i:i + n] for i in range(0, len(trajs), n)]
        kept += sum(usable(g) for g in groups)
    return time.monotonic() - t0, jobs, 0


def run_overprovision(c, tasks, N, n, extra):
    k = math.ceil(N * (1 + extra))
    res = c.overprovision([next(tasks) for _ in range(k)], n, want=N, extra=extra, deadline_s=600)
    assert len(res.groups) == N, res
    return res.elapsed_s, res.submitted_jobs, len(res.cancelled)


def run_dynamic(c, tasks, N, n, inflight):
    res = c.dynamic_sample(tasks, n, want=N, inflight=inflight, accept=usable, deadline_s=600)
    assert len(res.groups) == N and all(usable(g) for g in res.groups), res
    return res.elapsed_s, res.submitted_jobs, len(res.cancelled)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, ~1 min")
    ap.add_argument("--groups", type=int, default=16, help="N: groups per step")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--median-s", type=float, default=0.2, help="median of the tasks' median run latency")
    ap.add_argument("--task-sigma", type=float, default=1.0, help="lognormal sigma across tasks (the tail)")
    ap.add_argument("--extra", type=float, default=0.5, help="over-provisioning: extra fraction of groups")
    ap.add_argument("--run-pool", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.n, args.steps, args.median_s = 8, 4, 3, 0.1

    from rolloutd.gateway.batch import BatchClient

    rng = random.Random(args.seed)
    N, n = args.groups, args.n
    strategies = {
        "gather": lambda c, t: run_gather(c, t, N, n),
        "overprovision": lambda c, t: run_overprovision(c, t, N, n, args.extra),
        "gather_dapo": lambda c, t: run_gather_dapo(c, t, N, n),
        "dynamic": lambda c, t: run_dynamic(c, t, N, n, N),
        "dynamic_2x": lambda c, t: run_dynamic(c, t, N, n, 2 * N),
    }
    rows = {k: [] for k in strategies}
    t_start = time.monotonic()
    with Rolloutd({"run.pool": args.run_pool, "init.pool": args.run_pool, "eval.pool": args.run_pool}) as rd, \
            BatchClient(rd.gateway, poll_wait_s=0.05) as c:
        for step in range(args.steps):
            for name, fn in strategies.items():
                tasks = task_stream(random.Random(rng.random()), args.median_s, args.task_sigma, f"{name}{step}")
                wall, jobs, cancelled = fn(c, tasks)
                rows[name].append({"wall_s": wall, "jobs": jobs, "cancelled": cancelled})
                print(f"step {step} {name:14s} {wall:7.3f} s  jobs {jobs:4d}  cancelled {cancelled:4d}", flush=True)
    summary = {}
    for name, rs in rows.items():
        summary[name] = {"step_s_median": round(median([r["wall_s"] for r in rs]), 3),
                         "jobs_median": median([r["jobs"] for r in rs]),
                         "cancelled_median": median([r["cancelled"] for r in rs])}
    base_of = {"overprovision": "gather", "gather_dapo": "gather_dapo", "gather": "gather",
               "dynamic": "gather_dapo", "dynamic_2x": "gather_dapo"}
    for name, s in summary.items():
        s["vs_baseline"] = round(s["step_s_median"] / summary[base_of[name]]["step_s_median"], 3)
        s["baseline"] = base_of[name]
    out = {"args": vars(args), "summary": summary, "wall_s": round(time.monotonic() - t_start, 1),
           "machine": machine(), "revision": revision(REPO), "loadavg": loadavg()}
    print("SUMMARY " + json.dumps(out))
    print(f"\n| strategy | step time (median) | vs baseline | jobs/step | cancelled/step |\n|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['step_s_median']:.3f} s | {s['vs_baseline']:.2f} x {s['baseline']} | "
              f"{s['jobs_median']:.0f} | {s['cancelled_median']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
