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

            async def counted(fn, *args):
                hands.append(getattr(fn, "__name__", repr(fn)))
                return await offload(fn, *args)

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
