"""Host-side process helpers: identify a pid safely across reuse, kill, wait, enumerate."""
from __future__ import annotations

import os
import signal
import time
from typing import Dict, Iterable, List, Optional


def _stat_fields(pid: int) -> Optional[List[bytes]]:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    # fields after "comm)" start at field 3 (state)
    return stat[stat.rfind(b")") + 2:].split()


def start_time(pid: int) -> Optional[int]:
    """Boot-relative start time in clock ticks: (pid, start_time) names one process forever."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def state(pid: int) -> Optional[str]:
    f = _stat_fields(pid)
    return f[0].decode() if f else None


def is_running(pid: int, started: Optional[int] = None) -> bool:
    """True if pid exists, is not a zombie, and (if given) has the recorded start time."""
    f = _stat_fields(pid)
    if not f or f[0] in (b"Z", b"X"):
        return False
    return started is None or int(f[19]) == int(started)


def kill(pid: int, started: Optional[int] = None, sig: int = signal.SIGKILL) -> bool:
    if not is_running(pid, started):
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_gone(pids: Iterable[int], timeout: float = 5.0) -> bool:
    """Wait until none of pids runs (zombies count as gone: their parent reaps them)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if is_running(p)]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def namespace_pids(init_pid: int, init_start: Optional[int] = None) -> List[int]:
    """Every live process of the pid namespace whose init is ``init_pid`` (how we count a sandbox's
    processes). Orphans in a pid namespace are re-parented inside it, so the namespace is its init
    plus the init's descendants. Read from /proc/PID/stat, which anyone may read: /proc/PID/ns
    needs ptrace rights, which a root without CAP_SYS_PTRACE (a container) lacks."""
    if not is_running(init_pid, init_start):
        return []
    return [init_pid] + [p for p in descendants(init_pid) if is_running(p)]


def children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat_fields(int(name))
            if f:
                kids.setdefault(int(f[1]), []).append(int(name))
    return kids


def descendants(root: int) -> List[int]:
    kids = children_map()
    out, stack = [], list(kids.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(kids.get(pid, []))
    return out


def kill_tree(root: int, started: Optional[int] = None, rounds: int = 10) -> None:
    """Kill root and all its descendants.

    Everything is SIGSTOPped first, rescanning until no new process shows up (a stopped
    process cannot fork), then SIGKILLed, so a fork racing the scan cannot escape.
    """
    if not is_running(root, started):
        return
    seen: List[int] = []
    for _ in range(rounds):
        new = [p for p in [root] + descendants(root) if p not in seen and is_running(p)]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        seen.extend(new)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
