#!/usr/bin/env python3
"""CPU the OpenAI-compatible endpoint adds per LLM call, against the built-in agent loop.

Same run, same scripted backend (a separate process, zero latency, the ``tool_then_answer``
policy of ``bench_agent_loop.py``: ``--turns - 1`` Hermes tool calls, then an answer, with the
same observation text between turns):

* built-in: ``--rollouts`` concurrent rollouts of ``run_agent_loop`` (``LLMClient``,
  ``Conversation``, the Hermes parser) in this process: CPU per turn (``time.process_time``);
* endpoint: one ``EndpointSession`` + uvicorn server per rollout on a Unix socket in this process
  (as the run daemon serves each harness job), driven by an agent in a *separate* process that
  speaks one API shape (chat: the ``openai`` SDK's tool loop; anthropic, responses, gemini: plain
  httpx), each shape's history sent back unchanged, every reply either as one JSON body or
  streamed (server-sent events, reassembled by the agent as its SDK would); CPU of this process
  per LLM call while the agent runs.

``added`` = endpoint - built-in, the CPU the endpoint costs per call on top of the loop it
replaces (HTTP serving by uvicorn, JSON, translation of the shape, history matching, response
shaping). The agent's own CPU is in its process and not counted. Medians over ``--repeats``;
every trajectory is checked (one segment, every turn, every sampled reply but the last reused
as its sampled ids, none re-encoded).

Long history (``--history``, 200 messages by default): every rollout first builds that history
through the same path, untimed (system, task, then tool call + tool result pairs, each call a
real one), then ``--history-calls`` calls are measured, each resending the whole history.
The endpoint keeps, per session, the previous request's translated messages (chat:
``parse_messages``' ``prev``; other shapes: ``wire.memo_items``/``memo_value``; the body's
JSON and nesting walk: ``bounds.load_body``'s ``resent``), so only the new messages are decoded
and translated; the
same calls are also run with that cache off (``uncached``: the bench swaps those names for the
run, no production code changes) to show what it saves. A rollout's connection idle at the gate
for more than 3 s is reopened by its first measured call (the server closes idle ones at 5 s).
``parse`` = CPU per call translating the request (JSON body -> messages),
``thread`` = all the session's counted work per call (parse, history matching, rendering the new
messages, parsing the reply: in the endpoint thread, or on the loop when small), ``loop`` = the
event loop's thread CPU per call, built-in | endpoint (the endpoint's: uvicorn and its HTTP
parser, the hand-offs, the backend call, the reply's JSON and the small work; the built-in's also
renders and tokenizes), ``gc`` = the garbage collector's CPU per call,
built-in | endpoint (counted in both totals; a full collection landing in one side's window
shows here). After the tokenizer is loaded the process freezes its heap (``gc.freeze``), as
the run daemon does after its set-up: without it, a full collection walked every imported
object (~0.24 s) and added up to ~3.7 ms per call to whichever side's window it fell in.
``--tools N``: every request of both sides declares bash and N-1 harness-sized tools (~1.5 KB of
JSON each, never called): a coding harness resends its whole tool list (10-40 KB) on every call,
which the endpoint reads each time and the built-in loop rendered once.
``--agent-churn N``: the agent also decodes N copies of its request per call. The endpoint's CPU
per call depends on what the agent process does between calls: its memory traffic evicts the
endpoint's working set from the shared caches (the ``openai`` SDK's chat agent costs the endpoint
~0.35-1.1 ms more per call at 200 messages than the plain-httpx agents; N = 6 does the same to them).
``--chat-agent httpx``: the chat shape's agent is plain httpx like the others' (same bodies), not
the ``openai`` SDK: the chat path's own cost without the SDK's traffic beside it.
``--profile DIR``: ``py-spy record --gil`` of this process through each measured long-history
window (``DIR/<shape>-<mode>-...txt``, raw stacks; the top self lines are printed). Its line
attribution around the endpoint thread's hand-offs is unreliable (``_counted``'s clock reads showed
10-25% there, ~3 us per call measured): take the functions, time lines another way.
Example::

    python bench/bench_endpoint.py --rollouts 16 --turns 8 --repeats 3
    python bench/bench_endpoint.py --rollouts 0 --history 200 --repeats 3 --backend inline
    python bench/bench_endpoint.py --rollouts 0 --history 200 --repeats 3 --backend inline --tools 17
    python bench/bench_endpoint.py --quick

``--backend inline`` answers both sides from a function in this process with the scripted
backend's own replies (:func:`inline_generate`): no HTTP client on either side, whose cost at 200
messages (a ~20K-id prompt to JSON and back, the same on both sides) moved +-1 ms between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_loop import BASH_TOOL, OBSERVATION, POLICY, ROOT, start_backend, tokenizer_dir
from bench import common
from bench.common import die_with_parent, stop_procs
from rolloutd.backends.policies import get_policy
from rolloutd.llm.agent_loop import run_agent_loop
from rolloutd.llm.client import Generation, LLMClient, SamplingParams, simple_generate
from rolloutd.llm.conversation import Conversation
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.llm.tokenizer_utils import load_tokenizer
from rolloutd.llm.toolparse import get_parser

SYSTEM = "You are a software engineering agent working in a sandbox."
SHAPES = ("chat", "anthropic", "responses", "gemini")
MODES = ("json", "stream")
TOOLS = [BASH_TOOL]  # --tools N: bash and N-1 of harness_tool's
AGENT_CHURN = [0]  # --agent-churn N
CHAT_AGENT = ["openai"]  # --chat-agent: the openai SDK, or plain httpx as the other shapes' agent
PROFILE: list = [None]  # --profile DIR: py-spy this process through each measured window


def harness_tool(i: int) -> dict:
    """A tool as coding harnesses declare theirs (~1.5 KB of JSON each: a long description, a few
    typed parameters); sent with every request, never called by the scripted policy."""
    words = "read edit search list the file path lines pattern replace tool when use only absolute".split()
    desc = " ".join(words[(i * 7 + j) % len(words)] for j in range(180))
    props = {f"arg{j}": {"type": ["string", "integer", "boolean"][j % 3], "description": f"what {j} means for tool {i}"}
             for j in range(5)}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": desc,
                                             "parameters": {"type": "object", "properties": props, "required": ["arg0"]}}}


# Both drivers end the same way. Each rollout makes ``warm`` calls (its history), then waits at
# the gate; once every rollout is there: READY, a line on stdin starts the measured calls, DONE
# and the number of calls per rollout. A rollout that ends or fails before the gate: FAILED.
_GO = r"""
arrived = 0


