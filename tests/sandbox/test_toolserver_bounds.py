"""Issue 35 item 1: a bounded tool server. Every attack runs from inside a real bubblewrap
sandbox (the agent's own python or bash call); the host reads the tool server's memory from
/proc/<pid>/status and the sandbox's host-side log file. docs/SANDBOX.md "Round 2: bounded tool
server" cites these tests.

The bounds are written here as numbers, not imported, so that each test also runs (and fails)
against the tool server before issue 35."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from rolloutd.sandbox import SandboxSpec, ToolTransportError
from tests.conftest import wait_for

MiB = 1024 * 1024
# The tool server's peak RSS after an attack: it idles at ~18 MiB; before issue 35 the python
# reply flood below took it past 600 MiB.
RSS_BOUND = 200 * MiB
# The tool server's own RLIMIT_DATA (docs/SANDBOX.md): 1 GiB.
DATA_LIMIT = 1024 * MiB
# A host log line and the whole host log (toolserver/toollog.py).
LOG_LINE = 16 * 1024
LOG_TOTAL = 8 * MiB

# Agent code in the Python session: write a frame header announcing `n` bytes on the session
# driver's reply pipe (its fd is the last argument in /proc/self/cmdline), then `n` bytes of
# `fill`. The driver is the agent's own process: nothing stops the write.
REPLY_FLOOD = r'''
import os, struct
args = [a for a in open("/proc/self/cmdline", "rb").read().split(b"\0") if a]
fd = int(args[-1])
def flood(n, fill):
    os.write(fd, struct.pack("!I", n))
    chunk = fill * (1 << 20)
    left = n
    while left > 0:
        left -= os.write(fd, chunk[:min(left, len(chunk))])
flood(%d, %r)
'''


def _status(pid: int) -> dict:
    with open("/proc/%d/status" % pid) as f:
        rows = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return {k: int(rows[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS", "VmData") if k in rows}


def _data_limit(pid: int):
    with open("/proc/%d/limits" % pid) as f:
        for line in f:
            if line.startswith("Max data size"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    return None


def _log(h) -> bytes:
    return (Path(h.sandbox_dir) / "log").read_bytes()


def _log_ok(h) -> bytes:
    data = _log(h)
    assert len(data) < LOG_TOTAL, "host log grew to %d bytes" % len(data)
    longest = max((len(x) for x in data.split(b"\n")), default=0)
    assert longest <= LOG_LINE, "a host log line of %d bytes" % longest
    return data


def test_python_reply_pipe_flood_is_a_tool_error_not_a_dropped_job(bwrap_rt):
    """The agent's code writes a 32 MiB frame of 0xff to the session's reply pipe. Before: the
    tool server read it all, failed to decode it, logged repr() of it (128 MiB) and its reply
    exceeded the frame limit: the connection dropped (ToolTransportError, the job failed)."""
    h = bwrap_rt.create("pyflood")
    c = bwrap_rt.client(h, timeout=30)
    ts = h.pids[1]
    assert c.call("python", {"code": "x = 41"}).error is None
    try:
        r = c.call("python", {"code": REPLY_FLOOD % (32 * MiB, b"\xff")})
    except ToolTransportError as e:
        raise AssertionError("the agent's flood dropped the tool server's connection: %s" % e)
    assert r.exit_code is None and r.error and "reply" in r.error and "restart" in r.error, r
    assert "65536" in r.error, r  # the error names the bound
    # The session was restarted: the agent's state is gone, and it is told so.
    r = c.call("python", {"code": "print(40 + 2); 'x' in globals()"})
    assert r.error is None and r.output.split() == ["42", "False"], r
    assert _status(ts)["VmHWM"] < RSS_BOUND, _status(ts)
    _log_ok(h)


def test_python_reply_pipe_garbage_and_forged_replies_restart_the_session(bwrap_rt):
    """Small frames too: a frame that is not UTF-8 JSON, a JSON list, a reply whose exit_code is
    not an integer (host code compares it with 0) and one nested 20,000 deep (a parser's
    recursion) each restart the session with a tool error. Before: a UnicodeDecodeError / AttributeError surfaced as 'internal error' and a
    string exit_code reached the host."""
    h = bwrap_rt.create("pygarbage")
    c = bwrap_rt.client(h, timeout=30)
    deep = b'{"status": "ok", "exit_code": 0, "x": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    for body in (b"\xff" * 100, b"[1, 2]", b'{"status": "ok", "exit_code": "' + b"A" * 5000 + b'"}', deep):
        code = ("import os, struct\nargs = [a for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0') if a]\n"
                "os.write(int(args[-1]), struct.pack('!I', %d) + %r)\nimport time; time.sleep(5)" % (len(body), body))
        r = c.call("python", {"code": code})
        assert r.exit_code is None and r.error and "not a reply" in r.error and "restart" in r.error, (body[:20], r)
        assert "internal error" not in r.error
        r = c.call("python", {"code": "print(6 * 7)"})
        assert r.error is None and r.output.strip() == "42", r
    _log_ok(h)


# Agent code that ends its own call with a well-formed reply (the agent fooling itself) and keeps
# the session's driver busy, so the driver reads no request for an hour.
FORGE_AND_HOLD = r'''
import os, struct, time
args = [a for a in open("/proc/self/cmdline", "rb").read().split(b"\0") if a]
body = b'{"status": "ok", "exit_code": 0}'
os.write(int(args[-1]), struct.pack("!I", len(body)) + body)
time.sleep(3600)
'''


def test_a_session_that_reads_no_request_costs_the_call_its_timeout_not_the_connection(bwrap_rt):
    """After FORGE_AND_HOLD the next call's code (1 MiB: more than the request pipe holds) cannot
    be written whole. Before: the tool server's write of the request blocked with no deadline (an
    hour here): no reply, the client timed out (ToolTransportError, a failed job) and the Python
    tool stayed locked. Now the write has the call's deadline: the call times out, the session is
    killed and the next call gets a fresh one."""
    h = bwrap_rt.create("pystall")
    c = bwrap_rt.client(h, timeout=30)
    r = c.call("python", {"code": FORGE_AND_HOLD, "timeout": 20})
    assert r.error is None and r.exit_code == 0, r  # its own call ended early, as it wanted
    code = "print('ran')\n" + "#" * (1 << 20)
    try:
        r = c.call("python", {"code": code, "timeout": 3}, timeout=3)  # the client waits 3 + 10 s
    except ToolTransportError as e:
        raise AssertionError("a session that reads no request dropped the connection: %s" % e)
    assert r.timed_out and "ran" not in r.output, r
    assert "killed" in r.output and "state lost" in r.output, r  # the note says the session went
    r = c.call("python", {"code": "print(6 * 7)"})
    assert r.error is None and r.output.strip().splitlines()[-1] == "42", r


def test_editor_refuses_fifos_and_devices_and_reads_no_more_than_its_bound(bwrap_rt):
    """The agent leaves a FIFO (or a symlink to /dev/zero) where the model will look. Before: the
    editor opened the FIFO and blocked (the tool stuck, the client timed out: a failed job), or
    read whatever a writer pushed into it, and read /dev/zero until memory ran out."""
    h = bwrap_rt.create("editorfifo")
    c = bwrap_rt.client(h, timeout=30)
    ts = h.pids[1]
    r = c.call("bash", {"command": "mkfifo /workspace/empty.py /workspace/fed.py && ln -s /dev/zero /workspace/zero.py && "
                                   "(python3 -c \"import sys; sys.stdout.buffer.write(b'a' * (64 << 20))\" "
                                   "> /workspace/fed.py &) && echo ok"})
    assert r.output.strip() == "ok", r
    try:
        for name in ("empty.py", "fed.py", "zero.py"):
            r = c.call("editor", {"command": "view", "path": "/workspace/" + name}, timeout=10)
            assert r.error and "not a regular file" in r.error, (name, r)
            r = c.call("editor", {"command": "str_replace", "path": "/workspace/" + name, "old_str": "a",
                                  "new_str": "b"}, timeout=10)
            assert r.error and "not a regular file" in r.error, (name, r)
            r = c.call("editor", {"command": "create", "path": "/workspace/" + name, "file_text": "x"}, timeout=10)
            assert r.error and "not a regular file" in r.error, (name, r)
    except ToolTransportError as e:
        raise AssertionError("the editor hung on the agent's special file: %s" % e)
    assert _status(ts)["VmHWM"] < RSS_BOUND, _status(ts)
    assert c.call("editor", {"command": "view", "path": "/workspace"}).error is None


def test_an_agent_log_path_that_is_a_fifo_is_an_error_not_a_hang(bwrap_rt):
    """The agent tool's `log` (the whole output of a harness agent) at a path the agent made a
    FIFO. Before: open() blocked with no reader, the call never answered (ToolTransportError)."""
    h = bwrap_rt.create("agentlog")
    c = bwrap_rt.client(h, timeout=30)
    assert c.call("bash", {"command": "mkfifo /workspace/agent.log && echo ok"}).output.strip() == "ok"
    try:
        r = c.call("agent", {"argv": ["echo", "hi"], "timeout": 5, "log": "/workspace/agent.log"}, timeout=10)
    except ToolTransportError as e:
        raise AssertionError("the agent tool hung on the FIFO: %s" % e)
    assert r.error and "not a regular file" in r.error, r
    r = c.call("agent", {"argv": ["echo", "hi"], "timeout": 5, "log": "/workspace/real.log"}, timeout=10)
    assert r.exit_code == 0 and r.output.strip() == "hi", r
    assert c.call("bash", {"command": "cat /workspace/real.log"}).output.strip() == "hi"


def test_editor_lists_a_bounded_number_of_entries_per_directory(bwrap_rt):
    """50,000 files in one directory: the listing stops at its bound and says so (before: every
    name was read, sorted and joined in the tool server)."""
    h = bwrap_rt.create("editordir")
    c = bwrap_rt.client(h, timeout=60)
    r = c.call("python", {"code": "import os\nos.mkdir('/tmp/many')\n"
                                  "for i in range(50000):\n    open('/tmp/many/f%d' % i, 'w').close()\nprint('made')",
                          "timeout": 60})
    assert r.output.strip() == "made", r
    r = c.call("editor", {"command": "view", "path": "/tmp/many"})
    assert r.error is None and "not listed" in r.output, r.output[-300:]


def test_signal_flood_does_not_grow_the_host_log(bwrap_rt):
    """`kill -INT 1` in a loop: the tool server (pid 1) ignores each, and used to log each: the
    sandbox's host-side log grew without bound (~100 bytes per signal)."""
    h = bwrap_rt.create("sigflood")
    c = bwrap_rt.client(h, timeout=30)
    before = len(_log(h))
    r = c.call("python", {"code": "import os, signal, time\nend = time.time() + 3\nn = 0\n"
                                  "while time.time() < end:\n    os.kill(1, signal.SIGINT)\n    os.kill(1, signal.SIGTERM)\n"
                                  "    n += 2\nprint(n)", "timeout": 30})
    assert r.error is None and int(r.output.strip()) > 1000, r
    after = c.call("bash", {"command": "true"})
    assert after.ok, after  # failed once in a combined run, not reproduced in 13 more: say why next time
    data = _log_ok(h)
    lines = [json.loads(x) for x in data.splitlines() if x.startswith(b"{")]
    ignored = [x for x in lines if x.get("event") == "signal_ignored"]
    assert len(ignored) <= 8, "%d signal_ignored lines (%d bytes of log)" % (len(ignored), len(data) - before)
    assert ignored and ignored[-1]["count"] >= 1, (r.output, data[-2000:])


