"""A job's request bodies decoded without decoding again the history they resend
(``endpoint/resent.py``): the value and every error are ``json.loads``' own, for bodies that
extend, edit, reorder, shrink or break the previous one; the unchanged items are the previous
body's objects. An agent controls every byte of a body: nothing it sends may decode differently."""
from __future__ import annotations

import json
import math
import random

import pytest

from rolloutd.endpoint.bounds import load_body
from rolloutd.endpoint.resent import ResentBodies, Unshared
from rolloutd.endpoint.wire import EndpointError


def same(a, b) -> bool:
    """Equal as JSON values, NaN included, types kept (1 vs 1.0 vs True), key order included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outcome(fn, raw):
    try:
        return "ok", fn(raw)
    except (ValueError, RecursionError) as e:
        return "error", (type(e), str(e))


def check(r: ResentBodies, raw: bytes):
    want, got = outcome(json.loads, raw), outcome(r.decode, raw)
    assert want[0] == got[0], (raw[:200], want, got)
    if want[0] == "ok":
        assert same(want[1], got[1]), raw[:200]
        if isinstance(got[1], dict):
            r.keep(got[1])
    else:
        assert want[1] == got[1]
    return got


def msg(i: int, rng: random.Random) -> dict:
    kind = rng.randrange(4)
    if kind == 0:
        return {"role": "user", "content": f"task {i} \u00e9\u4e2d \U0001F600 \"quoted\" \\ back"}
    if kind == 1:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": f"ls {i}"})}}]}
    if kind == 2:
        return {"role": "tool", "tool_call_id": f"call_{i}", "content": "x" * rng.randrange(50) + "\n\t"}
    return {"role": "user", "content": [{"type": "text", "text": f"part {i}"}, {"type": "text", "text": "[]{},:"}]}


def dumps(body: dict, rng: random.Random, style: int) -> bytes:
    if style == 0:
        return json.dumps(body).encode()
    if style == 1:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    if style == 2:
        return json.dumps(body, indent=2).encode()
    return (" \n" + json.dumps(body, separators=(" , ", " : ")) + "\r\n").encode("utf-16" if rng.random() < 0.3 else "utf-8")


def test_a_growing_history_decodes_as_json_loads_and_reuses_the_unchanged_items():
    rng = random.Random(7)
    r = ResentBodies()
    msgs = [{"role": "system", "content": "you are a coder"}]
    prev = None
    for i in range(60):
        msgs = msgs + [msg(i, rng) for _ in range(rng.randrange(1, 3))]
        body = {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {"name": "bash"}}],
                "max_tokens": 64}
        if i % 7 == 3:
            body = {"messages": msgs, "model": "m"}  # the history first
        _, got = check(r, dumps(body, rng, 0))
        if prev is not None and i % 7 not in (3, 4):  # same layout as the body before: its items are reused
            n = len(prev["messages"])
            assert all(got["messages"][j] is prev["messages"][j] for j in range(n))
        prev = got


def test_an_edited_shrunk_or_reordered_history_is_decoded_again_where_it_differs():
    rng = random.Random(11)
    r = ResentBodies()
    msgs = [msg(i, rng) for i in range(40)]
    _, first = check(r, json.dumps({"model": "m", "messages": msgs}).encode())
    edited = [dict(m) for m in msgs]
    edited[17] = {**edited[17], "content": "the agent rewrote this one"}  # a compaction, an edit
    _, got = check(r, json.dumps({"model": "m", "messages": edited + [msg(99, rng)]}).encode())
    assert all(got["messages"][j] is first["messages"][j] for j in range(17))
    assert got["messages"][17]["content"] == "the agent rewrote this one"
    assert all(got["messages"][j] is not first["messages"][j] for j in range(17, 40))
    # one character changed inside an early item, same length: nothing after it is taken over
    raw = json.dumps({"model": "m", "messages": edited + [msg(99, rng)]})
    at = raw.index("the agent rewrote")
    check(r, (raw[:at] + "The" + raw[at + 3:]).encode())
    check(r, json.dumps({"model": "m", "messages": edited[:5]}).encode())  # shrunk
    check(r, json.dumps({"model": "m", "messages": list(reversed(edited))}).encode())  # reordered
    check(r, json.dumps({"model": "n", "messages": edited}).encode())  # something before the history changed
    check(r, json.dumps({"model": "m", "messages": []}).encode())
    check(r, json.dumps({"model": "m", "input": edited}).encode())  # another shape's key


@pytest.mark.parametrize("seed", range(6))
def test_random_bodies_and_their_corruptions_decode_or_fail_as_json_loads(seed):
    """Every prefix cut, byte flip, splice and duplicate of a history body (its system prompt and
    tools too), after a body that passed: the same value or the same error as json.loads, NaN and
    big ints included."""
    rng = random.Random(seed)
    r = ResentBodies()
    msgs = [msg(i, rng) for i in range(12)]
    base = {"model": "m", "system": "be brief " * 20, "messages": msgs, "tools": harness_tools(2),
            "temperature": float("nan") if seed % 2 else 0.5, "seed": 10 ** 30}
    for style in range(4):
        check(r, dumps(base, rng, style))
    good = json.dumps({**base, "messages": msgs + [msg(50, rng)]})
    check(r, json.dumps(base).encode())
    for _ in range(150):
        t = good
        op = rng.randrange(6)
        if op == 0:
            t = t[:rng.randrange(len(t))]  # cut
        elif op == 1:
            j = rng.randrange(len(t))
            t = t[:j] + rng.choice('{}[],:" \\x0e') + t[j + 1:]  # one character replaced
        elif op == 2:
            j = rng.randrange(len(t))
            t = t[:j] + t[j:j + rng.randrange(1, 20)] + t[j:]  # a piece repeated
        elif op == 3:
            t = t.replace('"model"', '"messages"', 1)  # a duplicate key: json.loads keeps the last
        elif op == 4:
            t = t + rng.choice([" ", "x", "{}", ",", "\x00"])  # after the object
        else:
            t = t.replace("}]", "},]", 1)  # a trailing comma
        check(r, t.encode())
        if rng.random() < 0.3:
            check(r, good.encode())  # back to a body that extends a kept one
    check(r, b"\xef\xbb\xbf" + good.encode())  # a UTF-8 BOM, which json.loads takes from bytes
    check(r, b"\xff\xfe{")  # not decodable
    check(r, b"[1, 2]")  # not an object
    check(r, b"")


def test_load_body_refuses_with_the_resent_history_as_without():
    """load_body with the job's bodies: the same 400s (invalid JSON, too deep, not an object), and
    a refused body is not kept for the next one."""
    r = ResentBodies()
    msgs = [{"role": "user", "content": "hi"}] * 3
    ok = json.dumps({"messages": msgs}).encode()
    assert load_body(ok, 8, r)["messages"] == msgs and r.body is not None
    deep = json.dumps({"messages": msgs + [{"role": "user", "content": [[[[[[["x"]]]]]]]}]}).encode()
    for raw in (deep, b"{\"messages\": [", b"[]", b"{" * 100_000):
        with pytest.raises(EndpointError) as e1:
            load_body(raw, 8)
        with pytest.raises(EndpointError) as e2:
            load_body(raw, 8, r)
        assert (e1.value.status, e1.value.message) == (e2.value.status, e2.value.message)
    kept = r.body
    assert load_body(ok, 8, r) == json.loads(ok) and r.body is not kept


@pytest.mark.parametrize("shape", ["one long list", "many keys", "many lists"])
def test_a_body_of_tiny_pieces_is_left_to_json_loads(monkeypatch, shape):
    """Decoding piece by piece costs ~1 us a piece, json.loads ~20 ns for a tiny one: an agent
    sending millions of tiny items or keys must not make the endpoint pay 20x (a 12 MB list of
    zeros took 4.8 s instead of 0.24). Past ``MAX_STEPS`` keys and items the walk stops and
    json.loads decodes the body; nothing is kept, so the next body walks no further either."""
    from rolloutd.endpoint import resent

    calls = [0]
    scan = resent._SCAN

    def counted(text, pos):
        calls[0] += 1
        return scan(text, pos)

    monkeypatch.setattr(resent, "_SCAN", counted)
    n = 5 * resent.MAX_STEPS
    raw = {"one long list": b'{"model": "m", "messages": [' + b"0," * n + b'0], "x": [1]}',
           "many keys": ("{" + ",".join(f'"k{i}": 0' for i in range(n)) + "}").encode(),
           "many lists": ("{" + ",".join(f'"k{i}": [0, 0]' for i in range(n)) + "}").encode()}[shape]
    r = ResentBodies()
    for _ in range(2):
        calls[0] = 0
        got = r.decode(raw)
        assert got == json.loads(raw)
        assert calls[0] <= resent.MAX_STEPS + 2  # plus the values of the keys before
        r.keep(got)


def harness_tools(n: int) -> list[dict]:
    """A coding harness's tool list: more tools than its first request has messages."""
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "reads and edits files " * 20,
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}} for i in range(n)]


