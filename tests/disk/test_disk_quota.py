"""Limits.disk_mb. Measured (no root, or disk_quota="measured"): a sandbox whose workspace
outgrows its quota is stopped by the node, its job is scored 0 with the reason (DiskQuotaExceeded), its
neighbours are untouched (issue 17.1). Hard (root: a loop-mounted image per workspace, issue
24.3): a write past the quota gets ENOSPC and the job goes on."""
from __future__ import annotations

import os
import time

import pytest
from rolloutd.sandbox import (
    DiskQuotaExceeded,
    Limits,
    SandboxSpec,
    ToolClient,
    ToolTransportError,
    get_runtime,
)
from rolloutd.sandbox.runtime import disk_usage
from rolloutd.sandbox.spec import SandboxSpecError

from tests.conftest import alive, remove_tree as _remove_tree, short_tmpdir

HOST_MOUNTS = ["grade", "pts", "shm", "tmp", "workspace"]  # what a bwrap sandbox mounts on the host as root


def remove_tree(root) -> None:
    """Reap and unmount first: a test that failed midway may leave a sandbox (and, as root, its
    workspace mount, which rm --one-file-system would leave behind)."""
    from rolloutd.sandbox.runtime import _remove_sandbox_dir

    try:
        get_runtime("bwrap", root_dir=root).reap(keep=())
    except Exception:
        pass
    _remove_sandbox_dir(root)
    _remove_tree(root)

# Writes 1 MiB files until stopped (each file well under file_size_mb, so only the quota stops it).
HOG = "i=0; while true; do head -c 1048576 /dev/zero > f$i || true; i=$((i+1)); done"


def test_disk_mb_validated():
    assert Limits(disk_mb=10).disk_mb == 10
    assert Limits.from_dict({"disk_mb": 7}).disk_mb == 7
    for bad in (0, -1, "10", True):
        with pytest.raises(SandboxSpecError):
            Limits(disk_mb=bad)


def test_disk_usage_counts_blocks_and_hard_links_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 50_000)
    (tmp_path / "sub" / "link").hardlink_to(tmp_path / "a")
    (tmp_path / "sym").symlink_to("/usr")  # not followed
    used = disk_usage(tmp_path)
    assert 150_000 <= used < 150_000 + 4 * 8192
    assert disk_usage(tmp_path, stop_above=10) > 10


@pytest.fixture
def bwrap_rt(bwrap_required):
    root = short_tmpdir("rd-dq-")
    rt = get_runtime("bwrap", root_dir=root, ready_timeout=20.0, disk_quota="measured")
    yield rt
    for h in rt.list():
        rt.destroy(h)
    remove_tree(root)


def test_runtime_stops_the_sandbox_over_quota_and_spares_the_neighbour(bwrap_rt):
    rt = bwrap_rt
    hog = rt.create("1.1", SandboxSpec(limits=Limits(disk_mb=8, file_size_mb=4)))
    calm = rt.create("2.1", SandboxSpec(limits=Limits(disk_mb=8)))
    sandbox_pids = list(hog.pids)
    with ToolClient(calm.tool_socket) as c:
        assert c.call("bash", {"command": "head -c 2000000 /dev/zero > keep && echo ok", "timeout": 20}).output.strip() == "ok"
    with ToolClient(hog.tool_socket) as c:
        # RLIMIT_FSIZE stops one big file at once (EFBIG) ...
        r = c.call("bash", {"command": "head -c 6000000 /dev/zero > big; echo rc=$?", "timeout": 20})
        assert "rc=1" in r.output or "File too large" in r.output, r.output
        # ... and many small ones go past the quota, which only the measurement catches.
        c.call("bash", {"command": "rm -f big; for i in $(seq 12); do head -c 1048576 /dev/zero > f$i; done", "timeout": 20})
    assert rt.enforce_disk_quotas() and not rt.enforce_disk_quotas()  # stopped once
    assert all(not alive(p) for p in sandbox_pids)
    assert disk_usage(hog.workspace) < 64 * 1024  # the space is back at once
    with pytest.raises(DiskQuotaExceeded, match="disk quota of 8 MB"):
        ToolClient(hog.tool_socket, connect_timeout=2).call("bash", {"command": "true", "timeout": 5})
    with ToolClient(calm.tool_socket) as c:  # the neighbour under its quota is untouched
        assert c.call("bash", {"command": "wc -c < keep", "timeout": 20}).output.strip() == "2000000"
    assert rt.destroy(hog)  # the holder still destroys it as usual


