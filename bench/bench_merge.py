"""Prefix merging, measured (issue 37 item 7): how many trainer rows the harness calls become.

Polar reports 1,185 harness calls becoming 218 trainer updates by prefix merging (5.4 calls per
row). Here: whole harness jobs of every preset (the real CLIs, unmodified, in bwrap, through the
harness handler's ``run_local``) against the scripted backend with the tiny model's tokenizer,
each a multi-call episode: N ``echo`` steps through the harness's own shell tool, then a final
answer (mini-swe-agent: its text format); side calls (opencode's session title) as each harness
makes them. Per preset: LLM calls, segments (one trainer row each), forks, side segments,
re-encoded sampled tokens, rows per call. ``--compact N`` turns on the harness's own compaction (Codex:
``model_auto_compact_token_limit``; Claude Code: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW``, 50 %; OpenCode, Pi: the model's context window). Subagent and retry episodes are not scripted
(docs/BENCHMARKS.md says what is and is not covered).

Usage: ``python bench/bench_merge.py [--steps N] [--repeats R] [--presets P1,P2|all] [--compact N]
[--venv DIR] [--quick]`` (``--quick``: 2 steps, 1 episode, two presets; what ``make bench-smoke`` runs).
Prints one JSON line per preset and a total; the table goes to docs/BENCHMARKS.md by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_harness import EchoSteps, ToolEchoSteps, served_presets  # noqa: E402
from bench.common import loadavg, machine, revision  # noqa: E402

POLAR = {"calls": 1185, "rows": 218}


async def episode(handler, preset: str, steps: int, backend_url: str, root: str, compact: int | None = None) -> dict:
    from rolloutd.handlers.harness_presets import PRESETS
    from rolloutd.handlers.tasks import run_local

    inst = {"preset": preset, "task": "Benchmark: follow the instructions.",
            "limits": {"max_llm_calls": steps + 4, "wall_s": 600}, "eval": {"command": ["true"]}}
    if compact is not None:  # the harness's own auto-compaction at this token count
        if preset == "codex":  # its config.toml
            cfg = PRESETS["codex"]["home_files"][".codex/config.toml"]
            inst["home_files"] = {".codex/config.toml": f"model_auto_compact_token_limit = {compact}\n" + cfg}
        elif preset == "claude-code":  # the window its auto-compact threshold is a share of
            inst["env"] = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(compact), "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "50"}
        elif preset == "opencode":  # the model's context limit in its opencode.json
            path = ".config/opencode/opencode.json"
            cfg = json.loads(PRESETS["opencode"]["home_files"][path])
            cfg["provider"]["rolloutd"]["models"]["{model}"]["limit"] = {"context": compact, "output": 4096}
            inst["home_files"] = {path: json.dumps(cfg)}
        elif preset == "pi":  # the model's contextWindow in its models.json
            path = ".pi/agent/models.json"
            cfg = json.loads(PRESETS["pi"]["home_files"][path])
            cfg["providers"]["rolloutd"]["models"][0]["contextWindow"] = compact
            inst["home_files"] = {path: json.dumps(cfg)}
    r = await run_local(handler, inst, backend_url=backend_url, runtime="bwrap", root_dir=root)
    if r["status"] != "ok" and compact is None:
        raise RuntimeError(f"bench job {preset} failed: {r['status']} {r['error']}")
    m = r["metrics"]
    out = {k: m[k] for k in ("llm_calls", "segments", "forks", "side_segments", "assistant_tokens_reencoded",
                             "assistant_tokens_reused", "fork_fallbacks")}
    out["failed"] = int(r["status"] != "ok")  # a compaction episode may end in the harness's own error
    if out["failed"]:
        print(json.dumps({"preset": preset, "status": r["status"], "error": str(r["error"])[-400:]}), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--venv", default=None)
    ap.add_argument("--presets", default="all")
    ap.add_argument("--compact", type=int, default=None,
                    help="codex: model_auto_compact_token_limit; claude-code: CLAUDE_CODE_AUTO_COMPACT_WINDOW "
                         "(threshold 50%%); opencode, pi: the model's context window: each harness's own compaction")
    ap.add_argument("--quick", action="store_true",
                    help="make bench-smoke: 2 steps, 1 episode, mini-swe-agent and pi only")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.steps, ns.repeats, ns.presets = 2, 1, "mini-swe-agent,pi"
    presets = served_presets() if ns.presets == "all" else ns.presets.split(",")
    presets = [p for p in presets if p != "aider"]  # one call per message: nothing to merge

    from rolloutd.handlers.harness import HarnessHandler
    from rolloutd.handlers.harness_presets import build_agent_venv
    from rolloutd.llm.scripted import ScriptedBackend
    from rolloutd.llm.tiny_model import make_tiny_model

    venv = build_agent_venv(ns.venv or os.environ.get("ROLLOUTD_AGENT_VENV")
                            or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}")
    work = Path(tempfile.mkdtemp(prefix="rb-m-", dir="/tmp"))
    os.chmod(work, 0o711)
    tok = str(make_tiny_model(work / "tok", tokenizer_only=True))
    backends = {kind: ScriptedBackend(tok, policy=cls(ns.steps), max_model_len=1 << 20)
                for kind, cls in (("mini", EchoSteps), ("tools", ToolEchoSteps))}
    for be in backends.values():
        be.start()
    handler = HarnessHandler({"tokenizer": tok, "agent_venv": venv})
    handler.name = "harness"
    total = {"calls": 0, "rows": 0, "reencoded": 0}
    try:
        for preset in presets:
            url = backends["mini" if preset == "mini-swe-agent" else "tools"].url
            compact = ns.compact if preset in ("codex", "claude-code", "opencode", "pi") else None
            runs = [asyncio.run(episode(handler, preset, ns.steps, url, str(work / "sb"), compact))
                    for _ in range(ns.repeats)]
            row = {k: sum(r[k] for r in runs) for k in runs[0]}
            row.update(bench="merge", preset=preset, episodes=len(runs), steps=ns.steps, compact=compact,
                       rows_per_call=round(row["segments"] / row["llm_calls"], 4),
                       calls_per_row=round(row["llm_calls"] / row["segments"], 2))
            total["calls"] += row["llm_calls"]
            total["rows"] += row["segments"]
            total["reencoded"] += row["assistant_tokens_reencoded"]
            print(json.dumps(row), flush=True)
    finally:
        for be in backends.values():
            be.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "merge", "total": total, "calls_per_row": round(total["calls"] / max(1, total["rows"]), 2),
                      "polar": POLAR, "polar_calls_per_row": round(POLAR["calls"] / POLAR["rows"], 2),
                      "loadavg": loadavg(), "machine": machine(), "revision": revision(REPO),
                      "command": f"python bench/bench_merge.py --steps {ns.steps} --repeats {ns.repeats}"
                                 + (f" --presets {ns.presets}" if ns.presets != "all" else "")
                                 + (f" --compact {ns.compact}" if ns.compact else "")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