def test_a_history_shorter_than_the_tool_list_is_still_reused_once_it_grows():
    """A coding harness's first request: one user message, 17 tools. The history must still be the
    list whose items are reused once it grows past the tools (before: the tool list, the longest at
    the first request, stayed the kept list, and no history item was ever reused)."""
    rng = random.Random(3)
    r = ResentBodies()
    tools = harness_tools(17)
    msgs = [{"role": "user", "content": "fix the failing test"}]
    prev = None
    for i in range(40):
        msgs = msgs + [msg(i, rng)]
        _, got = check(r, json.dumps({"model": "m", "messages": msgs, "tools": tools, "stream": True}).encode())
        if i >= 20:
            n = len(prev["messages"])
            assert all(got["messages"][j] is prev["messages"][j] for j in range(n)), i
        prev = got


def test_an_unchanged_tool_list_system_prompt_and_object_are_the_previous_bodys():
    """What a harness resends unchanged besides its history (``tools``, ``system``, a config
    object) is not decoded again; any change inside one is decoded, as json.loads would."""
    rng = random.Random(5)
    r = ResentBodies()
    tools = harness_tools(12)
    system = "You are a coding agent. " * 400
    cfg = {"temperature": 0.7, "stop": ["</s>"], "nested": {"a": [1, 2, {"b": None}]}}
    msgs = [msg(i, rng) for i in range(15)]  # past the tools: the history is the list reused item by item
    body = lambda m, t=tools, s=system, c=cfg, n=12: {"system": s, "messages": m, "tools": t, "config": c, "n": n}  # noqa: E731
    _, first = check(r, json.dumps(body(msgs)).encode())
    msgs = msgs + [msg(20, rng)]
    _, second = check(r, json.dumps(body(msgs)).encode())
    _, third = check(r, json.dumps(body(msgs + [msg(21, rng)])).encode())
    for key in ("tools", "system", "config"):
        assert third[key] is second[key], key
    edited = json.loads(json.dumps(tools))
    edited[7]["function"]["description"] += "!"
    _, fourth = check(r, json.dumps(body(msgs, t=edited)).encode())
    assert fourth["tools"] is not third["tools"] and fourth["tools"][7]["function"]["description"].endswith("!")
    _, fifth = check(r, json.dumps(body(msgs, s=system[:-1], c={**cfg, "temperature": 0.75}, n=123)).encode())
    assert fifth["system"] == system[:-1] and fifth["config"]["temperature"] == 0.75 and fifth["n"] == 123
    # a value that starts as the previous one did but goes on (a longer string, a number) is not taken over
    raw = json.dumps(body(msgs, n=12)).replace('"n": 12', '"n": 12345')
    _, sixth = check(r, raw.encode())
    assert sixth["n"] == 12345


