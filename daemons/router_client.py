"""The run daemon's requests to the router: one DEALER socket, replies matched by request id.

Lease requests and releases are not one message each: what the daemon's jobs queue during one
event-loop tick goes out as one ``lease_batch`` (docs/PROTOCOL.md, router requests), answered by
one reply. A run daemon sends at most one batch per ``batch_s``, an interval each batch reply
sets (the router shares a message budget among the run daemons it hears from: 0 with a few, 0.25 s
at 1,000 nodes); the first batch after a quiet spell goes at once. At 512 slots and 30 s jobs a
daemon has ~34 operations a second, about one per tick, so per-tick batches alone would stay at
one operation; a fixed interval would delay every lease and release of a small deployment (the
routing benchmark's refill delay). While a batch is unanswered for more than ``BEHIND_S`` (up to
``hold_max_s``) new operations keep queueing, so a router that falls behind gets fewer, larger
batches instead of a growing backlog of messages (docs/SCALING.md). A lease the router cannot grant at once waits there up to its ``wait_s`` and
is answered on its own when granted, as a single ``lease`` would be.

A router that died with requests in hand is detected by its new incarnation and every
unanswered request is sent again (``router_seen``). A router older than ``lease_batch`` (it answers
``unknown_kind``) gets that batch's operations again as single messages, and single messages from
then on: nodes may be upgraded before the head.
"""
from __future__ import annotations

import asyncio
import itertools
import time

from rolloutd.bus import codec
from rolloutd.bus.messages import Lease, LeaseBatch, Release
from rolloutd.bus.sockets import recv, recv_now
from rolloutd.llm.client import with_timeout


HOLD_MAX_S = 1.0  # longest a queued operation waits behind an unanswered batch
BEHIND_S = 0.01   # a batch unanswered this long means the router is behind


class RouterError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def lease_member(msg: Lease, requester: str, node: str) -> dict:
    """A ``lease`` message as a ``lease_batch`` member: the batch carries requester and node."""
    d = {"job_id": msg.job_id, "wait_s": msg.wait_s, "req_id": msg.req_id}
    if msg.exclude:
        d["exclude"] = list(msg.exclude)
    if msg.requester and msg.requester != requester:
        d["requester"] = msg.requester
    if msg.node and msg.node != node:
        d["node"] = msg.node
    return d


