"""FastTransport against httpx's default transport: client CPU per request at N requests in flight.

Why this exists: ``rolloutd.llm.http_transport.FastTransport`` replaces httpx's default
transport (httpcore) for plain-http LLM backends because httpcore's pool did not scale to the
~1,000 requests a run daemon keeps in flight. This benchmark re-checks that against the
installed httpx; if the default transport comes within 20% of FastTransport's CPU per request at
1,000 in flight, FastTransport should be deleted (issue 15).

Setup: a uvicorn server (httptools, the stack vLLM and SGLang run) in a child process on
127.0.0.1 answers ``POST /v1/completions`` with a fixed vLLM-shaped JSON reply (64 tokens with
logprobs and ids); the request body is a pre-encoded prompt of 512 token ids. One
``httpx.AsyncClient`` per run, N tasks each sending R sequential requests after one warm-up
request per task (so every transport starts with its connections open). CPU is
``time.process_time()`` of this (client) process only; the server's CPU is not counted. Runs of
the transports alternate within each repeat so they share the machine's load; medians of the
repeats. If ``httpx2`` (pydantic's fork, which the openai SDK now uses) is installed, its default
transport is measured too, for reference.

    .venv/bin/python bench/bench_transport.py            # 100 and 1,000 in flight, 3 repeats
    .venv/bin/python bench/bench_transport.py --quick    # smoke: 200 in flight, 1 repeat, < 60 s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import die_with_parent, stop_procs  # noqa: E402
from tests.llm.uvicorn_server import quiet_config, serve_printing_port, wait_ready  # noqa: E402

PROMPT_IDS = 512
REPLY_TOKENS = 64


def reply_body() -> bytes:
    ids = list(range(1000, 1000 + REPLY_TOKENS))
    toks = [f"token_id:{t}" for t in ids]
    lps = [-0.5] * REPLY_TOKENS
    return json.dumps({
        "id": "cmpl-bench", "object": "text_completion", "model": "bench",
        "choices": [{"index": 0, "text": "x" * REPLY_TOKENS, "finish_reason": "length", "stop_reason": None,
                     "token_ids": ids,
                     "logprobs": {"tokens": toks, "token_logprobs": lps, "text_offset": list(range(REPLY_TOKENS)),
                                  "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)]}}],
        "usage": {"prompt_tokens": PROMPT_IDS, "completion_tokens": REPLY_TOKENS,
                  "total_tokens": PROMPT_IDS + REPLY_TOKENS},
    }).encode()


# -- server (child process) ---------------------------------------------------------------------
def serve(http: str) -> int:
    import uvicorn

    body = reply_body()
    head = {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    msg = {"type": "http.response.body", "body": body}
    ports: set[int] = set()  # client ports seen since the last /connections: one per connection

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/connections":
            data = str(len(ports)).encode()
            ports.clear()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(data)).encode()), (b"connection", b"close")]})
            return await send({"type": "http.response.body", "body": data})
        ports.add(scope["client"][1])
        await send(head)
        await send(msg)

    serve_printing_port(uvicorn.Server(quiet_config(app, http=http, backlog=4096)))
    return 0


def start_server(http: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", http], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(ROOT), preexec_fn=die_with_parent)
    port = wait_ready(proc)
    if port is None:
        stop_server(proc)
        raise RuntimeError("uvicorn did not start")
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    stop_procs([proc])
    proc.stdout.close()


def server_connections(url: str) -> int:
    """Connections the server saw since the last call (warm-up included)."""
    with urllib.request.urlopen(url + "/connections", timeout=30) as r:
        return int(r.read())


# -- client -------------------------------------------------------------------------------------
def make_client(kind: str, url: str, n: int):
    """An AsyncClient with the transport under test; pool sized for n, long timeouts (pool included)."""
    if kind == "httpx2":
        mod = importlib.import_module("httpx2")
    else:
        import httpx as mod
    limits = mod.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=4.0)
    transport = None
    if kind == "fast":
        from rolloutd.llm.http_transport import FastTransport

        transport = FastTransport(max_connections=n, keepalive_expiry=4.0)
    return mod.AsyncClient(base_url=url, transport=transport, limits=limits, timeout=mod.Timeout(300.0),
                           trust_env=False)


async def run_one(kind: str, url: str, n: int, rounds: int) -> dict:
    body = json.dumps({"model": "bench", "prompt": list(range(1000, 1000 + PROMPT_IDS)), "max_tokens": REPLY_TOKENS,
                       "logprobs": 0, "return_token_ids": True}).encode()
    headers = {"content-type": "application/json"}
    failures: collections.Counter[str] = collections.Counter()

    async with make_client(kind, url, n) as c:
        async def one(k: int) -> None:
            for _ in range(k):
                try:
                    r = await c.post("/v1/completions", content=body, headers=headers)
                    if r.status_code != 200 or len(r.content) < 100:
                        failures[f"HTTP {r.status_code}"] += 1
                except Exception as e:
                    failures[f"{type(e).__name__}: {e}"[:120]] += 1

        await asyncio.gather(*[one(1) for _ in range(n)])  # warm-up: every connection open
        failures.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*[one(rounds) for _ in range(n)])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    reqs = n * rounds
    return {"transport": kind, "in_flight": n, "requests": reqs, "failures": sum(failures.values()),
            "failure_kinds": dict(failures), "wall_s": wall, "cpu_s": cpu,
            "cpu_ms_per_req": cpu / reqs * 1e3, "req_per_s": reqs / wall}


def versions() -> dict:
    import h11
    import httpcore
    import httpx
    import uvicorn

    v = {"python": sys.version.split()[0], "httpx": httpx.__version__, "httpcore": httpcore.__version__,
         "uvicorn": uvicorn.__version__, "h11": h11.__version__}
    try:
        v["httpx2"] = importlib.import_module("httpx2").__version__
    except ImportError:
        pass
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", metavar="HTTP", help=argparse.SUPPRESS)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[100, 1000], help="concurrent requests")
    ap.add_argument("--rounds", type=int, default=4, help="sequential requests per task after the warm-up")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--http", choices=["httptools", "h11"], default="httptools", help="uvicorn's HTTP stack")
    ap.add_argument("--no-httpx2", action="store_true", help="skip the httpx2 reference column")
    ap.add_argument("--only-fast", action="store_true", help="FastTransport alone (to look at its failures)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 200 in flight, 2 rounds, 1 repeat, no httpx2 (< 60 s on a busy 2-core box)")
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    if args.quick:
        args.in_flight, args.rounds, args.repeats, args.no_httpx2 = [200], 2, 1, True
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("uvicorn is not installed (pip install rolloutd[test]); nothing to measure", file=sys.stderr)
        return 2
    kinds = ["fast"] if args.only_fast else ["fast", "httpx"]
    if not (args.no_httpx2 or args.only_fast):
        try:
            importlib.import_module("httpx2")
            kinds.append("httpx2")
        except ImportError:
            pass

    t_start = time.monotonic()
    v = versions()
    print(f"# {v}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"# uvicorn[{args.http}] in a child process; {PROMPT_IDS}-id prompt, {REPLY_TOKENS}-token reply; "
          f"{args.rounds} requests per task after a warm-up; client CPU only; failures are summed over repeats")
    proc, url = start_server(args.http)
    rows: list[dict] = []
    try:
        for rep in range(args.repeats):
            for n in args.in_flight:
                order = kinds if rep % 2 == 0 else kinds[::-1]
                for kind in order:
                    server_connections(url)  # reset the count
                    r = asyncio.run(run_one(kind, url, n, args.rounds))
                    r["repeat"] = rep
                    r["connections"] = server_connections(url)
                    rows.append(r)
                    print(f"  repeat {rep + 1}, {n:>5} in flight, {kind:<6}: {r['cpu_ms_per_req']:.3f} ms CPU/req, "
                          f"{r['req_per_s']:,.0f} req/s, {r['connections']} connections for {n * (args.rounds + 1)} requests, "
                          f"{r['failures']} failed {r['failure_kinds'] or ''}", flush=True)
    finally:
        stop_server(proc)

    summary: dict = {"versions": v, "args": {k: val for k, val in vars(args).items() if k != "json"}, "results": {}}
    print(f"\nmedians of {args.repeats} repeat(s):")
    print("| in flight | transport | CPU ms/request | requests/s | connections opened (per run) | failed | "
          "CPU vs FastTransport |")
    print("|---|---|---|---|---|---|---|")
    verdict = None
    for n in args.in_flight:
        med = {}
        for kind in kinds:
            rs = [r for r in rows if r["in_flight"] == n and r["transport"] == kind]
            med[kind] = {
                "cpu_ms_per_req": statistics.median(r["cpu_ms_per_req"] for r in rs),
                "req_per_s": statistics.median(r["req_per_s"] for r in rs),
                "failures": sum(r["failures"] for r in rs),
                "connections": statistics.median(r["connections"] for r in rs),
                "requests_per_run": n * (args.rounds + 1),
            }
        for kind in kinds:
            ratio = med[kind]["cpu_ms_per_req"] / med["fast"]["cpu_ms_per_req"]
            med[kind]["cpu_ratio_vs_fast"] = ratio
            print(f"| {n:,} | {kind} | {med[kind]['cpu_ms_per_req']:.3f} | {med[kind]['req_per_s']:,.0f} | "
                  f"{med[kind]['connections']:,.0f} of {med[kind]['requests_per_run']:,} requests | "
                  f"{med[kind]['failures']} | {ratio:.2f}x |")
        summary["results"][str(n)] = med
        if n == 1000 and "httpx" in med:
            verdict = med["httpx"]["cpu_ratio_vs_fast"]
    if verdict is not None:
        caught_up = verdict <= 1.2
        summary["httpx_default_cpu_ratio_at_1000"] = verdict
        summary["httpx_caught_up"] = caught_up
        print(f"\nhttpx {v['httpx']} default transport at 1,000 in flight: {verdict:.2f}x FastTransport's CPU per "
              f"request -> {'caught up (<= 1.2x): delete FastTransport' if caught_up else 'keep FastTransport'}")
    summary["runtime_s"] = time.monotonic() - t_start
    print(f"runtime {summary['runtime_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