async def gate(n):
    global arrived
    if n == warm:
        arrived += 1
        if arrived == len(socks):
            ready.set()
        await go.wait()


async def main():
    global ready, go
    ready, go = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(socks)]
    waiter = asyncio.ensure_future(ready.wait())
    await asyncio.wait(tasks + [waiter], return_when=asyncio.FIRST_COMPLETED)
    if not ready.is_set():
        done = [t for t in tasks if t.done()]
        print("FAILED before the gate: " + repr(done[0].exception() or done[0].result()), flush=True)
        os._exit(1)
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    go.set()
    print("DONE " + json.dumps(await asyncio.gather(*tasks)), flush=True)

asyncio.run(main())
"""

# The agent: an openai-SDK tool loop, one rollout per socket, all at once; streamed replies are
# reassembled from the chunks (content, tool_calls by index) as an SDK user does.
DRIVER = r"""
import asyncio, importlib, json, os, sys
import openai
httpx_lib = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
LIMITS = httpx_lib.Limits(keepalive_expiry=3.0)  # under the server's 5 s: a rollout idle at the gate reconnects
a = json.loads(sys.stdin.readline())
socks, turns, warm, stream, obs, tools, system = (a[k] for k in ("socks", "turns", "warm", "stream", "obs", "tools",
                                                                 "system"))
JUNK = []


async def ask(c, msgs):
    JUNK[:] = [json.loads(json.dumps(msgs)) for _ in range(a["churn"])]  # --agent-churn
    if not stream:
        r = await c.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=512)
        return r.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    async for ch in await c.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=512,
                                                      stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            e = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            e["id"] += tc.id or ""
            if tc.function:
                e["function"]["name"] += tc.function.name or ""
                e["function"]["arguments"] += tc.function.arguments or ""
    m = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = [calls[k] for k in sorted(calls)]
    return m


async def one(i, sock):
    http = httpx_lib.AsyncClient(transport=httpx_lib.AsyncHTTPTransport(uds=sock, limits=LIMITS), timeout=120)
    c = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="k", max_retries=0, http_client=http)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Task {i}: the test suite fails; find the bug and fix it."}]
    n = 0
    try:
        while n < warm + turns:
            await gate(n)
            m = await ask(c, msgs)
            n += 1
            msgs.append(m)
            if not m.get("tool_calls"):
                break
            msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": obs} for tc in m["tool_calls"]]
    finally:
        await c.close()
    return n

"""


# The same agent speaking the other API shapes (issue 25): plain httpx over the Unix socket (the
# agent's CPU is not counted, so an SDK would add nothing to the figure), each shape's own history
# format sent back unchanged: Anthropic content blocks with tool_use / tool_result, Responses
# input items with function_call / function_call_output, Gemini contents with functionCall /
# functionResponse parts. Streamed: each shape's events reassembled into the body the
# non-streamed call returns (Anthropic blocks from their deltas, Responses' response.completed,
# Gemini's parts of every chunk).
SHAPE_DRIVER = r"""
import asyncio, json, os, sys
import httpx
a = json.loads(sys.stdin.readline())
shape, socks, turns, warm, stream, obs, tools, system = (a[k] for k in ("shape", "socks", "turns", "warm", "stream",
                                                                        "obs", "tools", "system"))
fns = [t["function"] for t in tools]


def first(i):
    return "Task %d: the test suite fails; find the bug and fix it." % i


async def events(c, url, body):
    async with c.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                yield json.loads(line[5:])


JUNK = []


