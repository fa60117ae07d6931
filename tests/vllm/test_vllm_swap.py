"""A checkpoint swap under ``stale_policy = "continue"`` against the real vLLM (issue 36).

Jobs generate on version 0; version 1 is registered mid-generation. Each call in flight is
aborted the only way vLLM's ``/v1/completions`` can be (the run daemon closes the stream), its
tokens so far are kept as an ``abort`` turn at version 0, and the same call continues at
version 1 from exactly prompt + those tokens.

Two versions, one engine: version 1 is the same vLLM server registered under a second address
(``http://127.0.0.1:P/`` beside ``http://127.0.0.1:P``). Why not two engines or a weight reload:
on these 2 cores a second engine costs another ~1-2 minutes of start and halves the decode speed
of both, and rolloutd never sees weights, only addresses, versions, aborts and prompts, which
this exercises for real. What a second set of weights would add (each version's tokens scored by
its own weights) is checked here by one set: every kept token's logprob equals vLLM's own
recomputation (``prompt_logprobs`` over prompt + response), which holds only if each
continuation was asked for exactly the prompt plus every token before it.
"""
from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

# Long enough that every job is mid-generation at the swap (hundreds of tokens/s each when the
# machine is quiet; 300 was not: in one CI run the first job had sampled all 300 before the third
# one started; 1024 was not either once, with the daemons just started and starved), and
# ignore_eos: the random tiny model samples EOS now and then (a job that ended before the swap
# failed this test in two full runs: its sampler state depends on the requests before it).
# 2048 was not on a quiet machine (vLLM at ~775 tokens/s: the three jobs, started seconds apart,
# did not overlap at all, or one started after the swap): nearly the whole window (4,096).
MAX_TOKENS = 4000
JOBS = 3
PROMPT_LEN = 16
# vLLM's /metrics renders every histogram in its API server, on the two cores the engine and the
# daemons share: polled at wait_for's 20 Hz it took CPU from what the waits wait for.
POLL_S = 0.5


def metrics(url: str) -> dict[str, float]:
    from rolloutd.llm.client import parse_prometheus

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    out = parse_prometheus(text)
    out.update(parse_prometheus(text, {"vllm:generation_tokens_total": "generated"}))
    return out


