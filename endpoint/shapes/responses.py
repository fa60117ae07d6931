"""OpenAI Responses API shapes for the per-job endpoint (``POST /v1/responses``, and the object a
``GET /v1/responses/{id}`` returns): request translation to the chat path's messages, tools and
sampling, and a :class:`~rolloutd.endpoint.wire.Reply` rendered as a ``response`` object or as
the Responses event sequence. Pure translation: the endpoint keeps the store.

Shapes follow the ``openai`` SDK's types (``ResponseCreateParams``, ``Response``,
``ResponseStreamEvent``) and what Codex sends and parses (``codex-rs``: ``ResponseItem``,
``ToolSpec``, its SSE reader, which needs ``response.output_item.done`` items and a final
``response.completed``).

Input. ``instructions`` becomes the first system message; ``input`` is a string (one user message)
or items: ``message`` (roles ``user``, ``assistant``, ``system``, ``developer`` = system; content a
string or ``input_text``/``output_text``/``refusal`` parts), ``function_call``,
``custom_tool_call``, ``local_shell_call``, their ``*_output`` items (tool messages), and
``reasoning`` (its ``reasoning_text`` content, else our own ``encrypted_content``, else the summary).
A run of assistant-side items (reasoning, an assistant message, calls) is one assistant message,
as one reply renders it. ``item_reference``, images and files are refused (400).

Tools, mapped to chat-template functions and back:

* ``function`` as is; a ``namespace``'s functions flattened (a call names its ``namespace`` again);
* ``custom`` (Codex's freeform tools, e.g. ``apply_patch`` with a Lark grammar): a function with one
  string parameter ``input``, the grammar appended to its description; a call comes back as a
  ``custom_tool_call`` with that string as its ``input``;
* ``local_shell``: a function ``local_shell`` taking ``command`` (argv), ``workdir``, ``timeout_ms``;
  a call comes back as a ``local_shell_call`` with an ``exec`` action;
* hosted tools Codex always sends (``web_search``, ``web_search_preview``, ``image_generation``,
  ``tool_search``) are left out of the prompt (named in ``extras["ignored_tools"]``): nothing here
  can run them. Other hosted tools (``file_search``, ``code_interpreter``, ``computer_use_preview``,
  ``mcp``, ...) are refused.

``store``/``previous_response_id``: :func:`parse` takes the stored conversation of the previous
response (``history``: its items, from :func:`conversation_items`) and puts it before ``input``.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from ..wire import (EndpointError, Msg, Reply, Sampling, WireRequest, assembled_before, bad, call_arguments, canon_args,
                    dumps, keep_assembled, memo_items, memo_value, names_before, number, tools_given)

__all__ = ["conversation_items", "error_body", "output_items", "parse", "response", "response_id",
           "stream_events"]

_IGNORED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "image_generation",
                  "tool_search")
_ENC = "rolloutd:"  # our encrypted_content: the reasoning text, base64 (opaque to the client)

LOCAL_SHELL_PARAMS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments."},
        "workdir": {"type": "string", "description": "The working directory."},
        "timeout_ms": {"type": "integer", "description": "The timeout in milliseconds."},
    },
    "required": ["command"],
}


def error_body(e: EndpointError) -> bytes:
    """``e`` in OpenAI's error shape (the Responses API uses the Chat Completions one)."""
    return e.body()


