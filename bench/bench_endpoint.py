#!/usr/bin/env python3
"""CPU the OpenAI-compatible endpoint adds per LLM call, against the built-in agent loop.

Same run, same scripted backend (a separate process, zero latency, the ``tool_then_answer``
policy of ``bench_agent_loop.py``: ``--turns - 1`` Hermes tool calls, then an answer, with the
same observation text between turns):

* built-in: ``--rollouts`` concurrent rollouts of ``run_agent_loop`` (``LLMClient``,
  ``Conversation``, the Hermes parser) in this process: CPU per turn (``time.process_time``);
* endpoint: one ``EndpointSession`` + uvicorn server per rollout on a Unix socket in this process
  (as the run daemon serves each harness job), driven by an agent in a *separate* process (the
  ``openai`` SDK's tool loop: it sends back the assistant message with its ``tool_calls`` and one
  tool message per call); CPU of this process per LLM call while the agent runs.

``added`` = endpoint - built-in, the CPU the endpoint costs per call on top of the loop it
replaces (HTTP serving by uvicorn, JSON, history matching, response shaping). The agent's own CPU
(openai SDK, pydantic) is in its process and not counted. Medians over ``--repeats``; every
trajectory is checked (one segment, ``--turns`` turns). Example::

    python bench/bench_endpoint.py --rollouts 16 --turns 8 --repeats 3
    python bench/bench_endpoint.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_loop import BASH_TOOL, OBSERVATION, ROOT, start_backend, tokenizer_dir
from bench.common import stop_procs
from rolloutd.llm.agent_loop import run_agent_loop
from rolloutd.llm.client import LLMClient, SamplingParams, simple_generate
from rolloutd.llm.conversation import Conversation
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.llm.tokenizer_utils import load_tokenizer
from rolloutd.llm.toolparse import get_parser

SYSTEM = "You are a software engineering agent working in a sandbox."

# Both drivers end the same way: READY, wait for a line on stdin, run every rollout at once, DONE.
_GO = r"""
async def main():
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print("DONE " + json.dumps(await asyncio.gather(*[one(i, s) for i, s in enumerate(socks)])), flush=True)

asyncio.run(main())
"""

# The agent: an openai-SDK tool loop, one rollout per socket, all at once. READY, then waits for a
# line on stdin, runs, prints DONE and the number of calls per rollout.
DRIVER = r"""
import asyncio, importlib, json, sys
import openai
httpx_lib = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
socks, turns, obs, tools, system = json.loads(sys.stdin.readline())

async def one(i, sock):
    http = httpx_lib.AsyncClient(transport=httpx_lib.AsyncHTTPTransport(uds=sock), timeout=120)
    c = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="k", max_retries=0, http_client=http)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Task {i}: the test suite fails; find the bug and fix it."}]
    n = 0
    try:
        while n < turns:
            r = await c.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=512)
            n += 1
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                break
            msgs += [{"role": "tool", "tool_call_id": tc.id, "content": obs} for tc in m.tool_calls]
    finally:
        await c.close()
    return n

"""


# The same agent speaking the other API shapes (issue 25): plain httpx over the Unix socket (the
# agent's CPU is not counted, so an SDK would add nothing to the figure), each shape's own history
# format sent back unchanged: Anthropic content blocks with tool_use / tool_result, Responses
# input items with function_call / function_call_output, Gemini contents with functionCall /
# functionResponse parts.
SHAPE_DRIVER = r"""
import asyncio, json, sys
import httpx
shape, socks, turns, obs, tools, system = json.loads(sys.stdin.readline())
fn = tools[0]["function"]

def first(i):
    return "Task %d: the test suite fails; find the bug and fix it." % i

