"""Clients of the in-sandbox tool server (sync and asyncio) and the ToolResult they return.

One request is in flight per connection; each client keeps a small pool so concurrent
calls (a ping while bash runs) get their own connection. Closing a connection while its
call runs makes the server interrupt that call: that is how cancellation travels.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import DiskQuotaExceeded, ToolTransportError
from .log import log
from .toolserver.toollog import clip
from .toolserver.wire import HEADER, FrameError, check_length, decode_body, encode, recv_frame

# Tools whose calls carry a timeout that the server enforces itself.
_TIMED_TOOLS = ("bash", "python")
# Calls that need no purge before them (grade purges itself).
_NO_PURGE = ("ping", "purge", "grade")
PURGE_TIMEOUT = 60.0


def _purged(r: "ToolResult", socket_path: str) -> None:
    if r.error:
        raise ToolTransportError("tool server at %s could not clear the sandbox: %s" % (socket_path, clip(str(r.error))))


@dataclass
class ToolResult:
    output: str = ""
    exit_code: Optional[int] = None
    duration: float = 0.0
    timed_out: bool = False
    error: Optional[str] = None
    truncated: bool = False
    info: Dict[str, Any] = field(default_factory=dict)  # extra fields (e.g. ping details)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0

    @classmethod
    def from_wire(cls, d: Dict[str, Any]) -> "ToolResult":
        known = {"output", "exit_code", "duration", "timed_out", "error", "truncated", "id", "info"}
        info = dict(d.get("info") or {})
        info.update({k: v for k, v in d.items() if k not in known})
        return cls(
            output=str(d.get("output") or ""), exit_code=d.get("exit_code"),
            duration=float(d.get("duration") or 0.0), timed_out=bool(d.get("timed_out")),
            error=d.get("error"), truncated=bool(d.get("truncated")), info=info,
        )


class _Base:
    def __init__(self, socket_path: str, timeout: float = 60.0, connect_timeout: float = 5.0,
                 grace: float = 10.0, purge_first: bool = False) -> None:
        """timeout: default per-call tool timeout (sent to the server when the call has none);
        grace: extra time the client waits beyond it, for the server's interrupt escalation;
        purge_first: before this client's first tool call, kill every process in the sandbox
        (the ``purge`` tool; what JobContext.tools() does in eval)."""
        self.purge_pending = bool(purge_first)
        self.socket_path = str(socket_path)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.grace = float(grace)
        self._ids = itertools.count(1)

    def _prepare(self, tool: str, args: Optional[Dict[str, Any]], timeout: Optional[float]):
        args = dict(args or {})
        call_timeout = timeout if timeout is not None else args.get("timeout")
        if call_timeout is None:
            call_timeout = self.timeout
        if tool in _TIMED_TOOLS and "timeout" not in args:
            args["timeout"] = call_timeout
        try:
            wait = float(call_timeout) + self.grace
        except (TypeError, ValueError):
            wait = self.timeout + self.grace  # the server will reject the bad value
        req = {"id": next(self._ids), "tool": tool, "args": args}
        return encode(req), wait


class ToolClient(_Base):
    """Blocking client; thread-safe."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._idle: List[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.connect_timeout)
        try:
            s.connect(self.socket_path)
        except OSError as e:
            s.close()
            raise ToolTransportError("tool server at %s is not reachable: %s" % (self.socket_path, e)) from e
        return s

    def call(self, tool: str, args: Optional[Dict[str, Any]] = None, timeout: Optional[float] = None) -> ToolResult:
        try:
            if self.purge_pending and tool not in _NO_PURGE:
                _purged(self._call("purge", {}, PURGE_TIMEOUT), self.socket_path)
                self.purge_pending = False
            return self._call(tool, args, timeout)
        except ToolTransportError as e:
            raise _why_gone(self.socket_path, e) from e

    def _call(self, tool: str, args: Optional[Dict[str, Any]], timeout: Optional[float]) -> ToolResult:
        frame, wait = self._prepare(tool, args, timeout)
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._connect()
        deadline = time.monotonic() + wait
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frame)
            resp = _recv_with_deadline(sock, deadline)
        except socket.timeout:
            sock.close()  # the server sees EOF and interrupts the call
            raise ToolTransportError("tool server at %s did not answer %s within %.1fs" % (self.socket_path, tool, wait)) from None
        except (OSError, FrameError) as e:
            sock.close()
            raise ToolTransportError("tool server at %s failed during %s: %s" % (self.socket_path, tool, e)) from e
        except BaseException:
            sock.close()  # e.g. KeyboardInterrupt: do not leave the command running
            raise
        if resp is None:
            sock.close()
            raise ToolTransportError("tool server at %s closed the connection during %s" % (self.socket_path, tool))
        with self._lock:
            self._idle.append(sock)
        return _logged(tool, ToolResult.from_wire(resp), self.socket_path)

    def ping(self, timeout: float = 5.0) -> ToolResult:
        return self.call("ping", {}, timeout=timeout)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def __enter__(self) -> "ToolClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _why_gone(socket_path: str, e: ToolTransportError) -> ToolTransportError:
    """A sandbox the node stopped for its disk quota says so in its state.json (next to run/,
    where the socket lives): the caller gets DiskQuotaExceeded instead of a bare transport error."""
    if isinstance(e, DiskQuotaExceeded):
        return e
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(socket_path)), "state.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return e
    if not isinstance(state, dict) or state.get("status") != "disk_quota_exceeded":
        return e
    return DiskQuotaExceeded("sandbox %s was stopped: its workspace held %d bytes, over its disk quota of %s MB"
                             % (state.get("sandbox_id"), int(state.get("disk_used_bytes") or 0), state.get("disk_mb")))


