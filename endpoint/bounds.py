"""What one job's endpoint traffic may cost, and the refusals that say so: the per-job limits
(``EndpointLimits``) and HTTP bounds (``EndpointBounds``), the body bound's ingredient
(``max_bytes_per_token``), the cheap checks made before tokenizing (JSON nesting, message
sizes), the context-window refusal in vLLM's words (``too_long``), an encode worker's refusal
as the agent's error, and errors with the backends' addresses taken out (docs/HARNESS.md, "Bounds").
"""

from __future__ import annotations

import concurrent.futures
import json
import operator
import re
import threading
from dataclasses import dataclass
from typing import Any

from ..llm.encode_worker import EncodeRefused
from .resent import ResentBodies
from .wire import EndpointError, Msg, bad, same_objects, same_prefix


@dataclass(slots=True)
class EndpointLimits:
    """Per-job limits. ``deadline`` is a ``time.monotonic()`` instant (None: none)."""

    max_llm_calls: int | None = None
    max_context: int = 32768
    max_tokens: int = 1024  # per request, when the request names none (capped by the context left)
    deadline: float | None = None
    max_aborts: int = 3  # server-side aborts (weight swaps) continued within one request
    max_cpu_s: float = 300.0  # CPU the endpoint may spend preparing this job's requests, all calls together
    max_request_cpu_s: float = 10.0  # CPU one request's tokenizing may take (in an encode worker; llm/encode_worker.py)


@dataclass(slots=True)
class EndpointBounds:
    """What one job's HTTP traffic may cost the run daemon (docs/HARNESS.md, "Bounds").

    The body bound itself is per session (:meth:`EndpointSession.max_body`): it derives from
    the job's context window and the tokenizer's longest token."""

    max_header_bytes: int = 64 * 1024  # request target + header fields (endpoint/server.py): 431
    max_headers: int = 100  # header fields: 431
    request_timeout_s: float = 30.0  # a request (headers and body) not complete this long after its first byte: 408
    send_timeout_s: float = 60.0  # a reply (head and body) the client does not take in this long: the connection is closed
    max_connections: int = 64  # open connections per job: more are answered 503 and closed
    max_inflight: int = 16  # requests being handled per job: more get 429
    max_depth: int = 400  # JSON nesting: deeper bodies get 400
    json_overhead: int = 64 * 1024  # body bytes allowed beyond the content bound (JSON structure, sampling fields)
    json_expansion: int = 6  # body bytes per content byte at most (\u00XX escapes)


# Endpoint requests are parsed, rendered and tokenized here, never on the run daemon's loop:
# the tokenizer releases the GIL for long texts (tokenizer_utils.FastEncoder), so a job's big
# request costs a thread, not every job's latency. One thread per job at a time (_Session.work).
POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="endpoint")
_MBPT: dict[int, tuple[Any, int]] = {}
_MBPT_LOCK = threading.Lock()


