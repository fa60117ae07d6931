"""Prefix merging, measured (issue 37 item 7): how many trainer rows the harness calls become.

Polar reports 1,185 harness calls becoming 218 trainer updates by prefix merging (5.4 calls per
row), over episodes with subagents, retries, compaction and parallel calls. Here: whole harness
jobs of every preset (the real CLIs, unmodified, in bwrap, through the harness handler's
``run_local``) against the scripted backend with the tiny model's tokenizer playing
:class:`rolloutd.handlers.harness_episodes.EpisodePolicy` (mini-swe-agent: its text format, echo
steps only). Episode kinds, each N echo steps through the harness's own shell tool, then a final
answer, side calls (opencode's title) as each harness makes them:

* ``linear``: the steps only;
* ``parallel``: two shell calls in one reply at step 1 (every CLI runs both);
* ``subagent``: at step 2 the harness's subagent tool (Claude Code ``Agent``, Qwen Code ``agent``,
  Gemini CLI ``invoke_agent``, OpenCode ``task``), one shell step in the subagent;
* ``retry``: an empty reply at step 2, which Claude Code and Qwen Code send again (the others end
  their run on it: not run for them);
* ``compaction``: the harness's own compaction (``compaction_instance``), set a few steps past the
  preset's first prompt (measured in its linear episode: ``COMPACT_AFTER``); Gemini CLI with a
  pause at step 5 (its compression needs a "Please continue." to split at);
* ``mixed``: all of them in one episode (a Polar-like episode): subagent at 2, parallel at 4,
  retry at 6 where the CLI retries, compaction; Gemini CLI pauses at 5.

Per preset and kind: LLM calls, segments (one trainer row each), forks, side segments,
re-encoded sampled tokens, rows per call; totals per kind beside Polar's figure.

Usage: ``python bench/bench_merge.py [--steps N] [--repeats R] [--presets P1,P2|all]
[--kinds K1,K2|all] [--venv DIR] [--quick]`` (``--quick``: 2 steps, 1 episode, mini-swe-agent and
pi, linear and parallel; what ``make bench-smoke`` runs). Prints one JSON line per preset and kind,
one per kind with its totals, and the overall total; the table goes to docs/BENCHMARKS.md by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_harness import EchoSteps, served_presets  # noqa: E402
from bench.common import loadavg, machine, revision  # noqa: E402

POLAR = {"calls": 1185, "rows": 218}
KINDS = ("linear", "parallel", "subagent", "retry", "compaction", "mixed")
SUBAGENTS = ("claude-code", "qwen-code", "gemini-cli", "opencode")  # presets with a subagent tool
RETRIES = ("claude-code", "qwen-code")  # presets that send a request again after an empty reply
COMPACTS = ("codex", "claude-code", "opencode", "pi", "qwen-code", "gemini-cli")
METRICS = ("llm_calls", "segments", "forks", "side_segments", "assistant_tokens_reencoded", "assistant_tokens_reused",
           "fork_fallbacks")


def runs_kind(preset: str, kind: str) -> bool:
    """Whether ``preset`` takes part in episodes of ``kind``."""
    if preset == "mini-swe-agent":
        return kind == "linear"
    return {"subagent": preset in SUBAGENTS, "retry": preset in RETRIES,
            "compaction": preset in COMPACTS}.get(kind, True)


def episode_spec(preset: str, kind: str, steps: int, base: int | None, scale: float = 1.0) -> tuple[dict, int | None]:
    """(the episode's knobs, the compaction threshold or None) for ``preset`` and ``kind``."""
    from rolloutd.handlers.harness_episodes import COMPACT_AFTER

    knobs: dict = {}
    if kind in ("parallel", "mixed"):
        knobs["parallel_at"] = 1 if kind == "parallel" else min(4, steps - 1)
    if kind in ("subagent", "mixed") and preset in SUBAGENTS:
        knobs["subagent_at"] = min(2, steps - 1)
    if kind in ("retry", "mixed") and preset in RETRIES:
        knobs["retry_at"] = min(2 if kind == "retry" else 6, steps - 1)
    at = None
    if kind in ("compaction", "mixed") and preset in COMPACTS and base is not None:
        at = base + round(COMPACT_AFTER[preset] * scale)
        if preset == "gemini-cli":  # past its threshold (it compresses at a pause only)
            knobs["pause_at"] = min(round(5 * scale), steps - 1)
    return knobs, at


async def episode(handler, preset: str, steps: int, backend_url: str, root: str, knobs: dict,
                  at: int | None, policy=None, compact_scale: float = 1.0) -> dict:
    from rolloutd.handlers.harness_episodes import compaction_instance, episode_tag, episode_task
    from rolloutd.handlers.tasks import run_local

    task = ("Benchmark: follow the instructions." if preset == "mini-swe-agent"
            else episode_task(steps, nonce=uuid.uuid4().int % 10 ** 9, **knobs))
    inst = {"preset": preset, "task": task, "limits": {"max_llm_calls": 3 * steps + 12, "wall_s": 900},
            "eval": {"command": ["true"]}}
    if at is not None:
        extra = compaction_instance(preset, at)
        inst["limits"].update(extra.pop("limits", {}))
        inst.update(extra)
    r = await run_local(handler, inst, backend_url=backend_url, runtime="bwrap", root_dir=root)
    m = r["metrics"]
    out = {k: m[k] for k in METRICS}
    out["failed"] = int(r["status"] != "ok")
    out["exit"] = (r["eval_details"].get("agent") or {}).get("exit_code")  # 1: Claude Code's "Autocompact is thrashing"
    # what the model did in it (EpisodePolicy's count for this episode): finished, summaries, ...
    out["did"] = dict(policy.episodes.get(episode_tag(task), {})) if policy is not None else {}
    # the main conversation's first prompt (the largest first prompt: opencode's title call is small)
    segs = r.get("segments") or [r]
    out["first_prompt"] = max((len(s["prompt_ids"]) for s in segs), default=0)
    if out["failed"]:
        print(json.dumps({"preset": preset, "status": r["status"], "error": str(r["error"])[-400:]}), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--venv", default=None)
    ap.add_argument("--presets", default="all")
    ap.add_argument("--kinds", default="all", help="comma-separated of " + ",".join(KINDS))
    ap.add_argument("--compact-scale", type=float, default=1.0,
                    help="compaction threshold past the first prompt: COMPACT_AFTER x this (5: about 5x as many steps "
                         "between compactions)")
    ap.add_argument("--quick", action="store_true",
                    help="make bench-smoke: 2 steps, 1 episode, mini-swe-agent and pi, linear and parallel")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.steps, ns.repeats, ns.presets, ns.kinds = 2, 1, "mini-swe-agent,pi", "linear,parallel"
    if ns.steps < 3 and ns.kinds != "linear,parallel":
        ap.error("--steps must be at least 3 for the subagent, retry, compaction and mixed episodes")
    presets = served_presets() if ns.presets == "all" else ns.presets.split(",")
    presets = [p for p in presets if p != "aider"]  # one call per message: nothing to merge
    kinds = list(KINDS) if ns.kinds == "all" else ns.kinds.split(",")
    if set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    if any(k in kinds for k in ("compaction", "mixed")) and "linear" not in kinds:
        kinds.insert(0, "linear")  # its first prompt sets the compaction threshold

    from rolloutd.handlers.harness import HarnessHandler
    from rolloutd.handlers.harness_episodes import EpisodePolicy
    from rolloutd.handlers.harness_presets import build_agent_venv
    from rolloutd.backends.scripted import ScriptedBackend
    from rolloutd.backends.tiny_model import make_tiny_model

    venv = build_agent_venv(ns.venv or os.environ.get("ROLLOUTD_AGENT_VENV")
                            or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}")
    work = Path(tempfile.mkdtemp(prefix="rb-m-", dir="/tmp"))
    os.chmod(work, 0o711)
    tok = str(make_tiny_model(work / "tok", tokenizer_only=True))
    # the coding harnesses' prompts run to ~40K tokens of the tiny vocabulary
    policy = EpisodePolicy(ns.steps)
    backends = {"mini": ScriptedBackend(tok, policy=EchoSteps(ns.steps), max_model_len=1 << 20),
                "tools": ScriptedBackend(tok, policy=policy, max_model_len=1 << 20)}
    for be in backends.values():
        be.start()
    handler = HarnessHandler({"tokenizer": tok, "agent_venv": venv})
    handler.name = "harness"
    totals = {k: dict.fromkeys(("calls", "rows", "forks", "reencoded", "episodes", "failed"), 0) for k in kinds}
    try:
        for preset in presets:
            url = backends["mini" if preset == "mini-swe-agent" else "tools"].url
            base = None
            for kind in kinds:
                if not runs_kind(preset, kind):
                    continue
                knobs, at = episode_spec(preset, kind, ns.steps, base, ns.compact_scale)
                runs = [asyncio.run(episode(handler, preset, ns.steps, url, str(work / "sb"), knobs, at, policy))
                        for _ in range(ns.repeats)]
                if kind == "linear":
                    base = max(r["first_prompt"] for r in runs)
                row = {k: sum(r[k] for r in runs) for k in (*METRICS, "failed")}
                did: dict[str, int] = {}
                for r in runs:
                    for k, v in r["did"].items():
                        did[k] = did.get(k, 0) + v
                row["did"] = did
                row["exits"] = [r["exit"] for r in runs]
                row.update(bench="merge", preset=preset, kind=kind, episodes=len(runs), steps=ns.steps, knobs=knobs,
                           compact_at=at, first_prompt=base, compact_scale=ns.compact_scale,
                           rows_per_call=round(row["segments"] / max(1, row["llm_calls"]), 4),
                           calls_per_row=round(row["llm_calls"] / max(1, row["segments"]), 2))
                t = totals[kind]
                for a, b in (("calls", "llm_calls"), ("rows", "segments"), ("forks", "forks"),
                             ("reencoded", "assistant_tokens_reencoded"), ("failed", "failed")):
                    t[a] += row[b]
                t["episodes"] += len(runs)
                print(json.dumps(row), flush=True)
    finally:
        for be in backends.values():
            be.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    for kind, t in totals.items():
        print(json.dumps({"bench": "merge", "kind": kind, **t,
                          "calls_per_row": round(t["calls"] / max(1, t["rows"]), 2)}), flush=True)
    every = {a: sum(t[a] for t in totals.values())
             for a in ("calls", "rows", "forks", "reencoded", "episodes", "failed")}
    print(json.dumps({"bench": "merge", "total": every,
                      "calls_per_row": round(every["calls"] / max(1, every["rows"]), 2),
                      "polar": POLAR, "polar_calls_per_row": round(POLAR["calls"] / POLAR["rows"], 2),
                      "loadavg": loadavg(), "machine": machine(), "revision": revision(REPO),
                      "command": f"python bench/bench_merge.py --steps {ns.steps} --repeats {ns.repeats}"
                                 + (f" --presets {ns.presets}" if ns.presets != "all" else "")
                                 + (f" --kinds {ns.kinds}" if ns.kinds != "all" else "")
                                 + (f" --compact-scale {ns.compact_scale:g}" if ns.compact_scale != 1 else "")}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
