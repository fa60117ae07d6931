"""The built-in agent loop against the session's real vLLM, through a real ``rolloutd up`` (real
daemons, bwrap sandboxes for code and swe): every domain, ids and logprobs checked against vLLM's
own recomputation, loss masks, stop strings and ``stop_token_ids``, the context edge and a prompt
longer than the context.

The model has random weights: it calls no tool, so the domain jobs are single turns (reward 0);
the ``dialogue`` handler's scripted user turns give multi-turn trajectories with observation tokens
(``loss_mask`` 0) between vLLM's turns. Recomputation: ``prompt_logprobs`` over prompt + response in
one request (``vllm_logprobs``); every ``loss_mask == 1`` logprob must equal it within
``LOGPROB_TOL`` (the recorded one comes from the decode step, the recomputed one from a prefill of
the whole sequence: float32 on the same weights, different kernels and batch shapes).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.domains.conftest import _domain_sets, domain_entry_points, need_bwrap, swe_built  # noqa: F401

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4  # measured: max 5.7e-6 over the 144 tokens here; 1.1e-5 over 2,463 (issue 36's trial)


@pytest.fixture(scope="module")
def vllm_up(module_up_factory, vllm_server, sandbox_root, need_bwrap):  # noqa: F811
    up = module_up_factory(*_domain_sets(vllm_server.model_dir, sandbox_root))
    with up.client() as c:
        c.add_backend(vllm_server.url)
    return up


@pytest.fixture(scope="module")
def tok(vllm_server):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(vllm_server.model_dir)


def gather(up, tasks, timeout_s=240):
    with up.client() as c:
        ids = c.submit(tasks)
        res = {r["job_id"]: r for r in c.gather(ids, timeout_s=timeout_s)}
    return [res[i] for i in ids]


def vllm_logprobs(srv, ids) -> np.ndarray:
    """vLLM's own logprob of each of ``ids`` given the ones before it (NaN for the first). A
    sequence that fills vLLM's whole context cannot be sent as a prompt (no room for the one token
    the request must ask for: 400): its last token stays NaN, unchecked."""
    ids = [int(x) for x in ids]
    sent = ids[:srv.max_model_len - 1]
    r = srv.server.post("/v1/completions", {"model": srv.model, "prompt": sent, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": 0})
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(sent) and pl[0] is None
    out = [np.nan] + [d[str(t)]["logprob"] for t, d in zip(sent[1:], pl[1:])]
    return np.asarray(out + [np.nan] * (len(ids) - len(sent)), dtype=np.float64)


def check_trajectory(r, srv, tok) -> dict:
    """Ids, loss mask and logprobs of one ok trajectory against vLLM; returns figures."""
    assert r["status"] == "ok", (r["instance_id"], r["failed_phase"], r["error"])
    prompt = np.asarray(r["prompt_ids"], dtype=np.int64)
    resp = np.asarray(r["response_ids"], dtype=np.int64)
    mask = np.asarray(r["loss_mask"], dtype=np.int8)
    lps = np.asarray(r["logprobs"], dtype=np.float64)
    n = len(resp)
    assert len(mask) == len(lps) == n and n > 0
    assert resp.min() >= 0 and resp.max() < len(tok)
    # the mask is 1 exactly on the turns' sampled spans, 0 on what was put between them
    want = np.zeros(n, dtype=np.int8)
    for t in r["turns"]:
        want[t["start"]:t["end"]] = 1
        assert t["backend"] == srv.url, t
        assert t["finish_reason"] in ("stop", "length", "context_overflow"), t
        sampled = resp[t["start"]:t["end"]].tolist()
        if t["finish_reason"] == "stop" and not r.get("stop_expected"):
            assert sampled[-1] == tok.convert_tokens_to_ids("<|im_end|>"), t
    assert np.array_equal(mask, want), (mask, want)
    assert np.all(lps[mask == 0] == 0.0)
    ref = vllm_logprobs(srv, np.concatenate([prompt, resp]))[len(prompt):]
    checked = (mask == 1) & np.isfinite(ref)
    assert checked.any() and checked.sum() >= mask.sum() - 1  # at most the context's last token unchecked
    diff = np.abs(ref[checked] - lps[checked])
    assert np.all(np.isfinite(lps[mask == 1])) and np.all(lps[mask == 1] <= 0)
    assert diff.max() <= LOGPROB_TOL, (r["instance_id"], float(diff.max()), int(diff.argmax()))
    return {"tokens": int(checked.sum()), "max_diff": float(diff.max())}


def test_every_domain_on_vllm_ids_masks_and_logprobs(vllm_up, vllm_server, tok, swe_built):  # noqa: F811
    from rolloutd.handlers.swe_tasks import task_ids

    swe = sorted(task_ids())
    lim = {"max_turns": 2, "sampling": {"max_tokens": 24, "seed": 11}}
    tasks = [
        {"handler": "math", "instance_id": "m0", "instance": dict({"dataset": "basic_arithmetic", "seed": 5, "index": 0}, **lim)},
        {"handler": "math", "instance_id": "q0", "instance": dict({"question": "What is 6 * 7?", "answer": "42"}, **lim)},
        {"handler": "code", "instance_id": "c0", "instance": dict({"task_id": "HumanEval/0"}, **lim)},
        {"handler": "swe", "instance_id": "s0", "instance": dict({"task_id": swe[0]}, **lim)},
        {"handler": "dialogue", "instance_id": "d0", "instance": {
            "messages": [{"role": "user", "content": "Tell me about the fox."}], "user_turns": ["and then?", "thanks"],
            "tokenizer": vllm_server.model_dir, "sampling": {"max_tokens": 16}}},
    ]
    results = gather(vllm_up, tasks)
    figures = {}
    for r in results:
        figures[r["instance_id"]] = check_trajectory(r, vllm_server, tok)
        assert r["reward"] == 0.0  # random weights solve nothing, and that is a reward, not a failure
    by = {r["instance_id"]: r for r in results}
    d0 = by["d0"]
    assert len(d0["turns"]) == 3 and (np.asarray(d0["loss_mask"]) == 0).sum() > 0  # user turns between
    for iid in ("m0", "q0", "c0", "s0"):
        assert by[iid]["metrics"]["stop_reason"] in ("no_tool_call", "length"), by[iid]["metrics"]
    print("recorded vs vLLM's recomputed logprobs:", figures)


def math_job(iid, question, **fields):
    return {"handler": "math", "instance_id": iid, "instance": dict({"question": question, "answer": "1"}, **fields)}


def test_stop_token_ids_and_stop_strings_end_the_turn(vllm_up, vllm_server, tok):
    """vLLM keeps the stop token, and the token that completes a stop string, in the ids (its text
    leaves them out); the loop records them as sampled, with their logprobs."""
    even = [i for i in range(len(tok)) if i % 2 == 0]
    stops = ["e", "a", "o", " "]
    rs = gather(vllm_up, [
        math_job("ids", "What is 6 * 7?", max_turns=1, sampling={"max_tokens": 24, "seed": 5, "stop_token_ids": even}),
        math_job("str", "What is 6 * 7?", max_turns=1, sampling={"max_tokens": 24, "seed": 5, "stop": stops}),
    ])
    for r in rs:
        r["stop_expected"] = True
        check_trajectory(r, vllm_server, tok)
        (turn,) = r["turns"]
        assert turn["finish_reason"] == "stop", turn
        assert r["metrics"]["stop_reason"] == "no_tool_call"
    ids = rs[0]["response_ids"]
    assert ids[-1] % 2 == 0 and all(t % 2 == 1 for t in ids[:-1]), ids
    ids = rs[1]["response_ids"]
    assert ids[-1] != tok.convert_tokens_to_ids("<|im_end|>"), "ended on EOS, not on a stop string: pick another seed"
    before, full = tok.decode(ids[:-1]), tok.decode(ids)
    assert not any(s in before for s in stops) and any(s in full for s in stops), (before, full)


def _question(n_filler: int) -> str:
    return "How many x are there?" + " x" * n_filler  # " x" is one token of the tiny BPE


def test_context_edges(vllm_up, vllm_server, tok):
    """Three edges. The loop's own (``max_context``): it asks for the room left and the turn ends
    ``context_overflow``. vLLM's (``--max-model-len`` below the handler's ``max_context``): vLLM 0.32
    clamps ``max_tokens`` to the room left and ends ``length`` with fewer tokens than asked (older
    vLLM answered 400). A prompt longer than vLLM's context: its 400 ends the rollout
    ``context_overflow`` with no turn (a result, not a failure)."""
    L = vllm_server.max_model_len
    (probe,) = gather(vllm_up, [math_job("probe", _question(100), max_turns=1, sampling={"max_tokens": 1})])
    base = len(probe["prompt_ids"]) - 100  # the prompt without filler
    near = L - 6 - base  # a prompt 6 tokens short of vLLM's context
    rs = gather(vllm_up, [
        math_job("own", _question(100), max_turns=1, max_context=base + 100 + 5, sampling={"max_tokens": 64, "seed": 3}),
        math_job("vllm", _question(near), max_turns=1, max_context=2 * L, sampling={"max_tokens": 64, "seed": 3}),
        math_job("over", _question(L), max_turns=1, max_context=4 * L, sampling={"max_tokens": 64, "seed": 3}),
    ])
    own, edge, over = rs
    for r in (own, edge):
        r["stop_expected"] = False
        check_trajectory(r, vllm_server, tok)
    assert len(own["response_ids"]) == 5 and own["turns"][0]["finish_reason"] == "context_overflow"
    assert own["metrics"]["stop_reason"] == "context_overflow"
    room = L - len(edge["prompt_ids"])  # ~6 (the filler's tokens are not exactly one each at every length)
    assert 0 < room < 32, room
    assert len(edge["response_ids"]) == room and edge["turns"][0]["finish_reason"] == "length", edge["turns"]
    assert over["status"] == "ok", over["error"]
    assert len(over["prompt_ids"]) > L and len(over["response_ids"]) == 0 and over["turns"] == []
    assert over["metrics"]["stop_reason"] == "context_overflow"
