"""The agent-facing endpoint's HTTP server: uvicorn inside the caller's event loop on a Unix
socket or 127.0.0.1 (``serve``, ``EndpointServer``), with the bounds uvicorn lacks (a
per-server connection cap that pauses accepting, header limits, a request deadline;
docs/HARNESS.md, "Bounds").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from typing import Any

import structlog

from .bounds import EndpointBounds
from .wire import EndpointError

log = structlog.get_logger("rolloutd.llm")

__all__ = ["EndpointServer", "serve"]


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

# A request line (method SP target SP HTTP/x.y); anything else as the first line of a request
# (HTTP/0.9 "GET /path", TLS, garbage) is answered 400 as soon as that line is in, and a version
# other than 1.0 or 1.1 505, rather than llhttp's plain-text 400 or a wait for more bytes.
_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [\x21-\x7e]+ HTTP/([0-9]\.[0-9])\r?")


def _raw_refusal(transport, status: int, reason: str, err: EndpointError) -> None:
    """Answer ``err`` and close, without the parser or the app: the cheap path for refusals at the
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
    """uvicorn's httptools protocol with the bounds uvicorn lacks: a per-server connection cap,
    a deadline for a whole request, a bound on the request line and headers, and HTTP/1.0 or
    1.1 only, refused at the request line. httptools (llhttp) rather than h11: the server's CPU
    per resent 53 KB chat request is 0.45x h11's (bench/bench_endpoint_http.py); the bounds h11
    had built in are here instead (docs/HARNESS.md, "Bounds")."""
    global _protocol_class
    if _protocol_class is not None:
        return _protocol_class
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _Refused(Exception):
        """Raised from a parser callback after a refusal was written: stops llhttp mid-feed."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _timer = None
        _idle = True  # between requests: the next byte starts one (its deadline, its line check)
        _head = b""  # the start of the current request until its first line is checked; None once it is
        _in_head = False  # llhttp is inside a request line or header block
        _head_fields = 0  # bytes of that head's target and fields, as llhttp hands them over
        _head_chunks = 0  # bytes of the chunks that ended inside that head (bounds a header never finished)
        _completed = False  # a request ended during the current feed

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

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                _raw_refusal(self.transport, 408, "Request Timeout", EndpointError(
                    408, "the request did not arrive completely in "
                         f"{self.config.rolloutd_bounds.request_timeout_s:g} s", code="request_timeout"))
            self.transport.close()

        def _refuse(self, status: int, reason: str, err: EndpointError) -> None:
            self._disarm()
            _raw_refusal(self.transport, status, reason, err)

        def _check_line(self, data: bytes) -> bool:
            """The request's first line, once it is in: HTTP/1.0 or 1.1, or refused (False)."""
            limit = self.config.rolloutd_bounds.max_header_bytes
            head = self._head + data
            end = head.find(b"\n", 0, limit)
            if end < 0:  # past the bound the head's own bound refuses it
                self._head = head if len(head) < limit else None
                return True
            self._head = None
            m = _REQUEST_LINE.fullmatch(head, 0, end)
            if m is None:
                self._refuse(400, "Bad Request", EndpointError(
                    400, "the request line is not 'METHOD target HTTP/x.y' (HTTP/0.9 is not served)",
                    code="bad_request_line"))
                return False
            if m.group(1) not in (b"1.0", b"1.1"):
                self._refuse(505, "HTTP Version Not Supported", EndpointError(
                    505, f"HTTP/{m.group(1).decode()} is not supported: HTTP/1.1 or 1.0",
                    code="http_version_not_supported"))
                return False
            return True

        def data_received(self, data: bytes) -> None:
            if self._idle and self._timer is None:
                self._arm()  # the first byte of the next request on a kept-alive connection
                self._head = b""
            if self._head is not None and not self._check_line(data):
                return
            self._completed = False
            super().data_received(data)  # a refusal from a callback raises out of llhttp: uvicorn's 400 is skipped
            if self._in_head and not self.transport.is_closing():
                # A head not complete at the end of this chunk: count the chunk (not the one a request
                # ended in: part of it was that request's). Bounds what llhttp buffers of a header line.
                if not self._completed:
                    self._head_chunks += len(data)
                if self._head_chunks > self.config.rolloutd_bounds.max_header_bytes:
                    self._too_large()

        def _too_large(self) -> None:
            b = self.config.rolloutd_bounds
            self._refuse(431, "Request Header Fields Too Large", EndpointError(
                431, f"request line and headers over {b.max_header_bytes} bytes",
                code="request_header_fields_too_large"))

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():  # not after a refusal of ours
                self._disarm()
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            self._idle, self._in_head, self._head_fields, self._head_chunks = False, True, 0, 0
            if self._timer is None:  # one pipelined behind a request that ended in the same chunk
                self._arm()
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_fields += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_fields += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_fields > self.config.rolloutd_bounds.max_header_bytes:
                self._too_large()
                raise _Refused
            if self.parser.should_upgrade() and any(
                    k == b"transfer-encoding" or (k == b"content-length" and v.strip(b" 0")) for k, v in self.headers):
                # llhttp hands the bytes after an Upgrade request's head to the new protocol, so its
                # body would reach the app empty: refused rather than served without it
                self._refuse(400, "Bad Request", EndpointError(
                    400, "a request body with an Upgrade header is not read: send it without 'Upgrade'",
                    code="upgrade_with_body"))
                raise _Refused
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._idle, self._completed = True, True
            self._disarm()  # the whole request is in
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)
            if len(self.connections) < self.config.rolloutd_bounds.max_connections:
                self.config.rolloutd_accept.resume()

    _protocol_class = BoundedHttpToolsProtocol
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
                            # no proxy stands before a job's endpoint: an agent's X-Forwarded-* is not
                            # believed, and no middleware layer runs per request
                            proxy_headers=False,
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
