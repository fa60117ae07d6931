"""The bounds the job endpoint's HTTP parser (httptools/llhttp under uvicorn, endpoint/server.py)
keeps on what an agent sends: request line and headers, versions, the whole-request deadline,
and keep-alive and pipelined requests still served. The real server on a Unix socket in the
test's loop, raw sockets as clients (in a thread), an app that echoes what it received.
Wall time ~10 s.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

from rolloutd.endpoint.bounds import EndpointBounds
from rolloutd.endpoint.server import serve

from .test_endpoint_connection_bounds import connect, status_line


async def echo_app(scope, receive, send) -> None:
    """Answers what it was sent: method, path, version, header count and body length."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    out = json.dumps({"path": scope["path"], "version": scope["http_version"], "headers": len(scope["headers"]),
                      "body": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


def read_replies(s: socket.socket, n: int, timeout_s: float) -> list[tuple[str, dict | None]]:
    """``n`` replies (status line, JSON body) from ``s``, or fewer when it closes or goes quiet."""
    s.settimeout(timeout_s)
    buf, out = b"", []
    while len(out) < n:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            head = buf[:head_end].decode("latin-1").split("\r\n")
            length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
            if len(buf) >= head_end + 4 + length:
                body = buf[head_end + 4:head_end + 4 + length]
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                out.append((head[0], parsed))
                buf = buf[head_end + 4 + length:]
                continue
        try:
            d = s.recv(65536)
        except (socket.timeout, OSError):
            break
        if not d:
            break
        buf += d
    return out


def send_each(path: str, raws: dict[str, bytes], n: int) -> dict:
    """Each of ``raws`` on a connection of its own: up to ``n`` replies to it (5 s quiet ends them)."""
    out = {}
    for name, raw in raws.items():
        s = connect(path)
        try:
            s.sendall(raw)
            out[name] = read_replies(s, n, 5)
        finally:
            s.close()
    return out


def run_clients(arun, tmp_path, clients, app=echo_app, **bounds) -> dict:
    path = str(tmp_path / "s.sock")

    async def main():
        srv = await serve(app, uds=path, bounds=EndpointBounds(**bounds))
        try:
            return await asyncio.to_thread(clients, path)
        finally:
            await srv.stop()

    return arun(main(), timeout=120)


