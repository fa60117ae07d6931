"""LLMClient against the scripted backend over real loopback HTTP, both API shapes."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from rolloutd.llm.agent_loop import run_agent_loop
from rolloutd.llm.client import (
    BackendError,
    ContextOverflow,
    LLMClient,
    LLMTimeout,
    RequestError,
    SamplingParams,
    failover_generate,
    parse_prometheus,
    simple_generate,
)
from rolloutd.llm.conversation import Conversation
from rolloutd.backends.policies import Policy, PolicyReply, get_policy, parse_policy_spec
from rolloutd.backends.scripted import Latency
from rolloutd.llm.toolparse import get_parser

from .uvicorn_server import ThreadedUvicorn, read_body

APIS = ["vllm", "sglang"]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("api", APIS)
def test_generate_returns_sampled_ids_and_logprobs(api, qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "constant:text=\"Hello there, world!\"")
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def main():
        async with LLMClient(be.url, api, timeout=10) as c:
            g = await c.generate(np.array([1, 2, 3], dtype=np.int32), SamplingParams(max_tokens=64, seed=5))
            g2 = await c.generate([1, 2, 3], SamplingParams(max_tokens=64, seed=5))
            short = await c.generate([1, 2, 3], SamplingParams(max_tokens=2))
            return g, g2, short

    g, g2, short = arun(main())
    expected = tok.encode("Hello there, world!", add_special_tokens=False) + [eot]
    assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
    assert g.token_ids.tolist() == expected
    assert len(g.logprobs) == len(expected) and np.all(g.logprobs < 0)
    assert np.array_equal(g.logprobs, g2.logprobs)  # seeded
    assert g.finish_reason == "stop" and g.text == "Hello there, world!" and g.latency_s > 0
    assert short.finish_reason == "length" and short.token_ids.tolist() == expected[:2]
    assert be.stats[f"requests_{api}"] == 3


@pytest.mark.parametrize("api", APIS)
def test_reply_shapes_match_the_real_servers(api, qwen_tokenizer, scripted):
    be = scripted(qwen_tokenizer, "constant:text=\"ok\"")
    if api == "vllm":
        body = {"model": "scripted", "prompt": [1, 2], "max_tokens": 8, "logprobs": 0, "return_token_ids": True}
        r = httpx.post(be.url + "/v1/completions", json=body, timeout=5).json()
        assert r["object"] == "text_completion" and set(r["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}
        ch = r["choices"][0]
        assert set(ch) >= {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids"}
        assert set(ch["logprobs"]) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
        assert ch["prompt_token_ids"] == [1, 2] and len(ch["token_ids"]) == len(ch["logprobs"]["token_logprobs"])
        assert all(len(d) == 1 for d in ch["logprobs"]["top_logprobs"])  # logprobs=0: the sampled token only
    else:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        r = httpx.post(be.url + "/generate", json=body, timeout=5).json()
        m = r["meta_info"]
        assert m["finish_reason"] == {"type": "length", "length": 1}
        assert len(m["output_token_logprobs"]) == 1 and len(m["output_token_logprobs"][0]) == 3
        assert m["output_token_logprobs"][0][1] == r["output_ids"][0]
        body["sampling_params"]["max_new_tokens"] = 8
        m = httpx.post(be.url + "/generate", json=body, timeout=5).json()["meta_info"]
        assert m["finish_reason"] == {"type": "stop", "matched": qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_same_agent_loop_on_both_api_shapes(qwen_tokenizer, scripted, bash_tool, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer:tool_turns=2,answer=\"It is 42.\"")
    calls = []

    async def execute(call):
        calls.append(call)
        return f"ran {call.arguments['command']}"

    async def one(api):
        async with LLMClient(be.url, api, timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "What is 6*7?"}], [bash_tool], 4096)
            return await run_agent_loop(
                simple_generate(c, f"be-{api}", 3), conv, get_parser("hermes"), execute, SamplingParams(256), 8, tok
            )

    results = {api: arun(one(api)) for api in APIS}
    for api, res in results.items():
        assert res.stop_reason == "no_tool_call" and res.final_text == "It is 42."
        assert res.metrics["turns"] == 3 and res.metrics["tool_calls"] == 2 and res.metrics["malformed_tool_calls"] == 0
        assert [t["backend"] for t in res.turns] == [f"be-{api}"] * 3
        assert all(t["policy_version"] == 3 for t in res.turns)
    a, b = results["vllm"].arrays, results["sglang"].arrays
    for k in ("prompt_ids", "response_ids", "loss_mask"):
        assert np.array_equal(a[k], b[k])
    assert len(calls) == 4 and calls[0].name == "bash"


@pytest.mark.parametrize("api", APIS)
def test_http_500_is_a_backend_error(api, qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo")
    be.inject("500")

    async def main():
        async with LLMClient(be.url, api, timeout=5) as c:
            with pytest.raises(BackendError) as ei:
                await c.generate([1, 2, 3], SamplingParams(8))
            assert ei.value.status == 500 and not isinstance(ei.value, LLMTimeout)
            return await c.generate([1, 2, 3], SamplingParams(8))  # next request is fine

    assert arun(main()).finish_reason in ("stop", "length")


@pytest.mark.parametrize("api", APIS)
def test_dropped_connection_is_a_backend_error(api, qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo")

    async def main():
        async with LLMClient(be.url, api, model="scripted", timeout=5) as c:
            be.inject("drop")  # a new connection closed without a reply: an error at once
            with pytest.raises(BackendError):
                await c.generate([1, 2, 3], SamplingParams(8))
        assert be.stats["injected_drop"] == 1
        async with LLMClient(be.url, api, model="scripted", timeout=5) as c:
            await c.generate([1, 2, 3], SamplingParams(8))
            # a kept-alive connection closed without a reply as it is reused (what a server's keep-alive
            # timeout looks like): sent once more on a new connection
            be.inject("drop")
            assert (await c.generate([1, 2, 3], SamplingParams(8))).finish_reason in ("stop", "length")
            assert be.stats["injected_drop"] == 2
            # dropped again on the new connection too: a BackendError, not a loop
            be.inject("drop", count=2)
            with pytest.raises(BackendError):
                await c.generate([1, 2, 3], SamplingParams(8))
        assert be.stats["injected_drop"] == 4

    arun(main())


def test_refused_connection_is_a_backend_error(arun):
    async def main():
        async with LLMClient(f"http://127.0.0.1:{_free_port()}", "sglang", timeout=5) as c:
            with pytest.raises(BackendError):
                await c.generate([1], SamplingParams(4))
            assert await c.health() is False

    arun(main())


@pytest.mark.parametrize("api", APIS)
def test_timeout_is_llm_timeout_and_closes_the_connection(api, qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo")
    be.inject("hang")

    async def main():
        async with LLMClient(be.url, api, timeout=0.3) as c:
            t0 = time.perf_counter()
            with pytest.raises(LLMTimeout):
                await c.generate([1, 2, 3], SamplingParams(8))
            assert time.perf_counter() - t0 < 5.0

    arun(main())
    assert be.wait_for(lambda b: b.stats["disconnects"] == 1, timeout=5)
    assert be.wait_for(lambda b: b.num_running == 0, timeout=5)


@pytest.mark.parametrize("api", APIS)
def test_cancelling_the_task_closes_the_connection(api, qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo", latency=30.0)

    async def main():
        async with LLMClient(be.url, api, timeout=60) as c:
            task = asyncio.create_task(c.generate([1, 2, 3], SamplingParams(8)))
            deadline = time.monotonic() + 10
            while be.num_running != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert be.num_running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    arun(main())
    assert be.wait_for(lambda b: b.stats["disconnects"] == 1, timeout=5), dict(be.stats)
    # the server counts the disconnect first, then its generation task unwinds
    assert be.wait_for(lambda b: b.num_running == 0, timeout=5), be.num_running


@pytest.mark.parametrize("api", APIS)
def test_context_rejection_is_context_overflow(api, qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo", max_model_len=16)

    async def main():
        async with LLMClient(be.url, api, timeout=5) as c:
            with pytest.raises(ContextOverflow):  # a prompt past the context (vLLM 0.32 clamps max_tokens)
                await c.generate(list(range(100, 120)), SamplingParams(max_tokens=32))
            with pytest.raises(ContextOverflow):
                await c.generate([1], SamplingParams(max_tokens=0))

    arun(main())


class CannedServer(ThreadedUvicorn):
    """uvicorn (in a thread, its own loop) answering ``POST /v1/completions`` with fixed replies in order."""

    def __init__(self, replies: list[tuple[int, bytes]]) -> None:
        pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[test])")
        self.replies = list(replies)
        self.bodies: list[bytes] = []

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            self.bodies.append(await read_body(receive) or b"")
            status, data = self.replies.pop(0) if self.replies else (500, b'{"error": "no reply left"}')
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        super().__init__(app)


@pytest.fixture
def canned():
    started: list[CannedServer] = []

    def make(replies) -> CannedServer:
        srv = CannedServer(replies)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def test_malformed_replies_are_backend_errors(canned, arun):
    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    srv = canned(
        [
            (200, b"not json"),
            (200, js({"choices": [{"text": "x", "finish_reason": "stop", "logprobs": None}]})),
            (200, js({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"}]})),
            (200, js({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "weird"}]})),
            (503, js({"error": {"message": "overloaded"}})),
            (400, js({"error": {"message": "bad temperature"}})),
            (200, js({"choices": [{"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [None]}, "finish_reason": "length", "text": ""}]})),
        ]
    )

    async def main():
        async with LLMClient(srv.url, "vllm", model="m", timeout=10) as c:
            errors = []
            for _ in range(5):
                with pytest.raises(BackendError) as ei:
                    await c.generate([1], SamplingParams(4))
                errors.append(ei.value)
            with pytest.raises(RequestError, match="bad temperature"):
                await c.generate([1], SamplingParams(4))
            g = await c.generate([1], SamplingParams(4))  # old vLLM: ids only in logprobs.tokens
            return errors, g

    errors, g = arun(main())
    assert not any(isinstance(e, (RequestError, LLMTimeout)) for e in errors)
    assert "no token ids" in str(errors[1]) and "1 logprobs for 2 tokens" in str(errors[2])
    assert "weird" in str(errors[3]) and errors[4].status == 503 and "overloaded" in str(errors[4])
    assert g.token_ids.tolist() == [7] and np.isnan(g.logprobs[0]) and g.finish_reason == "length"
    assert len(srv.bodies) == 7 and json.loads(srv.bodies[0])["prompt"] == [1]


def test_metrics_health_models(qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "echo", latency=2.0, max_running=2, model="m1")

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c, LLMClient(be.url, "sglang", timeout=10) as s:
            assert await c.health()
            assert await c.models() == ["m1"]
            tasks = [asyncio.create_task(c.generate([1, 2], SamplingParams(4))) for _ in range(3)]
            deadline = time.monotonic() + 1.5
            while not (be.num_running == 2 and be.num_waiting == 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            m1, m2 = await c.metrics(), await s.metrics()
            await asyncio.gather(*tasks)
            return m1, m2, await c.metrics()

    m1, m2, after = arun(main())
    assert m1["num_requests_running"] == 2 and m1["num_requests_waiting"] == 1
    assert m2 == m1
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0


def test_parse_prometheus():
    text = """# HELP vllm:num_requests_running Number of requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0 1700000000000
