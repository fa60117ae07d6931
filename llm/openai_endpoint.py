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
* Requests of one session are served one at a time (the conversation is one sequence).
* ``parser`` names a tool-call parser of the registry (``rolloutd.llm.toolparse``); ``conv_options``
  are extra ``Conversation`` keywords (model-family settings); ``api_key`` is checked when set.

Token capture. Each session keeps its current *segment*: a :class:`Conversation` plus the
messages it represents, where the assistant messages are the replies we sampled. A request
whose ``messages`` start with exactly those messages (our replies sent back as text or as
structured ``tool_calls``, the same tools) *extends* the segment: only the new messages are
rendered (with the template's own delimiters, :meth:`Conversation.add_messages`) and the
assistant turns stay the exact sampled ids. Any other request (an edited, dropped or
summarized history, other tools, a retry after our reply) opens a new segment rendered from the
request's messages. docs/HARNESS.md says what a trainer does with segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from .client import Generation, SamplingParams
from .conversation import Conversation
from .errors import BackendError, ContextOverflow, RequestError
from .openai_wire import (
    EndpointError,
    Msg,
    Reply,
    Sampling,
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
from .toolparse import get_parser

log = structlog.get_logger("rolloutd.llm")

__all__ = ["EndpointError", "EndpointLimits", "EndpointServer", "EndpointSession", "make_app", "serve"]

GenerateFn = Callable[[Any, SamplingParams], Awaitable[tuple[Generation, str, int]]]


@dataclass(slots=True)
class EndpointLimits:
    """Per-job limits. ``deadline`` is a ``time.monotonic()`` instant (None: none)."""

    max_llm_calls: int | None = None
    max_context: int = 32768
    max_tokens: int = 1024  # per request, when the request names none (capped by the context left)
    deadline: float | None = None
    max_aborts: int = 3  # server-side aborts (weight swaps) continued within one request


@dataclass(slots=True, eq=False)
class _Gen:
    """One assistant message we returned: what the agent may send back."""

    content: str  # message.content as returned ("" for null)
    raw: str  # the full sampled text (tool-call markup included)
    calls: tuple  # ((name, canonical JSON arguments), ...) as returned in tool_calls
    n_tokens: int
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

    __slots__ = ("closed", "conv", "entries", "index", "raw", "tools")

    def __init__(self, index: int, conv: Conversation | None, tools: list | None, entries: list) -> None:
        self.index = index
        self.conv = conv
        self.tools = tools
        self.entries: list[Msg | _Gen] = entries
        self.closed = False  # a request failed mid-way: never extended again
        self.raw: dict | None = None  # /v1/completions: arrays and the one turn

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

    def __init__(self, generate: GenerateFn, tokenizer: Any, *, parser: str = "hermes", model: str = "rolloutd",
                 limits: EndpointLimits | None = None, api_key: str | None = None,
                 parser_options: dict | None = None, conv_options: dict | None = None) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.parser = get_parser(parser, **(parser_options or {}))
        self.model = model
        self.limits = limits or EndpointLimits()
        self.api_key = api_key
        self.conv_options = dict(conv_options or {})  # extra Conversation(...) keywords (model-family options)
        self.created = int(time.time())
        self.segments: list[_Segment] = []
        self.fatal: BaseException | None = None
        self.metrics: dict[str, float] = {"llm_calls": 0, "refused_calls": 0, "assistant_tokens_reused": 0,
                                          "assistant_tokens_reencoded": 0, "llm_s": 0.0, "aborts": 0,
                                          "malformed_tool_calls": 0}
        self._gens: list[_Gen] = []
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future | None = None
        self._cancelled: str | None = None
        self._call_ids = itertools.count()
        self._decode_cache: dict[int, str] = {}
        self._prev_msgs: tuple[list, list[Msg]] | None = None

    # -- admission -------------------------------------------------------------------------
    def cancel(self, reason: str = "cancelled") -> None:
        """Refuse every later call (503) and cancel the backend call in flight (closing its
        HTTP connection, which is how vLLM and SGLang abort a request)."""
        if self._cancelled is None:
            self._cancelled = reason
            log.info("endpoint_cancelled", reason=reason)
        fut = self._inflight
        if fut is not None and not fut.done():
            fut.cancel()

    @property
    def cancelled(self) -> str | None:
        return self._cancelled

    def _refuse(self, err: EndpointError) -> EndpointError:
        self.metrics["refused_calls"] += 1
        log.info("endpoint_call_refused", status=err.status, code=err.code, reason=err.message)
        return err

    def _admit(self) -> None:
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
        if cap is not None and self.metrics["llm_calls"] >= cap:
            raise self._refuse(EndpointError(429, f"this job's budget of {cap} LLM calls is spent",
                                             type="insufficient_quota", code="insufficient_quota", retry=False))

    # -- chat ------------------------------------------------------------------------------
    async def chat(self, body: dict) -> Reply:
        """One ``/v1/chat/completions`` request. Raises :class:`EndpointError`."""
        self._admit()
        raw = body.get("messages")
        msgs = parse_messages(raw, self._prev_msgs)
        self._prev_msgs = (raw, msgs)
        tools = parse_tools(body.get("tools"))
        parse_calls = parse_tool_choice(body.get("tool_choice"), tools)
        samp = parse_sampling(body)
        async with self._lock:
            self._admit()
            self.metrics["llm_calls"] += 1
            seg = self._place(msgs, tools)
            n_turns, n_ctx = seg.conv.num_turns, seg.conv.num_tokens
            try:
                ids, lps, finish, text = await self._sample(seg.conv, samp)
            except BaseException:
                if seg.conv.num_turns > n_turns:  # a partial (aborted) reply is in it: never extend it again
                    seg.closed = True
                raise
            return self._chat_reply(seg, n_ctx, ids, lps, finish, text, parse_calls, bool(body.get("logprobs")))

    def _chat_reply(self, seg: _Segment, n_ctx: int, ids: list[int], lps: list[float], finish: str, text: str,
                    parse_calls: bool, want_lp: bool) -> Reply:
        content, reasoning, tool_calls, calls = text, None, [], ()
        if parse_calls:
            # A parser that reads control tokens (harmony, Mistral) gets the ids decoded with them
            # kept, as in the built-in agent loop; it should then also set ParseResult.content.
            skip = getattr(self.parser, "skip_special_tokens", True)
            res = self.parser.parse(text if skip else self.tokenizer.decode(ids, skip_special_tokens=False))
            if res.errors:  # a malformed call stays in the content as text (vLLM does the same)
                self.metrics["malformed_tool_calls"] += len(res.errors)
            if res.calls:
                n = next(self._call_ids)
                tool_calls = [{"id": f"call_{n}_{k}", "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                              for k, c in enumerate(res.calls)]
                calls = tuple((c.name, canon_args(c.arguments)) for c in res.calls)
                content = getattr(res, "content", None)
                if content is None:  # the text around the calls
                    content = text
                    for c in res.calls:
                        content = content.replace(c.raw, "", 1) if c.raw else content
                    content = content.strip()
            elif getattr(res, "content", None) is not None:  # e.g. reasoning split off by the parser
                content = res.content
            reasoning = getattr(res, "reasoning", None)
        if finish == "stop" and tool_calls:
            finish = "tool_calls"
        gen = _Gen(content=content or "", raw=text, calls=calls, n_tokens=len(ids))
        seg.entries.append(gen)
        self._gens.append(gen)
        return Reply(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model, content=content if content or not tool_calls
                     else None, tool_calls=tool_calls, reasoning=reasoning, finish_reason=finish,
                     prompt_tokens=n_ctx, completion_tokens=len(ids), token_ids=ids,
                     logprobs=lps, token_strs=self._token_strs(ids) if want_lp else None)

    def _place(self, msgs: list[Msg], tools: list | None) -> _Segment:
        """The segment this request continues (its new messages appended), or a new one."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.conv is not None and not seg.closed and tools == seg.tools \
                and len(msgs) >= len(seg.entries):
            entries = seg.entries
            if all((e.matches(m) if type(e) is _Gen else e.key == m.key) for e, m in zip(entries, msgs)):
                tail = msgs[len(entries):]
                conv = seg.conv
                if conv.awaiting_generation and not tail:  # the same request again after a failure
                    return seg
                if tail and not conv.awaiting_generation:
                    try:
                        conv.add_messages([m.template_dict() for m in tail])
                    except ContextOverflow as e:
                        raise bad(str(e), "messages", "context_length_exceeded") from None
                    except Exception as e:  # noqa: BLE001 - the template refused them (e.g. raise_exception on role order)
                        raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                                  "messages") from None
                    for e in entries:
                        if type(e) is _Gen and not e.reused:
                            e.reused = True
                            self.metrics["assistant_tokens_reused"] += e.n_tokens
                    entries.extend(tail)
                    return seg
        return self._new_segment(msgs, tools)

    def _new_segment(self, msgs: list[Msg], tools: list | None) -> _Segment:
        try:
            conv = Conversation(self.tokenizer, [m.template_dict() for m in msgs], tools,
                                self.limits.max_context, **self.conv_options)
        except Exception as e:  # noqa: BLE001 - TemplateError, or the template's own raise_exception
            raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                      "messages") from None
        if conv.remaining_context <= 0:
            raise bad(f"the messages take {conv.num_tokens} tokens; this job's context window is "
                      f"{self.limits.max_context}", "messages", "context_length_exceeded")
        if self.segments and self.segments[-1].n_turns == 0:
            self.segments.pop()  # an earlier request that never sampled: nothing to keep
        seg = _Segment(len(self.segments), conv, tools, list(msgs))
        if seg.index:
            log.info("endpoint_segment_opened", segment=seg.index, messages=len(msgs), prompt_tokens=conv.num_tokens)
        for m in msgs:
            if m.role == "assistant":
                g = next((g for g in self._gens if g.matches(m)), None)
                if g is not None and not g.reencoded:
                    g.reencoded = True
                    self.metrics["assistant_tokens_reencoded"] += g.n_tokens
        self.segments.append(seg)
        return seg

    # -- sampling --------------------------------------------------------------------------
    async def _sample(self, conv: Conversation, samp: Sampling) -> tuple[list[int], list[float], str, str]:
        """Generate one assistant message into ``conv`` (continuing it after server-side aborts)."""
        want = samp.max_tokens if samp.max_tokens is not None else self.limits.max_tokens
        if conv.remaining_context <= 0:
            raise bad(f"no room left to generate: {conv.num_tokens} tokens of this job's context window of "
                      f"{self.limits.max_context} are used", "messages", "context_length_exceeded")
        ids: list[int] = []
        lps: list[float] = []
        texts: list[str] = []
        aborts = 0
        while True:
            max_new = min(want - len(ids), conv.remaining_context)
            if max_new <= 0:
                finish = "length"
                break
            g, backend, pv = await self._call(conv.context_ids, samp.params(max_new))
            text = g.text if g.text is not None else self._decode(g.token_ids)
            if samp.stop:
                text = self._apply_stop(g, text, samp.stop, "".join(texts))
            capped = max_new < want - len(ids) and g.finish_reason == "length" and len(g.token_ids) >= max_new
            conv.add_generation(g, backend, pv)
            if capped:  # cut by the context window, not by max_tokens (as the built-in loop records it)
                conv.set_last_finish_reason("context_overflow")
            ids += np.asarray(g.token_ids).tolist()
            lps += np.asarray(g.logprobs, dtype=np.float64).tolist()
            texts.append(text)
            finish = g.finish_reason
            if finish != "abort":
                break
            aborts += 1
            self.metrics["aborts"] += 1
            log.info("endpoint_generation_aborted", backend=backend, tokens=len(g.token_ids), aborts=aborts)
            if aborts > self.limits.max_aborts:
                raise EndpointError(503, f"generation aborted {aborts} times in a row", type="service_unavailable",
                                    code="backend_aborted")
        return ids, lps, finish, "".join(texts)

    def _apply_stop(self, g: Generation, text: str, stops: list[str], before: str) -> str:
        """Cut the generation after the token that completes the first stop string (OpenAI's
        ``stop``; the tokens after it are dropped, so the trajectory holds what the agent saw);
        the returned text ends before the stop string. ``before``: this message's earlier parts."""
        full = before + text
        hits = [(i, s) for s in stops if (i := full.find(s, max(0, len(before) - len(s) + 1))) >= 0]
        if not hits:
            return text
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
        return full[len(before):cut] if cut >= len(before) else ""

    async def _call(self, ids: Any, params: SamplingParams) -> tuple[Generation, str, int]:
        """The backend call, cancellable by :meth:`cancel` and bounded by the deadline."""
        timeout = None
        if self.limits.deadline is not None:
            timeout = self.limits.deadline - time.monotonic()
            if timeout <= 0:
                raise self._refuse(EndpointError(503, "the job's deadline has passed", type="service_unavailable",
                                                 code="deadline_exceeded", retry=False))
        fut = self._inflight = asyncio.ensure_future(self.generate(ids, params))
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
                raise bad(str(e), "messages", "context_length_exceeded") from None
            except RequestError as e:
                raise bad(f"the backend rejected the request: {e}") from None
            except BackendError as e:
                raise EndpointError(503, f"no backend could serve the request: {e}", type="service_unavailable",
                                    code="backend_unavailable") from None
            except Exception as e:  # noqa: BLE001 - router/lease failures (StaleLease, RouterError): the job's to decide
                self.fatal = e
                log.warning("endpoint_llm_failed", error=f"{type(e).__name__}: {e}")
                raise EndpointError(503, f"LLM unavailable for this job: {type(e).__name__}: {e}",
                                    type="service_unavailable", code="job_failed", retry=False) from None
        finally:
            self.metrics["llm_s"] += time.perf_counter() - t0
            self._inflight = None
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
    async def complete(self, body: dict) -> tuple[Reply, str]:
        """One ``/v1/completions`` request: a text or token-id prompt, recorded as its own segment."""
        self._admit()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        samp = parse_sampling(body)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        async with self._lock:
            self._admit()
            room = self.limits.max_context - len(ids)
            if room <= 0:
                raise bad(f"the prompt takes {len(ids)} tokens; this job's context window is "
                          f"{self.limits.max_context}", "prompt", "context_length_exceeded")
            self.metrics["llm_calls"] += 1
            want = samp.max_tokens if samp.max_tokens is not None else min(16, self.limits.max_tokens)
            g, backend, pv = await self._call(np.asarray(ids, dtype=np.int32), samp.params(min(want, room)))
            text = g.text if g.text is not None else self._decode(g.token_ids)
            if samp.stop:
                text = self._apply_stop(g, text, samp.stop, "")
            out = np.asarray(g.token_ids, dtype=np.int32).reshape(-1)
            lp = np.asarray(g.logprobs, dtype=np.float32).reshape(-1)
            if self.segments and self.segments[-1].n_turns == 0:
                self.segments.pop()
            seg = _Segment(len(self.segments), None, None, [])
            seg.raw = {"prompt_ids": np.asarray(ids, dtype=np.int32), "response_ids": out,
                       "loss_mask": np.ones(len(out), np.int8), "logprobs": lp,
                       "turns": [{"index": 0, "span": [0, len(out)], "start": 0, "end": len(out),
                                  "finish_reason": g.finish_reason, "backend": str(backend),
                                  "policy_version": int(pv), "latency_s": float(g.latency_s or 0.0),
                                  "obs_start": None, "obs_end": None, "continuation": False}]}
            self.segments.append(seg)
            ids_out, lps_out = out.tolist(), lp.astype(np.float64).tolist()
            fr = g.finish_reason if g.finish_reason in ("stop", "length") else "stop"
            reply = Reply(id=f"cmpl-{uuid.uuid4().hex}", model=self.model, content=text, tool_calls=[],
                          reasoning=None, finish_reason=fr, prompt_tokens=len(ids), completion_tokens=len(ids_out),
                          token_ids=ids_out, logprobs=lps_out,
                          token_strs=self._token_strs(ids_out) if want_lp else None)
            return reply, text

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
        out["metrics"] = m
        return out


# -- the ASGI app ----------------------------------------------------------------------------
MAX_BODY = 64 * 1024 * 1024
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def _read_body(receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client went away")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise EndpointError(413, f"request body larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def _json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def make_app(session: EndpointSession, *, max_body: int = MAX_BODY):
    """A raw ASGI 3 app serving ``session`` (no framework: three routes)."""

    async def send_json(send, status: int, payload: bytes, extra: list | None = None) -> None:
        headers = _JSON + [(b"content-length", str(len(payload)).encode())] + (extra or [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def send_sse(send, chunks: list[bytes]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for c in chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def authorized(scope) -> bool:
        if not session.api_key:
            return True
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                return v.decode("latin-1") == "Bearer " + session.api_key
        return False

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
        method = scope["method"]
        try:
            if path == "/health":
                await send_json(send, 200, b"{}")
                return
            if not authorized(scope):
                raise EndpointError(401, "invalid API key", code="invalid_api_key", retry=False)
            if path == "/models" and method == "GET":
                await send_json(send, 200, dumps(models_response(session.model, session.created)))
                return
            if path in ("/chat/completions", "/completions"):
                if method != "POST":
                    raise EndpointError(405, f"{method} {scope['path']}: use POST")
                body = _json_body(await _read_body(receive, max_body))
                stream = bool(body.get("stream"))
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                if path == "/chat/completions":
                    r = await session.chat(body)
                    if stream:
                        await send_sse(send, chat_chunks(r, include_usage))
                    else:
                        await send_json(send, 200, dumps(chat_response(r)))
                else:
                    r, text = await session.complete(body)
                    if stream:
                        await send_sse(send, completion_chunks(r, text, include_usage))
                    else:
                        await send_json(send, 200, dumps(completion_response(r, text)))
                return
            raise EndpointError(404, f"no route {method} {scope['path']}", code="not_found")
        except EndpointError as e:
            extra = [] if e.retry is None else [(b"x-should-retry", b"true" if e.retry else b"false")]
            await send_json(send, e.status, e.body(), extra)
        except ConnectionResetError:
            return
        except Exception as e:  # a bug here must not take the job's server down with it
            log.exception("endpoint_request_crashed", path=scope["path"])
            err = EndpointError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
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
        try:
            await asyncio.wait_for(self._server.shutdown(), timeout_s)
        except asyncio.TimeoutError:
            for t in list(self._server.server_state.tasks):
                t.cancel()
        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds)


async def serve(app, *, uds: str | None = None, host: str | None = None, port: int = 0) -> EndpointServer:
    """Start uvicorn for ``app`` on ``uds`` (a Unix socket path) or ``host:port`` (port 0: any free one)."""
    if (uds is None) == (host is None):
        raise ValueError("serve: give exactly one of uds= or host=")
    import uvicorn

    config = uvicorn.Config(app, uds=uds, host=host or "127.0.0.1", port=port, log_config=None, access_log=False,
                            lifespan="off", ws="none", timeout_graceful_shutdown=2, server_header=False,
                            date_header=False)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    try:
        await server.startup()
    except SystemExit:  # uvicorn exits the process when it cannot bind; here that is an error of this job
        raise RuntimeError(f"the endpoint server could not listen on {uds or f'{host}:{port}'}") from None
    bound = None
    if uds is None:
        bound = server.servers[0].sockets[0].getsockname()[1]
    log.info("endpoint_serving", uds=uds, host=host, port=bound)
    return EndpointServer(server, uds, host if uds is None else None, bound)
