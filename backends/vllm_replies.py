"""What vLLM answers on ``POST /v1/completions`` (and SGLang on ``/generate``), for the stand-ins
(scripted, serve-hf) to say alike.

Taken from the real server, vLLM 0.32.0 (CPU build), and checked against it by
``tests/vllm/test_vllm_stand_ins.py`` (the same requests to vLLM and to each stand-in):

* the reply's keys (``routed_experts`` per choice; ``ec_transfer_params`` and ``metrics`` at the
  top; ``completion_tokens_details`` in ``usage``);
* the context: a prompt longer than ``max_model_len`` is a 400 ("...your prompt contains N input
  tokens, which exceeds this limit even without any output tokens..."); otherwise ``max_tokens`` is
  clamped to the room left (a prompt of exactly ``max_model_len`` tokens then gets "max_tokens must
  be at least 1, got 0"); older vLLM (<= 0.11) answered 400 for prompt + max_tokens past the context;
* ``stop_token_ids``: the stop token ends the ids (kept), its text is not in ``text``;
* ``stop`` strings: the generation ends at the token whose text completes one (kept in the ids);
  ``text`` ends before the stop string (with ``include_stop_str_in_output``, after it);
  ``stop_reason`` is the string.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def error_body(message: str, param: str | None = None, etype: str = "BadRequestError", code: int = 400) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def _param_error(message: str, param: str, value: Any) -> dict:
    return error_body(f"{message} (parameter={param}, value={value})", param)


def models_body(model: str, root: str, max_model_len: int) -> dict:
    """vLLM's ``GET /v1/models``: the one model served, its path (``root``) and context window."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                                        "root": root, "parent": None, "max_model_len": max_model_len}]}


def model_info_body(path: str) -> dict:
    """SGLang's ``GET /get_model_info``: the model and tokenizer path."""
    return {"model_path": path, "tokenizer_path": path, "is_generation": True}


def context_max_tokens(n_prompt: int, max_tokens: int | None, max_model_len: int,
                       default: int | None = None) -> tuple[int, dict | None]:
    """vLLM 0.32's checks of prompt length and ``max_tokens``: (the max_tokens it samples with, None)
    or (0, the 400 body). ``default``: what an absent max_tokens means (vLLM: the room left)."""
    if n_prompt > max_model_len:
        return 0, _param_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{n_prompt} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            "the length of the input prompt.", "input_tokens", n_prompt)
    room = max_model_len - n_prompt
    want = max_tokens if max_tokens is not None else default
    n = room if want is None else min(int(want), room)
    if n < 1:
        return 0, _param_error(f"max_tokens must be at least 1, got {n}.", "max_tokens", n)
    return n, None


def first_stop_string(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the stop string that completes earliest in ``text`` (ties: list
    order), as vLLM's detokenizer picks it; None when none occurs."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
            best = (i, s)
    return best


def cut_at_stop_string(ids: list[int], decode: Callable[[list[int]], str], stops: Sequence[str],
                       include: bool = False) -> tuple[list[int], str, str] | None:
    """The ids up to and including the token that completes the first stop string, the text vLLM
    returns for them, and the stop string; None when no stop string occurs in ``decode(ids)``."""
    if not stops or first_stop_string(decode(ids), stops) is None:
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop_string(decode(ids[:mid]), stops) is not None:
            hi = mid
        else:
            lo = mid + 1
    kept = ids[:lo]
    text = decode(kept)
    i, s = first_stop_string(text, stops)  # type: ignore[misc]
    return kept, (text[:i + len(s)] if include else text[:i]), s


def logprobs_object(ids: Sequence[int], logprobs: Sequence[float], req: dict, token_str: Callable[[int], str],
                    offset: int = 0) -> tuple[dict | None, int]:
    """A choice's ``logprobs`` object (None unless ``req`` asks for logprobs) and the text offset after
    it: a streamed chunk's ``text_offset`` go on from the previous chunk's ``offset``."""
    if req.get("logprobs") is None:
        return None, offset
    as_ids = bool(req.get("return_tokens_as_token_ids"))
    toks = [f"token_id:{t}" if as_ids else token_str(t) for t in ids]
    offsets = []
    for tk in toks:
        offsets.append(offset)
        offset += len(tk)
    lps = [max(float(x), -9999.0) for x in logprobs]  # vLLM clamps -inf for JSON
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": toks,
            "top_logprobs": [{tk: lp} for tk, lp in zip(toks, lps)]}, offset


