"""The one socket helper: explicit bind/connect, bounded high-water marks, linger, CURVE.

Every socket is made here and tracked, so ``close()`` closes all of them; nothing else in
the project calls ``zmq.Context.socket``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import zmq
import zmq.asyncio

from rolloutd.bus.endpoints import Endpoints

# Small HWMs keep work from piling up in pipes, so backpressure reaches the gateway.
DEFAULT_HWM = 16
DEFAULT_LINGER_MS = 1000
MAX_MSG_BYTES = 256 << 20  # hard cap enforced by libzmq; the gateway replies "too_large" far below it

TYPES = {name: getattr(zmq, name) for name in ("PUSH", "PULL", "ROUTER", "DEALER", "PUB", "SUB", "XPUB", "XSUB", "PAIR", "REQ", "REP")}


class Closing:
    """``with X() as x:`` closes ``x`` on the way out: for the classes that own sockets."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass
class Curve:
    """CURVE keys. A binder with ``secret_key`` is a server; a connecter with
    ``server_key`` is a client. ``authorized_dir`` holds the clients' public keys."""

    public_key: bytes | None = None
    secret_key: bytes | None = None
    server_key: bytes | None = None
    authorized_dir: str | None = None
    server_secret: bytes | None = None   # only where server.key_secret is present (the head)

    @classmethod
    def from_dir(cls, keys_dir: str | os.PathLike, name: str) -> "Curve":
        """Load ``NAME.key_secret`` and ``server.key`` from a directory made by ``rolloutd keys generate``."""
        import zmq.auth

        d = Path(keys_dir)
        pub, sec = zmq.auth.load_certificate(d / f"{name}.key_secret")
        server_file = d / "server.key_secret"
        server_pub, server_sec = zmq.auth.load_certificate(server_file if server_file.exists() else d / "server.key")
        auth_dir = d / "authorized"
        return cls(public_key=pub, secret_key=sec, server_key=server_pub, server_secret=server_sec,
                   authorized_dir=str(auth_dir) if auth_dir.is_dir() else None)


class Sockets(Closing):
    def __init__(self, endpoints: Endpoints | None = None, *, asyncio: bool = True,
                 curve: Curve | None = None, linger_ms: int = DEFAULT_LINGER_MS):
        self.endpoints = endpoints
        self.ctx = zmq.asyncio.Context() if asyncio else zmq.Context()
        self.curve = curve
        self.linger_ms = linger_ms
        self._sockets: list[zmq.Socket] = []
        self._auth = None

    def _make(self, kind: str, hwm: int, identity: bytes | None) -> zmq.Socket:
        s = self.ctx.socket(TYPES[kind])
        s.setsockopt(zmq.LINGER, self.linger_ms)
        s.setsockopt(zmq.SNDHWM, hwm)
        s.setsockopt(zmq.RCVHWM, hwm)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        if kind == "ROUTER":
            s.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished peers are dropped, not raised
        self._sockets.append(s)
        return s

    def bind(self, kind: str, name_or_addr: str, *, hwm: int = DEFAULT_HWM, identity: bytes | None = None) -> zmq.Socket:
        addr = self._bind_addr(name_or_addr)
        s = self._make(kind, hwm, identity)
        if addr.startswith("tcp://") and self.curve and (self.curve.server_secret or self.curve.secret_key):
            # A server socket must hold the key pair whose public half the clients were given
            # (server.key); a daemon's own pair is its client identity.
            self._start_auth()
            s.curve_server = True
            if self.curve.server_secret:
                s.curve_secretkey = self.curve.server_secret
                s.curve_publickey = self.curve.server_key
            else:
                s.curve_secretkey = self.curve.secret_key
                s.curve_publickey = self.curve.public_key
        if addr.startswith("ipc://"):
            path = Path(addr[6:])
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if path.exists():  # left by a killed predecessor; ipc bind would otherwise steal silently
                path.unlink()
        s.bind(addr)
        return s

    def connect(self, kind: str, name_or_addr: str, *, hwm: int = DEFAULT_HWM, identity: bytes | None = None,
                subscribe: list[bytes] | None = None) -> zmq.Socket:
        addr = self._addr(name_or_addr)
        s = self._make(kind, hwm, identity)
        if addr.startswith("tcp://") and self.curve and self.curve.server_key:
            s.curve_serverkey = self.curve.server_key
            s.curve_publickey = self.curve.public_key
            s.curve_secretkey = self.curve.secret_key
        if kind == "SUB":
            for topic in subscribe if subscribe is not None else [b""]:
                s.setsockopt(zmq.SUBSCRIBE, topic)
        s.connect(addr)
        return s

    def _addr(self, name_or_addr: str) -> str:
        if "://" in name_or_addr:
            return name_or_addr
        return getattr(self.endpoints, name_or_addr)

    def _bind_addr(self, name_or_addr: str) -> str:
        if "://" in name_or_addr:
            return name_or_addr
        return self.endpoints.bind_address(name_or_addr)

    def _start_auth(self):
        if self._auth is not None:
            return
        from zmq.auth.thread import ThreadAuthenticator

        # A thread authenticator works for both sync and asyncio contexts (it runs its own zap socket).
        ctx = zmq.Context.shadow(self.ctx.underlying)  # ZAP must live in the sockets' own context
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        if self.curve.authorized_dir:
            self._auth.configure_curve(domain="*", location=self.curve.authorized_dir)
        else:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)

    def forget(self, s: zmq.Socket):
        """Close one socket now (e.g. a client reconnecting after a timeout)."""
        s.close(linger=0)
        if s in self._sockets:
            self._sockets.remove(s)

    def close(self, linger_ms: int | None = None):
        for s in self._sockets:
            if not s.closed:
                s.close(linger=self.linger_ms if linger_ms is None else linger_ms)
        self._sockets.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()