vllm:num_requests_waiting{model_name="a, b"} 4
sglang:num_queue_reqs 1.5
vllm:kv_cache_usage_perc{engine="0"} 0.25
other_metric 99
vllm:num_requests_running_total 1000
"""
    out = parse_prometheus(text)
    assert out == {"num_requests_running": 5.0, "num_requests_waiting": 4.0, "kv_cache_usage": 0.25}
    out = parse_prometheus(text, {"sglang:num_queue_reqs": "num_requests_waiting"})
    assert out == {"num_requests_waiting": 1.5}


def test_failover_generate_moves_on(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    bad = scripted(tok, "tool_then_answer")
    good = scripted(tok, "tool_then_answer")
    bad.inject("500", count=100)

    async def main():
        async with LLMClient(bad.url, "vllm", timeout=5) as c1, LLMClient(good.url, "vllm", timeout=5) as c2:
            gen = failover_generate([(c1, "bad", 1), (c2, "good", 2)])
            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 4096)

            async def execute(call):
                return "ok"

            return await run_agent_loop(gen, conv, get_parser("hermes"), execute, SamplingParams(128), 5, tok)

    res = arun(main())
    assert res.stop_reason == "no_tool_call"
    assert [t["backend"] for t in res.turns] == ["good", "good"]
    assert [t["policy_version"] for t in res.turns] == [2, 2]
    assert bad.stats["injected_500"] == 2


def test_latency_and_policy_specs():
    import random

    rng = random.Random(0)
    assert Latency.parse("constant:0.25").sample(rng, 10) == 0.25
    lat = Latency.parse("uniform:0.1,0.2")
    assert all(0.1 <= lat.sample(rng, 0) <= 0.2 for _ in range(100))
    lat = Latency.parse("lognormal:0.1,0.5,0.001")
    xs = sorted(lat.sample(rng, 100) for _ in range(2001))
    assert 0.15 < xs[1000] < 0.25  # median 0.1 + 100 tokens * 1 ms
    with pytest.raises(ValueError):
        Latency.parse("gamma:1")
    assert parse_policy_spec('tool_then_answer:tool_turns=3,arguments={"command": "ls, -la"},answer=done') == (
        "tool_then_answer",
        {"tool_turns": 3, "arguments": {"command": "ls, -la"}, "answer": "done"},
    )
    with pytest.raises(KeyError):
        get_policy("no-such-policy")


def test_custom_policy_reply_with_explicit_ids(qwen_tokenizer, scripted, arun):
    class Fixed(Policy):
        def reply(self, request):
            return PolicyReply(token_ids=[11, 22, 33], finish="length", append_eos=False)

    be = scripted(qwen_tokenizer, Fixed())

    async def main():
        async with LLMClient(be.url, "sglang", timeout=5) as c:
            return await c.generate([1], SamplingParams(10))

    g = arun(main())
    assert g.token_ids.tolist() == [11, 22, 33] and g.finish_reason == "length"


def test_scripted_backend_cli_process(tiny_tokenizer_dir, arun):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.backends.scripted", "--port", "0", "--tokenizer", str(tiny_tokenizer_dir),
         "--policy", "tool_then_answer", "--latency", "constant:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        import queue
        import threading

        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("READY") and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if proc.poll() is not None:
                    break
        assert line.startswith("READY"), f"no READY line (exit {proc.poll()})"
        port = int(line.split()[1])

        async def main():
            async with LLMClient(f"http://127.0.0.1:{port}", "vllm", timeout=10) as c:
                g = await c.generate([1, 2, 3], SamplingParams(64))
                return g, await c.health()

        g, healthy = arun(main())
        assert healthy and g.text is not None and "<tool_call>" in g.text
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
            proc.stdout.close()


def test_registered_policy_and_policy_failure(qwen_tokenizer, scripted, arun):
    from rolloutd.backends.policies import available_policies, register_policy

    @register_policy("test_upper")
    class Upper(Policy):
        def reply(self, request):
            if self.options.get("boom"):
                raise RuntimeError("policy bug")
            return request.prompt_text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0].upper()

    assert "test_upper" in available_policies()
    tok = qwen_tokenizer
    ok_be = scripted(tok, "test_upper")
    bad_be = scripted(tok, "test_upper:boom=true")

    async def main():
        ids = tok.apply_chat_template([{"role": "user", "content": "shout this"}], add_generation_prompt=True, return_dict=False)
        async with LLMClient(ok_be.url, "vllm", timeout=5) as c, LLMClient(bad_be.url, "vllm", timeout=5) as b:
            g = await c.generate(ids, SamplingParams(32))
            with pytest.raises(BackendError):
                await b.generate(ids, SamplingParams(32))
            return g

    assert arun(main()).text == "SHOUT THIS"
    assert bad_be.stats["policy_errors"] == 1


def test_vllm_without_prompt_echo(qwen_tokenizer, scripted, arun):
    be = scripted(qwen_tokenizer, "constant:text=\"same ids either way\"")

    async def main():
        async with LLMClient(be.url, "vllm", timeout=5) as a, LLMClient(be.url, "vllm", timeout=5, return_token_ids=False) as b:
            p = SamplingParams(32, seed=1)
            return await a.generate([5, 6, 7], p), await b.generate([5, 6, 7], p)

    g1, g2 = arun(main())
    assert g1.token_ids.tolist() == g2.token_ids.tolist() and np.array_equal(g1.logprobs, g2.logprobs)


def test_a_latency_object_with_only_sample_is_served(qwen_tokenizer, scripted):
    """Benchmarks plug their own latency models in (bench_scale's grows with requests in flight):
    an object with only ``sample(rng, n_tokens)`` must work; the abortable path read a
    ``per_token`` it does not have and every request crashed (bench-smoke, silently)."""

    class OnlySample:
        def sample(self, rng, n_tokens):
            return 0.01

    be = scripted(qwen_tokenizer, "constant:text=\"ok\"")
    be.latency = OnlySample()
    body = {"model": "scripted", "prompt": [1, 2], "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
    r = httpx.post(be.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"]


def test_abort_all_while_a_request_without_rid_is_in_flight(qwen_tokenizer, scripted):
    """SGLang's /abort_request {"abort_all": true} beside a delayed request that named no rid (every
    vLLM-API request): the backend answers 200 and the request completes; before, the request left
    an entry None in the abort table and abort_all raised AttributeError on it."""
    import threading

    be = scripted(qwen_tokenizer, "constant:text=\"ok\"", latency=0.5)
    body = {"model": "scripted", "prompt": [1, 2], "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
    got = {}
    t = threading.Thread(target=lambda: got.update(r=httpx.post(be.url + "/v1/completions", json=body, timeout=10)))
    t.start()
    assert be.wait_for(lambda b: b.num_running >= 1, timeout=10)
    a = httpx.post(be.url + "/abort_request", json={"abort_all": True}, timeout=10)
    t.join(15)
    assert a.status_code == 200, a.text
    assert got["r"].status_code == 200