def stream_chunk(*, rid: str, created: int, model: str, prompt: Sequence[int], ids: Sequence[int],
                 logprobs: Sequence[float], text: str, first: bool, finish: str | None,
                 stop_reason: int | str | None, req: dict, token_str: Callable[[int], str],
                 offset: int) -> tuple[dict, int]:
    """One event of vLLM's streamed ``/v1/completions`` (``ids``: the tokens new since the last one;
    ``finish`` only on the last) and the text offset after it."""
    lp_obj, offset = logprobs_object(ids, logprobs, req, token_str, offset)
    want_ids = bool(req.get("return_token_ids"))
    return {"id": rid, "object": "text_completion", "created": int(created), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": lp_obj, "finish_reason": finish,
                         "stop_reason": stop_reason,
                         "prompt_token_ids": list(prompt) if want_ids and first else None,
                         "token_ids": list(ids) if want_ids else None}],
            "usage": None}, offset


def stream_usage(*, rid: str, created: int, model: str, n_prompt: int, n: int) -> dict:
    """The last event of a stream asked with ``stream_options.include_usage``."""
    return {"id": rid, "object": "text_completion", "created": int(created), "model": model, "choices": [],
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n, "completion_tokens": n}}


def sglang_generate_body(*, rid: str, prompt: Sequence[int], ids: Sequence[int], logprobs: Sequence[float],
                         finish: str | None, stop_reason: int | str | None, text: str, req: dict,
                         elapsed: float) -> dict:
    """SGLang's ``POST /generate`` reply (``output_ids`` and ``meta_info``) for the same sample."""
    if finish == "length":
        fr: dict[str, Any] = {"type": "length", "length": len(ids)}
    elif finish == "abort":
        fr = {"type": "abort", "message": "aborted"}
    else:
        fr = {"type": "stop", "matched": stop_reason if stop_reason is not None else (ids[-1] if ids else None)}
    meta: dict[str, Any] = {"id": rid, "finish_reason": fr, "prompt_tokens": len(prompt),
                            "weight_version": "default", "total_retractions": 0}
    if req.get("return_logprob"):
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
    meta["completion_tokens"] = len(ids)
    meta["cached_tokens"] = 0
    meta["e2e_latency"] = elapsed
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def load_gauges(registry: Any, model: str, running: Callable[[], float], waiting: Callable[[], float]) -> None:
    """The load gauges vLLM and SGLang export on ``/metrics`` (what the router reads), on ``registry``."""
    from prometheus_client import Gauge

    for name, doc, fn in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
        ("sglang:num_running_reqs", "The number of running requests.", running),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting),
    ):
        Gauge(name, doc, ["model_name"], registry=registry).labels(model_name=model).set_function(fn)


def completion_body(*, rid: str, created: int, model: str, prompt: Sequence[int], ids: Sequence[int],
                    logprobs: Sequence[float], finish: str | None, stop_reason: int | str | None, text: str,
                    req: dict, token_str: Callable[[int], str]) -> dict:
    """vLLM's whole (non-streamed) ``/v1/completions`` reply for one choice. ``token_str(id)`` is the
    token's text for ``logprobs.tokens`` when ``return_tokens_as_token_ids`` is not set."""
    lp_obj = logprobs_object(ids, logprobs, req, token_str)[0]
    want_ids = bool(req.get("return_token_ids"))
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(created),
        "model": model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": lp_obj,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": list(ids) if want_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(prompt) if want_ids else None,
            "routed_experts": None,
        }],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def reply_text(ids: Sequence[int], decode: Callable[[list[int]], str], finish: str | None,
               stop_reason: int | str | None) -> str:
    """``text`` for sampled ``ids``: a stop token (``stop_token_ids``) is not in it."""
    ids = list(ids)
    if finish == "stop" and isinstance(stop_reason, int) and ids and ids[-1] == stop_reason:
        ids = ids[:-1]
    return decode(ids)
