"""Streamed vLLM generation (``LLMClient.generate(..., partial=Partial())``, issue 27): vLLM's
``stream: true`` server-sent events read into ``Partial`` as they arrive, so a cancelled call keeps
the tokens sampled before it. Real parts: the scripted backend's vLLM stream parsed by the real
``openai`` SDK (its own SSE decoder), and FastTransport against a real uvicorn + starlette
``StreamingResponse`` (the stack vLLM's API server answers ``stream: true`` with). No real vLLM
runs here (no GPU): the chunk shapes follow vLLM's source (``completion_stream_generator``)."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from rolloutd.llm.client import BackendError, ContextOverflow, LLMClient, Partial, SamplingParams
from rolloutd.backends.policies import get_policy

from .uvicorn_server import ThreadedUvicorn

TEXT = "alpha beta gamma delta " * 12

# vLLM's CompletionStreamResponse / CompletionResponseStreamChoice fields (0.10.2-0.11, dumped with
# exclude_unset=False; main dumps the same choice fields and leaves out an unset usage)
CHUNK_KEYS = {"id", "object", "created", "model", "choices", "usage"}
CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}


def _body(prompt, **kw):
    return {"model": "scripted", "prompt": prompt, "max_tokens": 20, "logprobs": 0, "seed": 7,
            "return_token_ids": True, "return_tokens_as_token_ids": True, **kw}


async def cancel_when(task: asyncio.Task, ready, timeout: float) -> None:
    """Cancel ``task`` once ``ready()`` holds (or ``timeout`` seconds passed); it must end cancelled."""
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_scripted_stream_parsed_by_the_openai_sdk(qwen_tokenizer, scripted, arun):
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed")
    be = scripted(qwen_tokenizer, get_policy("constant", text=TEXT), latency="constant:0.01,0.002")
    prompt = [9707, 11, 1879]

    async def main():
        async with openai.AsyncOpenAI(base_url=be.url + "/v1", api_key="x", max_retries=0) as oa:
            extra = {k: v for k, v in _body(prompt).items() if k.startswith("return_")}
            whole = await oa.completions.create(model="scripted", prompt=prompt, max_tokens=20, logprobs=0, seed=7,
                                                extra_body=extra)
            stream = await oa.completions.create(model="scripted", prompt=prompt, max_tokens=20, logprobs=0, seed=7,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra)
            return whole.model_dump(), [c.model_dump(exclude_unset=True) for c in [x async for x in stream]]

    whole, chunks = arun(main())
    *token_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert len(token_chunks) >= 2  # streamed as sampled, not one reply
    ids, lps = [], []
    for i, ch in enumerate(token_chunks):
        assert set(ch) == CHUNK_KEYS and ch["object"] == "text_completion", ch
        (c,) = ch["choices"]
        assert set(c) == CHOICE_KEYS, c
        assert (c["prompt_token_ids"] == prompt) == (i == 0)
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert c["finish_reason"] == ("length" if i == len(token_chunks) - 1 else None)
        ids += c["token_ids"]
        lps += c["logprobs"]["token_logprobs"]
    w = whole["choices"][0]
    assert ids == w["token_ids"] and lps == w["logprobs"]["token_logprobs"]  # seeded: the same sample


@pytest.mark.parametrize("return_token_ids", [True, False])
def test_streamed_generation_equals_the_whole_reply(qwen_tokenizer, scripted, arun, return_token_ids):
    be = scripted(qwen_tokenizer, get_policy("constant", text=TEXT), latency="constant:0.005,0.001")
    stop = qwen_tokenizer.encode(" gamma", add_special_tokens=False)[0]

    async def main():
        async with LLMClient(be.url, "vllm", timeout=20, return_token_ids=return_token_ids) as c:
            out = []
            for p in (SamplingParams(20, seed=3), SamplingParams(200, seed=3), SamplingParams(20, seed=3,
                                                                                         stop_token_ids=[stop])):
                whole = await c.generate([1, 2, 3], p)
                part = Partial()
                streamed = await c.generate([1, 2, 3], p, partial=part)
                out.append((whole, streamed, part))
            return out, c._http._transport.stats

    out, stats = arun(main())
    assert [w.finish_reason for w, _, _ in out] == ["length", "stop", "stop"]
    for whole, streamed, part in out:
        assert streamed.token_ids.dtype == np.int32 and streamed.logprobs.dtype == np.float32
        assert streamed.token_ids.tolist() == whole.token_ids.tolist() == part.ids
        assert np.array_equal(streamed.logprobs, whole.logprobs)
        assert (streamed.finish_reason, streamed.stop_reason, streamed.prompt_tokens) == (
            whole.finish_reason, whole.stop_reason, whole.prompt_tokens)
    assert out[2][1].stop_reason == stop
    assert stats["streams"] == 3 and stats["connections_opened"] == 1  # read to the end: kept alive


def test_cancelling_a_stream_keeps_the_tokens_that_arrived_and_aborts_on_the_server(qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, get_policy("constant", text=TEXT), latency="constant:0.01,0.05")

    async def main():
        async with LLMClient(be.url, "vllm", timeout=30) as c:
            full = (await c.generate([1, 2, 3], SamplingParams(8, seed=1))).token_ids.tolist()
            part = Partial()
            task = asyncio.create_task(c.generate([1, 2, 3], SamplingParams(40, seed=1), partial=part))
            await cancel_when(task, lambda: len(part) >= 3, timeout=20)
            g = part.generation()
            return full, g, c._http._transport

    full, g, transport = arun(main())
    assert g.finish_reason == "abort" and 3 <= len(g.token_ids) < 40 and len(g.logprobs) == len(g.token_ids)
    assert g.token_ids.tolist()[:8] == full[: len(g.token_ids)][:8]  # the same sample, cut
    assert be.wait_for(lambda b: b.stats["disconnects"] == 1 and b.num_running == 0, timeout=10), dict(be.stats)
    assert transport.num_open <= 1  # the cancelled stream's connection was closed, not pooled


def test_errors_in_a_stream(qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, get_policy("constant", text=TEXT), max_model_len=64)

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c:
            with pytest.raises(ContextOverflow):  # rejected before the stream starts: a JSON 400
                await c.generate(list(range(100, 170)), SamplingParams(32), partial=Partial())

    arun(main())


# -- FastTransport and the client against uvicorn + starlette's StreamingResponse -----------------


class SSEServer(ThreadedUvicorn):
    """uvicorn in a thread serving ``POST /v1/completions`` with a starlette ``StreamingResponse``
    (media type text/event-stream, as vLLM's api_server) of the events ``script()`` yields."""

    def __init__(self, script):
        pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[test])")
        responses = pytest.importorskip("starlette.responses", reason="starlette is not installed")
        self.closed_early = 0
        self.requests = 0

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            while (await receive()).get("more_body"):
                pass
            self.requests += 1

            async def events():
                finished = False
                try:
                    async for ev in script():
                        yield ev
                    finished = True
                finally:
                    if not finished:
                        self.closed_early += 1

            await responses.StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

        super().__init__(app)


