"""The tool server's ``agent`` and ``relay`` tools, in real bwrap sandboxes (no network inside)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from rolloutd.sandbox import AsyncToolClient, SandboxSpec
from rolloutd.sandbox.procs import descendants
from tests.conftest import wait_for


def sandbox_cmdlines(h) -> list[str]:
    """Command lines of every process in the sandbox (descendants of its namespace init)."""
    out = []
    for pid in descendants(h.pids[1]):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            pass
    return out


def test_agent_exit_code_and_tail(sandboxes):
    h = sandboxes.create("a1")
    c = sandboxes.client(h, timeout=30)
    code = "import sys\nfor i in range(5000): print('line', i)\nsys.stdout.flush()\nsys.stderr.write('boom on stderr\\n')\nsys.exit(3)"
    r = c.call("agent", {"argv": ["python3", "-c", code], "timeout": 20, "tail_bytes": 200})
    assert r.error is None, r.error
    assert r.exit_code == 3
    assert not r.timed_out
    assert r.output.endswith("boom on stderr\n")  # stderr is merged, the tail is the end
    assert "line 4999" in r.output and "line 0\n" not in r.output
    assert len(r.output.encode()) <= 200 and r.truncated
    assert r.info["output_bytes"] > 5000 * 6


def test_agent_env_cwd_stdin_and_log(sandboxes):
    h = sandboxes.create("a2", SandboxSpec(workspace_files={"sub/x.txt": "x"}))
    c = sandboxes.client(h, timeout=30)
    code = ("import os,sys\ntext=sys.stdin.read()\n"
            "print(os.getcwd(), os.environ['TASK_MODE'], len(text), text.splitlines()[-1])")
    stdin = "first line\n" + "ünïcode " * 20000 + "\nlast line"  # bigger than a pipe buffer
    r = c.call("agent", {"argv": ["python3", "-c", code], "env": {"TASK_MODE": "stdin"},
                         "cwd": "/workspace/sub", "stdin": stdin, "timeout": 20, "log": "/workspace/agent.log"})
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"/workspace/sub stdin {len(stdin)} last line"
    assert (Path(h.workspace) / "agent.log").read_text() == r.output


def test_agent_missing_program_and_bad_args(sandboxes):
    h = sandboxes.create("a3")
    c = sandboxes.client(h, timeout=30)
    r = c.call("agent", {"argv": ["/no/such/agent"], "timeout": 5})
    assert r.exit_code == 127 and "cannot start /no/such/agent" in r.error
    for bad, msg in [({"argv": [], "timeout": 5}, "'argv'"), ({"argv": ["true"]}, "'timeout'"),
                     ({"argv": ["true"], "timeout": 5, "env": {"A=B": "x"}}, "'env'"),
                     ({"argv": ["true"], "timeout": 5, "cwd": "rel"}, "'cwd'"),
                     ({"argv": ["true"], "timeout": 5, "stdin": 3}, "'stdin'")]:
        r = c.call("agent", bad)
        assert r.error and msg in r.error and r.exit_code is None, (bad, r)
    assert c.ping().ok  # still serving


TREE = """
import os, subprocess, sys, time
subprocess.Popen(["sleep", "1001"])
if os.fork() == 0:          # a double-forked daemon that leaves the tree
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "1002"])
    os._exit(0)