def test_a_sandbox_its_holder_destroys_right_after_the_kill_is_still_reported(bwrap_rt, monkeypatch):
    """The run daemon sees the killed sandbox at once and destroys it while the init daemon's
    check still updates its state and empties it: the stop must be reported all the same (the
    log line and the ``sandbox.disk_quota_exceeded`` event come from this return value), and a
    second sandbox over quota in the same pass must be stopped too."""
    rt = bwrap_rt
    hogs = [rt.create(f"{i}.1", SandboxSpec(limits=Limits(disk_mb=8))) for i in (4, 5)]
    for h in hogs:
        with ToolClient(h.tool_socket) as c:
            c.call("bash", {"command": "for i in $(seq 12); do head -c 1048576 /dev/zero > f$i; done", "timeout": 20})
    kill, destroying = rt._kill, []

    def kill_then_holder_destroys(state):
        kill(state)
        if not destroying:  # destroy kills too: the plain kill there
            destroying.append(state["sandbox_id"])
            rt.destroy(next(h for h in hogs if h.sandbox_id == state["sandbox_id"]))
            destroying.clear()

    monkeypatch.setattr(rt, "_kill", kill_then_holder_destroys)
    stopped = rt.enforce_disk_quotas()
    assert sorted(i["sandbox_id"] for i in stopped) == sorted(h.sandbox_id for h in hogs), stopped
    assert all(i["used_bytes"] > 8 * 1024 * 1024 for i in stopped), stopped  # measured before it vanished


def test_a_plain_dead_sandbox_is_still_a_transport_error(bwrap_rt):
    h = bwrap_rt.create("3.1", SandboxSpec(limits=Limits(disk_mb=8)))
    bwrap_rt.destroy(h)
    with pytest.raises(ToolTransportError) as ei:
        ToolClient(h.tool_socket, connect_timeout=2).call("bash", {"command": "true", "timeout": 5})
    assert not isinstance(ei.value, DiskQuotaExceeded)


def hog_beside_calm(up, command: str):
    """A diskhog job (16 MB quota) running ``command`` beside a calm one writing 4 MB and printing
    its size: (the hog's result, the calm one's)."""
    with up.client(timeout_s=10) as c:
        hog, calm = c.submit([
            {"handler": "diskhog", "instance_id": "hog", "instance": {"disk_mb": 16, "command": command}},
            {"handler": "diskhog", "instance_id": "calm",
             "instance": {"disk_mb": 16, "command": "head -c 4000000 /dev/zero > data && wc -c < data"}},
        ])
        results = {r["job_id"]: r for r in c.gather([hog, calm], timeout_s=120)}
    return results[hog], results[calm]


def test_agent_writing_until_stopped_is_scored_zero_neighbour_ok(up_factory, bwrap_required, diskhog_entry_point):
    """The agent's own doing: reward 0 with the reason, never a failed (dropped) job (issue 35 item 6;
    before, status failed / DiskQuotaExceeded). The handler's eval, which rewards 1, is skipped."""
    up = up_factory("sandbox.runtime=bwrap", "sandbox.quota_interval_s=0.2", "sandbox.disk_quota=measured")
    bad, good = hog_beside_calm(up, HOG)
    assert bad["status"] == "ok" and bad["reward"] == 0.0, bad
    assert bad["failed_phase"] is None and bad["error"] is None, bad
    assert bad["eval_details"]["agent_fault"] == {"phase": "run", "type": "DiskQuotaExceeded"}, bad["eval_details"]
    assert "disk quota of 16 MB" in bad["eval_details"]["reason"]
    assert good["status"] == "ok", good
    assert good["eval_details"]["output"].strip() == "4000000"
    # The init daemon logs it once the hog's workspace is emptied, after the kill the run daemon
    # already saw: the result can come first (CI run of f0efd91 read the log before the line).
    deadline = time.monotonic() + 15
    while "sandbox_disk_quota_exceeded" not in up.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "sandbox_disk_quota_exceeded" in up.log()


def require_root_mounts():
    from rolloutd.sandbox.bounds import why_no_mounts

    why = why_no_mounts()
    if why is not None:
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":  # CI runs as root: there it must work
            pytest.fail("ROLLOUTD_TEST_STRICT=1: no hard disk quota here: " + why)
        pytest.skip("no hard disk quota here: " + why)


def test_hard_quota_agent_gets_enospc_and_the_job_goes_on(up_factory, bwrap_required, diskhog_entry_point):
    require_root_mounts()
    up = up_factory("sandbox.runtime=bwrap", "sandbox.quota_interval_s=0.2")
    fill = "head -c 40M /dev/zero > big; echo rc=$?; rm big; head -c 1M /dev/zero > small && echo small ok"
    bad, good = hog_beside_calm(up, fill)
    assert bad["status"] == "ok", (bad.get("error"), bad.get("failed_phase"))
    out = bad["eval_details"]["output"]
    assert "No space left on device" in out and "rc=1" in out and "small ok" in out, out
    assert good["status"] == "ok" and good["eval_details"]["output"].strip() == "4000000", good
    assert "sandbox_disk_quota_exceeded" not in up.log()


