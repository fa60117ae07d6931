"""Scripted LLM backend: a stand-in for vLLM / SGLang in tests and benchmarks.

Over ~700 lines because it is one server: two APIs (vLLM's and SGLang's), streaming, aborts, failure
injection, batching and load gauges share its queue; the reply bodies both stand-ins send are in
:mod:`rolloutd.backends.vllm_replies`, the policies in :mod:`rolloutd.backends.policies`.

It speaks the same HTTP JSON as the real servers, in the same shapes:

* ``POST /v1/completions`` (vLLM's OpenAI completions with a token-id prompt,
  ``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs``),
* ``POST /generate`` (SGLang's native API with ``input_ids`` and ``return_logprob``),
* ``GET /health`` (and SGLang's ``/health_generate``), ``GET /v1/models``, ``GET /get_model_info``, and ``GET /metrics`` with
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` and
  ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``.

Replies come from a :class:`~rolloutd.backends.policies.Policy` (looked up by name, see
:mod:`rolloutd.backends.policies`): the prompt ids are decoded with the tokenizer, the policy
returns text, the server tokenizes it (plus the end-of-turn token) and returns the
ids with fake logprobs. Latency can be constant, uniform or lognormal (plus a
per-token term); failures can be injected (HTTP 500, dropped connection, hang), at
random or deterministically (:meth:`ScriptedBackend.inject`). A client that closes
its connection while its request is in flight is counted in ``stats["disconnects"]``
(that is how vLLM/SGLang see an abort). SGLang's ``POST /abort_request`` (``{"rid"}`` or
``{"abort_all": true}``) ends in-flight ``/generate`` requests at once with
``finish_reason: {"type": "abort"}`` and the tokens sampled so far (those whose per-token time
has passed), as SGLang returns a partial output; ``stats["aborted"]`` counts them.
A vLLM request with ``"stream": true`` is answered as vLLM's ``completion_stream_generator`` does
(checked against its source, vLLM 0.10.2-0.11 and main): ``content-type: text/event-stream;
charset=utf-8``, ``transfer-encoding: chunked``, the head at once, then one ``data: {chunk}\n\n``
event per HTTP chunk as tokens are sampled (one token per chunk when on time; the tokens due
since the last chunk together when late, as vLLM's output collector merges deltas for a slow
reader), each chunk ``{"id", "object": "text_completion", "created", "model", "choices": [{"index",
"text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}], "usage":
null}`` with ``prompt_token_ids`` on the first chunk only (``return_token_ids``), ``finish_reason`` on
the last; with ``stream_options.include_usage`` a ``{"choices": [], "usage": {...}}`` chunk; then
``data: [DONE]\n\n``. Closing the connection mid-stream aborts the request (``disconnects``).
``stats["tokens_sampled"]`` counts the tokens of delayed requests (per-token latency), including
those of requests aborted or disconnected part-way (what a benchmark counts as wasted work).

It is a raw asyncio-protocol HTTP/1.1 server with keep-alive; with zero latency a
request is answered synchronously from ``data_received`` (no task, no timer), which
is what the agent-loop benchmark needs. In process: ``port = ScriptedBackend(...).start()``
(own thread and event loop, binds 127.0.0.1 port 0); as a process:
``rolloutd scripted-backend --port P --policy NAME --tokenizer DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import math
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable

import structlog

from .policies import Policy, PolicyReply, PolicyRequest, get_policy
from .vllm_replies import (completion_body, context_max_tokens, cut_at_stop_string, load_gauges, model_info_body,
                           models_body, reply_text,
                           sglang_generate_body, stream_chunk, stream_usage)

log = structlog.get_logger("rolloutd.llm")

__all__ = ["ScriptedBackend", "Latency", "Failures", "main"]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
MAX_HEADER = 64 * 1024
MAX_BODY = 256 * 1024 * 1024


@dataclass
class Latency:
    """Per-request latency: ``constant`` (a s), ``uniform`` (a..b s) or ``lognormal``
    (median a s, sigma b), plus ``per_token`` s per generated token."""

    kind: str = "constant"
    a: float = 0.0
    b: float = 0.0
    per_token: float = 0.0

    @classmethod
    def parse(cls, spec: str | float | "Latency" | None) -> "Latency":
        if spec is None:
            return cls()
        if isinstance(spec, Latency):
            return spec
        if isinstance(spec, (int, float)):
            return cls("constant", float(spec))
        kind, _, rest = str(spec).partition(":")
        nums = [float(x) for x in rest.split(",") if x.strip()] if rest else []
        per_token = 0.0
        if kind not in ("constant", "uniform", "lognormal"):
            raise ValueError(f"latency kind must be constant|uniform|lognormal, not {kind!r}")
        need = {"constant": 1, "uniform": 2, "lognormal": 2}[kind]
        if len(nums) == need + 1:
            per_token = nums.pop()
        if len(nums) != need:
            raise ValueError(f"latency {kind!r} needs {need} number(s) (+ optional per-token s): {spec!r}")
        return cls(kind, nums[0], nums[1] if need == 2 else 0.0, per_token)

    def sample(self, rng: random.Random, n_tokens: int) -> float:
        if self.kind == "constant":
            base = self.a
        elif self.kind == "uniform":
            base = rng.uniform(self.a, self.b)
        else:
            base = self.a * math.exp(rng.gauss(0.0, self.b)) if self.a > 0 else 0.0
        return max(0.0, base + self.per_token * n_tokens)


@dataclass
class Failures:
    """Random failure injection, per generation request."""

    p_500: float = 0.0
    p_drop: float = 0.0
    p_hang: float = 0.0


class _Conn(asyncio.Protocol):
    __slots__ = ("srv", "transport", "buf", "busy", "closed", "task", "keep_alive")

    def __init__(self, srv: "ScriptedBackend") -> None:
        self.srv = srv
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False
        self.task: asyncio.Task | None = None
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.srv._conns.add(self)
        self.srv.stats["connections"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.srv._conns.discard(self)
        t = self.task
        if t is not None and not t.done():
            self.srv.stats["disconnects"] += 1
            log.info("scripted_client_disconnected", in_flight=True)
            t.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._process()

    def _send(self, payload: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(payload)
            if not self.keep_alive:
                self.transport.close()
                self.closed = True

    def _process(self) -> None:
        srv = self.srv
        while not self.busy and not self.closed:
            buf = self.buf
            hend = buf.find(b"\r\n\r\n")
            if hend < 0:
                if len(buf) > MAX_HEADER:
                    self.keep_alive = False
                    self._send(_response(431, b"", "text/plain"))
                return
            head = bytes(buf[:hend]).decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                self.keep_alive = False
                self._send(_response(400, b"bad request line", "text/plain"))
                return
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self.keep_alive = False
                self._send(_response(501, b"chunked bodies are not supported", "text/plain"))
                return
            try:
                cl = int(headers.get("content-length", "0") or 0)
            except ValueError:
                cl = -1
            if cl < 0 or cl > MAX_BODY:
                self.keep_alive = False
                self._send(_response(413 if cl > 0 else 400, b"bad content-length", "text/plain"))
                return
            total = hend + 4 + cl
            if len(buf) < total:
                return
            body = bytes(buf[hend + 4 : total])
            del buf[:total]
            conn_hdr = headers.get("connection", "").lower()
            self.keep_alive = (version == "HTTP/1.1" and conn_hdr != "close") or conn_hdr == "keep-alive"
            result = srv._dispatch(self, method, target, body)
            if self.closed:
                return
            if result is None:
                continue
            if isinstance(result, (bytes, bytearray)):
                self._send(result)
                continue
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(self._finish(result))
            return

    async def _finish(self, coro: Awaitable[bytes | None]) -> None:
        try:
            payload = await coro
        except asyncio.CancelledError:
            return
        except Exception as e:  # pragma: no cover - a bug in a policy
            log.error("scripted_request_crashed", error=f"{type(e).__name__}: {e}")
            payload = _json_response(500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}})
        self.task = None
        self.busy = False
        if self.closed:
            return
        if payload is not None:
            self._send(payload)
        if self.buf and not self.closed:
            self._process()


def _response(status: int, body: bytes, ctype: str = "application/json") -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"content-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode("latin-1") + body


def _json_response(status: int, obj: Any) -> bytes:
    return _response(status, json.dumps(obj, separators=(",", ":")).encode())


def _vllm_error(status: int, message: str, etype: str = "BadRequestError") -> bytes:
    return _json_response(status, {"error": {"message": message, "type": etype, "param": None, "code": status}})


class ScriptedBackend:
    """In-process or standalone scripted vLLM/SGLang-compatible server."""

    def __init__(
        self,
        tokenizer: Any = None,
        policy: str | Policy = "echo",
        *,
        latency: str | float | Latency | None = None,
        failures: Failures | None = None,
        model: str = "scripted",
        max_model_len: int = 32768,
        max_running: int | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        eos_token_id: int | None = None,
    ) -> None:
        if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
            from ..llm.tokenizer_utils import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.policy = get_policy(policy) if not isinstance(policy, Policy) else policy
        self.latency = Latency.parse(latency)
        self.failures = failures or Failures()
        self.model = model
        self.max_model_len = int(max_model_len)
        self.max_running = max_running
        self.host = host
        self.port = int(port)
        self.rng = random.Random(seed)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        self._backend_tok = getattr(tokenizer, "backend_tokenizer", None)
        self.stats: collections.Counter[str] = collections.Counter()
        self._forced: collections.deque[str] = collections.deque()
        self._conns: set[_Conn] = set()
        self._aborts: dict[str, asyncio.Event] = {}  # SGLang rid -> set by /abort_request
        self._running = 0
        self._waiting = 0
        self._sem: asyncio.Semaphore | None = None
        self._encode_cache: dict[str, list[int]] = {}
        self._tokstr_cache: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._start_error: BaseException | None = None
        self._metrics_registry = self._make_registry()

    # -- public control --------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def inject(self, kind: str, count: int = 1) -> None:
        """Force the next ``count`` generation requests to fail: ``500``, ``400`` (vLLM's invalid
        request reply), ``drop`` or ``hang``."""
        if kind not in ("500", "400", "drop", "hang"):
            raise ValueError("kind must be '500', '400', 'drop' or 'hang'")
        for _ in range(count):
            self._forced.append(kind)

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return self._waiting

    def wait_for(self, predicate, timeout: float = 5.0, interval: float = 0.005) -> bool:
        """Poll ``predicate(self)`` from another thread until true or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(interval)
        return bool(predicate(self))

    # -- lifecycle -------------------------------------------------------------------
    async def start_async(self) -> int:
        """Start on the running loop; returns the bound port."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if self.max_running:
            self._sem = asyncio.Semaphore(self.max_running)
        self._server = await self._loop.create_server(
            lambda: _Conn(self), self.host, self.port, reuse_address=True, backlog=4096
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("scripted_backend_started", url=self.url, policy=type(self.policy).__name__, model=self.model)
        return self.port

    async def stop_async(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            if c.task is not None and not c.task.done():
                c.task.cancel()
            if c.transport is not None:
                c.transport.abort()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except asyncio.TimeoutError:  # pragma: no cover
                pass
        if self._stopped is not None:
            self._stopped.set()
        log.info("scripted_backend_stopped", url=self.url, requests=self.stats["requests"])

    async def serve_forever(self) -> None:
        await self.start_async()
        assert self._stopped is not None
        await self._stopped.wait()

    def start(self, timeout: float = 10.0) -> int:
        """Run in a daemon thread with its own event loop; returns the port."""
        if self._thread is not None:
            return self.port

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:  # pragma: no cover - bind failure
                self._start_error = e
                self._ready.set()
                loop.close()
                return
            self._ready.set()
            try:
                loop.run_until_complete(self._stopped.wait())  # type: ignore[union-attr]
            finally:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name=f"scripted-backend-{id(self):x}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("scripted backend did not start")
        if self._start_error is not None:
            raise self._start_error
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.stop_async(), self._loop)
        try:
            fut.result(timeout)
        except Exception:  # pragma: no cover
            pass
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ScriptedBackend":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- metrics ---------------------------------------------------------------------
    def _make_registry(self):
        from prometheus_client import CollectorRegistry

        reg = CollectorRegistry(auto_describe=False)
        load_gauges(reg, self.model, lambda: self._running, lambda: self._waiting)
        return reg

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self._metrics_registry)

    # -- request handling --------------------------------------------------------------
    def _dispatch(self, conn: _Conn, method: str, target: str, body: bytes) -> bytes | Awaitable[bytes | None] | None:
        path = target.split("?", 1)[0]
        if method == "POST":
            if path == "/v1/completions":
                return self._generate(conn, "vllm", body)
            if path == "/generate":
                return self._generate(conn, "sglang", body)
            if path == "/abort_request":
                return self._abort_request(body)
            return _vllm_error(404, f"no route {path}", "NotFoundError")
        if method == "GET":
            if path in ("/health", "/health_generate"):  # SGLang serves both; the router probes the second
                return _response(200, b"", "text/plain")
            if path == "/v1/models":
                return _json_response(200, models_body(self.model, self.model, self.max_model_len))
            if path == "/get_model_info":
                return _json_response(200, model_info_body(self.model))
            if path == "/metrics":
                return _response(200, self.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            return _vllm_error(404, f"no route {path}", "NotFoundError")
        return _vllm_error(405, f"method {method} not allowed", "MethodNotAllowed")

    def _next_failure(self) -> str | None:
        if self._forced:
            try:
                return self._forced.popleft()
            except IndexError:  # pragma: no cover - raced
                return None
        f = self.failures
        if f.p_500 or f.p_drop or f.p_hang:
            r = self.rng.random()
            if r < f.p_500:
                return "500"
            if r < f.p_500 + f.p_drop:
                return "drop"
            if r < f.p_500 + f.p_drop + f.p_hang:
                return "hang"
        return None

    def _encode(self, text: str) -> list[int]:
        ids = self._encode_cache.get(text)
        if ids is None:
            if self._backend_tok is not None:
                ids = self._backend_tok.encode(text, add_special_tokens=False).ids
            else:
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(self._encode_cache) > 8192:
                self._encode_cache.clear()
            self._encode_cache[text] = ids
        return ids

    def _decode(self, ids: list[int]) -> str:
        if self._backend_tok is not None:
            return self._backend_tok.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _tokstr(self, tid: int) -> str:
        s = self._tokstr_cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)
            self._tokstr_cache[tid] = s
        return s

    def _generate(self, conn: _Conn, api: str, body: bytes) -> bytes | Awaitable[bytes | None] | None:
        t0 = time.perf_counter()
        self.stats["requests"] += 1
        self.stats[f"requests_{api}"] += 1
        fail = self._next_failure()
        if fail == "500":
            self.stats["injected_500"] += 1
            return _vllm_error(500, "injected failure", "InternalServerError")
        if fail == "400":
            self.stats["injected_400"] += 1
            return _vllm_error(400, "injected bad request")
        if fail == "drop":
            self.stats["injected_drop"] += 1
            conn.closed = True
            if conn.transport is not None:
                conn.transport.abort()
            return None
        if fail == "hang":
            self.stats["injected_hang"] += 1
            return self._hang()
        try:
            req = json.loads(body)
            if api == "vllm":
                prompt = req["prompt"]
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                    prompt = prompt[0]
                if not isinstance(prompt, list):
                    return _vllm_error(400, "this stand-in only accepts token-id prompts (a list of ints)")
                sp = req
                max_tokens = sp.get("max_tokens")
                max_tokens = 16 if max_tokens is None else int(max_tokens)
            else:
                prompt = req["input_ids"]
                sp = req.get("sampling_params") or {}
                max_tokens = int(sp.get("max_new_tokens", 128))
            stop_ids = [int(x) for x in (sp.get("stop_token_ids") or [])]
        except (ValueError, KeyError, TypeError) as e:
            return _vllm_error(400, f"malformed request: {type(e).__name__}: {e}")
        n_prompt = len(prompt)
        if api == "vllm":  # vLLM 0.32: max_tokens clamped to the room left, 400 only past the context
            max_tokens, err = context_max_tokens(n_prompt, max_tokens, self.max_model_len)
            if err is not None:
                self.stats["rejected_context"] += 1
                return _json_response(400, err)
        elif n_prompt + max_tokens > self.max_model_len or max_tokens < 0:
            self.stats["rejected_context"] += 1
            return _json_response(
                400,
                {
                    "error": {
                        "message": f"The input ({n_prompt} tokens) is longer than the model's context length "
                        f"({self.max_model_len} tokens).",
                        "code": 400,
                    }
                },
            )
        seed = sp.get("seed") if api == "vllm" else sp.get("sampling_seed")
        preq = PolicyRequest(
            prompt_ids=prompt,
            api=api,
            max_tokens=max_tokens,
            temperature=1.0 if sp.get("temperature") is None else float(sp["temperature"]),
            seed=seed,
            stop_token_ids=stop_ids,
            decode=self._decode if self.tokenizer is not None else None,
        )
        try:
            reply = self.policy.reply(preq)
        except Exception as e:
            self.stats["policy_errors"] += 1
            log.error("scripted_policy_failed", policy=type(self.policy).__name__, error=f"{type(e).__name__}: {e}")
            return _vllm_error(500, f"policy failed: {type(e).__name__}: {e}", "InternalServerError")
        if isinstance(reply, str):
            reply = PolicyReply(text=reply)
        if reply.token_ids is not None:
            ids = list(reply.token_ids)
        else:
            ids = list(self._encode(reply.text))
        if reply.append_eos and self.eos_token_id is not None and reply.finish in (None, "stop"):
            ids.append(self.eos_token_id)
        finish = reply.finish or "stop"
        stop_reason: int | str | None = None
        if stop_ids:
            stop_set = set(stop_ids)
            for i, t in enumerate(ids):
                if t in stop_set:
                    ids = ids[: i + 1]
                    stop_reason = t
                    finish = "stop"
                    break
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            finish = "length"
            stop_reason = None
        stops = sp.get("stop") or []
        if stops and self.tokenizer is not None:  # a stop string wins over length and later stop tokens
            cut = cut_at_stop_string(ids, self._text, [stops] if isinstance(stops, str) else [str(x) for x in stops])
            if cut is not None:
                ids, finish, stop_reason = cut[0], "stop", cut[2]
        n = len(ids)
        rng = random.Random(seed) if seed is not None else self.rng
        lps = [-0.01 - 2.0 * rng.random() for _ in range(n)]
        delay = self.latency.sample(self.rng, n)
        if api == "vllm" and req.get("stream"):
            return self._streamed(conn, req, prompt, ids, lps, finish, stop_reason, delay)
        if delay <= 0 and self._sem is None:
            self.stats["completed"] += 1
            return self._render(api, req, prompt, ids, lps, finish, stop_reason, time.perf_counter() - t0)
        return self._delayed(api, req, prompt, ids, lps, finish, stop_reason, delay, t0)

    def _abort_request(self, body: bytes) -> bytes:
        """SGLang's AbortReqInput: ``rid`` (one request) or ``abort_all``; 200 with an empty body."""
        try:
            req = json.loads(body or b"{}")
            rid, every = str(req.get("rid") or ""), bool(req.get("abort_all"))
        except (ValueError, AttributeError) as e:
            return _vllm_error(400, f"malformed request: {type(e).__name__}: {e}")
        for key, ev in list(self._aborts.items()):
            if every or key == rid:
                ev.set()
        return _response(200, b"", "application/json")

    async def _hang(self) -> None:
        self._running += 1
        try:
            await asyncio.Event().wait()
        finally:
            self._running -= 1

    async def _delayed(self, api, req, prompt, ids, lps, finish, stop_reason, delay, t0) -> bytes:
        rid = req.get("rid") if api == "sglang" and isinstance(req.get("rid"), str) else None
        abort = asyncio.Event() if rid else None
        if rid:  # a request without a rid cannot be aborted by id (and must not sit in the table as None)
            self._aborts[rid] = abort
        try:
            return await self._delayed_abortable(api, req, prompt, ids, lps, finish, stop_reason, delay, t0, abort)
        finally:
            if rid:
                self._aborts.pop(rid, None)

    async def _acquire(self) -> None:
        """Wait for one of the server's ``max_running`` sequences (counted as waiting meanwhile)."""
        if self._sem is not None:
            self._waiting += 1
            try:
                await self._sem.acquire()
            finally:
                self._waiting -= 1
        self._running += 1

    def _release(self) -> None:
        self._running -= 1
        if self._sem is not None:
            self._sem.release()

    async def _delayed_abortable(self, api, req, prompt, ids, lps, finish, stop_reason, delay, t0, abort) -> bytes:
        await self._acquire()
        started = time.perf_counter()
        n, per = len(ids), getattr(self.latency, "per_token", 0.0)  # a custom latency may have only sample()

        def sampled() -> int:  # tokens whose time has passed (the rest were never sampled)
            spent = time.perf_counter() - started
            k = int((spent - (delay - per * n)) / per) if per > 0 else int(n * spent / delay)
            return max(0, min(k, n - 1))

        try:
            if delay > 0 and abort is not None:
                try:
                    await asyncio.wait_for(abort.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                else:  # aborted: SGLang returns what was sampled so far
                    k = sampled()
                    ids, lps, finish, stop_reason = ids[:k], lps[:k], "abort", None
                    self.stats["aborted"] += 1
                    self.stats["aborted_tokens"] += k
            elif delay > 0:
                await asyncio.sleep(delay)
        except asyncio.CancelledError:  # the client closed the connection: sampled, never delivered
            self.stats["tokens_sampled"] += sampled()
            raise
        finally:
            self._release()
        self.stats["tokens_sampled"] += len(ids)
        self.stats["completed"] += 1
        return self._render(api, req, prompt, ids, lps, finish, stop_reason, time.perf_counter() - t0)

    async def _streamed(self, conn: _Conn, req, prompt, ids, lps, finish, stop_reason, delay) -> None:
        """vLLM's ``stream: true`` reply (module doc): token k goes out when its time has passed."""
        await self._acquire()
        n, per = len(ids), getattr(self.latency, "per_token", 0.0)
        first = max(0.0, delay - per * n)  # time to the first token (prefill)
        started = time.monotonic()
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.get("model") or self.model
        so = req.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))

        def due() -> tuple[int, bool]:  # (tokens sampled by now, all of them): token j at first + per * (j + 1)
            spent = time.monotonic() - started
            if spent >= delay:
                return n, True
            if per <= 0 or spent < first:
                return 0, False
            return min(n - 1, int((spent - first) / per)), False

        def write(obj: Any) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()) + b"\n\n"
            conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

        sent, offset = 0, 0
        try:
            if conn.closed or conn.transport is None:
                return None
            conn.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
            while True:
                k, done = due()
                if k > sent or done:
                    delta = ids[sent:k]
                    chunk, offset = stream_chunk(rid=rid, created=created, model=model, prompt=prompt, ids=delta,
                                                 logprobs=lps[sent:k], text=self._text(delta), first=sent == 0,
                                                 finish=finish if done else None,
                                                 stop_reason=stop_reason if done else None, req=req,
                                                 token_str=self._tokstr, offset=offset)
                    write(chunk)
                    sent = k
                    if done:
                        break
                    continue
                next_t = min(delay, first + per * (sent + 1)) if per > 0 else delay
                await asyncio.sleep(max(0.0, next_t - (time.monotonic() - started)))
            if include_usage:
                write(stream_usage(rid=rid, created=created, model=model, n_prompt=len(prompt), n=n))
            write(b"[DONE]")
            conn.transport.write(b"0\r\n\r\n")
            if not conn.keep_alive:
                conn.transport.close()
                conn.closed = True
        except asyncio.CancelledError:  # the client closed the connection: vLLM aborts the request
            self.stats["tokens_sampled"] += due()[0]
            raise
        finally:
            self._release()
        self.stats["tokens_sampled"] += n
        self.stats["completed"] += 1
        self.stats["streamed"] += 1
        return None

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        if self._backend_tok is not None:
            return self._backend_tok.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render(self, api, req, prompt, ids, lps, finish, stop_reason, elapsed) -> bytes:
        if isinstance(stop_reason, str):
            text = cut_at_stop_string(ids, self._text, [stop_reason], bool(req.get("include_stop_str_in_output")))[1]
        else:
            text = reply_text(ids, self._text, finish, stop_reason)
        if api == "vllm":
            out = completion_body(rid=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                  model=req.get("model") or self.model, prompt=prompt, ids=ids, logprobs=lps,
                                  finish=finish, stop_reason=stop_reason, text=text, req=req, token_str=self._tokstr)
        else:
            out = sglang_generate_body(rid=req.get("rid") or uuid.uuid4().hex, prompt=prompt, ids=ids, logprobs=lps,
                                       finish=finish, stop_reason=stop_reason, text=text, req=req, elapsed=elapsed)
        return _json_response(200, out)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rolloutd scripted-backend",
        description="Scripted vLLM/SGLang-compatible HTTP backend (a stand-in for vLLM in tests and benchmarks).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as 'READY <port>')")
    p.add_argument("--policy", default="echo", help="policy name or spec 'name:key=value,...'")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    p.add_argument("--model", default="scripted", help="served model name")
    p.add_argument("--latency", default="constant:0", help="constant:S | uniform:A,B | lognormal:MEDIAN,SIGMA [,PER_TOKEN]")
    p.add_argument("--fail-500", type=float, default=0.0, help="probability of HTTP 500 per request")
    p.add_argument("--fail-drop", type=float, default=0.0, help="probability of dropping the connection")
    p.add_argument("--fail-hang", type=float, default=0.0, help="probability of never answering")
    p.add_argument("--max-running", type=int, default=None, help="simulated capacity (excess requests wait)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    backend = ScriptedBackend(
        args.tokenizer,
        args.policy,
        latency=args.latency,
        failures=Failures(args.fail_500, args.fail_drop, args.fail_hang),
        model=args.model,
        max_model_len=args.max_model_len,
        max_running=args.max_running,
        seed=args.seed,
        host=args.host,
        port=args.port,
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        await backend.start_async()
        # Everything imported so far (transformers, tokenizer) is long-lived: keep it out of
        # the cyclic GC's full collections, which otherwise cause 20-100 ms pauses.
        gc.collect()
        gc.freeze()
        print(f"READY {backend.port}", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(backend.stop_async()))
            except (NotImplementedError, RuntimeError):  # pragma: no cover
                pass
        assert backend._stopped is not None
        await backend._stopped.wait()

    asyncio.run(run())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
