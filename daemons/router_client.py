"""The run daemon's requests to the router: one DEALER socket, replies matched by request id.

Lease requests wait at the router up to their ``wait_s``; a router that died with requests in hand
is detected by its new incarnation and every unanswered request is sent again (``router_seen``).
"""
from __future__ import annotations

import asyncio
import itertools

from rolloutd.bus import codec
from rolloutd.bus.messages import Release
from rolloutd.bus.sockets import recv, recv_now
from rolloutd.llm.client import with_timeout


class RouterError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class RouterClient:
    """Async requests to the router over one DEALER socket, matched by request id."""

    def __init__(self, sockets, requester: str, node: str, timeout_s: float = 5.0):
        self.sock = sockets.connect("DEALER", "router", hwm=10000)
        self.requester = requester
        self.node = node
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future, list]] = {}  # req id -> (reply, request frames)
        self._reader: asyncio.Task | None = None
        self.orphans_released = 0
        self.router_incarnation: str | None = None
        self.resent = 0

    def start(self):
        self._reader = asyncio.create_task(self._read())

    def stop(self):
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self):
        while True:
            frames = await recv(self.sock, 1.0)
            while frames is not None:  # drain what is queued: one wake-up, many replies
                await self._on_reply(frames)
                frames = recv_now(self.sock)

    async def _on_reply(self, frames):
        rest = frames[1:] if len(frames[0]) == 0 else frames
        try:
            header = codec.decode(rest)
        except codec.CodecError:
            return
        fut, _ = self._waiting.pop(header.get("req_id"), (None, None))
        if fut is not None and not fut.done():
            fut.set_result(header)
        elif isinstance(header.get("body"), dict) and "lease_id" in header["body"]:
            # A lease granted after its requester gave up (cancelled, timed out): hand it back
            # now instead of letting it count as in flight until lease_ttl_s expires it.
            self.orphans_released += 1
            await self.send(Release(lease_id=header["body"]["lease_id"]))

    async def router_seen(self, incarnation) -> int:
        """A router heartbeat or start notice. When the incarnation changed, the old router died
        with the requests it was holding (lease requests wait there up to a minute): send every
        unanswered one again. One the new router already got is granted twice; the reply that
        finds no waiter is an orphan and released (``_on_reply``). Returns how many were re-sent."""
        if not incarnation or incarnation == self.router_incarnation:
            return 0
        first, self.router_incarnation = self.router_incarnation is None, incarnation
        if first:
            return 0
        pending = [frames for fut, frames in self._waiting.values() if not fut.done()]
        for frames in pending:
            await self.sock.send_multipart(frames, copy=False)
        self.resent += len(pending)
        return len(pending)

    async def send(self, msg):
        """A request whose reply nobody waits for."""
        msg.req_id = next(self._ids)
        await self.sock.send_multipart([b""] + codec.encode(msg.to_wire()), copy=False)

    async def request(self, msg, timeout_s: float | None = None) -> dict:
        msg.req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        frames = [b""] + codec.encode(msg.to_wire())
        self._waiting[msg.req_id] = (fut, frames)
        await self.sock.send_multipart(frames, copy=False)
        try:
            header = await with_timeout(fut, timeout_s or self.timeout_s)  # not wait_for: see llm.client
        except asyncio.TimeoutError:
            raise RouterError("unavailable", "the router did not answer in time") from None
        finally:
            self._waiting.pop(msg.req_id, None)
        if header.get("kind") == "error":
            raise RouterError(header.get("code", "?"), header.get("message", ""))
        return header.get("body", {})
