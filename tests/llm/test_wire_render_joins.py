"""What a history rendered from text looks like on each route (issue 37 items 2 and 3): text parts
joined as vLLM joins them (Chat Completions: every role's parts by ``"\\n"``; Anthropic: system
blocks glued, a message's text blocks by ``"\\n"``, empty blocks dropped), and tool-call arguments
in the client's key order (Hugging Face's template and vLLM render the client's object). Real
endpoint, real socket, the Qwen2.5 tokenizer and template; the prompt the backend got is
compared with the template's rendering of the messages vLLM would build."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.backends.policies import Policy

from .conftest import BASH_TOOL

pytestmark = pytest.mark.timeout(300)

ARGS = '{"zeta": "1", "alpha": "2"}'  # not sorted: the order the client sent must survive
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}}}


class Prompts(Policy):
    def __init__(self):
        super().__init__()
        self.prompts: list[list[int]] = []

    def reply(self, request):
        self.prompts.append(list(request.prompt_ids))
        return "ok"


def served_prompt(tok, scripted, arun, path: str, body: dict) -> str:
    pol = Prompts()
    be = scripted(tok, pol)

    async def main():
        llm = LLMClient(be.url, timeout=60)
        session = EndpointSession(simple_generate(llm, "b0", 0), tok, limits=EndpointLimits(max_context=4096))
        server = await serve(make_app(session), host="127.0.0.1", port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
                return await http.post(path, json=body)
        finally:
            await server.stop()
            await llm.aclose()

    r = arun(main())
    assert r.status_code == 200, r.text
    return tok.decode(pol.prompts[-1], skip_special_tokens=False)


def rendered(tok, msgs, tools) -> str:
    return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)


def test_chat_joins_text_parts_by_newline_and_keeps_argument_order(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    msgs = [{"role": "system", "content": [{"type": "text", "text": "You are an agent."},
                                           {"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                         {"type": "text", "text": "Say hi."}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]
    got = served_prompt(tok, scripted, arun, "/v1/chat/completions",
                        {"model": "m", "messages": msgs, "tools": [TOOL, BASH_TOOL]})
    want = rendered(tok, [
        {"role": "system", "content": "You are an agent.\nBe brief."},
        {"role": "user", "content": "<system-reminder>x</system-reminder>\nSay hi."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"zeta": "1", "alpha": "2"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a\nb"}], [TOOL, BASH_TOOL])
    assert got == want
    assert ARGS in got and "</system-reminder>\nSay hi." in got


def test_anthropic_joins_as_vllm_and_keeps_argument_order(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100,
            "system": [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": " Be brief."}],
            "tools": [{"name": "f", "description": "d", "input_schema": TOOL["function"]["parameters"]}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                             {"type": "text", "text": ""}, {"type": "text", "text": "Say hi."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "First."}, {"type": "text", "text": "Then."},
                                                  {"type": "tool_use", "id": "toolu_c1", "name": "f",
                                                   "input": {"zeta": "1", "alpha": "2"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "content": "done"}]}]}
    got = served_prompt(tok, scripted, arun, "/v1/messages", body)
    want = rendered(tok, [
        {"role": "system", "content": "You are Claude Code. Be brief."},
        {"role": "user", "content": "<system-reminder>x</system-reminder>\nSay hi."},
        {"role": "assistant", "content": "First.\nThen.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"zeta": "1", "alpha": "2"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}],
        [{"type": "function", "function": {"name": "f", "description": "d",
                                           "parameters": TOOL["function"]["parameters"]}}])
    assert got == want
    assert ARGS in got
