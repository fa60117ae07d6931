"""The OpenAI shapes of the agent-facing endpoint: Chat Completions and Completions requests
(validation, message normalization) and their response and server-sent-event bodies.

Shapes follow OpenAI's Chat Completions and Completions references (the ones the ``openai``
SDK parses): ``chat.completion`` / ``chat.completion.chunk`` / ``text_completion`` objects and
``{"error": {"message", "type", "param", "code"}}``. Unknown request fields are tolerated
(ignored), as vLLM does; fields whose meaning we cannot honour are refused with a 400.
"""

from __future__ import annotations

from typing import Any

from ..wire import (Msg, Reply, Sampling, _dumps, bad, call_arguments, canon_args, number, same_prefix, text_of,
                    tools_given)

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_messages(raw: Any, prev: tuple[list, list[Msg]] | None = None) -> list[Msg]:
    """Validate and normalize ``messages``. ``prev`` is the previous request's (raw, parsed)
    messages: a message equal to the one at the same position there is not parsed again (an
    agent resends its whole history on every call; dict equality is C-speed)."""
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    prev_raw, prev_msgs = prev if prev is not None else ([], [])
    n_prev = len(prev_raw)
    k = same_prefix(raw, prev_raw)  # the resent history, at C speed
    out: list[Msg] = prev_msgs[:k]
    for i, m in enumerate(raw[k:], k):
        if i < n_prev and (m is prev_raw[i] or m == prev_raw[i]):
            out.append(prev_msgs[i])
            continue
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}: unknown role {role!r}", "messages")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role == "function":  # the deprecated pre-tools shape
            role = "tool"
        calls: list[tuple[str, str]] = []
        ids: list[str] = []
        tcs = m.get("tool_calls")
        if tcs:
            if role != "assistant" or not isinstance(tcs, list):
                raise bad(f"{where}: tool_calls must be a list on an assistant message", "messages")
            for j, tc in enumerate(tcs):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}] needs function.name", "messages")
                calls.append((fn["name"], canon_args(call_arguments(fn.get("arguments"), where))))
                ids.append(str(tc.get("id") or f"call_{i}_{j}"))
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        name = m.get("name")
        tcid = m.get("tool_call_id")
        out.append(Msg(role=role, content=text_of(m.get("content"), where),
                       name=name if isinstance(name, str) else None,
                       tool_call_id=tcid if isinstance(tcid, str) else None,
                       calls=tuple(calls), call_ids=tuple(ids),
                       reasoning=reasoning if isinstance(reasoning, str) else None))
    return out


def parse_tools(raw: Any) -> list[dict] | None:
    if not tools_given(raw, "'tools' must be a list"):
        return None
    for i, t in enumerate(raw):
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    return raw


def parse_sampling(body: dict) -> Sampling:
    n = number(body, "n", 1, int)
    if n != 1:
        raise bad(f"n = {n} is not supported: one choice per request (send n requests instead)", "n")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of is not supported", "best_of")
    if body.get("echo"):
        raise bad("echo is not supported", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        raise bad(f"response_format {rf.get('type')!r} is not supported (no guided decoding here)", "response_format")
    mt = body.get("max_completion_tokens")
    mt = number(body, "max_tokens", None, int, 1) if mt is None else number(body, "max_completion_tokens", None, int, 1)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    stops = [s for s in stops if s]
    sti = body.get("stop_token_ids") or []
    if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
        raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    return Sampling(max_tokens=mt, temperature=number(body, "temperature", 1.0, float, 0.0, 2.0),
                    top_p=number(body, "top_p", 1.0, float, 0.0, 1.0), top_k=number(body, "top_k", -1, int),
                    seed=number(body, "seed", None, int), stop=stops, stop_token_ids=list(sti))


def parse_tool_choice(raw: Any, tools: list[dict] | None) -> bool:
    """Whether tool calls are parsed out of the reply (``auto``/``required``/a named function)."""
    if raw is None:
        return tools is not None
    if raw == "none":
        return False
    if raw in ("auto", "required"):
        if tools is None:
            raise bad(f"tool_choice {raw!r} needs 'tools'", "tool_choice")
        return True
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        if tools is None or raw["function"].get("name") not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice names a function that is not in 'tools'", "tool_choice")
        return True
    raise bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
              "tool_choice")


def _logprobs_obj(r: Reply) -> dict | None:
    if r.token_strs is None:
        return None
    return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                        for s, lp in zip(r.token_strs, r.logprobs)], "refusal": None}


def _usage(r: Reply) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def chat_response(r: Reply) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": r.content, "tool_calls": r.tool_calls or None}
    if r.reasoning is not None:
        msg["reasoning_content"] = r.reasoning
    return {
        "id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
        "choices": [{"index": 0, "message": msg, "logprobs": _logprobs_obj(r), "finish_reason": r.finish_reason,
                     "token_ids": r.token_ids}],  # token_ids: vLLM's return_token_ids extension
        "usage": _usage(r),
    }


def chat_chunks(r: Reply, include_usage: bool) -> list[bytes]:
    """The reply as ``data: ...`` server-sent events, ``[DONE]`` last (OpenAI's chunk order)."""
    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        c = {"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    out = [chunk({"role": "assistant", "content": ""})]
    if r.reasoning:
        out.append(chunk({"reasoning_content": r.reasoning}))
    if r.content:
        out.append(chunk({"content": r.content}, logprobs=_logprobs_obj(r)))
    for i, tc in enumerate(r.tool_calls):
        out.append(chunk({"tool_calls": [dict(tc, index=i)]}))
    out.append(chunk({}, r.finish_reason))
    if include_usage:
        out.append({"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
                    "choices": [], "usage": _usage(r)})
    return [b"data: " + _dumps(c).encode() + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


def completion_response(r: Reply, text: str) -> dict:
    lp = None
    if r.token_strs is not None:
        offs, off = [], 0
        for s in r.token_strs:
            offs.append(off)
            off += len(s)
        lp = {"tokens": r.token_strs, "token_logprobs": r.logprobs, "top_logprobs": None, "text_offset": offs}
    return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": r.finish_reason,
                         "token_ids": r.token_ids}],
            "usage": _usage(r)}


def completion_chunks(r: Reply, text: str, include_usage: bool) -> list[bytes]:
    body = completion_response(r, text)
    usage = body.pop("usage")
    if include_usage:
        body["usage"] = None
    out = [body]
    if include_usage:
        out.append({"id": r.id, "object": "text_completion", "created": r.created, "model": r.model, "choices": [],
                    "usage": usage})
    return [b"data: " + _dumps(c).encode() + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]
