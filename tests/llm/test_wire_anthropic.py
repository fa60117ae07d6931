"""Anthropic Messages shapes (``rolloutd.endpoint.shapes.anthropic``) checked with the real ``anthropic``
SDK as the parser: its streaming accumulator and its non-streaming model must rebuild exactly the
reply's text, tool calls (ids, names, inputs), thinking and stop reason; an assistant turn sent
back by the SDK as history parses to the Msg the Chat Completions path would; bad bodies get
Anthropic's error shape and status. A real uvicorn socket on loopback; no endpoint session."""

from __future__ import annotations

import json

import pytest

from .wire_helpers import need_sdk  # noqa: E402

anthropic = need_sdk("anthropic", "the anthropic SDK")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.endpoint.shapes import anthropic as W
from rolloutd.endpoint.wire import canon_args

from .wire_helpers import Answer, WireServer, chat_msg, fuzz, post_bad_bodies, reply, same_turn

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"name": "Bash", "description": "Run a shell command.", "cache_control": {"type": "ephemeral"},
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
         {"name": "Edit", "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                                             "new": {"type": "string"}}}}]
CALLS = [("Bash", {"command": "ls -la | grep 'x' \u00e9"}), ("Edit", {"path": "a.py", "new": "x = {\"k\": [1, 2]}\n"})]


class Serve:
    """Answers /v1/messages with ``self.reply`` rendered by the module under test."""

    def __init__(self):
        self.reply = reply()
        self.reqs = []

    def __call__(self, s):
        if s.path == "/v1/messages/count_tokens":
            req = W.parse_count_tokens(s.body)
            self.reqs.append(req)
            return Answer(200, [json.dumps(W.count_tokens_response(17 + len(req.messages))).encode()])
        if s.path != "/v1/messages":
            return Answer(404, [W.error_body(W.bad("no route"))])
        req = W.parse(s.body)
        self.reqs.append(req)
        if req.stream:
            return Answer(200, W.stream_events(self.reply, req), sse=True)
        return Answer(200, [json.dumps(W.response(self.reply, req)).encode()])


def client(url):
    return anthropic.AsyncAnthropic(base_url=url, api_key="sk-test", max_retries=0)


def check_message(msg, r, thinking=True):
    blocks = [b.type for b in msg.content]
    want = (["thinking"] if thinking and r.reasoning else []) + (["text"] if r.content else []) + \
        ["tool_use"] * len(r.tool_calls)
    assert blocks == want
    if thinking and r.reasoning:
        assert msg.content[0].thinking == r.reasoning and msg.content[0].signature
    if r.content:
        assert next(b for b in msg.content if b.type == "text").text == r.content
    uses = [b for b in msg.content if b.type == "tool_use"]
    for b, tc in zip(uses, r.tool_calls):
        assert b.id.startswith("toolu_") and b.id == W.tool_use_id(tc["id"])
        assert b.name == tc["function"]["name"]
        assert b.input == json.loads(tc["function"]["arguments"])
    assert msg.usage.input_tokens == r.prompt_tokens and msg.usage.output_tokens == r.completion_tokens


def test_stream_rebuilds_thinking_text_and_tool_calls(arun):
    """messages.stream(...).get_final_message() rebuilds the reply; the raw event order is Anthropic's."""
    srv_h = Serve()
    srv_h.reply = reply("I'll look.", CALLS, reasoning="The user wants a listing.\nFirst ls.")

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            async with c.messages.stream(model="claude-x", max_tokens=1000, tools=TOOLS,
                                         system=[{"type": "text", "text": "You are helpful.",
                                                  "cache_control": {"type": "ephemeral"}}],
                                         thinking={"type": "enabled", "budget_tokens": 1024},
                                         messages=[{"role": "user", "content": "list files"}]) as st:
                kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) async for e in st]
                final = await st.get_final_message()
            await c.close()
            return final, kinds

    final, kinds = arun(go())
    check_message(final, srv_h.reply)
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    raw = [k for k in kinds if k[0] in ("message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == ("message_start", None) and raw[-2:] == [("message_delta", None), ("message_stop", None)]
    deltas = [d for t, d in raw if t == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta", "input_json_delta"]
    req = srv_h.reqs[0]
    assert req.stream and req.extras["thinking"]["type"] == "enabled"
    assert [m.role for m in req.messages] == ["system", "user"] and req.messages[0].content == "You are helpful."
    assert [t["function"]["name"] for t in req.tools] == ["Bash", "Edit"]
    assert req.tools[0]["function"]["parameters"] == TOOLS[0]["input_schema"]


@pytest.mark.parametrize("finish,seq,want", [("stop", None, "end_turn"), ("length", None, "max_tokens"),
                                             ("stop", "###", "stop_sequence")])
def test_stop_reasons_streaming_and_not(arun, finish, seq, want):
    srv_h = Serve()
    srv_h.reply = reply("partial answer", finish=finish, stop_sequence=seq)

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            # temperature/top_p/top_k: older SDKs' and Claude Code's fields, gone from this SDK's signature
            kw = dict(model="m", max_tokens=50, stop_sequences=["###"],
                      extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 20},
                      messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      metadata={"user_id": "u1"})
            plain = await c.messages.create(**kw)
            async with c.messages.stream(**kw) as st:
                streamed = await st.get_final_message()
            await c.close()
            return plain, streamed

    plain, streamed = arun(go())
    for m in (plain, streamed):
        check_message(m, srv_h.reply)
        assert m.stop_reason == want and m.stop_sequence == seq
    s = srv_h.reqs[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (50, 0.3, 0.9, 20, ["###"])
    assert srv_h.reqs[0].extras["metadata"] == {"user_id": "u1"}


def test_thinking_disabled_is_not_returned(arun):
    srv_h = Serve()
    srv_h.reply = reply("answer", reasoning="hidden")

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            m = await c.messages.create(model="m", max_tokens=10, thinking={"type": "disabled"},
                                        messages=[{"role": "user", "content": "q"}])
            await c.close()
            return m

    m = arun(go())
    check_message(m, srv_h.reply, thinking=False)


def test_round_trip_assistant_turn_and_tool_results(arun):
    """The SDK's final message sent back as history (to_param, thinking and signature included)
    with tool_result blocks parses to the Chat Completions path's Msg for the same reply, and the
    results become tool messages carrying the tool_use ids and names."""
    srv_h = Serve()
    r1 = reply("Let me check.", CALLS, reasoning="think first")
    srv_h.reply = r1

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            hist = [{"role": "user", "content": "fix it"}]
            async with c.messages.stream(model="m", max_tokens=100, tools=TOOLS, messages=hist,
                                         thinking={"type": "enabled", "budget_tokens": 500}) as st:
                first = await st.get_final_message()
            uses = [b for b in first.content if b.type == "tool_use"]
            hist = hist + [first.to_param(), {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "a.py\nb.py"},
                {"type": "tool_result", "tool_use_id": uses[1].id, "is_error": True,
                 "content": [{"type": "text", "text": "no such file"}], "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "<system-reminder>go on</system-reminder>"}]}]
            srv_h.reply = reply("All done.")
            second = await c.messages.create(model="m", max_tokens=100, tools=TOOLS, messages=hist)
            await c.close()
            return first, second

    first, second = arun(go())
    msgs = srv_h.reqs[1].messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool", "user"]
    a = msgs[1]
    assert same_turn(a, chat_msg(r1)) and a.reasoning == "think first"
    assert a.calls == tuple((n, canon_args(x)) for n, x in CALLS)
    assert [W.tool_use_id(i) for i in a.call_ids] == [b.id for b in first.content if b.type == "tool_use"]
    assert list(a.call_ids) == [tc["id"] for tc in r1.tool_calls]  # the endpoint's ids again
    assert (msgs[2].tool_call_id, msgs[2].name, msgs[2].content) == (a.call_ids[0], "Bash", "a.py\nb.py")
    assert (msgs[3].tool_call_id, msgs[3].name, msgs[3].content) == (a.call_ids[1], "Edit", "no such file")
    assert msgs[4].content == "<system-reminder>go on</system-reminder>"
    assert second.content[0].text == "All done." and second.stop_reason == "end_turn"


def test_count_tokens(arun):
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            n = await c.messages.count_tokens(model="m", system="sys", tools=TOOLS,
                                              messages=[{"role": "user", "content": "hello"}])
            await c.close()
            return n

    n = arun(go())
    assert n.input_tokens == 17 + 2 and srv_h.reqs[0].sampling.max_tokens is None


def test_text_blocks_join_with_newlines_as_vllm_joins_them():
    req = W.parse({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "fix it"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me "}, {"type": "text", "text": "look."},
                                          {"type": "tool_use", "id": "toolu_c", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c", "content": [
            {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]}]}]})
    assert [m.content for m in req.messages] == ["<reminder>\nfix it", "Let me \nlook.", "line 1\nline 2"]


def test_count_tokens_takes_a_list_ending_with_an_assistant_turn():
    req = W.parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "x"},
                                                           {"role": "assistant", "content": "partial"}]})
    assert [m.role for m in req.messages] == ["user", "assistant"]


