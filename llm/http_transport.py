"""A lean HTTP/1.1 keep-alive transport for ``httpx.AsyncClient``.

Why: httpx's default transport (httpcore 1.0) scales badly with many concurrent
requests on one pool. Its ``_assign_requests_to_connections`` runs on every request
start and end and is quadratic in the number of pooled connections (an
``is_idle`` list is rebuilt inside the loop over connections) and polls every idle
socket; under contention requests also spin through ``ConnectionNotAvailable``
retries, and it closes and reopens connections it could reuse. Measured against uvicorn
with httpx 0.29.0 / httpcore 1.0.9 (bench/bench_transport.py, docs/LLM.md): 5.9 ms client
CPU per request at 1,000 in flight against 0.95 ms with this transport. A run daemon keeps
~1,000 rollouts in flight, so the LLM client plugs this transport into the same
``httpx.AsyncClient`` API instead; delete it once httpx comes within 20%.

What it does: one asyncio ``Protocol`` per TCP connection; the request is written in
one ``write``; the response is parsed incrementally (Content-Length, chunked, or
read-until-close bodies); connections are reused LIFO per (host, port) and capped at
``max_connections`` (excess requests wait for a free slot, ``pool`` timeout).
Idle connections older than ``keepalive_expiry`` (default 4 s, below uvicorn's 5 s
keep-alive, which vLLM and SGLang use) are dropped, so the server never closes a
connection we are about to reuse, and an idle connection is polled once before reuse (a
restarted server's FIN may still be unread when the loop was busy). At the cap, a request
for one host closes the longest-idle connection to another host rather than wait for it.
A connection that closes before the response is an error (``RemoteProtocolError``), for
the caller to fail over, with one exception: a reused keep-alive connection that closes
without one byte of reply is retried once on a new connection (the server's keep-alive
timer beat us; the request was not answered, and generation has no side effects). Request bodies are sent whole with
a Content-Length (a streamed body is read first); HEAD replies have no body.
Server-sent events (a ``content-type: text/event-stream`` reply, as vLLM's ``stream: true``) are
the one reply handed over as it arrives: the response returns after its head and its body is read
chunk by chunk (``client.stream(...)``, ``aiter_raw``/``aiter_bytes``); each wait for more bytes
has the read timeout. Closing the response before the body ended closes the connection (the
server sees the disconnect, which aborts the generation); a body read to its end keeps the
connection for reuse. Every other reply is read whole before the response returns.
Cancelling the awaiting task, an error
or a timeout aborts the connection (the server sees the disconnect, which is how
vLLM/SGLang abort a request). Plain ``http://`` only (LLM backends on a cluster
network); ``https://`` clients use httpx's default transport.
"""

from __future__ import annotations

import asyncio
import collections
import select

import httpx

__all__ = ["FastTransport"]

_MAX_HEAD = 256 * 1024


class _Stale(Exception):
    """The connection closed before any byte of the response arrived."""


