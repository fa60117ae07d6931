"""One host uid per sandbox (issue 35 item 4), from inside real bubblewrap sandboxes.

Per-uid kernel limits (inotify instances, pipe pages, POSIX mqueue bytes, keys, epoll watches,
the host-level process count) are counted per host uid across every namespace. When every
sandbox of a node ran as nobody, sandbox A holding them all broke sandbox B: inotify EMFILE,
8 KiB pipes and F_SETPIPE_SZ EPERM, mq_open EMFILE, add_key EDQUOT. Each sandbox now runs as a
uid of its own (root only: without root no uid can be switched, see docs/SANDBOX.md).
"""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.uids import DEFAULT_UID_RANGE, UidAllocator, UidsExhausted, parse_uid_range

from tests.conftest import wait_for

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a uid per sandbox needs root (docs/SANDBOX.md)")

# Raw syscalls (x86_64 numbers): nothing here may depend on what the image ships.
LIB = r'''
import ctypes, fcntl, os, sys
libc = ctypes.CDLL(None, use_errno=True)
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032

class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]

def inotify():
    fd = libc.inotify_init1(0)
    return fd, ctypes.get_errno()

def mq(name):  # ~80 KiB of RLIMIT_MSGQUEUE (800 KiB per uid) each
    at = MqAttr(0, 10, 8192, 0)
    r = libc.syscall(240, name.encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(at))
    return r, ctypes.get_errno()

def key(name):  # kernel.keys.maxkeys (200) per uid
    r = libc.syscall(248, b"user", name.encode(), b"x" * 64, 64, -3)  # KEY_SPEC_SESSION_KEYRING
    return r, ctypes.get_errno()
'''

# Sandbox A: take every inotify instance, pipe page, mqueue byte and key the uid may have, say
# what stopped each (the control: it really ran out), then hold them until destroyed.
HOG = LIB + r'''
import time
got = {}
fds = []
while len(fds) < 100000:
    fd, e = inotify()
    if fd < 0:
        break
    fds.append(fd)
got["inotify"] = (len(fds), e)
pipes, e = [], 0
soft = int(open("/proc/sys/fs/pipe-user-pages-soft").read()) or 16384
while len(pipes) < soft // 256 + 64:  # 1 MiB pipes: the soft limit is passed after soft/256
    r, w = os.pipe()
    pipes.append((r, w))
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
    except OSError as err:
        e = err.errno
        break
got["pipes"] = (len(pipes), e)
pipes += [os.pipe() for _ in range(64)]  # past the soft limit: new pipes of the uid get 2 pages
r, w = os.pipe()
got["pipe_size"] = fcntl.fcntl(w, F_GETPIPE_SZ)
for kind, fn in (("mq", mq), ("keys", key)):
    n = 0
    while n < 1000:
        r, e = fn("hog%d" % n)
        if r < 0:
            break
        n += 1
    got[kind] = (n, e)
with open("/workspace/.held.tmp", "w") as f:
    f.write(repr(got))
os.replace("/workspace/.held.tmp", "/workspace/held")
time.sleep(3600)
'''

# Sandbox B: what an agent's ordinary tools need.
CHECK = LIB + r'''
import asyncio, errno
out = {}
fd, e = inotify()
out["inotify"] = errno.errorcode.get(e, e) if fd < 0 else "ok"
if fd >= 0:
    wd = libc.inotify_add_watch(fd, b"/workspace", 0x100)  # IN_CREATE
    out["inotify_watch"] = "ok" if wd >= 0 else errno.errorcode.get(ctypes.get_errno())
r, w = os.pipe()
out["pipe_size"] = fcntl.fcntl(w, F_GETPIPE_SZ)
try:
    out["setpipe"] = fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
except OSError as err:
    out["setpipe"] = errno.errorcode[err.errno]
async def main():
    await asyncio.sleep(0)
    return "ok"
try:
    out["asyncio"] = asyncio.run(main())
except OSError as err:
    out["asyncio"] = errno.errorcode[err.errno]
r, e = mq("mine")
out["mq"] = "ok" if r >= 0 else errno.errorcode[e]
r, e = key("mine")
out["key"] = "ok" if r >= 0 else errno.errorcode[e]
print(repr(out))
'''


def _host_uid(pid: int) -> int:
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line for pid %d" % pid)


