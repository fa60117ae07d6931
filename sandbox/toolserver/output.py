"""Output capture shared by the tools: a byte cap that keeps head and tail, ANSI stripping."""
from __future__ import annotations

import re
from typing import Tuple

DEFAULT_MAX_OUTPUT = 64 * 1024

# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks), charset
# selection and every other two-byte escape. Agents read text, not a terminal.
_ANSI = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"
    rb"|\x1b[()*+][A-Za-z0-9]"
    rb"|\x1b[@-Z\\-_0-?`-~]"  # Fe, Fp (ESC 7/8, = >) and Fs (ESC c: full reset) escapes
)


def strip_ansi(data: bytes) -> bytes:
    return _ANSI.sub(b"", data)


class CappedBuffer:
    """Collects bytes; beyond ``cap`` keeps the first and last halves.

    The tail matters most (errors, the final summary line), the head gives context, and
    the middle of a huge output is rarely worth the tokens.
    """

    def __init__(self, cap: int = DEFAULT_MAX_OUTPUT) -> None:
        if cap < 64:
            raise ValueError("output cap must be at least 64 bytes")
        self.cap = cap
        self.tail_cap = cap // 2
        self.head_cap = cap - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:  # amortized trim
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def getvalue(self) -> Tuple[bytes, bool]:
        if not self.truncated:
            return bytes(self.head + self.tail), False
        tail = bytes(self.tail[-self.tail_cap:])
        dropped = self.total - len(self.head) - len(tail)
        note = ("\n[... output truncated: %d bytes omitted (cap %d bytes) ...]\n" % (dropped, self.cap)).encode()
        return bytes(self.head) + note + tail, True


def finish_text(data: bytes) -> str:
    """Raw terminal bytes -> clean text: no ANSI codes, no CR before LF."""
    data = strip_ansi(data).replace(b"\r\n", b"\n")
    return data.decode("utf-8", errors="replace")