def chunk(ids, finish=None):
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": "x" * len(ids), "logprobs": {"text_offset": [0] * len(ids),
                                                         "token_logprobs": [-0.5] * len(ids),
                                                         "tokens": [f"token_id:{t}" for t in ids],
                                                         "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids]},
         "finish_reason": finish, "stop_reason": None, "prompt_token_ids": None, "token_ids": ids}],
        "usage": None}) + "\n\n"


@pytest.fixture
def sse():
    made = []

    def make(script):
        made.append(SSEServer(script))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def test_stream_through_uvicorn_kept_alive_and_cut(sse, arun):
    async def ok():
        for k in range(5):
            yield chunk([10 + 2 * k, 11 + 2 * k], finish="length" if k == 4 else None)
            await asyncio.sleep(0.005)
        yield "data: [DONE]\n\n"

    async def endless():
        for k in range(2000):
            yield chunk([k])
            await asyncio.sleep(0.01)

    srv_ok, srv_long = sse(ok), sse(endless)

    async def main():
        async with LLMClient(srv_ok.url, "vllm", model="m", timeout=20) as c:
            gs = [await c.generate([1], SamplingParams(10), partial=Partial()) for _ in range(3)]
            opened = c._http._transport.stats["connections_opened"]
        async with LLMClient(srv_long.url, "vllm", model="m", timeout=20) as c:
            part = Partial()
            task = asyncio.create_task(c.generate([1], SamplingParams(10), partial=part))
            await cancel_when(task, lambda: len(part) >= 5, timeout=20)
        return gs, opened, part

    gs, opened, part = arun(main())
    for g in gs:
        assert g.token_ids.tolist() == list(range(10, 20)) and g.finish_reason == "length"
    assert opened == 1  # three streams read to the end over one kept-alive connection
    assert part.ids[:5] == [0, 1, 2, 3, 4] and len(part.ids) == len(part.logprobs)
    deadline = time.monotonic() + 10
    while srv_long.closed_early < 1 and time.monotonic() < deadline:  # starlette saw the disconnect
        time.sleep(0.02)
    assert srv_long.closed_early == 1


