"""Process helpers used inside the sandbox: rlimits on children, killing a process tree."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from typing import Dict, Iterator, List, Optional, Tuple

try:
    import resource
except ImportError:  # pragma: no cover - non-Unix
    resource = None  # type: ignore

PR_SET_CHILD_SUBREAPER = 36

# Children whose exit status their owner (bash/python session) collects itself. The
# orphan reaper must never waitpid() them; spawning holds the lock until registered.
MANAGED: "set" = set()
SPAWN_LOCK = threading.Lock()

_LIMIT_NAMES = {
    # config key -> (rlimit, multiplier)
    "memory_mb": ("RLIMIT_AS", 1024 * 1024),
    "nproc": ("RLIMIT_NPROC", 1),
    "cpu_seconds": ("RLIMIT_CPU", 1),
    "file_size_mb": ("RLIMIT_FSIZE", 1024 * 1024),
    "address_space_mb": ("RLIMIT_AS", 1024 * 1024),  # replaces memory_mb's RLIMIT_AS (spec.Limits)
}


# The tool server's own data segment (heap, anonymous mappings, thread stacks): RLIMIT_DATA, set
# on itself at start (limit_self). Measured need: ~15 MiB idle; ~300 MiB with the relay full (256
# threads of THREAD_STACK); 64 MiB host frames and 8 MiB editor files on top. The agent cannot
# raise or lower it (guard.py's seccomp filter keeps prlimit64 off other processes).
DEFAULT_DATA_MB = 1024
THREAD_STACK = 1024 * 1024  # 3.8 crashes at 1000 nested calls with 512 KiB; the default is 8 MiB
_INHERITED: Dict[int, Tuple[int, int]] = {}  # rlimits as the tool server got them: its children's


def limit_self(data_mb: Optional[float] = DEFAULT_DATA_MB) -> Optional[int]:
    """Bound the tool server's own memory: its soft RLIMIT_DATA (the hard one stays, so children
    get theirs back before exec: release_for_child). Returns the limit in bytes, None if unset."""
    if resource is None or not data_mb:
        return None
    which = resource.RLIMIT_DATA
    soft, hard = resource.getrlimit(which)
    want = int(data_mb * 1024 * 1024)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY:
        want = min(want, soft)
    try:
        resource.setrlimit(which, (want, hard))
    except (OSError, ValueError):
        return None
    _INHERITED[which] = (soft, hard)
    return want


def release_for_child() -> None:
    """In a child before exec: the limits the tool server put on itself are not the agent's."""
    for which, lim in _INHERITED.items():
        try:
            resource.setrlimit(which, lim)
        except (OSError, ValueError):
            pass


def become_subreaper() -> bool:
    """Orphans (double-forked daemons) re-parent to us, so we can still find and kill them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def apply_limits(pid: int, limits: Dict[str, Optional[float]]) -> List[str]:
    """Set rlimits on a freshly spawned child (before it runs any user command).

    The tool server's own bound (limit_self) is separate and larger, so a memory or process limit
    hit by user code never takes down the server that has to report it.
    Returns the names of limits that could not be applied.
    """
    failed = []
    if resource is None:
        return list(k for k, v in limits.items() if v)
    for key, value in limits.items():
        if value is None or key not in _LIMIT_NAMES:
            continue
        if key == "memory_mb" and limits.get("address_space_mb"):
            continue
        name, mult = _LIMIT_NAMES[key]
        n = int(value * mult)
        # CPU: soft < hard, so the process first gets the catchable SIGXCPU, then SIGKILL.
        hard = n + 1 if key == "cpu_seconds" else n
        try:
            resource.prlimit(pid, getattr(resource, name), (n, hard))
        except (OSError, ValueError, AttributeError):
            failed.append(key)
    return failed


def _stat_rows() -> Iterator[Tuple[int, List[bytes]]]:
    """(pid, fields from state on) for every process; comm may hold spaces and parens, so the
    fields are split after its last ')'."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(name), stat[stat.rfind(b")") + 2:].split()


def _children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for pid, rest in _stat_rows():
        kids.setdefault(int(rest[1]), []).append(pid)
    return kids


def descendants(root: int) -> List[int]:
    kids = _children_map()
    out: List[int] = []
    stack = list(kids.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(kids.get(pid, []))
    return out


def session_members(sid: int) -> List[int]:
    """Processes whose session id is ``sid`` (a dead shell's leftover jobs)."""
    return [pid for pid, rest in _stat_rows() if int(rest[3]) == sid]


def kill_pids(pids: List[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(root: int, include_root: bool = True, rounds: int = 10) -> None:
    """SIGSTOP the root and every descendant, rescanning until no new one appears, then SIGKILL
    all. The root stops first: running, it would see its children die and go on (a shell runs
    its next line and exits 0) before its own SIGKILL lands."""
    me = os.getpid()
    seen: List[int] = []
    if include_root and root != me:
        kill_pids([root], signal.SIGSTOP)
        seen.append(root)
    for _ in range(rounds):
        new = [p for p in descendants(root) if p not in seen and p != me]
        if not new:
            break
        kill_pids(new, signal.SIGSTOP)
        seen.extend(new)
    kill_pids(seen, signal.SIGKILL)


@contextlib.contextmanager
def managed(spawn):  # type: ignore[no-untyped-def]
    """Start a child with ``spawn()`` and keep the orphan reaper off it while the block runs:
    its owner waits for it (a reaped child reads as exit 0 to subprocess)."""
    with SPAWN_LOCK:
        proc = spawn()
        MANAGED.add(proc.pid)
    try:
        yield proc
    finally:
        with SPAWN_LOCK:
            MANAGED.discard(proc.pid)


def reap_orphans() -> None:
    """Collect exited orphans that re-parented to us (we are a subreaper).

    Never waitpid(-1): that would steal the exit status of the shell and the Python
    session, which their owners wait for themselves.
    """
    me = os.getpid()
    with SPAWN_LOCK:
        for pid in _children_map().get(me, []):
            if pid in MANAGED:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
