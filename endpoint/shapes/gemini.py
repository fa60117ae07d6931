"""Gemini API shapes for the per-job endpoint (``POST /v1beta/models/{model}:generateContent``,
``:streamGenerateContent?alt=sse``, ``:countTokens``): request translation to the chat path's
messages, tools and sampling, and a :class:`~rolloutd.endpoint.wire.Reply` rendered as a
``GenerateContentResponse`` or as its server-sent chunks. Pure translation: no I/O, no state.

Shapes follow the REST API (camelCase JSON, what ``google-genai`` and Gemini CLI's ``@google/genai``
send and parse); snake_case names are accepted too, as Google's JSON parser does.

* ``systemInstruction`` (a Content or a string) becomes the system message.
* ``contents``: role ``user`` (or none) and ``model`` (consecutive model contents are one turn, their
  text parts joined as they came; a user turn's text parts joined by newlines); parts ``text``, ``text`` with
  ``thought: true`` (the model turn's reasoning), ``functionCall`` (``name``, ``args``, ``id``) and
  ``functionResponse`` (``name``, ``response``, ``id``: a tool message, answering the first open call
  of its name when it has no id; a response that is only
  ``{"output": "<text>"}``, Gemini CLI's shape, renders as that text, any other as its JSON).
  ``thoughtSignature`` is ignored; ``inlineData``, ``fileData``, code execution parts are refused.
* ``tools[].functionDeclarations`` (``parametersJsonSchema``, or ``parameters`` in Google's
  OpenAPI subset, whose upper-case type names are lower-cased); ``googleSearch``, ``urlContext``,
  ``codeExecution`` and other hosted tools are refused. ``toolConfig.functionCallingConfig.mode``
  ``NONE`` returns the reply unparsed; ``ANY``/``VALIDATED`` are accepted, not enforced.
* ``generationConfig``: ``maxOutputTokens``, ``temperature``, ``topP``, ``topK``, ``seed``,
  ``stopSequences``, ``candidateCount`` (1 only), ``thinkingConfig`` (``includeThoughts`` decides
  whether reasoning is returned as thought parts); ``responseMimeType``/``responseJsonSchema`` are
  accepted and not enforced (``extras``). Unknown fields are tolerated (Google's server refuses them).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..wire import (EndpointError, Msg, Reply, Sampling, WireRequest, args_object, assembled_before, bad, canon_args, dumps,
                    keep_assembled, memo_items, memo_value, tools_given)

__all__ = ["count_tokens_response", "error_body", "parse", "parse_count_tokens", "response", "stream_chunks"]

_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           405: "INVALID_ARGUMENT", 409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
           499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def error_body(e: EndpointError) -> bytes:
    """``e`` in Google's error shape ``{"error": {"code", "message", "status"}}`` (status ``e.status``)."""
    return dumps({"error": {"code": e.status, "message": e.message,
                            "status": _STATUS.get(e.status, "INTERNAL" if e.status >= 500 else "INVALID_ARGUMENT")}})


def _g(d: dict, camel: str, snake: str | None = None) -> Any:
    v = d.get(camel)
    if v is None and snake is not None:
        v = d.get(snake)
    return v


# -- requests ------------------------------------------------------------------------------
def _schema(s: Any) -> Any:
    """Google's OpenAPI-subset Schema as JSON Schema (type names lower-cased; the rest kept)."""
    if isinstance(s, dict):
        out = {}
        for k, v in s.items():
            if k == "type" and isinstance(v, str):
                out[k] = v.lower()
            elif k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                out[k] = {pk: _schema(pv) for pk, pv in v.items()}
            elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
                out[k] = _schema(v)
            elif k in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(v, list):
                out[k] = [_schema(x) for x in v]
            else:
                out[k] = v
        return out
    return s


