"""What keeps the agent's processes away from the tool server and from graders (issue 24).

* ``harden()``: the tool server makes itself non-dumpable. Without Yama, any process of the
  same uid could otherwise read and write its memory (/proc/1/mem, process_vm_writev), ptrace
  it, or take its descriptors (/proc/1/fd/*, pidfd_getfd). A non-dumpable process needs
  CAP_SYS_PTRACE in its own user namespace for all of those, which no process in the
  sandbox has (bwrap drops every capability; a nested user namespace grants none in ours).
  execve() makes the shell and every other child dumpable again: they are the agent's.
* ``purge()``: before a grader runs, every other process of the sandbox is killed and the
  kill is verified by scanning /proc. As pid 1 of the sandbox's pid namespace the tool
  server reaches all of them with one kill(-1, SIGKILL), however they detached (setsid,
  double fork, stopped, traced, renamed, in a nested pid namespace: all have a pid here).
* the seal: while a grade call runs no other call may start a process (checked under
  SPAWN_LOCK by every spawner), so a request an agent sent just before the purge cannot
  start something beside the grader.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import List, Optional, Tuple

from .errors import ToolError
from .procs import MANAGED, SPAWN_LOCK, _children_map, _stat_rows, descendants

PR_SET_DUMPABLE = 4
_SEALED = threading.Event()
_local = threading.local()


class Sealed(ToolError):
    """A process was to start while a grade call owns the sandbox."""


def harden(session_env: Optional[dict] = None) -> bool:
    """Make this process non-dumpable (see the module docstring). False if the kernel refused.

    ROLLOUTD_UNSAFE_DUMPABLE=1 in the sandbox's env (SandboxSpec.env, written by the host before
    start) leaves it dumpable: bench/bench_sandbox.py's same-run baseline, nothing else."""
    if (session_env or {}).get("ROLLOUTD_UNSAFE_DUMPABLE") == "1":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except Exception:
        return False


def check_spawn() -> None:
    """Called by every spawner (under SPAWN_LOCK where it spawns)."""
    if _SEALED.is_set() and not getattr(_local, "grader", False):
        raise Sealed("the sandbox is being graded: no other process may start now")


class sealed:
    """Context: no process but this thread's may start; this thread may (the grader)."""

    def __enter__(self) -> "sealed":
        with SPAWN_LOCK:
            _SEALED.set()
        _local.grader = True
        return self

    def __exit__(self, *exc) -> None:
        _local.grader = False
        _SEALED.clear()


def _alive_others() -> List[int]:
    me = os.getpid()
    if me == 1:
        return [pid for pid, rest in _stat_rows() if pid != me and rest[0] not in (b"Z", b"X")]
    # Not a pid-namespace init (the local runtime): our subtree only. We are a subreaper, so
    # double-forked and setsid'd processes are still our descendants.
    alive = set(descendants(me))
    return [pid for pid, rest in _stat_rows() if pid in alive and rest[0] not in (b"Z", b"X")]


def _reap_unmanaged() -> None:
    me = os.getpid()
    for pid in _children_map().get(me, []):
        if pid in MANAGED:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def purge(timeout: float = 10.0) -> Tuple[int, List[int]]:
    """Kill every process of the sandbox but this one; (how many were killed, survivors).

    Survivors is empty once a scan of /proc finds no live process but ours."""
    killed = set()
    deadline = time.monotonic() + timeout
    while True:
        with SPAWN_LOCK:
            _reap_unmanaged()  # zombies of earlier rounds too: none is left in /proc
        alive = _alive_others()
        if not alive:
            return len(killed), []
        killed.update(alive)
        if os.getpid() == 1:
            try:
                os.kill(-1, signal.SIGKILL)  # every process of the namespace but pid 1, atomically
            except ProcessLookupError:
                pass
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() >= deadline:
            left = _alive_others()
            if left:
                return len(killed), left
        time.sleep(0.001)
