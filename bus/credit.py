"""Credit-based hand-off: work goes only to a receiver that has announced a free slot.

PUSH/PULL with small high-water marks still lets messages pile up in kernel socket
buffers (measured: a dozen jobs left the gateway with every pool at 1), so backpressure
was loose and queued jobs were invisible to heartbeats. Instead the sender binds a
ROUTER, each receiver connects a DEALER and announces ``ready(free, received)``; the
sender's credit for a receiver is ``free - (sent - received)``, exact even while messages
cross. Announcements repeat periodically, so a lost or silent receiver's credit expires.
"""
from __future__ import annotations

import time

import zmq

from rolloutd.bus import codec
from rolloutd.bus.messages import PROTOCOL_VERSION

READY = b"ready"


class Peer:
    __slots__ = ("ident", "free", "received", "sent", "seen", "info")

    def __init__(self, ident: bytes):
        self.ident = ident
        self.free = 0
        self.received = 0
        self.sent = 0
        self.seen = 0.0
        self.info: dict = {}

    @property
    def credit(self) -> int:
        return self.free - (self.sent - self.received)


class CreditSender:
    """Owns a bound ROUTER socket; ``send`` picks the receiver with the most credit."""

    def __init__(self, sock, ttl_s: float = 3.0):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished receiver raises instead of eating the job
        self.sock = sock
        self.ttl_s = ttl_s
        self.peers: dict[bytes, Peer] = {}

    def on_message(self, frames) -> bool:
        """Handle one incoming message (a receiver's announcement); False if it was garbage."""
        if len(frames) != 2:
            return False
        ident = frames[0].bytes if hasattr(frames[0], "bytes") else frames[0]
        try:
            body = codec.unpack(frames[1].bytes if hasattr(frames[1], "bytes") else frames[1])
            if body.get("v") != PROTOCOL_VERSION or body.get("kind") != "ready":
                return False
            free, received = int(body["free"]), int(body["received"])
        except (codec.CodecError, KeyError, TypeError, ValueError, AttributeError):
            return False
        p = self.peers.get(ident)
        if p is None:  # identities carry the receiver's incarnation: a restart is a new peer
            p = self.peers[ident] = Peer(ident)
            p.sent = received  # a restarted *sender* meets a receiver that counted before it: start level
        p.free, p.received, p.seen = free, max(p.received, received), time.monotonic()
        p.info = body.get("info") or {}
        return True

    def expire(self):
        now = time.monotonic()
        for ident in [i for i, p in self.peers.items() if now - p.seen > self.ttl_s]:
            del self.peers[ident]

    def credit(self) -> int:
        return sum(max(0, p.credit) for p in self.peers.values())

    def pick(self) -> Peer | None:
        best = None
        for p in self.peers.values():
            if p.credit > 0 and (best is None or p.credit > best.credit):
                best = p
        return best

    def send(self, frames: list) -> Peer | None:
        """Send to the receiver with the most credit; None when nobody has a free slot."""
        while True:
            p = self.pick()
            if p is None:
                return None
            try:
                _send_now(self.sock, [p.ident, *frames])
            except zmq.ZMQError as e:
                if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    self.peers.pop(p.ident, None)  # gone: its announcements will bring it back
                    continue
                raise
            p.sent += 1
            return p


class CreditReceiver:
    """Owns a connected DEALER socket; announces free slots, counts what it received.

    It re-announces when the sender's view (the last report minus what arrived since) falls
    ``threshold`` slots short of the truth or reaches zero while a slot is free, and at least
    every ``period_s``; so a pool of 512 does not send a message per job.
    """

    def __init__(self, sock, pool: int, period_s: float = 0.5, info: dict | None = None):
        self.sock = sock
        self.period_s = period_s
        self.threshold = max(1, pool // 8)
        self.received = 0
        self._free = None
        self._at_received = 0
        self._t = 0.0
        self.info = info or {}

    def update(self, free: int, force: bool = False):
        if self.sock.closed:  # shutting down: a job's clean-up may end after the daemon closed its sockets
            return
        now = time.monotonic()
        if self._free is not None and not force:
            seen_by_sender = self._free - (self.received - self._at_received)
            short = free - seen_by_sender
            if now - self._t < self.period_s and not (short >= self.threshold or (seen_by_sender <= 0 < free)):
                return
        msg = codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": max(0, free),
                          "received": self.received, "info": self.info})
        try:
            _send_now(self.sock, [msg])
        except zmq.Again:
            return  # not connected yet; the next update goes
        self._free, self._at_received, self._t = max(0, free), self.received, now

    def got(self):
        self.received += 1


def _send_now(sock, frames):
    """Non-blocking send on a sync or asyncio socket; errors raise here either way."""
    r = sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
    if hasattr(r, "result"):
        r.result()