def test_destroy_and_reap_unmount_even_after_a_crash(bwrap_required):
    """The mounts are found in the mount table, not in the state: a creator that died (its
    sandbox "starting" forever, no state at all) is cleaned up by any later reap."""
    require_root_mounts()
    from rolloutd.sandbox import bounds
    from rolloutd.sandbox.runtime import STARTING_GRACE

    root = short_tmpdir("rd-dqm-")
    try:
        rt = get_runtime("bwrap", root_dir=root, ready_timeout=20.0)
        h = rt.create("5.1", SandboxSpec(limits=Limits(disk_mb=8)))
        # the workspace image and, as root, the sandbox's own devpts instance and tmpfs (/tmp, /dev/shm,
        # the grader's scratch; run/ is read-only)
        assert sorted(os.path.basename(m) for m in bounds.mounts_under(h.sandbox_dir)) == HOST_MOUNTS
        rt.destroy(h)
        assert not bounds.mounts_under(root) and not os.path.exists(h.sandbox_dir)
        # a dir left by a create() that died after mounting, before its first state write
        d = rt.sb_dir / "0123456789ab"
        (d / "workspace").mkdir(parents=True)
        bounds.make_ext4_image(d / "disk.img", 8 << 20, 0, 0)
        bounds.mount_ext4_image(d / "disk.img", d / "workspace")
        old = __import__("time").time() - STARTING_GRACE - 5
        os.utime(d, (old, old))
        rt.reap(keep=())
        assert not bounds.mounts_under(root) and not d.exists()
    finally:
        remove_tree(root)


def loop_backing_files(root) -> list:
    """Backing files of the attached loop devices that live under root (a nameless pooled
    image shows as '<dir>/#<inode> (deleted)')."""
    out = []
    for dev in sorted(os.listdir("/sys/block")):
        try:
            with open("/sys/block/%s/loop/backing_file" % dev) as f:
                path = f.read().strip()
        except OSError:
            continue  # not a loop device, or not attached
        if path.startswith(str(root) + "/"):
            out.append(path)
    return out


# A creator with a full workspace pool, then killed -9 (runs as a child: its fds must die with it).
POOL_CHILD = r"""
import json, sys, time
from rolloutd.sandbox import Limits, SandboxSpec, get_runtime
rt = get_runtime("bwrap", root_dir=sys.argv[1], ready_timeout=60.0, disk_pool=2)
h = rt.create("11.1", SandboxSpec(limits=Limits(disk_mb=8)))
end = time.monotonic() + 60
while rt._disk_pool.size() < 2 and time.monotonic() < end:
    time.sleep(0.05)
print("POOL " + json.dumps({"pool": rt._disk_pool.size(), "sandbox_dir": h.sandbox_dir}), flush=True)
time.sleep(600)
"""


