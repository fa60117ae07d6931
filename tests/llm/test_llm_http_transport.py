"""FastTransport (the httpx transport behind LLMClient) against a hand-written HTTP server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rolloutd.llm.http_transport import FastTransport


class RawServer:
    """Answers each request with ``handler(path, body) -> bytes | None`` (None: close, no reply)."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.active = 0
        self.max_active = 0
        self.server = None
        self.port = 0
        self.disconnects = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _conn(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                n = 0
                for ln in lines[1:]:
                    if ln.lower().startswith("content-length:"):
                        n = int(ln.split(":", 1)[1])
                body = await reader.readexactly(n) if n else b""
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                try:
                    out = await self.handler(path, body)
                except asyncio.CancelledError:
                    raise
                finally:
                    self.active -= 1
                if out is None:
                    writer.transport.abort()
                    return
                writer.write(out)
                await writer.drain()
                if b"connection: close" in out.lower():
                    writer.close()
                    return
        except ConnectionError:
            self.disconnects += 1
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def client(port, **kw):
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=FastTransport(**kw), timeout=5)


def test_keep_alive_reuses_one_connection(arun):
    async def handler(path, body):
        return ok(b'{"echo": %s}' % body)

    async def main():
        async with RawServer(handler) as srv, client(srv.port) as c:
            for i in range(5):
                r = await c.post("/x", content=b"%d" % i)
                assert r.status_code == 200 and r.json() == {"echo": i}
            assert srv.connections == 1

    arun(main())


def test_chunked_and_close_delimited_bodies(arun):
    async def handler(path, body):
        if path == "/chunked":
            return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
        if path == "/close":
            return b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end"
        return b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after-100")

    async def main():
        async with RawServer(handler) as srv, client(srv.port) as c:
            assert (await c.get("/chunked")).text == "hello, world"
            assert (await c.get("/close")).text == "until the end"
            assert (await c.get("/interim")).text == "after-100"
            assert (await c.get("/chunked")).text == "hello, world"

    arun(main())


def test_idle_connection_closed_by_server_is_not_reused(arun):
    async def handler(path, body):
        return ok(b"x", b"connection: close\r\n") if path == "/bye" else ok(b"y")

    async def main():
        async with RawServer(handler) as srv, client(srv.port) as c:
            assert (await c.get("/bye")).text == "x"
            await asyncio.sleep(0.05)
            assert (await c.get("/again")).text == "y"
            assert srv.connections == 2

    arun(main())


def test_expired_keepalive_is_dropped(arun):
    async def handler(path, body):
        return ok(b"y")

    async def main():
        async with RawServer(handler) as srv, client(srv.port, keepalive_expiry=0.05) as c:
            await c.get("/a")
            await asyncio.sleep(0.1)
            await c.get("/b")
            assert srv.connections == 2

    arun(main())


def test_connection_cap_and_queueing(arun):
    async def handler(path, body):
        await asyncio.sleep(0.05)
        return ok(b"z")

    async def main():
        async with RawServer(handler) as srv, client(srv.port, max_connections=2) as c:
            rs = await asyncio.gather(*[c.get(f"/{i}") for i in range(7)])
            assert all(r.text == "z" for r in rs)
            assert srv.connections == 2 and srv.max_active == 2

    arun(main())


def test_errors_map_to_httpx_exceptions(arun):
    async def handler(path, body):
        if path == "/slow":
            await asyncio.sleep(5)
        if path == "/drop":
            return None
        return ok(b"fine")

    async def main():
        async with RawServer(handler) as srv:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{srv.port}", transport=FastTransport(), timeout=httpx.Timeout(0.2)
            ) as c:
                with pytest.raises(httpx.ReadTimeout):
                    await c.get("/slow")
                with pytest.raises(httpx.RemoteProtocolError):
                    await c.get("/drop")
                assert (await c.get("/ok")).text == "fine"
                assert c._transport.num_open == 1
        # nothing listens there any more
        async with client(srv.port) as c:
            with pytest.raises(httpx.ConnectError):
                await c.get("/")

    arun(main())


def test_pool_timeout(arun):
    async def handler(path, body):
        await asyncio.sleep(1.0)
        return ok(b"late")

    async def main():
        async with RawServer(handler) as srv:
            t = FastTransport(max_connections=1)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{srv.port}", transport=t, timeout=httpx.Timeout(5, pool=0.1)
            ) as c:
                first = asyncio.create_task(c.get("/1"))
                await asyncio.sleep(0.05)
                with pytest.raises(httpx.PoolTimeout):
                    await c.get("/2")
                assert (await first).text == "late"

    arun(main())


def test_cancel_aborts_the_connection(arun):
    started = asyncio.Event

    async def main():
        flag = started()

        async def handler(path, body):
            flag.set()
            await asyncio.sleep(10)
            return ok(b"never")

        async with RawServer(handler) as srv, client(srv.port) as c:
            task = asyncio.create_task(c.get("/long"))
            await asyncio.wait_for(flag.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c._transport.num_open == 0

    arun(main())


def test_reused_connection_closed_without_reply_is_retried_once(arun):
    seen = []

    async def handler(path, body):
        seen.append(path)
        if path == "/drop-once" and seen.count(path) == 1:
            return None  # a kept-alive connection closed as it was reused: not one byte of reply
        if path == "/drop-always":
            return None
        return ok(b"fine")

    async def main():
        async with RawServer(handler) as srv:
            t = FastTransport()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", transport=t, timeout=5) as c:
                assert (await c.get("/warm")).text == "fine"
                assert (await c.post("/drop-once", content=b"x")).text == "fine"
                assert t.stats["stale_retries"] == 1 and srv.connections == 2
                # the retry goes on a new connection and is not repeated
                with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                    await c.get("/drop-always")
                assert t.stats["stale_retries"] == 2 and seen.count("/drop-always") == 2
            # a new connection that closes without a reply is an error at once, never retried
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", transport=FastTransport(), timeout=5) as c:
                with pytest.raises(httpx.RemoteProtocolError):
                    await c.get("/drop-always")
            assert seen.count("/drop-always") == 3

    arun(main())
