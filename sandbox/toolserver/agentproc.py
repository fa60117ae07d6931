"""The ``agent`` tool: run an agent program (an argv) to its end inside the sandbox.

One call = one process: started in its own session (so its process group and everything
it forks can be found and killed), with the sandbox's rlimits, an environment, a working
directory and optional stdin text (the task, for agents that read it there). The call
returns when the program exits, when its ``timeout`` passes, or when the caller goes away
(the tool server's cancel: EOF on the connection). On timeout and cancel the whole tree
is killed: descendants by parent links, and anything left in its session (double-forked
helpers re-parent to the tool server, a subreaper, but keep the session id).

The reply carries the exit code (negative: killed by that signal, as subprocess reports
it), ``timed_out`` / ``cancelled``, and the tail of the combined stdout+stderr; the whole
output can also go to ``log`` (a path inside the sandbox). stdlib only (see __init__.py).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict

from .cancel import Canceller
from .errors import ArgError
from .files import open_regular

DEFAULT_TAIL = 16 * 1024
MAX_TAIL = 1024 * 1024
_TICK = 0.05


class TailBuffer:
    """The last ``limit`` bytes written, and how many bytes went through in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock:
            self.total += len(data)
            self.buf += data
            if len(self.buf) > 2 * self.limit:  # trim in batches, not per chunk
                del self.buf[:-self.limit]

    def text(self) -> str:
        with self.lock:
            data = bytes(self.buf[-self.limit:])
        return data.decode("utf-8", errors="replace")


def _check_args(args: Dict[str, Any], max_timeout: float) -> Dict[str, Any]:
    argv = args.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise ArgError("'argv' must be a non-empty list of strings without NUL")
    env = args.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and "\0" not in k
                                            and isinstance(v, str) and "\0" not in v for k, v in env.items()):
        raise ArgError("'env' must map variable names to strings (no '=' in names, no NUL)")
    cwd = args.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
        raise ArgError("'cwd' must be an absolute path inside the sandbox")
    stdin = args.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise ArgError("'stdin' must be a string (the text the program reads) or null")
    timeout = args.get("timeout")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ArgError("'timeout' (seconds, > 0) is required: an agent always runs under a deadline")
    if timeout > max_timeout:
        raise ArgError("'timeout' %gs exceeds the maximum of %gs" % (timeout, max_timeout))
    tail = args.get("tail_bytes", DEFAULT_TAIL)
    if isinstance(tail, bool) or not isinstance(tail, int) or not 0 < tail <= MAX_TAIL:
        raise ArgError("'tail_bytes' must be an integer in 1..%d" % MAX_TAIL)
    log = args.get("log")
    if log is not None and (not isinstance(log, str) or not os.path.isabs(log)):
        raise ArgError("'log' must be an absolute path inside the sandbox")
    return {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdin": stdin, "timeout": float(timeout),
            "tail": tail, "log": log}


def _child_setup(confine: Callable[[], None]) -> Callable[[], None]:
    import signal

    def setup() -> None:
        # Python ignores SIGPIPE; ignored signals survive exec (see bash.py).
        for sig in (signal.SIGPIPE, signal.SIGHUP, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        confine()  # guard.py's seccomp filter
    return setup


def kill_agent(pid: int) -> None:
    """Kill the agent, every descendant and every process left in its session."""
    import signal

    from .procs import kill_pids, kill_tree, session_members

    kill_tree(pid, include_root=True)
    for _ in range(3):  # double-forked strays that left the tree but kept the session
        left = [p for p in session_members(pid) if p != os.getpid()]
        if not left:
            break
        kill_pids(left, signal.SIGKILL)


def run_agent(a: Dict[str, Any], base_env: Dict[str, str], default_cwd: str, limits: Dict[str, Any],
              canceller: Canceller) -> Dict[str, Any]:
    import subprocess

    from .guard import check_spawn, child_filter
    from .procs import MANAGED, SPAWN_LOCK, apply_limits

    env = dict(base_env)
    env.update(a["env"])
    cwd = a["cwd"] or default_cwd
    tail = TailBuffer(a["tail"])
    # Not blocking, regular only: the agent may have left a FIFO there (files.py).
    log_f = os.fdopen(open_regular(a["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") if a["log"] else None
    t0 = time.monotonic()
    try:
        with SPAWN_LOCK:  # registered in MANAGED before the orphan reaper can see it
            check_spawn()  # only the grader while a grade call runs
            try:
                proc = subprocess.Popen(
                    a["argv"], env=env, cwd=cwd, stdin=subprocess.PIPE if a["stdin"] is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                    preexec_fn=_child_setup(child_filter()))
            except OSError as e:
                return {"output": "", "exit_code": 127 if isinstance(e, FileNotFoundError) else 126,
                        "duration": time.monotonic() - t0, "timed_out": False, "truncated": False,
                        "error": "cannot start %s: %s" % (a["argv"][0], e.strerror or e)}
            MANAGED.add(proc.pid)
        try:
            apply_limits(proc.pid, limits)
            return _supervise(proc, a, tail, log_f, canceller, t0)
        finally:
            with SPAWN_LOCK:
                MANAGED.discard(proc.pid)
    finally:
        if log_f is not None:
            log_f.close()


def _supervise(proc, a: Dict[str, Any], tail: TailBuffer, log_f, canceller: Canceller, t0: float) -> Dict[str, Any]:
    import select

    def pump() -> None:
        fd = proc.stdout.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            tail.write(data)
            if log_f is not None:
                try:
                    log_f.write(data)
                    log_f.flush()
                except OSError:
                    pass

    reader = threading.Thread(target=pump, name="agent-out", daemon=True)
    reader.start()
    if a["stdin"] is not None:
        def feed() -> None:
            try:
                proc.stdin.write(a["stdin"].encode("utf-8"))
            except OSError:  # the program exited or closed stdin without reading it all
                pass
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        threading.Thread(target=feed, name="agent-in", daemon=True).start()

    deadline = t0 + a["timeout"]
    timed_out = cancelled = False
    try:  # readable when the process exits: no waiting out a tick (Linux >= 5.3, Python >= 3.9)
        exited = [os.pidfd_open(proc.pid)]
    except (AttributeError, OSError):
        exited = []
    try:
        while proc.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            fds = canceller.fds()
            if fds or exited:
                r, _, _ = select.select(fds + exited, [], [], min(_TICK, left))
                if any(f in r for f in fds) and canceller.poll():
                    cancelled = True
                    break
            else:
                time.sleep(min(_TICK, left))
    finally:
        for fd in exited:
            os.close(fd)
    # Also when it exited by itself: what it left running in the background goes with it.
    kill_agent(proc.pid)
    code = proc.wait()
    reader.join(timeout=5.0)  # EOF comes once every holder of the pipe is dead
    try:
        proc.stdout.close()
    except OSError:
        pass
    out: Dict[str, Any] = {
        "output": tail.text(), "exit_code": code, "duration": time.monotonic() - t0, "timed_out": timed_out,
        "error": None, "truncated": tail.total > a["tail"], "output_bytes": tail.total, "pid": proc.pid,
    }
    if cancelled:
        out["cancelled"] = True
    return out


def tools(server: Any) -> Dict[str, Callable[[Dict[str, Any], Canceller], Dict[str, Any]]]:
    """The ``agent`` tool bound to a ToolServer (its session environment, workdir, limits)."""

    def t_agent(args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        a = _check_args(args, server.max_timeout)
        server._wait_tools()  # procs' subreaper and the orphan reaper are set up with the tools
        return run_agent(a, server._session_env(server.cfg), server.workdir, server._limits, canceller)

    return {"agent": t_agent}

