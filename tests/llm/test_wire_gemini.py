"""Gemini API shapes (``rolloutd.endpoint.shapes.gemini``) checked with the real ``google-genai`` SDK as the
parser: ``generate_content``, ``generate_content_stream`` (``alt=sse``) and ``count_tokens`` must
give exactly the reply's text, thoughts, function calls (ids, names, args) and finish reason; a
chat's history as the SDK records it (the model turn sent back, function responses) parses to the
Chat Completions path's Msg; bad bodies get Google's error shape. A real uvicorn socket on
loopback; no endpoint session."""

from __future__ import annotations

import json
import re

import pytest

from .wire_helpers import need_sdk  # noqa: E402

genai = need_sdk("google.genai", "google-genai")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from google.genai import errors as gerrors
from google.genai import types

from rolloutd.endpoint.shapes import gemini as W
from rolloutd.endpoint.wire import canon_args

from .wire_helpers import Answer, WireServer, chat_msg, fuzz, post_bad_bodies, reply, same_turn

pytestmark = pytest.mark.timeout(120)

_ROUTE = re.compile(r"^/v1beta/models/([^/:]+):(generateContent|streamGenerateContent|countTokens)$")
CALLS = [("run_shell_command", {"command": "ls -la", "description": "list"}),
         ("replace", {"file_path": "/w/a.py", "old_string": "x = 1", "new_string": "x = \"\u00e9\""})]


class Serve:
    def __init__(self):
        self.reply = reply()
        self.reqs = []

    def __call__(self, s):
        m = _ROUTE.match(s.path)
        if not m:
            raise W.EndpointError(404, f"no route {s.path}")
        model, verb = m.groups()
        if verb == "countTokens":
            req = W.parse_count_tokens(s.body, model)
            self.reqs.append(req)
            return Answer(200, [json.dumps(W.count_tokens_response(40 + len(req.messages))).encode()])
        req = W.parse(s.body, model, stream=verb == "streamGenerateContent")
        self.reqs.append(req)
        if req.stream:
            assert "alt=sse" in s.query
            return Answer(200, W.stream_chunks(self.reply, req), sse=True)
        return Answer(200, [json.dumps(W.response(self.reply, req)).encode()])


def client(url):
    return genai.Client(api_key="test-key", http_options=types.HttpOptions(
        base_url=url, api_version="v1beta", retry_options=types.HttpRetryOptions(attempts=1)))


DECLS = [types.FunctionDeclaration(name="run_shell_command", description="Run a shell command.",
                                   parameters_json_schema={"type": "object", "properties": {
                                       "command": {"type": "string"}, "description": {"type": "string"}},
                                       "required": ["command"]}),
         types.FunctionDeclaration(name="replace", description="Replace text.", parameters=types.Schema(
             type="OBJECT", properties={"file_path": types.Schema(type="STRING"),
                                        "old_string": types.Schema(type="STRING"),
                                        "new_string": types.Schema(type="STRING")}))]


def config(**kw):
    return types.GenerateContentConfig(system_instruction="You are Gemini CLI.", tools=[types.Tool(
        function_declarations=DECLS)], automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        **kw)


def collect(chunks):
    """What Gemini CLI takes from a stream: text, thoughts, calls, the last finish reason and usage."""
    text, thoughts, calls, finish, usage = "", "", [], None, None
    for ch in chunks:
        for p in ch.candidates[0].content.parts or ():
            if p.text is not None:
                if p.thought:
                    thoughts += p.text
                else:
                    text += p.text
            if p.function_call is not None:
                calls.append(p.function_call)
        finish = ch.candidates[0].finish_reason or finish
        usage = ch.usage_metadata or usage
    return text, thoughts, calls, finish, usage


