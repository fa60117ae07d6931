"""Small filesystems for the ENOSPC tests: a size-limited tmpfs (root in CI can mount one),
and a filler that takes every free byte of it."""
from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(size_kb: int, prefix: str = "rd-fs-"):
    """A fresh tmpfs of size_kb at a temporary mount point; skips with the reason where mounting
    is impossible (not root, no CAP_SYS_ADMIN, a container that forbids mount)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        msg = (f"cannot mount a size-limited tmpfs here (needs root with CAP_SYS_ADMIN): "
               f"{r.stderr.strip() or r.returncode}")
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":  # CI runs as root: there it must work
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
        d.rmdir()


class Filler:
    """Takes the free space of a filesystem, to the last byte, and gives it back on release()."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / "filler"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def fill(self) -> int:
        """Write until even one byte does not fit; returns the bytes added."""
        added = 0
        for chunk in (1 << 20, 64 << 10, 4096, 512, 1):
            buf = b"\0" * chunk
            while True:
                try:
                    n = os.write(self.fd, buf)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
                added += n
                if n < chunk:
                    break
        return added

    def release(self):
        os.close(self.fd)
        self.path.unlink()


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
