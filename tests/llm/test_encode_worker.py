"""Long texts tokenized in bounded worker processes (llm/encode_worker.py): the same ids as the
tokenizer's own encode, refused early past a token count, ended at a CPU bound; real tokenizers,
real worker processes."""
from __future__ import annotations

import random

import pytest

from rolloutd.llm import encode_worker as ew
from rolloutd.llm.tokenizer_utils import WORKER_CHARS, encode_bounds, fast_encoder

WORDS = ["foo", "bar", "Ünï", "数字", "123", "x=1;", "\n", "  ", "\n\n", "<|im_end|>", "<tool_call>", "def", "'s",
         "a.b", "\t", "'", "é", "<|endoftext|>", "🙂", "\r\n"]


def texts(seed: int, n: int = 3, words: int = 40000):
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "\n"]) for _ in range(words))


@pytest.fixture(params=["qwen", "tiny"])
def tok(request, qwen_tokenizer, tmp_path_factory):
    if request.param == "qwen":
        return qwen_tokenizer
    from rolloutd.backends.tiny_model import make_tiny_model
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_only=True))


def test_worker_ids_equal_the_tokenizers_own(tok):
    """Chunked in the worker or not, encode / encode_plain / encode_special give the ids the
    tokenizer gives for the whole text (control-token strings, CRLF, emoji, long whitespace)."""
    enc = fast_encoder(tok)
    b = tok.backend_tokenizer
    before = ew.ENCODE_STATS.cpu_s
    for text in texts(7):
        assert len(text) > WORKER_CHARS
        ref = b.encode(text, add_special_tokens=False).ids
        ref_special = b.encode(text, add_special_tokens=True).ids
        ref_plain = enc.encode_plain(text)
        with encode_bounds(None, 30.0):
            assert enc.encode(text) == ref
            assert enc.encode_special(text) == ref_special
            assert enc.encode_plain(text) == ref_plain
    assert ew.ENCODE_STATS.cpu_s > before  # the worker's CPU is counted for this thread


def test_a_text_past_the_window_is_refused_after_about_the_window(qwen_tokenizer):
    enc = fast_encoder(qwen_tokenizer)
    text = "word " * ((8 << 20) // 5)  # 1.68M tokens
    with encode_bounds(131072, 30.0), pytest.raises(ew.EncodeRefused) as e:
        enc.encode(text)
    assert e.value.kind == "tokens" and 131072 < e.value.count < 131072 + 20000, e.value.count


def test_an_unsplittable_text_ends_at_its_cpu_bound(qwen_tokenizer):
    """8 MB of one letter is one pre-token: no cut point; the worker is ended by RLIMIT_CPU and
    replaced, and the next text is served."""
    enc = fast_encoder(qwen_tokenizer)
    with encode_bounds(131072, 1.0), pytest.raises(ew.EncodeRefused) as e:
        enc.encode("a" * (8 << 20))
    assert e.value.kind == "cpu"
    with encode_bounds(131072, 30.0):
        assert enc.encode("hello world " * 10000) == qwen_tokenizer.backend_tokenizer.encode(
            "hello world " * 10000, add_special_tokens=False).ids


def test_short_texts_and_unbounded_threads_stay_in_process(qwen_tokenizer, monkeypatch):
    enc = fast_encoder(qwen_tokenizer)

    def boom(*a, **k):
        raise AssertionError("encoded in a worker")

    monkeypatch.setattr(ew, "encode", boom)
    enc.encode("x " * (WORKER_CHARS // 2))  # bounded but short
    enc.encode("x " * WORKER_CHARS)  # long but no bounds in this thread
    with encode_bounds(100, 1.0):
        enc.encode("x " * (WORKER_CHARS // 2))


# -- the endpoint's answers (EndpointSession, the real tokenizer and workers) ------------------
def session(tok, **limits):
    from rolloutd.endpoint.bounds import EndpointLimits
    from rolloutd.endpoint.session import EndpointSession

    async def generate(ids, params):  # never reached: every request here is refused before sampling
        raise AssertionError("sampled")

    return EndpointSession(generate, tok, limits=EndpointLimits(**limits))


def test_the_agent_gets_each_refusal_in_its_api_shape(arun, qwen_tokenizer):
    """Past the window: 400 context_length_exceeded (Anthropic: "prompt is too long: N tokens >
    M maximum"); past the request's CPU bound: 400 request_too_costly; past the job's CPU budget:
    429 cpu_budget_exhausted, refused at admission afterwards. The CPU is the job's, worker included."""
    import json

    from rolloutd.endpoint.shapes import anthropic as aw
    from rolloutd.endpoint.wire import EndpointError

    async def go():
        s = session(qwen_tokenizer, max_context=131072)
        big = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * (1 << 20)}]}
        with pytest.raises(EndpointError) as e:
            await s.serve_wire(json.dumps(big).encode(), aw.parse)
        assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
        body = json.loads(aw.error_body(e.value))
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("prompt is too long: ") and "> 131072 maximum" in body["error"]["message"]

        s = session(qwen_tokenizer, max_context=131072, max_request_cpu_s=1.0)
        one = {"model": "m", "messages": [{"role": "user", "content": "a" * (8 << 20)}]}
        with pytest.raises(EndpointError) as e:
            await s.chat(json.dumps(one).encode())
        assert (e.value.status, e.value.code) == (400, "request_too_costly"), e.value.message
        assert s.metrics["endpoint_cpu_s"] >= 1.0  # the worker's CPU, counted for the job

        s = session(qwen_tokenizer, max_context=131072, max_cpu_s=1.0)
        with pytest.raises(EndpointError) as e:
            await s.chat(json.dumps(one).encode())
        assert (e.value.status, e.value.code) == (429, "cpu_budget_exhausted"), e.value.message
        with pytest.raises(EndpointError) as e:  # then at admission, before any work
            await s.chat({"messages": [{"role": "user", "content": "hi"}]})
        assert (e.value.status, e.value.code) == (429, "cpu_budget_exhausted")

    arun(go(), timeout=300)


def test_an_idle_worker_exits_and_a_new_one_serves_the_next_text(qwen_tokenizer):
    """Workers hold their tokenizers (~330 MB for Qwen2.5): unused for ``idle_s`` they exit."""
    import time

    p = ew.EncodePool(size=1, idle_s=1.0)
    b = qwen_tokenizer.backend_tokenizer
    text = "hello world\n" * 10000
    ref = b.encode(text, add_special_tokens=False).ids
    try:
        assert p.encode(b, "q", text).tolist() == ref
        w = p._idle.queue[0]
        deadline = time.monotonic() + 60
        while w.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert w.proc.poll() is not None  # ended (and reaped: close() waits for it)
        assert p.encode(b, "q", text).tolist() == ref
    finally:
        p.close()
