"""The harness endpoint's prompts against vLLM's own render routes (issue 36).

An agent sends a request in one of the four API shapes to rolloutd's endpoint; the endpoint
renders it to token ids and sends them to the real vLLM (``/v1/completions``). The same request
sent to vLLM's own render route (``/v1/chat/completions/render``, ``/v1/messages/render``,
``/v1/responses/render``; Gemini has none, so its request is compared with the render of the
Chat Completions request it translates to) must give exactly the ids rolloutd sent: plain, with
tools, and with a tool-call history written by the agent. A history that continues the endpoint's
own reply is not re-rendered (token-in/token-out): there the ids equal vLLM's render everywhere
but inside the reply, which is the sampled ids instead of its text encoded again.
"""
from __future__ import annotations

import asyncio
import copy
import json

import httpx
import numpy as np
import pytest

from tests.llm.test_wire_render import ANTHROPIC, CHAT, GEMINI, RESPONSES, SYSTEM, TASK

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4  # the prompt is what is compared; a few sampled tokens prove the call reached vLLM


def _plain(shape: str, tools: bool) -> dict:
    """The history case's request cut to system + task (with or without its tools)."""
    b = copy.deepcopy({"chat": CHAT, "anthropic": ANTHROPIC, "responses": RESPONSES, "gemini": GEMINI}[shape])
    if shape == "chat":
        b["messages"] = b["messages"][:2]
    elif shape == "anthropic":
        b["messages"] = b["messages"][:1]
    elif shape == "responses":
        b["input"] = b["input"][:1]
    else:
        b["contents"] = b["contents"][:1]
    if not tools:
        b.pop("tools")
    return b


def request(shape: str, case: str) -> dict:
    base = {"chat": CHAT, "anthropic": ANTHROPIC, "responses": RESPONSES, "gemini": GEMINI}[shape]
    return copy.deepcopy(base) if case == "history" else _plain(shape, case == "tools")


def endpoint_call(shape: str, body: dict) -> tuple[str, dict]:
    """The endpoint route and body of ``body`` in ``shape`` (sampling bounded)."""
    body = dict(body)
    if shape == "chat":
        return "/v1/chat/completions", dict(body, model="m", max_tokens=MAX_TOKENS)
    if shape == "anthropic":
        return "/v1/messages", dict(body, max_tokens=MAX_TOKENS)
    if shape == "responses":
        return "/v1/responses", dict(body, max_output_tokens=16)  # OpenAI's (and the endpoint's) least
    return "/v1beta/models/m:generateContent", dict(body, generationConfig={"maxOutputTokens": MAX_TOKENS})


def render_call(shape: str, case: str, model: str) -> tuple[str, dict]:
    """vLLM's render route for the same request (Gemini: its Chat Completions translation).
    Chat and Messages with tools say ``tool_choice: none``: their default ("auto") is refused by
    a server started without ``--enable-auto-tool-choice --tool-call-parser``, and "none" still
    renders the tools (vLLM's ``exclude_tools_when_tool_choice_none`` is off by default)."""
    if shape in ("chat", "gemini"):
        body = dict(request("chat", case), model=model)
        return "/v1/chat/completions/render", dict(body, tool_choice="none") if "tools" in body else body
    if shape == "anthropic":
        body = dict(request(shape, case), model=model)
        return "/v1/messages/render", dict(body, tool_choice={"type": "none"}) if "tools" in body else body
    return "/v1/responses/render", dict(request(shape, case), model=model)


class Recorder:
    """The endpoint's ``generate``: the real vLLM through LLMClient, each prompt noted."""

    def __init__(self, url: str):
        from rolloutd.llm.client import LLMClient, simple_generate

        self.llm = LLMClient(url, "vllm", timeout=120)
        self._inner = simple_generate(self.llm, url, 0)
        self.prompts: list[list[int]] = []
        self.replies: list[list[int]] = []

    async def __call__(self, ids, params):
        self.prompts.append(np.asarray(ids).tolist())
        g, b, v = await self._inner(ids, params)
        self.replies.append(g.token_ids.tolist())
        return g, b, v


async def _through_endpoint(vllm, tok, calls: list[tuple[str, dict]]):
    """Each (route, body) through one endpoint session in turn; (recorder, replies, session)."""
    from rolloutd.endpoint.app import make_app
    from rolloutd.endpoint.bounds import EndpointLimits
    from rolloutd.endpoint.server import serve
    from rolloutd.endpoint.session import EndpointSession

    rec = Recorder(vllm.url)
    session = EndpointSession(rec, tok, limits=EndpointLimits(max_context=vllm.max_model_len))
    server = await serve(make_app(session), host="127.0.0.1", port=0)
    replies = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
            for route, body in calls:
                r = await http.post(route, json=body, headers={"x-api-key": "k", "authorization": "Bearer k"})
                assert r.status_code == 200, (route, r.status_code, r.text[:500])
                replies.append(r.json())
    finally:
        await server.stop()
        await rec.llm.aclose()
    return rec, replies, session


