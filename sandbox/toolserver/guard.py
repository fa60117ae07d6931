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
from typing import Callable, List, Optional, Tuple

from .errors import ToolError
from .procs import SPAWN_LOCK, _stat_rows, descendants, reap_orphans, release_for_child

PR_SET_DUMPABLE = 4
_SEALED = threading.Event()
_local = threading.local()


class Sealed(ToolError):
    """A process was to start while a grade call owns the sandbox."""


def harden(session_env: Optional[dict] = None) -> bool:
    """Make this process non-dumpable (see the module docstring). False if the kernel refused.

    ROLLOUTD_UNSAFE_DUMPABLE=1 in the sandbox's env (SandboxSpec.env, written by the host before
    start) leaves it dumpable and its children unfiltered: bench/bench_sandbox.py's same-run
    baseline, nothing else."""
    global _UNSAFE
    if (session_env or {}).get("ROLLOUTD_UNSAFE_DUMPABLE") == "1":
        _UNSAFE = True
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


def _task_alive(pid: int) -> bool:
    """A process is dead only when every one of its threads is Z/X: /proc/<pid>/stat is the
    leader thread's, which says Z after the leader's SYS_exit while another thread runs on."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return False  # gone
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid), "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X"):
            return True
    return False


def _alive_others() -> List[int]:
    me = os.getpid()
    if me == 1:  # a live leader thread is a live process; only a Z/X leader needs its threads read
        return [pid for pid, rest in _stat_rows()
                if pid != me and (rest[0] not in (b"Z", b"X") or _task_alive(pid))]
    # Not a pid-namespace init (the local runtime): our subtree only. We are a subreaper, so
    # double-forked and setsid'd processes are still our descendants.
    return [pid for pid in descendants(me) if _task_alive(pid)]


def purge(timeout: float = 10.0) -> Tuple[int, List[int]]:
    """Kill every process of the sandbox but this one; (how many were killed, survivors).

    Survivors is empty once a scan of /proc finds no live process but ours."""
    killed = set()
    deadline = time.monotonic() + timeout
    first = True
    while True:
        reap_orphans()  # zombies of earlier rounds too: none is left in /proc
        alive = _alive_others()
        if not alive and not (first and os.getpid() == 1):
            return len(killed), []
        killed.update(alive)
        if os.getpid() == 1:
            # Every process of the namespace but pid 1, atomically; sent at least once whatever the
            # scan saw, so a process the scan misjudges cannot be what keeps kill(-1) from going out.
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        first = False
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


# -- a seccomp filter for every process the tool server starts ----------------------------------
# The kernel lets a process change the rlimits (prlimit64) and the nice value (setpriority) of
# any process of its uid, with no ptrace check: an agent could give the tool server a CPU hard
# limit (SIGKILL, which even a namespace init receives from the kernel), RLIMIT_NOFILE 4 (no new
# connection, no grader pipes) or RLIMIT_NPROC 0. Children get this filter before exec (it is
# inherited by everything they start and cannot be removed): prlimit64 may set limits only on
# the caller itself (pid 0), setpriority only for PRIO_PROCESS 0. Reading limits stays allowed.
_AUDIT_ARCH_X86_64 = 0xC000003E
_NR = {"x86_64": (302, 141), "i386": (340, 97)}  # prlimit64, setpriority
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1
_LD, _JEQ, _AND, _RET = 0x20, 0x15, 0x54, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_ALU|AND|K, BPF_RET|K


def _filter_program() -> bytes:
    import platform
    import struct

    if platform.machine() != "x86_64":
        return b""  # other arches: not filtered (documented)
    prl, prio = _NR["x86_64"]
    i_prl, i_prio = _NR["i386"]
    prog = _assemble(prl, prio, i_prl, i_prio)
    return b"".join(struct.pack("HBBI", *i) for i in prog)


def _assemble(prl: int, prio: int, i_prl: int, i_prio: int):
    """(code, jt, jf, k) instructions; labels resolved here."""
    body = [
        ("ld", 4), ("jeq", _AUDIT_ARCH_X86_64, "native", None),
        ("ld", 0), ("jeq", i_prl, "deny", None), ("jeq", i_prio, "deny", "allow"),
        ("native:",), ("ld", 0), ("and", 0xBFFFFFFF),
        ("jeq", prl, "prlimit", None), ("jeq", prio, "setprio", "allow"),
        ("prlimit:",), ("ld", 16), ("jeq", 0, "allow", None),
        ("ld", 32), ("jeq", 0, None, "deny"), ("ld", 36), ("jeq", 0, "allow", "deny"),
        ("setprio:",), ("ld", 16), ("jeq", 0, None, "deny"), ("ld", 24), ("jeq", 0, "allow", "deny"),
        ("allow:",), ("ret", _ALLOW), ("deny:",), ("ret", _EPERM),
    ]
    labels, n = {}, 0
    for op in body:
        if op[0].endswith(":"):
            labels[op[0][:-1]] = n
        else:
            n += 1
    out, i = [], 0
    for op in body:
        if op[0].endswith(":"):
            continue
        if op[0] == "ld":
            out.append((_LD, 0, 0, op[1]))
        elif op[0] == "and":
            out.append((_AND, 0, 0, op[1]))
        elif op[0] == "ret":
            out.append((_RET, 0, 0, op[1]))
        else:
            jt = 0 if op[2] is None else labels[op[2]] - i - 1
            jf = 0 if op[3] is None else labels[op[3]] - i - 1
            out.append((_JEQ, jt, jf, op[1]))
        i += 1
    return out


class _Filter:
    """Built once in the parent; install() runs in a forked child before exec (no allocation)."""

    def __init__(self) -> None:
        self.ok = False
        try:
            code = _filter_program()
            if not code:
                return
            self._buf = ctypes.create_string_buffer(code, len(code))

            class Prog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

            self._prog = Prog(len(code) // 8, ctypes.addressof(self._buf))
            self._prctl = ctypes.CDLL(None, use_errno=True).prctl
            self._ptr = ctypes.addressof(self._prog)
            self.ok = True
        except Exception:
            self.ok = False

    def install(self) -> None:
        if not self.ok:
            return
        # PR_SET_NO_NEW_PRIVS (needed without CAP_SYS_ADMIN), PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        if self._prctl(38, 1, 0, 0, 0) != 0 or self._prctl(22, 2, ctypes.c_void_p(self._ptr), 0, 0) != 0:
            os._exit(126)  # never run an agent process without it


_FILTER: Optional[_Filter] = None
_UNSAFE = False  # the benchmark's baseline (harden)


def child_filter() -> Callable[[], None]:
    """The function a spawner calls in the child before exec: the tool server's own limits off
    (procs.limit_self), then the seccomp filter."""
    global _FILTER
    if _UNSAFE:
        return release_for_child
    if _FILTER is None:
        _FILTER = _Filter()
    install = _FILTER.install

    def prepare() -> None:
        release_for_child()
        install()
    return prepare
