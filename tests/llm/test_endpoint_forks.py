"""Forks at a shared prefix (issue 25 item 2): a request that repeats an open conversation's
messages up to one of our replies and then goes another way (the main loop after a compaction
side call, a retry after our reply, subagents with a common opening) opens a segment whose prompt
is that conversation's exact ids up to the reply, plus its own messages rendered with the
template's delimiters: no sampled token is re-encoded. Real parts: the ``openai`` SDK as the
agent, a real uvicorn socket, the real Qwen2.5 tokenizer and the tiny BPE tokenizer with their
chat templates, the scripted vLLM-API backend. Before this change (checked) each test failed:
every fork re-rendered the shared history from text (``assistant_tokens_reencoded`` > 0).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")

from .conftest import thinking_policy, urgent_template_tokenizer
from .served_session import ServedSession

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(params=["qwen", "tiny"])
def tok(request):
    return request.getfixturevalue("qwen_tokenizer" if request.param == "qwen" else "tiny_tokenizer")


class Agent(ServedSession):
    """An ``openai``-SDK agent on a served session; also records the messages of every call."""

    def __init__(self, tok, url):
        super().__init__(tok, url, max_context=4096)
        self.calls: list[list[dict]] = []

    async def two_turns_then_compaction(self) -> list[dict]:
        """The main loop's first two turns, then a compaction side call (main history + "summarize");
        the main messages so far."""
        main = [{"role": "system", "content": "You are the main agent."}, user("fix the bug")]
        main.append(await self.chat(main))
        main.append(user("look at foo.py"))
        main.append(await self.chat(main))
        await self.chat(main + [user("Summarize the conversation so far.")])
        return main

    async def chat(self, msgs: list[dict]) -> dict:
        self.calls.append([dict(m) for m in msgs])
        r = await self.oa.chat.completions.create(model="m", messages=msgs, max_tokens=24)
        return {"role": "assistant", "content": r.choices[0].message.content}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def check_segments(traj: dict, agent: Agent, tok) -> list[dict]:
    """Every backend prompt is some segment's context at one of its turns; each segment's
    sampled spans (and only they) are loss-bearing; with sequential calls, every prompt decodes
    to the chat template's rendering of that call's messages."""
    segs = traj.get("segments") or [traj]
    contexts = set()
    for s in segs:
        ids = np.concatenate([s["prompt_ids"], s["response_ids"]]).tolist()
        p = len(s["prompt_ids"])
        for t in s["turns"]:
            contexts.add(tuple(ids[: p + t["start"]]))
        mask = np.asarray(s["loss_mask"])
        assert int(mask.sum()) == sum(t["end"] - t["start"] for t in s["turns"])
    assert {tuple(x) for x in agent.prompts} == contexts
    if len(agent.calls) == len(agent.prompts):
        for msgs, ids in zip(agent.calls, agent.prompts):
            want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            assert tok.decode(ids, skip_special_tokens=False) == want
    return segs


def shares_prefix(fork: dict, parent: dict, turn: int) -> None:
    """``fork``'s prompt starts with ``parent``'s ids up to the end of its turn ``turn``, verbatim."""
    end = parent["turns"][turn]["end"]
    prefix = np.concatenate([parent["prompt_ids"], parent["response_ids"][:end]])
    assert np.array_equal(fork["prompt_ids"][: len(prefix)], prefix)
    assert len(fork["prompt_ids"]) > len(prefix)


def test_compaction_side_calls_fork_the_main_conversation_without_reencoding(tok, scripted):
    """Codex/OpenCode/Claude Code compaction twice: a side call sends the main history plus a
    "summarize" message (it extends the main conversation), then the main loop continues from
    before it (once right after our reply, once after a further message both calls repeat)."""
    be = scripted(tok, "echo")

    async def episode():
        async with Agent(tok, be.url) as ag:
            main = await ag.two_turns_then_compaction()  # compaction 1
            main.append(user("now run the tests"))
            main.append(await ag.chat(main))
            main.append(user("tests fail in bar"))
            main.append(await ag.chat(main))
            obs = user("bar.py: line 3 is wrong")  # both calls repeat it: the fork re-renders it, not a reply
            await ag.chat(main + [obs, user("Summarize the conversation so far.")])  # compaction 2
            main += [obs, user("fix line 3")]
            main.append(await ag.chat(main))
            main.append(user("done?"))
            await ag.chat(main)
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    assert m["llm_calls"] == 8, m
    assert m["segments"] == 1 + 2 and m["forks"] == 2 and m["fork_fallbacks"] == 0, m  # main + one per compaction
    segs = check_segments(traj, ag, tok)
    # main+summary 1 | fork 1: two main turns, summary 2 | fork 2: the last two main turns
    assert [len(s["turns"]) for s in segs] == [3, 3, 2]
    shares_prefix(segs[1], segs[0], 1)
    shares_prefix(segs[2], segs[1], 1)
    # the shared replies are loss-bearing once: in the parent (in the fork they are prompt)
    assert sum(int(np.asarray(s["loss_mask"]).sum()) for s in segs) == \
        sum(sum(t["end"] - t["start"] for t in s["turns"]) for s in segs)


def test_retry_after_reply_forks_before_the_dropped_reply(tok, scripted):
    """The agent drops our last reply and asks again (same request, then an edited one): each
    is a fork after the reply before it; the dropped replies stay valid samples where they were."""
    be = scripted(tok, "echo")

    async def episode():
        async with Agent(tok, be.url) as ag:
            main = [{"role": "system", "content": "Be brief."}, user("hello")]
            main.append(await ag.chat(main))
            main.append(user("what is 2+2?"))
            await ag.chat(main)  # dropped by the agent
            again = await ag.chat(main)  # the same request again
            await ag.chat(main[:-1] + [user("what is 3+3?")])  # an edited retry
            main.append(again)
            main.append(user("thanks"))
            await ag.chat(main)  # continues the first retry
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    assert m["llm_calls"] == 5 and m["segments"] == 3 and m["forks"] == 2, m
    segs = check_segments(traj, ag, tok)
    assert [len(s["turns"]) for s in segs] == [2, 2, 1]
    shares_prefix(segs[1], segs[0], 0)
    shares_prefix(segs[2], segs[0], 0)


def test_subagents_with_a_shared_opening_fork_it(tok, scripted):
    """Two subagents start from the same opening, one of our replies included, and run at the
    same time: one extends the opening's conversation, the other forks it."""
    be = scripted(tok, "echo", latency=0.3)

    async def subagent(ag: Agent, opening: list[dict], i: int) -> None:
        msgs = opening + [user(f"subtask {i}: look around")]
        msgs.append(await ag.chat(msgs))
        msgs.append(user("go on"))
        await ag.chat(msgs)

    async def episode():
        async with Agent(tok, be.url) as ag:
            opening = [{"role": "system", "content": "You are a subagent."}, user("the task: fix the bug")]
            opening.append(await ag.chat(opening))
            await asyncio.gather(subagent(ag, opening, 1), subagent(ag, opening, 2))
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    assert ag.max_inflight >= 2, "the subagents were served one at a time"
    assert m["llm_calls"] == 5 and m["segments"] == 2 and m["forks"] == 1, m
    segs = check_segments(traj, ag, tok)
    assert sorted(len(s["turns"]) for s in segs) == [2, 3]
    parent, fork = sorted(segs, key=lambda s: -len(s["turns"]))
    shares_prefix(fork, parent, 0)


