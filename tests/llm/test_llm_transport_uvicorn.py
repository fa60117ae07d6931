"""FastTransport against uvicorn, the HTTP server vLLM and SGLang run, in both its HTTP/1.1 stacks.

The server is a real ``uvicorn.Server`` in a child process (this file run as a script) on
127.0.0.1, serving a small ASGI app that reports what it saw at ``/stats``: the client ports of
its requests (one port per connection), the connections still open, the requests in flight and
the ones that saw ``http.disconnect``. ``/stats`` is read with httpx's default transport so the
transport under test never measures itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

if not __package__:  # run as the server child (a script): the repo root, for tests.llm
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.llm.uvicorn_server import quiet_config, read_body, serve_printing_port, wait_ready  # noqa: E402

IMPLS = ["h11", "httptools"]


# -- the server side (runs in the child process) ----------------------------------------------


def pattern(n: int) -> bytes:
    """n deterministic bytes, all 256 values, so a misplaced chunk boundary shows."""
    base = bytes(range(256))
    return (base * (n // 256 + 1))[:n]


class _State:
    def __init__(self) -> None:
        self.server = None
        self.reset()

    def reset(self) -> None:
        self.ports: set[int] = set()
        self.inflight: set[str] = set()
        self.disconnected: list[str] = []
        self.active = 0
        self.max_active = 0
        self.requests = 0


async def _send_json(send, status: int, obj, headers=()) -> None:
    data = json.dumps(obj).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


def make_app(state: _State):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        q = dict(urllib.parse.parse_qsl(scope["query_string"].decode()))
        port = scope["client"][1]
        if path == "/stats":
            conns = state.server.server_state.connections
            open_ports = sorted(c.client[1] for c in conns if c.client and c.client[1] != port)
            return await _send_json(send, 200, {
                "ports": sorted(state.ports), "open": open_ports, "inflight": sorted(state.inflight),
                "disconnected": state.disconnected, "max_active": state.max_active, "requests": state.requests,
            })
        if path == "/reset":
            state.reset()
            return await _send_json(send, 200, {})
        state.ports.add(port)
        state.requests += 1
        body = await read_body(receive)
        if body is None:
            return
        if path == "/echo":
            return await _send_json(send, 200, {"len": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                                                "port": port})
        if path == "/length":
            data = pattern(int(q["n"]))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(data)).encode())]})
            return await send({"type": "http.response.body", "body": data})
        if path == "/chunked":  # no content-length: uvicorn sends transfer-encoding: chunked
            data, parts = pattern(int(q["n"])), int(q.get("parts", 1))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            step = -(-len(data) // parts) if data else 1
            for i in range(0, len(data), step):
                await send({"type": "http.response.body", "body": data[i : i + step], "more_body": True})
            return await send({"type": "http.response.body", "body": b""})
        if path == "/nocontent":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        if path == "/error":
            status = int(q["status"])
            return await _send_json(send, status, {"error": {"message": f"status {status}", "code": status}})
        if path == "/crash":  # uvicorn answers 500 text/plain with connection: close
            raise RuntimeError("crash before the response")
        if path == "/cut":  # start the response, then die: uvicorn closes the connection
            n = 100_000
            hdrs = [(b"content-length", str(n).encode())] if q["mode"] == "length" else []
            await send({"type": "http.response.start", "status": 200, "headers": hdrs})
            await send({"type": "http.response.body", "body": pattern(n // 2), "more_body": True})
            raise RuntimeError("cut mid-response")
        if path == "/sleep":
            state.active += 1
            state.max_active = max(state.max_active, state.active)
            try:
                await asyncio.sleep(float(q.get("s", 0)))
            finally:
                state.active -= 1
            return await _send_json(send, 200, {"port": port})
        if path == "/slow":  # like a generation: runs until done or until the client goes away
            rid = q["id"]
            state.inflight.add(rid)
            try:
                m = await asyncio.wait_for(receive(), 60)
            finally:
                state.inflight.discard(rid)
            if m["type"] == "http.disconnect":
                state.disconnected.append(rid)
                return
            return await _send_json(send, 200, {"id": rid})
        await _send_json(send, 404, {"error": {"message": f"no route {path}", "code": 404}})

    return app


def _serve(argv: list[str]) -> int:
    import argparse

    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--http", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--keep-alive", type=float, default=None)
    a = p.parse_args(argv)
    state = _State()
    kw = {} if a.keep_alive is None else {"timeout_keep_alive": a.keep_alive}
    server = uvicorn.Server(quiet_config(make_app(state), http=a.http, **kw))
    state.server = server
    serve_printing_port(server, a.port)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))


# -- the tests ------------------------------------------------------------------------------------

import httpx  # noqa: E402
import pytest  # noqa: E402

from rolloutd.llm.http_transport import FastTransport  # noqa: E402



class Uvicorn:
    """A uvicorn child process; ``stop()`` is checked, the port can be reused by a restart."""

    def __init__(self, impl: str, log: Path, port: int = 0, keep_alive: float | None = None) -> None:
        cmd = [sys.executable, __file__, "--http", impl, "--port", str(port)]
        if keep_alive is not None:
            cmd += ["--keep-alive", str(keep_alive)]
        self.impl = impl
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, cwd=str(Path(__file__).parent))
        port = wait_ready(self.proc)
        if port is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"uvicorn ({impl}) did not start; see {log}")
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def uvicorn_factory(tmp_path):
    pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[test])")
    started: list[Uvicorn] = []

    def make(impl: str, **kw) -> Uvicorn:
        pytest.importorskip(impl, reason=f"{impl} is not installed (pip install rolloutd[test])")
        srv = Uvicorn(impl, tmp_path / f"uvicorn-{impl}-{len(started)}.log", **kw)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
        assert srv.proc.returncode is not None


@pytest.fixture(params=IMPLS)
def uv(request, uvicorn_factory) -> Uvicorn:
    return uvicorn_factory(request.param)


async def stats(srv: Uvicorn) -> dict:
    # httpx's default transport, one connection per call, never the transport under test
    async with httpx.AsyncClient(timeout=5, verify=False, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        return (await c.get(srv.url + "/stats")).json()


async def wait_stats(srv: Uvicorn, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await stats(srv)
        if pred(st) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.02)


def client(srv: Uvicorn, transport: FastTransport | None = None, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=srv.url, transport=transport or FastTransport(), timeout=kw.pop("timeout", 10), **kw)


def test_keep_alive_reuses_one_connection(uv, arun):
    async def main():
        t = FastTransport()
        async with client(uv, t) as c:
            for i in range(20):
                body = json.dumps({"i": i}).encode()
                r = await c.post("/echo", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 200 and r.json()["sha256"] == hashlib.sha256(body).hexdigest()
            st = await stats(uv)
        assert len(st["ports"]) == 1 and st["requests"] == 20
        assert t.stats["connections_opened"] == 1

    arun(main())


@pytest.mark.parametrize("impl", IMPLS)
def test_idle_connection_closed_at_uvicorns_keep_alive_timeout(impl, uvicorn_factory, arun):
    srv = uvicorn_factory(impl, keep_alive=1)

    async def main():
        t = FastTransport(keepalive_expiry=60)  # longer than the server's: the server closes first
        async with client(srv, t) as c:
            first = (await c.get("/echo")).json()["port"]
            st = await wait_stats(srv, lambda s: first not in s["open"])
            assert first not in st["open"], "uvicorn did not close the idle connection at its keep-alive timeout"
            r = await c.get("/echo")
            assert r.status_code == 200 and r.json()["port"] != first
        assert t.stats["connections_opened"] == 2

    arun(main())


def test_expired_idle_connection_is_closed_by_the_client(uv, arun):
    async def main():
        t = FastTransport(keepalive_expiry=0.2)  # uvicorn keeps it 5 s
        async with client(uv, t) as c:
            first = (await c.get("/echo")).json()["port"]
            await asyncio.sleep(0.4)  # the expiry is the behaviour under test
            second = (await c.get("/echo")).json()["port"]
            assert second != first
            st = await wait_stats(uv, lambda s: first not in s["open"])
            assert first not in st["open"] and second in st["open"]

    arun(main())


def test_default_keepalive_expiry_is_below_uvicorns():
    import uvicorn

    from rolloutd.llm.client import LLMClient

    server_timeout = uvicorn.Config(app=make_app(_State())).timeout_keep_alive
    assert FastTransport().keepalive_expiry < server_timeout
    c = LLMClient("http://127.0.0.1:9")
    try:
        assert c._http._transport.keepalive_expiry < server_timeout
    finally:
        asyncio.run(c.aclose())


def test_content_length_and_chunked_bodies(uv, arun):
    big = 8 * 1024 * 1024

    async def main():
        t = FastTransport()
        async with client(uv, t) as c:
            for n in (0, 1, 4099, big):
                r = await c.get("/length", params={"n": n})
                assert r.headers["content-length"] == str(n) and "transfer-encoding" not in r.headers
                assert r.content == pattern(n)
                for parts in (1, 7, 100):
                    r = await c.get("/chunked", params={"n": n, "parts": parts})
                    assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers
                    assert r.content == pattern(n), (n, parts, len(r.content))
            r = await c.head("/length", params={"n": 1000})  # a length, and no body after it
            assert r.status_code == 200 and r.headers["content-length"] == "1000" and r.content == b""
            r = await c.get("/nocontent")
            assert r.status_code == 204 and r.content == b""
            assert (await c.get("/length", params={"n": 3})).content == pattern(3)
        assert t.stats["connections_opened"] == 1  # every body ended where the server said it would

    arun(main(), timeout=120)


def test_large_and_streamed_request_bodies(uv, arun):
    async def main():
        async with client(uv) as c:
            data = pattern(8 * 1024 * 1024 + 3)
            r = await c.post("/echo", content=data)
            assert r.json()["len"] == len(data) and r.json()["sha256"] == hashlib.sha256(data).hexdigest()

            async def parts():  # httpx sends a generator with transfer-encoding: chunked
                for i in range(3):
                    yield pattern(1000 + i)

            r = await c.post("/echo", content=parts())
            want = b"".join(pattern(1000 + i) for i in range(3))
            assert r.status_code == 200 and r.json()["sha256"] == hashlib.sha256(want).hexdigest()
            r = await c.post("/echo", json={"prompt": list(range(20_000))})
            assert r.json()["len"] == len(json.dumps({"prompt": list(range(20_000))}, separators=(",", ":")))
            st = await stats(uv)
        assert len(st["ports"]) == 1

    arun(main(), timeout=120)


def test_error_statuses_are_json_responses_on_a_kept_connection(uv, arun):
    async def main():
        t = FastTransport()
        async with client(uv, t) as c:
            for status in (400, 404, 422, 429, 500, 503):
                r = await c.get("/error", params={"status": status})
                assert r.status_code == status and r.json()["error"]["code"] == status
            assert (await c.get("/nowhere")).status_code == 404
            assert t.stats["connections_opened"] == 1
            r = await c.get("/crash")  # an app exception: 500 and connection: close
            assert r.status_code == 500 and r.text == "Internal Server Error"
            assert (await c.get("/echo")).status_code == 200
        assert t.stats["connections_opened"] == 2

    arun(main())


@pytest.mark.parametrize("mode", ["length", "chunked"])
def test_server_closing_mid_response_is_an_error(uv, mode, arun):
    async def main():
        t = FastTransport()
        async with client(uv, t) as c:
            with pytest.raises(httpx.RemoteProtocolError, match="mid-response"):
                await c.get("/cut", params={"mode": mode})
            assert t.num_open == 0
            assert (await c.get("/echo")).status_code == 200

    arun(main())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["graceful", "killed"])
@pytest.mark.parametrize("impl", IMPLS)
def test_server_restart_between_requests(impl, sig, uvicorn_factory, arun):
    first = uvicorn_factory(impl)

    async def main():
        t = FastTransport()
        async with client(first, t) as c:
            assert (await c.get("/echo")).status_code == 200
            # restart while this loop is blocked: the old connection's close is still unread
            # when the next request is sent, as on a busy run daemon
            first.stop(sig)
            second = uvicorn_factory(impl, port=first.port)
            r = await c.get("/echo")
            assert r.status_code == 200
            assert (await stats(second))["requests"] == 1
        assert t.stats["connections_opened"] == 2

    arun(main())


def test_thousand_concurrent_requests_through_a_capped_pool(uv, arun):
    cap = 32

    async def main():
        t = FastTransport(max_connections=cap)
        async with client(uv, t, timeout=httpx.Timeout(60, pool=60)) as c:
            rs = await asyncio.gather(*[c.get("/sleep", params={"s": 0.002}) for _ in range(1000)])
            assert all(r.status_code == 200 for r in rs)
            assert t.num_open <= cap
            st = await stats(uv)
        assert st["requests"] == 1000
        assert 1 < st["max_active"] <= cap
        assert len(st["ports"]) <= cap and t.stats["connections_opened"] <= cap

    arun(main(), timeout=180)


def test_cancellation_aborts_the_request_on_the_server(uv, arun):
    async def main():
        t = FastTransport()
        async with client(uv, t) as c:
            task = asyncio.create_task(c.post("/slow", params={"id": "cancelled"}, json={"prompt": [1, 2, 3]}))
            st = await wait_stats(uv, lambda s: "cancelled" in s["inflight"])
            assert "cancelled" in st["inflight"]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert t.num_open == 0
            st = await wait_stats(uv, lambda s: "cancelled" in s["disconnected"])
            assert st["disconnected"] == ["cancelled"] and st["inflight"] == []
            # a read timeout aborts the same way
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/slow", params={"id": "timed-out"}, json={}, timeout=httpx.Timeout(10, read=0.3))
            st = await wait_stats(uv, lambda s: "timed-out" in s["disconnected"])
            assert st["disconnected"] == ["cancelled", "timed-out"] and st["inflight"] == []

    arun(main())


def test_idle_connections_to_one_backend_do_not_starve_another(uvicorn_factory, arun):
    a, b = uvicorn_factory("h11"), uvicorn_factory("h11")

    async def main():
        t = FastTransport(max_connections=2)
        async with httpx.AsyncClient(transport=t, timeout=httpx.Timeout(10, pool=2)) as c:
            await asyncio.gather(*[c.get(a.url + "/sleep", params={"s": 0.2}) for _ in range(2)])
            assert t.num_open == 2  # both idle, kept for a
            r = await c.get(b.url + "/echo")  # needs a slot: an idle connection to a gives it up
            assert r.status_code == 200 and t.num_open <= 2
            assert (await c.get(a.url + "/echo")).status_code == 200

    arun(main())