async def one(i, sock):
    c = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock), base_url="http://localhost", timeout=120,
                          headers={"x-api-key": "k", "authorization": "Bearer k", "x-goog-api-key": "k"})
    n = 0
    try:
        if shape == "anthropic":
            msgs = [{"role": "user", "content": first(i)}]
            tl = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
            while n < turns:
                r = (await c.post("/v1/messages", json={"model": "m", "system": system, "messages": msgs, "tools": tl,
                                                        "max_tokens": 512})).raise_for_status().json()
                n += 1
                msgs.append({"role": "assistant", "content": r["content"]})
                uses = [b for b in r["content"] if b["type"] == "tool_use"]
                if not uses:
                    break
                msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": obs}
                                                         for b in uses]})
        elif shape == "responses":
            items = [{"role": "user", "content": first(i)}]
            tl = [{"type": "function", "name": fn["name"], "description": fn["description"],
                   "parameters": fn["parameters"]}]
            while n < turns:
                r = (await c.post("/v1/responses", json={"model": "m", "instructions": system, "input": items,
                                                         "tools": tl, "store": False,
                                                         "max_output_tokens": 512})).raise_for_status().json()
                n += 1
                items += r["output"]
                calls = [o for o in r["output"] if o["type"] == "function_call"]
                if not calls:
                    break
                items += [{"type": "function_call_output", "call_id": o["call_id"], "output": obs} for o in calls]
        elif shape == "gemini":
            contents = [{"role": "user", "parts": [{"text": first(i)}]}]
            tl = [{"functionDeclarations": [{"name": fn["name"], "description": fn["description"],
                                             "parameters": fn["parameters"]}]}]
            while n < turns:
                r = (await c.post("/v1beta/models/m:generateContent",
                                  json={"systemInstruction": {"parts": [{"text": system}]}, "contents": contents,
                                        "tools": tl, "generationConfig": {"maxOutputTokens": 512}})
                     ).raise_for_status().json()
                n += 1
                content = r["candidates"][0]["content"]
                contents.append(content)
                calls = [p["functionCall"] for p in content.get("parts", []) if "functionCall" in p]
                if not calls:
                    break
                contents.append({"role": "user", "parts": [{"functionResponse": {"name": f["name"], "id": f.get("id"),
                                                                                 "response": {"output": obs}}}
                                                           for f in calls]})
        else:
            raise SystemExit("unknown shape " + shape)
    finally:
        await c.aclose()
    return n

