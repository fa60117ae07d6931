"""A per-job OpenAI-compatible LLM endpoint that records exact token-level trajectories.

An unmodified agent program (mini-swe-agent, an ``openai`` SDK tool loop) talks to this
endpoint instead of a model server; every call is rendered to token ids, sent to the
job's leased backend, and recorded as the trajectory a trainer gets.

Interface (what the harness handler uses)::

    session = EndpointSession(generate, tokenizer, parser="hermes", limits=EndpointLimits(...))
    server = await serve(make_app(session), uds="/path/llm.sock")   # or host="127.0.0.1", port=0
    ... run the agent with OPENAI_BASE_URL = server.base_url (or the in-sandbox relay's URL) ...
    session.cancel("cancelled")     # job cancelled / timed out: refuse new calls, abort the one in flight
    await server.stop()
    traj = session.trajectory()     # prompt_ids, response_ids, loss_mask, logprobs, turns, policy_version,
                                    # segments (only with 2+), metrics (to merge into the job's metrics)
    if session.fatal: raise session.fatal   # e.g. StaleLease: the run daemon's staleness policy decides

* ``generate`` is the job's LLM callable, ``await generate(prompt_ids, SamplingParams) ->
  (Generation, backend_id, policy_version)``: the run daemon passes its leased ``LLMSession``
  (router lease, failover, capacity, staleness, policy_version per turn); tests and scripts pass
  ``simple_generate(LLMClient(...))``.
* Routes: ``POST /v1/chat/completions`` (non-streaming and ``stream: true`` SSE),
  ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``; the ``/v1`` prefix is optional.
  Errors use OpenAI's JSON error shape (:class:`~rolloutd.llm.openai_wire.EndpointError`).
  Other API shapes on the same session (``anthropic_wire``, ``responses_wire``, ``gemini_wire``
  translate): ``POST /v1/messages`` and ``/v1/messages/count_tokens``, ``POST /v1/responses`` and
  ``GET /v1/responses/{id}``, ``POST /v1beta/models/{m}:generateContent|:streamGenerateContent|
  :countTokens``; each answers errors in its own shape.
* A session's requests run concurrently; each conversation is extended by one at a time.
  Request parsing, rendering and tokenization run in endpoint threads, never on the caller's
  loop; ``EndpointBounds`` bounds what one job's traffic may cost (docs/HARNESS.md, "Bounds").
* ``parser`` names a tool-call parser of the registry (``rolloutd.llm.toolparse``); ``conv_options``
  are extra ``Conversation`` keywords (model-family settings); ``api_key`` is checked when set.

Token capture. Each session keeps every conversation it opened (a *segment*: a
:class:`Conversation` plus the messages it represents, where the assistant messages are the
replies we sampled). A request whose ``messages`` start with exactly one segment's messages
(our replies sent back as text or as structured ``tool_calls``, the same tools; the longest
such segment that no other request is extending) *extends* it: only the new messages are
rendered (with the template's own delimiters, :meth:`Conversation.add_messages`) and the
assistant turns stay the exact sampled ids. A request that repeats a segment's messages up to
one of its replies and then goes another way (the main loop after a compaction side call, a
retry after our reply, a second subagent with the same opening) *forks* it: a new segment whose
prompt is that segment's exact ids up to the reply plus the rest rendered with the template's
delimiters (:meth:`Conversation.fork`). Any other request (an edited or summarized history,
other tools) opens a new segment rendered from the request's messages. docs/HARNESS.md says
what a trainer does with segments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from .client import Generation, SamplingParams
from .conversation import Conversation
from .encode_worker import ENCODE_STATS, TRIM_BYTES, EncodeRefused, release_memory
from .errors import BackendError, ContextOverflow, RequestError
from .openai_wire import (
    EndpointError,
    Msg,
    Reply,
    Sampling,
    WireRequest,
    bad,
    canon_args,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    dumps,
    models_response,
    parse_messages,
    parse_sampling,
    parse_tool_choice,
    parse_tools,
)
from .tokenizer_utils import encode_bounds, fast_encoder
from .toolparse import CallIds, get_parser, parse_reply, parser_name_for

log = structlog.get_logger("rolloutd.llm")

__all__ = ["EndpointBounds", "EndpointError", "EndpointLimits", "EndpointServer", "EndpointSession", "make_app",
           "max_bytes_per_token", "serve"]

GenerateFn = Callable[[Any, SamplingParams], Awaitable[tuple[Generation, str, int]]]


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

    max_header_bytes: int = 64 * 1024  # request line + headers (h11's max incomplete event size): 400
    max_headers: int = 100  # header fields: 431
    request_timeout_s: float = 30.0  # a request (headers and body) not complete this long after its first byte: 408
    send_timeout_s: float = 60.0  # a reply the client does not take in this long: the connection is closed
    max_connections: int = 64  # open connections per job: more are answered 503 and closed
    max_inflight: int = 16  # requests being handled per job: more get 429
    max_depth: int = 400  # JSON nesting: deeper bodies get 400
    json_overhead: int = 64 * 1024  # body bytes allowed beyond the content bound (JSON structure, sampling fields)
    json_expansion: int = 6  # body bytes per content byte at most (\u00XX escapes)


# Endpoint requests are parsed, rendered and tokenized here, never on the run daemon's loop:
# the tokenizer releases the GIL for long texts (tokenizer_utils.FastEncoder), so a job's big
# request costs a thread, not every job's latency. One thread per job at a time (_Session.work).
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="endpoint")
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


def _unaddressed(e: BaseException) -> str:
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


def _nesting_ok(obj: Any, limit: int) -> bool:
    """No container of ``obj`` deeper than ``limit`` (iterative: deep input must not recurse)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        if type(o) is dict:
            stack.extend((v, d + 1) for v in o.values() if type(v) in (dict, list))
        elif type(o) is list:
            stack.extend((v, d + 1) for v in o if type(v) in (dict, list))
    return True


@dataclass(slots=True, eq=False)
class _Gen:
    """One assistant message we returned: what the agent may send back."""

    content: str  # message.content as returned ("" for null)
    raw: str  # the full sampled text (tool-call markup included)
    calls: tuple  # ((name, canonical JSON arguments), ...) as returned in tool_calls
    n_tokens: int
    ids: np.ndarray | None = None  # the sampled ids (what a new segment's prompt holds for it)
    reused: bool = False
    reencoded: bool = False

    def matches(self, m: Msg) -> bool:
        if m.role != "assistant":
            return False
        c = m.content.strip()
        if m.calls:
            return m.calls == self.calls and c == self.content.strip()
        return c == self.raw.strip() or (not self.calls and c == self.content.strip())


class _Segment:
    """A self-consistent token sequence: a Conversation (chat) or one raw completion."""

    __slots__ = ("busy", "closed", "conv", "cuts", "entries", "index", "last_call", "opened_call", "raw", "tools")

    def __init__(self, index: int, conv: Conversation | None, tools: list | None, entries: list) -> None:
        self.index = index
        self.conv = conv
        self.tools = tools
        self.entries: list[Msg | _Gen] = entries
        self.closed = False  # a request failed mid-way: never extended again
        self.busy = False  # a request is extending it now
        self.opened_call = self.last_call = 0  # the session's request counter when opened / last extended
        self.raw: dict | None = None  # /v1/completions: arrays and the one turn
        # where a fork may start: (entries, conv turns) just after each reply sampled in it (append-only)
        self.cuts: list[tuple[int, int]] = []

    @property
    def n_turns(self) -> int:
        if self.conv is not None:
            return self.conv.num_turns
        return 1 if self.raw is not None else 0

    def record(self) -> dict:
        if self.conv is not None:
            d: dict[str, Any] = dict(self.conv.arrays())
            d["turns"] = turns = self.conv.turns
            end = turns[-1]["end"] if turns else 0
            if turns and len(d["response_ids"]) > end:
                # messages rendered for a call that never sampled (it failed and was not sent again):
                # the trajectory ends with the last sampled turn, as the built-in loop's does
                for k in ("response_ids", "loss_mask", "logprobs"):
                    d[k] = d[k][:end]
                turns[-1]["obs_start"] = turns[-1]["obs_end"] = None
        else:
            assert self.raw is not None
            d = dict(self.raw)
        return d


