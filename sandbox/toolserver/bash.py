"""A persistent bash session on a pseudo-terminal, driven by a unique prompt marker.

How one call works (no sleeps, no polling of a screen):
  * the command text is written to a file and ``source``d with stdin from /dev/null, so a
    multi-line command is one unit, heredocs work, and programs reading stdin get EOF;
  * before that, the same text wrapped in a function definition is sourced: defining a
    function parses without executing, so an unterminated quote or heredoc is reported as
    an error and nothing runs;
  * PS1 is a marker carrying a random per-shell token, the call's sequence number and the
    exit status; reading the pty until that marker gives output + exit code exactly.
Interactive bash with job control keeps the foreground job in its own process group, so a
timeout can SIGINT just that group, like Ctrl-C at a terminal.
"""
from __future__ import annotations

import errno
import os
import re
import select
import shlex
import signal
import termios
import time
from typing import Dict, Optional, Tuple

from ptyprocess import PtyProcess

from .cancel import NEVER, Canceller
from .output import DEFAULT_MAX_OUTPUT, CappedBuffer, finish_text
from .session import Session, call_result
from .procs import MANAGED, SPAWN_LOCK, apply_limits, kill_pids, session_members

# Bytes held back from the output in case they are the start of a marker split across reads.
_KEEP = 128
_TICK = 0.1


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class ShellStartError(RuntimeError):
    pass


