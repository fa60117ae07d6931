"""The tool server's log: JSON lines on its stderr, which is the sandbox's host-side log file.

The host opens that file and hands it to the sandbox (bwrap's stdout/stderr), so whatever the
tool server writes there lands on the host's disk. It is capped: each line at ``max_line``
bytes, the whole log at ``max_bytes``. A line over the cap is cut and says so; once the total is
reached one last ``log_capped`` line is written and everything after is dropped (counted). The cap
sits on ``sys.stderr`` itself, so tracebacks Python prints there (an uncaught exception in a
thread) are capped too. Stdlib only (see __init__.py).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

MAX_LINE = 16 * 1024
MAX_BYTES = 8 * 1024 * 1024
MAX_FIELD = 4096  # characters of one field's text before the line is even built


class CappedStream:
    """A text stream over a file descriptor that never writes more than ``max_bytes`` in all
    nor a line longer than ``max_line`` bytes (newline included)."""

    encoding, errors = "utf-8", "replace"  # what code that inspects sys.stderr may read

    def __init__(self, fd: int, max_bytes: int = MAX_BYTES, max_line: int = MAX_LINE) -> None:
        if max_line < 256 or max_bytes < 4 * max_line:
            raise ValueError("log caps too small: max_line >= 256, max_bytes >= 4 * max_line")
        self.fd = fd
        self.max_bytes, self.max_line = max_bytes, max_line
        self.written = 0
        self.dropped = 0  # bytes not written once the total cap was reached
        self.capped = False
        self._line = 0  # bytes of the current (unterminated) line written so far
        self._cut = False  # the current line was cut: drop up to its newline
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            for piece in data.splitlines(keepends=True):
                self._piece(piece)
        return len(text)

    def _piece(self, piece: bytes) -> None:
        ends = piece.endswith(b"\n")
        if self.capped:
            self.dropped += len(piece)
            return
        if self._cut:
            self.dropped += len(piece)
            if ends:
                self._cut, self._line = False, 0
            return
        room = self.max_line - 1 - self._line  # keep one byte for the newline
        if len(piece) - ends > room:
            note = (" [log line cut at %d bytes]\n" % self.max_line).encode()
            keep = max(0, room - len(note) + 1)
            self.dropped += len(piece) - keep
            self._emit(piece[:keep] + note)
            self._line, self._cut = 0, not ends
            return
        self._emit(piece)
        self._line = 0 if ends else self._line + len(piece)

    def _emit(self, data: bytes) -> None:
        reserve = 256  # room for the closing log_capped line
        if self.written + len(data) > self.max_bytes - reserve:
            self.capped = True
            self.dropped += len(data)
            end = json.dumps({"event": "log_capped", "ts": round(time.time(), 3), "pid": os.getpid(),
                              "max_bytes": self.max_bytes, "note": "the tool server's log reached its cap; "
                              "later lines are dropped"})
            self._raw(("\n" if self._line else "") + end + "\n")
            return
        self._raw_bytes(data)

    def _raw(self, text: str) -> None:
        self._raw_bytes(text.encode())

    def _raw_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            pass
        self.written += len(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.fd


_stream: Any = None


def install(max_bytes: int = MAX_BYTES, max_line: int = MAX_LINE) -> CappedStream:
    """Put the cap on fd 2 (sys.stderr): every later write of this process goes through it."""
    global _stream
    _stream = CappedStream(2, max_bytes, max_line)
    sys.stderr = _stream  # type: ignore[assignment]
    return _stream


def clip(text: str, limit: int = MAX_FIELD) -> str:
    """text, or its head and tail with how much was cut between them."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return "%s...[%d characters cut]...%s" % (text[:half], len(text) - 2 * half, text[-half:])


def _short(value: Any) -> Any:
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str)
        return value if len(text) <= MAX_FIELD else clip(text)
    return clip(value if isinstance(value, str) else str(value))


def log(event: str, **fields: Any) -> None:
    """One JSON line: the event, its fields (each cut to MAX_FIELD characters), ts and pid."""
    fields = {k: _short(v) for k, v in fields.items()}
    fields.update(event=event, ts=round(time.time(), 3), pid=os.getpid())
    try:
        line = json.dumps(fields, default=str) + "\n"
        (_stream or sys.stderr).write(line)
        sys.stderr.flush()
    except Exception:
        pass
