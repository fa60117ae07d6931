#!/usr/bin/env python3
"""CPU per request of the job endpoint's HTTP server alone: this tree against a baseline tree,
in the same run.

The server a job's agent talks to (``endpoint.server.serve``: uvicorn with rolloutd's bounded
protocol) in its own process, on a Unix socket, serving an app that only reads the body and
answers a fixed reply, so what is measured is the HTTP layer: reading and parsing the request,
the ASGI hand-over, writing the reply. The request is what an agent resends late in an episode:
a chat body of ``--history`` messages (~71 KB at 200) with an OpenAI SDK's headers; the reply a
~1.5 KB JSON body, or (``--stream``) 24 SSE events in chunked encoding. One client (this process)
sends ``--requests`` requests on one kept-alive connection, one at a time; the server's process
CPU over them (after 50 unmeasured) divided by their number. Trees alternate (baseline, this,
this, baseline, ...); the median of the runs, and the ratio.

    python bench/bench_endpoint_http.py --root /tmp/base   # /tmp/base: a git worktree of an older commit
    python bench/bench_endpoint_http.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Runs in the measured tree's process (rolloutd imports only: see bench_endpoint_session).
_SERVER = r"""
import asyncio, json, sys, time
from rolloutd.endpoint.server import serve

a = json.loads(sys.argv[1])
REPLY = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
                                 "content": "x" * 1200, "tool_calls": []}}]}).encode()
EVENTS = [b"data: " + json.dumps({"choices": [{"delta": {"content": "tok%d " % i * 8}}]}).encode() + b"\n\n"
          for i in range(24)]
count, marks = 0, {}
done = asyncio.Event()


async def app(scope, receive, send):
    global count
    if scope["type"] != "http":
        return
    more = True
    while more:
        m = await receive()
        more = m.get("more_body", False)
    count += 1
    if count == a["warmup"] + 1:
        marks["t0"] = time.process_time()
    if a["stream"]:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for e in EVENTS:
            await send({"type": "http.response.body", "body": e, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]})
        await send({"type": "http.response.body", "body": REPLY})
    if count == a["warmup"] + a["requests"]:
        marks["t1"] = time.process_time()
        done.set()


async def main():
    srv = await serve(app, uds=a["uds"])
    await asyncio.wait_for(done.wait(), 600)
    await srv.stop()
    return (marks["t1"] - marks["t0"]) / a["requests"] * 1e6


print("RESULT " + json.dumps({"us_per_request": asyncio.run(main())}), flush=True)
"""

_HEADERS = (b"Host: localhost\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
            b"Accept: application/json\r\nContent-Type: application/json\r\nUser-Agent: OpenAI/Python 1.82.0\r\n"
            b"X-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.82.0\r\nX-Stainless-OS: Linux\r\n"
            b"X-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.2\r\n"
            b"Authorization: Bearer sk-job-0123456789abcdef\r\nX-Stainless-Async: false\r\n"
            b"x-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n")


def chat_request(history: int) -> bytes:
    msgs = [{"role": "system", "content": "You are a software engineering agent working in a sandbox."},
            {"role": "user", "content": "Task 0: the test suite fails; find the bug and fix it."}]
    for i in range((history - 2) // 2):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": f"ls -la src/pkg{i}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}",
                     "content": "total 24\n" + "-rw-r--r-- 1 agent agent 1024 Dec  6 12:00 module_%d.py\n" % i * 5})
    body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 512, "logprobs": True}).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\n" + _HEADERS + b"Content-Length: %d\r\n\r\n" % len(body) + body


def read_reply(s: socket.socket, buf: bytearray) -> None:
    """One whole reply from ``s`` (content-length or chunked); what follows stays in ``buf``."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            if not head.startswith(b"http/1.1 200"):
                raise RuntimeError(f"the server answered {head[:80]!r}")
            if b"content-length:" in head:
                n = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                if len(buf) >= end + 4 + n:
                    del buf[:end + 4 + n]
                    return
            else:
                stop = buf.find(b"\r\n0\r\n\r\n", end)
                if stop >= 0:
                    del buf[:stop + 7]
                    return
        d = s.recv(1 << 16)
        if not d:
            raise RuntimeError("the server closed the connection")
        buf += d


def run_one(root: Path, args: dict, request: bytes) -> float:
    env, cwd = common.source_env(root)
    with tempfile.TemporaryDirectory(prefix="rb-http-", dir="/tmp") as tmp:
        args = dict(args, uds=os.path.join(tmp, "s.sock"))
        p = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(args)], env=env, cwd=cwd, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=common.die_with_parent)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(60)
                deadline = time.monotonic() + 60
                while True:  # until the server listens
                    try:
                        s.connect(args["uds"])
                        break
                    except (FileNotFoundError, ConnectionRefusedError):
                        if p.poll() is not None or time.monotonic() > deadline:
                            p.kill()
                            raise RuntimeError(f"the server in {root} did not start: "
                                               f"{p.communicate()[1][-2000:]}") from None
                        time.sleep(0.05)
                buf = bytearray()
                for _ in range(args["warmup"] + args["requests"]):
                    s.sendall(request)
                    read_reply(s, buf)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return common.child_result(out, p.returncode, err, f"the server in {root}")["us_per_request"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_baseline_arg(ap)
    ap.add_argument("--history", type=int, default=200, help="messages in the request body (even, >= 2)")
    ap.add_argument("--requests", type=int, default=400, help="measured requests per run")
    ap.add_argument("--repeats", type=int, default=6, help="runs per tree and reply kind, alternated")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 messages, 20 requests, one run per tree")
    a = ap.parse_args(argv)
    if a.quick:
        a.history, a.requests, a.repeats = 20, 20, 1
    if a.history < 2 or a.history % 2:
        ap.error("--history: an even number >= 2")
    request = chat_request(a.history)
    here = common.REPO
    trees = common.ab_trees(a.root)
    print(f"# request {len(request):,} bytes ({a.history} messages), {a.requests} measured per run; "
          f"{common.machine()}, load {common.loadavg()} at start; this tree at {common.revision(here)}")
    runs: dict[str, dict[str, list[float]]] = {}
    for kind in ("json", "stream"):
        args = {"warmup": 50, "requests": a.requests, "stream": kind == "stream"}
        for rep in range(a.repeats):
            order = common.in_turn(trees, rep)
            for name, root in order:
                us = run_one(root, args, request)
                runs.setdefault(kind, {}).setdefault(name, []).append(us)
                print(f"  {kind:>6} run {rep + 1} {name:>8}: {us:7.1f} us per request", flush=True)
    summary = {kind: {name: statistics.median(v) for name, v in by.items()} for kind, by in runs.items()}
    for kind, by in summary.items():
        line = ", ".join(f"{name} {us:.1f} us" for name, us in by.items())
        ratio = f"; this / baseline {by['this'] / by['baseline']:.3f}" if a.root else ""
        print(f"# {kind:>6}: median {line} per request{ratio}")
    if a.json:
        a.json.write_text(json.dumps({"history": a.history, "requests": a.requests, "runs": runs,
                                      "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