# -- requests ------------------------------------------------------------------------------
def _parts_text(content: Any, where: str, sep: str = "\n") -> str:
    """A string or text parts; parts of a user-side message are joined by newlines (as vLLM joins
    them), an assistant message's by nothing (one reply's text, maybe split)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of content parts", "input")
    out = []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text", "summary_text",
                                                     "reasoning_text") and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif isinstance(p, dict) and p.get("type") == "refusal":
            out.append(str(p.get("refusal") or ""))
        else:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad(f"{where}[{j}]: content part of type {kind!r} is not supported (text only)", "input")
    return sep.join(out)


def _tools(raw: Any) -> tuple[list[dict] | None, dict[str, dict], list[str], bytes]:
    """(chat-template tools, name -> {"kind", "namespace"?}, ignored hosted tool types, the tools
    as JSON for the response object, which repeats them: a lone surrogate is refused here)."""
    if not tools_given(raw, "'tools' must be a list"):
        return None, {}, [], b"[]"
    out: list[dict] = []
    kinds: dict[str, dict] = {}
    ignored: list[str] = []

    def add(name: Any, desc: Any, params: Any, kind: str, where: str, namespace: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise bad(f"{where}: missing required parameter 'name'", "tools")
        if name in kinds:
            raise bad(f"{where}: duplicate tool name {name!r}", "tools")
        fn: dict[str, Any] = {"name": name}
        if isinstance(desc, str) and desc:
            fn["description"] = desc
        fn["parameters"] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
        kinds[name] = {"kind": kind, "namespace": namespace}

    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object", "tools")
        typ = t.get("type")
        if typ == "function":
            add(t.get("name"), t.get("description"), t.get("parameters"), "function", where)
        elif typ == "custom":
            desc = t.get("description") if isinstance(t.get("description"), str) else ""
            fmt = t.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                gram = fmt.get("grammar") if isinstance(fmt.get("grammar"), dict) else fmt
                desc = (desc + "\n\n" if desc else "") + \
                    f"The input must match this {gram.get('syntax', 'lark')} grammar:\n{gram.get('definition', '')}"
            params = {"type": "object", "properties": {"input": {"type": "string", "description":
                      "The tool's input (free-form text)."}}, "required": ["input"]}
            add(t.get("name"), desc, params, "custom", where)
        elif typ == "local_shell":
            add("local_shell", "Runs a shell command (an argv list) and returns its output.", LOCAL_SHELL_PARAMS,
                "local_shell", where)
        elif typ == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not isinstance(t.get("tools"), list):
                raise bad(f"{where}: a namespace needs 'name' and 'tools'", "tools")
            for j, f in enumerate(t["tools"]):
                if not isinstance(f, dict) or f.get("type", "function") != "function":
                    raise bad(f"{where}.tools[{j}]: only function tools are supported in a namespace", "tools")
                add(f.get("name"), f.get("description"), f.get("parameters"), "function", f"{where}.tools[{j}]", ns)
        elif typ in _IGNORED_TOOLS:
            ignored.append(typ)
        else:
            raise bad(f"{where}: tool type {typ!r} is not supported (function, custom, local_shell and namespace "
                      "tools are; web_search, image_generation and tool_search are ignored)", "tools")
    try:
        tools_json = dumps(raw)
    except UnicodeEncodeError as e:
        raise bad(f"'tools' contains text that is not valid Unicode: {e.reason}", "tools") from None
    return (out or None), kinds, ignored, tools_json


def _tool_choice(raw: Any, kinds: dict[str, dict]) -> tuple[bool, Any]:
    if raw is None or raw == "auto":
        return bool(kinds), ("auto" if kinds else None)
    if raw == "none":
        return False, "none"
    if raw == "required":
        if not kinds:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return True, "required"
    if isinstance(raw, dict):
        t = raw.get("type")
        if t in ("function", "custom"):
            if not isinstance(raw.get("name"), str) or raw["name"] not in kinds:
                raise bad(f"tool_choice names {raw.get('name')!r}, which is not in 'tools'", "tool_choice")
            return True, {"name": raw["name"]}
        if t == "allowed_tools":
            return bool(kinds), "required" if raw.get("mode") == "required" else "auto"
        if t in _IGNORED_TOOLS or t == "local_shell":
            return bool(kinds), "auto"
    raise bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _num(body: dict, key: str, default: Any, cast=float, lo: float | None = None, hi: float | None = None) -> Any:
    return number(body, key, default, cast, lo, hi, not_a_number="Invalid type for '{key}': expected a number",
                  not_finite="Invalid type for '{key}': expected a number",
                  out_of_range="Invalid '{key}': {v} is out of range [{lo}, {hi}]")


def _reasoning_text(it: dict) -> str:
    content = it.get("content")
    if isinstance(content, list) and content:
        return _parts_text(content, "reasoning.content", "")
    enc = it.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(_ENC):
        try:
            return base64.b64decode(enc[len(_ENC):]).decode()
        except ValueError:
            pass
    summary = it.get("summary")
    if isinstance(summary, list):
        return "\n\n".join(s["text"] for s in summary if isinstance(s, dict) and isinstance(s.get("text"), str))
    return ""


def _output_text(out: Any, where: str) -> str:
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        return _parts_text(out, where)
    if isinstance(out, dict) and isinstance(out.get("content"), str):  # Codex's old {content, success}
        return out["content"]
    raise bad(f"{where}: 'output' must be a string or a list of input_text parts", "input")


def _call(name: Any, args: Any, call_id: Any, where: str) -> tuple:
    if not isinstance(name, str) or not name:
        raise bad(f"{where}: missing required parameter 'name'", "input")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}: missing required parameter 'call_id'", "input")
    return ("call", name, canon_args(args), call_id)


def _item(it: Any, where: str) -> tuple:
    """One input item translated (pure: reused for an item sent again): ("message", role, text),
    ("reasoning", text), ("call", name, canonical arguments, call_id), ("output", call_id, text), ("skip",)."""
    if not isinstance(it, dict):
        raise bad(f"{where} must be an object", "input")
    t = it.get("type", "message" if "role" in it else None)
    if t == "message":
        role = it.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
        text = _parts_text(it.get("content"), f"{where}.content", "" if role == "assistant" else "\n")
        return ("message", "system" if role == "developer" else role, text)
    if t == "reasoning":
        return ("reasoning", _reasoning_text(it))
    if t == "function_call":
        args = it.get("arguments")
        if not isinstance(args, str):
            raise bad(f"{where}: 'arguments' must be a JSON string", "input")
        return _call(it.get("name"), call_arguments(args, where), it.get("call_id"), where)
    if t == "custom_tool_call":
        if not isinstance(it.get("input"), str):
            raise bad(f"{where}: 'input' must be a string", "input")
        return _call(it.get("name"), {"input": it["input"]}, it.get("call_id"), where)
    if t == "local_shell_call":
        act = it.get("action")
        if not isinstance(act, dict) or not isinstance(act.get("command"), list):
            raise bad(f"{where}: 'action' must be an exec action with a command list", "input")
        args = {"command": act["command"]}
        if act.get("working_directory") is not None:
            args["workdir"] = act["working_directory"]
        if act.get("timeout_ms") is not None:
            args["timeout_ms"] = act["timeout_ms"]
        return _call("local_shell", args, it.get("call_id") or it.get("id"), where)
    if t in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
        cid = it.get("call_id") or (it.get("id") if t == "local_shell_call_output" else None)
        if not isinstance(cid, str) or not cid:
            raise bad(f"{where}: missing required parameter 'call_id'", "input")
        return ("output", cid, _output_text(it.get("output"), f"{where}.output"))
    if t == "web_search_call":
        return ("skip",)  # a hosted call we never produce; nothing to render
    raise bad(f"{where}: input item of type {t!r} is not supported", "input")


def _items(items: list, out: list[Msg], where0: str, cache: dict | None = None) -> None:
    """Translated items assembled into messages: a run of assistant-side items (reasoning, an
    assistant message, calls) is one assistant message, as one reply renders it. Resumes from the
    previous call's assembly (``assembled_before``) at a point where no run was open."""
    pieces = memo_items(items, lambda it, i: _item(it, f"{where0}[{i}]"), cache)
    start, msgs, marks = assembled_before(pieces, cache)
    names = names_before(cache, start)  # call id -> function name, for the tool messages
    if names is None:
        names = {p[3]: p[1] for p in pieces[:start] if p[0] == "call"}
    cur: Msg | None = None  # the assistant message a run of assistant-side items is building
    reasoning: str | None = None  # a reasoning item waiting for its message

    def assistant() -> Msg:
        nonlocal cur, reasoning
        if cur is None:
            cur = Msg(role="assistant", content="", reasoning=reasoning)
            reasoning = None
            msgs.append(cur)
        return cur

    for i in range(start, len(pieces)):
        p = pieces[i]
        k = p[0]
        if k == "message":
            if p[1] == "assistant":
                if cur is not None and (cur.calls or cur.content):  # text after calls: a new turn
                    cur = None
                m = assistant()
                m.content += p[2]
                continue
            cur, reasoning = None, None  # reasoning not followed by an assistant turn: nothing to attach it to
            msgs.append(Msg(role=p[1], content=p[2]))
        elif k == "reasoning":
            cur = None
            reasoning = p[1]
        elif k == "call":
            m = assistant()
            m.calls = m.calls + ((p[1], p[2]),)
            m.call_ids = m.call_ids + (p[3],)
            names[p[3]] = p[1]
        elif k == "output":
            cur, reasoning = None, None
            msgs.append(Msg(role="tool", content=p[2], name=names.get(p[1]), tool_call_id=p[1]))
        if cur is None and reasoning is None:
            marks.append((i + 1, len(msgs)))
    keep_assembled(cache, pieces, marks, msgs, names)
    out.extend(msgs)