async def post(c, url, body):
    JUNK[:] = [json.loads(json.dumps(body)) for _ in range(a["churn"])]  # --agent-churn
    if not stream:
        return (await c.post(url, json=body)).raise_for_status().json()
    if shape == "chat":
        content, calls = "", {}
        async for d in events(c, url, dict(body, stream=True)):
            x = d["choices"][0].get("delta") or {} if d.get("choices") else {}
            content += x.get("content") or ""
            for tc in x.get("tool_calls") or ():
                e = calls.setdefault(tc["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                e["id"] += tc.get("id") or ""
                f = tc.get("function") or {}
                e["function"]["name"] += f.get("name") or ""
                e["function"]["arguments"] += f.get("arguments") or ""
        m = {"role": "assistant", "content": content}
        if calls:
            m["tool_calls"] = [calls[k] for k in sorted(calls)]
        return {"choices": [{"message": m}]}
    if shape == "anthropic":
        blocks = {}
        async for d in events(c, url, dict(body, stream=True)):
            t = d["type"]
            if t == "content_block_start":
                blocks[d["index"]] = b = dict(d["content_block"])
                if b["type"] == "tool_use":
                    b["partial"] = ""
            elif t == "content_block_delta":
                b, x = blocks[d["index"]], d["delta"]
                k = {"text_delta": "text", "input_json_delta": "partial", "thinking_delta": "thinking",
                     "signature_delta": "signature"}[x["type"]]
                b[k] += x["partial_json" if k == "partial" else k]
            elif t == "content_block_stop":
                b = blocks[d["index"]]
                if "partial" in b:
                    b["input"] = json.loads(b.pop("partial") or "{}")
        return {"content": [blocks[k] for k in sorted(blocks)]}
    if shape == "responses":
        async for d in events(c, url, dict(body, stream=True)):
            if d["type"] in ("response.completed", "response.incomplete"):
                out = d["response"]
        return out
    parts = []
    async for d in events(c, url.replace(":generateContent", ":streamGenerateContent") + "?alt=sse", body):
        parts += d["candidates"][0]["content"]["parts"]
    return {"candidates": [{"content": {"role": "model", "parts": parts}}]}


async def one(i, sock):
    c = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock, limits=httpx.Limits(keepalive_expiry=3.0)),
                          base_url="http://localhost", timeout=120,
                          headers={"x-api-key": "k", "authorization": "Bearer k", "x-goog-api-key": "k"})
    n = 0
    try:
        if shape == "chat":  # --chat-agent httpx: what the openai SDK sends, without the SDK
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": first(i)}]
            while n < warm + turns:
                await gate(n)
                r = await post(c, "/v1/chat/completions", {"model": "m", "messages": msgs, "tools": tools,
                                                           "max_tokens": 512})
                n += 1
                m = {k: v for k, v in r["choices"][0]["message"].items() if v is not None}
                msgs.append(m)
                if not m.get("tool_calls"):
                    break
                msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": obs} for tc in m["tool_calls"]]
        elif shape == "anthropic":
            msgs = [{"role": "user", "content": first(i)}]
            tl = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]} for fn in fns]
            while n < warm + turns:
                await gate(n)
                r = await post(c, "/v1/messages", {"model": "m", "system": system, "messages": msgs, "tools": tl,
                                                   "max_tokens": 512})
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
                   "parameters": fn["parameters"]} for fn in fns]
            while n < warm + turns:
                await gate(n)
                r = await post(c, "/v1/responses", {"model": "m", "instructions": system, "input": items, "tools": tl,
                                                    "store": False, "max_output_tokens": 512})
                n += 1
                items += r["output"]
                calls = [o for o in r["output"] if o["type"] == "function_call"]
                if not calls:
                    break
                items += [{"type": "function_call_output", "call_id": o["call_id"], "output": obs} for o in calls]
        elif shape == "gemini":
            contents = [{"role": "user", "parts": [{"text": first(i)}]}]
            tl = [{"functionDeclarations": [{"name": fn["name"], "description": fn["description"],
                                             "parameters": fn["parameters"]} for fn in fns]}]
            while n < warm + turns:
                await gate(n)
                r = await post(c, "/v1beta/models/m:generateContent",
                               {"systemInstruction": {"parts": [{"text": system}]}, "contents": contents,
                                "tools": tl, "generationConfig": {"maxOutputTokens": 512}})
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


@contextlib.contextmanager
def translation_cache(on: bool):
    """With ``on`` False, every request's whole history is translated again, as without the
    per-session cache (and its nesting walked in full): for the duration, the names the endpoint
    calls are swapped for versions that pass no cache (bench only; no production code changes)."""
    if on:
        yield
        return
    from rolloutd.endpoint import session as sm, wire
    from rolloutd.endpoint.shapes import anthropic, chat, gemini, responses

    saved = [(sm, "parse_messages", sm.parse_messages), (sm, "load_body", sm.load_body)]
    sm.parse_messages = lambda raw, prev=None: chat.parse_messages(raw, None)
    sm.load_body = uncached_load  # json.loads, the walk in full, always in the endpoint thread
    for m in (anthropic, responses, gemini):
        saved += [(m, "memo_items", m.memo_items), (m, "memo_value", m.memo_value)]
        m.memo_items = lambda items, fn, cache: wire.memo_items(items, fn, None)
        m.memo_value = lambda raw, fn, cache, key: fn(raw)
    try:
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, v)


