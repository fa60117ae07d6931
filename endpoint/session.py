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
  Errors use OpenAI's JSON error shape (:class:`~rolloutd.endpoint.wire.EndpointError`).
  Other API shapes on the same session (:mod:`rolloutd.endpoint.shapes`
  translate): ``POST /v1/messages`` and ``/v1/messages/count_tokens``, ``POST /v1/responses`` and
  ``GET /v1/responses/{id}``, ``POST /v1beta/models/{m}:generateContent|:streamGenerateContent|
  :countTokens``; each answers errors in its own shape.
* A session's requests run concurrently; each conversation is extended by one at a time.
  Request parsing, rendering and tokenization run in endpoint threads, not on the caller's
  loop, but for small work: a request that adds at most ``INLINE_REQUEST_CHARS`` to the
  previous body and extends a conversation, and a short sampled reply; ``EndpointBounds``
  bounds what one job's traffic may cost (docs/HARNESS.md, "Bounds").
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
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog

from ..llm.client import Generation, SamplingParams
from ..llm.conversation import Conversation
from ..llm.errors import BackendError, ContextOverflow, RequestError
from ..llm.tokenizer_utils import encode_bounds, fast_encoder
from ..llm.toolparse import CallIds, get_parser, parse_reply, parser_name_for
from .bounds import (POOL, EndpointBounds, EndpointLimits, SizeCheck, encode_refusal, load_body, max_bytes_per_token,
                     unaddressed)
from ..llm.encode_worker import ENCODE_STATS, EncodeRefused
from .shapes.chat import parse_messages, parse_sampling, parse_tool_choice, parse_tools
from .resent import ResentBodies, Unshared
from .stops import TokenText, apply_stop
from .tree import ConversationTree, Gen, Segment
from .wire import EndpointError, Msg, Reply, Sampling, WireRequest, bad, canon_args

log = structlog.get_logger("rolloutd.llm")

__all__ = ["EndpointSession", "GenerateFn"]

GenerateFn = Callable[[Any, SamplingParams], Awaitable[tuple[Generation, str, int]]]

# A sampled reply this long or shorter is parsed on the loop (EndpointSession._short): ~0.1 ms
# (Hermes, Qwen2.5 tokenizer; 512 tokens took 0.19 ms).
INLINE_REPLY_TOKENS = 256
# A request whose body repeats the previous one's text but for at most this many characters, and
# whose new messages (as many characters at most) extend a conversation, is decoded, translated
# and placed on the loop (EndpointSession._request): an agent's usual call, one reply and one tool
# result after its resent history. Its work there is ~0.1-0.3 ms; the hand-off it saves ~40-80 us
# of CPU and two loop turns. Longer texts would hold the loop (a tokenizer encode ~1 us per char).
INLINE_REQUEST_CHARS = 4096


def _release(seg: Segment | None) -> None:
    """A placement nobody will serve (its request was cancelled): the conversation is free again."""
    if seg is not None:
        seg.busy = False


