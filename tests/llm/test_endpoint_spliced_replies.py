"""Our replies in a new segment's prompt stay the ids we sampled (issue 37 item 4).

A request that cannot extend or fork an open conversation (a compaction request with other
tools, as Codex's ``tools: []``; a summary prompt with its own system prompt, as OpenCode's; a
compacted history that keeps the last replies, as Claude Code's) opens a new segment. The
replies of ours it carries are put into its prompt as their sampled ids, verbatim (a
non-canonical split included), the messages between them rendered with the template's
delimiters: the prompt an extension would have built, never a re-encoding of their text.
Real parts: the ``openai`` SDK as the agent, a real socket, the real Qwen2.5 tokenizer (and
Qwen3's for reasoning), the scripted vLLM-API backend. Before this change every test here failed
with ``assistant_tokens_reencoded`` > 0 and the replies' canonical ids in the prompt.
"""
from __future__ import annotations

import json

import pytest

from .conftest import thinking_policy, urgent_template_tokenizer
from .test_llm_openai_endpoint import TOOLS, Endpoint, Script, check_exact

pytestmark = pytest.mark.timeout(300)

CALL = 'Listing.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def as_vllm(msgs: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to the template (tool-call arguments as objects)."""
    def call(c: dict) -> dict:
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in msgs]


def find(hay: list[int], needle: list[int]) -> int:
    """Where ``needle`` starts in ``hay`` (-1 if nowhere)."""
    n = len(needle)
    return next((i for i in range(len(hay) - n + 1) if hay[i:i + n] == needle), -1)