def test_a_signal_handled_while_the_log_is_being_written_does_not_deadlock(monkeypatch):
    """Python runs a signal handler in the main thread between two bytecodes, which may be inside
    the log stream's lock (the previous signal's log line being written). The handler used to log
    itself: it then waited for a lock its own thread held, for ever, and every thread that logged
    after it (a tool call's reply path) hung with it. Seen once as a flood with no log line at all."""
    import signal

    from rolloutd.sandbox.toolserver import toollog
    from rolloutd.sandbox.toolserver.server import ToolServer

    server = ToolServer({"workdir": "/tmp"})
    r, w = os.pipe()
    stream = toollog.CappedStream(w)
    monkeypatch.setattr(toollog, "_stream", stream)
    done = threading.Event()

    def handler_inside_the_write():
        with stream._lock:  # what the interrupted write holds
            server._ignored(signal.SIGINT, None)
            done.set()

    t = threading.Thread(target=handler_inside_the_write, daemon=True)
    t.start()
    try:
        assert done.wait(5), "the signal handler blocked on the log's lock"
        assert server.ignored_signals == 1
        server._log_ignored_signals()  # a thread outside the handler writes the line
        line = json.loads(os.read(r, 65536).splitlines()[-1])
        assert line["event"] == "signal_ignored" and line["count"] == 1, line
        server.ignored_signals = 9
        server._log_ignored_signals()
        server.ignored_signals = 12
        server._log_ignored_signals()  # 10 passed since the last line: one more line
        server._log_ignored_signals()  # nothing new: nothing written
        os.set_blocking(r, False)
        lines = [json.loads(x) for x in os.read(r, 65536).splitlines()]
        assert [x["count"] for x in lines] == [12], lines
    finally:
        os.close(r)
        os.close(w)


