#!/usr/bin/env python3
"""CPU per call of the wire translation alone, per API shape, against Chat Completions' in the same run.

One call = what the endpoint does with the shape's bytes before and after sampling: ``json.loads``
of the body, parsing to messages/tools/sampling, and rendering one reply (text + one tool call +
reasoning) as the streaming body. No HTTP, no tokenizer, no session: these are the figures the
endpoint benchmark's per-shape "CPU added per call" starts from.

Bodies are harness-sized and each shape carries the same conversation: a system prompt (6K
characters, as Claude Code's), ``--tools`` tools, a history of ``--turns`` assistant turns with one
tool call and one tool result each. Chat Completions is measured with ``parse_messages``' cache
off (a new agent history every call) and on (the same history sent again, as the endpoint sees
it); each other shape likewise without and with its ``cache``. ``time.process_time`` per call,
medians over ``--repeats`` rounds of ``--calls`` calls::

    python bench/bench_wire.py
    python bench/bench_wire.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rolloutd.endpoint.shapes import anthropic, gemini, responses
from rolloutd.endpoint.shapes.chat import chat_chunks, parse_messages, parse_sampling, parse_tool_choice, parse_tools
from rolloutd.endpoint.wire import Reply

SYSTEM = ("You are an interactive CLI tool that helps users with software engineering tasks. " * 75)[:6000]


def schema(i):
    return {"type": "object", "properties": {"command": {"type": "string", "description": f"arg {i}"},
                                             "timeout": {"type": "integer"}}, "required": ["command"]}


def bodies(n_tools: int, turns: int) -> dict[str, bytes]:
    obs = "total 48\ndrwxr-xr-x 5 user user 4096 a.py b.py c.py\n" * 4
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    anth = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}]
    resp = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]}]
    gem = [{"role": "user", "parts": [{"text": "Fix the failing test."}]}]
    for k in range(turns):
        args = {"command": f"grep -rn 'def test_{k}' tests/", "timeout": 30}
        cid = f"call_{k}_0"
        chat += [{"role": "assistant", "content": f"Step {k}.", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "tool_0", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": obs}]
        anth += [{"role": "assistant", "content": [{"type": "text", "text": f"Step {k}."},
                                                   {"type": "tool_use", "id": "toolu_" + cid, "name": "tool_0",
                                                    "input": args}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_" + cid, "content": obs}]}]
        resp += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Step {k}."}]},
                 {"type": "function_call", "call_id": cid, "name": "tool_0", "arguments": json.dumps(args)},
                 {"type": "function_call_output", "call_id": cid, "output": obs}]
        gem += [{"role": "model", "parts": [{"text": f"Step {k}."},
                                            {"functionCall": {"id": cid, "name": "tool_0", "args": args}}]},
                {"role": "user", "parts": [{"functionResponse": {"id": cid, "name": "tool_0",
                                                                 "response": {"output": obs}}}]}]
    tools = [(f"tool_{i}", f"Tool number {i}. " * 20, schema(i)) for i in range(n_tools)]
    return {
        "chat": json.dumps({"model": "m", "messages": chat, "max_tokens": 4096, "temperature": 1.0, "stream": True,
                            "tools": [{"type": "function", "function": {"name": n, "description": d,
                                                                        "parameters": p}} for n, d, p in tools]}),
        "anthropic": json.dumps({"model": "m", "max_tokens": 4096, "stream": True, "messages": anth,
                                 "system": [{"type": "text", "text": SYSTEM[:200]},
                                            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                                 "tools": [{"name": n, "description": d, "input_schema": p} for n, d, p in tools]}),
        "responses": json.dumps({"model": "m", "instructions": SYSTEM, "input": resp, "stream": True, "store": False,
                                 "include": ["reasoning.encrypted_content"],
                                 "tools": [{"type": "function", "name": n, "description": d, "parameters": p,
                                            "strict": False} for n, d, p in tools] + [{"type": "web_search"}]}),
        "gemini": json.dumps({"contents": gem, "systemInstruction": {"parts": [{"text": SYSTEM}]},
                              "tools": [{"functionDeclarations": [{"name": n, "description": d,
                                                                   "parametersJsonSchema": p} for n, d, p in tools]}],
                              "generationConfig": {"temperature": 1.0, "maxOutputTokens": 4096}}),
    }


REPLY = dict(id="chatcmpl-0123456789abcdef", model="m", content="Let me run the tests.",
             tool_calls=[{"id": "call_99_0", "type": "function",
                          "function": {"name": "tool_0", "arguments": '{"command": "pytest -q", "timeout": 60}'}}],
             reasoning="The failure is in test_3; run it.", finish_reason="tool_calls", prompt_tokens=9000,
             completion_tokens=40, token_ids=list(range(40)), logprobs=[-0.1] * 40)


def chat_call(raw: str, prev):
    body = json.loads(raw)
    msgs = parse_messages(body["messages"], prev[0])
    if prev[1]:
        prev[0] = (body["messages"], msgs)
    tools = parse_tools(body.get("tools"))
    parse_tool_choice(body.get("tool_choice"), tools)
    parse_sampling(body)
    return chat_chunks(Reply(**REPLY), False)


def make_calls(b: dict[str, bytes]):
    return {
        "chat (no cache)": lambda: chat_call(b["chat"], [None, False]),
        "chat (history cached)": (lambda st: lambda: chat_call(b["chat"], st))([None, True]),
        "anthropic": lambda: anthropic.stream_events(Reply(**REPLY),
                                                          anthropic.parse(json.loads(b["anthropic"]))),
        "anthropic (cached)": (lambda c: lambda: anthropic.stream_events(
            Reply(**REPLY), anthropic.parse(json.loads(b["anthropic"]), cache=c)))({}),
        "responses": lambda: responses.stream_events(Reply(**REPLY),
                                                          responses.parse(json.loads(b["responses"]))),
        "responses (cached)": (lambda c: lambda: responses.stream_events(
            Reply(**REPLY), responses.parse(json.loads(b["responses"]), cache=c)))({}),
        "gemini": lambda: gemini.stream_chunks(Reply(**REPLY),
                                                    gemini.parse(json.loads(b["gemini"]), "m", True)),
        "gemini (cached)": (lambda c: lambda: gemini.stream_chunks(
            Reply(**REPLY), gemini.parse(json.loads(b["gemini"]), "m", True, cache=c)))({}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", type=int, default=25)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="few calls: a smoke run, not a measurement")
    a = ap.parse_args()
    if a.quick:
        a.calls, a.repeats = 20, 2
    b = bodies(a.tools, a.turns)
    calls = make_calls(b)
    rounds: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(a.repeats):
        for name, fn in calls.items():  # interleaved: load drifts hit every shape alike
            fn()
            t0 = time.process_time()
            for _ in range(a.calls):
                fn()
            rounds[name].append((time.process_time() - t0) / a.calls)
    base = statistics.median(rounds["chat (no cache)"])
    print("body sizes (KB): " + ", ".join(f"{k} {len(v) / 1024:.0f}" for k, v in b.items()))
    print(f"{'shape':24s} {'CPU/call (ms)':>14s} {'x chat (no cache)':>18s}")
    for name, xs in rounds.items():
        m = statistics.median(xs)
        print(f"{name:24s} {m * 1e3:14.3f} {m / base:18.2f}")


if __name__ == "__main__":
    main()
