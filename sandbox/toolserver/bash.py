"""A persistent bash session on a pseudo-terminal; the wrapper talks to us on descriptors the
agent's output cannot reach.

How one call works (no sleeps, no polling of a screen):
  * the command text goes into an anonymous in-memory file (memfd) the shell holds open on
    fd 251 and is ``source``d from /dev/fd/251 with stdin from /dev/null, so a multi-line
    command is one unit, heredocs work, programs reading stdin get EOF and line numbers are
    the user's. There is no scratch directory the agent could chmod, replace or delete;
  * before that, the same text wrapped in a function definition (fd 250) is sourced: defining
    a function parses without executing, so an unterminated quote or heredoc is reported as an
    error (its stderr goes to fd 253) and nothing runs;
  * completion and exit status travel on a pipe (fd 254, read end only in the tool server),
    tagged with a random per-call nonce that only ever exists in the line we type: printing a
    "marker" cannot end a call, and PS1/PROMPT_COMMAND play no part, so a readonly PS1 or any
    variable the agent sets cannot hang it. Two nonce-tagged delimiters in the pty stream cut
    the call's output out of what the terminal shows (prompts, job notices, between-call noise);
  * the wrapper is invisible: between calls the shell sits in "wrapper mode" (no DEBUG trap, no
    xtrace/verbose). The user's DEBUG trap and -x/-v are saved to fd 252 when a command ends and
    restored, inside the sourced file, just before the user's first command, so traps and
    traces see exactly the user's commands. Wrapper commands are ``\\builtin``-prefixed (immune
    to aliases), use no variables (nothing to make readonly) and survive set -u/-e/-C, xpg_echo.
Before every call the tool server checks that fds 250-254 are still ours (the agent can close
or replace them with ``exec``) and resets the terminal modes (``stty``); either breakage starts
a fresh shell and the reply says so.
Interactive bash with job control keeps the foreground job in its own process group, so a
timeout can SIGINT just that group, like Ctrl-C at a terminal.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import select
import signal
import subprocess
import tempfile
import termios
import time
from typing import Any, Dict, List, Optional, Tuple

from ptyprocess import PtyProcess

from .cancel import NEVER, Canceller
from .guard import check_spawn, child_filter
from .output import CappedBuffer, finish_text
from .procs import MANAGED, SPAWN_LOCK, apply_limits, kill_pids, managed, session_members
from .session import Session, call_result

# The shell's descriptors: high, so an agent's own `exec 3>log` never collides; below 255,
# which bash keeps for its terminal.
FD_CHECK, FD_SOURCE, FD_STATE, FD_ERR, FD_CTL = 250, 251, 252, 253, 254
# The terminal, for our delimiters: the agent may point the shell's stdout elsewhere
# (`exec >/dev/null`), and the delimiters must still reach the pty.
FD_TTY = 249
_FILES = (FD_CHECK, FD_SOURCE, FD_STATE, FD_ERR)
_TICK = 0.1
# How long (x 2 ms) the next call waits for the shell to leave the last report's `>&254`.
_STDOUT_SETTLE_STEPS = 500
# After the exit status arrived, how long the end delimiter may lag in the pty (it was written
# first; only a terminal mangled by the command itself can lose it).
_END_GRACE = 2.0
_TAMPERED = ("[the shell's control descriptors (fds 249-254) were closed or replaced; a fresh shell was started: "
             "cwd, variables and jobs were reset]")
_EXITED = ("[the shell exited after the command (e.g. it read end-of-file from its terminal, or an `exit` in a "
           "trap); a fresh shell was started: cwd, variables and jobs were reset]")
_STDOUT = ("[the shell's standard output is not the terminal (e.g. `exec >/dev/null`): commands' output goes "
           "there; `exec >/dev/tty 2>&1` brings it back]")

# Save $? into fd 253 and the user's DEBUG trap and -x/-v into fd 252, and leave them off
# ("wrapper mode"). Output goes to /dev/null, so a DEBUG trap firing on these lines shows
# nothing; the trap is saved by a simple command whose redirection applies after the trap ran.
_SAVE = ("{ \\builtin printf %%s \"$?\" >|/dev/fd/%(err)d; \\builtin trap -p DEBUG >|/dev/fd/%(state)d; "
         "\\builtin trap - DEBUG; [[ $- == *x* ]] && \\builtin printf '%%s\\n' '\\builtin set -x' >>/dev/fd/%(state)d; "
         "[[ $- == *v* ]] && \\builtin printf '%%s\\n' '\\builtin set -v' >>/dev/fd/%(state)d; "
         "\\builtin set +xv; IGNOREEOF=2147483647; } >/dev/null 2>&1")
# What the sourced command file starts with, on the user's first line (line numbers stay theirs).
_RESTORE = b"\\builtin source /dev/fd/%d >/dev/null 2>&1; " % FD_STATE


def _tags(nonce: str) -> Tuple[bytes, bytes]:
    # Upper-case hex and letters only: no terminal output mode (olcuc, onlcr, ...) changes them.
    return ("RLDS%sRLDS" % nonce).encode(), ("RLDE%sRLDE" % nonce).encode()


_SAVE = _SAVE % dict(err=FD_ERR, state=FD_STATE)


def _call_line(nonce: str) -> bytes:
    """Typed at the prompt for one call: check, run, save state, delimit, report.

    A failed check leaves bash's message in fd 253; a run leaves its exit status there."""
    start, end = _tags(nonce)
    return ("\\builtin printf %%s %s >&%d; "
            "if { \\builtin source /dev/fd/%d && \\builtin unset -f __rld_chk; } >/dev/null 2>|/dev/fd/%d; "
            # `&& S || S`: the source is not the last of an and-or list, so the user's ERR trap
            # and set -e do not fire a second time for it; $? is its status in either branch.
            "then { \\builtin source /dev/fd/%d </dev/null; } && %s || %s; fi; "
            "\\builtin printf %%s %s >&%d; \\builtin printf '\\n%%s\\n' %s >&%d\n"
            % (start.decode(), FD_TTY, FD_CHECK, FD_ERR, FD_SOURCE, _SAVE, _SAVE, end.decode(), FD_TTY, nonce,
               FD_CTL)).encode()


