"""A persistent Python interpreter session (variables persist between calls).

The interpreter is a child process (pyrepl.py) so that a timeout can interrupt it with
SIGINT (KeyboardInterrupt in the user's code) and, if it does not yield, kill it and
start a fresh one without touching the tool server.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from .cancel import NEVER, Canceller
from .output import CappedBuffer, finish_text
from .session import Session, call_result
from .guard import check_spawn, child_filter
from .procs import MANAGED, SPAWN_LOCK, apply_limits
from .wire import HEADER

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyrepl.py")
_TICK = 0.1


def _nonblock(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


# A reply is {"status": ..., "exit_code": n}, the first one the driver's version: ~100 bytes. The
# reply pipe is the agent's to write (its code runs in the driver and sees the fd), so nothing
# longer is read, and what is read must be a reply.
MAX_REPLY = 64 * 1024
# What a call drains from the output pipe besides its own output (older output at its start, the
# rest after the reply): more than a pipe holds, so a writer that never stops cannot hold the call.
_DRAIN_BYTES = 4 * 1024 * 1024


class NotAReply(Exception):
    """The reply pipe carried something that is not the driver's reply."""


class _FrameReader:
    def __init__(self, limit: int = MAX_REPLY) -> None:
        self.limit = limit
        self.buf = bytearray()

    def feed(self, data: bytes) -> Optional[dict]:
        self.buf += data
        if len(self.buf) < HEADER.size:
            return None
        (n,) = HEADER.unpack_from(self.buf)
        if n > self.limit:
            raise NotAReply("a frame of %d bytes was announced; replies are at most %d bytes" % (n, self.limit))
        if len(self.buf) < HEADER.size + n:
            return None
        body = bytes(self.buf[HEADER.size: HEADER.size + n])
        del self.buf[: HEADER.size + n]
        if body.count(b"{") + body.count(b"[") > 1:
            # Replies are flat objects. Nesting is what a parser recurses into: on Python >= 3.12
            # the C recursion limit (up to 10,000) can outlast a thread's 1 MiB stack.
            raise NotAReply("a frame with nested JSON")
        try:
            reply = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise NotAReply("a frame of %d bytes that is not UTF-8 JSON" % n) from None
        if not isinstance(reply, dict):
            raise NotAReply("a JSON %s instead of an object" % type(reply).__name__)
        code = reply.get("exit_code")
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
            raise NotAReply("an exit_code of type %s" % type(code).__name__)
        return reply