class EndpointSession:
    """One job's endpoint: its segments, limits and the backend call in flight."""

    def __init__(self, generate: GenerateFn, tokenizer: Any, *, parser: str | None = None, model: str = "rolloutd",
                 limits: EndpointLimits | None = None, api_key: str | None = None,
                 parser_options: dict | None = None, conv_options: dict | None = None) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        # no parser named: the tokenizer's model family's, else hermes
        self.parser = get_parser(parser_name_for(tokenizer, parser), **(parser_options or {}))
        self.call_ids = CallIds(tokenizer)  # the model's call ids <-> the agent's
        self.model = model
        self.limits = limits or EndpointLimits()
        self.api_key = api_key
        self.conv_options = dict(conv_options or {})  # extra Conversation(...) keywords (model-family options)
        self.created = int(time.time())
        self.segments: list[_Segment] = []
        self.fatal: BaseException | None = None
        # requests: every request but /health; refused_calls: every error answer (refused_by_status:
        # "<status> <code>" -> n); llm_calls: requests that reached the backend (limits.max_llm_calls).
        self.metrics: dict[str, Any] = {"requests": 0, "llm_calls": 0, "refused_calls": 0, "refused_by_status": {},
                                        "assistant_tokens_reused": 0,
                                          "assistant_tokens_reencoded": 0, "llm_s": 0.0, "aborts": 0,
                                          "malformed_tool_calls": 0, "forks": 0, "fork_fallbacks": 0,
                                          "budget_replies": 0,
                                          "endpoint_cpu_s": 0.0}
        self._gens: list[_Gen] = []
        self._inflight: set[asyncio.Future] = set()  # backend calls in flight (a job's requests run concurrently)
        self._calls = 0  # requests placed so far: the clock of the segments' side-call accounting
        self._cancelled: str | None = None
        self._decode_cache: dict[int, str] = {}
        self._prev_msgs: tuple[list, list[Msg]] | None = None
        self.bounds = EndpointBounds()
        self._work = asyncio.Semaphore(1)  # this job's share of the endpoint threads: one at a time
        self._mbpt: int | None = None

    # -- bounds ----------------------------------------------------------------------------
    async def _offload(self, fn, *args):
        """Run ``fn(*args)`` in an endpoint thread, one at a time per job; its CPU time, an
        encode worker's included, is counted against ``limits.max_cpu_s``, and long texts are
        tokenized in a worker bounded by the context window and the CPU left (encode_bounds)."""
        lim = self.limits

        def timed():
            t0, w0 = time.thread_time(), ENCODE_STATS.cpu_s
            try:
                cpu = min(lim.max_request_cpu_s, max(0.1, lim.max_cpu_s - self.metrics["endpoint_cpu_s"]))
                with encode_bounds(lim.max_context, cpu):
                    return fn(*args)
            finally:
                self.metrics["endpoint_cpu_s"] += time.thread_time() - t0 + ENCODE_STATS.cpu_s - w0

        async with self._work:
            try:
                return await asyncio.get_running_loop().run_in_executor(_POOL, timed)
            except EncodeRefused as e:
                raise self._encode_refusal(e) from None

    def _encode_refusal(self, e: EncodeRefused) -> EndpointError:
        """A text refused by its encode worker, as the agent's error (docs/HARNESS.md, "Bounds")."""
        lim = self.limits
        if e.kind == "tokens":
            return too_long(e.count, lim.max_context, "counting stopped there", at_least=True)
        if e.kind == "cpu" and self.metrics["endpoint_cpu_s"] >= lim.max_cpu_s:
            return EndpointError(429, f"this job's requests used more than {lim.max_cpu_s:g} s of the endpoint's "
                                 "CPU", type="insufficient_quota", code="cpu_budget_exhausted", retry=False)
        if e.kind == "cpu":
            return EndpointError(400, f"this request's text is too costly to tokenize: {e} (the bound is "
                                 f"{lim.max_request_cpu_s:g} s per request)", code="request_too_costly")
        return EndpointError(413, f"this request's text is too large to tokenize: {e}", code="request_too_large",
                             retry=False)

    async def max_body(self) -> int:
        """The largest body this job may send: one whose content could still fit its context
        window, ``max_context x max bytes per token x json_expansion + json_overhead``."""
        if self._mbpt is None:
            self._mbpt = await asyncio.get_running_loop().run_in_executor(_POOL, max_bytes_per_token, self.tokenizer)
        b = self.bounds
        return self.limits.max_context * self._mbpt * b.json_expansion + b.json_overhead

    def _load(self, raw: bytes | dict) -> dict:
        """The JSON body (bounded nesting) as a dict; runs in an endpoint thread."""
        if isinstance(raw, dict):
            return raw
        depth = self.bounds.max_depth
        try:
            body = json.loads(raw)
        except RecursionError:
            body = None
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON: {e}") from None
        if body is None or not _nesting_ok(body, depth):
            raise bad(f"the body is nested deeper than {depth} levels")
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        return body

    def _prepare_chat(self, raw: bytes | dict):
        """Parse and check a chat request, the cheap refusals first; runs in an endpoint thread."""
        body = self._load(raw)
        msgs_raw = body.get("messages")
        if isinstance(msgs_raw, list) and len(msgs_raw) > self.limits.max_context:
            raise bad(f"{len(msgs_raw)} messages cannot fit this job's context window of {self.limits.max_context} "
                      "tokens", "messages", "context_length_exceeded")
        msgs = parse_messages(msgs_raw, self._prev_msgs)
        self._prev_msgs = (msgs_raw, msgs)
        self._check_size(msgs)
        tools = parse_tools(body.get("tools"))
        return body, msgs, tools, parse_tool_choice(body.get("tool_choice"), tools), parse_sampling(body)

    # -- admission -------------------------------------------------------------------------
    def cancel(self, reason: str = "cancelled") -> None:
        """Refuse every later call (503) and cancel the backend call in flight (closing its
        HTTP connection, which is how vLLM and SGLang abort a request)."""
        if self._cancelled is None:
            self._cancelled = reason
            log.info("endpoint_cancelled", reason=reason)
        for fut in list(self._inflight):
            if not fut.done():
                fut.cancel()

    @property
    def cancelled(self) -> str | None:
        return self._cancelled

    def _refuse(self, err: EndpointError) -> EndpointError:
        if getattr(err, "counted", False):
            return err
        err.counted = True  # once per answer, wherever it was raised
        self.metrics["refused_calls"] += 1
        key = f"{err.status} {err.code}" if err.code else str(err.status)
        self.metrics["refused_by_status"][key] = self.metrics["refused_by_status"].get(key, 0) + 1
        return err  # logged by the app with the request's path (endpoint_call_refused)

    def _budget_spent(self) -> bool:
        cap = self.limits.max_llm_calls
        return cap is not None and self.metrics["llm_calls"] >= cap

    def _budget_reply(self) -> Reply:
        """A chat request once ``max_llm_calls`` is spent: a last assistant message, nothing
        sampled or recorded. Every harness CLI ends its run on a reply without calls, where it
        retries a 429 for minutes (docs/HARNESS.md, "Presets")."""
        self.metrics["budget_replies"] += 1
        cap = self.limits.max_llm_calls
        log.info("endpoint_budget_spent", max_llm_calls=cap, replies=self.metrics["budget_replies"])
        return Reply(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model,
                     content=f"[rolloutd] This job's budget of {cap} LLM calls is spent; no more calls are answered.",
                     tool_calls=[], reasoning=None, finish_reason="stop", prompt_tokens=0, completion_tokens=0,
                     token_ids=[], logprobs=[])

    def _admit(self, calls: bool = True) -> None:
        """Refuse a request the job can no longer serve; ``calls``: also one past ``max_llm_calls``
        (``/v1/completions``; the chat routes answer that with :meth:`_budget_reply`)."""
        if self._cancelled is not None:
            raise self._refuse(EndpointError(503, f"the job is {self._cancelled}; no more LLM calls",
                                             type="service_unavailable", code="job_" + self._cancelled, retry=False))
        if self.fatal is not None:
            raise self._refuse(EndpointError(503, f"the job cannot sample any more: {self.fatal}",
                                             type="service_unavailable", code="job_failed", retry=False))
        d = self.limits.deadline
        if d is not None and time.monotonic() >= d:
            raise self._refuse(EndpointError(503, "the job's deadline has passed; no more LLM calls",
                                             type="service_unavailable", code="deadline_exceeded", retry=False))
        cap = self.limits.max_llm_calls
        if calls and cap is not None and self.metrics["llm_calls"] >= cap:
            raise self._refuse(EndpointError(429, f"this job's budget of {cap} LLM calls is spent",
                                             type="insufficient_quota", code="insufficient_quota", retry=False))
        if self.metrics["endpoint_cpu_s"] > self.limits.max_cpu_s:
            raise self._refuse(EndpointError(429, f"this job's requests used more than {self.limits.max_cpu_s:g} s "
                                             "of the endpoint's CPU", type="insufficient_quota",
                                             code="cpu_budget_exhausted", retry=False))

    # -- chat ------------------------------------------------------------------------------
    async def chat(self, body: dict | bytes) -> Reply:
        """One ``/v1/chat/completions`` request (the body as bytes or parsed). Raises
        :class:`EndpointError`. Parsing, rendering and tokenization run in an endpoint thread."""
        return (await self._chat(body))[0]

    async def _chat(self, body: dict | bytes) -> tuple[Reply, dict]:
        self._admit(calls=False)
        if self._mbpt is None:
            await self.max_body()
        body, msgs, tools, parse_calls, samp = await self._offload(self._prepare_chat, body)
        return await self.serve_messages(msgs, tools, parse_calls, samp, bool(body.get("logprobs"))), body

    async def serve_messages(self, msgs: list[Msg], tools: list | None, parse_calls: bool, samp: Sampling,
                             want_lp: bool = False) -> Reply:
        """One translated chat request of any API shape: placed in the conversation it
        continues (or a new one), sampled, parsed. A job's requests run concurrently; each
        conversation is extended by one request at a time."""
        if self._budget_spent():
            return self._budget_reply()
        self._admit()
        seg = await self._offload(self._place, msgs, tools)
        try:
            if self._budget_spent():  # spent by a request served meanwhile
                return self._budget_reply()
            self._admit()
            n_turns, n_ctx = seg.conv.num_turns, seg.conv.num_tokens
            try:
                ids, lps, finish, stop_hit = await self._sample(seg.conv, samp)
            except BaseException:
                if seg.conv.num_turns > n_turns:  # a partial (aborted) reply is in it: never extend it again
                    seg.closed = True
                raise
            try:  # parsing a long reply is CPU work too: in the job's endpoint thread, not on the loop
                return await self._offload(self._chat_reply, seg, n_ctx, ids, lps, finish, stop_hit, parse_calls,
                                           want_lp)
            except BaseException:
                seg.closed = True  # cancelled before its entry was recorded: the turn is in it, unmatched
                raise
        finally:
            seg.busy = False

    def _chat_reply(self, seg: _Segment, n_ctx: int, ids: list[int], lps: list[float], finish: str,
                    stop_hit: str | None, parse_calls: bool, want_lp: bool) -> Reply:
        # from the sampled ids with this tokenizer, never the backend's text (llm/toolparse.py)
        res, tool_calls = parse_reply(ids, self.tokenizer, self.parser, seg.tools, call_ids=self.call_ids,
                                      parse_calls=parse_calls)
        text, content, reasoning, calls = res.text or "", res.content, res.reasoning, ()
        if stop_hit and content and (cut := content.find(stop_hit)) >= 0:
            content = content[:cut]  # the returned text ends before the stop string (OpenAI's stop)
        if parse_calls and res.errors:  # a malformed call is not returned as a call (vLLM does the same)
            self.metrics["malformed_tool_calls"] += len(res.errors)
        if tool_calls:
            calls = tuple((c.name, canon_args(c.arguments)) for c in res.calls)
        if finish == "stop" and tool_calls:
            finish = "tool_calls"
            seg.conv.set_last_finish_reason(finish)  # the turn records what the agent saw
        gen = _Gen(content=content or "", raw=text, calls=calls, n_tokens=len(ids), ids=np.asarray(ids, np.int32))
        seg.entries.append(gen)
        seg.cuts.append((len(seg.entries), seg.conv.num_turns))
        self._gens.append(gen)
        return Reply(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model, content=content or None,
                     tool_calls=tool_calls, reasoning=reasoning, finish_reason=finish, stop_sequence=stop_hit,
                     prompt_tokens=n_ctx, completion_tokens=len(ids), token_ids=ids,
                     logprobs=lps, token_strs=self._token_strs(ids) if want_lp else None)

    def _continued(self, msgs: list[Msg], tools: list | None) -> _Segment | None:
        """The open conversation ``msgs`` continues, the longest one if several do: its entries
        are a prefix of ``msgs`` (our replies compared as values) with the same tools, and no
        other request is extending it right now (a concurrent continuation of the same history
        is a fork: it gets its own segment)."""
        best = None
        n = len(msgs)
        for seg in reversed(self.segments):
            if seg.conv is None or seg.closed or seg.busy or tools != seg.tools:
                continue
            entries = seg.entries
            k = len(entries)
            if k > n or (best is not None and k <= len(best.entries)):
                continue
            if k == n and not seg.conv.awaiting_generation:
                continue  # nothing new to add: a repeated request (its own retry) opens a new segment
            if all((e.matches(m) if type(e) is _Gen else e.key == m.key) for e, m in zip(entries, msgs)):
                best = seg
        return best

    def _place(self, msgs: list[Msg], tools: list | None) -> _Segment:
        """The conversation this request continues (its new messages appended), or a new one;
        marked busy until the request is done. Runs in an endpoint thread, one per job at a time."""
        self._calls += 1
        seg = self._continued(msgs, tools)
        fork = self._fork_point(msgs, tools, len(seg.entries) if seg is not None else 0)
        if fork is not None:
            forked = self._fork(*fork, msgs, tools)
            if forked is not None:
                forked.busy, forked.opened_call = True, self._calls
                return forked
        if seg is not None:
            entries = seg.entries
            tail = msgs[len(entries):]
            conv = seg.conv
            if conv.awaiting_generation and not tail:  # the same request again after a failure
                seg.busy, seg.last_call = True, self._calls
                return seg
            if tail and not conv.awaiting_generation:
                try:
                    conv.add_messages(self.call_ids.prepare([m.template_dict() for m in tail]))
                except ContextOverflow as e:
                    if e.tokens is None:
                        raise bad(str(e), "messages", "context_length_exceeded") from None
                    raise too_long(e.tokens, self.limits.max_context, str(e)) from None
                except EncodeRefused:
                    raise
                except Exception as e:  # noqa: BLE001 - the template refused them (e.g. raise_exception on role order)
                    raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                              "messages") from None
                for e in entries:
                    if type(e) is _Gen and not e.reused:
                        e.reused = True
                        self.metrics["assistant_tokens_reused"] += e.n_tokens
                entries.extend(tail)
                seg.busy, seg.last_call = True, self._calls
                return seg
        seg = self._new_segment(msgs, tools)
        seg.busy, seg.opened_call = True, self._calls
        return seg

    def _new_segment(self, msgs: list[Msg], tools: list | None) -> _Segment:
        tds = self.call_ids.prepare([m.template_dict() for m in msgs])
        conv, spliced = None, self._replies(msgs, 0)
        if spliced:  # our replies go in as their sampled ids, the rest rendered as an extension would
            try:
                conv = Conversation(self.tokenizer, tds[:spliced[0][0]], tools, self.limits.max_context,
                                    **self.conv_options).splice(self._pieces(spliced, tds))
            except EncodeRefused:
                raise
            except Exception as e:  # noqa: BLE001 - TemplateError, raise_exception, ContextOverflow
                log.info("endpoint_replies_rendered_from_text", messages=len(msgs), error=f"{type(e).__name__}: {e}")
                conv, spliced = None, []
        try:
            if conv is None:
                conv = Conversation(self.tokenizer, tds, tools, self.limits.max_context, **self.conv_options)
        except EncodeRefused:
            raise
        except Exception as e:  # noqa: BLE001 - TemplateError, or the template's own raise_exception
            raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                      "messages") from None
        if conv.remaining_context <= 0:
            raise too_long(conv.num_tokens, self.limits.max_context)
        # earlier requests that never sampled (and are not being served): nothing to keep
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg = _Segment(len(self.segments), conv, tools, list(msgs))
        if seg.index:
            log.info("endpoint_segment_opened", segment=seg.index, messages=len(msgs), prompt_tokens=conv.num_tokens,
                     replies_spliced=len(spliced))
        self._count_spliced(msgs, spliced, 0)
        self.segments.append(seg)
        return seg

    def _gen_for(self, m: Msg) -> _Gen | None:
        """The reply of ours that ``m`` sends back (the latest, if the same text was sampled twice)."""
        if m.role != "assistant":
            return None
        return next((g for g in reversed(self._gens) if g.matches(m)), None)

    def _replies(self, msgs: list[Msg], start: int) -> list[tuple[int, _Gen]]:
        """Our replies in ``msgs[start:]`` that a new prompt can hold as their sampled ids: each
        after at least one message of the prompt and followed by a message that is not an
        assistant's (the next piece to render)."""
        out: list[tuple[int, _Gen]] = []
        for j in range(start + 1, len(msgs) - 1):
            if msgs[j + 1].role != "assistant" and (g := self._gen_for(msgs[j])) is not None and g.ids is not None:
                out.append((j, g))
        return out

    @staticmethod
    def _pieces(spliced: list[tuple[int, _Gen]], tds: list[dict]) -> list[tuple[Any, list[dict]]]:
        """``Conversation.splice``'s pieces: each reply's ids and the messages up to the next one."""
        ends = [j for j, _ in spliced[1:]] + [len(tds)]
        return [(g.ids, tds[j + 1:end]) for (j, g), end in zip(spliced, ends)]

    def _count_spliced(self, msgs: list[Msg], spliced: list[tuple[int, _Gen]], start: int) -> None:
        """Metrics for a prompt built from ``msgs[start:]``: spliced replies reused, others of ours
        rendered from their text re-encoded (each message counted once)."""
        at = {j for j, _ in spliced}
        for _, g in spliced:
            if not g.reused:
                g.reused = True
                self.metrics["assistant_tokens_reused"] += g.n_tokens
        self._count_reencoded([m for j, m in enumerate(msgs[start:], start) if j not in at])

    def _count_reencoded(self, msgs: list[Msg]) -> None:
        """Our replies among ``msgs``, rendered from their text into a new segment (once each)."""
        for m in msgs:
            if m.role == "assistant":
                g = next((g for g in self._gens if g.matches(m)), None)
                if g is not None and not g.reencoded:
                    g.reencoded = True
                    self.metrics["assistant_tokens_reencoded"] += g.n_tokens

    def _fork_point(self, msgs: list[Msg], tools: list | None, beat: int) -> tuple[_Segment, int, int] | None:
        """The open conversation sharing the longest prefix with ``msgs`` that ends just after
        one of its sampled replies and is longer than ``beat`` messages (an extension's): that
        conversation, the prefix's length in messages and its number of turns. Busy and closed
        conversations count too: a prefix already sampled never changes."""
        best: tuple[_Segment, int, int] | None = None
        n = len(msgs)
        for seg in list(self.segments):
            cuts = list(seg.cuts)  # appended on the loop while this runs in an endpoint thread
            if seg.conv is None or not cuts or tools != seg.tools:
                continue
            floor = best[1] if best is not None else beat
            top = max(c for c, _ in cuts if c < n) if any(c < n for c, _ in cuts) else 0
            if top <= floor:
                continue
            same = 0
            for e, m in zip(seg.entries[:top], msgs):
                if not (e.matches(m) if type(e) is _Gen else e.key == m.key):
                    break
                same += 1
            cut = max(((c, t) for c, t in cuts if c <= same and c < n), default=None)
            if cut is not None and cut[0] > floor:
                best = (seg, cut[0], cut[1])
        return best

    def _fork(self, parent: _Segment, g: int, turns: int, msgs: list[Msg], tools: list | None) -> _Segment | None:
        """A new segment whose prompt is ``parent``'s ids up to its reply that ends message ``g``
        (sampled ids verbatim) plus the rest of ``msgs`` rendered with the template's delimiters;
        None (counted in ``fork_fallbacks``) when the template cannot render it that way or it
        does not fit: the request then gets today's segment rendered from its messages."""
        tail = msgs[g:]
        spliced = self._replies(msgs, g)  # replies of ours sampled elsewhere, in the fork's own messages
        try:
            tds = self.call_ids.prepare([m.template_dict() for m in msgs])
            conv = parent.conv.fork(turns, tds[g:spliced[0][0]] if spliced else tds[g:])
            if spliced:
                conv.splice(self._pieces(spliced, tds))
            if conv.remaining_context <= 0:
                raise ContextOverflow(f"the fork's prompt of {conv.num_tokens} tokens leaves no room")
        except EncodeRefused:
            raise
        except Exception as e:  # noqa: BLE001 - TemplateError, the template's raise_exception, ContextOverflow
            self.metrics["fork_fallbacks"] += 1
            log.info("endpoint_fork_fell_back", parent=parent.index, messages=g, error=f"{type(e).__name__}: {e}")
            return None
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg = _Segment(len(self.segments), conv, tools, parent.entries[:g] + list(tail))
        self.metrics["forks"] += 1
        for e in seg.entries[:g]:
            if type(e) is _Gen and not e.reused:
                e.reused = True
                self.metrics["assistant_tokens_reused"] += e.n_tokens
        self._count_spliced(msgs, spliced, g)
        log.info("endpoint_segment_forked", segment=seg.index, parent=parent.index, messages=g,
                 prompt_tokens=conv.num_tokens)
        self.segments.append(seg)
        return seg

    # -- sampling --------------------------------------------------------------------------
    async def _sample(self, conv: Conversation, samp: Sampling) -> tuple[list[int], list[float], str, str | None]:
        """Generate one assistant message into ``conv`` (continuing it after server-side aborts);
        (ids, logprobs, finish reason, the request's stop string that ended it or None)."""
        want = samp.max_tokens if samp.max_tokens is not None else self.limits.max_tokens
        if conv.remaining_context <= 0:
            raise bad(f"no room left to generate: {conv.num_tokens} tokens of this job's context window of "
                      f"{self.limits.max_context} are used", "messages", "context_length_exceeded")
        ids: list[int] = []
        lps: list[float] = []
        texts: list[str] = []  # decoded parts, only to find stop strings (replies are parsed from ids)
        stop_hit = None
        aborts = 0
        self.metrics["llm_calls"] += 1  # past every refusal: this request reaches the backend
        while True:
            max_new = min(want - len(ids), conv.remaining_context)
            if max_new <= 0:
                finish = "length"
                break
            g, backend, pv = await self._call(conv.context_ids, samp.params(max_new))
            if samp.stop:  # the text decoded from the ids, never the backend's text
                text, stop_hit = self._apply_stop(g, self._decode(g.token_ids), samp.stop, "".join(texts))
                texts.append(text)
            capped = max_new < want - len(ids) and g.finish_reason == "length" and len(g.token_ids) >= max_new
            conv.add_generation(g, backend, pv)
            if capped:  # the agent sees "length"; the cause (the context window, not max_tokens) beside it
                conv.set_last_finish_reason("length", cause="context_overflow")
            ids += np.asarray(g.token_ids).tolist()
            lps += np.asarray(g.logprobs, dtype=np.float64).tolist()
            finish = g.finish_reason
            if finish != "abort":
                break
            aborts += 1
            self.metrics["aborts"] += 1
            log.info("endpoint_generation_aborted", backend=backend, tokens=len(g.token_ids), aborts=aborts)
            if aborts > self.limits.max_aborts:
                raise EndpointError(503, f"generation aborted {aborts} times in a row", type="service_unavailable",
                                    code="backend_aborted")
        return ids, lps, finish, stop_hit

    def _apply_stop(self, g: Generation, text: str, stops: list[str], before: str) -> tuple[str, str | None]:
        """Cut the generation after the token that completes the first stop string (OpenAI's
        ``stop``; the tokens after it are dropped, so the trajectory holds what the agent saw);
        returns the text before the stop string and the stop string (None when none occurs).
        ``before``: this message's earlier parts."""
        full = before + text
        hits = [(i, s) for s in stops if (i := full.find(s, max(0, len(before) - len(s) + 1))) >= 0]
        if not hits:
            return text, None
        cut, stop = min(hits)
        ids = np.asarray(g.token_ids).tolist()
        lo, hi = 1, len(ids)  # the shortest prefix whose text contains the stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in before + self._decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        g.token_ids = np.asarray(ids[:lo], dtype=np.int32)
        g.logprobs = np.asarray(g.logprobs)[:lo]
        g.finish_reason = "stop"
        return (full[len(before):cut] if cut >= len(before) else ""), stop

    async def _call(self, ids: Any, params: SamplingParams) -> tuple[Generation, str, int]:
        """The backend call, cancellable by :meth:`cancel` and bounded by the deadline."""
        timeout = None
        if self.limits.deadline is not None:
            timeout = self.limits.deadline - time.monotonic()
            if timeout <= 0:
                raise self._refuse(EndpointError(503, "the job's deadline has passed", type="service_unavailable",
                                                 code="deadline_exceeded", retry=False))
        fut = asyncio.ensure_future(self.generate(ids, params))
        self._inflight.add(fut)
        t0 = time.perf_counter()
        try:
            done, _ = await asyncio.wait((fut,), timeout=timeout)
            if not done:
                fut.cancel()
                with contextlib.suppress(BaseException):
                    await fut
                raise EndpointError(503, "the job's deadline passed during the LLM call", type="service_unavailable",
                                    code="deadline_exceeded", retry=False)
            if fut.cancelled():
                raise EndpointError(503, f"the job is {self._cancelled or 'cancelled'}; the LLM call was aborted",
                                    type="service_unavailable", code="job_" + (self._cancelled or "cancelled"),
                                    retry=False)
            try:
                return fut.result()
            except ContextOverflow as e:
                raise bad(_unaddressed(e), "messages", "context_length_exceeded") from None
            except RequestError as e:
                log.info("endpoint_backend_rejected", error=str(e))  # the address stays in our logs
                raise bad(f"the backend rejected the request: {_unaddressed(e)}") from None
            except BackendError as e:
                raise EndpointError(503, f"no backend could serve the request: {_unaddressed(e)}",
                                    type="service_unavailable", code="backend_unavailable") from None
            except Exception as e:  # noqa: BLE001 - router/lease failures (StaleLease, RouterError): the job's to decide
                self.fatal = e
                log.warning("endpoint_llm_failed", error=f"{type(e).__name__}: {e}")
                raise EndpointError(503, f"LLM unavailable for this job: {type(e).__name__}: {_unaddressed(e)}",
                                    type="service_unavailable", code="job_failed", retry=False) from None
        finally:
            self.metrics["llm_s"] += time.perf_counter() - t0
            self._inflight.discard(fut)
            if not fut.done():  # our own request task was cancelled (server shutdown)
                fut.cancel()

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)

    def _token_strs(self, ids: list[int]) -> list[str]:
        cache = self._decode_cache
        out = []
        for t in ids:
            s = cache.get(t)
            if s is None:
                s = cache[t] = self.tokenizer.decode([t], skip_special_tokens=False)
            out.append(s)
        return out

    # -- completions -----------------------------------------------------------------------
    def _check_size(self, msgs: list[Msg]) -> None:
        # A token is at most max_bytes_per_token bytes, a character at least one byte.
        if len(msgs) > self.limits.max_context:
            raise bad(f"{len(msgs)} messages cannot fit this job's context window of {self.limits.max_context} "
                      "tokens", "messages", "context_length_exceeded")
        chars = sum(len(m.content) for m in msgs)
        if self._mbpt is not None and chars > self._mbpt * self.limits.max_context:
            raise bad(f"the messages hold {chars} characters; no tokenization of them fits this job's context "
                      f"window of {self.limits.max_context} tokens", "messages", "context_length_exceeded")

    def _prepare_wire(self, raw: bytes | dict, parse: Callable[[dict], WireRequest]) -> WireRequest:
        req = parse(self._load(raw))
        self._check_size(req.messages)
        return req

    async def serve_wire(self, raw: bytes | dict, parse: Callable[[dict], WireRequest]) -> tuple[WireRequest, Reply]:
        """One request of another API shape: ``parse`` (a wire module's, e.g. ``anthropic_wire.parse``)
        translates the body in an endpoint thread; then the same session path as Chat Completions."""
        self._admit(calls=False)
        if self._mbpt is None:
            await self.max_body()
        req = await self._offload(self._prepare_wire, raw, parse)
        return req, await self.serve_messages(req.messages, req.tools, req.parse_calls, req.sampling)

    def _count(self, req: WireRequest) -> int:
        conv = Conversation(self.tokenizer, self.call_ids.prepare([m.template_dict() for m in req.messages]),
                            req.tools, 1 << 30, **self.conv_options)
        return conv.num_tokens

    async def count_tokens(self, raw: bytes | dict, parse: Callable[[dict], WireRequest]) -> int:
        """The prompt tokens of a translated request (``count_tokens`` routes); no segment, no LLM call."""
        self._admit(calls=False)
        if self._mbpt is None:
            await self.max_body()

        def work() -> int:
            req = self._prepare_wire(raw, parse)
            try:
                return self._count(req)
            except EncodeRefused:
                raise
            except Exception as e:  # noqa: BLE001 - the template refused the messages
                raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                          "messages") from None

        return await self._offload(work)

    def _add_raw(self, seg: _Segment) -> None:
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg.index = len(self.segments)
        self.segments.append(seg)

    def _prepare_completion(self, raw: bytes | dict):
        body = self._load(raw)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self._mbpt is not None and len(prompt) > self._mbpt * self.limits.max_context:
                raise bad(f"the prompt holds {len(prompt)} characters; no tokenization of them fits this job's "
                          f"context window of {self.limits.max_context} tokens", "prompt", "context_length_exceeded")
            ids = fast_encoder(self.tokenizer).encode_special(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        return body, ids, parse_sampling(body)

    async def complete(self, body: dict | bytes) -> tuple[Reply, str]:
        """One ``/v1/completions`` request: a text or token-id prompt, recorded as its own segment."""
        r, text, _ = await self._complete(body)
        return r, text

    async def _complete(self, body: dict | bytes) -> tuple[Reply, str, dict]:
        self._admit()
        if self._mbpt is None:
            await self.max_body()
        body, ids, samp = await self._offload(self._prepare_completion, body)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        self._admit()
        room = self.limits.max_context - len(ids)
        if room <= 0:
            raise bad(f"the prompt takes {len(ids)} tokens; this job's context window is "
                      f"{self.limits.max_context}", "prompt", "context_length_exceeded")
        self.metrics["llm_calls"] += 1
        want = samp.max_tokens if samp.max_tokens is not None else min(16, self.limits.max_tokens)
        g, backend, pv = await self._call(np.asarray(ids, dtype=np.int32), samp.params(min(want, room)))
        text = self._decode(g.token_ids)  # from the ids, never the backend's text
        if samp.stop:
            text, _ = self._apply_stop(g, text, samp.stop, "")
        out = np.asarray(g.token_ids, dtype=np.int32).reshape(-1)
        lp = np.asarray(g.logprobs, dtype=np.float32).reshape(-1)
        seg = _Segment(0, None, None, [])
        seg.raw = {"prompt_ids": np.asarray(ids, dtype=np.int32), "response_ids": out,
                   "loss_mask": np.ones(len(out), np.int8), "logprobs": lp,
                   "turns": [{"index": 0, "span": [0, len(out)], "start": 0, "end": len(out),
                              "finish_reason": g.finish_reason, "backend": str(backend),
                              "policy_version": int(pv), "latency_s": float(g.latency_s or 0.0),
                              "obs_start": None, "obs_end": None, "continuation": False}]}
        await self._offload(self._add_raw, seg)  # segments change in endpoint threads only, one per job
        ids_out, lps_out = out.tolist(), lp.astype(np.float64).tolist()
        fr = g.finish_reason if g.finish_reason in ("stop", "length") else "stop"
        reply = Reply(id=f"cmpl-{uuid.uuid4().hex}", model=self.model, content=text, tool_calls=[],
                      reasoning=None, finish_reason=fr, prompt_tokens=len(ids), completion_tokens=len(ids_out),
                      token_ids=ids_out, logprobs=lps_out,
                      token_strs=self._token_strs(ids_out) if want_lp else None)
        return reply, text, body

    # -- result ----------------------------------------------------------------------------
    def trajectory(self) -> dict:
        """The fields a handler copies into the job's trajectory.

        Top level: the last segment's ``prompt_ids``, ``response_ids`` (int32), ``loss_mask`` (int8),
        ``logprobs`` (float32) and ``turns``; ``segments`` (only when there are 2 or more): every
        segment in order as ``{"index", "prompt_ids", "response_ids", "loss_mask", "logprobs",
        "turns"}``; ``policy_version`` of the first turn; ``metrics`` (merge into the job's).
        """
        segs = [s for s in self.segments if s.n_turns > 0]
        recs = []
        for i, s in enumerate(segs):
            r = s.record()
            r["index"] = i
            recs.append(r)
        out: dict[str, Any] = {"prompt_ids": np.zeros(0, np.int32), "response_ids": np.zeros(0, np.int32),
                               "loss_mask": np.zeros(0, np.int8), "logprobs": np.zeros(0, np.float32), "turns": []}
        if recs:
            last = recs[-1]
            for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "turns"):
                out[k] = last[k]
        if len(recs) > 1:
            out["segments"] = recs
        out["policy_version"] = recs[0]["turns"][0]["policy_version"] if recs else None
        m = dict(self.metrics)
        m["segments"] = len(recs)
        # A side segment: opened while an earlier conversation was still going on (that one was
        # extended again afterwards): a title/summary call between main turns, a subagent.
        chats = [x for x in segs if x.conv is not None]
        m["side_segments"] = sum(1 for x in chats if any(y.opened_call < x.opened_call < y.last_call for y in chats))
        m["calls_per_segment"] = round(m["llm_calls"] / len(recs), 3) if recs else 0.0
        out["metrics"] = m
        return out


