"""Isolation on bwrap, for real (skipped where bubblewrap or user namespaces are unusable;
failed instead under ROLLOUTD_REQUIRE_BWRAP=1)."""
import json
import multiprocessing
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import remove_tree, traversable_tmpdir
from rolloutd.sandbox import Limits, SandboxHandle, SandboxSpec, SandboxStartError, ToolClient, get_runtime, procs

pytestmark = pytest.mark.timeout(120)


def bash(c, command, timeout=10):
    return c.call("bash", {"command": command, "timeout": timeout})


def pidns_procs(h):
    return procs.namespace_pids(h.pids[1], h.extra["pid_starts"][1])


def named(pids):
    """(pid, start time) pairs: a pid alone may be reused (a fork bomb churns through them)."""
    return {(p, procs.start_time(p)) for p in pids} - {(p, None) for p in pids}


def commands(pids):
    """Each live pid's command name (/proc/PID/comm is world-readable)."""
    out = []
    for p in pids:
        try:
            out.append(Path("/proc/%d/comm" % p).read_text().strip())
        except OSError:
            pass
    return out


def still_running(pairs, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        alive = sorted(p for p, st in pairs if procs.is_running(p, st))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


@pytest.fixture
def listener():
    """A TCP server on the host's loopback, outside any sandbox."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


CONNECT = ("python3 -c \"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\n"
           "except OSError as e: print('FAILED', type(e).__name__)\"")


def test_no_network(bwrap_rt, listener):
    h = bwrap_rt.create("net-off")
    c = bwrap_rt.client(h)
    assert bash(c, CONNECT.format(port=listener)).output.startswith("FAILED")
    ifaces = bash(c, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output.split()
    assert ifaces == ["lo"]


def test_network_when_asked_and_own_loopback(bwrap_rt, listener):
    h = bwrap_rt.create("net-on", SandboxSpec(network=True))
    c = bwrap_rt.client(h)
    assert bash(c, CONNECT.format(port=listener)).output.strip() == "CONNECTED"
    assert h.loopback and h.loopback.startswith("127.")
    r = bash(c, "python3 -c \"import os, socket; s = socket.socket(); s.bind((os.environ['ROLLOUTD_LOOPBACK'], 0)); print(s.getsockname()[0])\"")
    assert r.output.strip() == h.loopback


def test_writes_outside_workspace_fail(bwrap_rt):
    h = bwrap_rt.create("ro")
    c = bwrap_rt.client(h)
    for path in ("/usr/evil", "/etc/evil", "/evil", "/bin/evil", "/run/rolloutd-lib/evil", "/run/evil"):
        r = bash(c, "touch %s" % path)
        assert r.exit_code != 0, path
        assert "Read-only" in r.output or "No such file" in r.output or "Permission denied" in r.output, r.output
    assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")
    assert bash(c, "touch /workspace/ok /tmp/ok && echo ok").output == "ok\n"
    assert (Path(h.workspace) / "ok").exists()


def test_fork_bomb_is_contained(bwrap_rt):
    nproc = 32
    h = bwrap_rt.create("bomb", SandboxSpec(limits=Limits(nproc=nproc, wall_seconds=60)))
    c = bwrap_rt.client(h)
    bash(c, ":(){ :|:& };:", timeout=3)
    peak = 0
    seen = set()
    for _ in range(10):
        now = pidns_procs(h)
        seen |= named(now)
        peak = max(peak, len(now))
        time.sleep(0.1)
    assert 3 <= peak <= nproc, "fork bomb reached %d processes with nproc=%d" % (peak, nproc)
    assert c.ping().output == "pong"  # the tool server still answers
    assert subprocess.run(["true"]).returncode == 0  # the host still forks
    bwrap_rt.rt.destroy(h)
    assert still_running(seen) == []
    assert pidns_procs(h) == []


def test_memory_hog_is_stopped(bwrap_rt):
    h = bwrap_rt.create("mem", SandboxSpec(limits=Limits(memory_mb=200)))
    c = bwrap_rt.client(h)
    r = bash(c, "python3 -c 'x = bytearray(1024 * 1024 * 1024); print(\"allocated\")'")
    assert r.exit_code != 0 and "MemoryError" in r.output and "allocated" not in r.output
    r = c.call("python", {"code": "x = bytearray(1024 * 1024 * 1024)", "timeout": 10})
    assert "MemoryError" in r.output
    assert c.call("python", {"code": "y = bytearray(10 * 1024 * 1024); len(y)"}).output == "10485760\n"
    assert c.ping().output == "pong"


def test_file_size_and_cpu_limits(bwrap_rt):
    h = bwrap_rt.create("fs", SandboxSpec(limits=Limits(file_size_mb=1, cpu_seconds=1)))
    c = bwrap_rt.client(h)
    r = bash(c, "head -c 3000000 /dev/zero > /workspace/big; echo rc=$?")
    assert "rc=0" not in r.output
    assert os.path.getsize(Path(h.workspace) / "big") == 1024 * 1024
    r = bash(c, "python3 -c 'while True: pass'; echo rc=$?", timeout=20)
    assert "rc=152" in r.output  # stopped by SIGXCPU (128 + 24)


def test_sandboxes_cannot_see_each_other(bwrap_rt):
    a = bwrap_rt.create("a")
    b = bwrap_rt.create("b", SandboxSpec(workspace_files={"secret.txt": "b-secret"}))
    ca = bwrap_rt.client(a)
    for path in (b.workspace + "/secret.txt", b.tool_socket, b.sandbox_dir, a.sandbox_dir):
        assert bash(ca, "test -e %s && echo visible || echo hidden" % path).output == "hidden\n", path
    assert "secret.txt" not in bash(ca, "ls -a /workspace /run/rolloutd").output
    seen = bash(ca, "ls /proc | grep -c '^[0-9]'").output.strip()
    assert int(seen) < 10  # only its own few processes (own pid namespace)
    assert bash(ca, "hostname").output == "sandbox\n"
    # and b really has the file, so the check above is meaningful
    assert bash(bwrap_rt.client(b), "cat /workspace/secret.txt").output == "b-secret"


def test_wall_clock_limit_kills_the_sandbox(bwrap_rt):
    t0 = time.monotonic()
    h = bwrap_rt.create("wall", SandboxSpec(limits=Limits(wall_seconds=2.0)))  # (start-up counts too)
    assert bwrap_rt.client(h).ping().output == "pong"
    assert procs.wait_gone(h.pids, timeout=15), "sandbox still alive after its wall-clock limit"
    assert time.monotonic() - t0 >= 1.9
    assert pidns_procs(h) == []


def test_destroy_kills_double_forked_processes(bwrap_rt):
    h = bwrap_rt.create("daemonize")
    c = bwrap_rt.client(h)
    r = bash(c, "setsid nohup sleep 1000 >/dev/null 2>&1 & (sleep 1000 &) ; true")
    assert r.exit_code == 0, r
    # Wait for both sleeps themselves: setsid's and the subshell's short-lived forks can make the
    # count reach 5 before the second sleep runs.
    deadline = time.monotonic() + 5
    while commands(pidns_procs(h)).count("sleep") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    inside = pidns_procs(h)
    assert commands(inside).count("sleep") == 2 and len(inside) >= 4, (inside, bash(c, "ps -ef").output)
    assert bwrap_rt.rt.destroy(h) is True
    assert still_running(named(inside)) == []
    assert pidns_procs(h) == []
    assert not Path(h.sandbox_dir).exists()
    assert bwrap_rt.rt.destroy(h) is False  # idempotent


def _destroy_elsewhere(root, handle_json, q):
    rt = get_runtime("bwrap", root_dir=root)
    q.put(rt.destroy(SandboxHandle.from_dict(json.loads(handle_json))))


def test_handle_travels_to_another_process(bwrap_rt, short_root):
    h = bwrap_rt.create("travel")
    wire = json.dumps(h.to_dict())  # must be plain JSON
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_destroy_elsewhere, args=(str(short_root), wire, q))
    p.start()
    p.join(30)
    assert q.get(timeout=5) is True
    assert procs.wait_gone(h.pids, timeout=5)
    assert not Path(h.sandbox_dir).exists()
    assert bwrap_rt.rt.loopback.allocated() == {}


def test_list_survives_a_daemon_restart_and_reap(bwrap_rt, short_root):
    kept = bwrap_rt.create("keep-me")
    gone1 = bwrap_rt.create("finished")
    gone2 = bwrap_rt.create("cancelled")
    fresh = get_runtime("bwrap", root_dir=short_root)  # a new daemon process would do the same
    assert {h.job_id for h in fresh.list()} == {"keep-me", "finished", "cancelled"}
    assert sorted(fresh.reap({"keep-me"})) == ["cancelled", "finished"]
    assert [h.job_id for h in fresh.list()] == ["keep-me"]
    for h in (gone1, gone2):
        assert procs.wait_gone(h.pids, timeout=5) and not Path(h.sandbox_dir).exists()
    assert ToolClient(kept.tool_socket).ping().output == "pong"
    assert set(fresh.loopback.allocated()) == {kept.loopback}


def test_reap_expired_and_abandoned(bwrap_rt):
    h = bwrap_rt.create("expiring")
    # Pretend its wall-clock deadline passed long ago and its in-sandbox watchdog failed.
    state_path = Path(h.sandbox_dir) / "state.json"
    state = json.loads(state_path.read_text())
    state["deadline"] = time.time() - 3600
    state_path.write_text(json.dumps(state))
    assert bwrap_rt.rt.reap({"expiring"}) == ["expiring"]  # kept job, but past its deadline
    assert procs.wait_gone(h.pids, timeout=5)
    # a dir left by a create() that crashed before writing any state
    junk = bwrap_rt.rt.sb_dir / "0123456789ab"
    junk.mkdir()
    os.utime(junk, (time.time() - 3600, time.time() - 3600))
    bwrap_rt.rt.reap(set())
    assert not junk.exists()


def test_start_failure_is_clear_and_leaves_nothing(bwrap_rt, short_root, tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr").mkdir(parents=True)  # an "image" without python3
    with pytest.raises(SandboxStartError) as ei:
        bwrap_rt.rt.create("broken", SandboxSpec(image=str(rootfs)))
    msg = str(ei.value)
    assert "did not start" in msg and "sandbox log" in msg
    assert list(bwrap_rt.rt.sb_dir.iterdir()) == []
    assert bwrap_rt.rt.loopback.allocated() == {}


def test_rootfs_image_and_user_binds(bwrap_rt, short_root):
    data = short_root / "data"  # (pytest's tmp_path is private to root: nobody could not bind it)
    data.mkdir()
    (data / "in.txt").write_text("from host")
    spec = SandboxSpec(image="/", binds=[(str(data), "/data", True)], env={"TASK": "t1"}, workdir="/data")
    h = bwrap_rt.create("rootfs", spec)
    c = bwrap_rt.client(h)
    assert bash(c, "pwd; cat in.txt; echo; echo $TASK").output == "/data\nfrom host\nt1\n"
    assert bash(c, "touch /data/x").exit_code != 0  # read-only bind


def test_sif_image_is_rejected_with_advice(bwrap_rt):
    from rolloutd.sandbox import SandboxSpecError

    with pytest.raises(SandboxSpecError, match="apptainer"):
        bwrap_rt.rt.create("sif", SandboxSpec(image="/nonexistent/x.sif"))


def _create_and_die(root, conn):
    rt = get_runtime("bwrap", root_dir=root)
    h = rt.create("orphan")
    conn.send(json.dumps(h.to_dict()))  # synchronous, unlike Queue.put
    os._exit(0)  # the "daemon" dies without cleaning up


def test_sandbox_outlives_its_creator(bwrap_rt, short_root):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_create_and_die, args=(str(short_root), child))
    p.start()
    assert parent.poll(30), "the creator process did not report a sandbox"
    h = SandboxHandle.from_dict(json.loads(parent.recv()))
    p.join(10)
    bwrap_rt.handles.append(h)  # the fixture's finalizer checks it is gone at the end
    assert ToolClient(h.tool_socket).ping().output == "pong"  # --die-with-parent is off
    assert [x.job_id for x in bwrap_rt.rt.list()] == ["orphan"]
    assert bwrap_rt.rt.reap(set()) == ["orphan"]  # the janitor of the next daemon cleans it up
    assert procs.wait_gone(h.pids, timeout=5)


def test_pytest_out_of_nobodys_reach_is_bound_from_a_readable_copy(bwrap_rt, tmp_path, monkeypatch):
    """A root daemon's sandboxes run as nobody, and bwrap opens bind sources as that uid: pytest
    installed under a private directory (a venv in /root, pytest's 0700 tmp dirs) made every swe
    job fail in init with "Can't find source path ...: Permission denied". The binds now come
    from a world-readable copy, and pytest imports inside the sandbox."""
    import shutil

    from rolloutd.handlers import tasks

    if os.geteuid() != 0:
        pytest.skip("as another user the sandbox runs as that user and reaches its own files")
    private = tmp_path / "private-venv"
    private.mkdir(mode=0o700)
    items = []
    for name, src in tasks.pytest_files():
        dst = private / name
        (shutil.copytree if Path(src).is_dir() else shutil.copy2)(src, dst)
        items.append((name, str(dst)))
    monkeypatch.setattr(tasks, "pytest_files", lambda: tuple(items))
    tasks._pytest_bind_sources.cache_clear()  # decided once per process: decide again for these files
    stage = traversable_tmpdir("rdps-")   # where a real deployment's /tmp would be: others may enter
    try:
        monkeypatch.setenv("TMPDIR", str(stage))
        binds = tasks.pytest_binds()
        h = bwrap_rt.create("pytest-copy", SandboxSpec(binds=binds, env={"PYTHONPATH": tasks.PYTEST_MOUNT}))
        out = bash(bwrap_rt.client(h), "id -u; python3 -c 'import pytest, _pytest; print(pytest.__version__)'").output
        assert out.split() == [str(h.extra["uid"]), pytest.__version__], out  # not the host's
        assert all(src.startswith(str(stage) + "/") for src, _, _ in binds), binds
    finally:
        tasks._pytest_bind_sources.cache_clear()  # the next user decides for the real pytest
        remove_tree(stage)
