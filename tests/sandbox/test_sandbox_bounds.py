"""Every path a sandbox can write is bounded (issue 24 item 3).

The walk runs inside a real bwrap sandbox: it reads the sandbox's own mount table, tries to
create a file on every mount, and writes into each one that lets it until the kernel refuses
(or a cap well past the bound). A writable mount this file does not know fails the test, so
a new writable path cannot appear unbounded unnoticed. As root (CI) the workspace is a
loop-mounted ext4 image: 0 bytes past Limits.disk_mb; without root it is measured by the node
(the runtime's enforce_disk_quotas), whose reported usage must be exact.
"""
from __future__ import annotations

import json
import os

import pytest
from rolloutd.sandbox import DiskQuotaExceeded, Limits, SandboxSpec, ToolClient, bounds
from rolloutd.sandbox.runtime import disk_usage

from tests.conftest import require_bwrap
from tests.sandbox.conftest import Tracker, _make

MB = 1 << 20
DISK_MB, TMP_MB, SHM_MB, GRADE_MB = 8, 16, 4, 8
SLACK = 4 * MB           # the probe writes this far past a bound before giving up
UNKNOWN_CAP = 64 * MB    # enough to show a path is unbounded without filling the host

# Runs inside the sandbox (python3 -c): every mount, writable or not, and how much it took.
PROBE = r'''
import errno, json, os, sys
caps, keep = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
def unescape(s):
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
res = {}
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    f = left.split()
    mp, opts, fstype = unescape(f[4]), f[5].split(","), right.split()[0]
    if not os.path.isdir(mp):
        # a bind of one file: storage if it is a regular file we may write (devices are not)
        if os.path.isfile(mp) and "rw" in opts and os.access(mp, os.W_OK):
            res[mp] = {"fstype": fstype, "written": None, "error": "writable file"}
        continue
    path = os.path.join(mp, ".rd_probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        continue  # EROFS, EACCES, proc/devpts refusing regular files: not writable
    cap, written, err, buf = caps.get(mp, caps["*"]), 0, None, b"\0" * (1 << 20)
    try:
        while written < cap:
            written += os.write(fd, buf)
        os.fsync(fd)
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    os.close(fd)
    if mp not in keep:
        os.unlink(path)
    res[mp] = {"fstype": fstype, "written": written, "error": err}
print(json.dumps(res))
'''


def probe(c: ToolClient, caps: dict, keep=()) -> dict:
    cmd = "python3 -c %s %s %s" % tuple(map(_q, (PROBE, json.dumps(caps), json.dumps(list(keep)))))
    r = c.call("bash", {"command": cmd, "timeout": 120})
    assert r.exit_code == 0, r
    return json.loads(r.output.strip().splitlines()[-1])


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


@pytest.fixture
def bounded_rt(short_root):
    require_bwrap()
    t = Tracker(_make("bwrap", short_root, tmp_size_mb=TMP_MB, shm_size_mb=SHM_MB, grade_scratch_mb=GRADE_MB))
    if os.environ.get("ROLLOUTD_TEST_STRICT") == "1" and os.geteuid() == 0:  # CI: the hard bound must be in use
        assert t.rt.disk_quota == "loop", "ROLLOUTD_TEST_STRICT=1 as root, but %s" % t.rt.disk_quota_reason
    yield t
    t.cleanup()


def test_every_writable_mount_is_known_and_bounded(bounded_rt):
    t = bounded_rt
    h = t.create("walk", SandboxSpec(limits=Limits(disk_mb=DISK_MB)))
    known = {"/workspace": DISK_MB * MB, "/tmp": TMP_MB * MB, "/dev/shm": SHM_MB * MB,
             "/run/rolloutd-grade": GRADE_MB * MB}  # the grader's scratch (emptied by grade after the purge)
    caps = {mp: b + SLACK for mp, b in known.items()}
    caps["*"] = UNKNOWN_CAP
    hard = getattr(t.rt, "disk_quota", "measured") in ("loop", "tmpfs")
    with t.client(h, timeout=150) as c:
        res = probe(c, caps, keep=() if hard else ("/workspace",))
    unknown = {mp: r for mp, r in res.items() if mp not in known}
    assert not unknown, "writable paths the sandbox's bounds do not cover: %s" % unknown
    assert set(res) == set(known), res  # each known path is writable (else the walk proves nothing)
    for mp in ("/tmp", "/dev/shm", "/run/rolloutd-grade"):
        assert res[mp]["error"] == "ENOSPC" and res[mp]["written"] <= known[mp], (mp, res[mp])
    ws = res["/workspace"]
    if hard:
        assert ws["error"] == "ENOSPC" and ws["written"] <= known["/workspace"], ws
        img = os.path.join(h.sandbox_dir, "disk.img")
        if getattr(t.rt, "disk_quota", "measured") == "loop":  # the host holds at most the image's size
            assert os.stat(img).st_blocks * 512 <= DISK_MB * MB
    else:  # measured: the write goes through, the node stops the sandbox and says exactly how much
        assert ws["error"] is None and ws["written"] == caps["/workspace"], ws
        expected = disk_usage(h.workspace)  # /run/rolloutd is read-only: nothing to count there
        stopped = t.rt.enforce_disk_quotas()
        assert [s["sandbox_id"] for s in stopped] == [h.sandbox_id]
        assert stopped[0]["used_bytes"] == expected


