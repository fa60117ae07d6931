"""How often a call hands work to an endpoint thread, and what never runs on the loop (issue 40
item 4; docs/ARCHITECTURE.md, "Threads").

A hand-off to a thread and back costs ~40-80 us of CPU, so a chat call makes one at most for its
request: the parse and the placement in a conversation together; none when the body adds at most
``INLINE_REQUEST_CHARS`` to the previous one and extends a conversation (an agent's usual call);
a short sampled reply is parsed on the loop, a long one (over ``INLINE_REPLY_TOKENS``) in the
thread. The loop touches the job's conversations only while none of the job's thread work runs. The real ``openai`` SDK over a real
uvicorn socket, the real Qwen2.5 tokenizer, the scripted backend speaking vLLM's HTTP API."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")

from rolloutd.endpoint.resent import Unshared
from rolloutd.endpoint.session import INLINE_REPLY_TOKENS, INLINE_REQUEST_CHARS, EndpointSession

from .conftest import BASH_TOOL
from .test_llm_openai_endpoint import Endpoint, Script

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
LONG = "word " * (2 * INLINE_REPLY_TOKENS)

pytestmark = pytest.mark.timeout(300)


def test_a_small_call_stays_on_the_loop_and_a_long_reply_goes_to_a_thread(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, [CALL, LONG], split=False))
    user = {"role": "user", "content": "list the files"}

    async def main():
        async with Endpoint(tok, be.url) as ep:
            s = ep.session
            loop_thread = threading.get_ident()
            hands, parsed_in = [], []
            offload, reply = s._offload, s._chat_reply

            async def counted(fn, *args, **kw):
                hands.append(getattr(fn, "__name__", repr(fn)))
                return await offload(fn, *args, **kw)

            def recorded(*args):
                parsed_in.append("loop" if threading.get_ident() == loop_thread else "thread")
                return reply(*args)

            s._offload, s._chat_reply = counted, recorded
            c = ep.client
            r = await c.chat.completions.create(model="m", messages=[user], tools=[BASH_TOOL])
            assert r.choices[0].finish_reason == "tool_calls"
            # a new conversation is rendered in the thread (the parse stayed on the loop); reply on the loop
            assert (hands, parsed_in) == (["place"], ["loop"]), (hands, parsed_in)
            msg = r.choices[0].message
            r2 = await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=[
                user, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a.txt"}])
            assert r2.usage.completion_tokens > INLINE_REPLY_TOKENS
            # the request extends it by a small tool result: on the loop; the long reply: a thread
            assert (hands, parsed_in) == (["place", "recorded"], ["loop", "thread"]), (hands, parsed_in)
            return s.trajectory()

    traj = arun(main())
    assert len(traj["turns"]) == 2 and "segments" not in traj  # the second call extended the first's conversation
    assert traj["metrics"]["assistant_tokens_reused"] > 0


async def _held(s: EndpointSession) -> tuple[asyncio.Future, asyncio.Event]:
    """Another request of the job in its endpoint thread: the task holding the job's turn, and
    the event that ends it."""
    release = asyncio.Event()

    async def hold():
        async with s._work:
            await release.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    return holder, release


def _conversation(tok, scripted, arun):
    """Four calls through the openai SDK: a new conversation, a small extension, a tool result
    longer than ``INLINE_REQUEST_CHARS``, then a fork after the first reply with a small new part.
    (the backend's prompts, the trajectory, the names of the functions handed to a thread)."""
    script = Script(tok, [CALL, CALL, CALL, "done"], split=False)
    be = scripted(tok, script)
    user = {"role": "user", "content": "list the files"}
    long_result = "word " * (INLINE_REQUEST_CHARS // 4)

    async def main():
        async with Endpoint(tok, be.url) as ep:
            s, hands = ep.session, []
            offload = s._offload

            async def counted(fn, *args, **kw):
                hands.append(getattr(fn, "__name__", repr(fn)))
                return await offload(fn, *args, **kw)

            s._offload = counted
            c = ep.client
            r1 = await c.chat.completions.create(model="m", messages=[user], tools=[BASH_TOOL])
            a1 = r1.choices[0].message
            h1 = [user, a1.model_dump(exclude_none=True)]
            result = lambda msg, text: {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": text}  # noqa: E731
            r2 = await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=h1 + [result(a1, "a.txt")])
            a2 = r2.choices[0].message
            h2 = h1 + [result(a1, "a.txt"), a2.model_dump(exclude_none=True), result(a2, long_result)]
            await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=h2)
            r4 = await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=h1 + [result(a1, "b.txt")])
            assert r4.choices[0].message.content == "done"
            return s.trajectory(), hands

    traj, hands = arun(main())
    return script.prompts, traj, hands