def _tools(raw: Any) -> list[dict] | None:
    if not tools_given(raw, "Invalid value at 'tools': must be a list of Tool objects"):
        return None
    out: list[dict] = []
    seen: set[str] = set()
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad(f"Invalid value at 'tools[{i}]': must be an object", "tools")
        decls = _g(t, "functionDeclarations", "function_declarations")
        others = [k for k, v in t.items() if k not in ("functionDeclarations", "function_declarations")
                  and v is not None]
        if others:
            raise bad(f"tools[{i}]: {others[0]!r} is not supported here (function declarations only)", "tools")
        if decls is None:
            continue
        if not isinstance(decls, list):
            raise bad(f"Invalid value at 'tools[{i}].function_declarations': must be a list", "tools")
        for j, f in enumerate(decls):
            where = f"tools[{i}].function_declarations[{j}]"
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                raise bad(f"{where}.name: a function declaration needs a name", "tools")
            if f["name"] in seen:
                raise bad(f"{where}: duplicate function name {f['name']!r}", "tools")
            seen.add(f["name"])
            js = _g(f, "parametersJsonSchema", "parameters_json_schema")
            params = js if js is not None else _schema(f.get("parameters"))
            fn: dict[str, Any] = {"name": f["name"]}
            if isinstance(f.get("description"), str) and f["description"]:
                fn["description"] = f["description"]
            fn["parameters"] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
            out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[bool, Any]:
    tc = _g(body, "toolConfig", "tool_config")
    if tc is None:
        return tools is not None, ("auto" if tools else None)
    if not isinstance(tc, dict):
        raise bad("Invalid value at 'tool_config': must be an object", "toolConfig")
    fcc = _g(tc, "functionCallingConfig", "function_calling_config") or {}
    if not isinstance(fcc, dict):
        raise bad("Invalid value at 'tool_config.function_calling_config': must be an object", "toolConfig")
    mode = fcc.get("mode") or "AUTO"
    if not isinstance(mode, str) or mode.upper() not in ("AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"):
        raise bad(f"Invalid value at 'tool_config.function_calling_config.mode' ({mode!r})", "toolConfig")
    mode = mode.upper()
    if mode == "NONE":
        return False, "none"
    allowed = _g(fcc, "allowedFunctionNames", "allowed_function_names")
    if allowed is not None and not (isinstance(allowed, list) and all(isinstance(n, str) for n in allowed)):
        raise bad("Invalid value at 'tool_config.function_calling_config.allowed_function_names': must be a list of "
                  "strings", "toolConfig")
    if allowed and tools:
        names = {t["function"]["name"] for t in tools}
        missing = [n for n in allowed if n not in names]
        if missing:
            raise bad(f"allowed_function_names names {missing[0]!r}, which is not declared", "toolConfig")
    if mode == "ANY":
        return tools is not None, ({"name": allowed[0]} if allowed and len(allowed) == 1 else "required")
    return tools is not None, "auto"


def _part_text_only(c: Any, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, dict):
        parts = c.get("parts")
        if parts is None:
            return ""
        if not isinstance(parts, list):
            raise bad(f"Invalid value at '{where}.parts': must be a list", where)
        out = []
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                raise bad(f"{where}.parts[{j}]: only text parts are supported here", where)
            out.append(p["text"])
        return "\n".join(out)
    raise bad(f"Invalid value at '{where}': must be a Content object or a string", where)


def _tool_text(resp: Any) -> str:
    if isinstance(resp, dict) and len(resp) == 1 and isinstance(resp.get("output"), str):
        return resp["output"]
    return json.dumps(resp, ensure_ascii=False)


def _content(c: Any, i: int) -> tuple:
    """One Content translated (pure: reused for a content sent again): ("model", text, thoughts,
    calls, ids) or ("user", ((name, id, text) per functionResponse), text or None)."""
    where = f"contents[{i}]"
    if not isinstance(c, dict):
        raise bad(f"Invalid value at '{where}': must be a Content object", "contents")
    role = c.get("role") or "user"
    if role not in ("user", "model", "function", "tool"):
        raise bad(f"Please use a valid role: user, model. (got {role!r} at {where})", "contents")
    parts = c.get("parts")
    if parts is not None and not isinstance(parts, list):
        raise bad(f"Invalid value at '{where}.parts': must be a list of parts, got {type(parts).__name__}",
                  "contents")
    if not parts:
        raise bad(f"* GenerateContentRequest.{where}.parts: contents.parts must not be empty", "contents")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[tuple[str, str]] = []
    ids: list[str] = []
    tools_out: list[tuple] = []
    for j, p in enumerate(parts):
        pw = f"{where}.parts[{j}]"
        if not isinstance(p, dict):
            raise bad(f"Invalid value at '{pw}': must be a Part object", "contents")
        fc = _g(p, "functionCall", "function_call")
        fr = _g(p, "functionResponse", "function_response")
        if isinstance(p.get("text"), str):
            (thoughts if p.get("thought") else texts).append(p["text"])
        elif fc is not None:
            if role != "model" or not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise bad(f"{pw}: a functionCall (with a name) belongs in a model turn", "contents")
            args = fc.get("args") if fc.get("args") is not None else {}
            cid = fc.get("id") if isinstance(fc.get("id"), str) and fc.get("id") else f"call_{i}_{j}"
            calls.append((fc["name"], canon_args(args)))
            ids.append(cid)
        elif fr is not None:
            if not isinstance(fr, dict) or not isinstance(fr.get("name"), str):
                raise bad(f"{pw}.function_response: a name is required", "contents")
            tid = fr.get("id") if isinstance(fr.get("id"), str) and fr.get("id") else None
            tools_out.append((fr["name"], tid, _tool_text(fr.get("response"))))
        elif p.get("thought") or _g(p, "thoughtSignature", "thought_signature") is not None:
            continue  # a signature-only part: opaque, nothing to render
        else:
            kind = next((k for k in p if k not in ("thought", "thoughtSignature", "thought_signature")), None)
            raise bad(f"{pw}: part {kind!r} is not supported (text, functionCall and functionResponse only)",
                      "contents")
    if role == "model":
        if tools_out:
            raise bad(f"{where}: a functionResponse belongs in a user turn", "contents")
        return ("model", "".join(texts), "".join(thoughts) if thoughts else None, tuple(calls), tuple(ids))
    # a user turn's text parts are separate pieces (a prompt, context): joined by newlines
    return ("user", tuple(tools_out), "\n".join(texts) if texts or not tools_out else None)


