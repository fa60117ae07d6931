"""The endpoint's request metrics are defined (docs/HARNESS.md) and counted the same way for every
answer (issue 28 item 5): ``requests`` = every request but ``/health``; ``refused_calls`` = every
error answer, by ``"<status> <code>"`` in ``refused_by_status``; ``llm_calls`` = requests that
reached the backend. Before, a 429 counted as refused but not as a call, a 400
``context_length_exceeded`` as a call but not refused, and 401/400/404 not at all. And a turn
whose reply carried tool calls records ``finish_reason: tool_calls`` (it said ``stop``).

The real ``openai`` SDK over a real uvicorn socket, the real Qwen2.5 tokenizer, the scripted
backend speaking vLLM's HTTP API (tests/llm/test_llm_openai_endpoint.py's Endpoint)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")

from rolloutd.endpoint.bounds import EndpointLimits

from .conftest import BASH_TOOL
from .test_llm_openai_endpoint import Endpoint, Script

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'

pytestmark = pytest.mark.timeout(300)


def test_every_request_and_every_refusal_is_counted(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, [CALL, "done"], split=False))
    user = {"role": "user", "content": "list the files"}

    async def main():
        async with Endpoint(tok, be.url, limits=EndpointLimits(max_context=256, max_llm_calls=2), api_key="k") as ep:
            c = ep.client
            r = await c.chat.completions.create(model="m", messages=[user], tools=[BASH_TOOL])  # 200
            assert r.choices[0].finish_reason == "tool_calls"
            msg = r.choices[0].message
            with pytest.raises(openai.BadRequestError) as e:  # 400 context_length_exceeded, before the backend
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 400}])
            assert e.value.body["code"] == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError):  # 400, a malformed field
                await c.chat.completions.create(model="m", messages=[user], temperature=9)
            with pytest.raises(openai.AuthenticationError):  # 401
                await c.with_options(api_key="wrong").chat.completions.create(model="m", messages=[user])
            with pytest.raises(openai.NotFoundError):  # 404 (no such route)
                await c.post("/no/such/route", cast_to=object, body={})
            await c.models.list()  # 200, no LLM call
            r2 = await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=[
                user, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a.txt"}])  # 200
            assert r2.choices[0].finish_reason == "stop"
            last = await c.chat.completions.create(model="m", messages=[user])  # the budget of two is spent:
            assert "budget of 2 LLM calls is spent" in last.choices[0].message.content  # a last message, 200
            return ep

    ep = arun(main())
    m = ep.session.trajectory()["metrics"]
    assert m["requests"] == 8
    assert m["llm_calls"] == 2 == be.stats["requests"]  # only the two answered ones reached the backend
    assert m["refused_by_status"] == {"400 context_length_exceeded": 1, "400": 1, "401 invalid_api_key": 1,
                                      "404 not_found": 1}, m["refused_by_status"]
    assert m["budget_replies"] == 1
    assert m["refused_calls"] == 4 == m["requests"] - m["llm_calls"] - 2  # the others: GET /models, the budget's
    # The turns as the agent saw them: a tool call, then a plain answer.
    turns = ep.session.trajectory()["turns"]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop"]
