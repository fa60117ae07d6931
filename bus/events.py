"""The events stream: every daemon PUBlishes to an XSUB/XPUB proxy; monitors SUBscribe.

A frame set is ``[topic, msgpack body]``. Topics are dotted names (``job.phase``,
``daemon.heartbeat``); subscribers filter by prefix. A heartbeat's topic frame also names its
sender (``daemon.heartbeat/run@n7/``) so a daemon can subscribe to the few it needs; readers
(``parse``, ``Subscriber``, ``base_topic``) see the dotted name alone. PUB drops messages for a
slow subscriber instead of blocking, so monitoring never slows the pipeline.
"""
from __future__ import annotations

import os
import struct
import threading
import time

import numpy as np
import zmq

from rolloutd.bus import codec
from rolloutd.bus.sockets import Closing, Sockets, send_now

EVENTS_HWM = 10000

# A heartbeat's topic frame is ``daemon.heartbeat/<daemon>@<node>/``: XPUB filters by prefix, so
# without the sender every run and init daemon received every heartbeat of the cluster (15 GB/s
# at 1,000 nodes, docs/SCALING.md). The closing "/" keeps node n7's prefix from matching n70;
# names may therefore hold no "/" (nor a daemon name "@"), checked here and in Config.
HEARTBEAT = "daemon.heartbeat"
SENDER_SEP = "/"


def heartbeat_topic(daemon: str, node: str | None = None) -> str:
    """The heartbeat topic of ``daemon`` on ``node``, which is also the subscription for exactly
    that daemon; without ``node``, the subscription for that daemon on every node. ValueError for a
    name that would break prefix matching."""
    if not daemon or SENDER_SEP in daemon or "@" in daemon:
        raise ValueError(f"daemon name {daemon!r} cannot name a heartbeat topic (empty, or holds '/' or '@')")
    if node is None:
        return f"{HEARTBEAT}{SENDER_SEP}{daemon}@"
    if not node or SENDER_SEP in node:
        raise ValueError(f"node name {node!r} cannot name a heartbeat topic (empty, or holds '/')")
    return f"{HEARTBEAT}{SENDER_SEP}{daemon}@{node}{SENDER_SEP}"


def base_topic(frame: bytes | str) -> str:
    """The dotted topic of a topic frame, without a sender suffix: what every reader compares."""
    topic = frame if isinstance(frame, str) else bytes(frame).decode()
    return topic.partition(SENDER_SEP)[0]


class Publisher:
    """Publishes events stamped with the daemon, node and pid."""

    def __init__(self, sockets: Sockets, daemon: str, node: str):
        # Before the socket: a name that cannot make a heartbeat topic fails the daemon's start.
        self.topics = {HEARTBEAT: heartbeat_topic(daemon, node).encode()}  # topics sent with the sender
        self.sock = sockets.connect("PUB", "events_in", hwm=EVENTS_HWM)
        self.base = {"daemon": daemon, "node": node, "pid": os.getpid()}

    def publish(self, topic: str, **fields):
        body = dict(self.base, ts=time.time(), **fields)
        # The stream full: dropped, never blocking the pipeline.
        send_now(self.sock, [self.topics.get(topic) or topic.encode(), codec.pack(body)])


# A listing (``jobs``, ``jobs_added``, ``jobs_removed``) is either a list of [id, attempt] pairs or,
# from holders with more than PACK_MIN jobs, those pairs packed as little-endian int64 (a msgpack
# bin of 16 bytes per pair): one frame either way, and the receiver checks its length instead of
# walking 576 Python lists (docs/EVENTS.md, docs/SCALING.md).
PAIR_BYTES = 16
PACK_MIN = 16
_PAIR = np.dtype("<i8")
_UNPACK_PAIRS = struct.Struct("<qq").iter_unpack


def pack_listing(held: dict) -> list | bytes:
    """``held`` (job id -> attempt) as a heartbeat listing: packed when it has more than PACK_MIN jobs."""
    if len(held) <= PACK_MIN:
        return [[j, a] for j, a in held.items()]
    a = np.empty((len(held), 2), dtype=_PAIR)
    a[:, 0] = list(held.keys())
    a[:, 1] = list(held.values())
    return a.tobytes()


def unpack_listing(raw: bytes) -> list:
    """A packed listing's [id, attempt] pairs (tuples), as a list. ValueError when it is not whole pairs."""
    if len(raw) % PAIR_BYTES:
        raise ValueError(f"a packed listing of {len(raw)} bytes is not whole [id, attempt] int64 pairs")
    # struct's tuples directly: 2.1 vs 3.9 us for 36 pairs through numpy's two tolist() and a zip
    # (30 vs 37 at 576), and most listings the gateway reads are init's and eval's few dozen.
    return list(_UNPACK_PAIRS(raw))