def recomputed_logprobs(vllm, ids: list[int]) -> list[float]:
    """vLLM's logprob of each token of ``ids`` given the ones before it (index 0: None)."""
    body = {"model": vllm.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    r = httpx.post(vllm.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:500]
    plp = r.json()["choices"][0]["prompt_logprobs"]
    return [None] + [d[str(t)]["logprob"] for d, t in zip(plp[1:], ids[1:])]


def test_continue_across_a_swap_with_vllms_real_abort(up_factory, vllm_server):
    v0, v1 = vllm_server.url, vllm_server.url + "/"
    up = up_factory("router.max_policy_lag=0", "router.stale_policy=continue")
    with up.client() as c:
        c.add_backend(v0, api="vllm", policy_version=0)
        # One short job through first: the daemons just started (imports, tokenizer, connection
        # pool) and, with vLLM on both cores, their loops ran 3-7 s late in a CI run, which
        # staggered the three jobs until none overlapped. Warm, they start together.
        warm = c.submit([{"handler": "synthetic_llm", "instance_id": "warm",
                          "instance": {"seed": 99, "llm_calls": 1, "max_tokens": 4, "prompt_len": PROMPT_LEN}}])
        assert [r["status"] for r in c.gather(warm, timeout_s=120)] == ["ok"]
        before = metrics(v0)
        ids = c.submit([{"handler": "synthetic_llm", "instance_id": f"s{i}",
                         "instance": {"seed": i, "llm_calls": 1, "max_tokens": MAX_TOKENS, "prompt_len": PROMPT_LEN,
                                      "ignore_eos": True}}
                        for i in range(JOBS)])
        try:
            wait_for(lambda: metrics(v0)["num_requests_running"] >= JOBS, timeout_s=180,
                     what="every job generating on version 0", interval_s=POLL_S)
        except AssertionError as e:  # say where the jobs were (it failed once in a loaded CI run)
            raise AssertionError(f"{e}; backends {c.list_backends()}; status {c.status()['totals']}; "
                                 f"log tail {up.log()[-3000:]}") from None
        # Every job has sampled tokens on version 0 before the swap: all are in vLLM's batch, so
        # each decode step gives each one token. (A fixed 0.5 s was not enough once in a loaded
        # CI run: one job's version-0 part was empty and its whole reply came from version 1.)
        start = metrics(v0)["generated"]
        try:
            wait_for(lambda: metrics(v0)["generated"] - start >= JOBS * 64, timeout_s=120,
                     what="tokens sampled on version 0", interval_s=POLL_S)
        except AssertionError as e:  # failed once in CI (2a00e1c): say what vLLM and the jobs were doing
            m = metrics(v0)
            raise AssertionError(f"{e}; generated {start} -> {m.get('generated')}, running "
                                 f"{m.get('num_requests_running')}, waiting {m.get('num_requests_waiting')}; "
                                 f"backends {c.list_backends()}; status {c.status()['totals']}; "
                                 f"log tail {up.log()[-3000:]}") from None
        c.add_backend(v1, api="vllm", policy_version=1)
        # The aborts reached the engine: once every job continues on version 1, vLLM runs those
        # continuations and nothing else. An abort it missed would sample its version-0 call on
        # to MAX_TOKENS beside the continuation (seconds at these speeds).
        wait_for(lambda: [b["inflight"] for b in c.list_backends()["backends"] if b["address"] == v1] == [JOBS],
                 timeout_s=120, what="every job leasing version 1")
        mark = metrics(v0)["generated"]
        wait_for(lambda: metrics(v0)["generated"] - mark >= JOBS * 32, timeout_s=120, what="the continuations sampling",
                 interval_s=POLL_S)
        running = []
        for _ in range(10):
            running.append(metrics(v0)["num_requests_running"])
            time.sleep(0.1)
        results = list(c.gather(ids, timeout_s=240))
        log = up.log()
    after = metrics(v0)
    assert [r["status"] for r in results] == ["ok"] * JOBS, ([r["error"] for r in results], log[-8000:])
    recorded = 0
    for r in results:
        turns = r["turns"]
        resp = [int(x) for x in r["response_ids"]]
        recorded += len(resp)
        assert [t["policy_version"] for t in turns] == sorted(t["policy_version"] for t in turns)
        assert turns[0]["policy_version"] == 0 and turns[-1]["policy_version"] == 1, turns
        cut = [i for i, t in enumerate(turns) if t["finish_reason"] == "abort"]
        assert len(cut) == 1, turns  # every job was generating at the swap: aborted once
        a, b = turns[cut[0]], turns[cut[0] + 1]
        assert (a["policy_version"], a["backend"]) == (0, v0) and a["end"] > a["start"], turns  # v0's tokens kept
        assert (b["policy_version"], b["backend"], b["continuation"]) == (1, v1, True), turns
        assert b["end"] - a["start"] <= MAX_TOKENS  # one call's budget across the abort
        # every token's logprob is vLLM's own for prompt + every token before it
        ids = list(range(1, 1 + PROMPT_LEN)) + resp
        want = recomputed_logprobs(vllm_server, ids)[PROMPT_LEN:]
        got = [float(x) for x in r["logprobs"]]
        worst = max(abs(g - w) for g, w in zip(got, want))
        assert len(got) == len(want) and worst < 1e-3, worst
    assert max(running) <= JOBS, running  # no version-0 call sampled on beside the continuations
    # Every recorded token was sampled by vLLM. It may have sampled more: what the run daemon had
    # not read when it closed the stream. Not bounded here: on a loaded machine the daemon reads
    # seconds late while vLLM samples ahead into the socket's buffers. (A bound of JOBS * 64 failed
    # one CI run at 3,283, which could not tell a late reader from a missed abort: `running` can.)
    extra = after["generated"] - before["generated"] - recorded
    assert extra >= 0, (after["generated"] - before["generated"], recorded)
    assert after["num_requests_running"] == 0