def test_qwen3_reasoning_dropped_from_earlier_turns_stays_dropped_in_a_fork(qwen3_tokenizer, scripted):
    """Qwen3's template drops the reasoning of earlier turns; with ``reasoning="drop"`` the
    endpoint hides it as each turn is followed by messages, and a fork hides it the same way
    (its shared prefix is the parent's context, hidden spans left out): every prompt the backend
    saw, the fork's included, decodes to the template's rendering of that call's messages."""
    tok = qwen3_tokenizer
    be = scripted(tok, thinking_policy())

    async def episode():
        async with Agent(tok, be.url) as ag:
            ag.session.conv_options = {"reasoning": "drop"}
            main = await ag.two_turns_then_compaction()
            main.append(user("now run the tests"))
            main.append(await ag.chat(main))
            main.append(user("done?"))
            await ag.chat(main)
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["assistant_tokens_reencoded"] == 0 and m["assistant_tokens_reused"] > 0, m
    assert m["segments"] == 2 and m["forks"] == 1 and m["fork_fallbacks"] == 0, m
    assert all(msg["content"].startswith("answer") for c in ag.calls for msg in c if msg["role"] == "assistant")
    assert len(ag.calls) == len(ag.prompts) == 5
    for msgs, ids in zip(ag.calls, ag.prompts):
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.decode(ids, skip_special_tokens=False) == want
    for s in traj["segments"]:  # every sampled token is in its segment, reasoning included, masked 1
        assert int(np.asarray(s["loss_mask"]).sum()) == sum(t["end"] - t["start"] for t in s["turns"])


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_conversation_fork_equals_the_extension_it_stands_for(reasoning, qwen3_tokenizer):
    """``Conversation.fork(k, msgs)``: the ids the conversation would have had, had it been
    extended by ``msgs`` right after its k-th reply, whether or not the parent went on after it
    (the reasoning of the last shared reply hidden under ``reasoning="drop"`` either way)."""
    from rolloutd.llm.client import Generation
    from rolloutd.llm.conversation import Conversation

    tok = qwen3_tokenizer

    def gen(i):
        ids = tok(f"<think>\nstep {i}\n</think>\n\nanswer {i}<|im_end|>", add_special_tokens=False)["input_ids"]
        return Generation(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), "stop")

    def conv(turns):
        c = Conversation(tok, [{"role": "system", "content": "s"}, user("u0")], None, 4096, reasoning=reasoning)
        for i in range(turns):
            if i:
                c.add_messages([user(f"u{i}")])
            c.add_generation(gen(i), "b", 0)
        return c

    other = [{"role": "tool", "content": "out"}, user("other way")]
    for k in (1, 2):
        ref = conv(k)
        ref.add_messages(other)
        parent = conv(3)  # went on after its k-th reply
        for p in (parent, conv(k)):  # ... or stopped there
            f = p.fork(k, other)
            assert np.array_equal(f.context_ids, ref.context_ids)
            assert f.num_turns == 0 and f.awaiting_generation and f.prompt_length == len(ref.context_ids)
    with pytest.raises(ValueError):
        conv(1).fork(2, other)


