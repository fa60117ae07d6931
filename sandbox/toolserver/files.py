"""Opening a file the agent may have replaced: only a regular file, never blocking.

A FIFO left where a file is expected blocks open() for ever (no writer, or no reader when opened
for writing) or feeds the reader without end; a device (/dev/zero) never ends. Stdlib only."""
from __future__ import annotations

import errno
import os
import stat

from .errors import ToolError

_FLAGS = os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


class NotRegular(ToolError):
    """The path is a FIFO, a device, a socket or a directory."""


def open_regular(path: str, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags) for a regular file only (O_NONBLOCK: no effect on regular files)."""
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except OSError as e:
        if e.errno == errno.ENXIO:  # opened for writing: a FIFO with no reader
            raise NotRegular("%s is not a regular file (a FIFO); use bash" % path) from None
        if e.errno == errno.EISDIR:
            raise NotRegular("%s is a directory" % path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise NotRegular("%s is a directory" % path)
        raise NotRegular("%s is not a regular file (a FIFO, a device or a socket); use bash" % path)
    return fd
