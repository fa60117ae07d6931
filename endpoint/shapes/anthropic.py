"""Anthropic Messages API shapes for the per-job endpoint (``POST /v1/messages``,
``POST /v1/messages/count_tokens``): request translation to the chat path's messages, tools and
sampling, and a :class:`~rolloutd.endpoint.wire.Reply` rendered as a ``message`` object or as
Anthropic's server-sent event sequence. Pure translation: no I/O, no session state.

Shapes follow the ``anthropic`` SDK's types (``MessageCreateParams``, ``Message``,
``RawMessageStreamEvent``, ``ErrorResponse``), the ground truth the SDK and Claude Code parse.

* ``system`` (a string or text blocks, glued as vLLM's Anthropic route does) becomes one system message;
  a ``system`` role inside ``messages`` (newer SDKs) is taken too.
* A user message's ``tool_result`` blocks become ``tool`` messages (in block order; its text blocks
  between them one user message each run); ``tool_result.content`` is a string or text blocks,
  ``is_error`` is not rendered (the result text is kept verbatim).
* An assistant message's ``text`` blocks are its content, ``tool_use`` blocks its calls (the
  ``input`` object as the arguments; ids lose the ``toolu_`` prefix :func:`tool_use_id` gave the
  endpoint's call ids), ``thinking`` its reasoning (the template decides whether to
  show it); ``redacted_thinking`` carries no text and is dropped.
* ``tools`` (``input_schema`` as the function's ``parameters``); server tools (a ``type`` other
  than ``custom``) are refused. ``tool_choice`` ``none`` returns the reply unparsed; ``any`` and
  ``tool`` are accepted and not enforced (no guided decoding), as on the chat path.
* ``cache_control`` anywhere is ignored; ``metadata``, ``thinking``, ``output_config`` go to
  ``extras``; unknown fields are tolerated (Anthropic's server refuses them; being stricter here
  would only break newer clients).
* Images, documents and other non-text blocks are refused (400): the chat path is text only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from ..wire import (EndpointError, Msg, Reply, Sampling, WireRequest, args_object, assembled_before, bad, canon_args, dumps,
                    keep_assembled, memo_items, memo_value, names_before, tools_given)

__all__ = ["call_id_of", "count_tokens_response", "error_body", "parse", "parse_count_tokens", "response",
           "stream_events", "tool_use_id"]

# status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(e: EndpointError) -> bytes:
    """``e`` in Anthropic's error shape (its status stays ``e.status``). A context overflow's
    message starts with "prompt is too long", which Claude Code reads to compact its history."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    msg = e.message
    if e.code == "context_length_exceeded" and not msg.startswith("prompt is too long"):
        # Anthropic's own wording, "prompt is too long: N tokens > M maximum", when the numbers are known
        n = re.search(r"contains (?:at least )?(\d+) input tokens", msg) or re.search(r"(\d+) tokens", msg)
        m = re.search(r"maximum context length is (\d+)", msg) or re.search(r"context window (?:is|of) (\d+)", msg)
        msg = f"prompt is too long: {n[1]} tokens > {m[1]} maximum ({msg})" if n and m else \
            f"prompt is too long: {msg}"
    return dumps({"type": "error", "error": {"type": kind, "message": msg}, "request_id": None})


def tool_use_id(call_id: str) -> str:
    """The ``tool_use`` id (Anthropic's ``toolu_`` shape) for a reply's tool-call id."""
    return "toolu_" + call_id


def call_id_of(tool_use_id: str) -> str:
    """The inverse of :func:`tool_use_id`, applied by :func:`parse` to every ``tool_use`` id and
    ``tool_use_id``: the messages carry the endpoint's own call ids again (a foreign ``toolu_...``
    id loses the prefix on both sides alike, so calls and results still pair)."""
    return tool_use_id[6:] if tool_use_id.startswith("toolu_") and len(tool_use_id) > 6 else tool_use_id


# -- requests ------------------------------------------------------------------------------
def _text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks (``cache_control``/``citations`` ignored) joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, b in enumerate(content):
            if not isinstance(b, dict):
                raise bad(f"{where}.{j}: each content block must be an object", where)
            if b.get("type") != "text":
                raise bad(f"{where}.{j}: content block of type {b.get('type')!r} is not supported here (text only)",
                          where)
            if not isinstance(b.get("text"), str):
                raise bad(f"{where}.{j}.text: Field required (a string)", where)
            out.append(b["text"])
        return "\n".join(out)  # separate blocks (a reminder, a prompt): never glue their words
    if content is None:
        return ""
    raise bad(f"{where}: must be a string or a list of text blocks", where)