def test_run_dir_is_read_only_and_the_socket_is_the_hosts(bounded_rt):
    t = bounded_rt
    h = t.create("run")
    with t.client(h, timeout=30) as c:
        r = c.call("bash", {"command": "touch /run/rolloutd/x; rm -f /run/rolloutd/tool.sock; "
                                       "chmod 000 /run/rolloutd; echo rc=$?", "timeout": 20})
        assert "Read-only file system" in r.output and "rc=1" in r.output, r.output
        assert c.call("bash", {"command": "echo still", "timeout": 20}).output == "still\n"
    st = os.stat(h.tool_socket)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
    if os.geteuid() == 0 and t.rt.run_as:
        with ToolClient(h.tool_socket, timeout=30) as c:  # the agent (nobody) cannot reach it
            r = c.call("bash", {"command": "python3 -c 'import socket; socket.socket(socket.AF_UNIX)"
                                           ".connect(\"/run/rolloutd/tool.sock\")'", "timeout": 20})
        assert "Permission denied" in r.output, r.output


def _hog_files(c: ToolClient, n: int, mb: int, how: str) -> None:
    cmd = "; ".join(how.format(f="/workspace/f%d" % i, mb=mb) for i in range(n))
    c.call("bash", {"command": cmd, "timeout": 60})


@pytest.mark.parametrize("how", ["fallocate -l {mb}M {f}", ": > {f}; fallocate -n -l {mb}M {f}",
                                 "head -c {mb}M /dev/zero > {f}"])
def test_past_the_workspace_limit(bounded_rt, how):
    """fallocate (also --keep-size: blocks past EOF that RLIMIT_FSIZE never sees) and plain
    writes. Hard: ENOSPC and the host holds at most disk_mb. Measured: fallocate is denied, each
    written file stops at the quota (RLIMIT_FSIZE), the node stops the sandbox and reports
    exactly what the files hold (the walk used to stop at the quota)."""
    t = bounded_rt
    h = t.create("fa", SandboxSpec(limits=Limits(disk_mb=DISK_MB)))
    with t.client(h, timeout=90) as c:
        _hog_files(c, 3, 3 * DISK_MB, how)
        if getattr(t.rt, "disk_quota", "measured") == "loop":
            assert os.stat(os.path.join(h.sandbox_dir, "disk.img")).st_blocks * 512 <= DISK_MB * MB
        if getattr(t.rt, "disk_quota", "measured") in ("loop", "tmpfs"):
            assert disk_usage(h.workspace) <= DISK_MB * MB
            assert not t.rt.enforce_disk_quotas()  # nothing to measure: the kernel bounds it
            r = c.call("bash", {"command": "rm -f /workspace/f*; echo ok > /workspace/after; cat /workspace/after",
                                "timeout": 20})
            assert r.output == "ok\n"  # deleting gives the space back; the job goes on
            return
    expected = disk_usage(h.workspace)
    if "fallocate" in how:
        assert expected < MB and not t.rt.enforce_disk_quotas()  # denied: nothing allocated
        return
    assert expected >= 3 * DISK_MB * MB  # three files, each at the quota alone
    stopped = t.rt.enforce_disk_quotas()
    assert stopped and stopped[0]["used_bytes"] == expected, (stopped, expected)
    with pytest.raises(DiskQuotaExceeded, match="held %d bytes" % expected):
        ToolClient(h.tool_socket, connect_timeout=2).call("bash", {"command": "true", "timeout": 5})