def _sync_line(nonce: str) -> bytes:
    """Typed after an interrupt (or at start): back to wrapper mode, delimit, report."""
    start, end = _tags(nonce)
    return ("\\builtin printf %%s %s >&%d; %s; \\builtin printf %%s %s >&%d; \\builtin printf '\\n%%s\\n' %s >&%d\n"
            % (start.decode(), FD_TTY, _SAVE, end.decode(), FD_TTY, nonce, FD_CTL)).encode()


def _anon_file(name: str) -> int:
    """An in-memory file with no path anyone could chmod or replace."""
    try:
        return os.memfd_create("rld-" + name)
    except (AttributeError, OSError):  # pre-3.17 kernel / no memfd: an unlinked temp file
        fd, path = tempfile.mkstemp(prefix="rld-")
        os.unlink(path)
        return fd


def _put(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    view = memoryview(data)
    off = 0
    while off < len(data):
        off += os.pwrite(fd, view[off:], off)


def _identity(path_or_fd) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path_or_fd) if isinstance(path_or_fd, str) else os.fstat(path_or_fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class ShellStartError(RuntimeError):
    pass


def _child_setup(fds: List[Tuple[int, int]]):
    confine = child_filter()  # built here, installed in the child

    def setup() -> None:
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
        for src, dst in fds:
            os.dup2(src, dst)  # inheritable: the shell keeps them across exec
        os.dup2(0, FD_TTY)  # the pty slave
        confine()  # last: the seccomp filter of guard.py
    return setup


class BashSession(Session):
    def __init__(self, env: Dict[str, str], cwd: str, shell: str = "/bin/bash", **session: Any) -> None:
        super().__init__(env, cwd, **session)  # limits, max_output, interrupt_grace: Session
        self.shell = shell
        self.proc: Optional[PtyProcess] = None
        self._files: Dict[int, int] = {}   # fd number in the shell -> our fd
        self._ctl_r: Optional[int] = None
        self._ctl_buf = bytearray()

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        check_spawn()  # not while a grader runs
        self._files = {n: _anon_file(str(n)) for n in _FILES}
        ctl_r, ctl_w = os.pipe()
        self._ctl_r, self._ctl_buf = ctl_r, bytearray()
        env = dict(self.env)
        env.update(PS1="", PS2="", PS4="+ ")
        env.pop("PROMPT_COMMAND", None)
        argv = [self.shell, "--noprofile", "--norc", "--noediting", "+H", "+o", "history", "-i"]
        pairs = [(ours, n) for n, ours in self._files.items()] + [(ctl_w, FD_CTL)]
        try:
            with SPAWN_LOCK:
                check_spawn()
                self.proc = PtyProcess.spawn(argv, env=env, cwd=self.cwd, echo=False, dimensions=(50, 200),
                                             preexec_fn=_child_setup(pairs), pass_fds=[p[0] for p in pairs])
                MANAGED.add(self.proc.pid)
        except BaseException:
            self.kill()  # closes the memfds and the read end
            raise
        finally:
            os.close(ctl_w)  # the shell holds the only write end: its exit is EOF here
        apply_limits(self.proc.pid, self.limits)
        self._tty = termios.tcgetattr(self.proc.fd)
        self._ids = {n: _identity(fd) for n, fd in self._files.items()}
        self._ids[FD_CTL] = _identity(ctl_r)  # a pipe's two ends share one inode
        self._ids[FD_TTY] = _identity("/proc/%d/fd/%d" % (self.proc.pid, FD_TTY))
        nonce = self._nonce()
        status = self._exchange(nonce, _sync_line(nonce), time.monotonic() + timeout, CappedBuffer(4096), NEVER,
                                keep_before_start=False)
        if status != "done":
            self.kill()
            raise ShellStartError("bash did not answer its first line (%s)" % status)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.isalive()

    def kill(self) -> None:
        """Kill the shell and everything left in its session (background jobs)."""
        proc, self.proc = self.proc, None
        for fd in list(self._files.values()) + ([self._ctl_r] if self._ctl_r is not None else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self._files, self._ctl_r = {}, None
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

    def intact(self) -> bool:
        """Are the shell's fds 250-254 still the ones we gave it? (`exec 254>&-` etc.)"""
        pid = self.proc.pid
        return all(_identity("/proc/%d/fd/%d" % (pid, n)) == ident for n, ident in self._ids.items())

    # -- one call --------------------------------------------------------------------
    def run(self, command: str, timeout: float, canceller: Canceller = NEVER) -> Dict:
        t0 = time.monotonic()
        notes = self.take_unreported()
        notes += self.revive("[the previous shell had exited; a fresh shell was started: cwd, variables and jobs were reset]")
        if not self.intact():
            self.restart_noted(notes, _TAMPERED)
        elif not self._stdout_is_terminal():  # checked while the shell is idle at its prompt
            notes.append(_STDOUT)
        text = command.encode("utf-8", errors="surrogateescape")
        # The empty line: a trailing backslash continues onto it, not onto the closing brace.
        _put(self._files[FD_CHECK], b"__rld_chk() {\n" + text + b"\n\n}\n")
        os.ftruncate(self._files[FD_ERR], 0)  # its status appears there once the command is done
        _put(self._files[FD_SOURCE], _RESTORE + text + b"\n")
        # A command may have left the terminal raw, echoing or translating (stty): reset it
        # (only then: setting the modes of a pty costs milliseconds).
        if termios.tcgetattr(self.proc.fd) != self._tty:
            termios.tcsetattr(self.proc.fd, termios.TCSANOW, self._tty)
        buf = CappedBuffer(self.max_output)
        nonce = self._nonce()
        status = self._exchange(nonce, _call_line(nonce), t0 + timeout, buf, canceller, keep_before_start=False)
        rc: Optional[int] = None
        timed_out = cancelled = False
        syntax_error = ""
        if status in ("timeout", "cancelled"):
            timed_out, cancelled = status == "timeout", status == "cancelled"
            # rc: 130 after Ctrl-C, 137 after SIGKILL, None if the shell had to go.
            status, rc, note = self._interrupt(buf)
            notes.append(("[command timed out after %gs and was interrupted]" % timeout) if timed_out
                         else "[call cancelled by the client; command interrupted]")
            if note:
                self.restart_noted(notes, note, restart=False)
        if status in ("eof", "ctl_eof"):
            # An exiting shell closes fd 254 too; a live one closed it itself (`exec 254>&-`).
            rc = self._exit_status()
            what = ("exited (code %s)" % rc) if rc is not None or status == "eof" else "closed its control descriptor"
            self.restart_noted(notes, "[the shell %s; a fresh shell was started: cwd, variables and jobs were reset]"
                               % what)
        elif status == "done" and not timed_out and not cancelled:
            rc, syntax_error = self._outcome(text)
        if status == "done" and not self.alive():  # the command ran; the shell went after it
            self.restart_noted(notes, _EXITED)
        elif status == "done" and not self.intact():  # e.g. `exec 253>&-`: its status is not to be trusted
            rc = None
            self.restart_noted(notes, _TAMPERED)

        data, truncated = buf.getvalue()
        if timed_out or cancelled:  # the interrupted line's own delimiters, if it got that far
            data = re.sub(rb"RLD([SE])[0-9A-F]{16}RLD\1", b"", data)
        result = call_result(finish_text(data), truncated, notes, rc, t0, timed_out, cancelled)
        if syntax_error:
            result["error"] = "bash syntax error, command not run: " + syntax_error
        return result

    # -- internals -------------------------------------------------------------------
    def restart_noted(self, notes: List[str], note: str, restart: bool = True) -> None:
        """Restart (unless already done) and tell this call's caller, or the next one if this
        caller never reads its reply (see Session.defer)."""
        if restart:
            self.kill()
            self.restarts += 1
            self.start()
        notes.append(note)
        self.restart_notes.append(note)

    @staticmethod
    def _nonce() -> str:
        return secrets.token_hex(8).upper()

    def _outcome(self, text: bytes) -> Tuple[Optional[int], str]:
        """(exit status, "") after a run, (None, bash's message) after a failed check: fd 253."""
        try:
            msg = os.pread(self._files[FD_ERR], 65536, 0).decode("utf-8", errors="replace").strip()
        except OSError:
            return None, ""
        if msg.isdigit():
            return int(msg), ""
        if not msg:
            return None, ""
        return None, self._explain(text) or self._translate(msg)

    def _explain(self, text: bytes) -> str:
        """The check's message can quote our wrapper (an unclosed `if` meets its `}`); `bash -n`
        on the text alone says what bash says of it as a script. Only after a failed check."""
        try:
            with managed(lambda: subprocess.Popen([self.shell, "-n"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, env=self.env, cwd=self.cwd)) as p:
                try:
                    _, err = p.communicate(text + b"\n", timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
                    return ""
        except OSError:
            return ""
        msg = err.decode("utf-8", errors="replace").strip()
        if p.returncode == 0 and "here-document" not in msg:
            return ""  # bash -n accepts it (an alias of the live shell made the difference)
        msg = re.sub(r"^(?:%s|bash): " % re.escape(self.shell), "", msg, flags=re.M)
        return msg.replace("warning: here-document", "unterminated here-document")

    @staticmethod
    def _translate(msg: str) -> str:
        # Point line numbers at the user's text, not the wrapper (one line longer).
        def fix(m: "re.Match[str]") -> str:
            return "line %d" % max(1, int(m.group(1)) - 1)
        msg = re.sub(r"^.*?/dev/fd/%d: " % FD_CHECK, "", msg, flags=re.M)
        msg = re.sub(r"^bash: ", "", msg, flags=re.M)
        msg = re.sub(r"line (\d+)", fix, msg)
        if "here-document" in msg:  # the EOF error that follows points into our wrapper
            msg = "\n".join(l for l in msg.splitlines() if "unexpected end of file" not in l)
            msg = msg.replace("warning: here-document", "unterminated here-document")
        return msg

    def _exchange(self, nonce: str, line: bytes, deadline: float, buf: CappedBuffer, canceller: Canceller,
                  keep_before_start: bool) -> str:
        """Type ``line`` and collect the pty between its two delimiters into ``buf``."""
        view = memoryview(line)
        while view:  # a pty takes a few KiB at once; our line is far shorter, but be exact
            view = view[os.write(self.proc.fd, view):]
        return self._collect(nonce, deadline, buf, canceller, keep_before_start)

    def _collect(self, nonce: str, deadline: float, buf: CappedBuffer, canceller: Canceller,
                 keep_before_start: bool) -> str:
        """Returns done | timeout | cancelled | eof | ctl_eof. Done means the line reported on
        fd 254 (the only proof of completion) and its output was cut out of the pty stream."""
        start, end = _tags(nonce)
        report = b"\n%s\n" % nonce.encode()
        fd, ctl = self.proc.fd, self._ctl_r
        pending = bytearray()
        started = ended = reported = False
        end_deadline = None
        span = deadline - time.monotonic()  # the command's time counts from its start delimiter

        def flush(upto: int) -> None:
            if upto > 0:
                buf.write(bytes(pending[:upto]))
                del pending[:upto]

        while True:
            now = time.monotonic()
            limit = deadline if end_deadline is None else min(deadline, end_deadline)
            if now >= limit:
                if end_deadline is None and self._finished():
                    # It completed in time; only the report is in flight.
                    end_deadline = deadline = now + _END_GRACE
                    continue
                flush(len(pending))
                if reported:
                    return "done"  # the terminal lost our delimiter; completion is certain
                return "timeout"
            watch = [fd, ctl] + canceller.fds()
            try:
                r, _, _ = select.select(watch, [], [], min(limit - now, _TICK))
            except InterruptedError:
                continue
            if not r:
                if not self.proc.isalive():  # exited while a background job holds the pty open
                    flush(len(pending))
                    return "eof"
                continue
            if ctl in r:
                data = os.read(ctl, 65536)
                if not data:
                    flush(len(pending))
                    return "ctl_eof"
                self._ctl_buf += data
                i = self._ctl_buf.find(report)
                if i >= 0:
                    del self._ctl_buf[:i + len(report)]
                    reported = True
                    if ended:
                        return "done"
                    end_deadline = time.monotonic() + _END_GRACE
                elif len(self._ctl_buf) > 65536:  # junk the agent wrote on fd 254
                    del self._ctl_buf[:-256]
            if fd in r:
                try:
                    data = os.read(fd, 65536)
                except OSError as e:
                    if e.errno != errno.EIO:
                        raise
                    data = b""
                if not data:
                    flush(len(pending))
                    return "eof"
                if ended:
                    continue  # the prompt after our line
                pending += data
                if not started:
                    i = pending.find(start)
                    if i < 0:
                        keep = max(0, len(pending) - len(start))
                        if keep_before_start:
                            flush(keep)
                        else:
                            del pending[:keep]
                        continue
                    if keep_before_start:
                        flush(i)
                    del pending[: i + len(start) - (i if keep_before_start else 0)]
                    started = True
                    deadline = max(deadline, time.monotonic() + span)
                i = pending.find(end)
                if i >= 0:
                    flush(i)
                    pending.clear()
                    ended = True
                    if reported:
                        return "done"
                else:
                    flush(len(pending) - len(end))
            if canceller.fds() and any(f in r for f in canceller.fds()) and canceller.poll():
                flush(len(pending))
                return "cancelled"

    def _interrupt(self, buf: CappedBuffer) -> Tuple[str, object, str]:
        """Ctrl-C the foreground job; escalate to SIGKILL, then to a fresh shell.

        The interrupted line never reports, so a second line (typed once, read by bash when it
        is back at its prompt) re-enters wrapper mode and reports; the output up to it is kept.
        That line is typed only once the shell owns the terminal again: a program still in the
        foreground (less, vi) would read it as keystrokes.
        """
        shell_pid = self.proc.pid
        try:
            pgrp = os.tcgetpgrp(self.proc.fd)
        except OSError:
            pgrp = shell_pid
        nonce = self._nonce()
        typed = False
        for sig in (signal.SIGINT, signal.SIGKILL):
            if sig == signal.SIGKILL and pgrp == shell_pid:
                break  # never SIGKILL the shell's own group here: that is a restart
            try:
                os.killpg(pgrp, sig)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + self.interrupt_grace
            if not typed:
                if not self._shell_in_foreground(shell_pid, deadline, buf):
                    continue
                typed = True
                status = self._exchange(nonce, _sync_line(nonce), deadline, buf, NEVER, keep_before_start=True)
            else:
                status = self._collect(nonce, deadline, buf, NEVER, keep_before_start=True)
            if status == "done":
                # bash reports an interrupted `source` as 2; report the signal convention.
                return status, 128 + int(sig), ""
            if status in ("eof", "ctl_eof"):
                return status, None, ""
        self.kill()
        self.restarts += 1
        self.start()
        return "restarted", None, "[the command ignored interrupts; the shell was killed and a fresh one started: " \
                                  "cwd, variables and jobs were reset]"

    def _shell_in_foreground(self, shell_pid: int, deadline: float, buf: CappedBuffer) -> bool:
        """Wait (keeping the output) until the shell's own group holds the terminal again."""
        fd = self.proc.fd
        while True:
            try:
                if os.tcgetpgrp(fd) == shell_pid:
                    return True
            except OSError:
                return True  # no terminal left: the exchange will see EOF
            now = time.monotonic()
            if now >= deadline:
                return False
            try:
                r, _, _ = select.select([fd], [], [], min(deadline - now, 0.01))
            except InterruptedError:
                continue
            if r:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    return True
                if not data:
                    return True
                buf.write(data)

    def _stdout_is_terminal(self) -> bool:
        try:
            fd = "/proc/%d/fd/%%d" % self.proc.pid
            ctl = os.readlink(fd % FD_CTL)
            # The shell may still be in the last report's `>&254` (its own fd 1 saved aside) when
            # the next call comes: wait for it to put fd 1 back before judging.
            for _ in range(_STDOUT_SETTLE_STEPS):
                out = os.readlink(fd % 1)
                if out != ctl:
                    break
                time.sleep(0.002)
            return out in ("/dev/tty", os.readlink(fd % FD_TTY), ctl)
        except OSError:
            return True  # gone: other checks report that

    def _finished(self) -> bool:
        """Has the call line saved the command's status (fd 253)? Then the command is done."""
        try:
            return os.pread(self._files[FD_ERR], 16, 0).strip().isdigit()
        except (OSError, KeyError):
            return False

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