@pytest.mark.parametrize("case", ["error_event", "no_done", "no_finish", "bad_json", "lp_mismatch", "server_dies",
                                  "stall", "weird_finish"])
def test_broken_streams_are_backend_errors(sse, arun, case):
    async def script():
        yield chunk([1, 2])
        if case == "error_event":  # vLLM's mid-stream error, then [DONE]
            yield "data: " + json.dumps({"error": {"message": "engine died", "type": "InternalServerError",
                                                   "param": None, "code": 500}}) + "\n\n"
        elif case == "bad_json":
            yield "data: {not json\n\n"
        elif case == "lp_mismatch":
            bad = json.loads(chunk([3, 4], "stop")[6:])
            bad["choices"][0]["logprobs"]["token_logprobs"] = [-1.0]
            yield "data: " + json.dumps(bad) + "\n\n"
        elif case == "no_finish":
            yield chunk([3])
        elif case == "server_dies":  # uvicorn closes the connection without the last HTTP chunk
            raise RuntimeError("engine died mid-stream")
        elif case == "stall":
            await asyncio.sleep(30)
        elif case == "weird_finish":
            yield chunk([3], finish="exploded")
        if case != "no_done":
            yield "data: [DONE]\n\n"

    srv = sse(script)

    async def main():
        async with LLMClient(srv.url, "vllm", model="m", timeout=1.5 if case == "stall" else 10) as c:
            part = Partial()
            with pytest.raises(BackendError) as e:
                await c.generate([1], SamplingParams(10), partial=part)
            return str(e.value), part

    msg, part = arun(main())
    assert part.ids[:2] == [1, 2]
    assert {"error_event": "engine died", "no_done": "[DONE]", "no_finish": "finish_reason",
            "bad_json": "malformed", "lp_mismatch": "logprobs", "server_dies": "closed the connection",
            "stall": "no reply within", "weird_finish": "unexpected finish_reason"}[case] in msg, msg


# -- serve-hf (a real transformers model) streams the same shape --------------------------------


def test_serve_hf_streams_what_it_would_return_whole(hf_server, arun):
    async def main():
        async with LLMClient(hf_server.url, "vllm", timeout=60) as c:
            p = SamplingParams(24, seed=5)
            whole = await c.generate([1, 2, 3], p)
            part = Partial()
            streamed = await c.generate([1, 2, 3], p, partial=part)
            return whole, streamed, part

    whole, streamed, part = arun(main())
    assert streamed.token_ids.tolist() == whole.token_ids.tolist() == part.ids
    assert np.allclose(streamed.logprobs, whole.logprobs)
    assert (streamed.finish_reason, streamed.prompt_tokens) == (whole.finish_reason, 3)


def test_serve_hf_stream_cancel_keeps_tokens_and_aborts(hf_server, arun):
    aborted = hf_server.stats["aborted"]

    async def main():
        async with LLMClient(hf_server.url, "vllm", timeout=60) as c:
            part = Partial()
            body = SamplingParams(3000, seed=5)
            task = asyncio.create_task(c.generate([1, 2, 3], body, partial=part))
            await cancel_when(task, lambda: len(part) >= 4, timeout=30)
            deadline = time.monotonic() + 30
            while hf_server.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return part, hf_server.num_running

    part, running = arun(main())
    assert len(part) >= 4 and len(part.ids) == len(part.logprobs) and running == 0
    deadline = time.monotonic() + 10
    while hf_server.stats["aborted"] == aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hf_server.stats["aborted"] == aborted + 1


def test_a_cancel_after_the_last_chunk_keeps_the_finish(sse, arun):
    """The interrupt can land after the finish_reason chunk and before [DONE]: the generation is
    complete (it may end in the stop token) and must come back as such, not as an abort the loop
    would continue past its end."""
    async def script():
        yield chunk([5, 6])
        yield chunk([7], finish="stop")
        await asyncio.sleep(30)  # [DONE] late
        yield "data: [DONE]\n\n"

    srv = sse(script)

    async def main():
        async with LLMClient(srv.url, "vllm", model="m", timeout=60) as c:
            part = Partial()
            task = asyncio.create_task(c.generate([1], SamplingParams(10), partial=part))
            await cancel_when(task, lambda: part.finish_reason is not None, timeout=20)
            return part.generation()

    g = arun(main())
    assert (g.token_ids.tolist(), g.finish_reason) == ([5, 6, 7], "stop")