def test_unknown_fields_and_cache_control_are_tolerated():
    req = W.parse({"model": "m", "max_tokens": 5, "context_management": {"edits": []}, "service_tier": "auto",
                   "output_config": {"effort": "high"}, "brand_new_field": [1],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control":
                                                              {"type": "ephemeral"}, "citations": None}]}]})
    assert req.messages[0].content == "a" and req.extras["output_config"] == {"effort": "high"}


BAD = [
    ("not an object", ["a"], "body must be a JSON object"),
    ("no max_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("max_tokens 0", {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("no messages", {"model": "m", "max_tokens": 5}, "messages"),
    ("messages not a list", {"model": "m", "max_tokens": 5, "messages": "hi"}, "messages"),
    ("bad role", {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("no content", {"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}, "content"),
    ("image", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ("temperature 1.5", {"model": "m", "max_tokens": 5, "temperature": 1.5,
                         "messages": [{"role": "user", "content": "x"}]}, "temperature"),
    ("top_k string", {"model": "m", "max_tokens": 5, "top_k": "5", "messages": [{"role": "user", "content": "x"}]},
     "top_k"),
    ("stop_sequences str", {"model": "m", "max_tokens": 5, "stop_sequences": "x",
                            "messages": [{"role": "user", "content": "x"}]}, "stop_sequences"),
    ("tool without schema", {"model": "m", "max_tokens": 5, "tools": [{"name": "t"}],
                             "messages": [{"role": "user", "content": "x"}]}, "input_schema"),
    ("server tool", {"model": "m", "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                     "messages": [{"role": "user", "content": "x"}]}, "server tool"),
    ("tool_choice unknown tool", {"model": "m", "max_tokens": 5, "tools": TOOLS,
                                  "tool_choice": {"type": "tool", "name": "Nope"},
                                  "messages": [{"role": "user", "content": "x"}]}, "Nope"),
    ("tool_choice string", {"model": "m", "max_tokens": 5, "tool_choice": "auto",
                            "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
    ("tool_result without id", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ("tool_use input not object", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "t", "input": "ls"}]},
        {"role": "user", "content": "y"}]}, "input"),
    ("prefill", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                             {"role": "assistant", "content": "The answer is"}]},
     "prefill"),
    ("stream not bool", {"model": "m", "max_tokens": 5, "stream": "yes",
                         "messages": [{"role": "user", "content": "x"}]}, "stream"),
]


def test_bad_input_gets_anthropics_error_shape(arun):
    """Every malformed body: HTTP 400, ``{"type": "error", "error": {"type": "invalid_request_error",
    "message"}}``, which the SDK raises as BadRequestError; raw bytes that are not JSON too."""
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            out = await post_bad_bodies(srv, BAD, "/v1/messages", b"{not json")
            c = client(srv.url)
            with pytest.raises(anthropic.BadRequestError) as ei:
                await c.messages.create(model="m", max_tokens=5, extra_body={"temperature": 3},
                                        messages=[{"role": "user", "content": "x"}])
            await c.close()
            out.append(("sdk", "temperature", ei.value.status_code, ei.value.body))
        return out

    for name, needle, status, body in arun(go()):
        assert status == 400, name
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", name
        assert needle in body["error"]["message"], (name, body)


def test_error_body_maps_endpoint_refusals():
    E = W.EndpointError
    cases = [(E(401, "invalid API key"), "authentication_error"), (E(429, "spent"), "rate_limit_error"),
             (E(503, "job cancelled", type="service_unavailable"), "api_error"), (E(413, "big"), "request_too_large"),
             (E(404, "no route"), "not_found_error")]
    for e, kind in cases:
        b = json.loads(W.error_body(e))
        assert b["type"] == "error" and b["error"]["type"] == kind
    b = json.loads(W.error_body(W.bad("the messages take 900 tokens; this job's context window is 512", "messages",
                                      "context_length_exceeded")))
    assert b["error"]["message"].startswith("prompt is too long: 900 tokens > 512 maximum")
    b = json.loads(W.error_body(W.bad("backend: too long", "messages", "context_length_exceeded")))
    assert b["error"]["message"] == "prompt is too long: backend: too long"


def test_fuzzed_bodies_give_400_never_a_crash_and_the_cache_changes_nothing():
    body = {"model": "m", "max_tokens": 100, "stream": True, "temperature": 0.5, "top_k": 5, "stop_sequences": ["x"],
            "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "enabled", "budget_tokens": 10}, "metadata": {"user_id": "u"},
            "tool_choice": {"type": "tool", "name": "Bash"}, "tools": TOOLS,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                           {"type": "text", "text": "ok"},
                                                           {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                            "input": {"command": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "text", "text": "a"}]},
                                                      {"type": "text", "text": "go"}]}]}
    r = reply("x", CALLS, reasoning="y")
    refused = fuzz(W.parse, lambda req: (W.response(r, req), W.stream_events(r, req)), body,
                   cached=lambda b, c: W.parse(b, cache=c))
    assert 0 < refused < 400


@pytest.mark.parametrize("finish,seq", [("stop", None), ("length", None), ("stop", "###")])
def test_every_event_validates_strictly_against_the_sdk_models(finish, seq):
    """The SDK's accumulator builds objects without validation; its pydantic models, strictly
    validated, also accept the message and every event (required fields present, types right)."""
    pydantic = pytest.importorskip("pydantic")
    r = reply("text", CALLS if finish == "stop" and not seq else [], reasoning="why", finish=finish, stop_sequence=seq)
    req = W.parse({"model": "m", "max_tokens": 5, "tools": TOOLS, "messages": [{"role": "user", "content": "x"}]})
    anthropic.types.Message.model_validate(W.response(r, req))
    ta = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    names = []
    for ev in W.stream_events(r, req):
        head, data = ev.split(b"\ndata: ", 1)
        d = json.loads(data)
        assert head == b"event: " + d["type"].encode() and ev.endswith(b"\n\n")
        names.append(d["type"])
        if d["type"] != "ping":
            ta.validate_python(d)
    assert names.count("ping") == 1 and names[-2:] == ["message_delta", "message_stop"]