def test_the_loop_and_the_thread_place_requests_alike(qwen_tokenizer, scripted, arun, monkeypatch):
    """The same calls served with small requests on the loop and with every request in the job's
    thread (``INLINE_REQUEST_CHARS`` = 0): the same prompts reach the backend and the same
    trajectory comes back. On the loop, only a new conversation's and a fork's placement and a
    long new part are handed off."""
    from rolloutd.endpoint import session as session_module

    prompts, traj, hands = _conversation(qwen_tokenizer, scripted, arun)
    assert hands == ["place", "work", "place"], hands  # the small extension: no hand-off
    monkeypatch.setattr(session_module, "INLINE_REQUEST_CHARS", 0)
    prompts0, traj0, hands0 = _conversation(qwen_tokenizer, scripted, arun)
    assert hands0 == ["work"] * 4, hands0
    assert prompts == prompts0 and len(prompts) == 4
    assert len(traj["segments"]) == len(traj0["segments"]) == 2  # the fork opened a second conversation
    for a, b in zip(traj["segments"], traj0["segments"]):
        for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
            assert np.array_equal(a[k], b[k]), k
    for k in ("forks", "side_segments", "assistant_tokens_reused", "assistant_tokens_reencoded", "llm_calls"):
        assert traj["metrics"][k] == traj0["metrics"][k], k


def test_a_request_runs_on_the_loop_only_when_small_and_alone(qwen_tokenizer, arun):
    """``_request``: a body is worked on the loop with the budget, counted against the job's CPU;
    one the budget refuses (``Unshared``), a parsed dict (no body text to compare), and any while
    the job's thread work runs are worked in the thread without it."""
    async def never(ids, params):
        raise AssertionError("no LLM call here")

    async def main():
        s = EndpointSession(never, qwen_tokenizer)
        loop_thread = threading.get_ident()
        ran = []

        def work(inline, refuse=False, seconds=0.0):
            ran.append((inline, threading.get_ident() == loop_thread))
            if refuse and inline is not None:
                raise Unshared
            t = time.thread_time()
            while time.thread_time() - t < seconds:
                pass
            return "parsed", None

        assert await s._request(lambda i: work(i, seconds=0.05), b"{}") == ("parsed", None)
        assert ran == [(INLINE_REQUEST_CHARS, True)] and s.metrics["endpoint_cpu_s"] >= 0.05
        ran.clear()
        await s._request(lambda i: work(i, refuse=True), b"{}")
        assert ran == [(INLINE_REQUEST_CHARS, True), (None, False)]
        ran.clear()
        await s._request(work, {"messages": []})
        assert ran == [(None, False)]
        ran.clear()
        holder, release = await _held(s)
        req = asyncio.ensure_future(s._request(work, b"{}"))
        await asyncio.sleep(0.2)
        assert not req.done() and not ran  # it waits its turn, off the loop
        release.set()
        await asyncio.wait_for(req, 10)
        assert ran == [(None, False)]
        await holder

    arun(main())


