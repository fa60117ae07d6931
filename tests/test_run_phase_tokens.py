"""The run phase's token bookkeeping: a failed job keeps what it sampled (issue 13 item 12), and
tokenizers load off the event loop, once per daemon, configured ones at start (item 13)."""
from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
from rolloutd.backends.policies import Policy

TOOL_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


class FirstTurnThen400(Policy):
    """Answers the first request with ``text`` and makes the backend answer the next one 400."""

    name = "first_turn_then_400"

    def __init__(self, text: str):
        super().__init__()
        self.text = text
        self.backend = None
        self.replies = []

    def reply(self, request):
        if not self.replies:
            self.backend.inject("400")
        self.replies.append(self.text)
        return self.text


@pytest.fixture
def backend_400(tokenizer, scripted):
    def make(text: str):
        policy = FirstTurnThen400(text)
        policy.backend = scripted(tokenizer, policy, latency=0.0)  # before any request: the test sends them
        return policy.backend

    return make


@pytest.mark.parametrize("handler", ["dialogue", "math"])
def test_a_400_on_turn_two_keeps_turn_one_tokens(up_factory, backend_400, tokenizer, tiny_tokenizer_dir, handler):
    # dialogue: a scripted follow-up makes turn 2; math (ToolAgentHandler, its python tool off):
    # the tool call of turn 1 gets an error observation and the loop asks for turn 2.
    text = "first answer" if handler == "dialogue" else TOOL_CALL
    b = backend_400(text)
    up = up_factory(f"handlers.{handler}.tokenizer={tiny_tokenizer_dir}", "handlers.math.python=false")
    instance = ({"messages": [{"role": "user", "content": "hello"}], "user_turns": ["and then?"]}
                if handler == "dialogue" else {"dataset": "basic_arithmetic", "seed": 5, "index": 0})
    with up.client() as c:
        c.add_backend(b.url)
        [r] = c.gather(c.submit([{"handler": handler, "instance": instance}]), timeout_s=60)
    assert r["status"] == "failed" and r["failed_phase"] == "run", r["error"]
    assert r["error"]["type"] == "RequestError" and "injected bad request" in r["error"]["message"]
    # Turn 1 as sampled: its ids are the backend's reply (text + end of turn), mask 1, logprobs kept.
    [turn] = r["turns"]
    s, e = turn["span"]
    sampled = tokenizer.encode(text, add_special_tokens=False)
    resp = np.asarray(r["response_ids"])
    assert resp[s:e].tolist()[:len(sampled)] == sampled and e - s == len(sampled) + 1
    assert len(r["prompt_ids"]) > 0 and len(resp) == len(r["loss_mask"]) == len(r["logprobs"]) >= e
    assert np.all(np.asarray(r["loss_mask"])[s:e] == 1) and np.all(np.asarray(r["logprobs"])[s:e] < 0)
    assert turn["backend"] == b.url and r["policy_version"] == 0
    assert b.stats["requests"] == 2 and b.stats["injected_400"] == 1 and r["attempts"] == 1


def test_shared_tokenizer_loads_once_off_the_event_loop(tiny_tokenizer_dir, tmp_path):
    from rolloutd.llm.tokenizer_utils import shared_tokenizer, shared_tokenizer_async

    path = shutil.copytree(tiny_tokenizer_dir, tmp_path / "tok")  # a path this process never loaded

    async def main():
        ticks = 0
        loaded = []

        async def ticker():
            nonlocal ticks
            while not loaded:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = ticks
        toks = await asyncio.gather(*(shared_tokenizer_async(path) for _ in range(8)))
        during = ticks - before
        loaded.append(True)
        await t
        return toks, during

    toks, during = asyncio.run(main())
    assert all(t is toks[0] for t in toks)  # one load shared by every caller
    assert during > 1  # the loop kept running while the tokenizer loaded
    assert shared_tokenizer(path) is toks[0]
    with pytest.raises(OSError):
        asyncio.run(shared_tokenizer_async(tmp_path / "missing"))


def test_run_daemon_preloads_configured_tokenizers_and_loads_others_once(up_factory, backends,
                                                                        tiny_tokenizer_dir, tmp_path):
    configured = shutil.copytree(tiny_tokenizer_dir, tmp_path / "configured")
    per_instance = shutil.copytree(tiny_tokenizer_dir, tmp_path / "per_instance")
    up = up_factory(f"handlers.dialogue.tokenizer={configured}")
    b = backends()
    task = {"handler": "dialogue", "instance": {"messages": [{"role": "user", "content": "hi"}],
                                                 "tokenizer": str(per_instance)}}
    with up.client() as c:
        c.add_backend(b.url)
        results = list(c.gather(c.submit([task] * 8), timeout_s=60))
    assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
    loads = up.logged("tokenizer_loaded")
    assert len(loads) == 2, loads  # each once, for 8 jobs (the other daemons never load one)
    by_path = {rec["path"]: rec for rec in loads}
    assert by_path[str(configured)]["why"] == "preload"
    assert by_path[str(per_instance)]["why"] == "first use"
    assert by_path[str(per_instance)]["thread"] == "tokenizer-load"  # not the event loop's thread
    # The configured one was loaded before the run daemon started serving.
    events = [json.loads(ln) for ln in up.log().splitlines() if ln.startswith("{")]
    preload = next(i for i, e in enumerate(events) if e.get("why") == "preload")
    started = next(i for i, e in enumerate(events) if e.get("event") == "daemon_started" and e.get("daemon") == "run")
    assert preload < started


def test_two_tokenizers_loading_at_once_in_a_fresh_process(tiny_tokenizer_dir, tmp_path):
    """transformers' lazy imports are not thread-safe: two first loads in parallel threads of a
    fresh process can fail with "cannot import name 'AutoTokenizer'". Preloading several
    configured tokenizers must not hit that."""
    import subprocess
    import sys

    a = shutil.copytree(tiny_tokenizer_dir, tmp_path / "a")
    b = shutil.copytree(tiny_tokenizer_dir, tmp_path / "b")
    code = ("import sys\n"
            "from rolloutd.llm.tokenizer_utils import preload_tokenizers\n"
            "futs = preload_tokenizers(sys.argv[1:])\n"
            "print(len({id(f.result()) for f in futs}))\n")
    for _ in range(3):  # a fresh interpreter each time: the race is on the first import
        out = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "2", out.stdout  # two distinct tokenizers loaded
