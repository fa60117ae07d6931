#!/usr/bin/env python3
"""CPU per call of one endpoint session replaying a long chat history, without HTTP: this tree
against a baseline tree, in the same run.

What the endpoint does per call besides serving HTTP -- the request's translation (JSON body ->
messages, with the per-session history cache), its placement in the job's conversation (history
match, rendering and tokenizing the new messages) and the reply's parse -- measured on one
``EndpointSession`` driven directly (``session._chat(body)``), so neither uvicorn nor an agent
process adds its noise: ``bench_endpoint.py`` resolves the endpoint's whole cost, whose run-to-run
spread on a shared 2-core VM (+-20-30%) hides a 10% change in this part.

Each measurement is its own process importing the tree under test (``bench.common.source_env``):
a chat agent's history of ``--history`` messages (system, task, then assistant tool call + tool
result pairs, every reply sampled by the session from a function that always calls the tool),
built untimed, then ``--calls`` measured calls. Per call: ``thread`` = the session's counted CPU
(its endpoint-thread work and the reply's parse), ``process`` = the whole process. Trees alternate
(baseline, this, this, baseline, ...); the medians of the per-run medians, and their ratio.

    python bench/bench_endpoint_session.py --root /tmp/base   # /tmp/base: a git worktree of an older commit
    python bench/bench_endpoint_session.py --quick
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_agent_loop import BASH_TOOL, OBSERVATION, tokenizer_dir  # noqa: E402

# Runs in the measured tree's process: rolloutd imports only (the bench's own modules would put
# this checkout first on sys.path and measure it twice).
_ONE = r"""
import asyncio, gc, json, statistics, sys, time
import numpy as np
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.session import EndpointSession
from rolloutd.endpoint.shapes.chat import chat_response
from rolloutd.llm.client import Generation
from rolloutd.llm.tokenizer_utils import load_tokenizer

a = json.loads(sys.argv[1])
tok = load_tokenizer(a["tokenizer"])
gc.collect()
gc.freeze()  # as the run daemon does after its set-up
eos = tok.convert_tokens_to_ids("<|im_end|>")
call = tok.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
                  add_special_tokens=False) + [eos]
IDS, LPS = np.asarray(call, np.int32), np.full(len(call), -0.5, np.float32)


async def generate(prompt_ids, params):
    await asyncio.sleep(0)  # one loop turn, as a reply arriving on a socket takes
    return Generation(token_ids=IDS, logprobs=LPS, finish_reason="stop", prompt_tokens=len(prompt_ids)), "inline", 0


async def main():
    s = EndpointSession(generate, tok, limits=EndpointLimits(max_tokens=512, max_context=a["max_context"]))
    msgs = [{"role": "system", "content": "You are a software engineering agent working in a sandbox."},
            {"role": "user", "content": "Task 0: the test suite fails; find the bug and fix it."}]
    warm = (a["history"] - 2) // 2
    thread, proc = [], []
    for i in range(warm + a["calls"]):
        body = json.dumps({"model": "m", "messages": msgs, "tools": a["tools"], "max_tokens": 512}).encode()
        c0, p0 = s.metrics["endpoint_cpu_s"], time.process_time()
        r, _ = await s._chat(body)
        m = chat_response(r)["choices"][0]["message"]
        if i >= warm:
            thread.append(s.metrics["endpoint_cpu_s"] - c0)
            proc.append(time.process_time() - p0)
        if not m.get("tool_calls"):
            raise RuntimeError(f"call {i}: the reply has no tool call: {m}")
        msgs.append({k: v for k, v in m.items() if v is not None})
        msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": a["obs"]} for tc in m["tool_calls"]]
    t = s.trajectory()
    if t["metrics"]["segments"] != 1 or t["metrics"]["assistant_tokens_reencoded"]:
        raise RuntimeError(f"the replay did not stay one conversation, none re-encoded: {t['metrics']}")
    return {"thread_us": statistics.median(thread) * 1e6, "process_us": statistics.median(proc) * 1e6,
            "messages": len(msgs) - 2}


print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
"""


def run_one(root: Path, args: dict) -> dict:
    env, cwd = common.source_env(root)
    p = subprocess.run([sys.executable, "-c", _ONE, json.dumps(args)], env=env, cwd=cwd, capture_output=True,
                       text=True, timeout=900, preexec_fn=common.die_with_parent)
    return common.child_result(p.stdout, p.returncode, p.stderr, f"the replay in {root}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_baseline_arg(ap)
    ap.add_argument("--history", type=int, default=200, help="messages before the measured calls (even, >= 4)")
    ap.add_argument("--calls", type=int, default=40, help="measured calls per run")
    ap.add_argument("--repeats", type=int, default=4, help="runs per tree, alternated")
    ap.add_argument("--tokenizer", choices=["auto", "qwen", "tiny"], default="auto")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 messages, 5 calls, one run per tree")
    a = ap.parse_args(argv)
    if a.quick:
        a.history, a.calls, a.repeats = 20, 5, 1
    if a.history < 4 or a.history % 2:
        ap.error("--history: an even number >= 4 (system, task, then call + result pairs)")
    tok_dir, tok_desc = tokenizer_dir(a.tokenizer)
    args = {"tokenizer": str(tok_dir), "history": a.history, "calls": a.calls, "tools": [BASH_TOOL],
            "obs": OBSERVATION, "max_context": 131072}
    here = common.REPO
    trees = common.ab_trees(a.root)
    print(f"# tokenizer: {tok_desc}; {a.history} messages of history, {a.calls} measured calls per run; "
          f"{common.machine()}, load {common.loadavg()} at start; this tree at {common.revision(here)}")
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for rep in range(a.repeats):
        order = common.in_turn(trees, rep)
        for name, root in order:
            r = run_one(root, args)
            runs[name].append(r)
            print(f"  run {rep + 1} {name:>8}: thread {r['thread_us']:7.1f} us, process {r['process_us']:7.1f} us per call"
                  f" ({r['messages']} messages at the end)", flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in ("thread_us", "process_us")}
               for name, rs in runs.items()}
    for name, v in summary.items():
        print(f"# {name:>8}: median thread {v['thread_us']:.1f} us, process {v['process_us']:.1f} us per call")
    if a.root:
        t, b = summary["this"], summary["baseline"]
        print(f"# this / baseline: thread {t['thread_us'] / b['thread_us']:.3f}, "
              f"process {t['process_us'] / b['process_us']:.3f}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: v for k, v in args.items() if k != "tools"}, "runs": runs,
                                      "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