class PythonSession(Session):
    def __init__(self, env: Dict[str, str], cwd: str, python: str = sys.executable, **session: Any) -> None:
        super().__init__(env, cwd, **session)  # limits, max_output, interrupt_grace: Session
        self.python = python
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 15.0) -> None:
        check_spawn()  # not while a grader runs
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            SPAWN_LOCK.acquire()
            check_spawn()
            self.proc = subprocess.Popen(
                [self.python, "-u", DRIVER, str(req_r), str(resp_w)],
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                pass_fds=(req_r, resp_w), env=self.env, cwd=self.cwd,
                start_new_session=True,  # its own process group: SIGINT reaches its children too
                preexec_fn=child_filter(),  # guard.py's seccomp filter
            )
            MANAGED.add(self.proc.pid)
        except BaseException:
            for fd in (req_w, resp_r, out_r):
                os.close(fd)
            raise
        finally:
            SPAWN_LOCK.release()
            for fd in (req_r, resp_w, out_w):
                os.close(fd)
        apply_limits(self.proc.pid, self.limits)
        self.req_w, self.resp_r, self.out_r = req_w, resp_r, out_r
        _nonblock(req_w)  # its write has the call's deadline (_send)
        _nonblock(resp_r)
        _nonblock(out_r)
        self.reader = _FrameReader()
        hello = self._wait_reply(time.monotonic() + timeout, CappedBuffer(4096), NEVER)
        if not isinstance(hello, dict) or not hello.get("ready"):
            self.kill()
            raise RuntimeError("python session did not start (%s)" % (hello,))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        MANAGED.discard(proc.pid)
        for fd in (self.req_w, self.resp_r, self.out_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def run(self, code: str, timeout: float, canceller: Canceller = NEVER) -> Dict:
        t0 = time.monotonic()
        notes = self.take_unreported()
        notes += self.revive("[the previous Python session had died; a fresh one was started, state lost]")
        buf = CappedBuffer(self.max_output)
        self._drain(self.out_r, buf, discard=True)
        # The driver answers each request once and that answer was read: anything waiting on the
        # reply pipe now was written by the agent's code. It is not this call's reply.
        self._drain(self.resp_r, buf, discard=True)
        self.reader = _FrameReader()
        body = json.dumps({"code": code}).encode("utf-8")
        frame = HEADER.pack(len(body)) + body
        timed_out = cancelled = False
        try:
            sent = self._send(frame, t0 + timeout, canceller)
        except BrokenPipeError:
            sent = reply = "eof"
        if sent in ("timeout", "cancelled"):
            # Part of the request may be in the pipe: the driver can never read the next one.
            timed_out, cancelled = sent == "timeout", sent == "cancelled"
            self._lost(notes, "[the Python session read no code within %s (code of an earlier call still holds "
                              "it); the session was killed and restarts on the next call, state lost]"
                       % ("the timeout of %gs" % timeout if timed_out else "the call"))
            reply = None
        elif sent == "sent":
            reply = self._wait_reply(t0 + timeout, buf, canceller)
        if reply in ("timeout", "cancelled"):
            timed_out, cancelled = reply == "timeout", reply == "cancelled"
            notes.append(("[execution timed out after %gs and was interrupted]" % timeout) if timed_out
                         else "[call cancelled by the client; execution interrupted]")
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass
            reply = self._wait_reply(time.monotonic() + self.interrupt_grace, buf, NEVER)
            if not isinstance(reply, (dict, NotAReply)):
                self._lost(notes, "[the session ignored the interrupt and was killed; a fresh one starts on the next "
                                  "call, state lost]")
                reply = None
        exit_code, error = None, None
        if isinstance(reply, NotAReply):
            error = ("the Python session's reply pipe carried something that is not a reply (%s: code wrote to "
                     "the session's own descriptor); the session was killed and restarts on the next call, "
                     "state lost" % reply)
            self._lost(notes, "[the Python session was killed: %s]" % error)
        elif reply == "eof":
            code_ = self.proc.wait() if self.proc else None
            self._lost(notes, "[the Python process exited (code %s); a fresh session starts on the next call, state lost]"
                       % code_)
            exit_code = code_
        elif isinstance(reply, dict):
            exit_code = reply.get("exit_code")
            self._drain(self.out_r, buf)
        data, truncated = buf.getvalue()
        out = call_result(finish_text(data), truncated, notes, exit_code, t0, timed_out, cancelled)
        if error:
            out["error"] = error
        return out

    def _send(self, frame: bytes, deadline: float, canceller: Canceller) -> str:
        """Write the request: "sent", or "timeout" / "cancelled" with it not all written. The pipe
        holds 64 KiB; the driver reads the rest unless the agent's code keeps it busy after a reply
        of its own (BrokenPipeError: the driver is gone)."""
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(self.req_w, view):]
                continue
            except BlockingIOError:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            try:
                r, _, _ = select.select(canceller.fds(), [self.req_w], [], min(remaining, _TICK))
            except InterruptedError:
                continue
            if r and canceller.poll():
                return "cancelled"
        return "sent"

    def _lost(self, notes: List[str], note: str) -> None:
        """Kill the session (a fresh one starts on the next call) and tell this call's caller."""
        self.kill()
        self.restarts += 1
        notes.append(note)
        self.restart_notes.append(note)

    @staticmethod
    def _drain(fd: int, buf: CappedBuffer, discard: bool = False) -> None:
        """What the pipe holds now, up to _DRAIN_BYTES (a writer that never stops cannot hold us)."""
        left = _DRAIN_BYTES
        while left > 0:
            try:
                data = os.read(fd, 65536)
            except OSError:  # BlockingIOError: empty for now
                return
            if not data:
                return
            left -= len(data)
            if not discard:
                buf.write(data)

    def _wait_reply(self, deadline: float, buf: CappedBuffer, canceller: Canceller):
        """Collect output until the driver replies. Returns the reply dict, a status str, or the
        NotAReply the reply pipe gave."""
        out_open = True
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            watch = [self.resp_r] + ([self.out_r] if out_open else []) + canceller.fds()
            try:
                r, _, _ = select.select(watch, [], [], min(remaining, _TICK))
            except InterruptedError:
                continue
            if not r:
                if self.proc is not None and self.proc.poll() is not None:
                    return "eof"
                continue
            if self.out_r in r:
                try:
                    data = os.read(self.out_r, 65536)
                except BlockingIOError:
                    data = None
                if data == b"":
                    out_open = False
                elif data:
                    buf.write(data)
            if self.resp_r in r:
                try:
                    data = os.read(self.resp_r, 65536)
                except BlockingIOError:
                    data = None
                if data == b"":
                    return "eof"
                if data:
                    try:
                        reply = self.reader.feed(data)
                    except NotAReply as e:
                        return e
                    if reply is not None:
                        return reply
            for fd in canceller.fds():
                if fd in r and canceller.poll():
                    return "cancelled"
