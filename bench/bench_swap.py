#!/usr/bin/env python3
"""A checkpoint swap in the middle of a GRPO step, under each ``router.stale_policy`` (issue 27).

A step is ``--groups`` x ``--n`` samples, one ``synthetic_llm`` job each: one generation of a
long-tailed length (max_tokens drawn lognormal, median ``--median-tokens``, sigma ``--sigma``,
capped at ``--max-tokens``) on a scripted SGLang-API server (and, for ``continue_vllm``, a vLLM-API one,
whose calls under ``continue`` stream so the interrupt keeps what arrived) sampling ``--per-token-s`` s
per token. When half of the step's jobs are done, the next version is registered on a second server
(the old one is not cleared: one server per version, as in a rolling swap), with
``max_policy_lag = 0``. The step ends when every sample is back. One ``rolloutd up`` per policy,
all up at once, steps interleaved across them (load drift hits all alike); medians over steps.

Per policy:
* ``wall_s``: step time (submit to last result);
* ``wasted_tokens``: tokens the servers sampled that the trainer cannot use: everything sampled
  minus the sampled tokens of ``ok`` trajectories (abort_requeue's stopped attempts, drop's
  failed jobs, tokens a disconnect threw away: on the vLLM API those sampled but not yet received
  when the stream closed);
* ``stale_tokens``: tokens sampled by the old version in ok trajectories delivered after the swap
  (off-policy data the trainer must importance-correct or drop: ``finish`` delivers whole old
  generations, ``continue`` only the part sampled before the swap);
* ``ok``: usable samples per step.

    python bench/bench_swap.py --quick     # ~1 min
    python bench/bench_swap.py             # ~4 min
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
import time

import numpy as np
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Rolloutd, loadavg, machine, median, revision  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# (label, stale_policy, server API): continue on the vLLM API streams its calls (SGLang's abort returns the tokens)
VARIANTS = (("finish", "finish", "sglang"), ("abort_requeue", "abort_requeue", "sglang"), ("drop", "drop", "sglang"),
            ("continue", "continue", "sglang"), ("continue_vllm", "continue", "vllm"))


def lengths(rng: random.Random, k: int, med: float, sigma: float, cap: int) -> list[int]:
    return [max(1, min(cap, int(med * math.exp(rng.gauss(0.0, sigma))))) for _ in range(k)]


def one_step(c, servers, step: int, lens: list[int], n: int, tag: str, api: str) -> dict:
    old, new = servers[step % 2], servers[(step + 1) % 2]
    before = sum(s.stats["tokens_sampled"] for s in servers)
    tasks = [{"handler": "synthetic_llm", "instance_id": f"{tag}-{step}-{g}",
              "instance": {"llm_calls": 1, "max_tokens": lens[g * n + k], "seed": g * n + k}}
             for g in range(len(lens) // n) for k in range(n)]
    t0 = time.perf_counter()
    ids = c.submit(tasks)
    got, swapped, after = [], False, []
    for r in c.gather(ids, timeout_s=600, wait_s=0.05):
        got.append(r)
        if swapped:
            after.append(r)
        if not swapped and len(got) >= len(ids) // 2:
            c.add_backend(new.url, api=api, policy_version=step + 1)
            swapped = True
    wall = time.perf_counter() - t0
    end = time.monotonic() + 10  # disconnects of stopped jobs reach the servers a moment later: count them here
    while any(x.num_running for x in servers) and time.monotonic() < end:
        time.sleep(0.01)
    sampled = sum(s.stats["tokens_sampled"] for s in servers) - before
    ok = [r for r in got if r["status"] == "ok"]
    kept = sum(int(np.asarray(r["loss_mask"], dtype=np.int64).sum()) for r in ok)
    stale = sum(t["end"] - t["start"] for r in after if r["status"] == "ok" for t in r["turns"]
                if t["policy_version"] <= step)
    errors = collections.Counter(f"{r['status']}:{(r.get('error') or {}).get('type')}" for r in got if r["status"] != "ok")
    return {"errors": dict(errors), "wall_s": wall, "wasted_tokens": sampled - kept, "stale_tokens": stale, "ok": len(ok), "longest": max(lens),
            "sampled_tokens": sampled, "attempts": sum(r.get("attempts", 1) for r in got) - len(got)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 groups x 4, 2 steps")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--median-tokens", type=float, default=32)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--per-token-s", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--only", help="comma-separated variant labels (default: all)")
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.n, args.steps = 4, 4, 2
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]

    from rolloutd.backends.policies import get_policy
    from rolloutd.backends.scripted import ScriptedBackend
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = "tok " * (args.max_tokens + 8)
    rng = random.Random(args.seed)
    rows: dict[str, list[dict]] = {label: [] for label, _, _ in VARIANTS}
    services, backends = {}, []
    try:
        for p, policy, api in variants:
            services[p] = Rolloutd({"router.max_policy_lag": 0, "router.stale_policy": policy}).start()
            pair = [ScriptedBackend(tok, policy=get_policy("constant", text=text),
                                    latency=f"constant:0.005,{args.per_token_s}") for _ in range(2)]
            for b in pair:
                b.start()
            backends.append(pair)
            with services[p].client() as c:
                c.add_backend(pair[0].url, api=api, policy_version=0)
        for step in range(args.steps):
            lens = lengths(rng, args.groups * args.n, args.median_tokens, args.sigma, args.max_tokens)
            for i, (p, _, api) in enumerate(variants):  # the same lengths for every policy
                with services[p].client() as c:
                    row = one_step(c, backends[i], step, lens, args.n, p, api)
                rows[p].append(row)
                if row["errors"]:  # say why (the service's warnings), then go on
                    seen = services[p].log().splitlines()
                    print("\n".join(line[:300] for line in seen[-4000:] if "job_" in line or "presumed" in line
                                    or "lease" in line)[-3000:], flush=True)
                print(json.dumps({"step": step, "policy": p, **{k: v if isinstance(v, dict) else round(v, 3)
                                                                for k, v in row.items()}}), flush=True)
    finally:
        for b in (b for pair in backends for b in pair):
            b.stop()
        for s in services.values():
            s.stop()
    rows = {p: rs for p, rs in rows.items() if rs}
    base = median(r["wall_s"] for r in rows.get("finish") or next(iter(rows.values())))
    summary = {p: {"wall_s": round(median(r["wall_s"] for r in rs), 3),
                   "vs_finish": round(median(r["wall_s"] for r in rs) / base, 2),
                   "wasted_tokens": median(r["wasted_tokens"] for r in rs),
                   "stale_tokens": median(r["stale_tokens"] for r in rs),
                   "ok": median(r["ok"] for r in rs), "sampled_tokens": median(r["sampled_tokens"] for r in rs),
                   "extra_attempts": median(r["attempts"] for r in rs)} for p, rs in rows.items()}
    print("| stale_policy | wall/step (median) | vs finish | wasted tokens | stale tokens kept | ok samples | extra attempts |")
    print("|---|---|---|---|---|---|---|")
    for p, s in summary.items():
        print(f"| {p} | {s['wall_s']:.2f} s | {s['vs_finish']:.2f} | {s['wasted_tokens']:g} of {s['sampled_tokens']:g} "
              f"| {s['stale_tokens']:g} | {s['ok']:g} / {args.groups * args.n} | {s['extra_attempts']:g} |")
    meta = {"machine": machine(), "load": loadavg(), "revision": revision(REPO), "args": vars(args) | {"json": None}}
    print("META", json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows, "meta": meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