class RouterClient:
    """Async requests to the router over one DEALER socket, matched by request id."""

    def __init__(self, sockets, requester: str, node: str, timeout_s: float = 5.0, hold_max_s: float = HOLD_MAX_S,
                 endpoint: str = "router"):
        # endpoint: the router's, or its shard's address (router.shards > 1: bus.endpoints.router_address)
        self.sock = sockets.connect("DEALER", endpoint, hwm=10000)
        self.requester = requester
        self.node = node
        self.timeout_s = timeout_s
        self.hold_max_s = hold_max_s
        self.batch_s = 0.0    # the router's answer to each batch sets it
        self._sent_at = -1e9  # when the last batch went out
        self._ids = itertools.count(1)
        # req id -> (reply, request frames) or, for a lease that travels in a batch, (reply, member)
        self._waiting: dict[int, tuple[asyncio.Future, object]] = {}
        self._reader: asyncio.Task | None = None
        self.orphans_released = 0
        self.router_incarnation: str | None = None
        self.resent = 0
        self._leases: list[dict] = []      # queued for the next batch
        self._releases: list[str] = []
        self._flush_at: asyncio.Handle | None = None
        self._batch_out: tuple[int, float] | None = None  # (req id, sent at) of the batch unanswered
        self._members: dict[int, list[int]] = {}          # batch req id -> its leases' req ids
        self.batches = 0
        self.batched = 0  # operations sent in batches
        self.single = False  # the router does not know lease_batch: one message per operation

    def start(self):
        self._reader = asyncio.create_task(self._read())

    def stop(self):
        if self._reader is not None:
            self._reader.cancel()
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self._releases:  # the releases of the jobs that just ended: the router frees their slots now
            self._leases = []
            if self.single:
                for lease_id in self._releases:
                    self._send_single(Release(lease_id=lease_id, req_id=next(self._ids)))
                self._releases = []
            else:
                self._flush()

    async def _read(self):
        while True:
            frames = await recv(self.sock, 1.0)
            while frames is not None:  # drain what is queued: one wake-up, many replies
                await self._on_reply(frames)
                frames = recv_now(self.sock)

    # -- batching ------------------------------------------------------------------------
    def _kick(self):
        """Flush at the end of this tick, but not sooner than ``batch_s`` after the last batch, and,
        while a batch is overdue (``BEHIND_S``), not before it is answered or ``hold_max_s`` old (a
        reply that never comes must not hold the queue)."""
        if self._flush_at is not None or not (self._leases or self._releases):
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        wait = self._sent_at + self.batch_s - now
        if self._batch_out is not None and now - self._batch_out[1] > BEHIND_S:
            # The router is behind: gather until it answers. Not sooner: waiting a round trip for
            # every reply of a quiet router would delay each lease (bench_router's refill delay).
            wait = max(wait, self._batch_out[1] + self.hold_max_s - now)
            if wait <= 0:
                self._batch_out = None
            else:  # the reply's arrival flushes sooner (_on_batch_reply)
                self._flush_at = loop.call_later(wait, self._flush)
                return
        self._flush_at = loop.call_later(wait, self._flush) if wait > 0 else loop.call_soon(self._flush)

    def _flush(self):
        self._flush_at = None
        # A member whose requester stopped waiting (cancelled, timed out) before it went out is dropped.
        leases = [m for m in self._leases if m["req_id"] in self._waiting]
        releases = self._releases
        self._leases, self._releases = [], []
        if not leases and not releases:
            return
        rid = next(self._ids)
        msg = LeaseBatch(requester=self.requester, node=self.node, leases=leases, releases=releases, req_id=rid)
        self._members[rid] = ([m["req_id"] for m in leases], releases)
        if len(self._members) > 1024:  # batches a vanished router never answered
            self._members.pop(next(iter(self._members)))
        self._sent_at = time.monotonic()
        self._batch_out = (rid, self._sent_at)
        self.batches += 1
        self.batched += len(leases) + len(releases)
        self.sock.send_multipart([b""] + codec.encode(msg.to_wire()), copy=False)

    def _resolve(self, rid, header: dict):
        fut, _ = self._waiting.pop(rid, (None, None))
        if fut is not None and not fut.done():
            fut.set_result(header)
        elif header.get("kind") == "reply" and "lease_id" in header.get("body", {}):
            # A lease granted after its requester gave up (cancelled, timed out): hand it back
            # now instead of letting it count as in flight until lease_ttl_s expires it.
            self.orphans_released += 1
            if self.single:
                self._send_single(Release(lease_id=header["body"]["lease_id"], req_id=next(self._ids)))
                return
            self._releases.append(header["body"]["lease_id"])
            self._kick()

    def _on_batch_reply(self, rid, header: dict):
        members, releases = self._members.pop(rid, ((), ()))
        if self._batch_out is not None and self._batch_out[0] == rid:
            self._batch_out = None
            if self._flush_at is not None:  # it waited for this reply: flush as batch_s allows
                self._flush_at.cancel()
                self._flush_at = None
        if header.get("kind") == "error" and header.get("code") == "unknown_kind":
            self._fall_back(members, releases)
        elif header.get("kind") == "error":  # the batch as a whole was refused: so is each member
            for m in members:
                self._resolve(m, header)
        else:
            body = header.get("body") or {}
            pace = body.get("batch_s")
            if pace.__class__ in (int, float) and 0 <= pace <= self.hold_max_s:
                self.batch_s = pace
            for g in body.get("granted") or ():
                self._resolve(g.get("req_id"), {"kind": "reply", "req_id": g.get("req_id"), "body": g})
            for e in body.get("errors") or ():
                if isinstance(e, list) and len(e) == 3:
                    self._resolve(e[0], {"kind": "error", "req_id": e[0], "code": e[1], "message": e[2]})
            # members in body["waiting"] are answered later, each on its own
        self._kick()

    def _fall_back(self, members, releases):
        """The router predates ``lease_batch``: send the batch's operations as single messages,
        and every later one too."""
        self.single = True
        for lease_id in releases:
            self._send_single(Release(lease_id=lease_id, req_id=next(self._ids)))
        for m in members:
            fut, member = self._waiting.get(m, (None, None))
            if fut is None or fut.done() or not isinstance(member, dict):
                continue
            msg = Lease(job_id=member["job_id"], requester=member.get("requester", self.requester),
                        node=member.get("node", self.node), exclude=list(member.get("exclude", ())),
                        wait_s=member["wait_s"], req_id=m)
            self._waiting[m] = (fut, self._send_single(msg))

    def _send_single(self, msg) -> list:
        frames = [b""] + codec.encode(msg.to_wire())
        self.sock.send_multipart(frames, copy=False)
        return frames

    async def _on_reply(self, frames):
        rest = frames[1:] if len(frames[0]) == 0 else frames
        try:
            header = codec.decode(rest)
        except codec.CodecError:
            return
        rid = header.get("req_id")
        if rid in self._members:
            self._on_batch_reply(rid, header)
        else:
            self._resolve(rid, header)

    async def router_seen(self, incarnation) -> int:
        """A router heartbeat or start notice. When the incarnation changed, the old router died
        with the requests it was holding (lease requests wait there up to a minute): send every
        unanswered one again. One the new router already got is granted twice; the reply that
        finds no waiter is an orphan and released (``_resolve``). Returns how many were re-sent."""
        if not incarnation or incarnation == self.router_incarnation:
            return 0
        first, self.router_incarnation = self.router_incarnation is None, incarnation
        if first:
            return 0
        self._batch_out = None  # the old router will not answer it
        self._members.clear()
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        pending = [req for fut, req in self._waiting.values() if not fut.done()]
        queued = {m["req_id"] for m in self._leases}
        for req in pending:
            if isinstance(req, dict):
                if req["req_id"] not in queued:
                    self._leases.append(req)
            else:
                await self.sock.send_multipart(req, copy=False)
        self._kick()
        self.resent += len(pending)
        return len(pending)

    async def send(self, msg):
        """A request whose reply nobody waits for. A release goes in the next batch."""
        if isinstance(msg, Release) and not self.single:
            self._releases.append(msg.lease_id)
            self._kick()
            return
        msg.req_id = next(self._ids)
        await self.sock.send_multipart([b""] + codec.encode(msg.to_wire()), copy=False)

    async def request(self, msg, timeout_s: float | None = None) -> dict:
        msg.req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        if isinstance(msg, Lease) and not self.single:
            member = lease_member(msg, self.requester, self.node)
            self._waiting[msg.req_id] = (fut, member)
            self._leases.append(member)
            self._kick()
        else:
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
