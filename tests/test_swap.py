"""Checkpoint swaps against real daemons and several real (scripted vLLM/SGLang-API) servers:
routing by version, each stale_policy, the re-queue bound, a rolling swap and per-token versions
(issue 27). Each server answers its own text, so a token's server (hence version) is checkable."""
from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for

PER_TOKEN = 0.04  # s per sampled token: a 48-token call takes ~2 s, a swap lands inside it
MAX_TOKENS = 48


@pytest.fixture
def servers(tokenizer):
    from rolloutd.backends.policies import get_policy
    from rolloutd.backends.scripted import ScriptedBackend

    made = []

    def make(word: str, per_token: float = PER_TOKEN):
        constant = get_policy("constant", text=f"{word} " * 80)

        class Recording(type(constant)):  # the prompts it was asked to continue
            def reply(self, request):
                b.prompts.append(list(request.prompt_ids))
                return constant.reply(request)

        b = ScriptedBackend(tokenizer, policy=Recording(**constant.options), latency=f"constant:0.02,{per_token}")
        b.prompts = []
        b.start()
        b.word_ids = set(tokenizer.encode(f"{word} " * 80, add_special_tokens=False))
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


def job(i, calls=3, max_tokens=MAX_TOKENS):
    return {"handler": "synthetic_llm", "instance_id": f"s{i}",
            "instance": {"seed": i, "llm_calls": calls, "max_tokens": max_tokens}}


def versions(r):
    return [t["policy_version"] for t in r["turns"]]


def spans(r):
    """(start, end, version, backend) per turn: the per-span versions a trainer reads."""
    return [(t["start"], t["end"], t["policy_version"], t["backend"]) for t in r["turns"]]


@pytest.mark.parametrize("policy", ["finish", "abort_requeue", "drop", "continue"])
def test_with_two_versions_registered_new_jobs_run_only_on_the_newest(up_factory, servers, policy):
    """v0 stays registered beside v1 (a rolling swap's middle, or one server per version). Before
    issue 27 the router spread new jobs over both: finish ran half on v0, drop failed them,
    abort_requeue re-dispatched them hundreds of times."""
    up = up_factory("router.max_policy_lag=0", f"router.stale_policy={policy}")
    old, new = servers("old"), servers("new")
    with up.client() as c:
        c.add_backend(old.url, policy_version=0)
        c.add_backend(new.url, policy_version=1)
        wait_for(lambda: all(b["healthy"] for b in c.list_backends()["backends"]), what="both admitted")
        ids = c.submit([job(i, calls=2, max_tokens=4) for i in range(16)])
        results = list(c.gather(ids, timeout_s=120))
    assert [r["status"] for r in results] == ["ok"] * 16, [(r["status"], r["error"]) for r in results]
    assert all(r["attempts"] == 1 for r in results), [r["attempts"] for r in results]
    assert all(set(versions(r)) == {1} for r in results), [versions(r) for r in results]
    assert old.stats["requests"] == 0


def _start_on_v0(c, old, n=6, api="sglang", calls=2):
    c.add_backend(old.url, api=api, policy_version=0)
    ids = c.submit([job(i, calls=calls) for i in range(n)])
    wait_for(lambda: c.list_backends()["leases"] >= n and old.num_running >= n,
             what="every job generating on version 0")
    time.sleep(0.3)  # not a timing assertion: lets some tokens be sampled before the swap
    return ids


