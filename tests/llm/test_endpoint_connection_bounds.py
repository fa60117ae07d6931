"""Connection-level bounds of the job endpoint server (``openai_endpoint.serve``; issue 31).

The real uvicorn server (httptools, rolloutd's bounded protocol) on a Unix socket in the test's
loop, raw sockets as clients (in a thread). A minimal ASGI app: what is tested is the server's
own refusals, before any app runs. Wall time ~2 s.
"""
from __future__ import annotations

import asyncio
import socket
import time

from rolloutd.endpoint.bounds import EndpointBounds
from rolloutd.endpoint.server import serve


async def ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def status_line(s: socket.socket, timeout_s: float) -> str:
    s.settimeout(timeout_s)
    buf = b""
    try:
        while b"\r\n" not in buf:
            d = s.recv(4096)
            if not d:
                return "closed"
            buf += d
    except socket.timeout:
        return "timeout"
    except OSError:  # reset
        return "closed"
    return buf.split(b"\r\n", 1)[0].decode("latin-1")


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    return s


def test_a_request_line_that_is_not_http1_gets_400_at_once(arun, tmp_path):
    """HTTP/0.9 ("GET /path") and garbage get 400 as soon as their first line is in, not 408
    after the request deadline (a parser alone waits for a blank line that never comes)."""
    path = str(tmp_path / "s.sock")

    def clients() -> dict:
        out = {}
        for name, chunks in (("http09", [b"GET /v1/models\r\n"]), ("tls", [b"\x16\x03\x01\x02\x00\x01\r\n"]),
                             ("split", [b"GET /v1/mo", b"dels HTTP/1.1\r\nHost: x\r\n\r\n"])):
            s = connect(path)
            try:
                t = time.monotonic()
                for c in chunks:
                    s.sendall(c)
                    time.sleep(0.05)
                out[name] = (status_line(s, 20), time.monotonic() - t)
            finally:
                s.close()
        return out

    async def main():
        srv = await serve(ok_app, uds=path, bounds=EndpointBounds(request_timeout_s=30))
        try:
            return await asyncio.to_thread(clients)
        finally:
            await srv.stop()

    out = arun(main(), timeout=60)
    assert out["http09"][0] == "HTTP/1.1 400 Bad Request" and out["http09"][1] < 20, out
    assert out["tls"][0] == "HTTP/1.1 400 Bad Request", out
    assert out["split"][0] == "HTTP/1.1 200 OK", out  # a request line in two pieces is still served


def test_a_job_at_its_connection_cap_is_not_accepted_until_one_closes(arun, tmp_path):
    """At ``max_connections`` the server stops accepting on the job's socket: a further
    connection waits in the kernel's queue (no 503, no work on the loop) and is served as soon
    as one of the open ones closes."""
    path = str(tmp_path / "s.sock")
    cap = 4

    def clients(srv) -> dict:
        held = [connect(path) for _ in range(cap)]
        out = {}
        try:
            end = time.monotonic() + 30
            while len(srv._server.server_state.connections) < cap and time.monotonic() < end:
                time.sleep(0.02)
            extra = connect(path)  # queued by the kernel: the backlog is the cap
            try:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                out["while_full"] = status_line(extra, 1.0)  # the old code answered 503 at once
                held.pop().close()
                out["after_one_closed"] = status_line(extra, 30)
            finally:
                extra.close()
        finally:
            for s in held:
                s.close()
        return out

    async def main():
        srv = await serve(ok_app, uds=path, bounds=EndpointBounds(max_connections=cap, request_timeout_s=60))
        try:
            out = await asyncio.to_thread(clients, srv)
            out["pauses"] = srv._server.config.rolloutd_accept.pauses
            return out
        finally:
            await srv.stop()

    out = arun(main(), timeout=90)
    assert out["while_full"] == "timeout", out
    assert out["after_one_closed"] == "HTTP/1.1 200 OK", out
    assert out["pauses"] >= 1, out


def test_a_reply_the_client_never_takes_ends_the_request(qwen_tokenizer, arun):
    """``send_timeout_s`` bounds the sending of a reply (its head and body together): a client
    that never takes it (the send never completes) ends the request instead of holding it, and
    its job's slot, forever."""
    from rolloutd.endpoint.app import make_app
    from rolloutd.endpoint.session import EndpointSession

    async def no_backend(ids, params):
        raise AssertionError("no LLM call is made")

    s = EndpointSession(no_backend, qwen_tokenizer)
    s.bounds.send_timeout_s = 0.2
    app = make_app(s)
    sent: list[str] = []

    async def send(msg) -> None:
        sent.append(msg["type"])
        await asyncio.Event().wait()  # the client's socket buffer is full and it never reads

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": "/v1/models", "method": "GET", "http_version": "1.1", "headers": []}
    arun(app(scope, receive, send), timeout=60)  # raises if the request is still held then
    assert sent == ["http.response.start"]