def _sink(path: str):
    """A Unix socket endpoint that accepts and never reads (the LLM endpoint, stalled)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o666)  # the sandbox's uid (nobody, when the tests run as root) connects
    srv.listen(512)
    held = []

    def loop():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return srv, held


def test_tool_server_memory_is_bounded_and_its_children_do_not_inherit_the_bound(bwrap_rt):
    """The tool server limits its own data segment (RLIMIT_DATA) and keeps under it with the
    relay full (128 connections pushing into an endpoint that never reads: 256 relay threads)
    and fd 254 of the shell flooded; the host's calls still work. The agent's processes get
    their own limits, not the tool server's."""
    h = bwrap_rt.create("tsmem")
    c = bwrap_rt.client(h, timeout=60)
    ts = h.pids[1]
    limit = _data_limit(ts)
    assert limit is not None and limit <= DATA_LIMIT, limit
    r = c.call("bash", {"command": "grep 'Max data size' /proc/self/limits; "
                                   "python3 -c \"print(open('/proc/self/limits').read())\" | grep 'Max data size'"})
    assert r.output.count("unlimited") == 4, r.output  # soft and hard, for bash and for its child
    srv, held = _sink(str(Path(h.sandbox_dir) / "run" / "llm.sock"))
    try:
        r = c.call("relay", {"socket": "/run/rolloutd/llm.sock"})
        assert r.error is None, r
        port = int(r.output.rsplit(":", 1)[1])
        flood = ("import socket, threading\nsocks = []\n"
                 "for _ in range(160):\n"
                 "    try:\n"
                 "        s = socket.create_connection(('127.0.0.1', %d)); s.setblocking(False); socks.append(s)\n"
                 "    except OSError:\n        pass  # past the relay's bound: reset\n"
                 "for s in socks:\n"
                 "    try:\n        s.send(b'x' * (4 << 20))\n    except OSError:\n        pass\n"
                 "print(len(socks))" % port)
        r = c.call("python", {"code": flood, "timeout": 60})
        assert r.error is None and int(r.output.strip()) >= 128, r
        wait_for(lambda: len(held) >= 128, 30, what="128 relayed connections at the endpoint")
        # fd 254 of the shell: 64 MiB of junk without the call's report in it, then the call ends.
        r = c.call("bash", {"command": "head -c 67108864 /dev/zero | tr '\\0' x >&254; echo done", "timeout": 60})
        assert r.output.strip() == "done", r
        st = _status(ts)
        assert st["VmData"] < limit and st["VmHWM"] < RSS_BOUND, st
        assert c.call("ping").ok and c.call("bash", {"command": "true"}).ok
    finally:
        srv.close()
        for s in held:
            s.close()