def uncached_load(raw, depth, resent=None, new_chars=None):
    """``bounds.load_body`` without the job's previous bodies; a request the loop would keep
    (``new_chars``) is refused to it, as nothing shows how much of the body is new."""
    from rolloutd.endpoint import bounds

    if new_chars is not None:
        from rolloutd.endpoint.resent import Unshared

        raise Unshared
    return bounds.load_body(raw, depth, None)


def count_parse_cpu(s: EndpointSession) -> None:
    """``s.parse_cpu_s``: thread CPU of the session's request translation (JSON body -> messages,
    tools, sampling: ``_prepare_chat`` / ``_prepare_wire``, in its endpoint thread or on the loop)."""
    s.parse_cpu_s = 0.0
    s.last_bodies = collections.deque(maxlen=2)  # for breakdown()
    for name in ("_prepare_chat", "_prepare_wire"):
        def timed(*a, _f=getattr(s, name)):
            s.last_bodies.append(a[0])
            t0 = time.thread_time()
            try:
                return _f(*a)
            finally:
                s.parse_cpu_s += time.thread_time() - t0
        setattr(s, name, timed)


class GcClock:
    """CPU time spent in the garbage collector, every thread (``gc.callbacks``): each row shows
    it per call, so a full collection landing in one side's measured window is seen, not guessed."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._t0: dict[int, float] = {}
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._t0[tid] = time.thread_time()
        elif tid in self._t0:
            self.cpu_s += time.thread_time() - self._t0.pop(tid)


GC = GcClock()


def profile_start(name: str):
    """``py-spy record`` of this process (``--gil``: Python on a CPU) into PROFILE/name.txt, raw
    collapsed stacks; None without --profile."""
    if PROFILE[0] is None:
        return None
    exe = common.pyspy_path()
    if exe is None:
        raise RuntimeError("--profile: py-spy not found")
    PROFILE[0].mkdir(parents=True, exist_ok=True)
    out = PROFILE[0] / f"{name}.txt"
    spy = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "-r", "1000", "-f", "raw", "-o", str(out),
                            "--nonblocking", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           preexec_fn=die_with_parent)
    time.sleep(0.5)  # attached before the window opens
    return spy, out


def profile_stop(spy) -> None:
    """Stop the recorder (it writes its file on SIGINT) and print the window's top self lines."""
    if spy is None:
        return
    proc, out = spy
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    rep = common.pyspy_report([(out.stem, out, proc)])
    for name, r in rep.items():
        print(f"# profile {name} ({r['samples']} samples, {out}); self:")
        for share, f in r["self"][:12]:
            print(f"#   {100 * share:5.1f}%  {f}")


class Gate:
    """Rollouts build their history, then wait here until every one has: the measured part."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived = n, 0
        self.ready, self.go = asyncio.Event(), asyncio.Event()

    async def __call__(self) -> None:
        self.arrived += 1
        if self.arrived == self.n:
            self.ready.set()
        await self.go.wait()


def inline_generate(tok, turns: int):
    """The scripted backend's replies (its ``tool_then_answer`` policy, the same ids and end-of-turn
    token) from a function in this process: no HTTP client on either side. At 200 messages the
    client's share of a call (a ~20K-id prompt to JSON and back, ~3.5 ms, the same on both sides)
    moved by +-1 ms between runs and drowned the difference this bench measures."""
    policy = get_policy(POLICY.format(n=turns - 1))
    vocab = tok.get_vocab()
    eos = vocab["<|im_end|>"] if "<|im_end|>" in vocab else tok.eos_token_id
    # without its ">": rendered, the ">" merges with the newline after it
    marker = np.asarray(tok.encode("<tool_response", add_special_tokens=False), np.int64)
    replies = {}
    for text in (policy.call_text, policy.answer):
        ids = list(tok.encode(text, add_special_tokens=False)) + ([eos] if eos is not None else [])
        replies[text] = (np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32))
    checks = 8  # the first calls also decode the prompt, to check the count from ids

    def responses_seen(prompt) -> int:
        """The policy's count of "<tool_response>" in the decoded prompt, from the ids (no decode)."""
        nonlocal checks
        a = np.asarray(prompt, np.int64)
        k = len(marker)
        hit = a[: len(a) - k + 1] == marker[0]
        for j in range(1, k):
            hit &= a[j: len(a) - k + 1 + j] == marker[j]
        n = int(np.count_nonzero(hit))
        if checks > 0:
            checks -= 1
            want = tok.decode(list(prompt), skip_special_tokens=False).count("<tool_response>")
            if n != want:
                raise RuntimeError(f"inline backend: {n} tool responses counted in the ids, {want} in the text")
        return n

    async def generate(prompt_ids, params: SamplingParams) -> tuple[Generation, str, int]:
        await asyncio.sleep(0)  # one loop turn, as a reply arriving on a socket takes
        ids, lps = replies[policy.call_text if responses_seen(prompt_ids) < policy.tool_turns else policy.answer]
        return Generation(token_ids=ids, logprobs=lps, finish_reason="stop", prompt_tokens=len(prompt_ids)), "inline", 0

    return generate