@root_only
def test_each_sandbox_runs_as_a_host_uid_of_its_own(bwrap_rt):
    a, b = bwrap_rt.create("a"), bwrap_rt.create("b")
    ua, ub = _host_uid(a.pids[1]), _host_uid(b.pids[1])  # the tool servers, seen from the host
    first, last = parse_uid_range(DEFAULT_UID_RANGE)  # the runtime's default
    assert ua != ub and first <= ua <= last and first <= ub <= last, (ua, ub)
    assert (a.extra["uid"], b.extra["uid"]) == (ua, ub)
    assert Path(a.workspace).stat().st_uid == ua  # the workspace is its sandbox's
    r = bwrap_rt.client(a, timeout=20).call("bash", {"command": "id -u; id -g; id -G", "timeout": 10})
    assert r.output.split() == [str(ua)] * 3, r  # no group of another sandbox either
    held = bwrap_rt.rt.uids.allocated()
    assert {held[str(ua)]["owner"], held[str(ub)]["owner"]} == {a.sandbox_id, b.sandbox_id}
    bwrap_rt.rt.destroy(a)
    assert str(ua) not in bwrap_rt.rt.uids.allocated()  # released with its sandbox
    assert str(ub) in bwrap_rt.rt.uids.allocated()


@root_only
def test_per_uid_limits_exhausted_in_one_sandbox_leave_another_working(bwrap_rt):
    """A takes every inotify instance, passes the pipe-page soft limit, fills its mqueue bytes and
    its key quota; B (same runtime, same node) still gets all of them, and asyncio runs there."""
    a = bwrap_rt.create("hog", SandboxSpec(workspace_files={"hog.py": HOG}))
    b = bwrap_rt.create("victim", SandboxSpec(workspace_files={"check.py": CHECK}))
    ca, cb = bwrap_rt.client(a, timeout=60), bwrap_rt.client(b, timeout=60)
    r = ca.call("bash", {"command": "(python3 hog.py > /tmp/hog.log 2>&1 &)", "timeout": 30})
    assert r.exit_code == 0, r
    held = Path(a.workspace) / "held"
    wait_for(held.exists, timeout_s=60, what="the hog to take every per-uid resource")
    got = eval(held.read_text())  # {what: (count, errno that stopped it)}
    # the control: A really ran out of each (EMFILE, EPERM, EMFILE, EDQUOT)
    assert got["inotify"][1] == 24 and got["pipes"][1] == 1 and got["pipe_size"] == 8192, got
    assert got["mq"][1] == 24 and got["keys"][1] == 122, got
    r = cb.call("bash", {"command": "python3 check.py", "timeout": 30})
    assert r.exit_code == 0, r
    out = eval(r.output.strip().splitlines()[-1])
    assert out == {"inotify": "ok", "inotify_watch": "ok", "pipe_size": 65536, "setpipe": 1 << 20,
                   "asyncio": "ok", "mq": "ok", "key": "ok"}, (out, got)


@root_only
def test_the_grader_scratch_and_tmp_are_bounded_in_inodes_too(bwrap_rt):
    """As root /tmp, /dev/shm and the grader's scratch are host-made tmpfs with nr_inodes (bwrap's
    --size sets none: millions of empty files used to fit in a 512 MB /tmp)."""
    if bwrap_rt.rt.disk_quota == "measured":
        pytest.skip("no mounts here: %s" % bwrap_rt.rt.disk_quota_reason)
    h = bwrap_rt.create("inodes")
    r = bwrap_rt.client(h, timeout=20).call("bash", {"command": "df -iP /tmp /dev/shm /run/rolloutd-grade | tail -n +2",
                                                     "timeout": 10})
    inodes = {f[-1]: int(f[1]) for f in (ln.split() for ln in r.output.splitlines())}
    assert inodes == {"/tmp": 512 * 256, "/dev/shm": 64 * 256, "/run/rolloutd-grade": 16384}, r


def _allocate_many(state_dir: str, n: int, q) -> None:
    alloc = UidAllocator(3000000000, 3000000999, state_dir)
    got = []
    for i in range(n):
        d = Path(state_dir) / ("p%d-%d" % (os.getpid(), i))
        d.mkdir()
        got.append(alloc.allocate("%d-%d" % (os.getpid(), i), d))
    q.put(got)