async def recv(sock: zmq.asyncio.Socket, timeout_s: float) -> list | None:
    """One multipart message or None after ``timeout_s``. Every recv has a timeout.

    One already queued is taken without Futures (a poll's and a receive's: ~8% of a phase
    daemon's CPU under load), after one turn of the loop, as an await of them would give."""
    frames = recv_now(sock)
    if frames is not None:
        await asyncio.sleep(0)
        return frames
    if await sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return recv_now(sock)  # None only if another reader of the socket took it meanwhile
    return None


_ASYNC = zmq.asyncio.Socket
# Plain ints: pyzmq converts an option given as its enum member through the enum machinery, ~1 us
# of the ~2 us an EVENTS read costs (a drain reads it once per message and once at its end).
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_FRAME_TYPES = (bytes, memoryview, zmq.Frame)


def _sync(sock):
    """The socket's own synchronous shadow (pyzmq's ``_shadow_sock``): a non-blocking operation on
    it costs ~3 us less than on the zmq.asyncio socket, which wraps even an immediate result in a
    Future (bench/bench_sockets.py). A plain socket is its own. (Checked by type: a missing
    attribute on a zmq socket is looked up as a socket option, ~2 us.)"""
    return sock._shadow_sock if isinstance(sock, _ASYNC) else sock


def recv_now(sock) -> list | None:
    """A message already queued, without waiting (to drain a socket in batches). Asks the socket
    first: an empty receive raises zmq.Again (~7 us), asking costs ~2 us, and a drain ends on an
    empty socket every time (bench/bench_head_cpu.py, docs/SCALING.md). Received on the sync shadow,
    as zmq.asyncio itself does for a non-blocking receive, minus its Future."""
    sync = _sync(sock)
    if not _events(sock, sync) & _POLLIN:
        return None
    try:
        frame = sync.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    # pyzmq's recv_multipart asks RCVMORE through the option enum per frame (~1 us); a Frame knows.
    frames = [frame]
    while frame.more:  # the rest of a multipart message is there once its first part is
        frame = sync.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def _events(sock, sync) -> int:
    """EVENTS, read on the shadow ``sync`` of ``sock``. The read consumes the edge of the fd's
    notification: a zmq.asyncio Future waiting on ``sock`` is re-armed as its own EVENTS read
    would (that read, a Python override, costs ~1 us more on every message)."""
    events = sync.getsockopt(_EVENTS)
    if sync is not sock and (sock._recv_futures or sock._send_futures):
        sock._schedule_remaining_events(events)
    return events


def send_now(sock, frames) -> bool:
    """Send without blocking; False when the peer's pipe is full (HWM) or no peer is there."""
    try:
        send_nowait(sock, frames)
        return True
    except zmq.Again:
        return False


