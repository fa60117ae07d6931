"""serve-hf with the tiny Qwen2 model: logprob parity of multi-turn rollouts, sampling, aborts."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install rolloutd[torch])")

from rolloutd.llm.agent_loop import run_agent_loop  # noqa: E402
from rolloutd.llm.client import ContextOverflow, LLMClient, SamplingParams, simple_generate  # noqa: E402
from rolloutd.llm.conversation import Conversation  # noqa: E402
from rolloutd.llm.http_transport import FastTransport  # noqa: E402
from rolloutd.llm.toolparse import ParseResult, ToolCall, ToolParser  # noqa: E402


class AlwaysCall(ToolParser):
    """A random model never writes a valid tool call; pretend every turn made one."""

    def parse(self, text):
        call = ToolCall(name="bash", arguments={"command": "echo hi"})
        return ParseResult(calls=[call], items=[("call", call)])


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, dtype=np.int64)[None])).logits[0].float()


def test_logprob_parity_multi_turn(hf_server, ref_model, tiny_tok, bash_tool, arun):
    tok = tiny_tok

    async def execute(call):
        return "file_a.txt\nfile_b.txt\n"

    async def rollout(c, i):
        conv = Conversation(tok, [{"role": "user", "content": f"List the files, please ({i})."}], [bash_tool], 2048)
        res = await run_agent_loop(
            simple_generate(c, c.api, 0), conv, AlwaysCall(), execute, SamplingParams(max_tokens=12), 3, tok
        )
        return res

    async def main():
        async with LLMClient(hf_server.url, "vllm", timeout=60) as v, LLMClient(hf_server.url, "sglang", timeout=60) as s:
            # concurrent rollouts of different lengths: batched, left-padded forward passes
            return await asyncio.gather(rollout(v, 0), rollout(v, 1), rollout(v, 22), rollout(s, 3))

    results = arun(main(), timeout=120)
    for res in results:
        a = res.arrays
        assert res.metrics["turns"] == 3 and len(res.turns) == 3
        assert all(t["obs_end"] > t["obs_start"] for t in res.turns[:2])  # observations between turns
        full = np.concatenate([a["prompt_ids"], a["response_ids"]])
        logp = torch.log_softmax(_logits(ref_model, full), dim=-1).numpy()
        p = len(a["prompt_ids"])
        idx = np.nonzero(a["loss_mask"])[0]
        assert len(idx) == sum(t["end"] - t["start"] for t in res.turns) > 0
        recomputed = logp[p + idx - 1, full[p + idx]]
        diff = np.abs(recomputed - a["logprobs"][idx]).max()
        assert diff < 1e-3, diff
        assert np.all(a["logprobs"][a["loss_mask"] == 0] == 0)


def _processed_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference implementation (numpy) of the distribution serve-hf samples from."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order][0])
        probs /= probs.sum()
        cum = np.cumsum(probs)
        remove = (cum - probs) > top_p
        remove[0] = False
        x = x.copy()
        x[order[remove]] = -np.inf
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_logprobs_are_of_the_processed_distribution(hf_server, ref_model, arun):
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=40, top_p=0.9, seed=123)

    async def main():
        async with LLMClient(hf_server.url, "vllm", timeout=60) as c:
            return await c.generate(prompt, params), await c.generate(prompt, params)

    g, g2 = arun(main())
    assert g.token_ids.tolist() == g2.token_ids.tolist()  # seeded
    full = prompt + g.token_ids.tolist()
    logits = _logits(ref_model, full).numpy()
    for j, tid in enumerate(g.token_ids.tolist()):
        ref = _processed_logprobs(logits[len(prompt) + j - 1], 0.7, 40, 0.9)
        assert np.isfinite(ref[tid])
        assert abs(ref[tid] - g.logprobs[j]) < 1e-3


def test_greedy_and_stop_tokens(hf_server, ref_model, arun):
    prompt = list(range(30, 40))

    async def main():
        async with LLMClient(hf_server.url, "sglang", timeout=60) as c:
            g = await c.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
            first = int(g.token_ids[0])
            s = await c.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first]))
            return g, s

    g, s = arun(main())
    logits = _logits(ref_model, prompt).numpy()
    assert int(g.token_ids[0]) == int(np.argmax(logits[-1]))
    assert s.token_ids.tolist() == [int(g.token_ids[0])] and s.finish_reason == "stop" and s.stop_reason == int(g.token_ids[0])


def test_client_disconnect_aborts_generation(hf_server, arun):
    import httpx

    aborted_before = hf_server.stats["aborted"]

    async def main():
        async with httpx.AsyncClient(base_url=hf_server.url, transport=FastTransport(), timeout=60) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 3500, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while hf_server.num_running == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert hf_server.num_running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while hf_server.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return hf_server.num_running

    tokens_before = hf_server.stats["aborted_at_tokens"]
    assert arun(main()) == 0
    assert hf_server.stats["aborted"] == aborted_before + 1
    assert hf_server.stats["aborted_at_tokens"] - tokens_before < 3500  # stopped, not run to max_tokens

    async def after():  # the server is still fine
        async with LLMClient(hf_server.url, "vllm", timeout=60) as c:
            return await c.generate([1, 2, 3], SamplingParams(4))

    assert len(arun(after()).token_ids) >= 1


def test_endpoints_and_context_limit(hf_server, arun):
    import urllib.request

    for path in ("/health", "/health_generate"):  # the router probes SGLang backends on the second
        with urllib.request.urlopen(hf_server.url + path, timeout=30) as r:
            assert r.status == 200, path

    async def main():
        async with LLMClient(hf_server.url, "vllm", timeout=60) as c:
            assert await c.health()
            assert await c.models() == ["tiny"]
            m = await c.metrics()
            assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
            with pytest.raises(ContextOverflow):  # longer than the context (vLLM 0.32 clamps max_tokens)
                await c.generate(list(range(10, 20)) * (hf_server.max_model_len // 10 + 1), SamplingParams(max_tokens=4))

    arun(main())


def test_serve_hf_main(tiny_model_dir, arun, capsys):
    """``rolloutd serve-hf`` entry point, in process: serve, answer, stop on SIGTERM."""
    import os
    import signal
    import threading

    from rolloutd.backends import serve_hf

    result = {}

    def client():
        try:
            deadline = time.monotonic() + 60
            port = None
            while port is None and time.monotonic() < deadline:
                out = capsys.readouterr().out
                for ln in out.splitlines():
                    if ln.startswith("READY"):
                        port = int(ln.split()[1])
                time.sleep(0.05)

            async def main():
                async with LLMClient(f"http://127.0.0.1:{port}", "vllm", timeout=60) as c:
                    return await c.generate([1, 2], SamplingParams(3))

            result["g"] = asyncio.run(main())
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    th = threading.Thread(target=client, daemon=True)
    th.start()
    assert serve_hf.main([str(tiny_model_dir), "--port", "0", "--max-batch-size", "2", "--threads", "1"]) == 0
    th.join(10)
    assert len(result["g"].token_ids) >= 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_accept_queue_holds_a_trainer_steps_burst():
    """A step opens dozens of connections at once. With the stdlib's listen backlog (5) the
    handshakes beyond it were dropped and came back only by TCP retransmission, which grew
    into job timeouts on a loaded box; nothing here accepts, so only the queue holds them."""
    from http.server import BaseHTTPRequestHandler

    from rolloutd.backends.serve_hf import _HTTPServer

    httpd = _HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    socks = []
    try:
        for _ in range(128):
            socks.append(socket.create_connection(httpd.server_address, timeout=1.0))
    finally:
        for s in socks:
            s.close()
        httpd.server_close()
    assert len(socks) == 128
