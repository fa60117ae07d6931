"""OpenAI Responses shapes (``rolloutd.endpoint.shapes.responses``) checked with the real ``openai`` SDK as
the parser: ``responses.create`` and the ``responses.stream`` accumulator must rebuild exactly the
reply's reasoning, text and calls (function, Codex's custom/freeform and local_shell, namespaced),
with ids and arguments; Codex-style history (output items sent back, developer messages,
``function_call_output``) and ``previous_response_id`` parse to the Chat Completions path's Msg;
bad bodies get OpenAI's error shape. A real uvicorn socket on loopback; no endpoint session."""

from __future__ import annotations

import json

import pytest

from .wire_helpers import need_sdk  # noqa: E402

openai = need_sdk("openai", "the openai SDK")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.endpoint.shapes import responses as W
from rolloutd.endpoint.wire import canon_args

from .wire_helpers import Answer, WireServer, chat_msg, fuzz, post_bad_bodies, reply, same_turn

pytestmark = pytest.mark.timeout(120)

GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}},
    {"type": "local_shell"},
    {"type": "namespace", "name": "mcp__fs", "description": "File tools.",
     "tools": [{"type": "function", "name": "read_file", "description": "Read a file.", "strict": False,
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
    {"type": "web_search", "external_web_access": False},
]
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch\n"
CALLS = [("exec_command", {"cmd": "ls -la"}), ("apply_patch", {"input": PATCH}),
         ("local_shell", {"command": ["bash", "-lc", "pytest -q"], "workdir": "/workspace", "timeout_ms": 5000}),
         ("read_file", {"path": "\u00e9t\u00e9.txt"})]


class Serve:
    """Answers /v1/responses with ``self.reply``; keeps the store for previous_response_id."""

    def __init__(self):
        self.reply = reply()
        self.reqs = []
        self.store: dict[str, list] = {}
        self.objects: dict[str, dict] = {}

    def __call__(self, s):
        if s.method == "GET" and s.path.startswith("/v1/responses/"):
            rid = s.path.rsplit("/", 1)[1]
            if rid not in self.objects:
                return Answer(404, [W.error_body(W.EndpointError(404, f"No response with id {rid!r}"))])
            return Answer(200, [json.dumps(self.objects[rid]).encode()])
        prev = s.body.get("previous_response_id") if isinstance(s.body, dict) else None
        req = W.parse(s.body, self.store.get(prev) if isinstance(prev, str) else None)
        self.reqs.append(req)
        r = self.reply
        if req.extras["store"]:
            self.store[W.response_id(r)] = W.conversation_items(req, r)
            self.objects[W.response_id(r)] = W.response(r, req)
        if req.stream:
            return Answer(200, W.stream_events(r, req), sse=True)
        return Answer(200, [json.dumps(W.response(r, req)).encode()])


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)


def check_output(resp, r):
    kinds = [o.type for o in resp.output]
    assert kinds == (["reasoning"] if r.reasoning else []) + (["message"] if r.content else []) + \
        ["function_call", "custom_tool_call", "local_shell_call", "function_call"][:len(r.tool_calls)]
    items = list(resp.output)
    if r.reasoning:
        assert items.pop(0).content[0].text == r.reasoning
    if r.content:
        assert resp.output_text == r.content and items.pop(0).content[0].text == r.content
    for it, tc in zip(items, r.tool_calls):
        args = json.loads(tc["function"]["arguments"])
        assert it.call_id == tc["id"]
        if it.type == "function_call":
            assert it.name == tc["function"]["name"] and json.loads(it.arguments) == args
        elif it.type == "custom_tool_call":
            assert it.name == "apply_patch" and it.input == args["input"]
        else:
            assert it.action.command == args["command"] and it.action.working_directory == args["workdir"]
            assert it.action.timeout_ms == args["timeout_ms"]
    ns = [it for it in items if it.type == "function_call" and it.name == "read_file"]
    assert all(it.namespace == "mcp__fs" for it in ns)
    assert resp.usage.input_tokens == r.prompt_tokens and resp.usage.output_tokens == r.completion_tokens


def test_stream_and_create_rebuild_every_item_kind(arun):
    srv_h = Serve()
    srv_h.reply = reply("Running the tests.", CALLS, reasoning="Need to look first.")

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            kw = dict(model="gpt-x", instructions="You are Codex.", tools=TOOLS, store=False,
                      include=["reasoning.encrypted_content"], parallel_tool_calls=False,
                      input=[{"type": "message", "role": "developer", "content": [
                          {"type": "input_text", "text": "<permissions>full</permissions>"}]},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix"}]}])
            plain = await c.responses.create(**kw)
            async with c.responses.stream(**kw) as st:
                events = [e.type async for e in st]
                final = await st.get_final_response()
            await c.close()
            return plain, final, events

    plain, final, events = arun(go())
    for resp in (plain, final):
        check_output(resp, srv_h.reply)
        assert resp.status == "completed" and resp.id == W.response_id(srv_h.reply)
    assert final.output[0].encrypted_content  # include asked for it
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    want = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
            "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done",
            "response.output_item.added", "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done", "response.output_item.done",
            "response.output_item.added", "response.output_item.done",
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert events[2:-1] == want
    req = srv_h.reqs[0]
    assert [m.role for m in req.messages] == ["system", "system", "user"]
    assert [t["function"]["name"] for t in req.tools] == ["exec_command", "apply_patch", "local_shell", "read_file"]
    assert GRAMMAR in req.tools[1]["function"]["description"] and req.extras["ignored_tools"] == ["web_search"]
    assert req.extras["parallel_tool_calls"] is False and not req.extras["store"]


def test_sequence_numbers_and_incomplete(arun):
    """Raw events count 0,1,2,... and a reply cut by max_output_tokens ends with response.incomplete."""
    srv_h = Serve()
    srv_h.reply = reply("cut sho", finish="length")

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            stream = await c.responses.create(model="m", input="hi", max_output_tokens=16, stream=True)
            evs = [e async for e in stream]
            plain = await c.responses.create(model="m", input="hi", max_output_tokens=16)
            await c.close()
            return evs, plain

    evs, plain = arun(go())
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[-1].type == "response.incomplete" and evs[-1].response.status == "incomplete"
    assert evs[-1].response.incomplete_details.reason == "max_output_tokens"
    assert plain.status == "incomplete" and plain.output_text == "cut sho"
    assert srv_h.reqs[0].sampling.max_tokens == 16


def test_round_trip_codex_history_and_previous_response_id(arun):
    """Output items sent back (as the SDK dumps them, reasoning with only encrypted_content left)
    with function_call_output / custom_tool_call_output items parse to one assistant Msg equal to
    the Chat Completions path's; the same turn continued by previous_response_id parses the same."""
    srv_h = Serve()
    r1 = reply("Running the tests.", CALLS, reasoning="Need to look first.")
    srv_h.reply = r1

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            first_input = [{"role": "user", "content": "fix the bug"}]
            async with c.responses.stream(model="m", instructions="Be brief.", tools=TOOLS, input=first_input,
                                          include=["reasoning.encrypted_content"]) as st:
                first = await st.get_final_response()
            back = [o.model_dump(exclude_none=True) for o in first.output]
            back[0].pop("content")  # keep only encrypted_content, as a client that drops the text would
            outs = [{"type": "function_call_output", "call_id": first.output[2].call_id, "output": "a.py"},
                    {"type": "custom_tool_call_output", "call_id": first.output[3].call_id, "output": "Done!"},
                    {"type": "function_call_output", "call_id": first.output[4].call_id,
                     "output": [{"type": "input_text", "text": "1 passed"}]},
                    {"type": "function_call_output", "call_id": first.output[5].call_id, "output": "x"}]
            srv_h.reply = reply("All green.", rid="chatcmpl-00second")
            full = await c.responses.create(model="m", instructions="Be brief.", tools=TOOLS,
                                            input=first_input + back + outs)
            chained = await c.responses.create(model="m", instructions="Be brief.", tools=TOOLS,
                                               previous_response_id=first.id, input=outs)
            got = await c.responses.retrieve(first.id)
            await c.close()
            return first, full, chained, got

    first, full, chained, got = arun(go())
    msgs = srv_h.reqs[1].messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "tool", "tool", "tool"]
    a = msgs[2]
    assert same_turn(a, chat_msg(r1)) and a.reasoning == "Need to look first."
    assert a.calls == tuple((n, canon_args(x)) for n, x in CALLS)
    assert list(a.call_ids) == [tc["id"] for tc in r1.tool_calls]
    assert [(m.tool_call_id, m.name, m.content) for m in msgs[3:]] == [
        (r1.tool_calls[0]["id"], "exec_command", "a.py"), (r1.tool_calls[1]["id"], "apply_patch", "Done!"),
        (r1.tool_calls[2]["id"], "local_shell", "1 passed"), (r1.tool_calls[3]["id"], "read_file", "x")]
    assert [m.key for m in srv_h.reqs[2].messages] == [m.key for m in msgs]
    assert full.output_text == chained.output_text == "All green."
    assert got.id == first.id and [o.type for o in got.output] == [o.type for o in first.output]


def test_previous_response_not_found_and_unknown_get(arun):
    httpx = pytest.importorskip("httpx")
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            c = client(srv.url)
            with pytest.raises(openai.BadRequestError) as ei:
                await c.responses.create(model="m", input="x", previous_response_id="resp_nope")
            await c.close()
            async with httpx.AsyncClient(timeout=30) as h:
                g = await h.get(srv.url + "/v1/responses/resp_nope")
            return ei.value, g

    e, g = arun(go())
    assert e.status_code == 400 and e.code == "previous_response_not_found" and e.param == "previous_response_id"
    assert g.status_code == 404 and "resp_nope" in g.json()["error"]["message"]


def test_user_side_parts_join_with_newlines_assistant_parts_do_not():
    req = W.parse({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "<env>"}, {"type": "input_text", "text": "go"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Do"}, {"type": "output_text", "text": "ne."}]},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "a"},
                                                                    {"type": "input_text", "text": "b"}]}]})
    assert [m.content for m in req.messages] == ["<env>\ngo", "Done.", "a\nb"]


