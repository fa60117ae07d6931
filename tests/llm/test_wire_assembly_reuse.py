"""The per-session translation cache resumes assembling messages where the previous request's
assembly was clean (``wire.assembled_before``): an agent resending its history gets the very
message objects of its last request for the unchanged part, and exactly the messages a fresh
parse gives, also where a turn spans several items (Gemini's consecutive model contents and
responses without an id, Responses' reasoning + message + calls runs) and where the history
was edited or cut inside such a turn."""
from __future__ import annotations

import json
import random

from rolloutd.endpoint.shapes import anthropic, gemini, responses


def gemini_turn(i: int, rng: random.Random) -> list[dict]:
    call = {"functionCall": {"name": "bash", "args": {"cmd": f"ls {i}"}}}
    if rng.random() < 0.5:  # streamed: one model content per chunk, a call in the second
        model = [{"role": "model", "parts": [{"text": f"look {i}"}]}, {"role": "model", "parts": [call]}]
    else:
        model = [{"role": "model", "parts": [{"text": f"look {i}"}, call]}]
    resp = {"functionResponse": {"name": "bash", "response": {"output": f"out {i}"}}}  # no id: by name
    if rng.random() < 0.3:  # answered in two user contents
        return model + [{"role": "user", "parts": [{"text": "wait"}]}, {"role": "user", "parts": [resp]}]
    return model + [{"role": "user", "parts": [resp]}]


def responses_turn(i: int, rng: random.Random) -> list[dict]:
    out = []
    if rng.random() < 0.5:
        out.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": f"think {i}"}]})
    if rng.random() < 0.5:
        out.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"say {i}"}]})
    out.append({"type": "function_call", "call_id": f"c{i}", "name": "exec_command",
                "arguments": json.dumps({"cmd": f"ls {i}"})})
    if rng.random() < 0.3:
        out.append({"type": "function_call", "call_id": f"d{i}", "name": "exec_command", "arguments": "{}"})
        out.append({"type": "function_call_output", "call_id": f"d{i}", "output": "x"})
    out.append({"type": "function_call_output", "call_id": f"c{i}", "output": f"out {i}"})
    return out


def anthropic_turn(i: int, rng: random.Random) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": f"look {i}"},
                                              {"type": "tool_use", "id": f"toolu_{i}", "name": "bash",
                                               "input": {"cmd": f"ls {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"out {i}"}]}]


SHAPES = {
    "gemini": (gemini_turn, "contents", {"role": "user", "parts": [{"text": "task"}]},
               lambda b, c: gemini.parse(b, "m", False, c)),
    "responses": (responses_turn, "input", {"type": "message", "role": "user", "content": "task"},
                  lambda b, c: responses.parse(b, None, c)),
    "anthropic": (anthropic_turn, "messages", {"role": "user", "content": "task"},
                  lambda b, c: anthropic.parse(b, c)),
}


def body(shape: str, history: list) -> dict:
    b = {"model": "m", SHAPES[shape][1]: history}
    if shape == "anthropic":
        b["max_tokens"] = 64
    return b


def test_a_resent_history_reuses_its_messages_and_parses_as_fresh():
    for shape, (turn, _, first, parse) in SHAPES.items():
        rng = random.Random(shape)
        cache: dict = {}
        history = [first]
        prev = None
        for i in range(30):
            history = history + turn(i, rng)
            b = json.loads(json.dumps(body(shape, history)))  # fresh objects, as a new request's
            got = parse(b, cache).messages
            assert got == parse(b, None).messages, (shape, i)
            if prev is not None:  # the last request ended its turn: all of its messages are reused
                assert all(g is p for g, p in zip(got, prev)), (shape, i)
            prev = got


def test_an_edit_or_a_cut_inside_a_turn_parses_as_fresh():
    for shape, (turn, _, first, parse) in SHAPES.items():
        rng = random.Random(1)
        history = [first]
        for i in range(12):
            history = history + turn(i, rng)
        for trial in range(60):
            cache: dict = {}
            parse(body(shape, history), cache)
            h = json.loads(json.dumps(history))
            at = rng.randrange(1, len(h))
            op = trial % 3
            if op == 0:
                h = h[:at]  # cut, maybe in the middle of a turn
            elif op == 1:
                h = h[:at] + h[at + 1:]  # one item dropped
            else:
                h = h[:at] + [h[at - 1]] + h[at:]  # one item doubled (a model content twice, a call twice)
            try:
                fresh = parse(body(shape, h), None).messages
            except Exception as e:  # noqa: BLE001 - a refused history is refused both ways
                fresh = type(e)
            try:
                cached = parse(body(shape, h), cache).messages
            except Exception as e:  # noqa: BLE001
                cached = type(e)
            assert cached == fresh, (shape, trial, op, at)


def test_a_tool_result_named_by_a_call_in_the_reused_history():
    """An output answering a call made turns before (a background command's result, say) gets the
    call's name from the reused history's id -> name map (``wire.names_before``), as a fresh parse
    gives it; after an edit that removed the call it gets none, as a fresh parse gives it."""
    late = {
        "responses": lambda i: [{"type": "function_call_output", "call_id": f"c{i - 2}", "output": "late"}],
        "anthropic": lambda i: [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i - 2}", "content": "late"}]}],
    }
    for shape, extra in late.items():
        turn, _, first, parse = SHAPES[shape]
        rng = random.Random(7)
        cache: dict = {}
        history = [first]
        for i in range(12):
            history = history + turn(i, rng) + (extra(i) if i >= 2 else [])
            got = parse(json.loads(json.dumps(body(shape, history))), cache).messages
            assert got == parse(body(shape, history), None).messages, (shape, i)
            assert [m.name for m in got if m.role == "tool" and m.content == "late"] == [
                "exec_command" if shape == "responses" else "bash"] * (i - 1), (shape, i)
        # the call answered late is edited out of the resent history: its id names nothing now
        calls = [k for k, it in enumerate(history) if '"toolu_9"' in json.dumps(it) or '"c9"' in json.dumps(it)]
        h = [it for k, it in enumerate(history) if k != calls[0]]
        got = parse(json.loads(json.dumps(body(shape, h))), cache).messages
        assert got == parse(body(shape, h), None).messages, shape
        assert [m.name for m in got if m.tool_call_id in ("c9", "9")] == [None, None], shape  # "toolu_9" -> "9"
