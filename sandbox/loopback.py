"""Unique 127.x.y.z addresses per sandbox, safe across threads and processes on one node.

State is a JSON file guarded by an exclusive flock on a lock file. flock() locks belong to
an open file description, and every operation opens the lock file afresh, so the same lock
serializes threads of one process as well as separate processes.

Each entry records the sandbox dir and a pid (with its start time, to survive pid reuse).
An entry is stale when the dir is gone or that process is no longer running; stale
entries are reclaimed when the pool runs dry and by reclaim_stale() (the janitor).
Addresses are handed out round-robin so a just-released address (whose sockets may sit
in TIME_WAIT) is not reused at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from .log import log
from .procs import is_running, start_time


class LoopbackExhausted(RuntimeError):
    pass


class LoopbackAllocator:
    def __init__(self, state_dir: os.PathLike, first: str = "127.1.0.1", last: str = "127.254.255.254") -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / "loopback.json"
        self.lock_path = self.state_dir / "loopback.lock"
        self.first = int(ipaddress.IPv4Address(first))
        self.last = int(ipaddress.IPv4Address(last))
        lo = ipaddress.IPv4Network("127.0.0.0/8")
        if not (ipaddress.IPv4Address(first) in lo and ipaddress.IPv4Address(last) in lo and self.first <= self.last):
            raise ValueError("loopback range must be inside 127.0.0.0/8 with first <= last")
        self._tlock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Dict]:
        with self._tlock:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                state = self._load()
                yield state
                self._save(state)
            finally:
                os.close(fd)  # releases the flock

    def _load(self) -> Dict:
        try:
            with open(self.state_path, "r", encoding="utf-8") as f:
                state = json.load(f)
            if isinstance(state, dict) and isinstance(state.get("entries"), dict):
                return state
        except (FileNotFoundError, ValueError):
            pass
        return {"entries": {}, "cursor": self.first}

    def _save(self, state: Dict) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)  # atomic: readers never see a half-written file

    @staticmethod
    def _usable(n: int) -> bool:
        return 0 < (n & 0xFF) < 255  # skip .0 and .255 in the last octet

    @staticmethod
    def _stale(entry: Dict) -> bool:
        path = entry.get("path")
        if path and not os.path.exists(path):
            return True
        pid = entry.get("pid")
        return pid is not None and not is_running(int(pid), entry.get("pid_start"))

    def allocate(self, owner: str, path: Optional[str] = None, pid: Optional[int] = None) -> str:
        """Reserve an address for ``owner`` (a sandbox id); held while ``path`` exists and
        ``pid`` (default: this process) runs."""
        pid = os.getpid() if pid is None else pid
        entry = {"owner": owner, "path": str(path) if path else None, "pid": pid,
                 "pid_start": start_time(pid), "ts": time.time()}
        with self._locked() as state:
            entries = state["entries"]
            for attempt in range(2):
                n = self._find_free(entries, int(state.get("cursor", self.first)))
                if n is not None:
                    addr = str(ipaddress.IPv4Address(n))
                    entries[addr] = entry
                    state["cursor"] = n + 1 if n < self.last else self.first
                    return addr
                if attempt == 0:
                    self._reclaim(entries)
        raise LoopbackExhausted("no free loopback address in %s-%s" % (
            ipaddress.IPv4Address(self.first), ipaddress.IPv4Address(self.last)))

    def _find_free(self, entries: Dict, cursor: int) -> Optional[int]:
        if not self.first <= cursor <= self.last:
            cursor = self.first
        size = self.last - self.first + 1
        for i in range(size):
            n = self.first + (cursor - self.first + i) % size
            if self._usable(n) and str(ipaddress.IPv4Address(n)) not in entries:
                return n
        return None

    def _reclaim(self, entries: Dict) -> List[str]:
        stale = [a for a, e in entries.items() if self._stale(e)]
        for a in stale:
            del entries[a]
        if stale:
            log.info("loopback_reclaimed", addresses=stale)
        return stale

    def update(self, addr: str, pid: int) -> None:
        """Hand the reservation to the sandbox's own process (it outlives the creator)."""
        with self._locked() as state:
            entry = state["entries"].get(addr)
            if entry is not None:
                entry["pid"] = pid
                entry["pid_start"] = start_time(pid)

    def release(self, addr: Optional[str], owner: Optional[str] = None) -> bool:
        """Free addr; with owner, only if it is still reserved by that owner (a late
        duplicate destroy must not free an address since handed to another sandbox)."""
        if not addr:
            return False
        with self._locked() as state:
            entry = state["entries"].get(addr)
            if entry is None or (owner is not None and entry.get("owner") != owner):
                return False
            del state["entries"][addr]
            return True

    def reclaim_stale(self) -> List[str]:
        with self._locked() as state:
            return self._reclaim(state["entries"])

    def allocated(self) -> Dict[str, Dict]:
        with self._locked() as state:
            return dict(state["entries"])