def _contents(raw: Any, out: list[Msg], cache: dict | None = None) -> None:
    """Translated contents assembled into messages, resuming from the previous call's assembly
    (``assembled_before``) at a point where no model turn was open and no call unanswered."""
    if not isinstance(raw, list) or not raw:
        raise bad("* GenerateContentRequest.contents: contents is not specified", "contents")
    pieces = memo_items(raw, _content, cache)
    start, msgs, marks = assembled_before(pieces, cache)
    prev_model = False
    pending: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls not answered yet
    for i in range(start, len(pieces)):
        p = pieces[i]
        if p[0] == "model":
            _, text, thoughts, calls, ids = p
            pending = ([] if not prev_model else pending) + [(cid, n) for cid, (n, _) in zip(ids, calls)]
            if prev_model:  # consecutive model contents are one turn (a chat records one per streamed chunk)
                m = msgs[-1]
                m.content += text
                m.calls, m.call_ids = m.calls + calls, m.call_ids + ids
                if thoughts:
                    m.reasoning = (m.reasoning or "") + thoughts
            else:
                msgs.append(Msg(role="assistant", content=text, calls=calls, call_ids=ids, reasoning=thoughts))
            prev_model = True
        else:
            prev_model = False
            for n, tid, t in p[1]:
                hit = next((k for k, pc in enumerate(pending) if (pc[0] == tid if tid else pc[1] == n)), None)
                if hit is not None:  # a response without an id answers the first open call of its name
                    tid = pending.pop(hit)[0]
                msgs.append(Msg(role="tool", content=t, name=n, tool_call_id=tid))
            if p[2] is not None:
                msgs.append(Msg(role="user", content=p[2]))
        if not prev_model and not pending:
            marks.append((i + 1, len(msgs)))
    keep_assembled(cache, pieces, marks, msgs)
    out.extend(msgs)


def _number(cfg: dict, camel: str, snake: str, lo: float | None, hi: float | None, cast=float) -> Any:
    v = _g(cfg, camel, snake)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"Invalid value at 'generation_config.{snake}' ({v!r}): must be a number", "generationConfig")
    v = cast(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"generation_config.{snake} = {v} is out of range [{lo}, {hi}]", "generationConfig")
    return v