def check(text, thoughts, calls, finish, usage, r, show_thoughts):
    assert text == (r.content or "")
    assert thoughts == (r.reasoning if show_thoughts and r.reasoning else "")
    assert [(c.id, c.name, c.args) for c in calls] == [
        (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in r.tool_calls]
    assert finish == (types.FinishReason.MAX_TOKENS if r.finish_reason == "length" else types.FinishReason.STOP)
    assert usage.prompt_token_count == r.prompt_tokens and usage.candidates_token_count == r.completion_tokens


@pytest.mark.parametrize("show_thoughts", [True, False])
def test_stream_and_plain_rebuild_text_thoughts_and_calls(arun, show_thoughts):
    srv_h = Serve()
    srv_h.reply = reply("Let me look.", CALLS, reasoning="First list the files.")

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            cfg = config(temperature=0.7, top_p=0.95, top_k=40, max_output_tokens=300, stop_sequences=["END"],
                         seed=3, thinking_config=types.ThinkingConfig(include_thoughts=show_thoughts,
                                                                      thinking_budget=512))
            chunks = [ch async for ch in await c.aio.models.generate_content_stream(
                model="gemini-x", contents="fix the bug", config=cfg)]
            plain = await c.aio.models.generate_content(model="gemini-x", contents="fix the bug", config=cfg)
            return chunks, plain

    chunks, plain = arun(go())
    r = srv_h.reply
    assert len(chunks) == (3 if show_thoughts else 2)
    check(*collect(chunks), r, show_thoughts)
    check(*collect([plain]), r, show_thoughts)
    req = srv_h.reqs[0]
    assert req.stream and req.model == "gemini-x" and not srv_h.reqs[1].stream
    assert [m.role for m in req.messages] == ["system", "user"]
    assert req.messages[0].content == "You are Gemini CLI." and req.messages[1].content == "fix the bug"
    assert req.tools[1]["function"]["parameters"]["properties"]["file_path"] == {"type": "string"}
    assert req.tools[0]["function"]["parameters"] == DECLS[0].parameters_json_schema
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (0.7, 0.95, 40, 300, ["END"], 3)
    assert req.extras["include_thoughts"] is show_thoughts


def test_max_tokens_and_empty_reply(arun):
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            srv_h.reply = reply("trunc", finish="length")
            a = [ch async for ch in await c.aio.models.generate_content_stream(model="m", contents="q")]
            srv_h.reply = reply(None)
            b = await c.aio.models.generate_content(model="m", contents="q")
            return a, b

    a, b = arun(go())
    assert collect(a)[3] == types.FinishReason.MAX_TOKENS and collect(a)[0] == "trunc"
    assert b.candidates[0].finish_reason == types.FinishReason.STOP and collect([b])[0] == ""


def test_round_trip_chat_history_with_function_responses(arun):
    """The SDK's chat records the streamed model turn; sent back with function responses (Gemini
    CLI's ``{"output": ...}``), it parses to the Chat Completions path's Msg for the same reply."""
    srv_h = Serve()
    r1 = reply("Let me look.", CALLS, reasoning="think")
    srv_h.reply = r1

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            chat = c.aio.chats.create(model="m", config=config(thinking_config=types.ThinkingConfig(
                include_thoughts=True)))
            first = [ch async for ch in await chat.send_message_stream("fix the bug")]
            calls = collect(first)[2]
            srv_h.reply = reply("Fixed.")
            second = await chat.send_message([
                types.Part(function_response=types.FunctionResponse(id=calls[0].id, name=calls[0].name,
                                                                    response={"output": "a.py\nb.py"})),
                types.Part(function_response=types.FunctionResponse(id=calls[1].id, name=calls[1].name,
                                                                    response={"error": "no match"}))])
            return second

    second = arun(go())
    msgs = srv_h.reqs[1].messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    a = msgs[2]
    assert same_turn(a, chat_msg(r1)) and a.reasoning == "think"
    assert a.calls == tuple((n, canon_args(x)) for n, x in CALLS)
    assert list(a.call_ids) == [tc["id"] for tc in r1.tool_calls]
    assert [(m.tool_call_id, m.name, m.content) for m in msgs[3:]] == [
        (r1.tool_calls[0]["id"], "run_shell_command", "a.py\nb.py"),
        (r1.tool_calls[1]["id"], "replace", '{"error": "no match"}')]
    assert collect([second])[0] == "Fixed."


def test_count_tokens(arun):
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            return await c.aio.models.count_tokens(model="m", contents=["one", "two"])

    n = arun(go())
    assert n.total_tokens == 40 + 1 and srv_h.reqs[0].messages[0].content == "one\ntwo"


def test_responses_without_ids_answer_the_open_calls_of_their_name():
    req = W.parse({"contents": [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {}}}, {"functionCall": {"name": "b"}},
                                    {"functionCall": {"name": "a", "args": {"x": 1}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "a", "response": {"output": "1"}}},
                                   {"functionResponse": {"name": "a", "response": {"output": "2"}}},
                                   {"functionResponse": {"name": "b", "response": {"output": "3"}}}]}]})
    calls = req.messages[1]
    assert calls.call_ids == ("call_1_0", "call_1_1", "call_1_2")
    assert [(m.tool_call_id, m.name, m.content) for m in req.messages[2:]] == [
        ("call_1_0", "a", "1"), ("call_1_2", "a", "2"), ("call_1_1", "b", "3")]


def test_snake_case_camel_case_and_unknown_fields():
    a = W.parse({"contents": [{"role": "user", "parts": [{"text": "q"}]}], "system_instruction": {"parts": [
        {"text": "S"}]}, "generation_config": {"max_output_tokens": 9, "thinking_config": {"include_thoughts": True}},
        "tool_config": {"function_calling_config": {"mode": "NONE"}}, "safetySettings": [], "labels": {"a": "b"},
        "brandNew": 1})
    b = W.parse({"contents": [{"role": "user", "parts": [{"text": "q"}]}], "systemInstruction": {"parts": [
        {"text": "S"}]}, "generationConfig": {"maxOutputTokens": 9, "thinkingConfig": {"includeThoughts": True},
                                              "responseMimeType": "application/json",
                                              "responseJsonSchema": {"type": "object"}},
        "toolConfig": {"functionCallingConfig": {"mode": "NONE"}}})
    for r in (a, b):
        assert [m.key for m in r.messages] == [("system", "S", None, None, ()), ("user", "q", None, None, ())]
        assert r.sampling.max_tokens == 9 and r.extras["include_thoughts"] and not r.parse_calls
    assert b.extras["response_format"]["schema"] == {"type": "object"}


