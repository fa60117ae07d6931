"""Replies whose tool call does not parse reach the agent as vLLM renders them (issue 37 item 1).

vLLM's hermes parser, with tools offered, decodes the sampled ids with special tokens kept and
returns the whole text as the content (no calls, the finish reason as sampled) when a call does
not parse; a call runs from ``<tool_call>`` to the next ``</tool_call>``, so control-token ids
inside a JSON string are part of the argument. Here every case goes through the real endpoint
on a real socket, in all four API shapes, streamed and not, against the scripted backend with
the real Qwen2.5 tokenizer; the replies are the exact ids a policy sampled (special ids where
the case needs them)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.backends.policies import Policy, PolicyReply

from .conftest import BASH_TOOL

pytestmark = pytest.mark.timeout(300)

SCHEMA = BASH_TOOL["function"]["parameters"]
CUT = 16  # max tokens for the length case (the Responses API's least max_output_tokens)


def case_ids(tok) -> dict[str, tuple[list[int], dict]]:
    """case -> (the sampled ids, what the agent must get: text, or a call's arguments)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    sp = tok.convert_tokens_to_ids
    end = [sp("<|im_end|>")]
    bad = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'
    long = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la /workspace && cat README.md"}}'
    long_ids = enc(long)
    assert len(long_ids) > CUT
    head = enc('<tool_call>\n{"name": "bash", "arguments": {"command": "echo ')
    tail = enc('"}}\n</tool_call>')
    return {
        "badjson": (enc(bad) + end, {"text": bad, "finish": "stop"}),
        "length": (long_ids, {"text": tok.decode(long_ids[:CUT], skip_special_tokens=False), "finish": "length"}),
        "toolcall_id": (head + [sp("<tool_call>")] + tail + end, {"args": {"command": "echo <tool_call>"}}),
        "imstart_id": (head + [sp("<|im_start|>")] + tail + end, {"args": {"command": "echo <|im_start|>"}}),
        # a special id in plain text: as vLLM (tools offered) the content carries its string
        "text_imstart": (enc("Done. ") + [sp("<|im_start|>")] + enc(" bye") + end,
                         {"text": "Done. <|im_start|> bye", "finish": "stop"}),
    }


class ByCase(Policy):
    """Answers the case named in the prompt (``case:<name>``) with its exact ids."""

    def __init__(self, cases):
        super().__init__()
        self.cases = cases

    def reply(self, request):
        name = re.findall(r"case:(\w+)", request.prompt_text)[-1]
        return PolicyReply(token_ids=list(self.cases[name][0]), append_eos=False)


def body(shape: str, case: str, stream: bool) -> tuple[str, dict]:
    task = f"Fix it. case:{case} "
    mt = CUT if case == "length" else 200
    if shape == "chat":
        return "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": task}],
                                        "tools": [BASH_TOOL], "max_tokens": mt, "stream": stream}
    if shape == "anthropic":
        return "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": mt, "stream": stream,
                                "messages": [{"role": "user", "content": task}],
                                "tools": [{"name": "bash", "description": "run", "input_schema": SCHEMA}]}
    if shape == "responses":
        return "/v1/responses", {"model": "m", "input": task, "max_output_tokens": mt, "stream": stream,
                                 "tools": [{"type": "function", "name": "bash", "description": "run",
                                            "parameters": SCHEMA}]}
    verb = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return f"/v1beta/models/m:{verb}", {"contents": [{"role": "user", "parts": [{"text": task}]}],
                                        "tools": [{"functionDeclarations": [{"name": "bash", "description": "run",
                                                                             "parametersJsonSchema": SCHEMA}]}],
                                        "generationConfig": {"maxOutputTokens": mt}}