def test_unknown_fields_tolerated_and_codex_extras():
    req = W.parse({"model": "m", "input": [{"type": "message", "role": "user", "content": "q"},
                                           {"type": "web_search_call", "status": "completed",
                                            "action": {"type": "search", "query": "x"}}],
                   "prompt_cache_key": "abc", "client_metadata": {"x": 1}, "reasoning": {"effort": "high"},
                   "text": {"verbosity": "low"}, "service_tier": "auto", "store": False,
                   "tool_choice": "auto", "tools": [{"type": "image_generation", "output_format": "png"}]})
    assert [m.role for m in req.messages] == ["user"] and req.tools is None and not req.parse_calls
    assert req.extras["reasoning"] == {"effort": "high"} and req.extras["ignored_tools"] == ["image_generation"]


BAD = [
    ("not an object", [1], "JSON object"),
    ("no input", {"model": "m"}, "input"),
    ("input number", {"model": "m", "input": 3}, "input"),
    ("bad role", {"model": "m", "input": [{"type": "message", "role": "robot", "content": "x"}]}, "role"),
    ("image part", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]}, "input_image"),
    ("unknown item", {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ("call without call_id", {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "call_id"),
    ("arguments object", {"model": "m", "input": [{"type": "function_call", "name": "f", "call_id": "c",
                                                   "arguments": {"a": 1}}]}, "arguments"),
    ("output without call_id", {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
     "call_id"),
    ("max_output_tokens 3", {"model": "m", "input": "x", "max_output_tokens": 3}, "max_output_tokens"),
    ("temperature 9", {"model": "m", "input": "x", "temperature": 9}, "temperature"),
    ("hosted tool", {"model": "m", "input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
     "file_search"),
    ("function without name", {"model": "m", "input": "x", "tools": [{"type": "function", "parameters": {}}]},
     "name"),
    ("tool_choice unknown", {"model": "m", "input": "x", "tools": TOOLS[:1],
                             "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ("required without tools", {"model": "m", "input": "x", "tool_choice": "required"}, "required"),
    ("background", {"model": "m", "input": "x", "background": True}, "background"),
    ("include not list", {"model": "m", "input": "x", "include": "reasoning.encrypted_content"}, "include"),
]


def test_bad_input_gets_openai_error_shape(arun):
    srv_h = Serve()

    async def go():
        async with WireServer(srv_h, W.error_body) as srv:
            out = await post_bad_bodies(srv, BAD, "/v1/responses", b"\xff\xfe")
        return out

    for name, needle, status, body in arun(go()):
        assert status == 400, name
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", name
        assert needle in body["error"]["message"], (name, body)


def test_fuzzed_bodies_give_400_never_a_crash_and_the_cache_changes_nothing():
    body = {"model": "m", "instructions": "sys", "stream": True, "store": False, "max_output_tokens": 100,
            "temperature": 0.5, "top_p": 0.9, "include": ["reasoning.encrypted_content"], "parallel_tool_calls": True,
            "reasoning": {"effort": "low"}, "tools": TOOLS, "tool_choice": {"type": "function", "name": "exec_command"},
            "previous_response_id": None,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                      {"type": "message", "role": "user", "content": "hi"},
                      {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                       "content": [{"type": "reasoning_text", "text": "r"}], "encrypted_content": "rolloutd:eA=="},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                      {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
                      {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": PATCH},
                      {"type": "local_shell_call", "call_id": "c3", "status": "completed",
                       "action": {"type": "exec", "command": ["ls"], "timeout_ms": 5, "working_directory": "/"}},
                      {"type": "function_call_output", "call_id": "c1", "output": "a"},
                      {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text",
                                                                                      "text": "b"}]},
                      {"type": "local_shell_call_output", "call_id": "c3", "output": "c"}]}
    r = reply("x", CALLS, reasoning="y")
    refused = fuzz(W.parse, lambda req: (W.response(r, req), W.stream_events(r, req),
                                         W.conversation_items(req, r)), body,
                   cached=lambda b, c: W.parse(b, cache=c))
    assert 0 < refused < 400


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_every_event_validates_strictly_against_the_sdk_models(finish):
    """The stream accumulator builds objects without validation; the SDK's pydantic models,
    strictly validated, also accept the response object and every event (required fields present)."""
    pydantic = pytest.importorskip("pydantic")
    r = reply("text", CALLS if finish == "stop" else [], reasoning="why", finish=finish)
    req = W.parse({"model": "m", "input": "x", "tools": TOOLS, "include": ["reasoning.encrypted_content"]})
    openai.types.responses.Response.model_validate(W.response(r, req))
    ta = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for ev in W.stream_events(r, req):
        head, data = ev.split(b"\ndata: ", 1)
        d = json.loads(data)
        assert head == b"event: " + d["type"].encode() and ev.endswith(b"\n\n")
        ta.validate_python(d)


def test_the_response_body_carries_the_requests_tools_as_they_were_sent():
    """The non-streamed body and the stream's response objects put the request's tools in as the
    JSON the parse kept (not encoded again per reply): the same object as ``response`` builds."""
    r = reply("text", CALLS, reasoning="why")
    for tools in (TOOLS, None):
        body = {"model": "m", "input": "x", **({"tools": tools} if tools else {})}
        req = W.parse(body)
        obj = W.response(r, req)
        sent = json.loads(W.response_body(obj, req))
        assert sent == obj and sent["tools"] == (tools or [])
        assert json.loads(W.response_body(obj)) == obj  # no request: encoded whole
        objs = [json.loads(ev.split(b"\ndata: ", 1)[1])["response"] for ev in W.stream_events(r, req)
                if b'"response":' in ev]
        assert [o["status"] for o in objs] == ["in_progress", "in_progress", "completed"]
        assert all(o["tools"] == (tools or []) for o in objs)
        assert {k: v for k, v in objs[-1].items() if k != "completed_at"} == \
            {k: v for k, v in obj.items() if k != "completed_at"}