def test_measured_fallback_reports_exact_usage(short_root):
    """Forced to the measured mechanism (what a node without root runs), also as root."""
    require_bwrap()
    t = Tracker(_make("bwrap", short_root, tmp_size_mb=TMP_MB, shm_size_mb=SHM_MB, disk_quota="measured"))
    try:
        h = t.create("m", SandboxSpec(limits=Limits(disk_mb=DISK_MB)))
        assert not bounds.mounts_under(h.sandbox_dir)
        with t.client(h, timeout=90) as c:
            _hog_files(c, 3, DISK_MB, "head -c {mb}M /dev/zero > {f}")
        expected = disk_usage(h.workspace)
        stopped = t.rt.enforce_disk_quotas()
        assert stopped and stopped[0]["used_bytes"] == expected >= 3 * DISK_MB * MB, (stopped, expected)
    finally:
        t.cleanup()


def test_measured_fallback_counts_deleted_files_held_open_and_denies_fallocate(short_root):
    """What the walk cannot see: files deleted while open (also reopened read-only through
    /proc/self/fd, and held by a detached process). And fallocate, which allocates any amount
    at once (--keep-size past RLIMIT_FSIZE), is denied by a seccomp filter in measured mode;
    RLIMIT_FSIZE defaults to the quota so no single file outgrows it between two walks."""
    require_bwrap()
    t = Tracker(_make("bwrap", short_root, tmp_size_mb=TMP_MB, shm_size_mb=SHM_MB, disk_quota="measured"))
    try:
        h = t.create("held", SandboxSpec(limits=Limits(disk_mb=DISK_MB)))
        with t.client(h, timeout=60) as c:
            r = c.call("bash", {"command": ": > a; fallocate -n -l 100M a; fallocate -l 100M b; ulimit -f; "
                                           "head -c 20M /dev/zero > big; echo rc=$?; rm -f a b big",
                                "timeout": 30})
            assert "fallocate failed" in r.output and "%d\n" % (DISK_MB * 1024) in r.output, r.output
            assert "rc=153" in r.output, r.output  # SIGXFSZ at the quota (128 + 25)
            c.call("bash", {"command": "(exec 3>/workspace/d; rm /workspace/d; head -c 6M /dev/zero >&3; "
                                       "exec 4</proc/self/fd/3; exec 3>&-; setsid sleep 1000 <&4 &); "
                                       "(exec 3>/workspace/e; rm /workspace/e; head -c 5M /dev/zero >&3; "
                                       "setsid sleep 1000 &)", "timeout": 30})
        assert disk_usage(h.workspace) < MB  # the walk sees nothing
        stopped = t.rt.enforce_disk_quotas()
        assert stopped and stopped[0]["used_bytes"] >= 11 * MB, stopped
    finally:
        t.cleanup()


def test_pooled_workspaces_have_their_own_size_and_start_empty(bounded_rt):
    """As root the loop workspaces come from a pool made ahead of demand (bounds.WorkspacePool),
    one queue per (size, owner; root-owned where each sandbox has a uid of its own): a sandbox must
    get an empty filesystem of exactly its own disk_mb, owned by the sandbox's uid, even when sizes
    alternate, and the bound must hold."""
    from tests.conftest import wait_for

    t = bounded_rt
    if getattr(t.rt, "disk_quota", "measured") != "loop":
        pytest.skip("no loop workspaces here (%s)" % t.rt.disk_quota_reason)
    pool = t.rt._disk_pool
    for i, mb in enumerate((8, 12, 8, 12)):
        if i >= 2:  # both kinds have been asked for: the next start takes a ready one
            wait_for(lambda: pool.size() >= 2, 60, "the pool to make one of each size")
        h = t.create("p%d" % i, SandboxSpec(limits=Limits(disk_mb=mb), workspace_files={"task.md": "x"}))
        with t.client(h, timeout=60) as c:
            r = c.call("bash", {"command": "stat -f -c '%b %S' /workspace; ls -A /workspace; "
                                           "stat -c %u /workspace; head -c 20M /dev/zero > /workspace/big; echo rc=$?",
                                "timeout": 60})
        size, listing, owner, rest = r.output.split("\n", 3)
        blocks, bsize = map(int, size.split())
        assert (mb - 1) * MB < blocks * bsize <= mb * MB, r.output  # its own size, less ext4's metadata
        assert (listing, int(owner)) == ("task.md", h.extra["uid"]), r.output
        assert "No space left on device" in rest and "rc=1" in rest, r.output
        assert os.stat(os.path.join(h.sandbox_dir, "disk.img")).st_blocks * 512 <= mb * MB
        t.rt.destroy(h)
    assert pool.hits >= 2, (pool.hits, pool.misses)