def test_programs_the_agents_code_starts_do_not_inherit_the_session_pipes(bwrap_rt):
    """The session driver's request and reply fds (named in its command line) are closed in
    every program its code starts: a child cannot forge replies or read requests after the
    driver restarts (SANDBOX.md, "Frames")."""
    h = bwrap_rt.create("pyfds")
    c = bwrap_rt.client(h, timeout=30)
    # By what the fds are (their pipes), not their numbers: `ls /proc/self/fd` opens a directory
    # fd of its own, which took number 3 (the request fd's number) in one CI run.
    code = ("import os, subprocess\n"
            "args = [a for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0') if a]\n"
            "print([os.readlink('/proc/self/fd/%d' % int(a)) for a in args[-2:]])\n"
            # os.system and close_fds=False keep every inheritable fd (subprocess closes them by default)
            "os.system('ls -l /proc/self/fd > /tmp/fds.txt')\n"
            "kept = subprocess.run(['ls', '-l', '/proc/self/fd'], capture_output=True, text=True, close_fds=False).stdout\n"
            "print([l.split(' -> ')[-1] for l in (open('/tmp/fds.txt').read() + kept).splitlines() if ' -> ' in l])")
    r = c.call("python", {"code": code})
    assert r.error is None and r.exit_code == 0, r
    first, child = r.output.strip().splitlines()
    pipes = set(eval(first))  # the driver's request and reply pipes, printed by our code
    assert len(pipes) == 2 and all(p.startswith("pipe:[") for p in pipes), pipes
    child_targets = set(eval(child))
    assert child_targets, child  # the listings were read (each shows at least its own stdio)
    assert not pipes & child_targets, (pipes, child_targets)


