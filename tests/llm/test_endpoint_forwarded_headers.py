"""An agent cannot name its own address to the endpoint: ``X-Forwarded-For`` / ``-Proto`` are not
believed (uvicorn's ``proxy_headers`` off; with it on, a request from 127.0.0.1 -- uvicorn's
default trusted proxy -- rewrote the client and scheme the app sees: checked). A real uvicorn
server from ``endpoint.server.serve`` on loopback, the real httpx client."""
from __future__ import annotations

import asyncio

import httpx

from rolloutd.endpoint.server import serve


def test_forwarded_headers_do_not_change_the_client_or_scheme():
    seen: list[tuple] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append((scope["client"], scope["scheme"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main():
        srv = await serve(app, host="127.0.0.1", port=0)
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.get(f"http://127.0.0.1:{srv.port}/health",
                                headers={"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https"})
                assert r.status_code == 200
        finally:
            await srv.stop()

    asyncio.run(main())
    (client, scheme), = seen
    assert client[0] == "127.0.0.1" and scheme == "http", seen
