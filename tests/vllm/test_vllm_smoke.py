"""The session's real vLLM serves the tiny model token-in/token-out, and rolloutd's client reads it."""
from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # vLLM's ipc socket names


def test_vllm_serves_the_tiny_model_through_the_client(vllm_server):
    from rolloutd.llm.client import LLMClient, SamplingParams
    from rolloutd.llm.conversation import Conversation
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    assert vllm_server.url.startswith("http://127.0.0.1:") and vllm_server.version
    tok = load_tokenizer(vllm_server.model_dir)
    conv = Conversation(tok, [{"role": "user", "content": "What is 12 times 7?"}], max_context=4096)

    async def go():
        async with LLMClient(vllm_server.url, "vllm") as c:
            assert await c.health()
            assert await c.models() == [vllm_server.model]
            return await c.generate(conv.context_ids, SamplingParams(max_tokens=8, seed=1))

    g = asyncio.run(go())
    assert 1 <= len(g.token_ids) <= 8 and g.finish_reason in ("stop", "length")
    assert len(g.logprobs) == len(g.token_ids) and np.all(g.logprobs <= 0) and np.all(np.isfinite(g.logprobs))
    assert int(g.token_ids.max()) < len(tok)
    assert g.prompt_tokens == len(conv.context_ids)


def test_prompts_that_fill_or_pass_the_context_are_context_overflow(vllm_server):
    """vLLM 0.32 clamps max_tokens to the room left: a prompt of exactly max-model-len tokens gets
    "max_tokens must be at least 1, got 0" (400), a longer one "...maximum context length..." (400).
    Both are ContextOverflow (the first was a RequestError before)."""
    from rolloutd.llm.client import ContextOverflow, LLMClient, SamplingParams

    L = vllm_server.max_model_len

    async def go(n):
        async with LLMClient(vllm_server.url, "vllm") as c:
            try:
                await c.generate([5] * n, SamplingParams(max_tokens=4))
            except ContextOverflow as e:
                return str(e)
            return None

    assert "max_tokens must be at least 1" in (asyncio.run(go(L)) or "")
    assert "maximum context length" in (asyncio.run(go(L + 3)) or "")


def test_ignore_eos_samples_past_eos_to_max_tokens(vllm_server):
    """``SamplingParams.ignore_eos`` reaches vLLM: seeded calls that end at EOS without it run on
    to ``max_tokens`` with it, sampling the same ids up to and including that EOS (the swap test's
    jobs must all still be generating at the swap; a random model samples EOS now and then)."""
    from rolloutd.llm.client import LLMClient, SamplingParams

    n = 300

    async def go(ignore_eos):
        async with LLMClient(vllm_server.url, "vllm") as c:
            return [await c.generate(list(range(1, 17)), SamplingParams(max_tokens=n, seed=s, ignore_eos=ignore_eos))
                    for s in range(8)]

    plain, ignoring = asyncio.run(go(False)), asyncio.run(go(True))
    stopped = [i for i, g in enumerate(plain) if g.finish_reason == "stop"]
    assert stopped, [g.finish_reason for g in plain]  # the seeds are chosen so that some calls hit EOS
    for p, g in zip(plain, ignoring):
        assert g.finish_reason == "length" and len(g.token_ids) == n
        assert list(g.token_ids[:len(p.token_ids)]) == list(p.token_ids)  # same seed: same ids up to the EOS


def test_the_servers_scratch_files_live_in_its_own_tmpdir(vllm_server):
    """vLLM names its ipc sockets and dist-init files after the temp dir and never removes them:
    the server's TMPDIR is a dir of its own (removed by stop()), so nothing of it lands in /tmp."""
    import tempfile
    from pathlib import Path

    scratch = vllm_server.server.scratch
    assert scratch is not None and scratch.parent == Path(tempfile.gettempdir())
    made = [p.name for p in scratch.iterdir() if p.name.startswith("vllm_dist_") or UUID.fullmatch(p.name)]
    assert made, sorted(p.name for p in scratch.iterdir())  # vLLM made them there
    assert not [n for n in made if (scratch.parent / n).exists()]


def test_the_server_runs_on_the_cpus_beside_the_daemons(vllm_server):
    """Every thread of the server's process group (API server, engine core, worker, OpenMP) is
    pinned to ``cpus_beside_daemons()``: the first CPU is left to the daemons under test, which the
    unpinned engine kept off the CPU for seconds (docs/LLM.md, "A real vLLM")."""
    import os

    from rolloutd.backends.vllm_cpu import cpus_beside_daemons

    srv = vllm_server.server
    want = cpus_beside_daemons()
    assert srv.cpus == want
    expected = set(want) if want else set(os.sched_getaffinity(0))  # one CPU: nothing to leave
    masks = {}
    for tid in srv.tasks():
        try:
            masks[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
    assert len(masks) > 2, masks  # the API server's and the engine's threads at least
    assert {t: m for t, m in masks.items() if m != expected} == {}


def test_a_server_pinned_to_no_cpu_is_refused(tmp_path):
    import glob
    import tempfile

    from rolloutd.backends.vllm_cpu import VLLMServer, main

    logs = set(glob.glob(f"{tempfile.gettempdir()}/rd-vllm-*.log"))
    with pytest.raises(ValueError, match="at least one CPU"):
        VLLMServer(tmp_path, tmp_path, cpus=[])
    assert set(glob.glob(f"{tempfile.gettempdir()}/rd-vllm-*.log")) == logs  # refused before making its log
    for bad in ("", "a,1", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(tmp_path), "--cpus", bad])
        assert e.value.code == 2