def test_uid_allocation_is_unique_across_processes(tmp_path):
    """Three creator processes and this one at once (threads share slots.SlotAllocator's lock
    path with the loopback allocator, tested under threads in test_sandbox_loopback.py)."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allocate_many, args=(str(tmp_path), 40, q)) for _ in range(3)]
    for p in procs:
        p.start()
    _allocate_many(str(tmp_path), 40, q)
    got = [u for _ in range(4) for u in q.get(timeout=60)]
    for p in procs:
        p.join(60)
    assert len(got) == 160 and len(set(got)) == 160
    assert all(3000000000 <= u <= 3000000999 for u in got)


def test_uids_of_a_crashed_creator_are_reclaimed_once_their_dirs_are_gone(tmp_path):
    alloc = UidAllocator(3000001000, 3000001002, tmp_path / "state")
    dirs = [tmp_path / ("sb%d" % i) for i in range(3)]
    for d in dirs:
        d.mkdir()
    uids = [alloc.allocate("sb%d" % i, d) for i, d in enumerate(dirs)]
    with pytest.raises(UidsExhausted):  # held while their dirs exist, whoever made them
        alloc.allocate("late", dirs[0])
    dirs[1].rmdir()  # the janitor removed a dead daemon's sandbox
    assert UidAllocator(3000001000, 3000001002, tmp_path / "state").reclaim_stale() == [str(uids[1])]
    assert not alloc.release(uids[0], owner="someone else")  # a late duplicate destroy frees nothing
    assert alloc.release(uids[0], owner="sb0")
    assert sorted(int(k) for k in alloc.allocated()) == [uids[2]]


def test_uid_ranges_are_checked(tmp_path):
    from rolloutd.sandbox.errors import SandboxSpecError

    assert parse_uid_range("2000000000-2000065535") == (2000000000, 2000065535)
    assert parse_uid_range("") is None and parse_uid_range("off") is None
    for bad in ("100-10", "60000-70000", "0-5", "abc", "5"):
        with pytest.raises(SandboxSpecError):
            parse_uid_range(bad)


@root_only
def test_without_a_range_every_sandbox_runs_as_nobody_as_before(short_root):
    from tests.conftest import require_bwrap

    require_bwrap()
    rt = get_runtime("bwrap", root_dir=short_root, uid_range="")
    assert rt.uids is None
    h = rt.create("old")
    try:
        assert _host_uid(h.pids[1]) == 65534
    finally:
        rt.destroy(h)


@root_only
def test_uid_range_setting_reaches_the_runtime(short_root):
    """`sandbox.uid_range` goes from the config through the phase daemons to their runtime."""
    import types

    from rolloutd.bus.config import Config
    from rolloutd.daemons.phase import PhaseDaemon
    from rolloutd.sandbox.errors import SandboxSpecError
    from tests.conftest import require_bwrap

    require_bwrap()

    def runtime(**sandbox):
        cfg = Config({"sandbox": {"runtime": "bwrap", "root_dir": str(short_root / "sb"), **sandbox}})
        return PhaseDaemon._make_runtime(types.SimpleNamespace(cfg=cfg))

    assert Config().section("sandbox")["uid_range"] == DEFAULT_UID_RANGE
    rt = runtime(uid_range="2100000000-2100000009")
    assert (rt.uids.first, rt.uids.last) == (2100000000, 2100000009)
    assert runtime().uids.first == 2000000000
    assert runtime(uid_range="").uids is None
    with pytest.raises(SandboxSpecError, match="uid_range"):
        runtime(uid_range="10-1")


def test_doctor_reports_whether_sandboxes_share_a_uid(short_root):
    from rolloutd.sandbox import doctor
    from tests.conftest import require_bwrap

    require_bwrap()
    own = {c.name: c for c in doctor.check(short_root, deep=True)}["sandbox_uids"]
    shared = {c.name: c for c in doctor.check(short_root, deep=False, uid_range="")}["sandbox_uids"]
    assert not shared.ok and shared.optional and "shared by every sandbox" in shared.detail, shared
    if os.geteuid() == 0:
        assert own.ok and "a host uid of its own from 2000000000-2000065535" in own.detail, own
        assert "the test sandbox ran as uid 20000" in own.detail, own  # verified on a real sandbox
    else:
        assert not own.ok and own.detail.startswith("not root"), own


@root_only
def test_an_unwritable_state_dir_falls_back_to_the_sandbox_root(short_root):
    from tests.conftest import require_bwrap

    require_bwrap()
    rt = get_runtime("bwrap", root_dir=short_root, uid_state_dir="/proc/rolloutd-uids")  # mkdir: ENOENT
    assert rt.uids.state_dir == short_root / "uids"
    h = rt.create("fallback")
    try:
        assert str(h.extra["uid"]) in rt.uids.allocated()
    finally:
        rt.destroy(h)
    assert not rt.uids.allocated()
