"""Credit-based hand-off: work goes only to a receiver that has announced a free slot.

PUSH/PULL with small high-water marks still lets messages pile up in kernel socket
buffers (measured: a dozen jobs left the gateway with every pool at 1), so backpressure
was loose and queued jobs were invisible to heartbeats. Instead the sender binds a
ROUTER, each receiver connects a DEALER and announces ``ready(free, received)``; the
sender's credit for a receiver is ``free - (sent - received)``, exact even while messages
cross. Announcements repeat periodically, so a lost or silent receiver's credit expires.

A receiver the sender forgets (silent past ``ttl_s``, or its pipe refused a send) keeps its
in-flight count for a while (``remember_s``): when the same identity announces again, what
was sent to it and not yet counted still counts, so it is not sent more than its free slots.
Messages really lost (queued to a pipe that dropped) would then hold its slots for good, so
the sender reconciles: a message its announcements have failed to count for ``ttl_s``, from
one read when it was already ``ttl_s`` old, is given up (``CreditSender.lost``);
``CreditSender._reconcile`` says why a message merely slow to be read never is.
"""
from __future__ import annotations

import time
from collections import deque

import zmq

from rolloutd.bus import codec
from rolloutd.bus.messages import PROTOCOL_VERSION
from rolloutd.bus.sockets import send_nowait

READY = b"ready"


class Peer:
    """The sender's view of one receiver. ``sent`` counts what was sent to it, less what was
    given up as lost; ``times`` holds the send times of the messages it has not counted yet,
    oldest first: ``len(times) == sent - received`` always."""
    __slots__ = ("ident", "free", "received", "sent", "seen", "info", "times", "suspect", "forgot")

    def __init__(self, ident: bytes):
        self.ident = ident
        self.free = 0
        self.received = 0
        self.sent = 0
        self.seen = 0.0  # when its last announcement was read
        self.info: dict = {}
        self.times: deque = deque()
        self.suspect = 0.0  # when announcements began to miss a message older than ttl_s
        self.forgot = 0.0

    @property
    def credit(self) -> int:
        return self.free - (self.sent - self.received)


class CreditSender:
    """Owns a bound ROUTER socket; ``send`` picks the receiver with the most credit.

    ``lost`` counts messages given up as lost (sent, never counted by their live receiver);
    ``late`` counts messages a receiver counted beyond what the sender had in flight for it:
    given up too early, or sent before its memory went (``remember_s``, ``remember_max``); the
    receiver was sent that many more than its free slots, once. A daemon may report both;
    nothing is logged here.
    """

    def __init__(self, sock, ttl_s: float = 3.0, remember_s: float = 600.0, remember_max: int = 16384):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished receiver raises instead of eating the job
        # A receiver reconnecting under its identity (a tcp link that broke without a FIN) takes it
        # over from the old, silent connection, which would otherwise keep it, and the jobs, until
        # TCP gives up on it. What was queued on the old one is lost: the lost-job rule above.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock = sock
        self.ttl_s = ttl_s
        self.peers: dict[bytes, Peer] = {}
        # Forgotten peers that still had messages in flight, oldest first, kept for remember_s
        # and at most remember_max of them (only peers with something in flight are kept).
        self.forgotten: dict[bytes, Peer] = {}
        self.remember_s = remember_s
        self.remember_max = remember_max
        self.lost = 0
        self.late = 0

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
        if p is None:
            p = self.forgotten.pop(ident, None)  # the same receiver back: its in-flight still counts
            if p is None:  # identities carry the receiver's incarnation: a restart is a new peer
                p = Peer(ident)
                p.sent = p.received = received  # a restarted *sender* meets a receiver that counted before it
            self.peers[ident] = p
        now = time.monotonic()
        self._reconcile(p, received, now)
        p.free, p.seen = free, now
        p.info = body.get("info") or {}
        return True

    def _reconcile(self, p: Peer, received: int, now: float):
        """Take the receiver's count, then give up messages it should have counted long ago.

        A message is lost when the receiver's announcements, read without a gap over ``ttl_s``
        between two of them, have failed to count it for ``ttl_s``, starting from one read when
        it was already ``ttl_s`` old. Why a message merely slow to be read never qualifies:
        a live receiver drains its socket and then announces, at least every ``period_s``
        (0.5 s), so a message that reached it is in its count within ``period_s`` of arriving
        (transit is milliseconds for jobs of usual size; ``ttl_s`` covers both with room). One announcement short of
        an old message proves nothing: a receiver's loop that stalled announces first and
        drains after, so its first announcement after the stall misses what waited (that one
        starts the span, or restarts it after a gap: a silent receiver is a stalled one), and
        the next, after the drain, counts it. A stalled *sender* reads a batch of old
        announcements at once: a span of microseconds. A blocked receiver announces nothing and
        so loses nothing. Which uncounted messages were lost cannot be told (the count is a
        count, and what a new pipe delivered after the loss counts too), but lost ones are older
        than those sent since: the messages sent before the span's start minus ``ttl_s`` are
        dropped from the in-flight count, the newer ones stay. Counted after all (the bound
        was wrong for them), they show as ``late`` and the count is taken as it is.
        """
        t = p.times
        n = received - p.received
        if n > 0:
            p.received = received
            if n >= len(t):  # everything in flight counted, and more: given up too early
                self.late += n - len(t)
                t.clear()
                p.sent = received
            else:
                for _ in range(n):
                    t.popleft()
        if not t or t[0] > now - self.ttl_s:  # nothing it should have counted by now
            p.suspect = 0.0
        elif not p.suspect or now - p.seen > self.ttl_s:  # a span starts (again, after a silence)
            p.suspect = now
        elif now - p.suspect >= self.ttl_s:
            cut, n = p.suspect - self.ttl_s, 0
            while t and t[0] <= cut:
                t.popleft()
                n += 1
            p.sent -= n
            self.lost += n
            p.suspect = now if t and t[0] <= now - self.ttl_s else 0.0

    def expire(self):
        now = time.monotonic()
        for ident in [i for i, p in self.peers.items() if now - p.seen > self.ttl_s]:
            self._forget(self.peers.pop(ident), now)
        f = self.forgotten
        while f:
            oldest = next(iter(f.values()))
            if len(f) <= self.remember_max and now - oldest.forgot <= self.remember_s:
                break
            del f[oldest.ident]

    def _forget(self, p: Peer, now: float):
        if p.times:  # nothing in flight: a new Peer at its next announcement is the same
            p.forgot = now
            self.forgotten.pop(p.ident, None)
            self.forgotten[p.ident] = p

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
                send_nowait(self.sock, [p.ident, *frames])
            except zmq.ZMQError as e:
                if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    # Gone (or its pipe full): its announcements will bring it back, with what
                    # was sent to it before still in flight.
                    self._forget(self.peers.pop(p.ident), time.monotonic())
                    continue
                raise
            p.sent += 1
            p.times.append(time.monotonic())
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
            send_nowait(self.sock, [msg])
        except zmq.Again:
            return  # not connected yet; the next update goes
        self._free, self._at_received, self._t = max(0, free), self.received, now

    def got(self):
        self.received += 1