async def builtin_phase(url: str, tok, n: int, turns: int, warm: int = 0, inline=None) -> dict:
    """``n`` rollouts of the built-in loop; the first ``warm`` turns of each (its history) untimed."""
    parser = get_parser("hermes")
    params = SamplingParams(max_tokens=512)

    async def execute(call) -> str:
        return OBSERVATION

    async with LLMClient(url, timeout=120) as client:
        gen = inline or simple_generate(client, "scripted", 0)

        async def one(i: int, gate, warm: int):
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Task {i}: the test suite fails; find the bug and fix it."}]
            if not warm:  # the opening render is measured, as the endpoint's first request makes it
                await gate()
                return await run_agent_loop(gen, Conversation(tok, msgs, TOOLS, 32768), parser, execute, params,
                                            turns, tok)
            conv = Conversation(tok, msgs, TOOLS, 32768)
            await run_agent_loop(gen, conv, parser, execute, params, warm, tok)
            await gate()
            # the loop stopped after its last call: that call's result, as the agent sends it next
            conv.add_messages([{"role": "tool", "name": "bash", "tool_call_id": "call_0", "content": OBSERVATION}])
            return await run_agent_loop(gen, conv, parser, execute, params, turns, tok)

        async def nothing() -> None:
            pass

        await one(-1, nothing, 0)  # warm-up: connection, renderer cache
        gate = Gate(n)
        tasks = [asyncio.ensure_future(one(i, gate, warm)) for i in range(n)]
        await gate.ready.wait()
        c0, t0, g0, l0 = time.process_time(), time.perf_counter(), GC.cpu_s, time.thread_time()
        gate.go.set()
        res = await asyncio.gather(*tasks)
        cpu, wall, gc_s = time.process_time() - c0, time.perf_counter() - t0, GC.cpu_s - g0
        loop_s = time.thread_time() - l0
    if any(len(r.turns) != warm + turns for r in res):
        raise RuntimeError(f"built-in loop: {[len(r.turns) for r in res]} turns, expected {warm + turns} each")
    calls = n * turns
    return {"calls": calls, "cpu_ms_per_call": cpu / calls * 1e3, "wall_s": wall, "gc_ms_per_call": gc_s / calls * 1e3,
            "loop_ms_per_call": loop_s / calls * 1e3}


async def endpoint_phase(url: str, tok, n: int, turns: int, tmp: Path, shape: str = "chat", stream: bool = False,
                         warm: int = 0, cache: bool = True, inline=None) -> dict:
    """``n`` rollouts through ``n`` endpoint sessions, the agent speaking ``shape``; the first
    ``warm`` calls of each (its history) untimed."""
    async with LLMClient(url, timeout=120) as client:
        sessions, servers, socks = [], [], []
        for i in range(n + 1):  # session 0 warms up
            gen = inline or simple_generate(client, "scripted", 0)
            s = EndpointSession(gen, tok, limits=EndpointLimits(max_tokens=512))
            count_parse_cpu(s)
            sock = str(tmp / f"ep{i}.sock")
            servers.append(await serve(make_app(s), uds=sock))
            sessions.append(s)
            socks.append(sock)
        try:
            async def drive(which: list[str], warm: int) -> tuple[list[int], float, float, float, float, float, float]:
                env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                driver = DRIVER if shape == "chat" and CHAT_AGENT[0] == "openai" else SHAPE_DRIVER
                args = {"shape": shape, "socks": which, "turns": turns, "warm": warm, "stream": stream,
                        "obs": OBSERVATION, "tools": TOOLS, "system": SYSTEM, "churn": AGENT_CHURN[0]}
                p = await asyncio.create_subprocess_exec(sys.executable, "-c", driver, stdin=subprocess.PIPE,
                                                         stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent)
                mine = [sessions[socks.index(w)] for w in which]
                try:
                    p.stdin.write((json.dumps(args) + "\n").encode())
                    await p.stdin.drain()
                    line = await asyncio.wait_for(p.stdout.readline(), 600)
                    if not line.startswith(b"READY"):
                        raise RuntimeError(f"agent driver did not start: {line!r}")
                    th0 = sum(s.metrics["endpoint_cpu_s"] for s in mine)
                    pa0 = sum(s.parse_cpu_s for s in mine)
                    spy = profile_start(f"{shape}-{'stream' if stream else 'json'}-{'cached' if cache else 'uncached'}"
                                        f"-{len(which)}x{warm}") if warm else None
                    c0, t0, g0, l0 = time.process_time(), time.perf_counter(), GC.cpu_s, time.thread_time()
                    p.stdin.write(b"go\n")
                    await p.stdin.drain()
                    line = await asyncio.wait_for(p.stdout.readline(), 600)
                    cpu, wall, gc_s = time.process_time() - c0, time.perf_counter() - t0, GC.cpu_s - g0
                    loop_s = time.thread_time() - l0
                    profile_stop(spy)
                    if not line.startswith(b"DONE "):
                        raise RuntimeError(f"agent driver failed: {line!r}")
                    th = sum(s.metrics["endpoint_cpu_s"] for s in mine) - th0
                    pa = sum(s.parse_cpu_s for s in mine) - pa0
                    return json.loads(line[5:]), cpu, wall, th, pa, gc_s, loop_s
                finally:
                    if p.returncode is None:
                        p.kill()
                    await p.wait()

            with translation_cache(cache):
                await drive(socks[:1], 0)
                calls_per, cpu, wall, thread_s, parse_s, gc_s, loop_s = await drive(socks[1:], warm)
        finally:
            for srv in servers:
                await srv.stop()
    if calls_per != [warm + turns] * n:
        raise RuntimeError(f"endpoint ({shape}): calls per rollout {calls_per}, expected {warm + turns}")
    for s in sessions[1:]:  # one segment, every turn, every reply but the last sent back and reused as sampled
        t, m = s.trajectory(), s.metrics
        if t["metrics"]["segments"] != 1 or len(t["turns"]) != warm + turns:
            raise RuntimeError(f"endpoint ({shape}) trajectory: {t['metrics']}, {len(t['turns'])} turns")
        if m["assistant_tokens_reencoded"] or not all(g.reused for g in s.tree.gens[:-1]):
            raise RuntimeError(f"endpoint ({shape}): replies not reused as sampled: {m}")
    calls = n * turns
    reused = statistics.fmean(s.metrics["assistant_tokens_reused"] for s in sessions[1:])
    return {"calls": calls, "cpu_ms_per_call": cpu / calls * 1e3, "wall_s": wall, "reused_tokens": reused,
            "thread_ms_per_call": thread_s / calls * 1e3, "parse_ms_per_call": parse_s / calls * 1e3,
            "gc_ms_per_call": gc_s / calls * 1e3, "loop_ms_per_call": loop_s / calls * 1e3,
            "last_bodies": list(sessions[1].last_bodies)}