BAD = [
    ("not an object", [1], "body must be an object"),
    ("no contents", {}, "contents"),
    ("empty parts", {"contents": [{"role": "user", "parts": []}]}, "parts"),
    # issue 38: a string is not "empty": the message says what is wrong
    ("parts a string", {"contents": [{"role": "user", "parts": "hi"}]}, "must be a list of parts, got str"),
    ("bad role", {"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "role"),
    ("image", {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
     "inlineData"),
    ("call in user turn", {"contents": [{"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]},
     "functionCall"),
    ("response without name", {"contents": [{"role": "user", "parts": [{"functionResponse": {"response": {}}}]}]},
     "name"),
    ("google search", {"contents": [{"parts": [{"text": "x"}]}], "tools": [{"googleSearch": {}}]}, "googleSearch"),
    ("decl without name", {"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{}]}]},
     "name"),
    ("temperature 5", {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": 5}},
     "temperature"),
    ("candidates 2", {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
     "candidate_count"),
    ("stop not list", {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"stopSequences": "x"}},
     "stop_sequences"),
    ("bad mode", {"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "X"}}},
     "mode"),
    ("cached content", {"contents": [{"parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"},
     "cached_content"),
]


def test_bad_input_gets_googles_error_shape(arun):
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            out = await post_bad_bodies(srv, BAD, "/v1beta/models/m:generateContent", b"[",
                                        "/v1beta/models/m:streamGenerateContent?alt=sse")
            c = client(srv.url)
            with pytest.raises(gerrors.ClientError) as ei:
                await c.aio.models.generate_content(model="m", contents="x",
                                                    config=types.GenerateContentConfig(candidate_count=3))
        return out, ei.value

    out, e = arun(go())
    for name, needle, status, body in out:
        assert status == 400, name
        assert body["error"]["code"] == 400 and body["error"]["status"] == "INVALID_ARGUMENT", name
        assert needle in body["error"]["message"], (name, body)
    assert e.code == 400 and e.status == "INVALID_ARGUMENT" and "candidate_count" in e.message


def test_error_body_maps_endpoint_refusals():
    for status, name in [(401, "UNAUTHENTICATED"), (429, "RESOURCE_EXHAUSTED"), (503, "UNAVAILABLE"),
                         (404, "NOT_FOUND"), (500, "INTERNAL")]:
        b = json.loads(W.error_body(W.EndpointError(status, "x")))
        assert b == {"error": {"code": status, "message": "x", "status": name}}


def test_fuzzed_bodies_give_400_never_a_crash_and_the_cache_changes_nothing():
    body = {"systemInstruction": {"role": "user", "parts": [{"text": "sys"}]},
            "contents": [{"role": "user", "parts": [{"text": "hi"}]},
                         {"role": "model", "parts": [{"text": "t", "thought": True}, {"text": "ok"},
                                                     {"functionCall": {"id": "c1", "name": "run_shell_command",
                                                                       "args": {"command": "ls"}},
                                                      "thoughtSignature": "c2ln"}]},
                         {"role": "user", "parts": [{"functionResponse": {"id": "c1", "name": "run_shell_command",
                                                                          "response": {"output": "a"}}}]}],
            "tools": [{"functionDeclarations": [{"name": "run_shell_command", "description": "d",
                                                 "parametersJsonSchema": {"type": "object"}},
                                                {"name": "replace", "parameters": {"type": "OBJECT", "properties": {
                                                    "x": {"type": "STRING"}}}}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["replace"]}},
            "generationConfig": {"temperature": 0.5, "topP": 0.9, "topK": 3, "maxOutputTokens": 50,
                                 "stopSequences": ["x"], "seed": 1, "candidateCount": 1,
                                 "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 10},
                                 "responseMimeType": "application/json", "responseJsonSchema": {"type": "object"}}}
    r = reply("x", CALLS, reasoning="y")
    refused = fuzz(lambda b: W.parse(b, "m", True), lambda req: (W.response(r, req), W.stream_chunks(r, req)), body,
                   cached=lambda b, c: W.parse(b, "m", True, cache=c))
    assert 0 < refused < 400


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_every_chunk_validates_strictly_against_the_sdk_models(finish):
    r = reply("text", CALLS if finish == "stop" else [], reasoning="why", finish=finish)
    req = W.parse({"contents": [{"parts": [{"text": "x"}]}],
                   "generationConfig": {"thinkingConfig": {"includeThoughts": True}}})
    types.GenerateContentResponse.model_validate(W.response(r, req))
    for ch in W.stream_chunks(r, req):
        assert ch.startswith(b"data: ") and ch.endswith(b"\r\n\r\n")
        types.GenerateContentResponse.model_validate(json.loads(ch[6:]))
