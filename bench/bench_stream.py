#!/usr/bin/env python3
"""What streaming a vLLM call costs the run daemon: client CPU and wall per generation, whole
reply (``stream: false``) against streamed (``stream: true``, ``LLMClient.generate(partial=...)``),
as ``stale_policy = "continue"`` does on the vLLM API (issue 27; decision in docs/TRAINERS.md).

Setup: ``rolloutd scripted-backend`` in a child process (its CPU is not counted) sampling
``--per-token-s`` per token, one chunk per token when on time, as vLLM streams one per decode step.
One ``LLMClient`` (FastTransport); ``--inflight`` tasks, each ``--calls`` sequential generations of
exactly ``--tokens`` tokens after one warm-up call. CPU is ``time.process_time()`` of this
process; the two modes alternate within each repeat (same load), medians over repeats.

    .venv/bin/python bench/bench_stream.py            # 64 in flight, 32/256/1024 tokens, 3 repeats
    .venv/bin/python bench/bench_stream.py --quick    # 32 in flight, 256 tokens, 1 repeat
"""
from __future__ import annotations

import argparse
import asyncio
import json
import select
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import die_with_parent, loadavg, machine, median, revision, short_tmpdir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def start_backend(tok_dir: Path, per_token: float, max_tokens: int) -> tuple[subprocess.Popen, str]:
    text = "tok " * (max_tokens + 8)
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd", "scripted-backend", "--port", "0", "--tokenizer",
                             str(tok_dir), "--policy", f"constant:text={text}",
                             "--latency", f"constant:0.002,{per_token}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1)[0]:
            line = proc.stdout.readline()
            if line.startswith(b"READY"):
                return proc, f"http://127.0.0.1:{int(line.split()[1])}"
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("scripted backend did not start")


async def run(url: str, stream: bool, tokens: int, inflight: int, calls: int) -> dict:
    from rolloutd.llm.client import LLMClient, Partial, SamplingParams

    p = SamplingParams(max_tokens=tokens)
    prompt = list(range(1, 513))
    async with LLMClient(url, "vllm", timeout=600) as c:
        async def worker(n):
            for _ in range(n):
                g = await c.generate(prompt, p, partial=Partial() if stream else None)
                assert len(g.token_ids) == tokens, len(g.token_ids)

        await asyncio.gather(*(worker(1) for _ in range(inflight)))  # warm-up: connections open
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(calls) for _ in range(inflight)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    n = inflight * calls
    return {"cpu_ms_per_call": 1000 * cpu / n, "wall_s": wall, "cpu_us_per_token": 1e6 * cpu / (n * tokens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", default="32,256,1024")
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-token-s", type=float, default=0.002)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.inflight, args.calls, args.repeats = "256", 32, 2, 1
    sizes = [int(x) for x in args.tokens.split(",")]


    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    tmp = short_tmpdir("bench-stream-")
    build_tiny_tokenizer().save_pretrained(str(tmp))
    proc, url = start_backend(tmp, args.per_token_s, max(sizes))
    rows = {}
    try:
        for tokens in sizes:
            got = {"whole": [], "stream": []}
            for _ in range(args.repeats):
                for mode in ("whole", "stream"):
                    got[mode].append(asyncio.run(run(url, mode == "stream", tokens, args.inflight, args.calls)))
            rows[tokens] = {m: {k: round(median(r[k] for r in rs), 3) for k in rs[0]} for m, rs in got.items()}
            print(json.dumps({"tokens": tokens, **rows[tokens]}), flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    print("| tokens per call | client CPU per call, whole | streamed | ratio | wall per round, whole | streamed |")
    print("|---|---|---|---|---|---|")
    for tokens, r in rows.items():
        w, s = r["whole"], r["stream"]
        print(f"| {tokens} | {w['cpu_ms_per_call']:.2f} ms | {s['cpu_ms_per_call']:.2f} ms | "
              f"{s['cpu_ms_per_call'] / w['cpu_ms_per_call']:.1f}x | {w['wall_s']:.2f} s | {s['wall_s']:.2f} s |")
    print("META", json.dumps({"machine": machine(), "load": loadavg(), "revision": revision(REPO), "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