def _logged(tool: str, r: ToolResult, socket_path: str) -> ToolResult:
    if r.timed_out:
        log.info("tool_call_timed_out", tool=tool, duration_ms=round(r.duration * 1000, 1), socket=socket_path)
    return r


def _recv_with_deadline(sock: socket.socket, deadline: float) -> Optional[Dict[str, Any]]:
    # recv_frame honours the socket timeout per recv(); re-arm it to the overall deadline.
    class _Deadline:
        def recv(self, n: int) -> bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(remaining)
            return sock.recv(n)

    return recv_frame(_Deadline())  # type: ignore[arg-type]


class AsyncToolClient(_Base):
    """asyncio client. Cancelling the task awaiting call() interrupts the command."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._idle: List[tuple] = []

    async def _connect(self):
        try:
            return await asyncio.wait_for(asyncio.open_unix_connection(self.socket_path), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise ToolTransportError("tool server at %s is not reachable: %r" % (self.socket_path, e)) from e

    async def call(self, tool: str, args: Optional[Dict[str, Any]] = None, timeout: Optional[float] = None) -> ToolResult:
        try:
            if self.purge_pending and tool not in _NO_PURGE:
                _purged(await self._call("purge", {}, PURGE_TIMEOUT), self.socket_path)
                self.purge_pending = False
            return await self._call(tool, args, timeout)
        except ToolTransportError as e:
            raise _why_gone(self.socket_path, e) from e

    async def _call(self, tool: str, args: Optional[Dict[str, Any]], timeout: Optional[float]) -> ToolResult:
        frame, wait = self._prepare(tool, args, timeout)
        conn = self._idle.pop() if self._idle else await self._connect()
        reader, writer = conn
        try:
            resp = await asyncio.wait_for(self._roundtrip(reader, writer, frame), wait)
        except asyncio.CancelledError:
            writer.transport.abort()  # EOF at the server: it interrupts the running command
            log.info("tool_call_cancelled", tool=tool, socket=self.socket_path)
            raise
        except asyncio.TimeoutError:
            writer.transport.abort()
            raise ToolTransportError("tool server at %s did not answer %s within %.1fs" % (self.socket_path, tool, wait)) from None
        except (OSError, FrameError, asyncio.IncompleteReadError) as e:
            writer.transport.abort()
            raise ToolTransportError("tool server at %s failed during %s: %r" % (self.socket_path, tool, e)) from e
        self._idle.append(conn)
        return _logged(tool, ToolResult.from_wire(resp), self.socket_path)

    @staticmethod
    async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes) -> Dict[str, Any]:
        writer.write(frame)
        await writer.drain()
        head = await reader.readexactly(HEADER.size)
        (n,) = HEADER.unpack(head)
        body = await reader.readexactly(check_length(n))
        return decode_body(body)

    async def ping(self, timeout: float = 5.0) -> ToolResult:
        return await self.call("ping", {}, timeout=timeout)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def __aenter__(self) -> "AsyncToolClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
