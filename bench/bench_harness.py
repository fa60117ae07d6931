"""End-to-end cost of a harness step through the harness handler, per preset (issues 12, 25).

One harness job = init (bwrap sandbox, venv mounted) + run (endpoint on a Unix socket, relay into
the sandbox, ``mini`` from PyPI: LiteLLM -> HTTP -> relay -> endpoint -> scripted backend -> back,
then the action run by mini in a subshell) + eval (``true``). A scripted policy makes mini take
exactly N steps (``echo step k``) and then submit, with zero backend latency, so everything
measured is overhead. Run with N = a and N = b (same run, interleaved, medians of ``--repeats``):

* per-step cost  = (run(b) - run(a)) / (b - a)           (one LLM call + one action, end to end)
* fixed cost     = run(a) - a * per-step                 (mini's start-up: Python, LiteLLM imports)
* endpoint share = the endpoint's own time per call (``metrics.llm_s`` / calls includes the backend
  round trip on loopback), for comparison with the per-step cost.

Every preset (``--presets``, default every one whose API route the endpoint serves): the coding
harnesses' steps are ``echo step k`` through the shell tool each offers (read from the rendered
prompt, as :class:`PresetOracle` does), then a final answer; side calls without tools (session
titles) get a title. Per preset also: start-up (the fixed cost: the harness's own launch until its
first call and its exit), the endpoint's time per call, and the calls-to-segments ratio (calls per
trajectory segment: 1 segment per conversation is the best a harness that makes side calls allows).
Aider makes one call per message (no steps): its row has the fixed cost only.

Usage: ``python bench/bench_harness.py [--quick] [--repeats R] [--steps A,B] [--venv DIR]
[--presets P1,P2|all]`` (``--quick``: mini-swe-agent and pi, N = 1, 4 and 2 repeats: about two
minutes). Prints one JSON line per preset; results and the command go to docs/BENCHMARKS.md by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import loadavg, machine, median, revision  # noqa: E402
from rolloutd.backends.policies import Policy, PolicyRequest  # noqa: E402


class EchoSteps(Policy):
    """mini-swe-agent's text format: N ``echo`` actions, then the submit command."""

    name = "echo_steps"

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def reply(self, request: PolicyRequest) -> str:
        from rolloutd.handlers.oracles import assistant_turns

        k = assistant_turns(request.prompt_text)
        cmd = f"echo step {k}" if k < self.steps else "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
        return f"THOUGHT: step {k}.\n\n```mswea_bash_command\n{cmd}\n```"


class ToolEchoSteps(Policy):
    """Any tool-calling harness: N ``echo`` commands through the shell tool it offers, then a
    final answer; a call without tools (a side call: a title) gets a title; aider's edit format
    (no tools) a plain answer."""

    name = "tool_echo_steps"

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def reply(self, request: PolicyRequest) -> str:
        from rolloutd.handlers.harness_presets import TITLE_REPLY, offered_tools, shell_call
        from rolloutd.handlers.oracles import assistant_turns

        text = request.prompt_text
        tools = offered_tools(text)
        if not tools:
            return "Done." if "SEARCH/REPLACE" in text else TITLE_REPLY
        k = assistant_turns(text)
        if k >= self.steps:
            return "All steps done."
        return f"Step {k}.\n" + (shell_call(tools, f"echo step {k}", f"step {k}") or "")


async def one_job(handler, preset: str, steps: int, backend_url: str, root: str) -> dict:
    from rolloutd.handlers.tasks import run_local

    inst = {"preset": preset, "task": "Benchmark: follow the instructions.",
            "limits": {"max_llm_calls": steps + 4, "wall_s": 600}, "eval": {"command": ["true"]}}
    # opencode names its session with one side call (a title, on its small model) per run
    want = (1 if preset == "aider" else steps + 1) + (1 if preset == "opencode" else 0)
    t0 = time.perf_counter()
    r = await run_local(handler, inst, backend_url=backend_url, runtime="bwrap", root_dir=root)
    wall = time.perf_counter() - t0
    if r["status"] != "ok" or r["metrics"]["llm_calls"] != want:
        segs = [len(s["turns"]) for s in (r.get("segments") or [r])]
        raise RuntimeError(f"bench job {preset} failed: {r['status']} {r['error']} turns per segment {segs}, "
                           f"metrics {r['metrics']} "
                           f"{(r['eval_details'].get('agent') or {}).get('output_tail', '')[-1500:]}")
    m = r["metrics"]
    return {"wall": wall, "run": r["timing"]["run"], "init": r["timing"]["init"], "eval": r["timing"]["eval"],
            "agent": r["eval_details"]["agent"]["duration_s"], "llm_calls": m["llm_calls"], "llm_s": m["llm_s"],
            "segments": m["segments"]}


