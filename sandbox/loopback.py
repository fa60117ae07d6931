"""Unique 127.x.y.z addresses per sandbox, safe across threads and processes on one node
(slots.SlotAllocator: a JSON file under an flock).

Each entry records the sandbox dir and a pid (with its start time, to survive pid reuse).
An entry is stale when the dir is gone or that process is no longer running. Addresses are
handed out round-robin so a just-released address (whose sockets may sit in TIME_WAIT) is not
reused at once.
"""
from __future__ import annotations

import ipaddress
import os
import time
from typing import Dict, Optional

from .procs import is_running, start_time
from .slots import SlotAllocator


class LoopbackExhausted(RuntimeError):
    pass


class LoopbackAllocator(SlotAllocator):
    name, what, exhausted = "loopback", "addresses", LoopbackExhausted

    def __init__(self, state_dir: os.PathLike, first: str = "127.1.0.1", last: str = "127.254.255.254") -> None:
        lo = ipaddress.IPv4Network("127.0.0.0/8")
        a, b = ipaddress.IPv4Address(first), ipaddress.IPv4Address(last)
        if not (a in lo and b in lo and int(a) <= int(b)):
            raise ValueError("loopback range must be inside 127.0.0.0/8 with first <= last")
        super().__init__(state_dir, int(a), int(b))

    def _key(self, n: int) -> str:
        return str(ipaddress.IPv4Address(n))

    def _usable(self, n: int) -> bool:
        return 0 < (n & 0xFF) < 255  # skip .0 and .255 in the last octet

    def _stale(self, entry: Dict) -> bool:
        if super()._stale(entry):
            return True
        pid = entry.get("pid")
        return pid is not None and not is_running(int(pid), entry.get("pid_start"))

    def allocate(self, owner: str, path: Optional[str] = None, pid: Optional[int] = None) -> str:
        """Reserve an address for ``owner`` (a sandbox id); held while ``path`` exists and
        ``pid`` (default: this process) runs."""
        pid = os.getpid() if pid is None else pid
        return self._reserve({"owner": owner, "path": str(path) if path else None, "pid": pid,
                              "pid_start": start_time(pid), "ts": time.time()})

    def update(self, addr: str, pid: int) -> None:
        """Hand the reservation to the sandbox's own process (it outlives the creator)."""
        with self._locked() as state:
            entry = state["entries"].get(addr)
            if entry is not None:
                entry["pid"] = pid
                entry["pid_start"] = start_time(pid)

    def release(self, addr: Optional[str], owner: Optional[str] = None) -> bool:
        """Free addr; with owner, only if it is still reserved by that owner."""
        return self._free(addr, owner)
