"""The credit sender's view of a receiver it forgot, and of messages that never arrive.

Real zmq sockets: ``CreditSender`` binds a ROUTER on ipc, receivers are DEALERs that announce
``ready(free, received)`` the way ``CreditReceiver`` does (raw, so a test controls exactly
when a receiver reads and what it counts). ``ttl_s`` is small so the tests wait fractions of a
second; the waits set up a state, no assert depends on how fast anything ran.
"""
from __future__ import annotations

import time

import pytest
import zmq
import zmq.utils.monitor

from rolloutd.bus import codec
from rolloutd.bus.credit import CreditSender
from rolloutd.bus.messages import PROTOCOL_VERSION

from .conftest import short_tmpdir

TTL = 0.2
IDENT = b"init@n1#4242"  # identities carry the receiver's incarnation: a reconnect keeps it


class Rig:
    def __init__(self):
        self.ctx = zmq.Context()
        self.addr = f"ipc://{short_tmpdir('rd-credit-')}/s"
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.addr)
        self.tx = CreditSender(router, ttl_s=TTL)
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.dealers: list[zmq.Socket] = []

    def dealer(self, ident: bytes = IDENT) -> zmq.Socket:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.IDENTITY, ident)
        d.connect(self.addr)
        self.dealers.append(d)
        return d

    def announce(self, d: zmq.Socket, free: int, received: int):
        """One announcement, handled by the sender before this returns."""
        d.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": free, "received": received,
                           "info": {"node": "n1"}}))
        assert self.tx.sock.poll(5000), "the announcement did not reach the sender"
        assert self.tx.on_message(self.tx.sock.recv_multipart(copy=False))

    def send_all(self, limit: int = 100) -> int:
        """Send until the sender has no credit left; how many went."""
        n = 0
        while n < limit and self.tx.send([codec.pack({"job": n})]) is not None:
            n += 1
        return n

    def drop(self, d: zmq.Socket):
        """Close a receiver without reading: what was sent to it is lost with its pipe. Returns
        once the sender's ROUTER refuses the identity (EHOSTUNREACH)."""
        d.close(linger=0)
        assert self.monitor.poll(5000), "the ROUTER did not see the receiver disconnect"
        ev = zmq.utils.monitor.recv_monitor_message(self.monitor)
        assert ev["event"] == zmq.EVENT_DISCONNECTED
        deadline = time.monotonic() + 5
        while True:  # a probe that still goes out dies with the pipe; the sender's counts never see it
            try:
                self.tx.sock.send_multipart([IDENT, b"probe"], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                assert e.errno == zmq.EHOSTUNREACH
                return
            assert time.monotonic() < deadline, "the ROUTER kept the dropped pipe"
            time.sleep(0.01)

    def reconnect(self, free: int, received: int) -> zmq.Socket:
        """The same receiver (same identity, same count) connects again and announces. The ROUTER
        removes the old pipe a moment after refusing it, and ignores a new connection that still
        finds the identity taken: such a try is closed and made again."""
        deadline = time.monotonic() + 10
        while True:
            d = self.dealer()
            d.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": free, "received": received}))
            if self.tx.sock.poll(500):
                assert self.tx.on_message(self.tx.sock.recv_multipart(copy=False))
                return d
            assert time.monotonic() < deadline, "the ROUTER never took the identity back"
            self.dealers.remove(d)
            d.close(linger=0)

    def close(self):
        for d in self.dealers:
            d.close(linger=0)
        self.tx.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.tx.sock.close(linger=0)
        self.ctx.term()


def read_all(d: zmq.Socket, quiet_ms: int = 300) -> int:
    """Read every message that arrives until none came for ``quiet_ms``."""
    n = 0
    while d.poll(quiet_ms):
        d.recv_multipart()
        n += 1
    return n


@pytest.fixture
def rig():
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def test_a_forgotten_receiver_comes_back_with_its_jobs_still_in_flight(rig):
    """(a) A receiver silent past ttl (a busy loop) is forgotten; when it announces again without
    having read its jobs yet, they still count: it gets free - in flight, not free."""
    d = rig.dealer()
    rig.announce(d, free=4, received=0)
    assert rig.tx.send([b"1"]) and rig.tx.send([b"2"]) and rig.tx.send([b"3"])  # 3 of 4 in flight
    time.sleep(TTL * 2)  # silent past ttl
    rig.tx.expire()
    assert IDENT not in rig.tx.peers
    rig.announce(d, free=4, received=0)  # back, still busy: the first announcement after a stall
    assert rig.tx.credit() == 1
    assert rig.send_all() == 1
    assert read_all(d) == 4  # its 4 free slots, not 4 + 3
    assert rig.tx.lost == 0


def test_a_peer_dropped_on_send_is_remembered_too(rig):
    """``send`` forgets a peer whose pipe is gone (EHOSTUNREACH); when the same receiver
    reconnects, what was sent before still counts until it is shown lost."""
    d = rig.dealer()
    rig.announce(d, free=6, received=0)
    assert rig.send_all(limit=4) == 4
    rig.drop(d)  # the 4 are lost with the pipe
    assert rig.tx.send([b"x"]) is None  # EHOSTUNREACH: forgotten, nothing else to send to
    assert IDENT not in rig.tx.peers
    d2 = rig.reconnect(free=6, received=0)
    assert rig.tx.credit() == 2  # 6 free - 4 it may still get (the sender cannot know yet)
    # (b) Announcements keep coming, ``received`` does not move past messages sent more than a
    # ttl before: they are lost, and the credit comes back.
    deadline = time.monotonic() + 10
    while rig.tx.credit() != 6 and time.monotonic() < deadline:
        time.sleep(TTL / 4)
        rig.announce(d2, free=6, received=0)
    assert rig.tx.credit() == 6
    assert rig.tx.lost == 4
    assert rig.send_all() == 6
    assert read_all(d2) == 6


def test_b_messages_lost_in_a_reconnect_do_not_leak_slots(rig):
    """(b) A receiver reconnects (same identity) before the sender forgot it: the messages queued to
    the old pipe are gone. Its announcements keep saying so; after ttl the sender stops counting
    them in flight, so the receiver's slots are not leaked for good."""
    d = rig.dealer()
    rig.announce(d, free=4, received=0)
    assert rig.send_all() == 4
    rig.drop(d)
    d2 = rig.reconnect(free=4, received=0)
    assert rig.tx.credit() == 0  # not yet shown lost
    deadline = time.monotonic() + 10
    while rig.tx.credit() != 4 and time.monotonic() < deadline:
        time.sleep(TTL / 4)
        rig.announce(d2, free=4, received=0)
        rig.tx.expire()  # it announces: never forgotten
    assert IDENT in rig.tx.peers
    assert rig.tx.credit() == 4
    assert rig.tx.lost == 4
    assert rig.send_all() == 4
    assert read_all(d2) == 4
    rig.announce(d2, free=4, received=4)
    assert rig.tx.credit() == 4 and rig.tx.lost == 4


def test_c_jobs_slow_to_be_read_are_never_declared_lost(rig):
    """(c) A receiver that neither reads nor announces for several ttl (blocked), then announces
    once before reading (a daemon's loop announces at its top, then drains), then reads and
    announces: nothing is lost, and it never gets more than its free slots."""
    d = rig.dealer()
    rig.announce(d, free=4, received=0)
    assert rig.send_all() == 4
    for _ in range(3):
        time.sleep(TTL * 2)
        rig.tx.expire()
    rig.announce(d, free=4, received=0)  # stale: its jobs wait unread in its socket
    assert rig.tx.credit() == 0
    assert rig.send_all() == 0
    assert read_all(d) == 4
    rig.announce(d, free=4, received=4)
    assert rig.tx.lost == 0
    assert rig.tx.credit() == 4


def test_c_a_receiver_announcing_often_while_reading_late_is_not_declared_lost(rig):
    """(c) Announcements that each follow a drain (the protocol) never show a message older than
    ttl as missing, however long the receiver was silent before: a steady stream of jobs read in
    batches loses nothing."""
    d = rig.dealer()
    rig.announce(d, free=8, received=0)
    got = 0
    for _ in range(6):
        assert rig.send_all() > 0
        time.sleep(TTL * 1.5)  # busy: longer than ttl between reads
        rig.tx.expire()
        got += read_all(d, quiet_ms=50)
        rig.announce(d, free=8, received=got)
        assert rig.tx.credit() == 8
    assert rig.tx.lost == 0


def test_c_old_announcements_read_at_once_by_a_stalled_sender_lose_nothing(rig):
    """(c) The sender's loop stalls while announcements sent before the jobs arrived wait in its
    socket (the receiver stalled too): read together, long after the jobs left, they are a span
    of one instant, not evidence that the jobs are lost."""
    d = rig.dealer()
    rig.announce(d, free=4, received=0)
    assert rig.send_all() == 4
    for _ in range(3):  # crossing the jobs: sent before any was read
        d.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": 4, "received": 0}))
    time.sleep(TTL * 3)  # the sender is stalled
    for _ in range(3):
        assert rig.tx.sock.poll(5000)
        assert rig.tx.on_message(rig.tx.sock.recv_multipart(copy=False))
    assert rig.tx.lost == 0
    assert rig.tx.credit() == 0
    assert read_all(d) == 4
    rig.announce(d, free=4, received=4)
    assert rig.tx.credit() == 4
    assert (rig.tx.lost, rig.tx.late) == (0, 0)


def test_the_memory_of_forgotten_receivers_is_bounded(rig):
    """Only receivers with something in flight are remembered, at most ``remember_max`` of them
    (the oldest go first) and for ``remember_s``; one whose memory went is a new peer again."""
    rig.tx.remember_max, rig.tx.remember_s = 2, TTL * 3
    ds = {i: rig.dealer(f"init@n{i}#1".encode()) for i in range(4)}
    for i, d in ds.items():
        rig.announce(d, free=2, received=0)
    for i in range(3):  # n0, n1, n2 get one job each, n3 none
        assert rig.tx.send([b"job"]).ident == f"init@n{i}#1".encode()
        rig.tx.peers[f"init@n{i}#1".encode()].free = 1  # so the next send goes to the next peer
    time.sleep(TTL * 2)
    rig.tx.expire()
    assert not rig.tx.peers
    assert list(rig.tx.forgotten) == [b"init@n1#1", b"init@n2#1"]  # n0 evicted, n3 had nothing in flight
    rig.announce(ds[0], free=2, received=0)
    assert rig.tx.peers[b"init@n0#1"].credit == 2  # its memory went: as a new peer
    rig.announce(ds[1], free=2, received=0)
    assert rig.tx.peers[b"init@n1#1"].credit == 1  # remembered: one still in flight
    assert list(rig.tx.forgotten) == [b"init@n2#1"]
    time.sleep(TTL * 3)
    rig.tx.expire()  # n2 past remember_s; n1 silent again, forgotten again (n0: nothing in flight)
    assert list(rig.tx.forgotten) == [b"init@n1#1"]


def test_jobs_given_up_that_turn_up_after_all_are_counted_late_and_the_credit_heals(rig):
    """A receiver that breaks the protocol (keeps announcing for long without draining) has its
    jobs given up; when it reads them after all, they show as ``late`` and its credit is its
    free slots again, not more."""
    d = rig.dealer()
    rig.announce(d, free=4, received=0)
    assert rig.send_all() == 4
    deadline = time.monotonic() + 10
    while rig.tx.lost < 4 and time.monotonic() < deadline:
        time.sleep(TTL / 4)
        rig.announce(d, free=4, received=0)
    assert rig.tx.lost == 4
    assert rig.send_all() == 4  # the sender believes them lost: 4 more go
    assert read_all(d) == 8
    rig.announce(d, free=0, received=8)  # 8 taken, no slot free
    assert rig.tx.late == 4
    assert rig.tx.credit() == 0
    rig.announce(d, free=4, received=8)
    assert rig.tx.credit() == 4


def test_a_receiver_reconnecting_while_its_old_connection_lingers_gets_the_jobs():
    """A node's tcp link breaks without a FIN (a switch dies): its DEALER reconnects with the same
    identity while the sender's ROUTER still holds the old, silent connection. Without
    ROUTER_HANDOVER the ROUTER refuses the newcomer and keeps routing to the dead link until TCP
    gives up on it (minutes); with it the new connection takes the identity at once. The broken
    link is a relay in this test that stops forwarding and keeps both its sockets open."""
    import socket
    import threading

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tx = CreditSender(router, ttl_s=5.0)
    frozen, stop = threading.Event(), threading.Event()
    lsock = socket.create_server(("127.0.0.1", 0))
    relay_port = lsock.getsockname()[1]
    held: list[socket.socket] = [lsock]

    def pump(src, dst):
        while not stop.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not frozen.is_set():
                dst.sendall(data)

    def relay():
        lsock.settimeout(10)
        a, _ = lsock.accept()
        b = socket.create_connection(("127.0.0.1", port))
        held.extend([a, b])
        for src, dst in ((a, b), (b, a)):
            threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    dealers = []

    def dealer(addr):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.IDENTITY, IDENT)
        d.connect(addr)
        dealers.append(d)
        return d

    def announce(d, free, received):
        d.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": free, "received": received,
                           "info": {"node": "n1"}}))
        if not router.poll(3000):
            return False
        return tx.on_message(router.recv_multipart(copy=False))

    try:
        old = dealer(f"tcp://127.0.0.1:{relay_port}")
        assert announce(old, 4, 0)
        assert tx.send([b"job-1"]) is not None and old.poll(3000) and old.recv_multipart()[-1] == b"job-1"
        frozen.set()  # the link goes silent; the relay's connection to the ROUTER stays open
        old.close(0)
        new = dealer(f"tcp://127.0.0.1:{port}")  # the same receiver, back on a working path
        assert announce(new, 4, 1), "the ROUTER refused a receiver reconnecting under its own identity"
        assert tx.send([b"job-2"]) is not None
        assert new.poll(3000), "the job went to the dead connection"
        assert new.recv_multipart()[-1] == b"job-2"
    finally:
        stop.set()
        for s in held:
            s.close()
        for d in dealers:
            d.close(0)
        router.close(0)
        ctx.term()