def _release_placed(parsed_and_placed: tuple) -> None:
    _release(parsed_and_placed[1])


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
        self.created = int(time.time())
        self.fatal: BaseException | None = None
        # requests: every request but /health; refused_calls: every error answer (refused_by_status:
        # "<status> <code>" -> n); llm_calls: requests that reached the backend (limits.max_llm_calls).
        self.metrics: dict[str, Any] = {"requests": 0, "llm_calls": 0, "refused_calls": 0, "refused_by_status": {},
                                        "assistant_tokens_reused": 0,
                                          "assistant_tokens_reencoded": 0, "llm_s": 0.0, "aborts": 0,
                                          "malformed_tool_calls": 0, "forks": 0, "fork_fallbacks": 0,
                                          "budget_replies": 0,
                                          "endpoint_cpu_s": 0.0}
        self._inflight: set[asyncio.Future] = set()  # backend calls in flight (a job's requests run concurrently)
        self._cancelled: str | None = None
        self.text = TokenText(tokenizer)  # sampled ids -> text (stop strings, logprobs' tokens)
        self._prev_msgs: tuple[list, list[Msg]] | None = None
        self._size = SizeCheck()  # the characters of the last request's messages, counted once
        self._resent = ResentBodies()  # the request bodies so far: their resent history is not decoded again
        self.bounds = EndpointBounds()
        self._work = asyncio.Semaphore(1)  # this job's share of the endpoint threads: one at a time
        self._mbpt: int | None = None
        # the conversations this job's requests were placed in (segments, forks, our replies)
        self.tree = ConversationTree(tokenizer, self.call_ids, self.limits, dict(conv_options or {}), self.metrics)

    @property
    def segments(self) -> list[Segment]:
        return self.tree.segments

    @property
    def conv_options(self) -> dict:
        """Extra ``Conversation(...)`` keywords (model-family options), the tree's."""
        return self.tree.conv_options

    @conv_options.setter
    def conv_options(self, value: dict) -> None:
        self.tree.conv_options = value

    # -- bounds ----------------------------------------------------------------------------
    def _counted(self, fn, *args):
        """``fn(*args)`` in this thread, its CPU time (an encode worker's included) counted against
        ``limits.max_cpu_s``, long texts tokenized in a worker bounded by the context window and
        the CPU left (encode_bounds)."""
        lim = self.limits
        t0, w0 = time.thread_time(), ENCODE_STATS.cpu_s
        try:
            cpu = min(lim.max_request_cpu_s, max(0.1, lim.max_cpu_s - self.metrics["endpoint_cpu_s"]))
            with encode_bounds(lim.max_context, cpu):
                return fn(*args)
        finally:
            self.metrics["endpoint_cpu_s"] += time.thread_time() - t0 + ENCODE_STATS.cpu_s - w0

    async def _offload(self, fn, *args, abandoned: Callable[[Any], None] | None = None):
        """Run ``fn(*args)`` in an endpoint thread, one at a time per job, counted (``_counted``).
        A thread cannot be stopped: when the caller is cancelled, the job's turn is kept until
        the work ends (one writer of the job's conversations) and ``abandoned(result)`` undoes
        what nobody will use (a placement's busy mark)."""
        async with self._work:
            fut = asyncio.get_running_loop().run_in_executor(POOL, self._counted, fn, *args)
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                while not fut.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(fut)  # a second cancel is this one again: the thread still runs
                if abandoned is not None and fut.exception() is None:
                    abandoned(fut.result())
                raise
            except EncodeRefused as e:
                raise self._encode_refusal(e) from None

    async def settled(self) -> None:
        """Wait until none of this job's thread work runs (a cancelled request's included): before
        the trajectory is read."""
        async with self._work:
            pass

    async def _short(self, n_tokens: int, fn, *args):
        """``fn(*args)`` on the loop when it is work on a reply of at most ``INLINE_REPLY_TOKENS``
        and none of this job's thread work is running (the tree is then the loop's alone);
        otherwise ``_offload``. A hand-off to a thread and back costs ~40-80 us of CPU, more than
        parsing such a reply."""
        if n_tokens > INLINE_REPLY_TOKENS or self._work.locked():
            return await self._offload(fn, *args)
        try:
            return self._counted(fn, *args)
        except EncodeRefused as e:
            raise self._encode_refusal(e) from None

    async def _request(self, work: Callable[[int | None], tuple], raw: bytes | dict) -> tuple:
        """``work(INLINE_REQUEST_CHARS)`` on the loop when ``raw`` is a body (bytes) and none of
        this job's thread work runs; ``work(None)`` in the job's endpoint thread when that is not
        so or the body is more of a change than that (``Unshared``: nothing was kept). ``work``
        returns (the parsed request, its segment or None)."""
        if isinstance(raw, (bytes, bytearray)) and not self._work.locked():
            try:
                return self._counted(work, INLINE_REQUEST_CHARS)
            except Unshared:
                pass
            except EncodeRefused as e:
                raise self._encode_refusal(e) from None
        return await self._offload(work, None, abandoned=_release_placed)

    def _encode_refusal(self, e: EncodeRefused) -> EndpointError:
        return encode_refusal(e, self.limits, self.metrics["endpoint_cpu_s"])

    async def max_body(self) -> int:
        """The largest body this job may send: one whose content could still fit its context
        window, ``max_context x max bytes per token x json_expansion + json_overhead``."""
        if self._mbpt is None:
            self._mbpt = await asyncio.get_running_loop().run_in_executor(POOL, max_bytes_per_token, self.tokenizer)
        b = self.bounds
        return self.limits.max_context * self._mbpt * b.json_expansion + b.json_overhead

    def _load(self, raw: bytes | dict, new_chars: int | None = None) -> dict:
        """The request body; the history it resends is decoded and walked only where it differs
        from the last body's (``Unshared`` when more than ``new_chars`` characters do)."""
        return load_body(raw, self.bounds.max_depth, self._resent, new_chars)

    def _prepare_chat(self, raw: bytes | dict, new_chars: int | None = None):
        """Parse and check a chat request, the cheap refusals first (``new_chars``: ``_load``'s)."""
        body = self._load(raw, new_chars)
        msgs_raw = body.get("messages")
        if isinstance(msgs_raw, list) and len(msgs_raw) > self.limits.max_context:
            raise bad(f"{len(msgs_raw)} messages cannot fit this job's context window of {self.limits.max_context} "
                      "tokens", "messages", "context_length_exceeded")
        msgs = parse_messages(msgs_raw, self._prev_msgs)
        self._prev_msgs = (msgs_raw, msgs)
        self._size.check(msgs, self._mbpt, self.limits.max_context)
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

    def _refusal(self, calls: bool = True) -> EndpointError | None:
        """Why the job can no longer serve a request, or None; ``calls``: also one past
        ``max_llm_calls`` (``/v1/completions``; the chat routes answer that with
        :meth:`_budget_reply`). Only reads the session: endpoint threads call it too."""
        if self._cancelled is not None:
            return EndpointError(503, f"the job is {self._cancelled}; no more LLM calls",
                                 type="service_unavailable", code="job_" + self._cancelled, retry=False)
        if self.fatal is not None:
            return EndpointError(503, f"the job cannot sample any more: {self.fatal}",
                                 type="service_unavailable", code="job_failed", retry=False)
        d = self.limits.deadline
        if d is not None and time.monotonic() >= d:
            return EndpointError(503, "the job's deadline has passed; no more LLM calls",
                                 type="service_unavailable", code="deadline_exceeded", retry=False)
        cap = self.limits.max_llm_calls
        if calls and cap is not None and self.metrics["llm_calls"] >= cap:
            return EndpointError(429, f"this job's budget of {cap} LLM calls is spent",
                                 type="insufficient_quota", code="insufficient_quota", retry=False)
        if self.metrics["endpoint_cpu_s"] > self.limits.max_cpu_s:
            return EndpointError(429, f"this job's requests used more than {self.limits.max_cpu_s:g} s "
                                 "of the endpoint's CPU", type="insufficient_quota",
                                 code="cpu_budget_exhausted", retry=False)
        return None

    def _admit(self, calls: bool = True) -> None:
        """Refuse (raise) a request the job can no longer serve (:meth:`_refusal`)."""
        err = self._refusal(calls)
        if err is not None:
            raise self._refuse(err)

    def _placed(self, msgs: list[Msg], tools: list | None, max_chars: int | None = None) -> Segment | None:
        """The request's segment (``tree.place``) if the loop would serve it now, else None (the
        loop then answers it as before, placing it in a thread if ``max_chars`` declined it).
        Right after the request's parse, in the same thread or loop turn: one hand-off at most."""
        if self._budget_spent() or self._refusal() is not None:
            return None
        return self.tree.place(msgs, tools, max_chars)

    # -- chat ------------------------------------------------------------------------------
    async def chat(self, body: dict | bytes) -> Reply:
        """One ``/v1/chat/completions`` request (the body as bytes or parsed). Raises
        :class:`EndpointError`. Parsing, rendering and tokenization run in an endpoint thread
        unless the request is a small change (``_request``)."""
        return (await self._chat(body))[0]

    async def _chat(self, body: dict | bytes) -> tuple[Reply, dict]:
        self._admit(calls=False)
        if self._mbpt is None:
            await self.max_body()

        def work(inline: int | None):
            p = self._prepare_chat(body, inline)
            return p, self._placed(p[1], p[2], inline)

        (body, msgs, tools, parse_calls, samp), seg = await self._request(work, body)
        return await self.serve_messages(msgs, tools, parse_calls, samp, bool(body.get("logprobs")), seg), body

    async def serve_messages(self, msgs: list[Msg], tools: list | None, parse_calls: bool, samp: Sampling,
                             want_lp: bool = False, seg: Segment | None = None) -> Reply:
        """One translated chat request of any API shape: placed in the conversation it
        continues (or a new one; ``seg``: already placed, by :meth:`_placed`), sampled, parsed.
        A job's requests run concurrently; each conversation is extended by one request at a time."""
        if seg is None:
            if self._budget_spent():
                return self._budget_reply()
            self._admit()
            seg = await self._offload(self.tree.place, msgs, tools, abandoned=_release)
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
                return await self._short(len(ids), self._chat_reply, seg, n_ctx, ids, lps, finish, stop_hit,
                                         parse_calls, want_lp)
            except BaseException:
                seg.closed = True  # cancelled before its entry was recorded: the turn is in it, unmatched
                raise
        finally:
            seg.busy = False

    def _chat_reply(self, seg: Segment, n_ctx: int, ids: list[int], lps: list[float], finish: str,
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
        gen = Gen(content=content or "", raw=text, calls=calls, n_tokens=len(ids), ids=np.asarray(ids, np.int32))
        self.tree.add_reply(seg, gen)
        return Reply(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model, content=content or None,
                     tool_calls=tool_calls, reasoning=reasoning, finish_reason=finish, stop_sequence=stop_hit,
                     prompt_tokens=n_ctx, completion_tokens=len(ids), token_ids=ids,
                     logprobs=lps, token_strs=self.text.token_strs(ids) if want_lp else None)

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
                decode = self.text.decode
                text, stop_hit = apply_stop(g, decode(g.token_ids), samp.stop, "".join(texts), decode)
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
                raise bad(unaddressed(e), "messages", "context_length_exceeded") from None
            except RequestError as e:
                log.info("endpoint_backend_rejected", error=str(e))  # the address stays in our logs
                raise bad(f"the backend rejected the request: {unaddressed(e)}") from None
            except BackendError as e:
                raise EndpointError(503, f"no backend could serve the request: {unaddressed(e)}",
                                    type="service_unavailable", code="backend_unavailable") from None
            except Exception as e:  # noqa: BLE001 - router/lease failures (StaleLease, RouterError): the job's to decide
                self.fatal = e
                log.warning("endpoint_llm_failed", error=f"{type(e).__name__}: {e}")
                raise EndpointError(503, f"LLM unavailable for this job: {type(e).__name__}: {unaddressed(e)}",
                                    type="service_unavailable", code="job_failed", retry=False) from None
        finally:
            self.metrics["llm_s"] += time.perf_counter() - t0
            self._inflight.discard(fut)
            if not fut.done():  # our own request task was cancelled (server shutdown)
                fut.cancel()

    # -- completions -----------------------------------------------------------------------
    def _prepare_wire(self, raw: bytes | dict, parse: Callable[[dict], WireRequest],
                      new_chars: int | None = None) -> WireRequest:
        req = parse(self._load(raw, new_chars))
        self._size.check(req.messages, self._mbpt, self.limits.max_context)
        return req

    async def serve_wire(self, raw: bytes | dict, parse: Callable[[dict], WireRequest]) -> tuple[WireRequest, Reply]:
        """One request of another API shape: ``parse`` (a wire module's, e.g. ``shapes.anthropic.parse``)
        translates the body (``_request``: a small change on the loop, else in an endpoint thread);
        then the same session path as Chat Completions."""
        self._admit(calls=False)
        if self._mbpt is None:
            await self.max_body()

        def work(inline: int | None):
            req = self._prepare_wire(raw, parse, inline)
            return req, self._placed(req.messages, req.tools, inline)

        req, seg = await self._request(work, raw)
        return req, await self.serve_messages(req.messages, req.tools, req.parse_calls, req.sampling, seg=seg)

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

    def _prepare_completion(self, raw: bytes | dict):
        body = load_body(raw, self.bounds.max_depth)
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
        text = self.text.decode(g.token_ids)  # from the ids, never the backend's text
        if samp.stop:
            text, _ = apply_stop(g, text, samp.stop, "", self.text.decode)
        out = np.asarray(g.token_ids, dtype=np.int32).reshape(-1)
        lp = np.asarray(g.logprobs, dtype=np.float32).reshape(-1)
        seg = Segment(0, None, None, [])
        seg.raw = {"prompt_ids": np.asarray(ids, dtype=np.int32), "response_ids": out,
                   "loss_mask": np.ones(len(out), np.int8), "logprobs": lp,
                   "turns": [{"index": 0, "span": [0, len(out)], "start": 0, "end": len(out),
                              "finish_reason": g.finish_reason, "backend": str(backend),
                              "policy_version": int(pv), "latency_s": float(g.latency_s or 0.0),
                              "obs_start": None, "obs_end": None, "continuation": False}]}
        await self._short(len(out), self.tree.add_raw, seg)  # the tree is changed by one of the job's calls at a time
        ids_out, lps_out = out.tolist(), lp.astype(np.float64).tolist()
        fr = g.finish_reason if g.finish_reason in ("stop", "length") else "stop"
        reply = Reply(id=f"cmpl-{uuid.uuid4().hex}", model=self.model, content=text, tool_calls=[],
                      reasoning=None, finish_reason=fr, prompt_tokens=len(ids), completion_tokens=len(ids_out),
                      token_ids=ids_out, logprobs=lps_out,
                      token_strs=self.text.token_strs(ids_out) if want_lp else None)
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