class _Conn(asyncio.Protocol):
    __slots__ = (
        "transport",
        "fd",
        "buf",
        "waiter",
        "closed",
        "last_used",
        "got_bytes",
        "_head_end",
        "_status",
        "_reason",
        "_headers",
        "_mode",
        "_length",
        "_keep",
        "_chunks",
        "_chunk_pos",
        "_head_only",
        "_sse",
        "_got",
        "body",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.last_used = 0.0
        self.got_bytes = False
        self._reset()

    def _reset(self) -> None:
        self._head_end = -1
        self._status = 0
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._mode = ""
        self._length = 0
        self._keep = True
        self._chunks: list[bytes] = []
        self._chunk_pos = 0
        self._head_only = False
        self._sse = False  # the reply is an event stream: handed to self.body as it arrives
        self._got = 0
        self.body: _Body | None = None

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.body is not None:  # an event stream being read
            try:
                self._advance()
            except Exception as e:  # malformed framing
                self.body.fail(httpx.RemoteProtocolError(f"malformed HTTP response: {e}"))
            return
        w = self.waiter
        if w is None:
            # bytes on an idle connection (e.g. a 408 before closing): unusable
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            return
        self.got_bytes = True
        if not w.done():
            try:
                self._advance()
            except Exception as e:  # malformed response
                w.set_exception(httpx.RemoteProtocolError(f"malformed HTTP response: {e}"))

    def eof_received(self) -> bool:
        # the transport calls connection_lost only on the next loop turn; unusable from now
        self.closed = True
        return False

    def unusable(self) -> bool:
        """Closed, or readable while idle (the server's FIN or a stray byte not yet seen by the loop).

        A server restart or keep-alive close that arrived while the event loop was busy is still
        unread in the kernel; one poll(2) of this socket (as httpcore and urllib3 do before reusing
        a connection) keeps the next request off a dead connection.
        """
        if self.closed or self.buf or self.fd < 0:
            return True
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(0))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        body = self.body
        if body is not None and not body.done:
            if self._mode == "close":
                self._feed(bytes(self.buf))
                self.buf.clear()
                body.finish(False)
            else:
                body.fail(httpx.RemoteProtocolError("server closed the connection mid-response"))
        w = self.waiter
        if w is not None and not w.done():
            if self._mode == "close" and self._head_end >= 0:
                self._complete(bytes(self.buf[self._head_end :]), keep=False)
            elif not self.got_bytes:
                w.set_exception(_Stale())
            else:
                w.set_exception(httpx.RemoteProtocolError("server closed the connection mid-response"))

    # -- parsing -------------------------------------------------------------------------
    def _advance(self) -> None:
        buf = self.buf
        while self._head_end < 0:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                if len(buf) > _MAX_HEAD:
                    raise ValueError("response head too large")
                return
            lines = bytes(buf[:i]).split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            version, status = parts[0], int(parts[1])
            reason = parts[2] if len(parts) > 2 else b""
            headers = []
            length = -1
            chunked = False
            conn_hdr = b""
            for ln in lines[1:]:
                k, _, v = ln.partition(b":")
                k = k.strip()
                v = v.strip()
                headers.append((k, v))
                kl = k.lower()
                if kl == b"content-length":
                    length = int(v)
                elif kl == b"transfer-encoding":
                    chunked = b"chunked" in v.lower()
                elif kl == b"connection":
                    conn_hdr = v.lower()
                elif kl == b"content-type":
                    self._sse = v.lower().startswith(b"text/event-stream")
            if 100 <= status < 200:  # interim response: skip it
                del buf[: i + 4]
                continue
            self._status, self._reason, self._headers = status, reason, headers
            self._keep = (version == b"HTTP/1.1" and b"close" not in conn_hdr) or b"keep-alive" in conn_hdr
            if self._head_only:  # a HEAD reply announces a length but never has a body
                self._mode, self._length = "length", 0
            elif chunked:
                self._mode = "chunked"
            elif length >= 0:
                self._mode, self._length = "length", length
            elif status in (204, 304):
                self._mode, self._length = "length", 0
            else:
                self._mode, self._keep = "close", False
            del buf[: i + 4]
            self._head_end = 0
            if self._sse and status == 200 and not self._head_only:
                self.body = _Body(self)
                w = self.waiter
                if w is not None and not w.done():
                    w.set_result((status, reason, headers, self.body, self._keep))
        if self.body is not None:
            self._advance_stream()
            return
        if self._mode == "length":
            if len(buf) >= self._length:
                body = bytes(buf[: self._length])
                del buf[: self._length]
                self._complete(body, self._keep and not buf)
        elif self._mode == "chunked":
            self._advance_chunked()

    def _feed(self, data: bytes) -> None:
        if data and self.body is not None:
            self.body.feed(data)

    def _advance_stream(self) -> None:
        buf = self.buf
        if self._mode == "length":
            take = min(len(buf), self._length - self._got)
            if take:
                self._feed(bytes(buf[:take]))
                del buf[:take]
                self._got += take
            if self._got >= self._length:
                self.body.finish(self._keep and not buf)
        elif self._mode == "chunked":
            self._advance_chunked()
            if self._chunk_pos:  # the stream's consumed chunks leave the buffer as they go
                del buf[: self._chunk_pos]
                self._chunk_pos = 0
        elif buf:  # read until close
            self._feed(bytes(buf))
            buf.clear()

    def _advance_chunked(self) -> None:
        buf = self.buf
        pos = self._chunk_pos
        while True:
            j = buf.find(b"\r\n", pos)
            if j < 0:
                self._chunk_pos = pos
                return
            size = int(bytes(buf[pos:j]).split(b";", 1)[0].strip(), 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", j)  # optional trailers end with an empty line
                if end < 0:
                    self._chunk_pos = pos
                    return
                del buf[: end + 4]
                self._chunk_pos = 0
                if self.body is not None:
                    self.body.finish(self._keep and not buf)
                else:
                    self._complete(b"".join(self._chunks), self._keep and not buf)
                return
            if len(buf) < j + 2 + size + 2:
                self._chunk_pos = pos
                return
            if self.body is not None:
                self._feed(bytes(buf[j + 2 : j + 2 + size]))
            else:
                self._chunks.append(bytes(buf[j + 2 : j + 2 + size]))
            pos = j + 2 + size + 2

    def _complete(self, body: bytes, keep: bool) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result((self._status, self._reason, self._headers, body, keep))

    # -- request ---------------------------------------------------------------------------
    async def roundtrip(
        self, data: bytes, timeout: float | None, head_only: bool = False
    ) -> tuple[int, bytes, list, bytes, bool]:
        if self.closed or self.transport is None:
            raise _Stale()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiter = fut
        self.got_bytes = False
        self._reset()
        self._head_only = head_only
        handle = loop.call_later(timeout, _expire, fut) if timeout is not None else None
        try:
            self.transport.write(data)
            return await fut
        finally:
            if handle is not None:
                handle.cancel()
            self.waiter = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Body(httpx.AsyncByteStream):
    """An event-stream reply's body, handed over as it arrives; closing it early closes the connection."""

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.parts: collections.deque[bytes] = collections.deque()
        self.done = False
        self.keep = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.read_timeout: float | None = None
        self.owner: tuple[FastTransport, tuple[str, int]] | None = None
        self.released = False

    def feed(self, data: bytes) -> None:
        self.parts.append(data)
        self._wake()

    def finish(self, keep: bool) -> None:
        if not self.done:
            self.done, self.keep = True, keep
            self._wake()

    def fail(self, exc: Exception) -> None:
        if not self.done:
            self.done, self.error = True, exc
            self.conn.abort()
            self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        while True:
            while self.parts:
                yield self.parts.popleft()
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            fut = self.waiter = loop.create_future()
            handle = loop.call_later(self.read_timeout, _expire, fut) if self.read_timeout is not None else None
            try:
                await fut
            except TimeoutError:
                raise httpx.ReadTimeout("timed out waiting for more of the response body") from None
            finally:
                if handle is not None:
                    handle.cancel()
                self.waiter = None

    async def aclose(self) -> None:
        self.release()

    def release(self) -> None:
        if self.released or self.owner is None:
            return
        self.released = True
        transport, key = self.owner
        transport._body_released(self.conn, key, self.done and self.error is None and self.keep)


class FastTransport(httpx.AsyncBaseTransport):
    """Keep-alive connection pool for plain-HTTP backends (see module doc)."""

    def __init__(self, max_connections: int = 1024, keepalive_expiry: float = 4.0) -> None:
        self.max_connections = int(max_connections)
        self.keepalive_expiry = float(keepalive_expiry)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()

    @property
    def num_open(self) -> int:
        return self._open

    def _wake(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _discard(self, conn: _Conn) -> None:
        conn.abort()
        self._open -= 1
        self._wake()

    def _body_released(self, conn: _Conn, key: tuple[str, int], reusable: bool) -> None:
        """An event-stream reply was closed: a body read to its end keeps the connection, an
        unfinished one closes it (the server's signal to abort the request)."""
        conn.body = None
        if reusable and not conn.closed and not conn.buf and not self._closed:
            conn.last_used = asyncio.get_running_loop().time()
            self._idle.setdefault(key, []).append(conn)
            self._wake()
        else:
            self._discard(conn)

    def _take_idle(self, key: tuple[str, int], now: float) -> _Conn | None:
        stack = self._idle.get(key)
        while stack:
            c = stack.pop()
            if now - c.last_used > self.keepalive_expiry or c.unusable():
                self._discard(c)
                continue
            return c
        return None

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection to any host, to free a slot for another host."""
        oldest: list[_Conn] | None = None
        for stack in self._idle.values():
            if stack and (oldest is None or stack[0].last_used < oldest[0].last_used):
                oldest = stack
        if oldest is None:
            return False
        oldest.pop(0).abort()
        self._open -= 1  # the slot goes to the caller, not to a waiter
        return True

    async def _connect(
        self, key: tuple[str, int], timeouts: dict, request: httpx.Request, fresh: bool = False
    ) -> tuple[_Conn, bool]:
        loop = asyncio.get_running_loop()
        while True:
            c = None if fresh else self._take_idle(key, loop.time())
            if c is not None:
                return c, True
            if self._open < self.max_connections or self._evict_idle():
                break
            w = loop.create_future()
            self._waiters.append(w)
            pool_t = timeouts.get("pool")
            try:
                await (asyncio.wait_for(w, pool_t) if pool_t is not None else w)
            except asyncio.TimeoutError:
                raise httpx.PoolTimeout("no free connection in the pool", request=request) from None
            except BaseException:
                if w.done() and not w.cancelled():
                    self._wake()  # pass the slot on
                raise
        self._open += 1
        try:
            connect = loop.create_connection(_Conn, key[0], key[1])
            ct = timeouts.get("connect")
            _, conn = await (asyncio.wait_for(connect, ct) if ct is not None else connect)
        except asyncio.TimeoutError:
            self._open -= 1
            self._wake()
            raise httpx.ConnectTimeout(f"connect to {key[0]}:{key[1]} timed out", request=request) from None
        except OSError as e:
            self._open -= 1
            self._wake()
            raise httpx.ConnectError(f"connect to {key[0]}:{key[1]}: {e}", request=request) from e
        except BaseException:
            self._open -= 1
            self._wake()
            raise
        self.stats["connections_opened"] += 1
        return conn, False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("transport is closed", request=request)
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol("FastTransport serves plain http:// only", request=request)
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout") or {}
        body = await request.aread()
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        has_length = False
        for k, v in request.headers.raw:
            kl = k.lower()
            if kl == b"transfer-encoding":
                continue  # a streamed body was read whole above: it goes out with a content-length
            if kl == b"content-length":
                has_length = True
            head += (k, b": ", v, b"\r\n")
        if not has_length and (body or request.method in ("POST", "PUT", "PATCH")):
            head += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        head.append(b"\r\n")
        data = b"".join(head) + body
        loop = asyncio.get_running_loop()
        conn, reused = await self._connect(key, timeouts, request)
        while True:
            try:
                status, reason, headers, content, keep = await conn.roundtrip(
                    data, timeouts.get("read"), request.method == "HEAD"
                )
                break
            except _Stale:
                self._discard(conn)
                if not reused:
                    raise httpx.RemoteProtocolError(
                        "server disconnected without sending a response", request=request
                    ) from None
                # A kept-alive connection closed with not one byte of reply: the server's keep-alive
                # timer ran out as we reused it (its clock starts when it sends, ours when this loop
                # reads the reply, seconds later on a lagging loop). Once more on a new connection;
                # failing here would report a healthy backend as failed to the router.
                self.stats["stale_retries"] += 1
                conn, reused = await self._connect(key, timeouts, request, fresh=True)
            except TimeoutError:
                self._discard(conn)
                raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
            except BaseException:  # cancellation included: abort the request by closing the connection
                self._discard(conn)
                raise
        self.stats["requests"] += 1
        if isinstance(content, _Body):  # an event stream: the connection goes back when it is closed
            content.owner, content.read_timeout = (self, key), timeouts.get("read")
            self.stats["streams"] += 1
            return httpx.Response(
                status,
                headers=headers,
                stream=content,
                extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
                request=request,
            )
        if keep and not conn.closed and not self._closed:
            conn.last_used = loop.time()
            self._idle.setdefault(key, []).append(conn)
            self._wake()
        else:
            self._discard(conn)
        return httpx.Response(
            status,
            headers=headers,
            stream=httpx.ByteStream(content),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
            request=request,
        )

    async def aclose(self) -> None:
        self._closed = True
        for stack in self._idle.values():
            for c in stack:
                c.abort()
                self._open -= 1
        self._idle.clear()
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.cancel()

    def __repr__(self) -> str:
        idle = sum(len(s) for s in self._idle.values())
        return f"FastTransport(open={self._open}, idle={idle}, max={self.max_connections})"