async def main_loop(ep, system: str) -> list[dict]:
    """Two tool-calling turns of a main loop (our replies sent back as structured tool_calls)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "fix the bug"}]
    for out in ("a.py b.py", "ok"):
        r = await ep.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": out})
    return msgs


@pytest.mark.parametrize("shape", ["codex", "opencode", "claude-code"])
def test_our_replies_in_a_new_segment_are_the_sampled_ids(qwen_tokenizer, scripted, arun, shape):
    """codex: the history with no tools plus a summary request; opencode: its own system prompt
    and no tools; claude-code: the compacted history (a summary as the user's message, then the
    last reply and its result kept), the same tools. Each opens a new segment holding our replies
    as sampled; every prompt still decodes to the template's rendering of its request."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, [CALL, CALL, "Summary: listed twice.", "Done."]))
    calls: list[tuple[list[dict], list | None]] = []

    async def run():
        async with Endpoint(tok, be.url) as ep:
            main = await main_loop(ep, "You are the main agent.")
            calls.extend([(main[:2], TOOLS), (main[:4], TOOLS)])
            if shape == "codex":
                req, tools = main + [{"role": "user", "content": "Summarize the conversation."}], None
            elif shape == "opencode":
                req, tools = [{"role": "system", "content": "You summarize."}] + main[1:] + [
                    {"role": "user", "content": "Summarize the conversation."}], None
            else:
                req, tools = [{"role": "user", "content": "Continued from a summary: listed once."}] + main[4:], TOOLS
            await ep.client.chat.completions.create(model="m", messages=req, **({"tools": tools} if tools else {}))
            calls.append((req, tools))
            return ep

    ep = arun(run())
    t = ep.session.trajectory()
    m = t["metrics"]
    kept = 1 if shape == "claude-code" else 2  # replies the new request carries
    sampled = [ids for _, ids, _ in ep.seen]
    assert m["segments"] == 2 and m["forks"] == 0, m
    assert m["assistant_tokens_reencoded"] == 0, m
    assert m["assistant_tokens_reused"] == sum(map(len, sampled[:2])), m
    check_exact(tok, t["segments"][0], ep.seen[:2])
    check_exact(tok, t["segments"][1], ep.seen[2:])
    prompt = t["segments"][1]["prompt_ids"].tolist()
    at = [find(prompt, ids) for ids in sampled[2 - kept:2]]
    assert all(i > 0 for i in at) and at == sorted(at), at  # verbatim, in order
    for ids in sampled[2 - kept:2]:  # the splits are ours, not the BPE's: re-encoding would differ
        assert tok.encode(tok.decode(ids[:-1]), add_special_tokens=False) != ids[:-1]
    for (msgs, tools), (sent, _, _) in zip(calls, ep.seen):
        want = tok.apply_chat_template(as_vllm(msgs), tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.decode(sent) == want


def test_a_fork_carrying_a_reply_from_another_segment_holds_its_ids(qwen_tokenizer, scripted, arun):
    """A fork whose own messages (after the shared prefix) carry a reply sampled in another
    segment: that reply too is its sampled ids."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["one", "side answer", "two", "three"]))

    async def run():
        async with Endpoint(tok, be.url) as ep:
            main = [{"role": "user", "content": "task"}]
            r = await ep.client.chat.completions.create(model="m", messages=main)
            main += [{"role": "assistant", "content": r.choices[0].message.content}]
            side = [{"role": "system", "content": "side"}, {"role": "user", "content": "ask"}]
            r = await ep.client.chat.completions.create(model="m", messages=side)
            side_reply = {"role": "assistant", "content": r.choices[0].message.content}
            main += [{"role": "user", "content": "more"}]
            await ep.client.chat.completions.create(model="m", messages=main)  # extends the main
            # back after the first reply, quoting the side conversation's reply as a turn
            await ep.client.chat.completions.create(
                model="m", messages=main[:1] + [main[1], {"role": "user", "content": "the side said"},
                                                side_reply, {"role": "user", "content": "go on"}])
            return ep

    ep = arun(run())
    t = ep.session.trajectory()
    m = t["metrics"]
    assert m["forks"] == 1 and m["assistant_tokens_reencoded"] == 0, m
    fork = t["segments"][-1]["prompt_ids"].tolist()
    assert find(fork, ep.seen[0][1]) > 0 and find(fork, ep.seen[1][1]) > find(fork, ep.seen[0][1])


def test_qwen3_reasoning_stays_hidden_in_a_spliced_reply(qwen3_tokenizer, scripted, arun):
    """With ``reasoning="drop"`` a reply spliced into a new segment is shown as the family's
    template shows an earlier turn: its sampled ids without the reasoning."""
    tok = qwen3_tokenizer
    be = scripted(tok, thinking_policy())
    calls = []

    async def run():
        async with Endpoint(tok, be.url, conv_options={"reasoning": "drop"}) as ep:
            main = [{"role": "system", "content": "main"}, {"role": "user", "content": "fix the bug"}]
            for q in ("look at foo.py", "run the tests"):
                calls.append(list(main))
                r = await ep.client.chat.completions.create(model="m", messages=main)
                main += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": q}]
            req = [{"role": "system", "content": "You summarize."}] + main[1:]
            calls.append(req)
            await ep.client.chat.completions.create(model="m", messages=req)
            return ep

    ep = arun(run())
    m = ep.session.trajectory()["metrics"]
    assert m["segments"] == 2 and m["assistant_tokens_reencoded"] == 0, m
    for msgs, (sent, _, _) in zip(calls, ep.seen):
        assert tok.decode(sent) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    think = tok.convert_tokens_to_ids("<think>")
    assert think not in ep.seen[2][0]  # hidden, as the template hides earlier reasoning
    answer = ep.seen[0][1][ep.seen[0][1].index(tok.convert_tokens_to_ids("</think>")) + 1:]
    while not tok.decode(answer[:1]).strip():  # the whitespace after it is hidden with it
        answer = answer[1:]
    assert find(ep.seen[2][0], answer) > 0  # the rest verbatim


def test_a_template_that_cannot_render_incrementally_renders_the_replies_from_text(scripted, arun):
    """A template whose earlier turns depend on later messages (the system prompt changes once a
    message says "urgent"): the new segment is the template's full rendering, its replies
    re-encoded and counted."""
    tok = urgent_template_tokenizer()
    be = scripted(tok, "echo")

    async def run():
        async with Endpoint(tok, be.url) as ep:
            main = [{"role": "system", "content": "main"}, {"role": "user", "content": "fix the bug"}]
            r = await ep.client.chat.completions.create(model="m", messages=main)
            req = [{"role": "system", "content": "other"}, main[1],
                   {"role": "assistant", "content": r.choices[0].message.content},
                   {"role": "user", "content": "urgent: summarize"}]
            await ep.client.chat.completions.create(model="m", messages=req)
            return ep, req

    ep, req = arun(run())
    t = ep.session.trajectory()
    assert t["metrics"]["assistant_tokens_reencoded"] == len(ep.seen[0][1]), t["metrics"]
    assert tok.decode(ep.seen[1][0]) == tok.apply_chat_template(req, add_generation_prompt=True, tokenize=False)
    assert "Hurry." in tok.decode(t["prompt_ids"].tolist())