def test_the_loop_waits_for_the_jobs_thread_work_and_counts_its_own_cpu(qwen_tokenizer, arun):
    async def never(ids, params):
        raise AssertionError("no LLM call here")

    def spin(seconds: float) -> int:
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            pass
        return threading.get_ident()

    async def main():
        s = EndpointSession(never, qwen_tokenizer)
        loop_thread = threading.get_ident()
        assert await s._short(10, spin, 0.05) == loop_thread  # short, nothing else running: on the loop
        assert s.metrics["endpoint_cpu_s"] >= 0.05  # and counted against the job's CPU budget
        assert await s._short(INLINE_REPLY_TOKENS + 1, spin, 0) != loop_thread  # long: a thread

        holder, release = await _held(s)
        short = asyncio.ensure_future(s._short(10, spin, 0))
        await asyncio.sleep(0.2)
        assert not short.done()  # not run on the loop beside that work: it waits its turn
        release.set()
        assert await asyncio.wait_for(short, 10) != loop_thread
        await holder

    arun(main())


class _SlowPlace:
    """``tree.place`` that, once armed, signals it started and then takes ``seconds`` (in the
    job's endpoint thread), as a long history's placement does on a busy machine."""

    def __init__(self, tree, seconds: float):
        self.place, self.seconds = tree.place, seconds
        self.armed, self.started, self.ended = False, threading.Event(), threading.Event()

    def __call__(self, msgs, tools, max_chars=None):
        if not self.armed:
            return self.place(msgs, tools, max_chars)
        assert max_chars is None, "placed on the loop: this test needs it in the thread"
        self.started.set()
        time.sleep(self.seconds)
        try:
            return self.place(msgs, tools)
        finally:
            self.ended.set()


def test_a_request_cancelled_while_placed_leaves_its_conversation_free(qwen_tokenizer, scripted, arun):
    """A request cancelled (its server stopping, a harness abort) while its thread places it: the
    thread finishes the placement after the request is gone. The conversation it marked busy
    is released, so the request's retry extends it (before: busy forever, the retry opened a
    second segment and the trajectory lost the continuation)."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, [CALL, "done"], split=False))
    user = {"role": "user", "content": "list the files"}

    async def main():
        async with Endpoint(tok, be.url) as ep:
            s = ep.session
            first = await s.chat({"model": "m", "messages": [user], "tools": [BASH_TOOL]})
            call = first.tool_calls[0]
            second = {"model": "m", "tools": [BASH_TOOL], "messages": [
                user, {"role": "assistant", "content": first.content or "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]}
            slow = s.tree.place = _SlowPlace(s.tree, 0.5)
            slow.armed = True
            req = asyncio.ensure_future(s.chat(second))
            assert await asyncio.to_thread(slow.started.wait, 10)
            req.cancel()
            with pytest.raises(asyncio.CancelledError):
                await req
            assert slow.ended.is_set()  # the request ended only with its thread work
            assert not any(seg.busy for seg in s.tree.segments), "a cancelled request left its conversation busy"
            slow.armed = False
            again = await s.chat(second)  # the retry
            assert again.finish_reason == "stop"
            return s.trajectory()

    traj = arun(main())
    assert len(traj["turns"]) == 2 and "segments" not in traj  # one conversation, extended by the retry


def test_a_cancelled_requests_thread_work_keeps_the_job_until_it_ends(qwen_tokenizer, arun):
    """The job's thread work runs one at a time, also when the request that started it is
    cancelled: the next request's work waits for the abandoned one (before: it ran beside it, two
    threads changing one job's conversations), and ``settled`` waits for it (what a harness
    calls before reading the trajectory)."""
    async def never(ids, params):
        raise AssertionError("no LLM call here")

    running, overlapped = [], []

    def work(seconds: float) -> None:
        if running:
            overlapped.append(True)
        running.append(True)
        time.sleep(seconds)
        running.pop()

    async def main():
        s = EndpointSession(never, qwen_tokenizer)
        first = asyncio.ensure_future(s._offload(work, 0.4))
        await asyncio.sleep(0.1)
        first.cancel()
        second = asyncio.ensure_future(s._offload(work, 0))
        await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 10)
        assert not overlapped, "two thread jobs of one job ran at once"
        third = asyncio.ensure_future(s._offload(work, 0.3))
        await asyncio.sleep(0.05)
        third.cancel()
        t0 = time.monotonic()
        await s.settled()
        assert not running and time.monotonic() - t0 > 0.1  # waited for the abandoned work
        assert third.cancelled() or third.done()

    arun(main())
