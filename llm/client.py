"""Token-in/token-out HTTP client for vLLM and SGLang backends.

``LLMClient(base_url, api="vllm" | "sglang")`` wraps one pooled ``httpx.AsyncClient``.
:meth:`LLMClient.generate` sends prompt token ids and returns the sampled token ids
with one logprob per token, exactly as the server produced them.

Wire formats (checked against the servers' own request/response models):

* vLLM, ``POST /v1/completions``: ``{"model", "prompt": [ids], "max_tokens", "temperature",
  "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "logprobs": 0, "return_token_ids": true,
  "return_tokens_as_token_ids": true}``; reply ``choices[0].token_ids`` (vLLM >= 0.10.2;
  older servers: parsed from ``logprobs.tokens == ["token_id:N", ...]``),
  ``choices[0].logprobs.token_logprobs``, ``choices[0].finish_reason`` in
  ``stop | length | abort``.
* SGLang, ``POST /generate``: ``{"input_ids": [ids], "sampling_params": {"max_new_tokens", ...},
  "return_logprob": true, "logprob_start_len": -1}``; reply ``meta_info.output_token_logprobs``
  as ``[logprob, token_id, text|null]`` triples, ``meta_info.finish_reason`` as
  ``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}`` /
  ``{"type": "abort", ...}``.

Streaming (vLLM only): ``generate(..., partial=Partial())`` sends the same request with
``"stream": true, "stream_options": {"include_usage": true}`` and reads vLLM's server-sent events
(``data: {chunk}`` per engine step, then ``data: [DONE]``; each chunk's ``choices[0]`` carries the
step's new ``token_ids`` (with ``return_token_ids``; else ``logprobs.tokens`` as ``token_id:N``) and
``logprobs.token_logprobs``, ``finish_reason`` on the last one; a last chunk with ``"choices": []``
carries ``usage``; an error mid-stream is ``data: {"error": {...}}``). The sampled tokens land in
``partial`` as each chunk arrives, so a caller that cancels the call (closing the connection, vLLM's
abort) still has the tokens sampled before it: ``partial.generation()`` is them as an ``abort``
generation. SGLang keeps its own abort (:meth:`LLMClient.abort` by rid, which returns them).

Failure mapping: connection errors, HTTP 5xx/404/408/429 and malformed replies raise
:class:`BackendError` (the caller reports the backend to the router and retries
elsewhere); the per-call timeout raises :class:`LLMTimeout` (a ``BackendError``);
a context-length rejection raises :class:`ContextOverflow`; other 4xx raise
:class:`RequestError`. Cancelling the awaiting task closes the HTTP connection,
which is how vLLM and SGLang abort a request.

Transport: plain ``http://`` backends go through :class:`rolloutd.llm.http_transport.FastTransport`
(a lean keep-alive pool plugged into ``httpx.AsyncClient``; httpx's default pool is
quadratic in the number of connections, see that module); ``https://`` uses httpx's
default. Pass ``transport=`` to override.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence

import httpx
import numpy as np
import structlog

from .errors import BackendError, ContextOverflow, LLMError, LLMTimeout, RequestError
from .http_transport import FastTransport

log = structlog.get_logger("rolloutd.llm")

__all__ = [
    "LLMClient",
    "SamplingParams",
    "Generation",
    "Partial",
    "BackendError",
    "LLMTimeout",
    "ContextOverflow",
    "RequestError",
    "LLMError",
    "parse_prometheus",
    "simple_generate",
    "failover_generate",
]

FINISH_REASONS = ("stop", "length", "abort", "context_overflow")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings (vLLM's and SGLang's `stop`): the server ends the generation at the token that
    # completes one; that token is kept in the ids (docs/LLM.md, "A real vLLM").
    stop: list[str] = field(default_factory=list)
    # Sample on past EOS until max_tokens (vLLM's and SGLang's `ignore_eos`): fixed-length calls
    # for benchmarks and tests; the EOS token, when sampled, stays in the ids like any other.
    ignore_eos: bool = False

    def replace(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)


@dataclass(slots=True)
class Generation:
    token_ids: np.ndarray  # int32, exactly as sampled (EOS/stop token included when the server returns it)
    logprobs: np.ndarray  # float32, one per token
    finish_reason: str  # "stop" | "length" | "abort" | "context_overflow"
    text: str | None = None
    latency_s: float = 0.0
    stop_reason: int | str | None = None  # vLLM stop_reason / SGLang "matched"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class Partial:
    """The tokens of a streamed generation received so far (see the module doc): ``ids`` and
    ``logprobs`` grow together, one chunk at a time, so they always have the same length;
    ``finish_reason`` once the last chunk came."""

    __slots__ = ("ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def generation(self) -> Generation:
        """What arrived: an ``abort`` generation, or the whole one when its last chunk came before
        the call was cancelled (an interrupt that lands after the finish must not reopen it)."""
        return Generation(token_ids=np.asarray(self.ids, dtype=np.int32), logprobs=_as_float32(self.logprobs),
                          finish_reason=self.finish_reason or "abort", stop_reason=self.stop_reason)


_CONTEXT_RE = re.compile(
    r"maximum context length|context length|context window|max_model_len|maximum model length"
    r"|prompt is too long|longer than the model"
    # vLLM 0.32 clamps max_tokens to the context left; a prompt that fills the context exactly gets
    # this 400. generate() never sends max_tokens < 1, so it can only mean that.
    r"|max_tokens must be at least 1",
    re.IGNORECASE,
)

_VLLM_METRICS = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
}
_SGLANG_METRICS = {
    "sglang:num_running_reqs": "num_requests_running",
    "sglang:num_queue_reqs": "num_requests_waiting",
    "sglang:token_usage": "kv_cache_usage",
}
_METRIC_MAPS = {"vllm": (_VLLM_METRICS, _SGLANG_METRICS), "sglang": (_SGLANG_METRICS, _VLLM_METRICS)}

_JSON_HEADERS = {"content-type": "application/json"}


def parse_prometheus(text: str, names: dict[str, str] | None = None) -> dict[str, float]:
    """Sum the samples of the named metrics over all label sets.

    ``names`` maps Prometheus metric names to result keys (default: vLLM's
    running/waiting/KV-usage gauges mapped to ``num_requests_running``,
    ``num_requests_waiting``, ``kv_cache_usage``).
    """
    names = names or _VLLM_METRICS
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            rest = line[close + 1 :].split()
        else:
            name = line[:space] if space != -1 else line
            rest = line[space + 1 :].split() if space != -1 else []
        key = names.get(name)
        if key is None or not rest:
            continue
        try:
            v = float(rest[0])
        except ValueError:
            continue
        if math.isnan(v):
            continue
        out[key] = out.get(key, 0.0) + v
    return out


def _ids_to_json(ids: Any) -> str:
    cached = getattr(ids, "json_ids", None)  # Conversation.context_ids carries its own encoding
    if cached is not None:
        return cached
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    elif not isinstance(ids, list):
        ids = [int(x) for x in ids]
    return json.dumps(ids, separators=(",", ":"))


def _as_float32(values: Sequence[Any]) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        return np.asarray([float("nan") if v is None else float(v) for v in values], dtype=np.float32)


def _stop_fields(p: SamplingParams, d: dict) -> None:
    """The sampling fields vLLM's body and SGLang's ``sampling_params`` spell alike, set when used."""
    if p.stop_token_ids:
        d["stop_token_ids"] = [int(x) for x in p.stop_token_ids]
    if p.stop:
        d["stop"] = [str(x) for x in p.stop]
    if p.ignore_eos:
        d["ignore_eos"] = True


def _sse_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its ``data:`` lines joined), None for a comment-only one."""
    data = [ln[5:].removeprefix(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(data).strip() if data else None


# A timeout that never swallows the caller's cancellation: Python 3.11's asyncio.wait_for returns
# the inner result when it is done at the moment the outer task is cancelled (fixed in 3.12).
if sys.version_info >= (3, 11):

    async def with_timeout(coro: Awaitable[Any], timeout: float | None) -> Any:
        async with asyncio.timeout(timeout):
            return await coro

else:  # pragma: no cover - Python 3.10

    async def with_timeout(coro: Awaitable[Any], timeout: float | None) -> Any:
        return await asyncio.wait_for(coro, timeout)


class LLMClient:
    """Pooled async client for one backend (one base URL)."""

    def __init__(
        self,
        base_url: str,
        api: str = "vllm",
        model: str | None = None,
        timeout: float = 60.0,
        max_connections: int = 1024,
        *,
        connect_timeout: float = 10.0,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        keepalive_expiry: float = 4.0,
        return_token_ids: bool = True,
    ) -> None:
        if api not in ("vllm", "sglang"):
            raise ValueError(f"api must be 'vllm' or 'sglang', not {api!r}")
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.model = model
        self.timeout = float(timeout)
        # vLLM: return_token_ids also echoes prompt_token_ids (a reply as large as the prompt);
        # False relies on return_tokens_as_token_ids alone ("token_id:N" in logprobs.tokens)
        self.return_token_ids = bool(return_token_ids)
        if transport is None and self.base_url.startswith("http://"):
            # httpcore's pool is quadratic in pooled connections; see llm/http_transport.py
            transport = FastTransport(max_connections=max_connections, keepalive_expiry=keepalive_expiry)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.timeout, connect=min(connect_timeout, self.timeout)),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_expiry,
            ),
            headers=headers,
            transport=transport,
            trust_env=False,
            # TLS only matters for https backends; skipping the context saves ~30 ms per client
            verify=self.base_url.startswith("https"),
        )
        self._path = "/v1/completions" if api == "vllm" else "/generate"
        self._resolving: asyncio.Future | None = None
        # absolute, pre-parsed: httpx then skips URL parsing and merging on every request
        self._url = httpx.URL(self.base_url + self._path)

    # -- context manager -------------------------------------------------------------
    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def __repr__(self) -> str:
        return f"LLMClient({self.base_url!r}, api={self.api!r}, model={self.model!r})"

    # -- generation ------------------------------------------------------------------
    async def _resolve_model(self) -> str:
        if self.model is None:
            # One lookup for every request that finds the name missing: after a checkpoint swap a
            # whole batch arrives at once, and each parallel /v1/models call would need a connection.
            if self._resolving is None:
                self._resolving = asyncio.ensure_future(self.models())
            fut = self._resolving
            try:
                models = await asyncio.shield(fut)
            finally:
                if fut.done() and self._resolving is fut:
                    self._resolving = None
            if not models:
                raise BackendError("backend serves no model", backend=self.base_url)
            self.model = models[0]
        return self.model

    def _body(self, ids_json: str, p: SamplingParams, model: str | None, rid: str | None = None,
              stream: bool = False) -> bytes:
        if self.api == "vllm":
            d: dict[str, Any] = {
                "max_tokens": int(p.max_tokens),
                "temperature": float(p.temperature),
                "top_p": float(p.top_p),
                "logprobs": 0,
                "return_token_ids": self.return_token_ids,
                "return_tokens_as_token_ids": True,
                "stream": stream,
            }
            if stream:
                d["stream_options"] = {"include_usage": True}
            if model is not None:
                d["model"] = model
            if p.top_k is not None and p.top_k > 0:
                d["top_k"] = int(p.top_k)
            if p.seed is not None:
                d["seed"] = int(p.seed)
            _stop_fields(p, d)
            key = '"prompt":'
        else:
            sp: dict[str, Any] = {
                "max_new_tokens": int(p.max_tokens),
                "temperature": float(p.temperature),
                "top_p": float(p.top_p),
                "top_k": int(p.top_k) if p.top_k is not None and p.top_k > 0 else -1,
                "skip_special_tokens": True,
            }
            if p.seed is not None:
                sp["sampling_seed"] = int(p.seed)
            _stop_fields(p, sp)
            d = {"sampling_params": sp, "return_logprob": True, "logprob_start_len": -1, "stream": False}
            if rid is not None:  # lets abort(rid) end it early with the tokens sampled so far
                d["rid"] = rid
            key = '"input_ids":'
        head = json.dumps(d, separators=(",", ":"))
        return (head[:-1] + "," + key + ids_json + "}").encode()

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        *,
        timeout: float | None = None,
        rid: str | None = None,
        partial: Partial | None = None,
    ) -> Generation:
        """Sample a continuation of ``prompt_ids``. See the module doc for errors. ``rid`` (SGLang
        only) names the request for :meth:`abort`; ``partial`` (vLLM only) streams the reply into
        it, so the tokens sampled before a cancellation are kept there."""
        t0 = time.perf_counter()
        if params.max_tokens <= 0:
            raise ContextOverflow("max_tokens <= 0: no room left in the context window")
        model = await self._resolve_model() if self.api == "vllm" else self.model
        stream = partial is not None and self.api == "vllm"
        body = self._body(_ids_to_json(prompt_ids), params, model, rid if self.api == "sglang" else None, stream)
        budget = self.timeout if timeout is None else timeout
        if stream:
            g = await self._generate_stream(body, budget, partial)
            g.latency_s = time.perf_counter() - t0
            return g
        try:
            resp = await with_timeout(
                self._http.post(self._url, content=body, headers=_JSON_HEADERS), budget
            )
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            log.warning("llm_request_timed_out", backend=self.base_url, timeout_s=budget)
            raise LLMTimeout(f"no reply within {budget:.3g}s from {self.base_url}", backend=self.base_url) from e
        except httpx.RequestError as e:  # transport errors, undecodable bodies, ...
            log.warning("llm_request_failed", backend=self.base_url, error=f"{type(e).__name__}: {e}")
            raise BackendError(f"{type(e).__name__}: {e}", backend=self.base_url) from e
        status = resp.status_code
        if status != 200:
            raise self._http_error(status, resp.content)
        try:
            data = json.loads(resp.content)
            g = self._parse_vllm(data) if self.api == "vllm" else self._parse_sglang(data)
        except BackendError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            log.warning("llm_reply_malformed", backend=self.base_url, error=f"{type(e).__name__}: {e}")
            raise BackendError(f"malformed reply: {type(e).__name__}: {e}", backend=self.base_url) from e
        g.latency_s = time.perf_counter() - t0
        return g

    async def _generate_stream(self, body: bytes, budget: float, partial: Partial) -> Generation:
        try:
            return await with_timeout(self._read_stream(body, partial), budget)
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            log.warning("llm_request_timed_out", backend=self.base_url, timeout_s=budget, streamed_tokens=len(partial))
            raise LLMTimeout(f"no reply within {budget:.3g}s from {self.base_url}", backend=self.base_url) from e
        except httpx.RequestError as e:
            log.warning("llm_request_failed", backend=self.base_url, error=f"{type(e).__name__}: {e}",
                        streamed_tokens=len(partial))
            raise BackendError(f"{type(e).__name__}: {e}", backend=self.base_url) from e

    async def _read_stream(self, body: bytes, partial: Partial) -> Generation:
        """vLLM's event stream into ``partial`` (module doc); the Generation once it ends."""
        async with self._http.stream("POST", self._url, content=body, headers=_JSON_HEADERS) as resp:
            if resp.status_code != 200:
                raise self._http_error(resp.status_code, await resp.aread())
            usage = None
            texts: list[str] = []
            done = False
            buf = b""
            async for data in resp.aiter_raw():
                buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    payload = _sse_data(ev)
                    if payload is None:
                        continue
                    if payload == b"[DONE]":
                        done = True
                        continue
                    try:
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            err = chunk["error"]
                            msg = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
                            raise BackendError(f"error in the stream from {self.base_url}: {msg}", backend=self.base_url)
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for ch in chunk["choices"]:
                            ids, lps = self._chunk_tokens(ch)
                            # ids and logprobs grow together, with no await between: a cancellation
                            # never sees one without the other
                            partial.ids += ids
                            partial.logprobs += lps
                            if ch.get("text"):
                                texts.append(ch["text"])
                            finish = ch.get("finish_reason")
                            if finish is not None:
                                if finish not in ("stop", "length", "abort"):
                                    raise BackendError(f"unexpected finish_reason {finish!r}", backend=self.base_url)
                                partial.finish_reason, partial.stop_reason = finish, ch.get("stop_reason")
                    except BackendError:
                        raise
                    except (ValueError, KeyError, TypeError, AttributeError) as e:
                        log.warning("llm_reply_malformed", backend=self.base_url, error=f"{type(e).__name__}: {e}")
                        raise BackendError(f"malformed stream chunk: {type(e).__name__}: {e}",
                                           backend=self.base_url) from e
        if not done or partial.finish_reason is None:
            raise BackendError(f"the stream from {self.base_url} ended without "
                               f"{'a finish_reason' if done else 'data: [DONE]'}", backend=self.base_url)
        g = partial.generation()
        g.text = "".join(texts)
        if usage:
            g.prompt_tokens = usage.get("prompt_tokens")
            g.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return g

    def _chunk_tokens(self, ch: dict) -> tuple[list[int], list[float]]:
        lp = ch.get("logprobs") or {}
        ids = ch.get("token_ids")
        if ids is None:
            toks = lp.get("tokens") or []
            if not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                raise BackendError("stream chunk has no token ids (needs vLLM >= 0.10.2 return_token_ids, "
                                   "or return_tokens_as_token_ids)", backend=self.base_url)
            ids = [int(t[9:]) for t in toks]
        tlp = lp.get("token_logprobs") or []
        if len(tlp) != len(ids):
            raise BackendError(f"stream chunk has {len(tlp)} logprobs for {len(ids)} tokens", backend=self.base_url)
        return [int(x) for x in ids], [float("nan") if x is None else float(x) for x in tlp]

    def _http_error(self, status: int, content: bytes) -> LLMError:
        try:
            text = content.decode("utf-8", "replace")
        except Exception:  # pragma: no cover
            text = repr(content[:200])
        msg = text
        try:
            obj = json.loads(text)
            if isinstance(obj, dict):
                err = obj.get("error", obj)
                if isinstance(err, dict):
                    msg = str(err.get("message", err))
                elif isinstance(err, str):
                    msg = err
                elif "message" in obj:
                    msg = str(obj["message"])
        except ValueError:
            pass
        msg = msg[:500]
        if status in (400, 413, 422) and _CONTEXT_RE.search(msg):
            return ContextOverflow(f"backend {self.base_url}: {msg}")
        if status in (400, 422):
            return RequestError(f"HTTP {status} from {self.base_url}: {msg}", backend=self.base_url, status=status)
        log.warning("llm_backend_http_error", backend=self.base_url, status=status, message=msg[:200])
        return BackendError(f"HTTP {status} from {self.base_url}: {msg}", backend=self.base_url, status=status)

    def _parse_vllm(self, data: dict) -> Generation:
        ch = data["choices"][0]
        lp = ch.get("logprobs") or {}
        ids = ch.get("token_ids")
        if ids is None:
            toks = lp.get("tokens")
            if toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                ids = [int(t[9:]) for t in toks]
            else:
                raise BackendError(
                    "reply has no token ids (needs vLLM >= 0.10.2 return_token_ids, "
                    "or return_tokens_as_token_ids)",
                    backend=self.base_url,
                )
        tlp = lp.get("token_logprobs")
        if tlp is None or len(tlp) != len(ids):
            raise BackendError(
                f"reply has {0 if tlp is None else len(tlp)} logprobs for {len(ids)} tokens", backend=self.base_url
            )
        fr = ch.get("finish_reason")
        if fr not in ("stop", "length", "abort"):
            raise BackendError(f"unexpected finish_reason {fr!r}", backend=self.base_url)
        usage = data.get("usage") or {}
        return Generation(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=_as_float32(tlp),
            finish_reason=fr,
            text=ch.get("text"),
            stop_reason=ch.get("stop_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        )

    def _parse_sglang(self, data: Any) -> Generation:
        if isinstance(data, list):
            data = data[0]
        meta = data["meta_info"]
        otl = meta.get("output_token_logprobs")
        if otl is None:
            raise BackendError("reply has no output_token_logprobs (return_logprob ignored?)", backend=self.base_url)
        ids = [int(x[1]) for x in otl]
        out_ids = data.get("output_ids")
        if out_ids is not None and len(out_ids) != len(ids):
            raise BackendError(
                f"output_ids ({len(out_ids)}) and output_token_logprobs ({len(ids)}) disagree", backend=self.base_url
            )
        fr = meta.get("finish_reason")
        if isinstance(fr, dict):
            kind = fr.get("type")
            stop_reason = fr.get("matched")
        else:
            kind, stop_reason = fr, None
        if kind not in ("stop", "length", "abort"):
            raise BackendError(f"unexpected finish_reason {fr!r}", backend=self.base_url)
        return Generation(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=_as_float32([x[0] for x in otl]),
            finish_reason=kind,
            text=data.get("text"),
            stop_reason=stop_reason,
            prompt_tokens=meta.get("prompt_tokens"),
            cached_tokens=meta.get("cached_tokens"),
        )

    async def abort(self, rid: str, timeout: float = 5.0) -> bool:
        """SGLang ``POST /abort_request {"rid"}``: the request named ``rid`` returns now with
        ``finish_reason`` ``abort`` and the tokens sampled so far. vLLM's HTTP API has no abort by id
        (closing the connection aborts, and returns nothing): False, cancel the call instead."""
        if self.api != "sglang":
            return False
        try:
            r = await with_timeout(self._http.post("/abort_request", json={"rid": rid}), min(timeout, self.timeout))
        except (asyncio.TimeoutError, httpx.HTTPError) as e:
            log.warning("llm_abort_failed", backend=self.base_url, error=f"{type(e).__name__}: {e}")
            return False
        return r.status_code == 200

    # -- control plane ---------------------------------------------------------------
    async def health(self, timeout: float = 5.0) -> bool:
        try:
            r = await with_timeout(self._http.get("/health"), min(timeout, self.timeout))
        except (asyncio.TimeoutError, httpx.HTTPError):
            return False
        return r.status_code == 200

    async def _get_ok(self, path: str, timeout: float) -> httpx.Response:
        """``GET path``; no answer in time, a transport error or a status other than 200 is a BackendError."""
        try:
            r = await with_timeout(self._http.get(path), min(timeout, self.timeout))
        except (asyncio.TimeoutError, httpx.HTTPError) as e:
            raise BackendError(f"{path}: {type(e).__name__}: {e}", backend=self.base_url) from e
        if r.status_code != 200:
            raise BackendError(f"{path}: HTTP {r.status_code}", backend=self.base_url, status=r.status_code)
        return r

    async def models(self, timeout: float = 10.0) -> list[str]:
        r = await self._get_ok("/v1/models", timeout)
        try:
            return [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError) as e:
            raise BackendError(f"/v1/models: malformed reply: {e}", backend=self.base_url) from e

    async def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """Load gauges from ``/metrics``: ``num_requests_running``, ``num_requests_waiting``
        (and ``kv_cache_usage`` when exported), from the ``vllm:`` or ``sglang:`` names."""
        r = await self._get_ok("/metrics", timeout)
        text = r.text
        primary, other = _METRIC_MAPS[self.api]
        out = parse_prometheus(text, primary)
        if not out:  # e.g. an SGLang server addressed through the vLLM API shape
            out = parse_prometheus(text, other)
        out.setdefault("num_requests_running", 0.0)
        out.setdefault("num_requests_waiting", 0.0)
        return out


GenerateFn = Callable[[Any, SamplingParams], Awaitable[tuple[Generation, str, int]]]


def simple_generate(client: LLMClient, backend_id: str | None = None, policy_version: int = 0) -> GenerateFn:
    """Adapt one client to the agent loop's ``generate`` callable (no failover)."""
    bid = backend_id or client.base_url

    async def generate(prompt_ids: Any, params: SamplingParams) -> tuple[Generation, str, int]:
        return await client.generate(prompt_ids, params), bid, policy_version

    return generate


def failover_generate(
    clients: Sequence[tuple[LLMClient, str, int]], max_attempts: int | None = None
) -> GenerateFn:
    """A minimal failover ``generate``: try the backends in order, moving on after a BackendError.

    The run daemon uses the router instead; this helper serves tests, benchmarks and
    single-node scripts.
    """
    attempts = max_attempts or len(clients)

    async def generate(prompt_ids: Any, params: SamplingParams) -> tuple[Generation, str, int]:
        last: BackendError | None = None
        for i in range(attempts):
            client, bid, pv = clients[i % len(clients)]
            try:
                return await client.generate(prompt_ids, params), bid, pv
            except BackendError as e:
                log.warning("llm_backend_failed_over", backend=bid, error=str(e)[:200], attempt=i + 1)
                last = e
        assert last is not None
        raise last

    return generate