def parse(body: Any, history: list | None = None, cache: dict | None = None) -> WireRequest:
    """A ``POST /v1/responses`` body as a :class:`WireRequest`. ``history``: the stored items of
    ``previous_response_id`` (:func:`conversation_items` of that response), required when the
    body names one (the endpoint looks it up; unknown: pass None and get the 400 OpenAI gives).
    ``extras``: ``input_items`` (history + this input, for the store), ``tool_kinds``,
    ``ignored_tools``, ``include``, ``store``, ``previous_response_id``, ``parallel_tool_calls``,
    ``reasoning``, ``text``, ``echo`` (request fields the response object repeats). ``cache``: a
    dict the caller keeps per session (items sent again are not translated again).
    Raises :class:`EndpointError` (400)."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    for k in ("background", "conversation", "prompt"):
        if body.get(k):
            raise bad(f"'{k}' is not supported by this endpoint", k)
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or history is None):
        raise bad(f"Previous response with id {prev!r} not found.", "previous_response_id",
                  "previous_response_not_found")
    instructions = body.get("instructions")
    raw = body.get("input")
    if raw is None:
        raise bad("Missing required parameter: 'input'.", "input")
    if isinstance(raw, str):
        items: list = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        raise bad("'input' must be a string or a list of items", "input")
    all_items = list(history or ()) + items
    msgs: list[Msg] = []
    if isinstance(instructions, str):
        if instructions:
            msgs.append(Msg(role="system", content=instructions))
    elif isinstance(instructions, list):
        _items(instructions, msgs, "instructions")
    elif instructions is not None:
        raise bad("'instructions' must be a string", "instructions")
    _items(all_items, msgs, "input", cache)
    if not msgs:
        raise bad("'input' must not be empty", "input")
    tools, kinds, ignored, tools_json = memo_value(body.get("tools"), _tools, cache, "tools")
    parse_calls, choice = _tool_choice(body.get("tool_choice"), kinds)
    mt = _num(body, "max_output_tokens", None, int, 16)
    temp = _num(body, "temperature", None, float, 0.0, 2.0)
    top_p = _num(body, "top_p", None, float, 0.0, 1.0)
    top_k = _num(body, "top_k", -1, int)  # not in OpenAI's API; vLLM's extension
    samp = Sampling(max_tokens=mt, temperature=1.0 if temp is None else temp, top_p=1.0 if top_p is None else top_p,
                    top_k=top_k, seed=_num(body, "seed", None, int))
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("'include' must be a list of strings", "include")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    ptc = body.get("parallel_tool_calls")
    echo = {"instructions": instructions, "max_output_tokens": mt, "temperature": temp, "top_p": top_p,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": True if ptc is None else bool(ptc), "previous_response_id": prev,
            "store": body.get("store", True) is not False, "truncation": body.get("truncation") or "disabled",
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None,
            "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}}
    try:  # the response object repeats these fields: a lone surrogate (valid JSON, not UTF-8) is refused now
        dumps({k: v for k, v in echo.items() if k != "tools"})
    except UnicodeEncodeError as e:
        raise bad(f"the body contains text that is not valid Unicode: {e.reason}") from None
    extras = {"input_items": all_items, "tool_kinds": kinds, "ignored_tools": ignored, "include": include,
              "store": echo["store"], "previous_response_id": prev, "parallel_tool_calls": echo["parallel_tool_calls"],
              "reasoning": echo["reasoning"], "text": echo["text"], "echo": echo, "tools_json": tools_json}
    return WireRequest(messages=msgs, tools=tools, parse_calls=parse_calls, sampling=samp, stream=stream,
                       model=body.get("model") if isinstance(body.get("model"), str) else None,
                       tool_choice=choice, extras=extras)


# -- replies -------------------------------------------------------------------------------
def response_id(r: Reply) -> str:
    """The ``resp_...`` id of a reply (stable: the key a ``GET /v1/responses/{id}`` looks up)."""
    return r.id if r.id.startswith("resp_") else "resp_" + r.id.rsplit("-", 1)[-1]


def output_items(r: Reply, req: WireRequest | None = None) -> list[dict]:
    """The reply's ``output`` items: reasoning, message, then one call item per tool call."""
    kinds = req.extras.get("tool_kinds", {}) if req is not None else {}
    include = req.extras.get("include", ()) if req is not None else ()
    hexid = response_id(r)[5:]
    items: list[dict] = []
    if r.reasoning:
        it: dict[str, Any] = {"id": f"rs_{hexid}", "type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": r.reasoning}], "status": "completed"}
        if "reasoning.encrypted_content" in include:
            it["encrypted_content"] = _ENC + base64.b64encode(r.reasoning.encode()).decode()
        items.append(it)
    if r.content:
        items.append({"id": f"msg_{hexid}", "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": r.content, "annotations": [], "logprobs": []}]})
    for k, tc in enumerate(r.tool_calls):
        name, arguments = tc["function"]["name"], tc["function"]["arguments"]
        info = kinds.get(name, {})
        kind = info.get("kind", "function")
        if kind == "custom":
            a = call_arguments(arguments, "arguments")
            text = a.get("input") if isinstance(a, dict) and isinstance(a.get("input"), str) else \
                (a if isinstance(a, str) else arguments)
            items.append({"id": f"ctc_{hexid}_{k}", "type": "custom_tool_call", "status": "completed",
                          "call_id": tc["id"], "name": name, "input": text})
        elif kind == "local_shell" and isinstance(a := call_arguments(arguments, "arguments"), dict) \
                and isinstance(a.get("command"), list) and all(isinstance(c, str) for c in a["command"]):
            items.append({"id": f"lsh_{hexid}_{k}", "type": "local_shell_call", "status": "completed",
                          "call_id": tc["id"], "action": {
                              "type": "exec", "command": a["command"], "env": {},
                              "timeout_ms": a.get("timeout_ms"), "working_directory": a.get("workdir"),
                              "user": None}})
        else:  # a function (or a malformed local_shell call: the client reports the bad arguments)
            it = {"id": f"fc_{hexid}_{k}", "type": "function_call", "status": "completed", "call_id": tc["id"],
                  "name": name, "arguments": arguments}
            if info.get("namespace"):
                it["namespace"] = info["namespace"]
            items.append(it)
    return items