def _generation(body: dict, extras: dict) -> Sampling:
    cfg = _g(body, "generationConfig", "generation_config") or {}
    if not isinstance(cfg, dict):
        raise bad("Invalid value at 'generation_config': must be an object", "generationConfig")
    n = _number(cfg, "candidateCount", "candidate_count", 1, None, int)
    if n not in (None, 1):
        raise bad(f"candidate_count = {n} is not supported: one candidate per request", "generationConfig")
    stops = _g(cfg, "stopSequences", "stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("Invalid value at 'generation_config.stop_sequences': must be a list of strings", "generationConfig")
    t = _number(cfg, "temperature", "temperature", 0.0, 2.0)
    p = _number(cfg, "topP", "top_p", 0.0, 1.0)
    k = _number(cfg, "topK", "top_k", 0, None, int)
    think = _g(cfg, "thinkingConfig", "thinking_config")
    if think is not None and not isinstance(think, dict):
        raise bad("Invalid value at 'generation_config.thinking_config': must be an object", "generationConfig")
    extras["thinking_config"] = think
    extras["include_thoughts"] = bool(think and _g(think, "includeThoughts", "include_thoughts"))
    mime = _g(cfg, "responseMimeType", "response_mime_type")
    if mime not in (None, "text/plain"):
        extras["response_format"] = {"mime_type": mime, "schema": _g(cfg, "responseJsonSchema", "response_json_schema")
                                     or _g(cfg, "responseSchema", "response_schema")}
    return Sampling(max_tokens=_number(cfg, "maxOutputTokens", "max_output_tokens", 1, None, int),
                    temperature=1.0 if t is None else t, top_p=1.0 if p is None else p, top_k=-1 if not k else k,
                    seed=_number(cfg, "seed", "seed", None, None, int), stop=[s for s in stops if s])


def parse(body: Any, model: str | None = None, stream: bool = False, cache: dict | None = None) -> WireRequest:
    """A ``generateContent`` body (``stream``: it came as ``streamGenerateContent``; ``model``:
    from the URL) as a :class:`WireRequest`. ``cache``: a dict the caller keeps per session
    (contents sent again are not translated again). Raises :class:`EndpointError` (400)."""
    if not isinstance(body, dict):
        raise bad("Invalid JSON payload received: the body must be an object")
    if _g(body, "cachedContent", "cached_content"):
        raise bad("cached_content is not supported by this endpoint", "cachedContent")
    msgs: list[Msg] = []
    si = _g(body, "systemInstruction", "system_instruction")
    if si is not None:
        s = _part_text_only(si, "system_instruction")
        if s:
            msgs.append(Msg(role="system", content=s))
    _contents(body.get("contents"), msgs, cache)
    tools = memo_value(body.get("tools"), _tools, cache, "tools")
    parse_calls, choice = _tool_choice(body, tools)
    extras: dict[str, Any] = {}
    samp = _generation(body, extras)
    return WireRequest(messages=msgs, tools=tools, parse_calls=parse_calls, sampling=samp, stream=stream,
                       model=model, tool_choice=choice, extras=extras)


def parse_count_tokens(body: Any, model: str | None = None) -> WireRequest:
    """A ``countTokens`` body: ``{"contents": [...]}`` or ``{"generateContentRequest": {...}}``."""
    if not isinstance(body, dict):
        raise bad("Invalid JSON payload received: the body must be an object")
    inner = _g(body, "generateContentRequest", "generate_content_request")
    return parse(inner if isinstance(inner, dict) else body, model)


def count_tokens_response(n: int) -> dict:
    return {"totalTokens": int(n)}


# -- replies -------------------------------------------------------------------------------
def _finish(r: Reply) -> str:
    return "MAX_TOKENS" if r.finish_reason == "length" and not r.tool_calls else "STOP"


def _usage(r: Reply) -> dict:
    return {"promptTokenCount": r.prompt_tokens, "candidatesTokenCount": r.completion_tokens,
            "totalTokenCount": r.prompt_tokens + r.completion_tokens}


def _parts(r: Reply, req: WireRequest | None) -> list[list[dict]]:
    """The reply's parts in stream order, grouped per chunk: thought, text, function calls."""
    groups: list[list[dict]] = []
    if r.reasoning and req is not None and req.extras.get("include_thoughts"):
        groups.append([{"text": r.reasoning, "thought": True}])
    if r.content:
        groups.append([{"text": r.content}])
    calls = []
    for tc in r.tool_calls:
        calls.append({"functionCall": {"id": tc["id"], "name": tc["function"]["name"],
                                       "args": args_object(tc["function"]["arguments"])}})
    if calls:
        groups.append(calls)
    if not groups:  # an empty reply still has one (empty) text part, as Gemini sends
        groups.append([{"text": ""}])
    return groups


def _chunk(r: Reply, parts: list[dict], last: bool) -> dict:
    cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    d: dict[str, Any] = {"candidates": [cand]}
    if last:
        cand["finishReason"] = _finish(r)
        d["usageMetadata"] = _usage(r)
    d["modelVersion"] = r.model
    d["responseId"] = r.id
    return d


def response(r: Reply, req: WireRequest | None = None) -> dict:
    """The non-streaming ``GenerateContentResponse``."""
    return _chunk(r, [p for g in _parts(r, req) for p in g], True)


def stream_chunks(r: Reply, req: WireRequest | None = None) -> list[bytes]:
    """The reply as ``streamGenerateContent?alt=sse`` chunks (``data: <json>\\r\\n\\r\\n``, as
    Google sends them): one per part group, the last with ``finishReason`` and ``usageMetadata``."""
    groups = _parts(r, req)
    return [b"data: " + dumps(_chunk(r, g, k == len(groups) - 1)) + b"\r\n\r\n" for k, g in enumerate(groups)]