# -- the ASGI app ----------------------------------------------------------------------------
MAX_BODY = 64 * 1024 * 1024
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]



_POST_ROUTES = ("/chat/completions", "/completions", "/messages", "/messages/count_tokens", "/responses")


class _Gate:
    """One job's requests in flight and the body bytes they hold (EndpointBounds)."""

    __slots__ = ("bytes", "inflight")

    def __init__(self) -> None:
        self.inflight = 0
        self.bytes = 0


async def _read_body(receive, limit: int, gate: _Gate, budget: int) -> bytes:
    """The body, refused (413) past ``limit``, or when this job's bodies in flight would pass
    ``budget``; the bytes stay counted in ``gate.bytes`` until the caller releases them."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client went away")
        chunk = msg.get("body", b"")
        gate.bytes += len(chunk)
        size += len(chunk)
        chunks.append(chunk)
        if size > limit:
            raise EndpointError(413, f"request body larger than {limit} bytes, more than any content that fits "
                                     "this job's context window", code="request_too_large", retry=False)
        if gate.bytes > budget:
            raise EndpointError(429, f"this job's requests in flight hold more than {budget} bytes",
                                type="rate_limit_exceeded", code="too_many_bytes_in_flight")
        if not msg.get("more_body"):
            return b"".join(chunks)


def _content_length(scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def api_shape(path: str) -> str:
    """The API shape of a request path (``/v1`` or ``/v1beta`` prefix optional): ``chat``,
    ``completions``, ``anthropic``, ``responses``, ``gemini``, else ``other``."""
    for pre in ("/v1beta/", "/v1/"):
        if path.startswith(pre):
            path = path[len(pre) - 1:]
            break
    if path.startswith("/chat/completions"):
        return "chat"
    if path.startswith("/completions"):
        return "completions"
    if path.startswith("/messages"):
        return "anthropic"
    if path.startswith("/responses"):
        return "responses"
    if path.startswith("/models/") and ":" in path:
        return "gemini"
    return "other"


def make_app(session: EndpointSession, *, max_body: int = MAX_BODY):
    """A raw ASGI 3 app serving ``session`` (no framework: a few routes). Request bodies are
    bounded by ``session.max_body()`` (and ``max_body``), parsed off the loop by the session."""
    b = session.bounds
    gate = _Gate()

    async def timed_send(send, msg) -> None:
        # A client that never takes its reply must not hold the request (and its job's slot) forever.
        await asyncio.wait_for(send(msg), b.send_timeout_s)

    async def send_json(send, status: int, payload: bytes, extra: list | None = None) -> None:
        headers = _JSON + [(b"content-length", str(len(payload)).encode())] + (extra or [])
        await timed_send(send, {"type": "http.response.start", "status": status, "headers": headers})
        await timed_send(send, {"type": "http.response.body", "body": payload})

    async def send_sse(send, chunks: list[bytes]) -> None:
        await timed_send(send, {"type": "http.response.start", "status": 200, "headers": _SSE})
        for c in chunks:
            await timed_send(send, {"type": "http.response.body", "body": c, "more_body": True})
        await timed_send(send, {"type": "http.response.body", "body": b""})

    def authorized(scope) -> bool:
        """``Authorization: Bearer`` (OpenAI, Anthropic's auth token), ``x-api-key`` (Anthropic),
        ``x-goog-api-key`` or ``?key=`` (Gemini)."""
        if not session.api_key:
            return True
        key = session.api_key
        for k, v in scope.get("headers", ()):
            if k == b"authorization" and v.decode("latin-1") == "Bearer " + key:
                return True
            if k in (b"x-api-key", b"x-goog-api-key") and v.decode("latin-1") == key:
                return True
        from urllib.parse import parse_qs

        return key in parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", ())

    wire_cache: dict[str, dict] = {"anthropic": {}, "responses": {}, "gemini": {}}
    stored: dict[str, tuple[list, dict]] = {}  # Responses store: response id -> (conversation items, response)
    STORE_MAX = 256

    async def post_route(path: str, scope, raw: bytes, send) -> None:
        """The POST routes; ``raw`` is the body within this job's bounds."""
        if path == "/chat/completions":
            r, body = await session._chat(raw)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if body.get("stream"):
                await send_sse(send, chat_chunks(r, include_usage))
            else:
                await send_json(send, 200, dumps(chat_response(r)))
        elif path == "/completions":
            r, text, body = await session._complete(raw)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if body.get("stream"):
                await send_sse(send, completion_chunks(r, text, include_usage))
            else:
                await send_json(send, 200, dumps(completion_response(r, text)))
        elif path == "/messages":
            from . import anthropic_wire as aw

            req, r = await session.serve_wire(raw, lambda b: aw.parse(b, wire_cache["anthropic"]))
            if req.stream:
                await send_sse(send, aw.stream_events(r, req))
            else:
                await send_json(send, 200, dumps(aw.response(r, req)))
        elif path == "/messages/count_tokens":
            from . import anthropic_wire as aw

            n = await session.count_tokens(raw, aw.parse_count_tokens)
            await send_json(send, 200, dumps(aw.count_tokens_response(n)))
        elif path == "/responses":
            from . import responses_wire as rw

            def parse(b: dict) -> WireRequest:
                prev = b.get("previous_response_id") if isinstance(b, dict) else None
                hist = stored.get(prev)[0] if isinstance(prev, str) and prev in stored else None
                return rw.parse(b, hist, wire_cache["responses"])

            req, r = await session.serve_wire(raw, parse)
            obj = rw.response(r, req)
            if req.extras.get("store", True) is not False:
                stored[rw.response_id(r)] = (rw.conversation_items(req, r), obj)
                while len(stored) > STORE_MAX:
                    stored.pop(next(iter(stored)))
            if req.stream:
                await send_sse(send, rw.stream_events(r, req))
            else:
                await send_json(send, 200, dumps(obj))
        elif path.startswith("/models/") and ":" in path:  # Gemini, after the /v1beta prefix
            from . import gemini_wire as gw

            model, _, verb = path[len("/models/"):].rpartition(":")
            if verb == "countTokens":
                n = await session.count_tokens(raw, lambda b: gw.parse_count_tokens(b, model))
                await send_json(send, 200, dumps(gw.count_tokens_response(n)))
                return
            if verb not in ("generateContent", "streamGenerateContent"):
                raise EndpointError(404, f"no method {verb!r} on models", code="not_found")
            stream = verb == "streamGenerateContent"
            req, r = await session.serve_wire(raw, lambda b: gw.parse(b, model, stream, wire_cache["gemini"]))
            if stream:  # alt=sse (what Gemini CLI and google-genai ask for)
                await send_sse(send, gw.stream_chunks(r, req))
            else:
                await send_json(send, 200, dumps(gw.response(r, req)))
        else:
            raise EndpointError(404, f"no route POST {scope['path']}", code="not_found")

    def error_body(path: str, e: EndpointError) -> bytes:
        """Each API shape's own error object."""
        shape = api_shape(path)
        try:
            if shape == "anthropic":
                from .anthropic_wire import error_body as eb
            elif shape == "responses":
                from .responses_wire import error_body as eb
            elif shape == "gemini":
                from .gemini_wire import error_body as eb
            else:
                return e.body()
        except ImportError:  # pragma: no cover - the wire modules ship with the endpoint
            return e.body()
        return eb(e)

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path.startswith("/v1/"):
            path = path[3:]
        elif path.startswith("/v1beta/"):  # Gemini
            path = path[7:]
        method = scope["method"]
        if path != "/health":
            session.metrics["requests"] += 1
        held = 0
        try:
            if scope.get("http_version") not in ("1.0", "1.1"):  # h11 parses any HTTP/x.y
                raise EndpointError(505, f"HTTP/{scope.get('http_version')} is not supported: HTTP/1.1 or 1.0",
                                    code="http_version_not_supported")
            if len(scope.get("headers", ())) > b.max_headers:
                raise EndpointError(431, f"more than {b.max_headers} header fields", code="request_header_fields_too_large")
            if path == "/health":
                await send_json(send, 200, b"{}")
                return
            if not authorized(scope):
                raise EndpointError(401, "invalid API key", code="invalid_api_key", retry=False)
            if path == "/models" and method == "GET":
                await send_json(send, 200, dumps(models_response(session.model, session.created)))
                return
            if path.startswith("/responses/") and method == "GET":
                hit = stored.get(path[len("/responses/"):])
                if hit is None:
                    raise EndpointError(404, f"no response {path[len('/responses/'):]!r} in this job's store",
                                        code="not_found")
                await send_json(send, 200, dumps(hit[1]))
                return
            if path in _POST_ROUTES or (path.startswith("/models/") and ":" in path):
                if method != "POST":
                    raise EndpointError(405, f"{method} {scope['path']}: use POST")
                limit = min(max_body, await session.max_body())
                cl = _content_length(scope)
                if cl is not None and cl > limit:  # refused before a byte of it is read
                    raise EndpointError(413, f"request body of {cl} bytes; this job's bound is {limit} bytes, more "
                                             "than any content that fits its context window", code="request_too_large",
                                        retry=False)
                if gate.inflight >= b.max_inflight:
                    raise EndpointError(429, f"this job already has {gate.inflight} requests in flight",
                                        type="rate_limit_exceeded", code="too_many_requests")
                gate.inflight += 1
                try:
                    before = gate.bytes
                    try:
                        raw = await _read_body(receive, limit, gate, 2 * limit)
                    finally:
                        held = gate.bytes - before
                    await post_route(path, scope, raw, send)
                finally:
                    gate.inflight -= 1
                    gate.bytes -= held
                    if held >= TRIM_BYTES:  # once this request's frames are gone: its memory back to the OS
                        loop = asyncio.get_running_loop()
                        loop.call_soon(loop.run_in_executor, _POOL, release_memory)
                    held = 0
                return
            raise EndpointError(404, f"no route {method} {scope['path']}", code="not_found")
        except EndpointError as e:
            session._refuse(e)  # every error answer, once (401, 404, 400 ..., not only the gate's)
            log.info("endpoint_call_refused", status=e.status, code=e.code, method=method, path=scope["path"],
                     shape=api_shape(path), reason=e.message)
            extra = [] if e.retry is None else [(b"x-should-retry", b"true" if e.retry else b"false")]
            if e.status in (413, 431, 505):  # the rest of the request is not read: the connection cannot be reused
                extra.append((b"connection", b"close"))
            await send_json(send, e.status, error_body(path, e), extra)
        except (ConnectionResetError, asyncio.TimeoutError):
            return
        except Exception as e:  # a bug here must not take the job's server down with it
            log.exception("endpoint_request_crashed", path=scope["path"])
            err = session._refuse(EndpointError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            await send_json(send, 500, err.body())

    return app


# -- the server ------------------------------------------------------------------------------
class EndpointServer:
    """uvicorn serving an app on a Unix socket or 127.0.0.1, inside the caller's event loop.

    Only uvicorn's ``startup``/``shutdown`` are used, not ``serve()``: that installs signal
    handlers (the daemon hosting the endpoint owns SIGTERM/SIGINT) and runs a 10 Hz tick per
    server (it refreshes the Date header), which with one server per job cost more CPU than the
    requests themselves. So responses carry no Date header.
    """

    def __init__(self, server: Any, uds: str | None, host: str | None, port: int | None) -> None:
        self._server = server
        self.uds = uds
        self.host = host
        self.port = port
        self._stopped = False

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``; on a Unix socket ``http://localhost/v1`` (connect through ``uds``)."""
        if self.uds is not None:
            return "http://localhost/v1"
        return f"http://{self.host}:{self.port}/v1"

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let responses in flight finish (cancel them after ``timeout_s``), close."""
        if self._stopped:
            return
        self._stopped = True
        self._server.config.rolloutd_accept.closed = True  # no resume onto a socket being closed
        try:
            await asyncio.wait_for(self._server.shutdown(), timeout_s)
        except asyncio.TimeoutError:
            for t in list(self._server.server_state.tasks):
                t.cancel()
        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds)


_protocol_class = None

# A request line as h11 parses it (method SP target SP HTTP/x.y); anything else as the first line
# of a request (HTTP/0.9 "GET /path", garbage) is answered 400 at once rather than waiting for
# a blank line that may never come (h11 parses the request line only with the whole header block).
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [\x21-\x7e]+ HTTP/[0-9]\.[0-9]\r?")


def _raw_refusal(transport, status: int, reason: str, err: EndpointError) -> None:
    """Answer ``err`` and close, without h11 or the app: the cheap path for refusals at the
    connection level (connection cap, request deadline, a request line that is not HTTP/1.x)."""
    body = err.body()
    transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n" % (status, reason.encode(), len(body)) + body)
    transport.close()


class _AcceptPause:
    """Stops accepting on one job's listening socket while that job is at its connection cap
    (EndpointBounds.max_connections) and resumes when one closes: the job's further connections
    wait in its own (short) kernel backlog instead of each costing the daemon's loop an accept, a
    protocol and a 503. The socket is the job's own, so the pause costs no other job anything.
    It removes and re-adds asyncio's own accept callback on the selector loop; on a loop without
    one (uvloop) it does nothing and connections past the cap get the 503 as before."""

    def __init__(self, loop, sock) -> None:
        self.loop, self.sock, self.paused, self.closed, self.pauses = loop, sock, False, False, 0
        self._reader = None  # asyncio's (_accept_connection, args): removing the reader cancels its handle
        with contextlib.suppress(AttributeError, KeyError, ValueError):
            h = loop._selector.get_key(sock.fileno()).data[0]
            self._reader = (h._callback, h._args)

    def pause(self) -> None:
        if self._reader is not None and not self.paused and not self.closed:
            self.paused = self.loop.remove_reader(self.sock.fileno())
            self.pauses += self.paused

    def resume(self) -> None:
        if self.paused and not self.closed and self.sock.fileno() != -1:
            self.paused = False
            self.loop.add_reader(self.sock.fileno(), self._reader[0], *self._reader[1])


def _bounded_protocol():
    """uvicorn's h11 protocol with the bounds uvicorn lacks: a per-server connection cap and a
    deadline for a whole request. h11 (not httptools) because it already refuses what
    httptools lets through: a request line plus headers over ``h11_max_incomplete_event_size``
    (httptools took a 2 MiB header line) and HTTP/0.9 or unknown versions (400)."""
    global _protocol_class
    if _protocol_class is not None:
        return _protocol_class
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        _timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            bounds = self.config.rolloutd_bounds
            if len(self.connections) > bounds.max_connections:  # accepted in the same batch as the cap's
                _raw_refusal(transport, 503, "Service Unavailable", EndpointError(
                    503, f"more than {bounds.max_connections} open connections to this job's endpoint",
                    type="service_unavailable", code="too_many_connections"))
                return
            if len(self.connections) >= bounds.max_connections:
                self.config.rolloutd_accept.pause()
            self._arm()

        def _arm(self) -> None:
            self._timer = self.loop.call_later(self.config.rolloutd_bounds.request_timeout_s, self._too_slow)

        def _too_slow(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                _raw_refusal(self.transport, 408, "Request Timeout", EndpointError(
                    408, "the request did not arrive completely in "
                         f"{self.config.rolloutd_bounds.request_timeout_s:g} s", code="request_timeout"))
            self.transport.close()

        _head = b""  # the start of the current request until its first line is checked; None once it is

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first byte of the next request on a kept-alive connection
                self._head = b""
            if self._head is not None and self.conn.their_state is h11.IDLE:
                head = self._head + data
                end = head.find(b"\n", 0, self.config.rolloutd_bounds.max_header_bytes)
                if end >= 0:
                    self._head = None
                    if not _REQUEST_LINE.fullmatch(head, 0, end):
                        if self._timer is not None:
                            self._timer.cancel()
                            self._timer = None
                        _raw_refusal(self.transport, 400, "Bad Request", EndpointError(
                            400, "the request line is not 'METHOD target HTTP/x.y' (HTTP/0.9 is not served)",
                            code="bad_request_line"))
                        return
                else:  # past the header bound h11 refuses it (400) without us
                    self._head = head if len(head) < self.config.rolloutd_bounds.max_header_bytes else None
            super().data_received(data)
            if self._timer is not None and self.conn.their_state is not h11.IDLE \
                    and self.conn.their_state is not h11.SEND_BODY:
                self._timer.cancel()  # the whole request is in
                self._timer = None

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)
            if len(self.connections) < self.config.rolloutd_bounds.max_connections:
                self.config.rolloutd_accept.resume()

    _protocol_class = BoundedH11Protocol
    return _protocol_class


async def serve(app, *, uds: str | None = None, host: str | None = None, port: int = 0,
                bounds: EndpointBounds | None = None) -> EndpointServer:
    """Start uvicorn for ``app`` on ``uds`` (a Unix socket path) or ``host:port`` (port 0: any free one)."""
    if (uds is None) == (host is None):
        raise ValueError("serve: give exactly one of uds= or host=")
    import uvicorn

    bounds = bounds or EndpointBounds()
    config = uvicorn.Config(app, uds=uds, host=host or "127.0.0.1", port=port, log_config=None, access_log=False,
                            lifespan="off", ws="none", timeout_graceful_shutdown=2, server_header=False,
                            date_header=False, http=_bounded_protocol(),
                            h11_max_incomplete_event_size=bounds.max_header_bytes,
                            backlog=bounds.max_connections)  # the queue of a job at its cap; asyncio's accept batch
    config.rolloutd_bounds = bounds
    config.rolloutd_accept = _AcceptPause(None, None)  # replaced once listening
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    try:
        await server.startup()
    except SystemExit:  # uvicorn exits the process when it cannot bind; here that is an error of this job
        raise RuntimeError(f"the endpoint server could not listen on {uds or f'{host}:{port}'}") from None
    config.rolloutd_accept = _AcceptPause(asyncio.get_running_loop(), server.servers[0].sockets[0])
    bound = None
    if uds is None:
        bound = server.servers[0].sockets[0].getsockname()[1]
    log.info("endpoint_serving", uds=uds, host=host, port=bound)
    return EndpointServer(server, uds, host if uds is None else None, bound)