def _content_blocks(content: Any, where: str):
    """A message's content blocks as (error path, block, type): each an object, a text block's
    ``text`` a string; ``content`` must be a list (a string is the caller's to take first)."""
    if not isinstance(content, list):
        raise bad(f"{where}.content: Input should be a valid string or list of content blocks", where)
    for j, b in enumerate(content):
        bw = f"{where}.content.{j}"
        if not isinstance(b, dict):
            raise bad(f"{bw}: each content block must be an object", bw)
        t = b.get("type")
        if t == "text" and not isinstance(b.get("text"), str):
            raise bad(f"{bw}.text: Field required (a string)", bw)
        yield bw, b, t


def _user(m: dict, where: str) -> tuple:
    """A user message as pieces: ("user", text) for each run of text blocks, ("tool", id, text)."""
    content = m.get("content")
    if isinstance(content, str):
        return (("user", content),)
    pieces: list[tuple] = []
    texts: list[str] | None = None
    for bw, b, t in _content_blocks(content, where):
        if t == "text":
            if texts is None:
                texts = []
                pieces.append(("user", ""))
            if b["text"]:  # vLLM's Anthropic route drops empty text blocks
                texts.append(b["text"])
            pieces[-1] = ("user", "\n".join(texts))
        elif t == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise bad(f"{bw}.tool_use_id: Field required", bw)
            pieces.append(("tool", call_id_of(tid), _text_blocks(b.get("content"), f"{bw}.content")))
            texts = None
        elif t in ("thinking", "redacted_thinking", "tool_use"):
            raise bad(f"{bw}: a {t!r} block belongs in an assistant message", bw)
        else:
            raise bad(f"{bw}: content block of type {t!r} is not supported (text and tool_result only)", bw)
    return tuple(pieces)


def _assistant(m: dict, where: str) -> tuple:
    """An assistant message as one piece: ("assistant", text, calls, ids, reasoning)."""
    content = m.get("content")
    if isinstance(content, str):
        return (("assistant", content, (), (), None),)
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[tuple[str, str]] = []
    ids: list[str] = []
    for bw, b, t in _content_blocks(content, where):
        if t == "text":
            texts.append(b["text"])
        elif t == "tool_use":
            name, tid, inp = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad(f"{bw}.name: Field required", bw)
            if not isinstance(tid, str) or not tid:
                raise bad(f"{bw}.id: Field required", bw)
            if not isinstance(inp, dict):
                raise bad(f"{bw}.input: Input should be a valid dictionary", bw)
            calls.append((name, canon_args(inp)))
            ids.append(call_id_of(tid))
        elif t == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{bw}.thinking: Field required (a string)", bw)
            thinking.append(b["thinking"])
        elif t == "redacted_thinking":
            continue  # opaque, no text to render
        else:
            raise bad(f"{bw}: content block of type {t!r} is not supported in an assistant message", bw)
    # text blocks joined by newlines, as vLLM's Anthropic route (text parts of one chat message)
    return (("assistant", "\n".join(t for t in texts if t), tuple(calls), tuple(ids),
             "".join(thinking) if thinking else None),)


def _message(m: Any, i: int) -> tuple:
    """One message of ``messages`` translated to pieces (pure: reused for a message sent again)."""
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise bad(f"{where}: Input should be a valid dictionary", where)
    role = m.get("role")
    if "content" not in m:
        raise bad(f"{where}.content: Field required", where)
    if role == "user":
        return _user(m, where)
    if role == "assistant":
        return _assistant(m, where)
    if role == "system":
        return (("system", _text_blocks(m.get("content"), f"{where}.content")),)
    raise bad(f"{where}.role: Input should be 'user' or 'assistant'", where)


def _messages(body: dict, cache: dict | None) -> list[Msg]:
    out: list[Msg] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            s = "".join(_text_blocks([b], "system") for b in system)  # vLLM's Anthropic route: glued
        else:
            s = _text_blocks(system, "system")
        if s:
            out.append(Msg(role="system", content=s))
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise bad("messages: Field required (a list of messages)", "messages")
    if not raw:
        raise bad("messages: at least one message is required", "messages")
    out += _assembled(memo_items(raw, _message, cache), cache)
    return out


