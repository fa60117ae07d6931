"""Cancellation of a running tool call: the client closing its connection means "stop"."""
from __future__ import annotations

import select
import socket
from typing import List, Optional


class Canceller:
    """Watches the caller's connection while a tool runs.

    The wire allows one request in flight per connection, so the only thing the client
    can do mid-call is go away (AsyncToolClient does this when its task is cancelled,
    ToolClient when its own deadline passes). EOF on the socket therefore means cancel.
    """

    def __init__(self, sock: Optional[socket.socket]) -> None:
        self.sock = sock
        self.cancelled = False
        self._watch = sock is not None

    def fds(self) -> List[int]:
        if not self._watch or self.sock is None:
            return []
        try:
            return [self.sock.fileno()]
        except OSError:
            return []

    def poll(self) -> bool:
        """Call when the socket is readable; True if the peer is gone."""
        if self.sock is None or not self._watch:
            return self.cancelled
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.cancelled = True
            return True
        if not data:
            self.cancelled = True
            return True
        # A pipelined request is not a cancel; stop watching so select() does not spin.
        self._watch = False
        return False

    def gone(self) -> bool:
        """Without blocking: has the client gone away (a call queued behind another must not
        start once its client gave up)?"""
        fds = self.fds()
        if not fds:
            return self.cancelled
        try:
            r, _, _ = select.select(fds, [], [], 0)
        except (OSError, ValueError):
            self.cancelled = True
            return True
        return bool(r) and self.poll()


NEVER = Canceller(None)