def breakdown(shape: str, prev: bytes, cur: bytes, tok, n: int = 15) -> dict:
    """A request's translation in pieces, one thread, nothing else running in this process: the
    last two bodies of a rollout (``cur`` resends ``prev``'s history plus one call and its
    result). ms of thread CPU, medians of ``n``."""
    from rolloutd.endpoint.bounds import EndpointBounds, nesting_ok
    from rolloutd.endpoint.resent import ResentBodies
    from rolloutd.endpoint.shapes import anthropic, gemini, responses

    def ms(f) -> float:
        xs = []
        for _ in range(n):
            f0 = f()  # a fresh setup per sample, untimed when it returns the timed part
            t0 = time.thread_time()
            f0()
            xs.append(time.thread_time() - t0)
        return statistics.median(xs) * 1e3

    depth = EndpointBounds().max_depth
    body, pbody = json.loads(cur), json.loads(prev)

    async def no_backend(ids, params):
        raise AssertionError("no LLM call")

    def resent_decode():
        r = ResentBodies()
        r.keep(r.decode(prev))
        return lambda: r.decode(cur)

    def prepared(cache_on: bool):
        def setup():
            s = EndpointSession(no_backend, tok)
            s._mbpt = 64
            wc: dict = {}
            parse = {"anthropic": lambda b: anthropic.parse(b, wc), "responses": lambda b: responses.parse(b, None, wc),
                     "gemini": lambda b: gemini.parse(b, "m", False, wc)}.get(shape)
            run = (lambda raw: s._prepare_chat(raw)) if shape == "chat" else (lambda raw: s._prepare_wire(raw, parse))
            with translation_cache(cache_on):
                run(prev)

            def timed():
                with translation_cache(cache_on):
                    run(cur)
            return timed
        return setup

    return {"bytes": len(cur), "messages_in_body": len(body.get("messages") or body.get("input")
                                                       or body.get("contents") or ()),
            "json_loads_ms": ms(lambda: lambda: json.loads(cur)),
            "resent_decode_ms": ms(resent_decode),
            "nesting_walk_full_ms": ms(lambda: lambda: nesting_ok(body, depth)),
            "nesting_walk_after_prev_ms": ms(lambda: lambda: nesting_ok(body, depth, pbody)),
            "prepare_cached_ms": ms(prepared(True)), "prepare_uncached_ms": ms(prepared(False))}


async def handoff_cost(n: int = 3000) -> dict:
    """CPU of one hand-off to an endpoint thread and back (``run_in_executor`` on the endpoint's
    pool, a no-op), whole process and the loop's thread alone, against one loop turn (``sleep(0)``),
    the baseline. Sequential, nothing else running: the least it costs."""
    from rolloutd.endpoint.bounds import POOL

    loop = asyncio.get_running_loop()
    for _ in range(200):
        await loop.run_in_executor(POOL, int)
    c0, l0 = time.process_time(), time.thread_time()
    for _ in range(n):
        await loop.run_in_executor(POOL, int)
    hop, hop_loop = (time.process_time() - c0) / n * 1e6, (time.thread_time() - l0) / n * 1e6
    c0 = time.process_time()
    for _ in range(n):
        await asyncio.sleep(0)
    turn = (time.process_time() - c0) / n * 1e6
    return {"handoff_us": hop, "handoff_loop_thread_us": hop_loop, "loop_turn_us": turn, "ratio": hop / turn}


