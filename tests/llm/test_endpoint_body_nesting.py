"""A request body nested deeper than ``EndpointBounds.max_depth`` is refused (400) in every shape,
also when it resends the history of the request before it: the nesting walk skips the items
equal to the previous body's (agents resend their whole history every call), never a new or
changed one. Real sessions, the real Qwen2.5 tokenizer, no LLM call (count_tokens routes)."""
from __future__ import annotations

import json

import pytest

from rolloutd.endpoint.session import EndpointSession
from rolloutd.endpoint.shapes import anthropic as aw, gemini as gw
from rolloutd.endpoint.wire import EndpointError


def deep(n: int):
    x: list = []
    for _ in range(n - 1):
        x = [x]
    return x


async def no_backend(ids, params):
    raise AssertionError("no LLM call is made")


def anthropic_body(msgs):
    return {"model": "m", "messages": msgs}


HISTORY = [{"role": "user", "content": "list the files"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash",
                                              "input": {"command": "ls"}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}]


@pytest.mark.parametrize("where", ["appended", "replacing an earlier message", "in the tool input",
                                   "beside the history"])
def test_a_deep_body_after_a_good_one_is_refused(arun, qwen_tokenizer, where):
    async def go():
        s = EndpointSession(no_backend, qwen_tokenizer)
        limit = s.bounds.max_depth
        ok = anthropic_body(HISTORY)
        assert await s.count_tokens(json.dumps(ok).encode(), aw.parse_count_tokens) > 0
        bad = json.loads(json.dumps(ok))
        if where == "appended":
            bad["messages"].append({"role": "user", "content": deep(limit)})
        elif where == "replacing an earlier message":
            bad["messages"][0] = {"role": "user", "content": deep(limit)}
        elif where == "in the tool input":
            bad["messages"][1]["content"][0]["input"] = {"command": deep(limit)}
        else:
            bad["metadata"] = {"x": deep(limit)}
        with pytest.raises(EndpointError) as e:
            await s.count_tokens(json.dumps(bad).encode(), aw.parse_count_tokens)
        assert e.value.status == 400 and "nested deeper" in e.value.message, e.value.message
        # the good body again (the refused one is not what later bodies are compared with)
        assert await s.count_tokens(json.dumps(ok).encode(), aw.parse_count_tokens) > 0

    arun(go())


def test_one_level_under_the_bound_passes_and_a_shape_switch_is_checked_in_full(arun, qwen_tokenizer):
    async def go():
        s = EndpointSession(no_backend, qwen_tokenizer)
        limit = s.bounds.max_depth
        ok = anthropic_body(HISTORY)
        assert await s.count_tokens(json.dumps(ok).encode(), aw.parse_count_tokens) > 0
        # body (1) > contents (2) > content (3) > parts (4) > part (5) > functionResponse (6) > response (7)
        under = {"contents": [{"role": "user", "parts": [{"text": "hi"}]},
                              {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response":
                                                                                 {"x": deep(limit - 7)}}}]}]}
        assert await s.count_tokens(json.dumps(under).encode(), lambda b: gw.parse_count_tokens(b, "m")) > 0
        over = json.loads(json.dumps(under))
        over["contents"][1]["parts"][0]["functionResponse"]["response"]["x"] = deep(limit - 6)
        with pytest.raises(EndpointError) as e:
            await s.count_tokens(json.dumps(over).encode(), lambda b: gw.parse_count_tokens(b, "m"))
        assert e.value.status == 400 and "nested deeper" in e.value.message, e.value.message

    arun(go())