def _child_setup() -> None:
    """In the child, before exec.

    Python ignores SIGPIPE (and we ignore SIGHUP); ignored signals survive exec, so without
    this `ls | head` would print "Broken pipe" errors and `yes | head` could spin.
    No CR before LF: set here rather than from the parent, which would race bash's first prompt.
    """
    for sig in (signal.SIGPIPE, signal.SIGHUP, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    attrs = termios.tcgetattr(0)
    attrs[1] &= ~termios.ONLCR
    termios.tcsetattr(0, termios.TCSANOW, attrs)


class BashSession(Session):
    def __init__(
        self,
        ctl_dir: str,
        env: Dict[str, str],
        cwd: str,
        shell: str = "/bin/bash",
        limits: Optional[Dict[str, Optional[float]]] = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        interrupt_grace: float = 1.0,
    ) -> None:
        self.ctl_dir = ctl_dir
        self.env = dict(env)
        self.cwd = cwd
        self.shell = shell
        self.limits = limits or {}
        self.max_output = max_output
        self.interrupt_grace = interrupt_grace
        self.proc: Optional[PtyProcess] = None
        self.seq = 0
        self.restarts = 0
        self.token = ""

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        self.token = os.urandom(8).hex()
        prompt = "\\n__RLD_%s_${__rld_n}_${__rld_rc}__\\n" % self.token
        self._ps1 = prompt
        env = dict(self.env)
        env.update(PS1=prompt, PS2="", PS4="+ ")
        env.pop("PROMPT_COMMAND", None)
        argv = [self.shell, "--noprofile", "--norc", "--noediting", "+H", "+o", "history", "-i"]
        with SPAWN_LOCK:
            self.proc = PtyProcess.spawn(argv, env=env, cwd=self.cwd, echo=False, dimensions=(50, 200),
                                         preexec_fn=_child_setup)
            MANAGED.add(self.proc.pid)
        apply_limits(self.proc.pid, self.limits)
        # \r? in case something (stty sane...) turns ONLCR back on.
        self._pattern = re.compile(rb"\r?\n__RLD_" + self.token.encode() + rb"_(\d*)_(\d*)__\r?\n")
        self.seq = 0
        seen = CappedBuffer(4096)
        status, _, _ = self._read_until(time.monotonic() + timeout, seen, NEVER, expect="")
        if status != "marker":
            self.kill()
            raise ShellStartError("bash did not show its prompt (%s); it printed %r" % (status, seen.getvalue()[0][-300:]))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.isalive()

    def kill(self) -> None:
        """Kill the shell and everything left in its session (background jobs)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        kill_pids(session_members(proc.pid) + [proc.pid], signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if not proc.isalive():
                    break
            except Exception:
                break
            time.sleep(0.005)
        MANAGED.discard(proc.pid)
        try:
            proc.fileobj.close()
        except OSError:
            pass
        proc.closed = True  # keep ptyprocess.__del__ from sleeping/terminating again

    # -- one call --------------------------------------------------------------------
    def run(self, command: str, timeout: float, canceller: Canceller = NEVER) -> Dict:
        t0 = time.monotonic()
        notes = self.revive("[the previous shell had exited; a fresh shell was started]")
        self._drain()
        self.seq += 1
        n = self.seq
        # Fresh files per call, removed afterwards (truncating and rewriting the same file
        # makes ext4 flush it to disk on close: milliseconds per call).
        os.makedirs(self.ctl_dir, exist_ok=True)  # the agent may have removed it
        base = os.path.join(self.ctl_dir, "cmd%d" % n)
        chk, src, err = base + ".chk", base + ".sh", base + ".err"
        text = command.encode("utf-8", errors="surrogateescape")
        _write(chk, b"__rld_chk() {\n" + text + b"\n}\n")
        _write(src, text + b"\n")
        # `jobs >/dev/null` consumes bash's "[1]+ Done ..." notices about jobs that ended
        # between calls, which would otherwise land in this call's output.
        # PS1 is re-asserted every call so a command that changes it cannot hide the marker.
        line = "__rld_n=%d; jobs >/dev/null; source %s 2>%s </dev/null && unset -f __rld_chk && source %s </dev/null; __rld_rc=$?; PS1=%s\n" % (
            n, shlex.quote(chk), shlex.quote(err), shlex.quote(src), shlex.quote(self._ps1))
        self._line = line.encode()
        buf = CappedBuffer(self.max_output)
        os.write(self.proc.fd, self._line)
        status, rc, tail = self._read_until(t0 + timeout, buf, canceller, expect=str(n))
        timed_out = cancelled = False
        if status in ("timeout", "cancelled"):
            timed_out = status == "timeout"
            cancelled = status == "cancelled"
            # rc: 130 after Ctrl-C, 137 after SIGKILL, None if the shell had to go.
            status, rc, note = self._interrupt(buf, str(n))
            notes.append(("[command timed out after %gs and was interrupted]" % timeout) if timed_out
                         else "[call cancelled by the client; command interrupted]")
            if note:
                notes.append(note)
        if status == "eof":
            code = self._exit_status()
            rc = code
            self.kill()
            self.restarts += 1
            self.start()
            notes.append("[the shell exited (code %s); a fresh shell was started: cwd, variables and jobs were reset]" % code)
        syntax_error = self._read_err(err)
        for path in (chk, src, err):
            try:
                os.unlink(path)
            except OSError:
                pass
        data, truncated = buf.getvalue()
        text = finish_text(data)
        if text.startswith(line.rstrip("\n")):  # someone re-enabled echo with stty
            text = text[len(line):]
        result = call_result(text, truncated, notes, rc, t0, timed_out, cancelled)
        if syntax_error:
            result["error"] = "bash syntax error, command not run: " + syntax_error
        return result

    # -- internals -------------------------------------------------------------------
    def _read_err(self, path: str) -> str:
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as f:
                msg = f.read().strip()
        except OSError:
            return ""
        if not msg:
            return ""
        # Point line numbers at the user's text, not the wrapper (one line longer).
        def fix(m: "re.Match[str]") -> str:
            return "line %d" % max(1, int(m.group(1)) - 1)
        msg = re.sub(r"^.*?\.chk: ", "", msg, flags=re.M)
        msg = re.sub(r"^bash: ", "", msg, flags=re.M)
        msg = re.sub(r"line (\d+)", fix, msg)
        if "here-document" in msg:  # the EOF error that follows points into our wrapper
            msg = "\n".join(l for l in msg.splitlines() if "unexpected end of file" not in l)
            msg = msg.replace("warning: here-document", "unterminated here-document")
        return msg

    def _drain(self) -> None:
        """Discard output produced between calls (background jobs, job notices)."""
        fd = self.proc.fd
        while True:
            r, _, _ = select.select([fd], [], [], 0)
            if not r:
                return
            try:
                if not os.read(fd, 65536):
                    return
            except OSError:
                return

    def _read_until(self, deadline: float, buf: CappedBuffer, canceller: Canceller, expect: str
                    ) -> Tuple[str, Optional[int], bytes]:
        """Read the pty into ``buf`` until the marker numbered ``expect`` shows up.

        Returns (status, exit_code, leftover) with status one of
        marker | timeout | cancelled | eof.
        """
        fd = self.proc.fd
        pending = bytearray()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                buf.write(bytes(pending))
                return "timeout", None, b""
            watch = [fd] + canceller.fds()
            try:
                r, _, _ = select.select(watch, [], [], min(remaining, _TICK))
            except InterruptedError:
                continue
            if not r:
                if not self.proc.isalive():  # exited while a background job holds the pty open
                    buf.write(bytes(pending))
                    return "eof", None, b""
                continue
            if fd not in r:
                if canceller.poll():
                    buf.write(bytes(pending))
                    return "cancelled", None, b""
                continue
            try:
                data = os.read(fd, 65536)
            except OSError as e:
                if e.errno != errno.EIO:
                    raise
                data = b""
            if not data:
                buf.write(bytes(pending))
                return "eof", None, b""
            pending += data
            while True:
                m = self._pattern.search(pending)
                if m is None:
                    break
                if m.group(1).decode() == expect:
                    buf.write(bytes(pending[: m.start()]))
                    rc = int(m.group(2)) if m.group(2) else None
                    return "marker", rc, bytes(pending[m.end():])
                del pending[m.start(): m.end()]  # a stale prompt (e.g. after a late SIGINT)
            if len(pending) > _KEEP:
                buf.write(bytes(pending[:-_KEEP]))
                del pending[:-_KEEP]

    def _interrupt(self, buf: CappedBuffer, expect: str) -> Tuple[str, Optional[int], str]:
        """Ctrl-C the foreground job; escalate to SIGKILL, then to a fresh shell."""
        shell_pid = self.proc.pid
        try:
            pgrp = os.tcgetpgrp(self.proc.fd)
        except OSError:
            pgrp = shell_pid
        for sig in (signal.SIGINT, signal.SIGKILL):
            if sig == signal.SIGKILL and pgrp == shell_pid:
                break  # never SIGKILL the shell's own group here: that is a restart
            try:
                os.killpg(pgrp, sig)
            except (ProcessLookupError, PermissionError):
                pass
            status, rc, _ = self._read_until(time.monotonic() + self.interrupt_grace, buf, NEVER, expect)
            if status == "marker":
                # bash reports an interrupted `source` as 2; report the signal convention.
                return status, 128 + int(sig), ""
            if status == "eof":
                return status, None, ""
        self.kill()
        self.restarts += 1
        self.start()
        return "restarted", None, "[the command ignored interrupts; the shell was killed and a fresh one started]"

    def _exit_status(self) -> Optional[int]:
        proc = self.proc
        if proc is None:
            return None
        deadline = time.monotonic() + 1.0
        while proc.isalive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.isalive():
            return None
        if proc.exitstatus is not None:
            return proc.exitstatus
        if proc.signalstatus is not None:
            return 128 + proc.signalstatus
        return None