def max_bytes_per_token(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` decodes to (control tokens included;
    a lone byte of a multi-byte character counts as its 3-byte replacement: an upper bound).
    Cached per tokenizer object; ~0.5 s for a 150k vocabulary, so call it off the loop."""
    hit = _MBPT.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    with _MBPT_LOCK:
        hit = _MBPT.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        b = getattr(tokenizer, "backend_tokenizer", None)
        if b is not None:
            n = b.get_vocab_size(with_added_tokens=True)
            texts = b.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        else:
            texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokenizer))]
        m = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
        _MBPT[id(tokenizer)] = (tokenizer, max(1, m))
        return max(1, m)


_ADDRESS = re.compile(r"\b(?:https?|tcp|ipc|unix)://[^\s,;'\"]+")


def unaddressed(e: BaseException) -> str:
    """An error's message without the addresses it names (a backend's or router's URL): an agent
    is never told where the job's backends are."""
    msg = str(e)
    backend = getattr(e, "backend", None)
    if isinstance(backend, str) and backend:
        msg = msg.replace(backend, "the backend")
    return _ADDRESS.sub("the backend", msg)


def too_long(n: int, limit: int, detail: str = "", *, at_least: bool = False) -> EndpointError:
    """A prompt past the context window, in vLLM's words (what harnesses match to compact and
    retry: Pi's overflow recovery reads "maximum context length is N tokens")."""
    past = ("which exceeds this limit even without any output tokens" if n > limit
            else "which leaves no room for any output tokens")
    return bad(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
               f"{'at least ' if at_least else ''}{n} input tokens, {past}. Please reduce the length of the input "
               f"prompt." + (f" ({detail})" if detail else ""), "messages", "context_length_exceeded")


def nesting_ok(obj: Any, limit: int, prev: Any = None) -> bool:
    """No container of ``obj`` deeper than ``limit`` (iterative: deep input must not recurse).
    ``prev``: a body that passed this check with the same ``limit``; an item of a top-level list
    of ``obj`` equal to the item at the same position under the same key in ``prev``, or a value
    that is ``prev``'s very object under the same key, is not walked again (agents resend their
    whole history every call: the walk was 0.4-1.4 ms per call at 200 messages, the equality is C
    speed and recurses no deeper than ``prev``'s item)."""
    stack = [(obj, 1)]
    if type(obj) is dict and type(prev) is dict and limit >= 3:
        stack = []
        for k, v in obj.items():
            p = prev.get(k)
            if v is p:  # the previous body's very object (resent.py), which passed
                continue
            if type(v) is list and type(p) is list:  # the list is at depth 2, its items at 3
                n, same = len(p), same_prefix(v, p)
                stack.extend((x, 3) for i, x in enumerate(v[same:], same)
                             if type(x) in (dict, list) and not (i < n and (x is p[i] or x == p[i])))
            elif type(v) in (dict, list):
                stack.append((v, 2))
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        if type(o) is dict:
            stack.extend((v, d + 1) for v in o.values() if type(v) in (dict, list))
        elif type(o) is list:
            stack.extend((v, d + 1) for v in o if type(v) in (dict, list))
    return True


def load_body(raw: bytes | dict, depth: int, resent: ResentBodies | None = None, new_chars: int | None = None) -> dict:
    """The JSON body (bounded nesting) as a dict. ``resent``: the job's bodies so far (see
    :mod:`.resent`): the history the body resends is neither decoded nor walked again
    (:func:`nesting_ok`'s ``prev``); ``new_chars`` (with ``resent``): ``resent.Unshared`` when
    more than that many characters of it are new."""
    if isinstance(raw, dict):
        return raw
    try:
        body = json.loads(raw) if resent is None else resent.decode(raw, new_chars)
    except RecursionError:
        body = None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    if body is None or not nesting_ok(body, depth, resent.body if resent is not None else None):
        raise bad(f"the body is nested deeper than {depth} levels")
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    if resent is not None:
        resent.keep(body)
    return body


_CONTENT = operator.attrgetter("content")


class SizeCheck:
    """Refuses messages no tokenization of which fits the context window, before tokenizing them.

    Counts only what is new: a request's messages that are the last checked request's very
    objects (a resent history, reused by the shape's parse) are not walked again; their
    characters are remembered (at 200 messages the walk was ~35 us a request, its misses in
    the cache more than the sums). A reused message is never changed (the tree's matching
    relies on the same)."""

    __slots__ = ("msgs", "n", "chars")

    def __init__(self) -> None:
        self.msgs: list[Msg] = []
        self.n = self.chars = 0  # how many of them were counted (the list may grow after), their characters

    def check(self, msgs: list[Msg], mbpt: int | None, max_context: int) -> None:
        # A token is at most max_bytes_per_token bytes, a character at least one byte.
        if len(msgs) > max_context:
            raise bad(f"{len(msgs)} messages cannot fit this job's context window of {max_context} "
                      "tokens", "messages", "context_length_exceeded")
        n = self.n
        known = n if len(msgs) >= n and same_objects(msgs, self.msgs[:n]) == n else 0
        chars = (self.chars if known else 0) + sum(map(len, map(_CONTENT, msgs[known:])))
        self.msgs, self.n, self.chars = msgs, len(msgs), chars
        if mbpt is not None and chars > mbpt * max_context:
            raise bad(f"the messages hold {chars} characters; no tokenization of them fits this job's context "
                      f"window of {max_context} tokens", "messages", "context_length_exceeded")


def encode_refusal(e: EncodeRefused, lim: EndpointLimits, cpu_spent: float) -> EndpointError:
    """A text refused by its encode worker, as the agent's error (docs/HARNESS.md, "Bounds")."""
    if e.kind == "tokens":
        return too_long(e.count, lim.max_context, "counting stopped there", at_least=True)
    if e.kind == "cpu" and cpu_spent >= lim.max_cpu_s:
        return EndpointError(429, f"this job's requests used more than {lim.max_cpu_s:g} s of the endpoint's "
                             "CPU", type="insufficient_quota", code="cpu_budget_exhausted", retry=False)
    if e.kind == "cpu":
        return EndpointError(400, f"this request's text is too costly to tokenize: {e} (the bound is "
                             f"{lim.max_request_cpu_s:g} s per request)", code="request_too_costly")
    return EndpointError(413, f"this request's text is too large to tokenize: {e}", code="request_too_large",
                         retry=False)