def sse(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def seen(shape: str, stream: bool, raw: str) -> tuple[str, list[dict], str]:
    """(text, calls' arguments, finish) as the agent of that shape reads the answer."""
    if shape == "chat":
        if not stream:
            c = json.loads(raw)["choices"][0]
            return (c["message"]["content"] or "", [json.loads(t["function"]["arguments"])
                                                     for t in c["message"]["tool_calls"] or []], c["finish_reason"])
        text, calls, fin = "", [], None
        for ch in sse(raw):
            for c in ch["choices"]:
                text += c["delta"].get("content") or ""
                calls += [json.loads(t["function"]["arguments"]) for t in c["delta"].get("tool_calls") or []]
                fin = c["finish_reason"] or fin
        return text, calls, fin
    if shape == "anthropic":
        if not stream:
            m = json.loads(raw)
            return ("".join(b["text"] for b in m["content"] if b["type"] == "text"),
                    [b["input"] for b in m["content"] if b["type"] == "tool_use"], m["stop_reason"])
        text, calls, fin, parts = "", [], None, {}
        for ev in sse(raw):
            if ev["type"] == "content_block_delta":
                d = ev["delta"]
                text += d.get("text", "")
                if d["type"] == "input_json_delta":
                    parts[ev["index"]] = parts.get(ev["index"], "") + d["partial_json"]
            elif ev["type"] == "message_delta":
                fin = ev["delta"]["stop_reason"]
        return text, [json.loads(v) for v in parts.values()], fin
    if shape == "responses":
        if stream:
            evs = sse(raw)
            assert evs[-1]["type"] in ("response.completed", "response.incomplete")
            text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
            r = evs[-1]["response"]
        else:
            r = json.loads(raw)
            text = None
        items = r["output"]
        full = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
        assert text is None or text == full
        calls = [json.loads(it["arguments"]) for it in items if it["type"] == "function_call"]
        fin = r["status"] + ("" if r["status"] == "completed" else ":" + r["incomplete_details"]["reason"])
        return full, calls, fin
    chunks = sse(raw) if stream else [json.loads(raw)]
    text, calls, fin = "", [], None
    for ch in chunks:
        cand = ch["candidates"][0]
        for p in cand.get("content", {}).get("parts", []):
            text += p.get("text", "") if not p.get("thought") else ""
            if "functionCall" in p:
                calls.append(p["functionCall"]["args"])
        fin = cand.get("finishReason") or fin
    return text, calls, fin


FINISH = {"chat": {"stop": "stop", "length": "length", "call": "tool_calls"},
          "anthropic": {"stop": "end_turn", "length": "max_tokens", "call": "tool_use"},
          "responses": {"stop": "completed", "length": "incomplete:max_output_tokens", "call": "completed"},
          "gemini": {"stop": "STOP", "length": "MAX_TOKENS", "call": "STOP"}}


@pytest.fixture(scope="module")
def served(qwen_tokenizer):
    """One endpoint over a real socket for the module; its scripted backend answers by case."""
    import asyncio
    import threading

    from rolloutd.backends.scripted import ScriptedBackend

    tok = qwen_tokenizer
    cases = case_ids(tok)
    be = ScriptedBackend(tok, ByCase(cases))
    be.start()
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()

    async def up():
        llm = LLMClient(be.url, timeout=60)
        session = EndpointSession(simple_generate(llm, "b0", 0), tok, limits=EndpointLimits(max_context=4096))
        return llm, session, await serve(make_app(session), host="127.0.0.1", port=0)

    llm, session, server = asyncio.run_coroutine_threadsafe(up(), loop).result(120)
    try:
        yield tok, cases, session, f"http://127.0.0.1:{server.port}"
    finally:
        async def down():
            await server.stop()
            await llm.aclose()

        asyncio.run_coroutine_threadsafe(down(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        be.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("shape", ["chat", "anthropic", "responses", "gemini"])
def test_every_shape_shows_the_sampled_text(served, shape, stream):
    tok, cases, session, url = served
    with httpx.Client(base_url=url, timeout=120) as http:
        for case, (_, want) in cases.items():
            path, b = body(shape, case, stream)
            r = http.post(path, json=b)
            assert r.status_code == 200, (case, r.text)
            text, calls, fin = seen(shape, stream, r.text)
            if "args" in want:  # a call vLLM parses: the control-token id is part of the argument
                assert calls == [want["args"]] and text == "", (case, text, calls)
                assert fin == FINISH[shape]["call"], (case, fin)
            else:  # the sampled text, no call, the finish reason as sampled
                assert calls == [] and text == want["text"], (case, text, calls)
                assert fin == FINISH[shape][want["finish"]], (case, fin)


def test_the_text_sent_back_extends_the_segment(served):
    """An agent that sends the unparsed reply back as its assistant text continues the same
    conversation (the sampled ids kept), as with any other reply."""
    tok, cases, session, url = served
    before = session.trajectory()["metrics"]
    with httpx.Client(base_url=url, timeout=120) as http:
        _, b = body("chat", "badjson", False)
        first = http.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]
        assert first["content"] == cases["badjson"][1]["text"] and first["tool_calls"] is None
        b["messages"] += [{"role": "assistant", "content": first["content"]},
                          {"role": "user", "content": "That was not a valid call. case:text_imstart"}]
        r = http.post("/v1/chat/completions", json=b)
        assert r.status_code == 200, r.text
    m = session.trajectory()["metrics"]
    assert m["assistant_tokens_reencoded"] == before["assistant_tokens_reencoded"]
    assert m["assistant_tokens_reused"] == before["assistant_tokens_reused"] + len(cases["badjson"][0])
    assert m["malformed_tool_calls"] > before["malformed_tool_calls"]


def test_a_call_cut_by_the_context_window(qwen_tokenizer, scripted, arun):
    """A call cut off by the context window: the agent gets the text and ``length``; the turn
    records ``length`` (what the agent saw) with the cause, ``context_overflow``, beside it."""
    tok = qwen_tokenizer
    cases = case_ids(tok)
    be = scripted(tok, ByCase(cases))
    path, b = body("chat", "length", False)
    b.pop("max_tokens")
    prompt = tok.encode(tok.apply_chat_template(b["messages"], tools=b["tools"], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    room = 10

    async def main():
        llm = LLMClient(be.url, timeout=60)
        session = EndpointSession(simple_generate(llm, "b0", 0), tok,
                                  limits=EndpointLimits(max_context=len(prompt) + room))
        server = await serve(make_app(session), host="127.0.0.1", port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
                r = await http.post(path, json=b)
        finally:
            await server.stop()
            await llm.aclose()
        return r, session.trajectory()

    r, t = arun(main())
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["tool_calls"] is None
    assert c["message"]["content"] == tok.decode(cases["length"][0][:room], skip_special_tokens=False)
    assert t["turns"][-1]["finish_reason"] == "length" and t["turns"][-1]["cause"] == "context_overflow"