async def _render(vllm, route: str, body: dict) -> list[int]:
    headers = {"authorization": f"Bearer {vllm.api_key}"} if vllm.api_key else {}
    async with httpx.AsyncClient(base_url=vllm.url, timeout=60) as http:
        r = await http.post(route, json=body, headers=headers)
    assert r.status_code == 200, (route, r.status_code, r.text[:800])
    return r.json()["token_ids"]


def first_difference(a: list[int], b: list[int], tok) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"lengths {len(a)} vs {len(b)}, first difference at {i}:\n rolloutd: {tok.decode(a[max(0, i - 20):i + 30])!r}"
            f"\n vLLM:     {tok.decode(b[max(0, i - 20):i + 30])!r}")


@pytest.fixture(scope="module")
def tok(vllm_server):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(vllm_server.model_dir)


SHAPES = ("chat", "anthropic", "responses", "gemini")
CASES = ("plain", "tools", "history")


@pytest.mark.parametrize("shape", SHAPES)
def test_endpoint_prompts_equal_vllm_render(vllm_server, tok, shape):
    """Per shape, three requests (plain, with tools, with an agent-written tool-call history),
    each a new conversation: the ids sent to vLLM equal vLLM's own render of the request."""
    async def main():
        got = {}
        for case in CASES:
            rec, replies, _ = await _through_endpoint(vllm_server, tok, [endpoint_call(shape, request(shape, case))])
            assert len(rec.prompts) == 1 and 1 <= len(rec.replies[0]) <= 16
            got[case] = (rec.prompts[0], await _render(vllm_server, *render_call(shape, case, vllm_server.model)))
        return got

    got = asyncio.run(asyncio.wait_for(main(), 240))
    for case, (ours, theirs) in got.items():
        assert ours == theirs, f"{shape}/{case}: " + first_difference(ours, theirs, tok)
    assert len(got["tools"][0]) > len(got["plain"][0])  # the tools are in the prompt
    assert tok.decode(got["history"][0]).count("<tool_call>") == 1 + tok.decode(got["tools"][0]).count("<tool_call>")


def test_continued_reply_keeps_sampled_ids_where_render_re_encodes(vllm_server, tok):
    """The agent sends the endpoint's own reply back with a tool result: rolloutd extends the
    conversation with the sampled ids (not re-rendered), so its prompt equals vLLM's render of
    the same messages outside the reply, and inside it whenever the sampled ids are the ones
    the reply's text encodes to."""
    first = {"model": "m", "max_tokens": 12, "temperature": 1.0, "seed": 3,
             "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]}

    async def main():
        from rolloutd.endpoint.app import make_app
        from rolloutd.endpoint.bounds import EndpointLimits
        from rolloutd.endpoint.server import serve
        from rolloutd.endpoint.session import EndpointSession

        rec = Recorder(vllm_server.url)
        session = EndpointSession(rec, tok, limits=EndpointLimits(max_context=vllm_server.max_model_len))
        server = await serve(make_app(session), host="127.0.0.1", port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
                r1 = (await http.post("/v1/chat/completions", json=first)).json()
                msg = r1["choices"][0]["message"]
                second = dict(first, messages=first["messages"] + [
                    {"role": "assistant", "content": msg["content"] or ""}, {"role": "user", "content": "go on"}])
                r2 = await http.post("/v1/chat/completions", json=second)
                assert r2.status_code == 200, r2.text[:500]
        finally:
            await server.stop()
            await rec.llm.aclose()
        theirs = await _render(vllm_server, "/v1/chat/completions/render",
                               {"model": vllm_server.model, "messages": second["messages"]})
        return rec, session, theirs

    rec, session, theirs = asyncio.run(asyncio.wait_for(main(), 240))
    ours, reply = rec.prompts[1], rec.replies[0]
    assert session.trajectory()["metrics"].get("segments", 1) == 1  # one conversation, extended
    start = len(rec.prompts[0])
    assert ours[:start + len(reply)] == rec.prompts[0] + reply  # the exact sampled ids, end token included
    # vLLM renders the reply from its text: the same ids outside the reply
    assert theirs[:start] == ours[:start]
    end_ours = start + len(reply)
    tail = len(ours) - end_ours
    text_ids = theirs[start:len(theirs) - tail]
    assert theirs[len(theirs) - tail:] == ours[end_ours:], first_difference(ours, theirs, tok)
    if tok.decode(reply, skip_special_tokens=False) == tok.decode(text_ids, skip_special_tokens=False):
        return  # same text; the ids may still differ (a non-canonical sample): that is the point
    # the reply's text as the agent saw it (special tokens skipped) is what vLLM re-encoded
    assert tok.decode(text_ids, skip_special_tokens=True).strip() == tok.decode(reply, skip_special_tokens=True).strip()
