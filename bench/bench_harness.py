"""End-to-end cost of a mini-swe-agent step through the harness (issue 12).

One harness job = init (bwrap sandbox, venv mounted) + run (endpoint on a Unix socket, relay into
the sandbox, ``mini`` from PyPI: LiteLLM -> HTTP -> relay -> endpoint -> scripted backend -> back,
then the action run by mini in a subshell) + eval (``true``). A scripted policy makes mini take
exactly N steps (``echo step k``) and then submit, with zero backend latency, so everything
measured is overhead. Run with N = a and N = b (same run, interleaved, medians of ``--repeats``):

* per-step cost  = (run(b) - run(a)) / (b - a)           (one LLM call + one action, end to end)
* fixed cost     = run(a) - a * per-step                 (mini's start-up: Python, LiteLLM imports)
* endpoint share = the endpoint's own time per call (``metrics.llm_s`` / calls includes the backend
  round trip on loopback), for comparison with the per-step cost.

Usage: ``python bench/bench_harness.py [--quick] [--repeats R] [--steps A,B] [--venv DIR]``
(``--quick``: N = 1, 4 and 2 repeats: about a minute). Prints one JSON line; results and the
command go to docs/BENCHMARKS.md by hand.
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
from rolloutd.llm.policies import Policy, PolicyRequest  # noqa: E402


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


async def one_job(handler, steps: int, backend_url: str, root: str) -> dict:
    from rolloutd.handlers.tasks import run_local

    inst = {"preset": "mini-swe-agent", "task": "Benchmark: follow the instructions.",
            "limits": {"max_llm_calls": steps + 2, "wall_s": 300}, "eval": {"command": ["true"]}}
    t0 = time.perf_counter()
    r = await run_local(handler, inst, backend_url=backend_url, runtime="bwrap", root_dir=root)
    wall = time.perf_counter() - t0
    if r["status"] != "ok" or len(r["turns"]) != steps + 1:
        raise RuntimeError(f"bench job failed: {r['status']} {r['error']} turns={len(r['turns'])} "
                           f"{(r['eval_details'].get('agent') or {}).get('output_tail', '')[-1500:]}")
    m = r["metrics"]
    return {"wall": wall, "run": r["timing"]["run"], "init": r["timing"]["init"], "eval": r["timing"]["eval"],
            "agent": r["eval_details"]["agent"]["duration_s"], "llm_calls": m["llm_calls"], "llm_s": m["llm_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", default=None, help="A,B (default 2,10; --quick 1,4)")
    ap.add_argument("--venv", default=None, help="agent venv (default: $ROLLOUTD_AGENT_VENV or /var/tmp/...)")
    ns = ap.parse_args(argv)
    a, b = (int(x) for x in (ns.steps or ("1,4" if ns.quick else "2,10")).split(","))
    repeats = ns.repeats or (2 if ns.quick else 5)

    from rolloutd.handlers.harness import HarnessHandler
    from rolloutd.handlers.harness_presets import build_agent_venv
    from rolloutd.llm.scripted import ScriptedBackend
    from rolloutd.llm.tiny_model import make_tiny_model

    venv = build_agent_venv(ns.venv or os.environ.get("ROLLOUTD_AGENT_VENV")
                            or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}")
    work = Path(tempfile.mkdtemp(prefix="rb-h-", dir="/tmp"))
    os.chmod(work, 0o711)
    tok = str(make_tiny_model(work / "tok", tokenizer_only=True))
    backends = {n: ScriptedBackend(tok, policy=EchoSteps(n)) for n in (a, b)}
    for be in backends.values():
        be.start()
    handler = HarnessHandler({"tokenizer": tok, "agent_venv": venv})
    handler.name = "harness"
    rows: dict[int, list[dict]] = {a: [], b: []}
    try:
        asyncio.run(one_job(handler, a, backends[a].url, str(work / "sb")))  # warm: page cache, venv
        for _ in range(repeats):
            for n in (a, b):  # interleaved: drift in the machine's load hits both alike
                rows[n].append(asyncio.run(one_job(handler, n, backends[n].url, str(work / "sb"))))
    finally:
        for be in backends.values():
            be.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    run_a, run_b = median(r["run"] for r in rows[a]), median(r["run"] for r in rows[b])
    per_step = (run_b - run_a) / (b - a)
    calls = [r["llm_s"] / r["llm_calls"] for n in (a, b) for r in rows[n]]
    out = {
        "bench": "harness_mini_swe_agent", "steps": [a, b], "repeats": repeats,
        "run_median_s": {str(a): round(run_a, 3), str(b): round(run_b, 3)},
        "per_step_s": round(per_step, 4), "fixed_s": round(run_a - a * per_step, 3),
        "init_median_s": round(median(r["init"] for n in (a, b) for r in rows[n]), 3),
        "eval_median_s": round(median(r["eval"] for n in (a, b) for r in rows[n]), 3),
        "endpoint_call_median_ms": round(1000 * median(calls), 2),
        "loadavg": loadavg(), "machine": machine(), "revision": revision(REPO),
        "command": "python bench/bench_harness.py" + (" --quick" if ns.quick else "")
                   + (f" --repeats {ns.repeats}" if ns.repeats else "") + (f" --steps {ns.steps}" if ns.steps else ""),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