def _assembled(items: list, cache: dict | None) -> list[Msg]:
    """The messages of the translated ``items`` (each a tuple of pieces), resuming from the
    previous call's (``assembled_before``: every item boundary is a clean point here)."""
    start, msgs, marks = assembled_before(items, cache)
    names = names_before(cache, start)  # tool_use id -> tool name, for the tool messages
    if names is None:
        names = {}
        for pieces in items[:start]:
            for p in pieces:
                if p[0] == "assistant":
                    names.update(zip(p[3], (n for n, _ in p[2])))
    for i in range(start, len(items)):
        for p in items[i]:
            if p[0] == "assistant":
                _, text, calls, ids, reasoning = p
                names.update(zip(ids, (n for n, _ in calls)))
                msgs.append(Msg(role="assistant", content=text, calls=calls, call_ids=ids, reasoning=reasoning))
            elif p[0] == "tool":
                msgs.append(Msg(role="tool", content=p[2], name=names.get(p[1]), tool_call_id=p[1]))
            else:
                msgs.append(Msg(role=p[0], content=p[1]))
        marks.append((i + 1, len(msgs)))
    keep_assembled(cache, items, marks, msgs, names)
    return msgs


def _tools(raw: Any) -> list[dict] | None:
    if not tools_given(raw, "tools: Input should be a valid list"):
        return None
    out = []
    seen = set()
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad(f"tools.{i}: Input should be a valid dictionary", "tools")
        typ = t.get("type")
        if typ not in (None, "custom"):
            raise bad(f"tools.{i}: server tool {typ!r} is not supported (only client tools with an input_schema)",
                      "tools")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad(f"tools.{i}.name: Field required", "tools")
        if not isinstance(schema, dict):
            raise bad(f"tools.{i}.input_schema: Field required (a JSON schema object)", "tools")
        if name in seen:
            raise bad(f"tools: Tool names must be unique ({name!r} repeats)", "tools")
        seen.add(name)
        fn: dict[str, Any] = {"name": name}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, tools: list[dict] | None) -> tuple[bool, Any]:
    if raw is None:
        return tools is not None, None
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice: Input should be an object with type 'auto', 'any', 'tool' or 'none'", "tool_choice")
    t = raw["type"]
    if t == "none":
        return False, "none"
    if t == "tool":
        names = {x["function"]["name"] for x in tools or ()}
        if not isinstance(raw.get("name"), str) or raw["name"] not in names:
            raise bad(f"tool_choice: tool {raw.get('name')!r} is not in tools", "tool_choice")
        return True, {"name": raw["name"]}
    if tools is None:
        return False, None  # Anthropic accepts auto/any without tools; nothing to parse
    return True, "required" if t == "any" else "auto"


def _number(body: dict, key: str, lo: float, hi: float | None, cast=float) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (cast is int and isinstance(v, float) and not v.is_integer()):
        raise bad(f"{key}: Input should be a valid {'integer' if cast is int else 'number'}", key)
    v = cast(v)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{key}: must be between {lo} and {hi}" if hi is not None else f"{key}: must be >= {lo}", key)
    return v


def _sampling(body: dict, need_max: bool) -> Sampling:
    mt = body.get("max_tokens")
    if mt is None:
        if need_max:
            raise bad("max_tokens: Field required", "max_tokens")
    else:
        mt = _number(body, "max_tokens", 1, None, int)
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    elif not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise bad("stop_sequences: Input should be a valid list of strings", "stop_sequences")
    t = _number(body, "temperature", 0.0, 1.0)
    p = _number(body, "top_p", 0.0, 1.0)
    k = _number(body, "top_k", 0, None, int)
    return Sampling(max_tokens=mt, temperature=1.0 if t is None else t, top_p=1.0 if p is None else p,
                    top_k=-1 if not k else k, seed=None, stop=[s for s in stops if s])


