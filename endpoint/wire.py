"""The wire types every API shape of the agent-facing endpoint shares: the refusal
(``EndpointError``, OpenAI's error object, which the other shapes reshape), the normalized
message (``Msg``), sampling fields (``Sampling``), a translated request (``WireRequest``), an
answered request (``Reply``), and the per-conversation memo the shapes' parsers reuse.

Each shape's own parsing and rendering lives in :mod:`rolloutd.endpoint.shapes` (``chat``
for OpenAI Chat Completions and Completions, ``responses``, ``anthropic``, ``gemini``).
"""

from __future__ import annotations

import bisect
import json
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any

from ..llm.client import SamplingParams

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class EndpointError(Exception):
    """A request the endpoint refuses: ``status`` plus OpenAI's error object.

    400 ``invalid_request_error`` (bad body, ``n > 1``, ``context_length_exceeded``),
    401 bad API key, 404 unknown route, 413 body too large, 429 ``insufficient_quota``
    (``max_llm_calls`` spent), 503 (job cancelled, past its deadline, no backend).
    ``retry=False`` adds ``x-should-retry: false``, which the ``openai`` SDK honours, so an
    agent does not retry a refusal that cannot change.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry = retry

    def body(self) -> bytes:
        return _dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                 "code": self.code}}).encode()


def bad(message: str, param: str | None = None, code: str | None = None) -> EndpointError:
    return EndpointError(400, message, param=param, code=code)


# -- requests ------------------------------------------------------------------------------
def text_of(content: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") == "refusal":
                parts.append(str(p.get("refusal") or ""))
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad(f"{where}: content part of type {kind!r} is not supported (text only)", "messages")
        return "\n".join(parts)  # as vLLM's chat route joins a message's text parts, every role
    raise bad(f"{where}: content must be a string, null or a list of text parts", "messages")


def call_arguments(raw: Any, where: str) -> Any:
    """A tool call's ``arguments`` (a JSON string on the wire) as a Python value."""
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # kept verbatim: rendered as the string it is
    if raw is None:
        return {}
    return raw


def args_object(arguments: str) -> dict:
    """A reply's tool-call arguments as the object Anthropic's ``input`` and Gemini's ``args``
    must be (a non-object value wrapped as ``{"input": value}``)."""
    v = call_arguments(arguments, "arguments")
    return v if isinstance(v, dict) else {"input": v}


@dataclass(slots=True)
class Msg:
    """One request message, normalized. ``key`` compares messages across requests."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    calls: tuple = ()  # ((name, arguments-as-JSON-text), ...)
    call_ids: tuple = ()
    reasoning: str | None = None

    @property
    def key(self) -> tuple:
        return (self.role, self.content, self.name, self.tool_call_id, self.calls)

    def template_dict(self) -> dict:
        """What the chat template gets (tool-call arguments as objects, as vLLM passes them)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None and self.role == "assistant":  # the template decides what to show
            d["reasoning_content"] = self.reasoning
        if self.calls:
            d["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": n, "arguments": json.loads(getattr(a, "ordered", a))}}
                for (n, a), cid in zip(self.calls, self.call_ids)
            ]
        return d





class Args(str):
    """Tool-call arguments as canonical JSON (sorted keys: equal values compare equal, whatever
    order an agent re-serialises them in), with ``ordered``, the JSON in the client's key order,
    which is what the template renders (as vLLM and Hugging Face pass the client's object)."""

    ordered: str


def canon_args(args: Any) -> Args:
    a = Args(json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":")))
    a.ordered = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return a



def tools_given(raw: Any, not_a_list: str) -> bool:
    """Whether a request names tools: False for none (absent, null or ``[]``); a ``tools`` that is
    not a list is refused with ``not_a_list`` (each shape's own words)."""
    if raw is None or raw == []:
        return False
    if not isinstance(raw, list):
        raise bad(not_a_list, "tools")
    return True


def number(body: dict, key: str, default: Any, cast=float, lo: float | None = None, hi: float | None = None, *,
           not_a_number: str = "'{key}' must be a number", not_finite: str = "'{key}' must be a finite number",
           out_of_range: str = "'{key}' = {v} is out of range [{lo}, {hi}]") -> Any:
    """A numeric request field (absent or null: ``default``), cast and range-checked; the refusals
    are format strings over ``key``, ``v``, ``lo``, ``hi`` (each shape's own words)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(not_a_number.format(key=key), key)
    if isinstance(v, float) and not math.isfinite(v):  # json.loads takes NaN and Infinity
        raise bad(not_finite.format(key=key), key)
    v = cast(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(out_of_range.format(key=key, v=v, lo=lo, hi=hi), key)
    return v


@dataclass(slots=True)
class Sampling:
    """The per-request sampling fields, before the context window caps ``max_tokens``."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=list(self.stop_token_ids))




def same_prefix(a: list, b: list) -> int:
    """How many leading items of ``a`` equal (or are) ``b``'s at the same positions. Agents resend
    their whole history every call: when the shorter list is all the other's (the usual call, the
    very objects where the history cache reused them), one C-level list comparison answers, not a
    Python step per item (~0.3 us each at 200 messages, in each of a request's passes)."""
    n = min(len(a), len(b))
    if not n or a[:n] == b[:n]:
        return n
    k = 0
    while a[k] is b[k] or a[k] == b[k]:  # stops: the slices differ at some k < n
        k += 1
    return k


