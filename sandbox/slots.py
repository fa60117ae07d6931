"""Numbers from a range handed out one per sandbox, safe across threads and processes on one node.

The base of the loopback allocator (addresses) and the uid allocator (host uids). State is a
JSON file guarded by an exclusive flock on a lock file. flock() locks belong to an open file
description, and every operation opens the lock file afresh, so the same lock serializes
threads of one process as well as separate processes (the init, run and eval daemons).

Each entry records its owner (a sandbox id) and the sandbox dir; a subclass says when an
entry is stale (_stale). Stale entries are reclaimed when the range runs dry and by
reclaim_stale() (the janitor). Numbers are handed out round-robin, so a just-released one is
not reused at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from .log import log


class SlotAllocator:
    name = "slots"          # <name>.json and <name>.lock in state_dir; log event <name>_reclaimed
    what = "slots"          # the log field listing what was reclaimed
    exhausted = RuntimeError

    def __init__(self, state_dir: os.PathLike, first: int, last: int) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / (self.name + ".json")
        self.lock_path = self.state_dir / (self.name + ".lock")
        self.first, self.last = int(first), int(last)
        self._tlock = threading.Lock()

    # -- what a subclass says ----------------------------------------------------------
    def _key(self, n: int) -> str:
        return str(n)

    def _usable(self, n: int) -> bool:
        return True

    def _stale(self, entry: Dict[str, Any]) -> bool:
        path = entry.get("path")
        return bool(path) and not os.path.exists(path)

    # -- the shared machinery ------------------------------------------------------------
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

    def _reserve(self, entry: Dict[str, Any]) -> str:
        """Reserve the next free number for entry (which names its owner); returns its key."""
        with self._locked() as state:
            entries = state["entries"]
            for attempt in range(2):
                n = self._find_free(entries, int(state.get("cursor", self.first)))
                if n is not None:
                    key = self._key(n)
                    entries[key] = entry
                    state["cursor"] = n + 1 if n < self.last else self.first
                    return key
                if attempt == 0:
                    self._reclaim(entries)
        raise self.exhausted("no free %s in %s-%s" % (self.name, self._key(self.first), self._key(self.last)))

    def _find_free(self, entries: Dict, cursor: int) -> Optional[int]:
        if not self.first <= cursor <= self.last:
            cursor = self.first
        size = self.last - self.first + 1
        for i in range(size):
            n = self.first + (cursor - self.first + i) % size
            if self._usable(n) and self._key(n) not in entries:
                return n
        return None

    def _reclaim(self, entries: Dict) -> List[str]:
        stale = [k for k, e in entries.items() if self._stale(e)]
        for k in stale:
            del entries[k]
        if stale:
            log.info("%s_reclaimed" % self.name, **{self.what: stale})
        return stale

    def _free(self, key: Optional[str], owner: Optional[str] = None) -> bool:
        """Free key; with owner, only if it is still reserved by that owner (a late duplicate
        destroy must not free a number since handed to another sandbox)."""
        if not key:
            return False
        with self._locked() as state:
            entry = state["entries"].get(key)
            if entry is None or (owner is not None and entry.get("owner") != owner):
                return False
            del state["entries"][key]
            return True

    def reclaim_stale(self) -> List[str]:
        with self._locked() as state:
            return self._reclaim(state["entries"])

    def allocated(self) -> Dict[str, Dict]:
        with self._locked() as state:
            return dict(state["entries"])