def _parse(body: Any, need_max: bool, cache: dict | None) -> WireRequest:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model: Input should be a valid string", "model")
    msgs = _messages(body, cache)
    tools = memo_value(body.get("tools"), _tools, cache, "tools")
    parse_calls, choice = _tool_choice(body.get("tool_choice"), tools)
    samp = _sampling(body, need_max)
    if need_max and msgs and msgs[-1].role == "assistant":  # counting tokens of such a list is fine
        # a prefill: the chat template would close the assistant turn; newer Claude models refuse it too
        raise bad("a final assistant message (prefill) is not supported: the conversation must end with a user turn",
                  "messages")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and isinstance(thinking.get("type"), str)):
        raise bad("thinking: Input should be an object with a type", "thinking")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata: Input should be a valid dictionary", "metadata")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad("stream: Input should be a valid boolean", "stream")
    tc = body.get("tool_choice")
    extras: dict[str, Any] = {"thinking": thinking, "metadata": metadata, "parallel_tool_calls":
                              not (isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True)}
    if isinstance(body.get("output_config"), dict):  # effort, format: accepted, not enforced
        extras["output_config"] = body["output_config"]
    return WireRequest(messages=msgs, tools=tools, parse_calls=parse_calls, sampling=samp, stream=stream,
                       model=model, tool_choice=choice, extras=extras)


def parse(body: Any, cache: dict | None = None) -> WireRequest:
    """A ``POST /v1/messages`` body as a :class:`WireRequest`. ``cache``: a dict the caller keeps
    per session (messages sent again are not translated again). Raises :class:`EndpointError` (400)."""
    return _parse(body, True, cache)


def parse_count_tokens(body: Any, cache: dict | None = None) -> WireRequest:
    """A ``POST /v1/messages/count_tokens`` body (no ``max_tokens``). Raises :class:`EndpointError` (400)."""
    return _parse(body, False, cache)


def count_tokens_response(n: int) -> dict:
    return {"input_tokens": int(n)}


# -- replies -------------------------------------------------------------------------------
def _stop_reason(r: Reply) -> tuple[str, str | None]:
    if r.tool_calls:
        return "tool_use", None
    if r.finish_reason == "length":
        return "max_tokens", None
    if r.stop_sequence:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def _signature(text: str) -> str:
    # an opaque value the client sends back unchanged; nothing here checks it
    return "rolloutd-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _show_thinking(r: Reply, req: WireRequest | None) -> bool:
    t = req.extras.get("thinking") if req is not None else None
    return bool(r.reasoning) and not (isinstance(t, dict) and t.get("type") == "disabled")


def _message_id(r: Reply) -> str:
    return r.id if r.id.startswith("msg_") else "msg_" + r.id.rsplit("-", 1)[-1]


def _usage(r: Reply) -> dict:
    return {"input_tokens": r.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "output_tokens": r.completion_tokens}


def _blocks(r: Reply, req: WireRequest | None) -> list[dict]:
    blocks: list[dict] = []
    if _show_thinking(r, req):
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": _signature(r.reasoning or "")})
    if r.content:
        blocks.append({"type": "text", "text": r.content})
    for tc in r.tool_calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(tc["id"]), "name": tc["function"]["name"],
                       "input": args_object(tc["function"]["arguments"])})
    return blocks


def response(r: Reply, req: WireRequest | None = None) -> dict:
    """The non-streaming ``message`` object."""
    stop, seq = _stop_reason(r)
    return {"id": _message_id(r), "type": "message", "role": "assistant", "model": r.model,
            "content": _blocks(r, req), "stop_reason": stop, "stop_sequence": seq, "usage": _usage(r)}


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def stream_events(r: Reply, req: WireRequest | None = None) -> list[bytes]:
    """The reply as Anthropic's event sequence: ``message_start``, per content block
    ``content_block_start`` / ``content_block_delta`` (``thinking_delta`` + ``signature_delta``,
    ``text_delta``, ``input_json_delta``) / ``content_block_stop`` (a ``ping`` after the first
    start, as the API sends one), ``message_delta`` (stop reason, usage), ``message_stop``."""
    stop, seq = _stop_reason(r)
    start_usage = dict(_usage(r), output_tokens=1)
    out = [_event("message_start", {"type": "message_start", "message": {
        "id": _message_id(r), "type": "message", "role": "assistant", "model": r.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})]
    for i, b in enumerate(_blocks(r, req)):
        t = b["type"]
        if t == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": b["thinking"]},
                      {"type": "signature_delta", "signature": b["signature"]}]
        elif t == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": b["text"]}]
        else:
            start = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}]
        out.append(_event("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}))
        if i == 0:
            out.append(_event("ping", {"type": "ping"}))
        for d in deltas:
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                                        "usage": _usage(r)}))
    out.append(_event("message_stop", {"type": "message_stop"}))
    return out