# -- the mechanisms under those tests, on real files and sockets ---------------------------------

def test_capped_log_cuts_long_lines_and_stops_at_its_total(tmp_path):
    """The cap the tool server puts on its stderr (the sandbox's host-side log): a line over
    max_line is cut and says so, the rest of that line is dropped; past max_bytes one log_capped
    line is written and nothing after it."""
    from rolloutd.sandbox.toolserver.toollog import CappedStream

    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        s = CappedStream(fd, max_bytes=64 * 1024, max_line=1024)
        s.write('{"event": "a"}\n')
        s.write("x" * 5000)  # a line written in pieces, the newline last
        s.write("Q" * 5000 + "\n")
        s.write('{"event": "b"}\n')
        lines = path.read_bytes().split(b"\n")
        assert lines[0] == b'{"event": "a"}' and lines[2] == b'{"event": "b"}', lines[:3]
        assert len(lines[1]) + 1 == 1024 and lines[1].endswith(b"[log line cut at 1024 bytes]"), lines[1][-60:]
        assert b"Q" not in lines[1]
        for i in range(10000):
            s.write('{"event": "flood", "n": %d}\n' % i)
        data = path.read_bytes()
        assert len(data) <= 64 * 1024, len(data)
        last = json.loads(data.splitlines()[-1])
        assert last["event"] == "log_capped" and last["max_bytes"] == 64 * 1024, last
        s.write('{"event": "late"}\n')
        assert path.read_bytes() == data and s.dropped > 0
    finally:
        os.close(fd)


def test_each_field_of_a_host_log_event_is_cut_to_4096_characters(capsys, monkeypatch):
    """A field the agent controls (an error text, a nested value) is cut to its head and tail
    before the line is built, so one event cannot fill the log line (SANDBOX.md, host-side log)."""
    from rolloutd.sandbox.toolserver import toollog

    monkeypatch.setattr(toollog, "_stream", None)  # to sys.stderr (captured), whatever ran before
    toollog.log("probe", text="a" * 10_000 + "TAIL", nested={"k": ["v" * 9_000]}, n=7, ok=True)
    rec = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert rec["event"] == "probe" and rec["n"] == 7 and rec["ok"] is True
    for key in ("text", "nested"):
        assert isinstance(rec[key], str) and len(rec[key]) <= 4096 + 40, (key, len(rec[key]))
        assert "characters cut]" in rec[key], rec[key][2040:2100]
    assert rec["text"].endswith("TAIL") and rec["text"].startswith("a" * 2048)