@pytest.mark.parametrize("policy", ["finish", "abort_requeue", "drop"])
def test_swap_mid_generation_under_each_policy(up_factory, servers, policy):
    up = up_factory("router.max_policy_lag=0", f"router.stale_policy={policy}")
    old, new = servers("old"), servers("new")
    with up.client() as c:
        ids = _start_on_v0(c, old)
        c.add_backend(new.url, api="sglang", policy_version=1)  # v0 is not cleared
        late = c.submit([job(100 + i, calls=1) for i in range(3)])
        results = {r["job_id"]: r for r in c.gather(ids + late, timeout_s=120)}
    for j in late:
        assert results[j]["status"] == "ok" and set(versions(results[j])) == {1}
    early = [results[j] for j in ids]
    if policy == "finish":  # runs to the end on its v0 lease; the trainer sees the versions
        assert all(r["status"] == "ok" and set(versions(r)) == {0} and r["attempts"] == 1 for r in early)
    elif policy == "abort_requeue":  # re-run from scratch on v1, one counted attempt more
        assert all(r["status"] == "ok" and set(versions(r)) == {1} for r in early), [versions(r) for r in early]
        assert all(r["attempts"] == 2 for r in early), [r["attempts"] for r in early]
    else:
        assert all(r["status"] == "failed" and r["stale"] and r["error"]["type"] == "StalePolicy" for r in early)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_continue_moves_generations_in_flight_to_the_new_version_keeping_their_tokens(up_factory, servers, tokenizer,
                                                                                      api):
    """stale_policy=continue: each generation in flight on v0 at the swap is aborted and continued
    on v1 within the same call; every token carries the version (and server) that sampled it, and
    the tokens sampled on v0 before the swap are kept: SGLang returns them from /abort_request; vLLM
    has no abort by id (closing the connection is its abort, and returns nothing), so under continue
    the call streams and the tokens that arrived before the interrupt are the aborted turn. The v1
    server is asked to continue exactly prompt + the response so far. (Before the vLLM call
    streamed, the aborted vLLM turns were empty and their tokens sampled again.)"""
    up = up_factory("router.max_policy_lag=0", "router.stale_policy=continue")
    old, new = servers("old"), servers("new")
    with up.client() as c:
        ids = _start_on_v0(c, old, api=api)
        c.add_backend(new.url, api=api, policy_version=1)
        results = list(c.gather(ids, timeout_s=120))
        wait_for(lambda: c.list_backends()["leases"] == 0, what="every lease released")
    assert [r["status"] for r in results] == ["ok"] * len(ids), [r["error"] for r in results]
    assert all(r["attempts"] == 1 for r in results)
    kept, moved = 0, 0
    for r in results:
        v = versions(r)
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v), v  # started on v0, finished on v1, never back
        turns = r["turns"]
        ids_ = [int(x) for x in r["response_ids"]]
        assert turns[-1]["end"] == len(ids_) == len(r["logprobs"])
        for start, end, version, backend in spans(r):  # per-token versions are exact
            assert backend == (old.url if version == 0 else new.url)
            sampled_by = old if version == 0 else new
            assert set(ids_[start:end]) <= sampled_by.word_ids | {old.eos_token_id}, (version, ids_[start:end])
        cut = [i for i, t in enumerate(turns) if t["finish_reason"] == "abort"]
        assert len(cut) <= 1, turns  # aborted once; none if its call ended just before the swap
        if cut:
            moved += 1
            a, b = turns[cut[0]], turns[cut[0] + 1]
            assert a["policy_version"] == 0, turns
            if cut[0] == 0:  # the first call ran >= 0.3 s on v0 before the swap: its tokens are kept
                assert a["end"] > a["start"], turns
            assert b["continuation"] and b["policy_version"] == 1
            kept += a["end"] - a["start"]
            # prompt-consistent: v1 continued exactly the prompt plus every token before its turn
            assert [int(x) for x in r["prompt_ids"]] + ids_[:b["start"]] in new.prompts, (b, len(new.prompts))
            assert b["end"] - a["start"] <= MAX_TOKENS  # one call's budget across the abort
    assert moved >= len(ids) // 2, moved  # all of them were generating a moment before the swap
    assert kept >= moved, kept  # a few tokens each at least
    if api == "sglang":
        assert old.stats["aborted"] == moved, old.stats  # partial generations kept, not re-sampled
    else:
        assert old.stats["disconnects"] >= moved, old.stats  # vLLM's abort: the stream closed


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_continue_works_for_the_built_in_agent_loop(up_factory, servers, tiny_tokenizer_dir, api):
    """The math handler (no sandbox) runs run_agent_loop: the aborted assistant message is continued
    as a `continuation` turn on v1, one assistant message in all, keeping the tokens sampled on v0."""
    up = up_factory("router.max_policy_lag=0", "router.stale_policy=continue", "handlers.math.python=false")
    old, new = servers("old"), servers("new")
    task = {"handler": "math", "instance_id": "m0",
            "instance": {"question": "1+1?", "answer": "2", "tokenizer": str(tiny_tokenizer_dir),
                         "sampling": {"max_tokens": MAX_TOKENS}}}
    with up.client() as c:
        c.add_backend(old.url, api=api, policy_version=0)
        ids = c.submit([dict(task, instance_id=f"m{i}") for i in range(3)])
        wait_for(lambda: old.num_running >= 3, what="generating on version 0")
        time.sleep(0.3)  # not a timing assertion: lets some tokens be sampled before the swap
        c.add_backend(new.url, api=api, policy_version=1)
        results = list(c.gather(ids, timeout_s=120))
    for r in results:
        assert r["status"] == "ok", r["error"]
        assert [(t["policy_version"], t["finish_reason"], t["continuation"]) for t in r["turns"]][:2] == [
            (0, "abort", False), (1, r["turns"][1]["finish_reason"], True)], r["turns"]
        assert r["metrics"]["turns"] == 1 and r["metrics"]["aborts"] == 1
        assert r["turns"][0]["end"] > r["turns"][0]["start"], r["turns"]  # v0's tokens kept


