"""How often a call hands work to an endpoint thread, and what never runs on the loop (issue 40
item 4; docs/ARCHITECTURE.md, "Threads").

A hand-off to a thread and back costs ~40-80 us of CPU, so a chat call makes one: the request's
parse and its placement in a conversation together; a short sampled reply is parsed on the
loop, a long one (over ``INLINE_REPLY_TOKENS``) in the thread. The loop touches the job's
conversations only while none of the job's thread work runs. The real ``openai`` SDK over a real
uvicorn socket, the real Qwen2.5 tokenizer, the scripted backend speaking vLLM's HTTP API."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")

from rolloutd.endpoint.session import INLINE_REPLY_TOKENS, EndpointSession

from .conftest import BASH_TOOL
from .test_llm_openai_endpoint import Endpoint, Script

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
LONG = "word " * (2 * INLINE_REPLY_TOKENS)

pytestmark = pytest.mark.timeout(300)


def test_a_call_hands_off_once_and_parses_a_short_reply_on_the_loop(qwen_tokenizer, scripted, arun):
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
            assert (len(hands), parsed_in) == (1, ["loop"]), (hands, parsed_in)  # parse + place; reply on the loop
            msg = r.choices[0].message
            r2 = await c.chat.completions.create(model="m", tools=[BASH_TOOL], messages=[
                user, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a.txt"}])
            assert r2.usage.completion_tokens > INLINE_REPLY_TOKENS
            assert (len(hands), parsed_in) == (3, ["loop", "thread"]), (hands, parsed_in)  # a long reply: a thread
            return s.trajectory()

    traj = arun(main())
    assert len(traj["turns"]) == 2 and "segments" not in traj  # the second call extended the first's conversation
    assert traj["metrics"]["assistant_tokens_reused"] > 0


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

        release = asyncio.Event()

        async def hold():  # another request of the job is in its endpoint thread
            async with s._work:
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
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

    def __call__(self, msgs, tools):
        if not self.armed:
            return self.place(msgs, tools)
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