"""
DRIVER += _GO
SHAPE_DRIVER += _GO
SHAPES = ("chat", "anthropic", "responses", "gemini")


async def builtin_phase(url: str, tok, n: int, turns: int) -> dict:
    parser = get_parser("hermes")
    params = SamplingParams(max_tokens=512)

    async def execute(call) -> str:
        return OBSERVATION

    async with LLMClient(url, timeout=120) as client:
        gen = simple_generate(client, "scripted", 0)

        async def one(i: int):
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Task {i}: the test suite fails; find the bug and fix it."}]
            conv = Conversation(tok, msgs, [BASH_TOOL], 32768)
            return await run_agent_loop(gen, conv, parser, execute, params, turns, tok)

        await one(-1)  # warm-up: connection, renderer cache
        c0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*[one(i) for i in range(n)])
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    calls = sum(len(r.turns) for r in res)
    if calls != n * turns:
        raise RuntimeError(f"built-in loop: {calls} turns, expected {n * turns}")
    return {"calls": calls, "cpu_ms_per_call": cpu / calls * 1e3, "wall_s": wall}


async def endpoint_phase(url: str, tok, n: int, turns: int, tmp: Path, shape: str = "chat") -> dict:
    async with LLMClient(url, timeout=120) as client:
        sessions, servers, socks = [], [], []
        for i in range(n + 1):  # session 0 warms up
            s = EndpointSession(simple_generate(client, "scripted", 0), tok, limits=EndpointLimits(max_tokens=512))
            sock = str(tmp / f"ep{i}.sock")
            servers.append(await serve(make_app(s), uds=sock))
            sessions.append(s)
            socks.append(sock)
        try:
            async def drive(which: list[str]) -> tuple[list[int], float, float]:
                env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                driver, head = (DRIVER, []) if shape == "chat" else (SHAPE_DRIVER, [shape])
                p = await asyncio.create_subprocess_exec(sys.executable, "-c", driver, stdin=subprocess.PIPE,
                                                         stdout=subprocess.PIPE, env=env)
                try:
                    p.stdin.write((json.dumps(head + [which, turns, OBSERVATION, [BASH_TOOL], SYSTEM]) + "\n").encode())
                    await p.stdin.drain()
                    line = await asyncio.wait_for(p.stdout.readline(), 120)
                    if not line.startswith(b"READY"):
                        raise RuntimeError(f"agent driver did not start: {line!r}")
                    c0, t0 = time.process_time(), time.perf_counter()
                    p.stdin.write(b"go\n")
                    await p.stdin.drain()
                    line = await asyncio.wait_for(p.stdout.readline(), 600)
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                    if not line.startswith(b"DONE "):
                        raise RuntimeError(f"agent driver failed: {line!r}")
                    return json.loads(line[5:]), cpu, wall
                finally:
                    if p.returncode is None:
                        p.kill()
                    await p.wait()

            await drive(socks[:1])
            calls_per, cpu, wall = await drive(socks[1:])
        finally:
            for srv in servers:
                await srv.stop()
    calls = sum(calls_per)
    for s in sessions[1:]:
        t = s.trajectory()
        if t["metrics"]["segments"] != 1 or len(t["turns"]) != turns:
            raise RuntimeError(f"endpoint trajectory: {t['metrics']}, {len(t['turns'])} turns")
    if calls != n * turns:
        raise RuntimeError(f"endpoint: {calls} calls, expected {n * turns}")
    reused = statistics.fmean(s.metrics["assistant_tokens_reused"] for s in sessions[1:])
    return {"calls": calls, "cpu_ms_per_call": cpu / calls * 1e3, "wall_s": wall, "reused_tokens": reused}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=16, help="concurrent rollouts (one endpoint each)")
    ap.add_argument("--turns", type=int, default=8, help="LLM calls per rollout (turns-1 tool calls)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer", choices=["auto", "qwen", "tiny"], default="auto")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 rollouts x 4 turns, one repeat")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="API shapes the agent speaks, each against the same built-in run (default: all four)")
    args = ap.parse_args(argv)
    shapes = [x for x in args.shapes.split(",") if x]
    if set(shapes) - set(SHAPES):
        ap.error(f"--shapes: one of {SHAPES}")
    if args.quick:
        args.rollouts, args.turns, args.repeats = 4, 4, 1
    import uvicorn

    tok_dir, tok_desc = tokenizer_dir(args.tokenizer)
    tok = load_tokenizer(tok_dir)
    proc, port = start_backend(tok_dir, args.turns)
    url = f"http://127.0.0.1:{port}"
    print(f"# tokenizer: {tok_desc}; backend: scripted (separate process, zero latency) at {url}")
    print(f"# python {sys.version.split()[0]}, uvicorn {uvicorn.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="rb-ep-", dir="/tmp") as d:
            for rep in range(args.repeats):
                b = asyncio.run(builtin_phase(url, tok, args.rollouts, args.turns))
                for shape in shapes:  # interleaved with the built-in run they are compared with
                    e = asyncio.run(endpoint_phase(url, tok, args.rollouts, args.turns, Path(d), shape))
                    rows.append({"shape": shape, "builtin": b, "endpoint": e,
                                 "added": e["cpu_ms_per_call"] - b["cpu_ms_per_call"]})
                    print(f"  repeat {rep + 1} {shape:>9}: built-in {b['cpu_ms_per_call']:.3f} ms CPU/call | endpoint "
                          f"{e['cpu_ms_per_call']:.3f} ms CPU/call | added {rows[-1]['added']:.3f} ms", flush=True)
    finally:
        stop_procs([proc], wait_s=10)
    med = statistics.median
    summary = {"tokenizer": tok_desc, "rollouts": args.rollouts, "turns": args.turns, "repeats": args.repeats,
               "builtin_cpu_ms_per_call": med(r["builtin"]["cpu_ms_per_call"] for r in rows),
               "load_average_end": os.getloadavg()[0], "shapes": {}}
    for shape in shapes:
        rs = [r for r in rows if r["shape"] == shape]
        summary["shapes"][shape] = {"endpoint_cpu_ms_per_call": med(r["endpoint"]["cpu_ms_per_call"] for r in rs),
                                    "added_cpu_ms_per_call": med(r["added"] for r in rs),
                                    "reused_tokens_per_rollout": rs[0]["endpoint"]["reused_tokens"]}
    print(json.dumps(summary, indent=2))
    for shape, v in summary["shapes"].items():
        ok = v["added_cpu_ms_per_call"] < 1.0
        print(f"# {shape}: added CPU per call {v['added_cpu_ms_per_call']:.3f} ms: target < 1 ms "
              f"{'met' if ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
