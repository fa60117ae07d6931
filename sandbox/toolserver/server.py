"""The tool server: a Unix socket, one thread per connection, tools behind per-tool locks.

Config is a JSON file written by the runtime before start (see sandbox/runtime.py):
  socket, workdir, home, shell, python, env, limits, apply_nproc, max_output,
  default_timeout, max_timeout, interrupt_grace, deadline (epoch s or null), ready_fd,
  sandbox_id, job_id; optional, with the defaults of procs.py and toollog.py: server_data_mb
  (the tool server's own RLIMIT_DATA), log_max_bytes, log_max_line (its host-side log's caps)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Optional

from . import PROTOCOL_VERSION
from .cancel import Canceller
from .errors import Abandoned, ArgError, BusyError, ToolError
from .output import DEFAULT_MAX_OUTPUT
from .toollog import clip, log
from .wire import FrameError, encode, recv_frame

# The tools (ptyprocess, subprocess, ctypes, re...) are imported by a background thread
# after "ready" is signalled: half of the interpreter's start-up is those imports, and a
# ping does not need them. The first tool call waits for them (see _tools_ready).
# An error text in a reply (an exception's repr can hold a whole payload).
MAX_ERROR = 4096


def result(output: str = "", exit_code: Optional[int] = None, duration: float = 0.0, timed_out: bool = False,
           error: Optional[str] = None, truncated: bool = False, **extra: Any) -> Dict[str, Any]:
    out = {"output": output, "exit_code": exit_code, "duration": duration, "timed_out": timed_out,
           "error": error, "truncated": truncated}
    out.update(extra)
    return out


class ToolServer:
    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cfg = cfg
        self.started = time.time()
        self.max_output = int(cfg.get("max_output") or DEFAULT_MAX_OUTPUT)
        self.default_timeout = float(cfg.get("default_timeout") or 60.0)
        self.max_timeout = float(cfg.get("max_timeout") or 24 * 3600.0)
        grace = float(cfg.get("interrupt_grace") or 1.0)
        limits = dict(cfg.get("limits") or {})
        if not cfg.get("apply_nproc", True):
            limits.pop("nproc", None)
        self.workdir = cfg.get("workdir") or os.getcwd()
        self._limits, self._grace = limits, grace
        self.bash = self.python = self.editor = None  # set by _load_tools
        self.locks = {name: threading.Lock() for name in ("bash", "python", "editor")}
        self.tools: Dict[str, Callable[[Dict[str, Any], Canceller], Dict[str, Any]]] = {
            "ping": self.t_ping, "bash": self.t_bash, "python": self.t_python, "editor": self.t_editor,
            "grade": self.t_grade, "purge": self.t_purge,
        }
        from . import agentproc, relay  # bring-your-own-agent: agent processes, the LLM relay (issue 12)

        self.tools.update(agentproc.tools(self))
        self.tools.update(relay.tools(self))
        self.calls = 0
        self.abandoned = 0  # calls whose client went away while they waited for their tool
        self.waiting = {name: 0 for name in self.locks}  # calls waiting for their tool's lock now
        self._waiting_lock = threading.Lock()
        self._tools_ready = threading.Event()
        self._tools_error: Optional[str] = None
        self._grading = threading.Lock()  # one grade/purge at a time
        self.refused_inside = 0  # connections from the sandbox's own processes (closed)
        self.ignored_signals = 0  # INT/TERM from inside (pid 1 ignores them)
        self.last_ignored_signal = 0
        self._ignored_logged = 0  # the count the last signal_ignored line gave
        self._tl = threading.local()  # per connection thread: the restart notes of its last reply
        self.hardened = False
        self.data_limit: Optional[int] = None  # bytes of its own RLIMIT_DATA (main: procs.limit_self)

    def _load_tools(self) -> None:
        from . import editor, procs
        from .bash import BashSession
        from .pysession import PythonSession

        self._kill_tree, self._reap_orphans = procs.kill_tree, procs.reap_orphans
        procs.become_subreaper()
        cfg, env = self.cfg, self._session_env(self.cfg)
        self.bash = BashSession(env, self.workdir, shell=cfg.get("shell") or "/bin/bash",
                                limits=self._limits, max_output=self.max_output, interrupt_grace=self._grace)
        self.python = PythonSession(env, self.workdir, python=cfg.get("python") or sys.executable,
                                    limits=self._limits, max_output=self.max_output, interrupt_grace=self._grace)
        self.editor = editor.Editor(self.workdir, max_output=self.max_output)

    @staticmethod
    def _session_env(cfg: Dict[str, Any]) -> Dict[str, str]:
        """Environment of the shell and the Python session: defaults, then the job's env."""
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb",
            "PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat",
            "HOME": cfg.get("home") or cfg.get("workdir") or "/tmp",
        }
        env.update({str(k): str(v) for k, v in (cfg.get("env") or {}).items()})
        return env

    # -- lifecycle -------------------------------------------------------------------
    def serve_forever(self) -> None:
        from .guard import harden

        self.hardened = harden(self.cfg.get("env"))  # before any agent process exists (see guard.py)
        home = self.cfg.get("home")
        if home:
            os.makedirs(home, exist_ok=True)
        path = self.cfg["socket"]
        self._run_dir_mode = os.stat(os.path.dirname(path)).st_mode & 0o7777
        if self.cfg.get("socket_fd") is not None:  # bwrap: bound by the host, the dir is read-only here
            self._adopt(int(self.cfg["socket_fd"]), path)
        else:
            self._listen(path)
        if os.getpid() == 1:
            # pid 1 of the sandbox's pid namespace (bwrap --as-pid-1): the kernel drops SIGKILL and
            # SIGSTOP sent from inside, and every signal we have no handler for, so `kill -9 $PPID`
            # cannot take the tools down. Python's own SIGINT handler would let `kill -INT 1` in;
            # these no-op handlers (reset to default in children by exec) keep INT and TERM out.
            # The host stops us with SIGKILL (Runtime.destroy).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._ignored)
        else:
            signal.signal(signal.SIGTERM, lambda *_: self.shutdown("sigterm"))
        threading.Thread(target=self._start_tools, name="tools-start", daemon=True).start()
        threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()
        # Orphans re-parent to us: reap them as they exit, not only once a second (a fork chain
        # would otherwise pile zombies up to nproc). The kernel may deliver SIGCHLD to any thread,
        # and a Python handler runs only when the main thread (asleep below) next wakes, so the
        # reaper waits on the wakeup fd, which the C-level handler writes in whichever thread.
        self._chld_r, chld_w = os.pipe()
        os.set_blocking(chld_w, False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # a blocked mask survives exec
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
        signal.siginterrupt(signal.SIGCHLD, False)  # SA_RESTART: other threads' syscalls go on
        signal.set_wakeup_fd(chld_w, warn_on_full_buffer=False)
        threading.Thread(target=self._reaper, name="reaper", daemon=True).start()
        ready_fd = self.cfg.get("ready_fd")
        if ready_fd is not None:
            try:
                os.write(int(ready_fd), b"ready\n")
                os.close(int(ready_fd))
            except OSError:
                pass
        log("toolserver_ready", socket=path, sandbox_id=self.cfg.get("sandbox_id"), data_limit=self.data_limit,
            startup_ms=round((time.time() - self.started) * 1000, 1))
        while True:  # the threads serve; shutdown() ends the process
            time.sleep(3600)

    def _ignored(self, signum: int, _frame: Any) -> None:
        # Count only: Python runs this in the main thread between two bytecodes, possibly inside
        # the log's lock (the last line being written), so logging here could deadlock for good.
        # The reaper, woken by the same signal's byte on the wakeup fd, writes the line.
        self.ignored_signals += 1
        self.last_ignored_signal = signum

    def _log_ignored_signals(self) -> None:
        """A line when the count of ignored signals passes a power of ten (the agent can send
        them in a loop)."""
        n = self.ignored_signals
        if n and len(str(n)) > len(str(self._ignored_logged or "")):
            self._ignored_logged = n
            log("signal_ignored", signal=self.last_ignored_signal, count=n)

    def _listen(self, path: str) -> None:
        """Bind the tool socket at path (replacing whatever is there) and accept on it."""
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # only the owner (the runtime's uid) may connect
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(128)
        self._sock_id = (os.stat(path).st_dev, os.stat(path).st_ino)
        previous, self.sock = getattr(self, "sock", None), sock
        threading.Thread(target=self._accept, args=(sock,), name="accept", daemon=True).start()
        if previous is not None:
            previous.close()  # unreachable by path anyway; its accept thread ends

    def _adopt(self, fd: int, path: str) -> None:
        self.sock = socket.socket(fileno=fd)
        st = os.stat(path)
        self._sock_id = (st.st_dev, st.st_ino)
        threading.Thread(target=self._accept, args=(self.sock,), name="accept", daemon=True).start()

    def _accept(self, sock: socket.socket) -> None:
        import errno

        while True:
            try:
                conn, _ = sock.accept()
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.05)  # out of descriptors or memory for now: never stop accepting
                    continue
                return  # closed: a new socket replaced it
            if self._from_inside(conn):
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve_conn, args=(conn,), name="conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this one, keep accepting
                conn.close()

    def _from_inside(self, conn: socket.socket) -> bool:
        """As the sandbox's pid 1, only the host may talk to us: a peer in our pid namespace (a
        process of the agent's) has a pid here, the host's is 0. Such connections are closed at
        once (no thread, no call: nothing to flood us with)."""
        if os.getpid() != 1:
            return False
        import struct

        try:
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            return True
        if pid == 0:
            return False
        self.refused_inside += 1
        if _now_and_then(self.refused_inside):
            log("tool_connection_from_inside_refused", pid=pid, count=self.refused_inside)
        return True

    def _guard_socket(self) -> None:
        """The agent shares our uid and sees /run/rolloutd: if it removed or replaced the socket or
        took the dir's permissions away, the host could never reach us again. Put both back."""
        path = self.cfg["socket"]
        d = os.path.dirname(path)
        try:
            if os.stat(d).st_mode & 0o7777 != self._run_dir_mode:
                os.chmod(d, self._run_dir_mode)
                log("tool_socket_dir_repaired", path=d)
            st = os.lstat(path)
            ok = (st.st_dev, st.st_ino) == self._sock_id
        except OSError:
            ok = False
        if not ok:
            try:
                self._listen(path)
                log("tool_socket_rebound", socket=path)
            except OSError as e:
                log("tool_socket_rebind_failed", socket=path, error=repr(e))

    def _start_tools(self) -> None:
        # In the background so "ready" is signalled as early as possible; a first bash
        # call waits on the lock held here while the shell starts.
        with self.locks["bash"]:
            try:
                self._load_tools()
            except Exception as e:
                self._tools_error = repr(e)
                log("tools_load_failed", error=repr(e), traceback=traceback.format_exc())
                self._tools_ready.set()
                return
            self._tools_ready.set()
            try:
                self.bash.start()
            except Exception as e:
                log("bash_start_failed", error=repr(e))

    def _wait_tools(self) -> None:
        if not self._tools_ready.wait(60):
            raise ToolError("the tools did not load within 60s")
        if self._tools_error:
            raise RuntimeError("the tools failed to load: %s" % self._tools_error)

    def shutdown(self, reason: str) -> None:
        log("toolserver_shutdown", reason=reason)
        if self._tools_ready.is_set() and not self._tools_error:
            self._kill_tree(os.getpid(), include_root=False)
        else:  # tools never loaded: no children of ours beyond what /proc shows
            from .procs import kill_tree
            kill_tree(os.getpid(), include_root=False)
        try:
            os.unlink(self.cfg["socket"])
        except OSError:
            pass
        os._exit(0 if reason == "sigterm" else 137)

    def _reaper(self) -> None:
        while True:
            os.read(self._chld_r, 4096)  # any signal's byte: a spare scan is harmless
            self._log_ignored_signals()
            if self._tools_ready.is_set() and not self._tools_error:
                self._reap_orphans()
            time.sleep(0.005)  # one /proc scan per 5 ms at most under a storm of exits

    def _watchdog(self) -> None:
        deadline = self.cfg.get("deadline")
        while True:
            if deadline is not None and time.time() >= float(deadline):
                log("sandbox_wall_clock_expired", deadline=deadline)
                self.shutdown("wall_clock")
            if self._tools_ready.is_set() and not self._tools_error:
                self._reap_orphans()
            self._guard_socket()
            wait = 1.0 if deadline is None else max(0.01, min(1.0, float(deadline) - time.time()))
            time.sleep(wait)

    # -- connections -----------------------------------------------------------------
    def _serve_conn(self, conn: socket.socket) -> None:
        sent = None  # restart notes in the last reply sent on this connection: (session, notes)
        try:
            while True:
                try:
                    req = recv_frame(conn)
                except FrameError as e:
                    conn.sendall(_encode(result(error="bad frame: %s" % e, exit_code=None)))
                    return
                except MemoryError:  # a request too big to decode within the server's own bound
                    log("tool_request_over_memory_bound", data_limit=self.data_limit)
                    conn.sendall(_encode(result(error="the request did not fit in the tool server's memory "
                                                      "bound (%s bytes of data)" % self.data_limit)))
                    return
                except ConnectionResetError:
                    # A Unix socket closed with unread data resets its peer: our last reply was
                    # never read, so its restart notes go to the next one (Session.defer).
                    self._unread(sent)
                    return
                if req is None:
                    return
                canceller = Canceller(conn)
                self._tl.reported = None
                resp = self.dispatch(req, canceller)
                if canceller.cancelled:
                    return
                sent = self._tl.reported
                try:
                    conn.sendall(_encode(resp))
                except OSError:
                    self._unread(sent)
                    raise
        except OSError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _unread(sent) -> None:
        if sent and sent[1]:
            session, notes = sent
            session.unreported[:0] = [n for n in notes if n not in session.unreported]

    def dispatch(self, req: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        t0 = time.monotonic()
        rid = req.get("id")
        tool = req.get("tool")
        args = req.get("args")
        if args is None:
            args = {}
        if not isinstance(tool, str) or tool not in self.tools:
            resp = result(error="unknown tool %r; available tools: %s" % (tool, ", ".join(sorted(self.tools))))
        elif not isinstance(args, dict):
            resp = result(error="'args' must be a JSON object, got %s" % type(args).__name__)
        else:
            try:
                resp = self.tools[tool](args, canceller)
            except Abandoned:
                canceller.cancelled = True  # nothing ran; no reply (the client is gone)
                self.abandoned += 1
                log("tool_call_abandoned", tool=tool, waited_ms=round((time.monotonic() - t0) * 1000, 1))
                return result(error="abandoned")
            except ArgError as e:
                resp = result(error="bad arguments for %s: %s" % (tool, e))
            except BusyError as e:
                resp = result(error=str(e))
            except ToolError as e:
                resp = result(error=str(e), exit_code=1)
            except Exception as e:  # a tool bug must never take the server down
                log("tool_internal_error", tool=tool, error=repr(e), traceback=traceback.format_exc())
                resp = result(error="internal error in tool %s: %s" % (tool, clip(repr(e), MAX_ERROR)))
        resp.setdefault("duration", time.monotonic() - t0)
        if not resp.get("duration"):
            resp["duration"] = time.monotonic() - t0
        resp["id"] = rid
        if resp.get("timed_out"):
            log("tool_call_timed_out", tool=tool, duration_ms=round(resp["duration"] * 1000, 1))
        if resp.get("cancelled"):
            log("tool_call_cancelled", tool=tool, duration_ms=round(resp["duration"] * 1000, 1))
        self.calls += 1
        return resp

    # -- argument helpers ------------------------------------------------------------
    def _timeout(self, args: Dict[str, Any]) -> float:
        t = args.get("timeout", self.default_timeout)
        if t is None:
            t = self.default_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ArgError("'timeout' must be a positive number of seconds, got %r" % (t,))
        if t > self.max_timeout:
            raise ArgError("'timeout' %gs exceeds the maximum of %gs" % (t, self.max_timeout))
        return float(t)

    @staticmethod
    def _text(args: Dict[str, Any], name: str, required: bool = True) -> Optional[str]:
        value = args.get(name)
        if value is None:
            if required:
                raise ArgError("'%s' (a string) is required" % name)
            return None
        if not isinstance(value, str):
            raise ArgError("'%s' must be a string, got %s" % (name, type(value).__name__))
        return value

    def _locked(self, name: str, timeout: float, canceller: Canceller) -> threading.Lock:
        """The tool's lock; a call whose client gives up while it waits never starts."""
        lock = self.locks[name]
        deadline = time.monotonic() + timeout
        with self._waiting_lock:
            self.waiting[name] += 1
        try:
            while not lock.acquire(timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                if canceller.gone():
                    raise Abandoned()
                if time.monotonic() >= deadline:
                    raise BusyError("the %s tool is busy with another call (waited %gs)" % (name, timeout))
        finally:
            with self._waiting_lock:
                self.waiting[name] -= 1
        if canceller.gone():  # left while we waited (or just before): do not run it
            lock.release()
            raise Abandoned()
        return lock

    def _finish(self, session, canceller: Canceller) -> None:
        """Under the tool's lock, after a call: if its reply will not reach anyone, the restarts it
        caused are reported to the next call instead."""
        if canceller.cancelled or canceller.gone():
            session.defer()
        else:
            self._tl.reported = (session, list(session.restart_notes))

    # -- tools -----------------------------------------------------------------------
    def t_ping(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        info = {
            "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "python": sys.version.split()[0],
            "uptime": round(time.time() - self.started, 3), "calls": self.calls,
            "sandbox_id": self.cfg.get("sandbox_id"), "job_id": self.cfg.get("job_id"),
            "tools_loaded": self._tools_ready.is_set(),
            "bash_restarts": self.bash.restarts if self.bash else 0,
            "python_restarts": self.python.restarts if self.python else 0,
            "abandoned": self.abandoned, "waiting": dict(self.waiting),
            "hardened": self.hardened, "refused_inside": self.refused_inside,
            "data_limit": self.data_limit, "ignored_signals": self.ignored_signals,
            "unreported": sum(len(t.unreported) for t in (self.bash, self.python) if t),  # notes of unread replies
        }
        return result(output="pong", exit_code=0, info=info)

    def t_bash(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        timeout = self._timeout(args)
        restart = bool(args.get("restart", False))
        command = self._text(args, "command", required=not restart)
        self._wait_tools()
        lock = self._locked("bash", timeout + 30, canceller)  # + the shell's start-up on a first call
        try:
            if restart:
                self.bash.restart()
                if command is None:
                    return result(output="[shell restarted]", exit_code=0)
            return self.bash.run(command, timeout, canceller)
        finally:
            self._finish(self.bash, canceller)
            lock.release()

    def t_python(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        timeout = self._timeout(args)
        restart = bool(args.get("restart", False))
        code = self._text(args, "code", required=not restart)
        self._wait_tools()
        lock = self._locked("python", timeout, canceller)
        try:
            if restart:
                self.python.restart()
                if code is None:
                    return result(output="[python session restarted]", exit_code=0)
            return self.python.run(code, timeout, canceller)
        finally:
            self._finish(self.python, canceller)
            lock.release()

    def _clear(self, canceller: Canceller) -> Dict[str, Any]:
        """Under the seal: kill every other process, end both sessions, verify. Raises ToolError
        (nothing is graded) if a process survives."""
        from .guard import purge

        t0 = time.monotonic()
        killed, left = purge()
        # The sessions' threads see their processes die and give their locks back.
        for name, session in (("bash", self.bash), ("python", self.python)):
            lock = self._locked(name, 30.0, canceller)
            try:
                session.kill()
            finally:
                lock.release()
        more, left = purge()
        if left:
            log("purge_failed", survivors=left)
            raise ToolError("could not stop every process of the sandbox before grading (%d left: %s)"
                            % (len(left), left[:10]))
        info = {"killed": killed + more, "purge_ms": round((time.monotonic() - t0) * 1000, 3)}
        log("sandbox_purged", **info)
        return info

    def t_purge(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        """Kill every process the agent started (the shell and Python session restart on their next call)."""
        from .guard import sealed

        self._wait_tools()
        with self._grading, sealed():
            info = self._clear(canceller)
        return result(output="", exit_code=0, purged=info)

    def t_grade(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        """Run a grader as the only process of the sandbox: every other process is killed first
        (and verified gone), nothing else may start while it runs, and its output comes back on
        pipes created for it. Arguments as for the agent tool; env is exactly ``env`` (+ PATH), with
        HOME a fresh empty directory, PYTHONNOUSERSITE=1 and PYTHONPYCACHEPREFIX under that HOME
        unless given."""
        from .agentproc import _check_args, run_agent
        from .guard import purge, sealed

        a = _check_args(args, self.max_timeout)
        self._wait_tools()
        env = {"PATH": self._session_env({})["PATH"]}
        env.update(a.pop("env"))
        a["env"] = {}
        with self._grading, sealed():
            info = self._clear(canceller)
            # A HOME no agent process ever saw (made after the purge): dotfiles the agent left in
            # its HOME or /tmp (~/.local/.../site-packages/*.pth, .gitconfig) must not run in a grader.
            import shutil
            import tempfile

            env["HOME"] = tempfile.mkdtemp(prefix=".rolloutd-grade-", dir=_grade_home_parent(self.cfg.get("grade_scratch")))
            env.setdefault("TMPDIR", env["HOME"])
            env.setdefault("PYTHONNOUSERSITE", "1")
            # Bytecode only from a cache no agent process wrote: a planted __pycache__/*.pyc whose
            # header matches a restored source's mtime and size would otherwise run instead of it.
            env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(env["HOME"], "pycache"))
            try:
                out = run_agent(a, env, self.workdir, self._limits, canceller)
            finally:
                purge()  # whatever the grader left behind
                shutil.rmtree(env["HOME"], ignore_errors=True)
        out["purged"] = info
        return out

    def t_editor(self, args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        t0 = time.monotonic()
        self._wait_tools()
        lock = self._locked("editor", 30.0, canceller)
        try:
            output, truncated = self.editor.call(args)
        except OSError as e:
            raise ToolError("%s: %s" % (e.strerror or "error", e.filename or "")) from None
        finally:
            lock.release()
        return result(output=output, exit_code=0, duration=time.monotonic() - t0, truncated=truncated)


def _now_and_then(n: int) -> bool:
    """Log the 1st, 10th, 100th, ... of something the agent can repeat at will (the count is in
    ping's info): a line per power of ten, however long it goes on."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _encode(resp: Dict[str, Any]) -> bytes:
    """The reply's frame; one over the frame limit becomes an error reply the client can read
    (dropping the connection would fail the job for what is at most a tool's fault)."""
    try:
        return encode(resp)
    except (FrameError, TypeError, ValueError) as e:
        log("tool_reply_unsendable", error=repr(e), keys=sorted(map(str, resp)))
        return encode(result(error="the tool's reply could not be sent: %s" % clip(str(e), MAX_ERROR),
                             id=resp.get("id") if isinstance(resp.get("id"), (int, str)) else None))


def _grade_home_parent(scratch: Optional[str] = None) -> Optional[str]:
    """Where the grader's fresh HOME is made: the grader's scratch mount where the runtime made one
    (bwrap: an agent that fills /tmp, bytes or inodes, cannot stop grading), emptied first; else
    /tmp, given back its mode first. The agent (our uid) owns both and may have filled them or made
    them read-only (`chmod 555 /tmp`); after the purge no agent process is left to do it again. A
    /tmp we cannot fix (not ours: the local runtime) is left alone."""
    if scratch and os.path.isdir(scratch):
        _empty_dir(scratch)
        return scratch
    if not os.path.isdir("/tmp"):
        return None
    try:
        st = os.stat("/tmp")
        if st.st_uid == os.geteuid() and st.st_mode & 0o7777 != 0o1777:
            os.chmod("/tmp", 0o1777)
            log("grade_tmp_mode_restored", mode=oct(st.st_mode & 0o7777))
    except OSError:
        pass
    return "/tmp"


def _empty_dir(top: str) -> None:
    """Delete everything under top, never following a symlink, at any depth, with one directory
    fd open at a time (an agent's 10,000-deep tree must not recurse or run out of fds); dirs the
    agent made unreadable are given back their mode first. Errors leave an entry behind."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.chmod(top, 0o755)
        fd = os.open(top, flags)
    except OSError:
        return
    stack = []  # (name of the current dir in its parent, subdirs of the parent still to empty)

    def scan(dfd: int) -> list:
        subdirs = []
        try:  # lazily: a rootless scratch may hold millions of entries
            with os.scandir(dfd) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            subdirs.append(e.name)
                        else:
                            os.unlink(e.name, dir_fd=dfd)
                    except OSError:
                        pass
        except OSError:
            pass
        return subdirs

    try:
        pending = scan(fd)
        while True:
            if pending:
                name = pending.pop()
                try:
                    os.chmod(name, 0o700, dir_fd=fd)
                    child = os.open(name, flags, dir_fd=fd)
                except OSError:
                    continue
                stack.append((name, pending))
                os.close(fd)
                fd, pending = child, scan(child)
            elif stack:
                parent = os.open("..", flags, dir_fd=fd)
                os.close(fd)
                fd = parent
                name, pending = stack.pop()
                try:
                    os.rmdir(name, dir_fd=fd)
                except OSError:
                    pass
            else:
                break
    finally:
        os.close(fd)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="rolloutd_toolserver", description="rolloutd in-sandbox tool server")
    parser.add_argument("--config", required=True, help="path of the JSON config written by the runtime")
    ns = parser.parse_args(argv)
    with open(ns.config, "r", encoding="utf-8") as f:
        cfg = json.load(f)
    from . import procs, toollog

    # First, before any thread: every later write to stderr (the host's log file) is capped, and
    # every thread gets a small stack (they count in RLIMIT_DATA).
    toollog.install(int(cfg.get("log_max_bytes") or toollog.MAX_BYTES), int(cfg.get("log_max_line") or toollog.MAX_LINE))
    threading.stack_size(procs.THREAD_STACK)
    server = ToolServer(cfg)
    server.data_limit = procs.limit_self(cfg.get("server_data_mb", procs.DEFAULT_DATA_MB))
    # PYTHONPATH only exists to find this package; keep it out of the agent's sessions.
    os.environ.pop("PYTHONPATH", None)
    server.serve_forever()
    return 0