def served_presets() -> list[str]:
    """Every preset whose API route the endpoint serves (probed without a network)."""
    from rolloutd.handlers.harness_presets import PRESETS

    sys.path.insert(0, str(REPO))
    from tests.harness.test_presets import PRESET_ROUTES, missing_route

    return [p for p in PRESETS if p != "openai-tools" and (p not in PRESET_ROUTES or missing_route(p) is None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", default=None, help="A,B (default 2,10; --quick 1,4)")
    ap.add_argument("--venv", default=None, help="agent venv (default: $ROLLOUTD_AGENT_VENV or /var/tmp/...)")
    ap.add_argument("--presets", default=None,
                    help="comma-separated presets, or 'all' (default: all served; --quick: mini-swe-agent,pi)")
    ns = ap.parse_args(argv)
    a, b = (int(x) for x in (ns.steps or ("1,4" if ns.quick else "2,10")).split(","))
    repeats = ns.repeats or (2 if ns.quick else 5)
    presets = (served_presets() if ns.presets in (None, "all") and not (ns.quick and ns.presets is None)
               else (ns.presets or "mini-swe-agent,pi").split(","))

    from rolloutd.handlers.harness import HarnessHandler
    from rolloutd.handlers.harness_presets import build_agent_venv
    from rolloutd.backends.scripted import ScriptedBackend
    from rolloutd.backends.tiny_model import make_tiny_model

    venv = build_agent_venv(ns.venv or os.environ.get("ROLLOUTD_AGENT_VENV")
                            or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}")
    work = Path(tempfile.mkdtemp(prefix="rb-h-", dir="/tmp"))
    os.chmod(work, 0o711)
    tok = str(make_tiny_model(work / "tok", tokenizer_only=True))
    # The coding harnesses' prompts run to ~40K tokens of the tiny vocabulary.
    backends = {(kind, n): ScriptedBackend(tok, policy=(EchoSteps if kind == "mini" else ToolEchoSteps)(n),
                                           max_model_len=1 << 20)
                for kind in ("mini", "tools") for n in (a, b)}
    for be in backends.values():
        be.start()
    handler = HarnessHandler({"tokenizer": tok, "agent_venv": venv})
    handler.name = "harness"
    try:
        for preset in presets:
            kind = "mini" if preset == "mini-swe-agent" else "tools"
            ns_ = (a,) if preset == "aider" else (a, b)
            rows: dict[int, list[dict]] = {n: [] for n in ns_}
            url = {n: backends[(kind, n)].url for n in ns_}
            asyncio.run(one_job(handler, preset, a, url[a], str(work / "sb")))  # warm: page cache, venv
            for _ in range(repeats):
                for n in ns_:  # interleaved: drift in the machine's load hits both alike
                    rows[n].append(asyncio.run(one_job(handler, preset, n, url[n], str(work / "sb"))))
            print(json.dumps(summary(preset, rows, a, b, repeats, ns)), flush=True)
    finally:
        for be in backends.values():
            be.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


def summary(preset: str, rows: dict, a: int, b: int, repeats: int, ns) -> dict:
    every = [r for n in rows for r in rows[n]]
    run_a = median(r["run"] for r in rows[a])
    per_step = (median(r["run"] for r in rows[b]) - run_a) / (b - a) if b in rows else None
    calls = [r["llm_s"] / r["llm_calls"] for r in every]
    return {
        "bench": "harness", "preset": preset, "steps": sorted(rows), "repeats": repeats,
        "run_median_s": {str(n): round(median(r["run"] for r in rows[n]), 3) for n in rows},
        "per_step_s": None if per_step is None else round(per_step, 4),
        "fixed_s": round(run_a - a * (per_step or 0.0), 3),
        "init_median_s": round(median(r["init"] for r in every), 3),
        "eval_median_s": round(median(r["eval"] for r in every), 3),
        "endpoint_call_median_ms": round(1000 * median(calls), 2),
        "calls_per_segment": round(sum(r["llm_calls"] for r in every) / max(1, sum(r["segments"] for r in every)), 3),
        "loadavg": loadavg(), "machine": machine(), "revision": revision(REPO),
        "command": "python bench/bench_harness.py" + (" --quick" if ns.quick else "")
                   + (f" --repeats {ns.repeats}" if ns.repeats else "") + (f" --steps {ns.steps}" if ns.steps else "")
                   + (f" --presets {ns.presets}" if ns.presets else ""),
    }


if __name__ == "__main__":
    sys.exit(main())