def test_a_fork_the_template_cannot_render_incrementally_falls_back_to_a_full_render(scripted):
    """A template whose rendering of earlier turns depends on later messages (here: the system
    prompt changes once a message says "urgent", as Qwen3's depends on where the last user query
    is) cannot continue the shared prefix: the fork falls back to a segment rendered from the
    request's messages, counted, and the prompt is still the template's rendering."""
    tok = urgent_template_tokenizer()
    be = scripted(tok, "echo")

    async def episode():
        async with Agent(tok, be.url) as ag:
            main = await ag.two_turns_then_compaction()
            main.append(user("this is urgent: run the tests"))
            await ag.chat(main)
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["segments"] == 2 and m["forks"] == 0 and m["fork_fallbacks"] == 1, m
    assert m["assistant_tokens_reencoded"] > 0, m
    check_segments(traj, ag, tok)
    assert "Hurry." in tok.decode(traj["prompt_ids"].tolist())


class _CountedTool(dict):
    """A tool whose comparisons are counted (a coding harness sends 10-40 KB of them per call)."""

    compared = 0

    def __eq__(self, other):
        _CountedTool.compared += 1
        return dict.__eq__(self, other)

    __hash__ = None


def test_an_equal_tool_list_extends_the_conversation_and_is_compared_once(qwen_tokenizer, arun):
    """A request whose tools equal its conversation's but are another list (a harness's first
    bodies are decoded afresh: endpoint/resent.py keeps the history, not the tools, until the
    history outgrows them) extends it, and that list becomes the conversation's: the job's next
    body resends that very object and is matched without comparing a tool (before: every tool
    compared twice per request, ~50 us for 17 harness tools). Other tools still open a new
    conversation."""
    from rolloutd.endpoint.session import EndpointSession
    from rolloutd.llm.client import Generation

    tok = qwen_tokenizer
    eos = tok.get_vocab()["<|im_end|>"]
    reply = np.asarray(tok.encode("done", add_special_tokens=False) + [eos], np.int32)

    async def generate(ids, params):
        return Generation(token_ids=reply, logprobs=np.zeros(len(reply), np.float32), finish_reason="stop",
                          prompt_tokens=len(ids)), "b0", 0

    def tools(desc="reads a file"):
        return [_CountedTool(type="function", function={"name": f"tool_{i}", "description": desc,
                                                        "parameters": {"type": "object", "properties": {}}})
                for i in range(5)]

    async def main():
        s = EndpointSession(generate, tok)
        msgs = [user("fix the bug")]
        for i in range(3):  # each request's tools an equal list of its own, as decoded afresh
            last = tools()
            await s.chat({"model": "m", "messages": msgs, "tools": last})
            msgs = msgs + [{"role": "assistant", "content": "done"}, user(f"and step {i}")]
        _CountedTool.compared = 0
        await s.chat({"model": "m", "messages": msgs, "tools": last})  # the very object, as resent.py gives it
        assert _CountedTool.compared == 0
        msgs = msgs + [{"role": "assistant", "content": "done"}, user("go on")]
        await s.chat({"model": "m", "messages": msgs, "tools": tools("writes a file")})
        return s.trajectory()

    traj = arun(main())
    assert len(traj["segments"]) == 2  # the other tools opened a second conversation
    assert [len(x["turns"]) for x in traj["segments"]] == [4, 1]  # the equal lists extended the first