def test_a_header_block_over_the_bound_is_refused_as_it_arrives(arun, tmp_path):
    """A 2 MiB header line is answered 431 once 64 KiB of it are in (not buffered to its end,
    not waited for); a complete 100 KB header block sent at once is 431 too; 60 KB of headers,
    under the bound, is served."""

    def clients(path: str) -> dict:
        out = {}
        s = connect(path)
        try:
            t = time.monotonic()
            sent = 0
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
            try:
                for _ in range(32):  # 2 MiB in 64 KiB pieces, never finished
                    s.sendall(b"a" * 65536)
                    sent += 65536
                    time.sleep(0.01)
            except OSError:  # the server closed its side
                pass
            out["line"] = (status_line(s, 10), time.monotonic() - t, sent)
        finally:
            s.close()
        for name, size in (("block", 100_000), ("under", 60_000)):
            s = connect(path)
            try:
                fields = b"".join(b"X-F%d: %s\r\n" % (i, b"b" * 990) for i in range(size // 1000))
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
                out[name] = read_replies(s, 1, 10)
            finally:
                s.close()
        return out

    out = run_clients(arun, tmp_path, clients, request_timeout_s=60)
    status, took, sent = out["line"]
    assert status == "HTTP/1.1 431 Request Header Fields Too Large", out
    assert took < 10 and sent < (1 << 20), out  # refused well before the 2 MiB were in
    assert [r[0] for r in out["block"]] == ["HTTP/1.1 431 Request Header Fields Too Large"], out
    assert out["under"][0][0] == "HTTP/1.1 200 OK" and out["under"][0][1]["headers"] == 61, out


def test_versions_other_than_http1_are_answered_505(qwen_tokenizer, arun, tmp_path):
    """HTTP/7.0 and HTTP/2.0 (which llhttp parses) get 505 at their request line; a pipelined
    HTTP/2.0 request behind a served one gets 505 from the app, after the first one's answer;
    1.0 is served. The job endpoint's own app (``make_app``), its /health route."""
    from rolloutd.endpoint.app import make_app
    from rolloutd.endpoint.session import EndpointSession

    async def no_backend(ids, params):
        raise AssertionError("no LLM call is made")

    raws = {"v7": b"GET /v1/health HTTP/7.0\r\nHost: x\r\n\r\n",
            "v2": b"GET /v1/health HTTP/2.0\r\nHost: x\r\n\r\n",
            "v10": b"GET /v1/health HTTP/1.0\r\n\r\n",
            "pipelined": b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/health HTTP/2.0\r\nHost: x\r\n\r\n"}
    out = run_clients(arun, tmp_path, lambda path: send_each(path, raws, 2),
                      app=make_app(EndpointSession(no_backend, qwen_tokenizer)))
    assert [r[0] for r in out["v7"]] == ["HTTP/1.1 505 HTTP Version Not Supported"], out
    assert out["v7"][0][1]["error"]["code"] == "http_version_not_supported", out
    assert [r[0] for r in out["v2"]] == ["HTTP/1.1 505 HTTP Version Not Supported"], out
    assert [r[0] for r in out["v10"]] == ["HTTP/1.1 200 OK"], out
    assert [r[0] for r in out["pipelined"]] == ["HTTP/1.1 200 OK", "HTTP/1.1 505 HTTP Version Not Supported"], out
    assert out["pipelined"][1][1]["error"]["code"] == "http_version_not_supported", out


def test_keep_alive_and_pipelined_requests_are_served_and_each_has_its_deadline(arun, tmp_path):
    """Three requests on one kept-alive connection (one with a chunked body) and two pipelined in
    one write are all answered in order; a later request on a kept-alive connection that stops
    halfway gets 408 at its own deadline, as do a pipelined one that stops halfway and a body
    that never completes."""
    deadline = 1.5

    def clients(path: str) -> dict:
        out = {}
        s = connect(path)
        try:
            replies = []
            for raw in (b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"POST /two HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                        b"POST /three HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"):
                s.sendall(raw)
                replies += read_replies(s, 1, 5)
            time.sleep(deadline + 0.5)  # idle between requests is not a slow request
            s.sendall(b"GET /four HTTP/1.1\r\nHost: x\r\n\r\nGET /five HTTP/1.1\r\nHost: x\r\n\r\n")
            replies += read_replies(s, 2, 5)
            out["kept"] = replies
            t = time.monotonic()
            s.sendall(b"GET /six HTTP/1.1\r\nHost: x\r\n")  # never finished
            out["slow_second"] = (read_replies(s, 1, 10), time.monotonic() - t)
        finally:
            s.close()
        s = connect(path)
        try:
            t = time.monotonic()  # a pipelined request that stops halfway, behind one that is whole
            s.sendall(b"GET /eight HTTP/1.1\r\nHost: x\r\n\r\nGET /nine HTTP/1.1\r\nHost: x\r\n")
            out["slow_pipelined"] = (read_replies(s, 2, 10), time.monotonic() - t)
        finally:
            s.close()
        s = connect(path)
        try:
            t = time.monotonic()
            s.sendall(b"POST /seven HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
            out["slow_body"] = (read_replies(s, 1, 10), time.monotonic() - t)
        finally:
            s.close()
        return out

    out = run_clients(arun, tmp_path, clients, request_timeout_s=deadline)
    kept = out["kept"]
    assert [r[0] for r in kept] == ["HTTP/1.1 200 OK"] * 5, out
    assert [(r[1]["path"], r[1]["body"]) for r in kept] == [("/one", 0), ("/two", 5), ("/three", 3), ("/four", 0),
                                                            ("/five", 0)], out
    replies, took = out["slow_pipelined"]
    assert [r[0] for r in replies] == ["HTTP/1.1 200 OK", "HTTP/1.1 408 Request Timeout"], out
    assert deadline - 0.2 < took < deadline + 5, out
    for name in ("slow_second", "slow_body"):
        replies, took = out[name]
        assert [r[0] for r in replies] == ["HTTP/1.1 408 Request Timeout"], (name, out)
        assert replies[0][1]["error"]["code"] == "request_timeout", (name, out)
        assert deadline - 0.2 < took < deadline + 5, (name, out)


def test_an_upgrade_request_with_a_body_is_refused_not_served_empty(arun, tmp_path):
    """llhttp hands what follows an Upgrade request's head to the new protocol: a POST with
    ``Upgrade: h2c`` (curl --http2 on http://) and a body would reach the app with no body. It
    gets 400 instead; a GET with the same header is served as plain HTTP/1.1."""

    raws = {"get": b"GET /g HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                   b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n",
            "post": b"POST /p HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}",
            "chunked": b"POST /p HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: foo\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n7\r\n{\"a\":1}\r\n0\r\n\r\n"}
    out = run_clients(arun, tmp_path, lambda path: send_each(path, raws, 1))
    assert out["get"][0][0] == "HTTP/1.1 200 OK" and out["get"][0][1]["path"] == "/g", out
    for name in ("post", "chunked"):
        assert [r[0] for r in out[name]] == ["HTTP/1.1 400 Bad Request"], (name, out)
        assert out[name][0][1]["error"]["code"] == "upgrade_with_body", (name, out)
