"""The stand-ins speak what the real vLLM speaks: the same ``/v1/completions`` requests to the
session's vLLM, to serve-hf on the same weights and to the scripted backend.

Every server: the same reply keys, the same 400 bodies (message, type, param, code) for the
context and ``max_tokens`` errors, ``max_tokens`` clamped at the context edge, and the stop rules
(``stop_token_ids``: the stop token kept in the ids, not in the text; ``stop`` strings: the ids up
to the token that completes one, the text before it, ``stop_reason`` the string), each checked on
the server's own greedy output. serve-hf on the same weights must also sample vLLM's greedy ids,
text and logprobs (within ``LOGPROB_TOL``).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

LOGPROB_TOL = 1e-4


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def brief(r: dict) -> dict:
    """A reply for an assertion message, without the echoed prompt."""
    return {k: ([{**c, "prompt_token_ids": "..."} for c in v] if k == "choices" else v) for k, v in r.items()}


def keys(obj, path="") -> set[str]:
    """Every key path of a JSON reply (lists: their first element; top_logprobs' keys are tokens)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(path + "." + k)
            if k != "top_logprobs":
                out |= keys(v, path + "." + k)
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        out |= keys(obj[0], path + "[]")
    return out


@pytest.fixture(scope="module")
def tok(vllm_server):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(vllm_server.model_dir)


@pytest.fixture(scope="module")
def servers(vllm_server):
    """name -> base URL: vLLM, serve-hf (same model dir and context) and the scripted backend."""
    from rolloutd.backends.scripted import ScriptedBackend
    from rolloutd.backends.serve_hf import HFServer

    hf = HFServer(vllm_server.model_dir, max_model_len=vllm_server.max_model_len, threads=1)
    hf.start()
    sc = ScriptedBackend(vllm_server.model_dir, "constant:text=hello world the answer is 42 and that is all I know about it",
                         max_model_len=vllm_server.max_model_len, model=vllm_server.model)
    sc.start()
    try:
        yield {"vllm": vllm_server.url, "serve-hf": hf.url, "scripted": sc.url}
    finally:
        hf.stop()
        sc.stop()


def cases(model: str, prompt: list[int], greedy: list[int], tok, L: int) -> dict[str, dict]:
    """The requests, built from one server's own greedy output ``greedy`` on ``prompt``."""
    base = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    out = {"plain": base,
           "stop_ids": dict(base, stop_token_ids=[greedy[2]]),
           "edge": dict(base, prompt=(prompt * L)[:L - 3], max_tokens=10),
           "full": dict(base, prompt=(prompt * L)[:L]),
           "over": dict(base, prompt=(prompt * L)[:L + 2]),
           "zero": dict(base, max_tokens=0)}
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for k in range(1, len(greedy)):  # a character that first appears in token k
        new = dec(greedy[:k + 1])[len(dec(greedy[:k])):]
        c = next((ch for ch in new if ch not in dec(greedy[:k]) and ch != "\ufffd"), None)
        if c is not None:
            out["stop_str"] = dict(base, stop=[c])
            out["stop_str_incl"] = dict(base, stop=[c], include_stop_str_in_output=True)
            break
    return out


def replies(url: str, model: str, prompt: list[int], tok, L: int) -> tuple[list[int], dict]:
    status, plain = post(url, {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                               "return_token_ids": True})
    assert status == 200, plain
    greedy = plain["choices"][0]["token_ids"]
    return greedy, {name: post(url, body) for name, body in cases(model, prompt, greedy, tok, L).items()}


def check_rules(name: str, greedy: list[int], got: dict, tok, L: int) -> None:
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    st, r = got["stop_ids"]
    c = r["choices"][0]
    k = greedy.index(greedy[2])
    assert (st, c["token_ids"], c["finish_reason"], c["stop_reason"]) == (200, greedy[:k + 1], "stop", greedy[2]), name
    assert c["text"] == dec(greedy[:k]), (name, c["text"])
    st, r = got["edge"]
    c = r["choices"][0]
    assert (st, len(c["token_ids"]), c["finish_reason"]) == (200, 3, "length"), (name, brief(r))
    for case in ("stop_str", "stop_str_incl"):
        st, r = got[case]
        c = r["choices"][0]
        s = c["stop_reason"]
        ids = c["token_ids"]
        assert st == 200 and c["finish_reason"] == "stop" and isinstance(s, str), (name, case, brief(r))
        assert ids == greedy[:len(ids)] and s in dec(ids) and s not in dec(ids[:-1]), (name, case, ids)
        cut = dec(ids).index(s)
        assert c["text"] == dec(ids)[:cut + (len(s) if case == "stop_str_incl" else 0)], (name, case, c["text"])
    for case, param in (("full", "max_tokens"), ("over", "input_tokens"), ("zero", "max_tokens")):
        st, r = got[case]
        assert st == 400 and r["error"]["param"] == param and r["error"]["type"] == "BadRequestError", (name, case, r)


def test_stand_ins_answer_like_vllm(vllm_server, servers, tok):
    L = vllm_server.max_model_len
    prompt = tok.encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    ref_greedy, ref = replies(servers["vllm"], vllm_server.model, prompt, tok, L)
    check_rules("vllm", ref_greedy, ref, tok, L)  # the rules are vLLM's own behaviour
    for name in ("serve-hf", "scripted"):
        greedy, got = replies(servers[name], vllm_server.model, prompt, tok, L)
        check_rules(name, greedy, got, tok, L)
        for case, (st, r) in ref.items():
            gst, g = got[case]
            assert gst == st, (name, case, brief(g))
            if st != 200:
                assert g == r, (name, case, g, r)  # same request: the same body
                continue
            assert keys(g) == keys(r), (name, case, keys(g) ^ keys(r))
        if name == "serve-hf":  # same weights, greedy: the same tokens
            for case, (st, r) in ref.items():
                if st != 200:
                    continue
                a, b = r["choices"][0], got[case][1]["choices"][0]
                assert (b["token_ids"], b["text"], b["finish_reason"], b["stop_reason"]) == \
                    (a["token_ids"], a["text"], a["finish_reason"], a["stop_reason"]), (case, brief(r))
                diff = np.abs(np.asarray(a["logprobs"]["token_logprobs"]) - np.asarray(b["logprobs"]["token_logprobs"]))
                assert diff.max() <= LOGPROB_TOL, (case, diff.max())