def _usage(r: Reply) -> dict:
    return {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _response(r: Reply, req: WireRequest | None, output: list[dict], status: str) -> dict:
    echo = req.extras.get("echo", {}) if req is not None else {}
    done = status != "in_progress"
    instr = echo.get("instructions")
    return {
        "id": response_id(r), "object": "response", "created_at": r.created, "status": status,
        "background": False, "completed_at": (int(time.time()) if done else None), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": instr if isinstance(instr, (str, list)) else None,
        "max_output_tokens": echo.get("max_output_tokens"), "model": r.model, "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": echo.get("reasoning") or {"effort": None, "summary": None}, "store": echo.get("store", True),
        "temperature": echo.get("temperature"), "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []), "top_p": echo.get("top_p"),
        "truncation": echo.get("truncation", "disabled"), "usage": _usage(r) if done else None,
        "user": echo.get("user"), "metadata": echo.get("metadata", {}),
    }


def _status(r: Reply) -> str:
    return "incomplete" if r.finish_reason == "length" and not r.tool_calls else "completed"


def response(r: Reply, req: WireRequest | None = None) -> dict:
    """The non-streaming ``response`` object (also what ``GET /v1/responses/{id}`` returns)."""
    return _response(r, req, output_items(r, req), _status(r))


def _with_tools(obj: dict, tools_json: bytes) -> tuple[bytes, ...]:
    """The pieces of ``dumps(obj)`` with its ``tools`` (the request's, often tens of KB: a coding
    harness's whole list) as the JSON the request parse kept, put last, instead of encoding them
    again per reply; joined once by the caller (each ``+`` copied the tools again)."""
    rest = dict(obj)
    del rest["tools"]
    return dumps(rest)[:-1], b',"tools":', tools_json, b"}"


def response_body(obj: dict, req: WireRequest | None = None) -> bytes:
    """The JSON body of a ``response`` object made for ``req`` (:func:`response`)."""
    tools_json = req.extras.get("tools_json") if req is not None else None
    return dumps(obj) if tools_json is None else b"".join(_with_tools(obj, tools_json))


def conversation_items(req: WireRequest, r: Reply) -> list[dict]:
    """What to store under :func:`response_id` for a later ``previous_response_id``: the request's
    items (its history included) followed by the reply's output items."""
    return list(req.extras.get("input_items", ())) + output_items(r, req)


def stream_events(r: Reply, req: WireRequest | None = None) -> list[bytes]:
    """The reply as the Responses event sequence, each with its ``sequence_number``:
    ``response.created``, ``response.in_progress``; per output item ``response.output_item.added``,
    its content events (``content_part.added``, ``output_text.delta``/``.done`` /
    ``reasoning_text.delta``/``.done``, ``content_part.done``; ``function_call_arguments.delta``/
    ``.done``; ``custom_tool_call_input.delta``/``.done``), ``response.output_item.done``; then
    ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``)."""
    seq = 0
    out: list[bytes] = []
    tools_json = req.extras.get("tools_json") if req is not None else None

    def ev(kind: str, **data: Any) -> None:
        nonlocal seq, tools_json
        d = {"type": kind, "sequence_number": seq}
        d.update(data)
        resp = d.get("response")
        if resp is None:
            out.append(b"".join((b"event: ", kind.encode(), b"\ndata: ", dumps(d), b"\n\n")))
        else:  # the request's tools (often large) are echoed three times: encoded once, put last
            if tools_json is None:
                tools_json = dumps(resp["tools"])
            d["response"] = None
            out.append(b"".join((b"event: ", kind.encode(), b"\ndata: ", dumps(d)[:-len(b"null}")],
                                 *_with_tools(resp, tools_json), b"}\n\n")))
        seq += 1

    ev("response.created", response=_response(r, req, [], "in_progress"))
    ev("response.in_progress", response=_response(r, req, [], "in_progress"))
    items = output_items(r, req)
    for i, it in enumerate(items):
        t, iid = it["type"], it["id"]
        if t == "message":
            text = it["content"][0]["text"]
            ev("response.output_item.added", output_index=i, item=dict(it, status="in_progress", content=[]))
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ev("response.content_part.added", item_id=iid, output_index=i, content_index=0, part=empty)
            ev("response.output_text.delta", item_id=iid, output_index=i, content_index=0, delta=text, logprobs=[])
            ev("response.output_text.done", item_id=iid, output_index=i, content_index=0, text=text, logprobs=[])
            ev("response.content_part.done", item_id=iid, output_index=i, content_index=0, part=it["content"][0])
        elif t == "reasoning":
            text = it["content"][0]["text"]
            ev("response.output_item.added", output_index=i, item=dict(it, status="in_progress", content=[]))
            ev("response.content_part.added", item_id=iid, output_index=i, content_index=0,
               part={"type": "reasoning_text", "text": ""})
            ev("response.reasoning_text.delta", item_id=iid, output_index=i, content_index=0, delta=text)
            ev("response.reasoning_text.done", item_id=iid, output_index=i, content_index=0, text=text)
            ev("response.content_part.done", item_id=iid, output_index=i, content_index=0, part=it["content"][0])
        elif t == "function_call":
            ev("response.output_item.added", output_index=i, item=dict(it, status="in_progress", arguments=""))
            ev("response.function_call_arguments.delta", item_id=iid, output_index=i, delta=it["arguments"])
            ev("response.function_call_arguments.done", item_id=iid, output_index=i, name=it["name"],
               arguments=it["arguments"])
        elif t == "custom_tool_call":
            ev("response.output_item.added", output_index=i, item=dict(it, status="in_progress", input=""))
            ev("response.custom_tool_call_input.delta", item_id=iid, output_index=i, delta=it["input"])
            ev("response.custom_tool_call_input.done", item_id=iid, output_index=i, input=it["input"])
        else:  # local_shell_call: no delta events
            ev("response.output_item.added", output_index=i, item=dict(it, status="in_progress"))
        ev("response.output_item.done", output_index=i, item=it)
    status = _status(r)
    ev("response.completed" if status == "completed" else "response.incomplete",
       response=_response(r, req, items, status))
    return out
