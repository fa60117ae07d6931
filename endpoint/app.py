"""The agent-facing endpoint's ASGI app: routes (``api_shape``), API key, body reading within
this job's bounds, each shape's error body, and the answers (JSON or server-sent events).

Routes: ``POST /v1/chat/completions`` (non-streaming and ``stream: true`` SSE),
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``; the ``/v1`` prefix is optional.
Other API shapes on the same session (:mod:`rolloutd.endpoint.shapes` translates):
``POST /v1/messages`` and ``/v1/messages/count_tokens``, ``POST /v1/responses`` and
``GET /v1/responses/{id}``, ``POST /v1beta/models/{m}:generateContent|:streamGenerateContent|
:countTokens``; each answers errors in its own shape.
"""

from __future__ import annotations

import asyncio

import structlog

from .bounds import POOL
from ..llm.encode_worker import TRIM_BYTES, release_memory
from .session import EndpointSession
from .shapes.chat import chat_chunks, chat_response, completion_chunks, completion_response
from .wire import EndpointError, WireRequest, dumps, models_response

log = structlog.get_logger("rolloutd.llm")

__all__ = ["MAX_BODY", "api_shape", "make_app"]

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

    async def timed_send(send, start: dict, body: bytes) -> None:
        # A client that never takes its reply must not hold the request (and its job's slot) forever.
        # asyncio.timeout, not wait_for: no task per send (wait_for's is 2 of them per reply); one
        # for the whole reply, its head and its body.
        async with asyncio.timeout(b.send_timeout_s):
            await send(start)
            await send({"type": "http.response.body", "body": body})

    async def send_json(send, status: int, payload: bytes, extra: list | None = None) -> None:
        headers = _JSON + [(b"content-length", str(len(payload)).encode())] + (extra or [])
        await timed_send(send, {"type": "http.response.start", "status": status, "headers": headers}, payload)

    async def send_sse(send, chunks: list[bytes]) -> None:
        # Every event is known before the first is sent (the reply is complete): one body, one
        # write, the same bytes as one send per event (which cost a write and a wakeup each).
        await timed_send(send, {"type": "http.response.start", "status": 200, "headers": _SSE}, b"".join(chunks))

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
            from .shapes import anthropic as aw

            req, r = await session.serve_wire(raw, lambda b: aw.parse(b, wire_cache["anthropic"]))
            if req.stream:
                await send_sse(send, aw.stream_events(r, req))
            else:
                await send_json(send, 200, dumps(aw.response(r, req)))
        elif path == "/messages/count_tokens":
            from .shapes import anthropic as aw

            n = await session.count_tokens(raw, aw.parse_count_tokens)
            await send_json(send, 200, dumps(aw.count_tokens_response(n)))
        elif path == "/responses":
            from .shapes import responses as rw

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
                await send_json(send, 200, rw.response_body(obj, req))
        elif path.startswith("/models/") and ":" in path:  # Gemini, after the /v1beta prefix
            from .shapes import gemini as gw

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
                from .shapes.anthropic import error_body as eb
            elif shape == "responses":
                from .shapes.responses import error_body as eb
            elif shape == "gemini":
                from .shapes.gemini import error_body as eb
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
            # A request's first line is checked by the server (endpoint/server.py); a pipelined one's
            # is not, and llhttp takes HTTP/0.9 and 2.0: answered here, in order.
            if scope.get("http_version") not in ("1.0", "1.1"):
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
                        loop.call_soon(loop.run_in_executor, POOL, release_memory)
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