def send_nowait(sock, frames):
    """Send without blocking; zmq errors (Again, EHOSTUNREACH of a ROUTER_MANDATORY socket) raise.
    On the sync shadow, with what zmq.asyncio does around an immediate send: while sends wait as
    Futures this one may not overtake them (Again: the caller waits in line, as a Future), and a
    receive awaited on the same socket is re-armed, since the send may have consumed the edge of
    its fd's notification."""
    if not isinstance(sock, _ASYNC):
        _send_frames(sock, frames)
        return
    if sock._send_futures:
        raise zmq.Again(zmq.EAGAIN)
    _send_frames(sock._shadow_sock, frames)
    if sock._recv_futures:
        sock._schedule_remaining_events()


def _send_frames(sync, frames):
    """``send_multipart(frames, NOBLOCK, copy=False)`` without its enum flag arithmetic
    (``SNDMORE | flags`` builds a Flag member, ~1 us per frame but the last: half its cost for a
    two-frame message, bench/bench_sockets.py). Every frame is checked before the first is sent,
    as pyzmq does: a bad one must not leave half a message in the pipe. Once the first part is
    queued the rest are too (a multipart message is atomic in libzmq)."""
    for f in frames:
        if not isinstance(f, _FRAME_TYPES):
            memoryview(f)  # TypeError for what is not a buffer, before anything is sent
    last = len(frames) - 1
    send = sync.send
    for i in range(last):
        send(frames[i], _MORE_NOBLOCK, copy=False)
    send(frames[last], _NOBLOCK, copy=False)


def writable(sock) -> bool:
    return bool(sock.getsockopt(_EVENTS) & _POLLOUT)


Again = zmq.Again
ZMQError = zmq.ZMQError
POLLIN = zmq.POLLIN
POLLOUT = zmq.POLLOUT
SUBSCRIBE = zmq.SUBSCRIBE


class InWaiter:
    """Waits until one of ``socks`` has a message (or a timeout): a daemon loop's one await.

    A zmq.asyncio ``Poller.poll`` of seven sockets costs ~145 us even when one is ready (a Future
    per socket, their callbacks, the timeout, a zmq_poll once woken): 15% of the gateway's CPU at
    the pipeline benchmark's load. So the sockets are asked first (EVENTS, ~1 us each) and a ready
    one costs a loop turn (``sleep(0)``: the daemon's other tasks still run); then a short
    blocking zmq_poll; only a wait longer than that pays for the Futures."""

    BLOCK_MS = 2  # the longest the loop's other tasks (heartbeats, signals) wait for this one

    def __init__(self, socks):
        self.pairs = [(s, _sync(s)) for s in socks]
        self.poller = zmq.asyncio.Poller()
        self.sync_poller = zmq.Poller()
        for s, sync in self.pairs:
            self.poller.register(s, zmq.POLLIN)
            self.sync_poller.register(sync, zmq.POLLIN)

    def ready(self) -> bool:
        # The first ready one answers: those not read keep their edges (the drain that follows
        # reads every socket, re-arming as it goes).
        return any(_events(s, sync) & _POLLIN for s, sync in self.pairs)

    async def wait(self, timeout_ms: int):
        if timeout_ms <= 0 or self.ready():
            await asyncio.sleep(0)
            return
        # Under load the next message is a peer's turn away: wait for it in zmq_poll (~10 us),
        # holding the event loop at most BLOCK_MS; only a longer wait pays for the Futures.
        block = min(timeout_ms, self.BLOCK_MS)
        self.sync_poller.poll(block)
        if self.ready():  # read after the poll, which consumed edges a Future may wait on
            await asyncio.sleep(0)
        elif timeout_ms > block:
            await self.poller.poll(timeout_ms - block)


def generate_keys(keys_dir: str | os.PathLike, names: list[str]) -> list[Path]:
    """Make CURVE key pairs: ``server`` plus each name; public keys of clients are copied
    into ``authorized/`` (the server accepts exactly those)."""
    import shutil

    import zmq.auth

    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    auth = d / "authorized"
    auth.mkdir(exist_ok=True)
    made = []
    for name in ["server", *names]:
        pub, sec = zmq.auth.create_certificates(d, name)
        os.chmod(sec, 0o600)
        shutil.copy(pub, auth / Path(pub).name)
        made += [Path(pub), Path(sec)]
    return made