print("started", flush=True)
time.sleep(1000)
"""


def test_agent_that_ignores_its_deadline_is_killed_with_its_tree(sandboxes):
    h = sandboxes.create("a4")
    c = sandboxes.client(h, timeout=30)
    t0 = time.monotonic()
    r = c.call("agent", {"argv": ["python3", "-c", TREE], "timeout": 1.5})
    assert r.timed_out and r.exit_code == -9, r
    assert r.output.strip() == "started"
    assert time.monotonic() - t0 < 15
    left = [cl for cl in sandbox_cmdlines(h) if "sleep 10" in cl or "python3 -c" in cl]
    assert not left, left
    assert c.ping().ok


def test_agent_exit_takes_its_background_children(sandboxes):
    h = sandboxes.create("a5")
    c = sandboxes.client(h, timeout=30)
    r = c.call("agent", {"argv": ["bash", "-c", "(sleep 1003 &) ; sleep 1004 & echo bye"], "timeout": 10})
    assert r.exit_code == 0 and r.output.strip() == "bye"
    wait_for(lambda: not [cl for cl in sandbox_cmdlines(h) if "sleep 100" in cl], what="strays gone")


def test_cancelled_agent_call_kills_the_agent(sandboxes):
    h = sandboxes.create("a6")

    async def go():
        client = AsyncToolClient(h.tool_socket, timeout=60)
        task = asyncio.create_task(client.call("agent", {"argv": ["python3", "-c", TREE], "timeout": 60}))
        for _ in range(300):
            if any("sleep 1002" in cl for cl in sandbox_cmdlines(h)):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the agent never started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()

    asyncio.run(go())
    wait_for(lambda: not [cl for cl in sandbox_cmdlines(h) if "sleep 100" in cl or "python3 -c" in cl],
             what="agent tree killed after cancel")


class EchoUnixServer:
    """A Unix-socket server in the sandbox's run dir: replies b"echo:" + what it got, per line."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o666)
        self.sock.listen(64)
        self.closed_by_peer = threading.Event()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        f = conn.makefile("rb")
        for line in f:
            conn.sendall(b"echo:" + line)
        self.closed_by_peer.set()
        conn.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_relay_reaches_a_host_unix_socket_from_a_sandbox_without_network(sandboxes):
    h = sandboxes.create("r1")
    c = sandboxes.client(h, timeout=30)
    run_dir = os.path.dirname(h.tool_socket)
    srv = EchoUnixServer(os.path.join(run_dir, "llm.sock"))
    try:
        r = c.call("relay", {"socket": "/run/rolloutd/llm.sock"})
        assert r.exit_code == 0, r.error
        port = r.info["port"]
        assert r.output == f"http://127.0.0.1:{port}"
        again = c.call("relay", {"socket": "/run/rolloutd/llm.sock"})
        assert again.info["port"] == port  # one relay per socket
        code = (f"import socket\ns=socket.create_connection(('127.0.0.1',{port}))\n"
                "f=s.makefile('rb')\nfor i in range(3):\n  s.sendall(b'hi %d\\n' % i); print(f.readline().decode().strip())\n"
                "s.close()\n"
                # the sandbox still has no route out
                "try:\n  socket.create_connection(('1.1.1.1', 80), timeout=2); print('NET')\n"
                "except OSError as e:\n  print('no network')\n")
        out = c.call("agent", {"argv": ["python3", "-c", code], "timeout": 20})
        assert out.exit_code == 0, out.output
        assert out.output.split() == ["echo:hi", "0", "echo:hi", "1", "echo:hi", "2", "no", "network"]
        assert srv.closed_by_peer.wait(5)  # the agent's close reached the Unix side
        stop = c.call("relay", {"stop": "/run/rolloutd/llm.sock"})
        assert stop.exit_code == 0 and stop.info["accepted"] == 1
        refused = c.call("agent", {"argv": ["python3", "-c", code.split("f=s")[0]], "timeout": 10})
        assert refused.exit_code == 1 and "ConnectionRefusedError" in refused.output
    finally:
        srv.close()


def test_relay_to_a_missing_socket_resets_the_client(sandboxes):
    h = sandboxes.create("r2")
    c = sandboxes.client(h, timeout=30)
    r = c.call("relay", {"socket": "/run/rolloutd/nothing.sock"})
    port = r.info["port"]
    code = (f"import socket\ns=socket.create_connection(('127.0.0.1',{port}))\ns.sendall(b'x')\n"
            "s.settimeout(5)\nprint(repr(s.recv(10)))\n")
    out = c.call("agent", {"argv": ["python3", "-c", code], "timeout": 20})
    assert "ConnectionResetError" in out.output or out.output.strip() == "b''", out.output
    for bad in ({"socket": "rel.sock"}, {"socket": "/x", "port": -1}, {"stop": "/not/running"}):
        assert c.call("relay", bad).error


def test_host_relay(tmp_path):
    """The same relay class gives an agent on the host a 127.0.0.1 port."""
    from rolloutd.sandbox.toolserver.relay import Relay

    path = f"/tmp/rlh-{os.getpid()}.sock"
    srv = EchoUnixServer(path)
    relay = Relay(path)
    try:
        port = relay.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"host\n")
            assert s.makefile("rb").readline() == b"echo:host\n"
        assert relay.info()["accepted"] == 1
    finally:
        relay.stop()
        srv.close()
        os.unlink(path)