def parse(frames) -> tuple[str, dict] | None:
    """``(topic, body)`` of an event, or None when it is not one of ours (garbage on the
    stream must never reach the job table). Packed listings come back as lists of pairs."""
    if len(frames) != 2:
        return None
    try:
        topic = base_topic(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
        body = codec.unpack(frames[1].bytes if hasattr(frames[1], "bytes") else frames[1])
    except (UnicodeDecodeError, codec.CodecError):
        return None
    body = checked_body(body)
    return None if body is None else (topic, body)


def checked_body(body) -> dict | None:
    """An event's decoded body, checked as ``parse`` checks it (its sender named; listings whole
    pairs, packed ones unpacked; changes only with their ``jobs_seq``), or None."""
    if not isinstance(body, dict) or not isinstance(body.get("daemon"), str) or not isinstance(body.get("node"), str):
        return None
    for key in ("jobs", "jobs_added", "jobs_removed"):
        jobs = body.get(key)
        if jobs is None:
            continue
        if isinstance(jobs, bytes):  # packed: validated by its length alone, decoded at C speed
            if len(jobs) % PAIR_BYTES:
                return None
            body[key] = unpack_listing(jobs)
        elif not (isinstance(jobs, list) and all(
                isinstance(j, list) and len(j) == 2 and all(isinstance(x, int) for x in j) for j in jobs)):
            return None
    seq = body.get("jobs_seq")
    if seq is not None and not isinstance(seq, int):
        return None
    if ("jobs_added" in body or "jobs_removed" in body) and (seq is None or "jobs" in body):
        return None  # changes mean nothing without their place in the sequence, or beside a full listing
    return body


def _pairs(listing) -> list:
    """A listing as pairs, packed or not (bodies unpacked without ``parse``: the init daemon's)."""
    return unpack_listing(listing) if isinstance(listing, bytes) else listing


class HeldJobs:
    """One holder's jobs as its heartbeats describe them (docs/PROTOCOL.md, heartbeat listings).

    A heartbeat with ``jobs`` is a full listing and replaces the set; one with ``jobs_added`` /
    ``jobs_removed`` changes it when its ``jobs_seq`` follows the previous heartbeat's. After a gap
    (a heartbeat dropped on the stream) the set is stale (``valid`` False) until the next full
    listing; its last known content stays readable. ``full_at`` and ``relist_asked`` are a
    reader's clock readings: when the last full listing arrived, when it last asked the holder for
    one (``control.relist``)."""

    __slots__ = ("incarnation", "seq", "jobs", "valid", "full_at", "relist_asked")

    def __init__(self, incarnation=None):
        self.incarnation = incarnation
        self.seq = None
        self.jobs: dict[int, int] = {}  # job id -> attempt
        self.valid = False
        self.full_at = float("-inf")
        self.relist_asked = float("-inf")

    @staticmethod
    def lists(body: dict) -> bool:
        """Whether this heartbeat comes from a job holder (carries a listing or changes)."""
        return "jobs" in body or "jobs_added" in body or "jobs_removed" in body

    def apply(self, body: dict) -> list | None:
        """Take one heartbeat; returns the [id, attempt] pairs it shows held now and newly or
        again (the whole listing, or what was added), or None when it could not be applied."""
        seq = body.get("jobs_seq")
        if "jobs" in body:
            jobs = _pairs(body["jobs"])
            self.jobs = dict(jobs)
            self.seq, self.valid = seq, True
            return jobs
        if not self.valid or seq is None or self.seq is None or seq != self.seq + 1:
            self.valid = False
            return None
        for j, a in _pairs(body.get("jobs_removed", ())):
            if self.jobs.get(j) == a:
                del self.jobs[j]
        added = _pairs(body.get("jobs_added", ()))
        for j, a in added:
            self.jobs[j] = a
        self.seq = seq
        return added


class Subscriber(Closing):
    """Sync subscriber for monitors and tests."""

    def __init__(self, address: str, topics: list[str] | None = None, curve=None):
        self.sockets = Sockets(asyncio=False, curve=curve, linger_ms=0)
        self.sock = self.sockets.connect("SUB", address, hwm=EVENTS_HWM,
                                         subscribe=[t.encode() for t in (topics or [""])])

    def next(self, timeout_s: float) -> tuple[str, dict] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        topic, body = self.sock.recv_multipart()
        return base_topic(topic), codec.unpack(body)

    def close(self):
        self.sockets.close()


class Proxy:
    """XSUB (events_in) <-> XPUB (events_out), forwarded by libzmq's own proxy in a thread.

    ``sockets`` must be a sync ``Sockets`` (``asyncio=False``): libzmq forwards at C speed.
    """

    def __init__(self, sockets: Sockets):
        self.front = sockets.bind("XSUB", "events_in", hwm=EVENTS_HWM)
        self.back = sockets.bind("XPUB", "events_out", hwm=EVENTS_HWM)
        self.ctrl_addr = f"inproc://events-proxy-{id(self)}"
        self.ctrl = sockets.bind("PAIR", self.ctrl_addr)
        self._peer = sockets.connect("PAIR", self.ctrl_addr)
        self.thread = threading.Thread(target=self._run, name="events-proxy", daemon=True)

    def _run(self):
        try:
            zmq.proxy_steerable(self.front, self.back, None, self._peer)
        except zmq.ZMQError:
            pass

    def start(self):
        self.thread.start()

    def stop(self, timeout_s: float = 2.0):
        self.ctrl.send(b"TERMINATE")
        self.thread.join(timeout_s)