def test_stale_requeues_count_against_max_attempts(up_factory, servers):
    """abort_requeue with a swap during every attempt: the third stale stop ends the job as failed,
    stale, AttemptsExhausted (before, stale re-runs were never counted: one job reached 217)."""
    up = up_factory("router.max_policy_lag=0", "router.stale_policy=abort_requeue", "gateway.max_attempts=3")
    s = [servers(f"v{k}") for k in range(4)]
    with up.client() as c:
        c.add_backend(s[0].url, api="sglang", policy_version=0)
        ids = c.submit([job(i, calls=6) for i in range(3)])
        for k in range(1, 4):
            wait_for(lambda: s[k - 1].num_running >= 3, what=f"every job generating on version {k - 1}")
            c.add_backend(s[k].url, api="sglang", policy_version=k)
        results = list(c.gather(ids, timeout_s=120))
    for r in results:
        assert (r["status"], r["stale"], r["error"]["type"], r["attempts"]) == (
            "failed", True, "AttemptsExhausted", 3), (r["status"], r["attempts"], r["error"])
    assert s[3].stats["requests"] == 0


@pytest.mark.parametrize("policy", ["finish", "continue"])
def test_rolling_swap_server_by_server(up_factory, servers, policy):
    """Three servers reload to v1 one by one (re-registered at the same address). With lag 0, from
    the first reload on a new job goes only to reloaded servers; a job on a reloaded server records
    its later turns at v1; under continue, a job on a not-yet-reloaded one moves to a reloaded one."""
    up = up_factory("router.max_policy_lag=0", f"router.stale_policy={policy}")
    s = [servers(f"w{k}") for k in range(3)]
    with up.client() as c:
        for b in s:
            c.add_backend(b.url, api="sglang", policy_version=0)
        first = c.submit([job(i, calls=4) for i in range(6)])
        wait_for(lambda: sum(b.num_running for b in s) >= 6, what="jobs generating on all three")
        later = []
        for b in s:
            c.add_backend(b.url, api="sglang", policy_version=1)  # this server reloaded in place
            wait_for(lambda: c.list_backends()["backends"][s.index(b)]["healthy"], what="reloaded server admitted")
            later += c.submit([job(100 + len(later) + i, calls=1, max_tokens=4) for i in range(2)])
        results = {r["job_id"]: r for r in c.gather(first + later, timeout_s=120)}
    assert all(r["status"] == "ok" and r["attempts"] == 1 for r in results.values()), (
        [(r["instance_id"], r["status"], r["attempts"], r["error"]) for r in results.values()],
        [e for e in up.logged("job_redispatched")])
    for j in later:  # submitted after a reload: only ever on v1
        assert set(versions(results[j])) == {1}, versions(results[j])
    for j in first:
        v = versions(results[j])
        assert v == sorted(v), v
        if policy == "continue":
            assert v[-1] == 1, v
    if policy == "continue":  # a job on the server reloaded first is current, never interrupted
        assert s[0].stats["aborted"] == 0 and s[1].stats["aborted"] + s[2].stats["aborted"] >= 1, [b.stats for b in s]