def test_a_killed_creator_leaves_no_pooled_loop_device_or_image(bwrap_required):
    """The workspace pool's filesystems (loop device + detached mount + nameless image) are held
    only by the creator's fds: kill -9 frees them all, and the one it installed is reaped as
    before (mount table). Fails if the pool keeps any state the kernel does not drop with the
    process (named image files, mounts in a staging dir, devices without autoclear)."""
    require_root_mounts()
    import json
    import signal
    import subprocess
    import sys

    from rolloutd.sandbox import bounds

    from tests.conftest import wait_for

    root = short_tmpdir("rd-dqp-")
    os.chmod(root, 0o755)
    child = subprocess.Popen([sys.executable, "-c", POOL_CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("POOL ") and child.poll() is None:
            line = child.stdout.readline()  # the child's own logs come first; it exits on failure
        info = json.loads(line[5:] or "{}")
        assert info.get("pool") == 2, info
        # the sandbox's image (named, mounted) and the two pooled ones (nameless, mounted nowhere)
        held = loop_backing_files(root)
        assert len(held) == 3 and sum(p.endswith(" (deleted)") for p in held) == 2, held
        assert sorted(bounds.mounts_under(root)) == [os.path.join(info["sandbox_dir"], m) for m in HOST_MOUNTS]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        wait_for(lambda: len(loop_backing_files(root)) == 1, 30, "the pooled loop devices to go with their holder")
        rt = get_runtime("bwrap", root_dir=root, ready_timeout=20.0, disk_pool=0)
        assert rt.reap(keep=()) == ["11.1"]  # its creator is dead: the janitor takes it
        wait_for(lambda: not loop_backing_files(root), 30, "the installed workspace's loop device to go")
        assert not bounds.mounts_under(root)
        left = [p for p in (root / "disk-templates").iterdir() if not p.name.startswith("ext4-")]
        assert not left and not list((root / "sb").iterdir()), left
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdout.close()
        remove_tree(root)


def test_full_sandbox_root_refuses_cleanly_and_the_janitor_still_reaps(bwrap_required):
    from rolloutd.sandbox import SandboxNoSpace

    from tests.disk.fs import Filler, small_tmpfs

    with small_tmpfs(32 * 1024, prefix="rd-sbfs-") as root:
        rt = get_runtime("bwrap", root_dir=root, ready_timeout=20.0)
        old = rt.create("7.1", SandboxSpec(limits=Limits(disk_mb=8)))  # also lays down the tool library
        filler = Filler(root)
        filler.fill()
        before = sorted(p.name for p in rt.sb_dir.iterdir())
        for spec in (SandboxSpec(), SandboxSpec(workspace_files={"a.txt": "x" * 100_000})):
            with pytest.raises(SandboxNoSpace, match="no space left on the sandbox root"):
                rt.create("8.1", spec)
            assert sorted(p.name for p in rt.sb_dir.iterdir()) == before  # nothing half-made
        assert [h.job_id for h in rt.list()] == ["7.1"]
        assert rt.reap(keep=()) == ["7.1"]  # the janitor's sweep works on a full disk
        assert not rt.list() and all(not alive(p) for p in old.pids)
        filler.release()
        h = rt.create("9.1")  # and space back means sandboxes again
        rt.destroy(h)


def test_apptainer_workspace_is_the_measured_host_dir():
    """Apptainer (argv only: no apptainer binary here): /workspace is a bind of the host dir the
    node measures for Limits.disk_mb; the rest of the container's writable layer is
    --writable-tmpfs, in RAM and bounded by apptainer.conf's node-wide `sessiondir max size`."""
    from rolloutd.sandbox.apptainer import instance_start_argv

    argv = instance_start_argv(binary="apptainer", image="/img.sif", instance="rd-x", workspace="/sb/ab/workspace",
                               run_dir="/sb/ab/run", lib_dir="/sb/lib/h")
    assert argv[:5] == ["apptainer", "instance", "start", "--containall", "--writable-tmpfs"]
    assert argv[argv.index("/sb/ab/workspace:/workspace") - 1] == "--bind"
    assert not [a for a in argv if a.startswith("--overlay")]  # no disk-backed writable layer to fill


def test_the_workspace_pool_turns_itself_off_where_the_root_has_no_tmpfile(monkeypatch, tmp_path):
    """A sandbox root on a filesystem without O_TMPFILE (the pool's nameless images) turns the
    pool off once, with the reason, instead of failing (and logging) in the background at every
    start; starts then make their workspace on their own path as before."""
    import errno

    from rolloutd.sandbox import bounds

    from tests.conftest import wait_for

    calls = []

    def no_tmpfile(*a, **kw):
        calls.append(a)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(bounds, "prepare_ext4", no_tmpfile)
    pool = bounds.WorkspacePool(tmp_path, depth=2)
    try:
        assert pool.take(8 << 20, 0, 0) is None
        assert "no O_TMPFILE" in wait_for(lambda: pool.off, 30, "the pool to turn itself off")
        assert pool.take(8 << 20, 0, 0) is None and pool.size() == 0 and len(calls) == 1
    finally:
        pool.close()


def test_a_template_is_whole_even_while_a_child_still_holds_its_mount(monkeypatch):
    """A workspace is a copy of a template image whose lost+found was removed through a detached
    mount. A child forked meanwhile (another sandbox's bwrap, between fork and exec) holds that
    mount past our close: its unmount and write-back come later, and a copy taken before them was
    torn (CI: a workspace root still listing lost+found; pytest's stat in it: EBADMSG). The
    template must hold the removal when template_image returns, whoever else holds the mount."""
    require_root_mounts()
    import subprocess

    from rolloutd.sandbox import bounds

    held: list[int] = []
    detached = bounds._detached_ext4

    def inherited(image):  # what a forked child's copy of the fd table keeps alive
        fd = detached(image)
        held.append(os.dup(fd))
        return fd

    monkeypatch.setattr(bounds, "_detached_ext4", inherited)
    root = short_tmpdir("rd-dqt-")
    try:
        t = bounds.template_image(root / "templates", 8 << 20, 65534, 65534)
        assert held, "the template was not made through a mount"
        ls = subprocess.run(["debugfs", "-R", "ls -l /", str(t)], capture_output=True, text=True, timeout=30)
        assert ls.returncode == 0, ls.stderr
        assert "lost+found" not in ls.stdout, ls.stdout  # the image file itself, read while the mount lives
        fsck = subprocess.run(["e2fsck", "-fn", str(t)], capture_output=True, text=True, timeout=60)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        for fd in held:
            os.close(fd)
        _remove_tree(root)
