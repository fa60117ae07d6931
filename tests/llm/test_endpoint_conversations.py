"""Trajectories from interleaved and concurrent calls (issue 25 item 2): a job keeps every open
conversation; a request extends the one it continues with its exact sampled ids, side calls and
subagents get their own segments without breaking the main one, and a job's requests run
concurrently. Real parts: the ``openai`` and ``anthropic`` SDKs as clients, a real uvicorn
socket, the Qwen2.5 tokenizer and template, the scripted vLLM-API backend (0.3 s per call, so
concurrent calls overlap at the backend). Before this change (checked) the Chat Completions case
failed: the side call broke the main segment (the next main call re-encoded the main history)
and the subagents were served one at a time; the Anthropic case got 404 (no /v1/messages).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")
anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (pip install rolloutd[harness])")

from .conftest import BASH_TOOL
from .served_session import ServedSession as Served

pytestmark = pytest.mark.timeout(300)


async def chat(ep: Served, msgs: list, tools=None) -> dict:
    r = await ep.oa.chat.completions.create(model="m", messages=msgs, max_tokens=24,
                                            **({"tools": tools} if tools else {}))
    m = r.choices[0].message
    out = {"role": "assistant", "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
    return out


async def subagent(ep: Served, i: int, api: str) -> None:
    """Claude Code's Task tool: its own system prompt, two turns, over the Anthropic Messages API
    (or Chat Completions)."""
    if api == "openai":
        msgs = [{"role": "system", "content": f"You are subagent {i}."}, {"role": "user", "content": "look around"}]
        msgs.append(await chat(ep, msgs))
        msgs.append({"role": "user", "content": "go on"})
        await chat(ep, msgs)
        return
    msgs = [{"role": "user", "content": f"subtask {i}: look around"}]
    r = await ep.an.messages.create(model="m", max_tokens=24, system=f"You are subagent {i}.", messages=msgs)
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
             {"role": "user", "content": "go on"}]
    await ep.an.messages.create(model="m", max_tokens=24, system=f"You are subagent {i}.", messages=msgs)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_side_calls_and_concurrent_subagents_keep_the_main_conversation_whole(qwen_tokenizer, scripted, api):
    be = scripted(qwen_tokenizer, "echo", latency=0.3)

    async def episode():
        async with Served(qwen_tokenizer, be.url) as ep:
            main = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "fix it"}]
            main.append(await chat(ep, main, [BASH_TOOL]))
            # a side call between main turns: a title, other system prompt, no tools
            await chat(ep, [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "fix it"}])
            main.append({"role": "user", "content": "continue"})
            main.append(await chat(ep, main, [BASH_TOOL]))
            # two subagents at once, beside a main turn
            main.append({"role": "user", "content": "and then?"})
            *_, last = await asyncio.gather(subagent(ep, 1, api), subagent(ep, 2, api), chat(ep, main, [BASH_TOOL]))
            main.append(last)
            main.append({"role": "user", "content": "done?"})
            await chat(ep, main, [BASH_TOOL])
            return ep.session.trajectory(), ep.max_inflight

    traj, max_inflight = asyncio.run(episode())
    m = traj["metrics"]
    assert max_inflight >= 2, "a job's requests were served one at a time"
    # main + title + two subagents; every later main call extended the main segment
    assert m["segments"] == 4 and m["side_segments"] == 3, m
    assert m["llm_calls"] == 4 + 1 + 4 and m["calls_per_segment"] == 9 / 4, m
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    segs = traj["segments"]
    assert sorted(len(s["turns"]) for s in segs) == [1, 2, 2, 4]
    for s in segs:  # each segment: sampled spans masked 1 with their logprobs, the rest 0
        mask = np.asarray(s["loss_mask"])
        spans = sum(e - b for b, e in (t["span"] for t in s["turns"]))
        assert int(mask.sum()) == spans
        assert not np.asarray(s["logprobs"])[mask == 0].any()


def test_responses_and_gemini_shapes_extend_one_conversation_each(qwen_tokenizer, scripted):
    """The Responses API with ``previous_response_id`` (and ``GET /v1/responses/{id}`` from the
    job's store) and a Gemini chat, each over the real SDK, each extend their own conversation
    with the exact sampled ids; Anthropic's and Gemini's count_tokens count the rendered prompt."""
    genai = pytest.importorskip("google.genai", reason="google-genai is not installed (pip install rolloutd[harness])")
    from google.genai import types

    be = scripted(qwen_tokenizer, "echo")

    async def episode():
        async with Served(qwen_tokenizer, be.url) as ep:
            r1 = await ep.oa.responses.create(model="m", instructions="Be brief.", input="hello", max_output_tokens=16)
            got = await ep.oa.responses.retrieve(r1.id)
            assert got.id == r1.id and got.output_text == r1.output_text
            await ep.oa.responses.create(model="m", instructions="Be brief.", input="and again",
                                         previous_response_id=r1.id, max_output_tokens=16)
            g = genai.Client(api_key="k", http_options=types.HttpOptions(
                base_url=f"http://127.0.0.1:{ep.server.port}", api_version="v1beta",
                retry_options=types.HttpRetryOptions(attempts=1)))
            chat_ = g.aio.chats.create(model="m", config=types.GenerateContentConfig(
                system_instruction="You are Gemini here.", max_output_tokens=16))
            await chat_.send_message("hi")
            await chat_.send_message("more")
            n_g = (await g.aio.models.count_tokens(model="m", contents="hi")).total_tokens
            n_a = (await ep.an.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])).input_tokens
            return ep.session.trajectory(), n_g, n_a

    traj, n_g, n_a = asyncio.run(episode())
    m = traj["metrics"]
    assert m["segments"] == 2 and m["llm_calls"] == 4, m
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    assert sorted(len(s["turns"]) for s in traj["segments"]) == [2, 2]
    # "hi" as one user message, rendered by the template with the generation prompt
    text = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=False)
    want = len(qwen_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n_g == n_a == want, (n_g, n_a, want)