def test_a_reply_over_the_frame_limit_becomes_an_error_reply():
    """The socket protocol both ways is bounded by wire.MAX_FRAME: a reply the tool server cannot
    send whole becomes an error reply on the same connection (before: the connection was dropped
    and the client raised ToolTransportError, a failed job)."""
    from rolloutd.sandbox.toolserver.server import ToolServer, result
    from rolloutd.sandbox.toolserver.wire import MAX_FRAME, encode, recv_frame

    server = ToolServer({"workdir": "/tmp"})
    server.tools["huge"] = lambda args, canceller: result(output="x" * (MAX_FRAME + 1), exit_code=0)
    a, b = socket.socketpair()
    a.settimeout(30)
    t = threading.Thread(target=server._serve_conn, args=(b,), daemon=True)
    t.start()
    try:
        a.sendall(encode({"id": 7, "tool": "huge", "args": {}}))
        r = recv_frame(a)
        assert r["id"] == 7 and "could not be sent" in r["error"] and str(MAX_FRAME) in r["error"], r
        a.sendall(encode({"id": 8, "tool": "nope", "args": {}}))
        assert recv_frame(a)["id"] == 8  # the connection goes on
    finally:
        a.close()
        t.join(10)


def test_editor_undo_history_is_bounded_over_all_files(tmp_path, monkeypatch):
    """Edits of many large files: the history keeps the newest edits within HISTORY_BYTES (here
    1 MiB) over all files together; the oldest file's edits are gone and undo says so."""
    from rolloutd.sandbox.toolserver import editor

    monkeypatch.setattr(editor, "HISTORY_BYTES", 1 << 20)
    ed = editor.Editor(str(tmp_path))
    for i in range(10):
        (tmp_path / ("f%d.py" % i)).write_text("a = 1\n" + "#" * (200 * 1024) + "\n")
        ed.call({"command": "str_replace", "path": "f%d.py" % i, "old_str": "a = 1", "new_str": "a = 2"})
        assert ed.history_bytes <= 1 << 20, (i, ed.history_bytes)
    out, _ = ed.call({"command": "undo", "path": "f9.py"})
    assert "undone" in out and (tmp_path / "f9.py").read_text().startswith("a = 1")
    try:
        ed.call({"command": "undo", "path": "f0.py"})
        raise AssertionError("the oldest file's edit was kept past the bound")
    except editor.EditorError as e:
        assert "no edit history" in str(e) and "MiB in all" in str(e)


def test_past_its_memory_bound_the_tool_server_answers_and_stays_up(tmp_path):
    """The tool server started as the runtimes start it, with server_data_mb = 160: a 60 MiB
    request (a frame within the 64 MiB limit, whose decoding needs more than 160 MiB) gets an
    error reply, and the server answers the next connection. No sandbox: the bound is the tool
    server's own (the local runtime's way of running it, bash in a scratch dir)."""
    import subprocess
    import sys

    from rolloutd.sandbox import ToolClient
    from rolloutd.sandbox.toolserver.wire import encode, recv_frame

    sock = str(tmp_path / "t.sock")
    cfg = {"socket": sock, "workdir": str(tmp_path), "home": str(tmp_path / "home"), "server_data_mb": 160,
           "env": {}, "limits": {}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.sandbox.toolserver", "--config", str(tmp_path / "cfg.json")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_for(lambda: os.path.exists(sock), 20, what="the tool server's socket")
        with ToolClient(sock, timeout=20) as c:
            assert c.ping().info["data_limit"] == 160 * MiB
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        try:
            s.connect(sock)
            s.sendall(encode({"id": 1, "tool": "bash", "args": {"command": "#" + "\u00e9" * (30 * MiB)}}))
            r = recv_frame(s)
        finally:
            s.close()
        assert r is not None, "no reply: the connection was dropped"
        assert r["error"] and "memory bound" in r["error"], {k: str(v)[:200] for k, v in r.items()}
        with ToolClient(sock, timeout=20) as c:
            assert c.ping().ok and c.call("bash", {"command": "echo up"}).output == "up\n"
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stderr.close()