def same_objects(a: list, b: list) -> int:
    """How many leading items of ``a`` are ``b``'s very objects (``same_prefix`` by identity)."""
    n = min(len(a), len(b))
    if all(map(operator.is_, a[:n], b[:n])):
        return n
    k = 0
    while a[k] is b[k]:
        k += 1
    return k


def memo_items(items: list, fn: Any, cache: dict | None) -> list:
    """``[fn(item, i) for i, item in enumerate(items)]``, where an item equal to the one at the same
    position of the previous call with this ``cache`` reuses that call's result: agents resend their
    whole history every call, and dict equality is C speed. ``fn`` must be a pure function of the
    item and its position, with a result nobody mutates. ``cache`` is any dict the caller keeps per
    conversation source (None: no reuse); it is updated only when every item translated."""
    prev, prev_out = (cache.get("items"), cache.get("out")) if cache is not None else (None, None)
    n_prev = len(prev) if prev is not None else 0
    k = same_prefix(items, prev) if n_prev else 0
    out = prev_out[:k] if k else []
    out += [prev_out[i] if i < n_prev and (it is prev[i] or it == prev[i]) else fn(it, i)
            for i, it in enumerate(items[k:], k)]
    if cache is not None:
        cache["items"], cache["out"] = items, out
    return out


def assembled_before(pieces: list, cache: dict | None) -> tuple[int, list, list]:
    """Where to resume assembling messages from ``pieces`` (``memo_items``' result): the previous
    call's messages (``keep_assembled``) up to its last clean point -- an item boundary after which
    no message was still being built -- among the leading items whose pieces are that call's very
    objects (so a resent history is not assembled again, and its messages match the conversation
    by identity). Returns (items done, their messages, the clean points so far as (items, messages)).
    A message is never changed once past a clean point."""
    prev = cache.get("assembled") if cache is not None else None
    if prev is None:
        return 0, [], []
    p_pieces, marks, p_msgs, _ = prev
    k = same_objects(pieces, p_pieces)
    j = bisect.bisect_right(marks, (k, math.inf))  # the last clean point at or before item k
    if not j:
        return 0, [], []
    return marks[j - 1][0], p_msgs[:marks[j - 1][1]], marks[:j]


def keep_assembled(cache: dict | None, pieces: list, marks: list, msgs: list, names: dict | None = None) -> None:
    """Remember this call's assembly for the next (``assembled_before``), and the tool-call id ->
    name map of all its pieces if the shape keeps one (``names_before``: never changed after, the
    next call changes a copy)."""
    if cache is not None:
        cache["assembled"] = (pieces, marks, msgs, names)


def names_before(cache: dict | None, start: int) -> dict | None:
    """A copy of the previous call's tool-call id -> name map when ``start`` (``assembled_before``'s
    resume point) is all of its pieces: the history was resent as it was and the map covers
    exactly the pieces before ``start``. None otherwise: the caller builds it from those pieces
    (at 200 messages that walk was ~70% of an Anthropic request's cached translation)."""
    prev = cache.get("assembled") if cache is not None else None
    if prev is None or prev[3] is None or len(prev[0]) != start:
        return None
    return dict(prev[3])


def memo_value(raw: Any, fn: Any, cache: dict | None, key: str) -> Any:
    """``fn(raw)``, reused when ``raw`` equals the previous call's under ``key`` in ``cache`` (an
    agent sends the same ``tools`` every call); ``fn`` must be pure, its result never mutated."""
    if cache is None:
        return fn(raw)
    hit = cache.get(key)
    if hit is not None and (hit[0] is raw or hit[0] == raw):
        return hit[1]
    out = fn(raw)
    cache[key] = (raw, out)
    return out


@dataclass(slots=True)
class WireRequest:
    """A request of any API shape (Anthropic Messages, OpenAI Responses, Gemini), translated:
    what the chat path gets from ``parse_messages``/``parse_tools``/``parse_tool_choice``/
    ``parse_sampling``, plus what the shape's renderer needs back (``extras``)."""

    messages: list[Msg]
    tools: list[dict] | None  # OpenAI function format, as the chat template takes them
    parse_calls: bool  # False: tool_choice none (the reply is returned as text)
    sampling: Sampling
    stream: bool = False
    model: str | None = None
    tool_choice: Any = None  # normalized: None, "auto", "none", "required" or {"name": ...}
    extras: dict = field(default_factory=dict)


# -- responses -----------------------------------------------------------------------------
@dataclass(slots=True)
class Reply:
    """One answered request, ready to be shaped as a response or as stream chunks."""

    id: str
    model: str
    content: str | None
    tool_calls: list[dict]
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    token_strs: list[str] | None = None  # filled when the request asked for logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    stop_sequence: str | None = None  # the request's stop string that ended it (Anthropic's stop_sequence)



def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "rolloutd"}]}


def dumps(obj: Any) -> bytes:
    return _dumps(obj).encode()