def summarize(rows: list[dict]) -> dict:
    """Medians per (case, shape, mode, cache) over the repeats."""
    med = statistics.median
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["key"], []).append(r)
    return {k: {"builtin_cpu_ms_per_call": med(r["builtin"]["cpu_ms_per_call"] for r in rs),
                "endpoint_cpu_ms_per_call": med(r["endpoint"]["cpu_ms_per_call"] for r in rs),
                "added_cpu_ms_per_call": med(r["added"] for r in rs),
                "thread_ms_per_call": med(r["endpoint"]["thread_ms_per_call"] for r in rs),
                "builtin_loop_ms_per_call": med(r["builtin"]["loop_ms_per_call"] for r in rs),
                "endpoint_loop_ms_per_call": med(r["endpoint"]["loop_ms_per_call"] for r in rs),
                "parse_ms_per_call": med(r["endpoint"]["parse_ms_per_call"] for r in rs),
                "builtin_gc_ms_per_call": med(r["builtin"]["gc_ms_per_call"] for r in rs),
                "endpoint_gc_ms_per_call": med(r["endpoint"]["gc_ms_per_call"] for r in rs),
                "reused_tokens_per_rollout": rs[0]["endpoint"]["reused_tokens"], "repeats": len(rs)}
            for k, rs in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=16,
                    help="concurrent rollouts (one endpoint each); 0: the long-history case only")
    ap.add_argument("--turns", type=int, default=8, help="LLM calls per rollout (turns-1 tool calls)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer", choices=["auto", "qwen", "tiny"], default="auto")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 rollouts x 4 turns, one repeat; history case 2 rollouts x 2 calls after 20 messages")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="API shapes the agent speaks, each against the same built-in run (default: all four)")
    ap.add_argument("--modes", default=",".join(MODES), help="json (one body per reply), stream (SSE), or both")
    ap.add_argument("--history", type=int, default=200,
                    help="messages of history (system and task included) before the measured calls of the "
                         "long-history case (0: skip it)")
    ap.add_argument("--history-rollouts", type=int, default=8)
    ap.add_argument("--history-calls", type=int, default=8, help="measured calls per rollout after the history")
    ap.add_argument("--backend", choices=["http", "inline"], default="http",
                    help="http: the scripted backend process over HTTP (LLMClient); inline: its replies from a "
                         "function in this process, no HTTP client on either side (less noise: see inline_generate)")
    ap.add_argument("--tools", type=int, default=1,
                    help="tools every request declares: bash and N-1 harness-sized ones (Claude Code sends ~17)")
    ap.add_argument("--agent-churn", type=int, default=0,
                    help="the agent decodes a copy of its request N times per call (memory traffic of its own, "
                         "as the openai SDK's models make: it evicts the endpoint's working set from the caches)")
    ap.add_argument("--chat-agent", choices=("openai", "httpx"), default="openai",
                    help="the chat shape's agent: the openai SDK (default), or plain httpx like the other shapes' "
                         "(same bodies: tells the SDK's own cost to the endpoint apart from the chat path's)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="py-spy this process through each measured long-history window into this dir (raw stacks)")
    ap.add_argument("--no-uncached", action="store_true",
                    help="long-history case: skip the comparison run with the translation cache off")
    args = ap.parse_args(argv)
    if args.tools < 1:
        ap.error("--tools: at least 1 (bash)")
    TOOLS[1:] = [harness_tool(i) for i in range(args.tools - 1)]
    AGENT_CHURN[0] = max(0, args.agent_churn)
    CHAT_AGENT[0] = args.chat_agent
    PROFILE[0] = args.profile
    shapes = [x for x in args.shapes.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    if set(shapes) - set(SHAPES):
        ap.error(f"--shapes: one of {SHAPES}")
    if set(modes) - set(MODES):
        ap.error(f"--modes: one of {MODES}")
    if args.history and (args.history < 4 or args.history % 2):
        ap.error("--history: an even number >= 4 (system, task, then call + result pairs)")
    if args.quick:
        args.rollouts, args.turns, args.repeats = 4, 4, 1
        args.history_rollouts, args.history_calls = 2, 2
        args.history = min(args.history, 20)
    warm = (args.history - 2) // 2 if args.history else 0  # calls that build the history
    import uvicorn

    tok_dir, tok_desc = tokenizer_dir(args.tokenizer)
    tok = load_tokenizer(tok_dir)
    gc.collect()
    gc.freeze()  # as the run daemon does after its setup (bus/daemon.py): no full passes over imports
    procs = []
    proc, port = start_backend(tok_dir, args.turns)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    if warm:
        proc, port = start_backend(tok_dir, warm + args.history_calls)
        procs.append(proc)
    hurl = f"http://127.0.0.1:{port}"
    print(f"# tokenizer: {tok_desc}; backend: " + ("scripted replies in this process (--backend inline)"
                                                   if args.backend == "inline" else
                                                   f"scripted (separate process, zero latency) at {url}")
          + f"; tools per request: {len(TOOLS)} ({len(json.dumps(TOOLS)):,} bytes of JSON)"
          + f"; agent churn: {AGENT_CHURN[0]} request copies decoded per call; chat agent: {CHAT_AGENT[0]}")
    print(f"# python {sys.version.split()[0]}, uvicorn {uvicorn.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    rows: list[dict] = []

    def show(r: dict) -> None:
        b, e = r["builtin"], r["endpoint"]
        print(f"  repeat {r['repeat']} {r['key']:>32}: built-in {b['cpu_ms_per_call']:.3f} | endpoint "
              f"{e['cpu_ms_per_call']:.3f} | added {r['added']:.3f} ms CPU/call (loop {b['loop_ms_per_call']:.3f} | "
              f"{e['loop_ms_per_call']:.3f}, thread {e['thread_ms_per_call']:.3f},"
              f" parse {e['parse_ms_per_call']:.3f}; gc {b['gc_ms_per_call']:.3f} | {e['gc_ms_per_call']:.3f})", flush=True)

    load0 = os.getloadavg()[0]
    parts: dict[str, dict] = {}  # the long-history request's translation in pieces, per shape
    try:
        with tempfile.TemporaryDirectory(prefix="rb-ep-", dir="/tmp") as d:
            for rep in range(1, args.repeats + 1):
                cases = [("short", url, args.rollouts, args.turns, 0)] if args.rollouts else []
                if warm:
                    cases.append((f"history{args.history}", hurl, args.history_rollouts, args.history_calls, warm))
                for case, u, n, turns, w in cases:
                    inline = inline_generate(tok, turns + w) if args.backend == "inline" else None
                    runs = [(shape, mode, True) for shape in shapes for mode in modes]
                    if w and not args.no_uncached:
                        runs += [(shape, "json", False) for shape in shapes]
                    for shape, mode, cache in runs:  # each right after the built-in run it is compared with
                        b = asyncio.run(builtin_phase(u, tok, n, turns, w, inline))
                        e = asyncio.run(endpoint_phase(u, tok, n, turns, Path(d), shape, mode == "stream", w, cache,
                                                       inline))
                        key = f"{case} {shape} {mode}" + ("" if cache else " uncached")
                        bodies = e.pop("last_bodies")
                        rows.append({"key": key, "case": case, "shape": shape, "mode": mode, "cache": cache,
                                     "repeat": rep, "builtin": b, "endpoint": e,
                                     "added": e["cpu_ms_per_call"] - b["cpu_ms_per_call"]})
                        show(rows[-1])
                        if w and rep == 1 and mode == "json" and cache and len(bodies) == 2:
                            parts[shape] = breakdown(shape, bodies[0], bodies[1], tok)
    finally:
        stop_procs(procs, wait_s=10)
    summary = {"tokenizer": tok_desc, "backend": args.backend, "rollouts": args.rollouts, "turns": args.turns, "repeats": args.repeats,
               "history": args.history, "history_rollouts": args.history_rollouts,
               "history_calls": args.history_calls, "agent_churn": AGENT_CHURN[0], "chat_agent": CHAT_AGENT[0], "load_average_start": load0,
               "load_average_end": os.getloadavg()[0], "results": summarize(rows), "translation_breakdown": parts,
               "handoff": asyncio.run(handoff_cost(300 if args.quick else 3000))}
    print(json.dumps(summary, indent=2))
    print(f"# medians of {args.repeats}, ms CPU per call; target: added < 1 ms")
    for key, v in summary["results"].items():
        ok = "met" if v["added_cpu_ms_per_call"] < 1.0 else "MISSED"
        if key.endswith("uncached"):
            ok = "(translation cache off, for comparison)"
        print(f"# {key:>32}: added {v['added_cpu_ms_per_call']:.3f} (built-in {v['builtin_cpu_ms_per_call']:.3f}, "
              f"endpoint {v['endpoint_cpu_ms_per_call']:.3f}; loop {v['builtin_loop_ms_per_call']:.3f} | "
              f"{v['endpoint_loop_ms_per_call']:.3f}, thread {v['thread_ms_per_call']:.3f}, "
              f"parse {v['parse_ms_per_call']:.3f}; gc {v['builtin_gc_ms_per_call']:.3f} | "
              f"{v['endpoint_gc_ms_per_call']:.3f}) {ok}")
    h = summary["handoff"]
    print(f"# a hand-off to an endpoint thread and back: {h['handoff_us']:.1f} us CPU ({h['handoff_loop_thread_us']:.1f} "
          f"on the loop's thread), {h['ratio']:.1f}x one loop turn ({h['loop_turn_us']:.1f} us)")
    for shape, v in parts.items():
        print(f"# {shape} request of {v['messages_in_body']} history items ({v['bytes']} bytes), one thread: json.loads "
              f"{v['json_loads_ms']:.3f} ms (the resent history reused: {v['resent_decode_ms']:.3f}), nesting walk {v['nesting_walk_full_ms']:.3f} (skipping the last body's "
              f"items {v['nesting_walk_after_prev_ms']:.3f}), whole translation {v['prepare_cached_ms']:.3f} "
              f"(uncached {v['prepare_uncached_ms']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