def test_a_resent_object_made_too_deep_is_refused():
    """The nesting walk skips only the previous body's very objects: a tool list that was fine and
    comes back nested past the limit is walked and refused, as without the job's bodies."""
    r = ResentBodies()
    tools = harness_tools(3)
    ok = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert load_body(json.dumps(ok).encode(), 8, r)["tools"] == tools
    assert load_body(json.dumps(ok).encode(), 8, r)["tools"] is r.body["tools"]  # taken over
    deep = {**ok, "tools": tools + [{"type": "function", "function": {"parameters": [[[[[["x"]]]]]]}}]}
    for raw in (json.dumps(deep).encode(), json.dumps({**ok, "config": [[[[[[[[1]]]]]]]]}).encode()):
        with pytest.raises(EndpointError) as e:
            load_body(raw, 8, r)
        assert e.value.status == 400 and "nested deeper" in e.value.message


def test_a_budget_of_new_characters_decodes_a_small_change_and_refuses_a_large_one():
    """``decode(raw, new_chars)`` (the endpoint's loop deciding whether to keep a request): the
    same value as ``json.loads`` while at most ``new_chars`` characters are not the previous
    body's; ``Unshared`` otherwise (a first big body, a changed tool list, a long new message, a
    malformed body: the endpoint's thread decodes those), and nothing the next decode reuses is
    changed by a refusal."""
    rng = random.Random(11)
    r = ResentBodies()
    tools = harness_tools(17)
    msgs = [{"role": "user", "content": "fix the failing test"}] + [msg(i, rng) for i in range(30)]
    body = lambda m, t=tools: json.dumps({"model": "m", "messages": m, "tools": t}).encode()  # noqa: E731
    with pytest.raises(Unshared):
        r.decode(body(msgs), 4096)  # nothing to share yet: 40 KB of new text
    check(r, body(msgs))
    msgs = msgs + [msg(40, rng), {"role": "tool", "tool_call_id": "call_40", "content": "ok\n" * 100}]
    got = r.decode(body(msgs), 4096)  # a reply and a tool result: ~500 new characters
    assert same(got, json.loads(body(msgs)))
    assert got["tools"] is r.body["tools"] and got["messages"][5] is r.body["messages"][5]
    r.keep(got)
    for raw in (body(msgs + [{"role": "tool", "tool_call_id": "x", "content": "y" * 5000}]),  # a long new message
                body(msgs, t=json.loads(json.dumps(tools))[::-1]),  # the same tools, reordered: all new text
                body(msgs)[:-1],  # malformed: json.loads' error comes from the thread
                body(msgs).replace(b'"model"', b'"messages": [], "model"')):  # a duplicate key
        with pytest.raises(Unshared):
            r.decode(raw, 4096)
    last = msgs + [msg(41, rng)]
    again = r.decode(body(last), 4096)  # the refusals changed nothing: still the kept body's items
    assert same(again, json.loads(body(last))) and again["messages"][30] is got["messages"][30]


def test_load_body_under_a_budget_refuses_or_decodes_as_without():
    """``load_body(..., new_chars)``: a small change passes the same checks (nesting refused as
    without a budget); a large one raises ``Unshared`` before any check."""
    r = ResentBodies()
    tools = harness_tools(3)
    ok = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    load_body(json.dumps(ok).encode(), 8, r)
    grown = {**ok, "messages": ok["messages"] + [{"role": "user", "content": "more"}]}
    assert load_body(json.dumps(grown).encode(), 8, r, 4096)["tools"] is r.body["tools"]
    with pytest.raises(EndpointError) as e:
        load_body(json.dumps({**grown, "config": [[[[[[[[1]]]]]]]]}).encode(), 8, r, 4096)
    assert "nested deeper" in e.value.message
    with pytest.raises(Unshared):
        load_body(json.dumps({**grown, "system": "s" * 5000}).encode(), 8, r, 4096)
