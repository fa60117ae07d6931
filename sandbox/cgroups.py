"""Optional cgroup v2 limits for a whole sandbox (memory.max, pids.max), where writable.

rlimits are per process (RLIMIT_AS) or per user namespace (RLIMIT_NPROC); a delegated
cgroup v2 adds a hard memory cap for the sandbox as a whole. It is only used when a
parent cgroup is writable and has the memory and pids controllers enabled for its children
(systemd: Delegate=yes, or ROLLOUTD_CGROUP_PARENT pointing at such a dir). Detection never
tries to reorganize the caller's own cgroup (the "no internal processes" rule forbids
enabling controllers in a cgroup that holds processes).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from .log import log

NEEDED = ("memory", "pids")


def cgroup2_mount() -> Optional[Path]:
    try:
        with open("/proc/self/mounts", "r") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return Path(parts[1])
    except OSError:
        pass
    return None


def own_cgroup() -> Optional[Path]:
    mount = cgroup2_mount()
    if mount is None:
        return None
    try:
        with open("/proc/self/cgroup", "r") as f:
            for line in f:
                if line.startswith("0::"):
                    return mount / line[3:].strip().lstrip("/")
    except OSError:
        pass
    return None


def _words(path: Path) -> set:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


class CgroupV2:
    def __init__(self, parent: Path) -> None:
        self.parent = Path(parent)

    @classmethod
    def detect(cls, parent: Optional[os.PathLike] = None) -> Optional["CgroupV2"]:
        """A usable parent cgroup, or None (then only rlimits apply)."""
        candidates = [Path(parent)] if parent else []
        if not candidates and os.environ.get("ROLLOUTD_CGROUP_PARENT"):
            candidates.append(Path(os.environ["ROLLOUTD_CGROUP_PARENT"]))
        if not candidates:
            own = own_cgroup()
            if own is not None:
                candidates.append(own)
        for cand in candidates:
            why = cls.unusable_reason(cand)
            if why is None:
                return cls(cand)
        return None

    @staticmethod
    def unusable_reason(parent: Path) -> Optional[str]:
        if not (parent / "cgroup.controllers").exists():
            return "not a cgroup v2 directory"
        missing = [c for c in NEEDED if c not in _words(parent / "cgroup.controllers")]
        if missing:
            return "controllers not available: %s" % ", ".join(missing)
        if not os.access(parent, os.W_OK):
            return "not writable"
        enabled = _words(parent / "cgroup.subtree_control")
        if not all(c in enabled for c in NEEDED):
            return "controllers not enabled in cgroup.subtree_control (delegate it, e.g. systemd Delegate=yes)"
        return None

    def create(self, name: str, memory_mb: Optional[int], nproc: Optional[int], owner_uid: Optional[int] = None) -> Path:
        path = self.parent / ("rolloutd-" + name)
        path.mkdir()
        if memory_mb:
            (path / "memory.max").write_text(str(int(memory_mb) * 1024 * 1024))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        if nproc:
            (path / "pids.max").write_text(str(int(nproc)))
        if owner_uid is not None:
            os.chown(path / "cgroup.procs", owner_uid, -1)
        return path

    @staticmethod
    def open_procs(path: Path) -> int:
        """An fd on cgroup.procs; writing b"0" to it moves the writing process in (used
        between fork and exec, so bwrap and all its descendants start inside)."""
        return os.open(str(path / "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

    @staticmethod
    def kill_and_remove(path: Path, timeout: float = 5.0) -> None:
        path = Path(path)
        if not path.exists():
            return
        kill_file = path / "cgroup.kill"
        try:
            if kill_file.exists():
                kill_file.write_text("1")
            else:
                for pid in _words(path / "cgroup.procs"):
                    try:
                        os.kill(int(pid), 9)
                    except (OSError, ValueError):
                        pass
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while True:
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("cgroup_not_removed", path=str(path))
                    return
                time.sleep(0.01)
