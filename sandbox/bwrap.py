"""bubblewrap runtime: daemonless, rootless, one set of namespaces per sandbox.

Process tree on the host:  bwrap (outer, our child) -> tool server (pid 1 of the sandbox's
pid namespace, --as-pid-1) -> bash / python sessions / user processes.
Killing the namespace's init (SIGKILL, from the host) makes the kernel kill everything in
the namespace, so nothing can escape destroy(). --die-with-parent is deliberately off:
sandboxes survive a daemon restart; state.json records the pids (with start times, to be
safe against pid reuse) so any process on the node can destroy or reap them later.

When the daemon runs as root, the sandbox is started as an unprivileged uid: by default one of
its own from the node's uid range (uids.py: per-uid kernel limits are then per sandbox), else
65534. RLIMIT_NPROC is never enforced for real uid 0, and a mapped root has no business reading
the host's root-owned files through the read-only mounts.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import bounds, procs
from .cgroups import CgroupV2
from .errors import RuntimeUnavailable, SandboxSpecError, SandboxStartError
from .log import log
from .runtime import LaunchContext, Runtime
from .uids import DEFAULT_UID_RANGE, UidAllocator, parse_uid_range

# Paths inside the sandbox.
WORKSPACE = "/workspace"
RUN_DIR = "/run/rolloutd"
LIB_DIR = "/run/rolloutd-lib"
CONFIG = RUN_DIR + "/config.json"
# The grader's scratch (its HOME and TMPDIR): a mount of its own, so an agent that fills /tmp (bytes
# or inodes) cannot make grading fail. The agent can write there too (same uid): the grade tool
# empties it after the purge. As root a host-made tmpfs with an inode bound; else bwrap's --size.
GRADE_DIR = "/run/rolloutd-grade"
GRADE_SCRATCH_INODES = 16384

# (op, src, dst) with op in {"ro-bind", "bind", "symlink"}; the pure argv builder takes these.
FsOp = Tuple[str, str, str]

_TOP_LEVEL = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# The bits of the host's /etc a shell, Python and TLS need; not the whole of /etc (secrets).
_ETC = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "resolv.conf", "gai.conf", "ld.so.cache",
        "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives", "ssl", "ca-certificates",
        "ca-certificates.conf", "pki", "mime.types", "protocols", "services", "os-release", "debian_version",
        "lsb-release", "terminfo", "locale.alias", "locale.conf")
_ROOTFS_SKIP = {"proc", "dev", "sys", "tmp", "run", "workspace", "mnt", "media", "lost+found", "boot"}


def host_system_ops(root: str = "/") -> List[FsOp]:
    """The host's /usr, /bin, /lib*, and a few /etc files, read-only (image=None)."""
    ops: List[FsOp] = []
    for name in _TOP_LEVEL:
        p = os.path.join(root, name)
        if os.path.islink(p):
            ops.append(("symlink", os.readlink(p), "/" + name))
        elif os.path.isdir(p):
            ops.append(("ro-bind", p, "/" + name))
    etc = os.path.join(root, "etc")
    names = list(_ETC) + sorted(n for n in _listdir(etc) if re.match(r"^python3(\.\d+)?$", n))
    for name in names:
        p = os.path.join(etc, name)
        if os.path.lexists(p) and os.path.exists(p):
            ops.append(("ro-bind", p, "/etc/" + name))
    return ops


def rootfs_ops(rootfs: str) -> List[FsOp]:
    """An unpacked image: each top-level entry read-only (the root itself stays bwrap's tmpfs
    so /workspace and /run/rolloutd can be mounted even when the image lacks them)."""
    if not os.path.isdir(rootfs):
        raise SandboxSpecError("image %s is not a root filesystem directory" % rootfs)
    ops: List[FsOp] = []
    for name in sorted(os.listdir(rootfs)):
        if name in _ROOTFS_SKIP:
            continue
        p = os.path.join(rootfs, name)
        if os.path.islink(p):
            ops.append(("symlink", os.readlink(p), "/" + name))
        elif os.path.isdir(p) or os.path.isfile(p):
            ops.append(("ro-bind", p, "/" + name))
    return ops


def _listdir(p: str) -> List[str]:
    try:
        return os.listdir(p)
    except OSError:
        return []


def build_argv(
    *,
    bwrap: str,
    fs_ops: Sequence[FsOp],
    workspace: str,
    run_dir: str,
    lib_dir: str,
    binds: Sequence[Tuple[str, str, bool]] = (),
    network: bool = False,
    workdir: str = WORKSPACE,
    env: Optional[Dict[str, str]] = None,
    python: str = "python3",
    info_fd: Optional[int] = None,
    seccomp_fd: Optional[int] = None,
    tmp_size_mb: Optional[int] = 512,
    shm_size_mb: Optional[int] = 64,
    hostname: str = "sandbox",
    devpts: Optional[str] = None,
    disable_userns: bool = True,
    grade_scratch_mb: Optional[int] = None,
    host_tmpfs: Optional[Dict[str, str]] = None,
) -> List[str]:
    """The exact bwrap command line (pure: no filesystem access, golden-testable)."""
    # --disable-userns (needs a user namespace of its own, hence --unshare-user, not --unshare-all's
    # "-try"): no nested user namespace, so the agent cannot mount anything (an unbounded tmpfs).
    argv = [bwrap, "--unshare-all"] + (["--unshare-user", "--disable-userns"] if disable_userns else [])
    if network:
        argv.append("--share-net")
    # setsid: the sandbox cannot push keystrokes into a terminal of ours (TIOCSTI).
    argv += ["--new-session", "--hostname", hostname, "--clearenv"]
    # The tool server is the namespace's pid 1: the kernel drops SIGKILL/SIGSTOP sent to it from
    # inside, so the agent cannot kill the tools (`kill -9 $PPID`); it reaps orphans itself.
    argv.append("--as-pid-1")
    for k, v in sorted((env or {}).items()):
        argv += ["--setenv", k, v]
    for op, src, dst in fs_ops:
        argv += ["--" + op, src, dst]
    # Every writable mount is bounded (docs/SANDBOX.md "Layout"): /tmp and /dev/shm are tmpfs of
    # a fixed size (without --size, /dev/shm would be a dir on /dev's tmpfs: half the host's RAM);
    # /run/rolloutd is read-only (the host binds tool.sock and hands the tool server its fd).
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if devpts:  # a host-made devpts instance with max= over bwrap's unbounded one (ptmx -> pts/ptmx)
        argv += ["--dev-bind", devpts, "/dev/pts"]  # --bind would add nodev: ptmx could not open
    # host_tmpfs: tmpfs the host made (root: with an inode bound, which bwrap's --size lacks), bound in.
    for size_mb, path in ((shm_size_mb, "/dev/shm"), (tmp_size_mb, "/tmp"), (grade_scratch_mb, GRADE_DIR)):
        if path in (host_tmpfs or {}):
            argv += ["--bind", (host_tmpfs or {})[path], path]
            continue
        if path == GRADE_DIR and not size_mb:
            continue
        if size_mb:
            argv += ["--size", str(int(size_mb) * 1024 * 1024)]
        argv += ["--tmpfs", path]
    argv += ["--bind", workspace, WORKSPACE, "--ro-bind", run_dir, RUN_DIR, "--ro-bind", lib_dir, LIB_DIR]
    for src, dst, ro in binds:
        argv += ["--ro-bind" if ro else "--bind", src, dst]
    # bwrap's root and /dev are tmpfs owned by the sandbox's uid; freeze both (not recursive:
    # /workspace, /tmp, /dev/shm and /dev/pts stay writable, each bounded).
    argv += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", workdir]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        argv += ["--add-seccomp-fd", str(seccomp_fd)]  # repeatable, unlike --seccomp
    argv += ["--", python, "-S", "-m", "rolloutd_toolserver", "--config", CONFIG]
    return argv


def bwrap_version(bwrap: str = "bwrap") -> Optional[Tuple[int, ...]]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in m.groups() if x is not None) if m else None


def resolve_run_as(run_as: Union[str, int, None, Tuple[int, int]]) -> Optional[Tuple[int, int]]:
    """"auto": nobody (65534) when we are root, else ourselves; None: never switch."""
    if run_as == "auto":
        return (65534, 65534) if os.geteuid() == 0 else None
    if run_as is None:
        return None
    if isinstance(run_as, int):
        return (run_as, run_as)
    if isinstance(run_as, tuple):
        return (int(run_as[0]), int(run_as[1]))
    uid, _, gid = str(run_as).partition(":")
    return (int(uid), int(gid or uid))


def probe(bwrap: str = "bwrap", run_as: Optional[Tuple[int, int]] = None, timeout: float = 10.0) -> Tuple[bool, str]:
    """Does bwrap really work here? Runs `bwrap --unshare-all ... true` for real."""
    path = shutil.which(bwrap)
    if path is None:
        return False, "%s not found on PATH" % bwrap
    argv = [path, "--unshare-all", "--new-session"]
    for op, src, dst in host_system_ops():
        argv += ["--" + op, src, dst]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "true"]
    kw: Dict[str, Any] = {}
    if run_as is not None and os.geteuid() == 0:
        kw.update(user=run_as[0], group=run_as[1], extra_groups=[])
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.SubprocessError) as e:
        return False, "bwrap failed to run: %s" % e
    if r.returncode != 0:
        return False, "bwrap --unshare-all failed (exit %d): %s" % (r.returncode, r.stderr.strip()[-300:])
    who = "uid %d" % (run_as[0] if run_as and os.geteuid() == 0 else os.geteuid())
    return True, "%s works (--unshare-all as %s)" % (path, who)


class BwrapRuntime(Runtime):
    name = "bwrap"
    nproc_scoped = True  # each sandbox has its own user namespace
    run_dir_read_only = True  # --ro-bind: the host binds tool.sock (see _pre_launch)

    def __init__(self, root_dir=None, *, bwrap: str = "bwrap", run_as: Any = "auto",
                 tmp_size_mb: Optional[int] = 512, shm_size_mb: Optional[int] = 64, cgroup: Any = "auto",
                 max_ptys: Optional[int] = 16, uid_range: Any = DEFAULT_UID_RANGE,
                 uid_state_dir: Optional[str] = None, grade_scratch_mb: Optional[int] = 128, **kw: Any) -> None:
        super().__init__(root_dir, **kw)
        path = shutil.which(bwrap)
        if path is None:
            raise RuntimeUnavailable("bubblewrap (%s) is not installed" % bwrap)
        self.bwrap = path
        self.run_as = resolve_run_as(run_as)
        span = parse_uid_range(uid_range)
        if span is not None and run_as == "auto" and os.geteuid() == 0:
            try:
                self.uids = UidAllocator(span[0], span[1], uid_state_dir)
            except OSError as e:  # no writable /run: this root's own state (unique per deployment only)
                log.warning("sandbox_uid_state_fallback", wanted=uid_state_dir or "/run/rolloutd-uids",
                            used=str(self.root_dir / "uids"), error=str(e))
                self.uids = UidAllocator(span[0], span[1], self.root_dir / "uids")
        version = bwrap_version(path) or (0, 0)
        if version < (0, 5):  # --size: bubblewrap >= 0.5 (Debian 12 has 0.8)
            raise RuntimeUnavailable("bubblewrap %s is too old: /tmp and /dev/shm could not be bounded "
                                     "(--size needs >= 0.5)" % ".".join(map(str, version)))
        self.disable_userns = version >= (0, 8)  # --disable-userns: bubblewrap >= 0.8 (SANDBOX.md)
        for name, v in (("tmp_size_mb", tmp_size_mb), ("shm_size_mb", shm_size_mb), ("grade_scratch_mb", grade_scratch_mb)):
            if (v is not None or name != "grade_scratch_mb") and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise SandboxSpecError("%s must be a positive number of MB, got %r" % (name, v))
        self.tmp_size_mb, self.shm_size_mb, self.grade_scratch_mb = tmp_size_mb, shm_size_mb, grade_scratch_mb
        if max_ptys is not None and (isinstance(max_ptys, bool) or not isinstance(max_ptys, int) or max_ptys <= 0):
            raise SandboxSpecError("max_ptys must be a positive number or None, got %r" % (max_ptys,))
        self.max_ptys = max_ptys  # per sandbox, as root (a devpts instance with max=); see SANDBOX.md
        self.cgroup = None
        if cgroup == "auto":
            self.cgroup = CgroupV2.detect()
        elif cgroup:
            self.cgroup = CgroupV2(Path(cgroup))
        self.python = self.python or "python3"

    def _inside(self, ctx: LaunchContext) -> Dict[str, str]:
        # per-call scratch files live on the sandbox's private tmpfs: half the latency of disk
        return {"socket": RUN_DIR + "/tool.sock", "ctl_dir": "/tmp/.rolloutd", "workdir": ctx.spec.workdir,
                "home": "/tmp/home", "python": None, "grade_scratch": GRADE_DIR if self.grade_scratch_mb else None}

    def _owner(self) -> Tuple[int, int]:
        return self.run_as if (self.run_as is not None and os.geteuid() == 0) else (os.geteuid(), os.getegid())

    def _pre_launch(self, ctx: LaunchContext) -> None:
        # /run/rolloutd is read-only inside, so the tool server cannot bind its socket there: we
        # bind it here and hand the listening fd down (bwrap passes inherited fds through). The
        # socket file stays ours (0600): as root, the agent (nobody) cannot even connect to it.
        fd = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach()
        ctx.extra.setdefault("fds", []).append(fd)  # closed by create() once bwrap holds it
        _bind_listen(fd, str(ctx.run_dir / "tool.sock"))  # no sandbox sees the dir yet
        os.chmod(ctx.run_dir / "tool.sock", 0o600)  # not os.umask: process-wide, and create() runs in threads
        ctx.extra["socket_fd"] = fd
        mounts = self.disk_quota != "measured"  # root, in the host's mount namespace
        if self.max_ptys and mounts:
            pts = ctx.dir / "pts"
            pts.mkdir(mode=0o755)
            bounds.mount_devpts(pts, self.max_ptys)  # unmounted with the sandbox dir (mount table)
            ctx.extra["devpts"] = str(pts)
        if mounts:  # /dev/shm, /tmp and the grader's scratch as host-made tmpfs, unmounted with the dir
            host: Dict[str, str] = {}
            for name, inside, mb, inodes in (("shm", "/dev/shm", self.shm_size_mb, 0), ("tmp", "/tmp", self.tmp_size_mb, 0),
                                             ("grade", GRADE_DIR, self.grade_scratch_mb, GRADE_SCRATCH_INODES)):
                if mb:
                    p = ctx.dir / name
                    p.mkdir(mode=0o755)
                    # one inode per 4 KiB page: every file that holds a byte takes a page anyway, so
                    # only empty files and dirs meet the bound (millions of them used to fit, at ~1 KiB
                    # of kernel memory each: bwrap's --size sets no nr_inodes, the kernel's default
                    # is half the RAM's pages)
                    bounds.mount_tmpfs(p, mb << 20, *ctx.owner, nr_inodes=inodes or max(1024, (mb << 20) // 4096))
                    host[inside] = str(p)
            ctx.extra["host_tmpfs"] = host

    def _prepare_dirs(self, ctx: LaunchContext) -> None:
        if os.geteuid() != 0 or ctx.owner[0] == 0:
            return
        uid, gid = ctx.owner
        os.chown(ctx.workspace, uid, gid)
        for dirpath, dirnames, filenames in os.walk(ctx.workspace):
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), uid, gid)
        os.chmod(ctx.config_path, 0o644)  # read by the tool server; the run dir itself stays ours

    def _launch(self, ctx: LaunchContext) -> Dict[str, Any]:
        spec = ctx.spec
        if spec.image is None:
            fs_ops = host_system_ops()
        elif spec.image.endswith(".sif"):
            raise SandboxSpecError("bwrap cannot mount .sif images; use the apptainer runtime, or unpack "
                                   "the image (apptainer build --sandbox DIR IMAGE.sif) and pass DIR")
        else:
            fs_ops = rootfs_ops(spec.image)
        info_r, info_w = os.pipe()
        seccomp_r = None
        if ctx.extra.get("bounds", {}).get("workspace") == "measured":
            prog = no_fallocate_filter()
            seccomp_r, w = os.pipe()
            os.write(w, prog)  # ~200 bytes: fits the pipe, bwrap reads it to EOF
            os.close(w)
            ctx.extra.setdefault("fds", []).append(seccomp_r)
        server_env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "PYTHONPATH": LIB_DIR, "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp/home",
        }
        argv = build_argv(
            bwrap=self.bwrap, fs_ops=fs_ops, workspace=str(ctx.workspace), run_dir=str(ctx.run_dir),
            lib_dir=str(ctx.lib_dir), binds=spec.binds, network=spec.network, workdir=spec.workdir,
            env=server_env, python=self.python, info_fd=info_w, seccomp_fd=seccomp_r, tmp_size_mb=self.tmp_size_mb,
            shm_size_mb=self.shm_size_mb, devpts=ctx.extra.get("devpts"), disable_userns=self.disable_userns,
            grade_scratch_mb=self.grade_scratch_mb, host_tmpfs=ctx.extra.get("host_tmpfs"),
        )
        pass_fds = [info_w, ctx.extra["socket_fd"]] + [fd for fd in (ctx.ready_fd, seccomp_r) if fd is not None]
        kw: Dict[str, Any] = {}
        cg_path = cg_fd = None
        drop = ctx.owner if (os.geteuid() == 0 and ctx.owner[0] != 0) else None
        if self.cgroup is not None and (spec.limits.memory_mb or spec.limits.nproc):
            cg_path = self.cgroup.create(ctx.sandbox_id, spec.limits.memory_mb, spec.limits.nproc)
            cg_fd = CgroupV2.open_procs(cg_path)
            kw["preexec_fn"] = _enter_cgroup_then_drop(cg_fd, drop)
        elif drop is not None:
            kw.update(user=drop[0], group=drop[1], extra_groups=[])
        log_fd = os.open(ctx.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                     pass_fds=pass_fds, start_new_session=True, close_fds=True, **kw)
        finally:
            os.close(log_fd)
            os.close(info_w)
            if cg_fd is not None:
                os.close(cg_fd)
        self._children[ctx.sandbox_id] = child
        pids, extra = [child.pid], {"pid_starts": [procs.start_time(child.pid)],
                                    "uid": drop[0] if drop else os.geteuid()}
        if cg_path is not None:
            extra["cgroup"] = str(cg_path)
        try:
            info = _read_info(info_r, child, self.ready_timeout)
        finally:
            os.close(info_r)
        init_pid = int(info["child-pid"])
        pids.append(init_pid)
        extra["pid_starts"].append(procs.start_time(init_pid))
        extra["pidns"] = info.get("pid-namespace")
        return {"pids": pids, "extra": extra}

    def _held_unlinked(self, state: Dict[str, Any]) -> int:
        """Deleted files still open in a sandbox process, opened through its /workspace mount
        (fdinfo's mnt_id: a deleted library under a read-only bind is not the agent's; a reopen
        through /proc/self/fd keeps the original mount). Counted once per inode."""
        pids = [int(p) for p in state.get("pids") or []]
        starts = list((state.get("extra") or {}).get("pid_starts") or []) + [None] * 2
        if len(pids) < 2:
            return 0
        ws_mnt = None
        try:
            with open("/proc/%d/mountinfo" % pids[1], "r", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) > 4 and parts[4] == WORKSPACE:
                        ws_mnt = parts[0]
        except OSError:
            return 0
        total, seen = 0, set()
        for pid in procs.namespace_pids(pids[1], starts[1]):
            try:
                fds = os.listdir("/proc/%d/fd" % pid)
            except OSError:
                continue
            for fd in fds:
                link = "/proc/%d/fd/%s" % (pid, fd)
                try:
                    if not os.readlink(link).endswith(" (deleted)"):
                        continue
                    with open("/proc/%d/fdinfo/%s" % (pid, fd), "r") as f:
                        info = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
                    if info.get("mnt_id", "").strip() != ws_mnt:
                        continue
                    st = os.stat(link)
                except (OSError, ValueError):
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    def _kill(self, state: Dict[str, Any]) -> None:
        pids = [int(p) for p in state.get("pids") or []]
        extra = state.get("extra") or {}
        starts = list(extra.get("pid_starts") or []) + [None] * len(pids)
        # The namespace's init first: its death takes every process of the sandbox with it.
        if len(pids) >= 2:
            procs.kill(pids[1], starts[1])
        if pids:
            procs.kill_tree(pids[0], starts[0])  # the outer bwrap, and anything not yet in the namespace
        if not procs.wait_gone(pids, timeout=5.0):
            log.warning("sandbox_processes_survived_kill", sandbox_id=state.get("sandbox_id"), pids=pids)
        if extra.get("cgroup"):
            CgroupV2.kill_and_remove(Path(extra["cgroup"]))


# AUDIT_ARCH_* and __NR_fallocate per ABI a sandbox may run code of.
_FALLOCATE_NR = {0xC000003E: (285, 0x40000000 | 285), 0x40000003: (324,), 0xC00000B7: (47,), 0x40000028: (352,)}
EOPNOTSUPP = 95


def no_fallocate_filter() -> bytes:
    """A classic-BPF seccomp program: fallocate(2) fails with EOPNOTSUPP, everything else runs.
    For measured workspaces: fallocate allocates any number of blocks at once (with
    FALLOC_FL_KEEP_SIZE past EOF, where RLIMIT_FSIZE never looks), so between two walks it could
    take the host's whole disk; without it blocks come only from writes (glibc's
    posix_fallocate falls back to writing). struct sock_filter: u16 code, u8 jt, u8 jf, u32 k."""
    import struct

    ld_abs, jeq, ret = 0x20, 0x15, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | EOPNOTSUPP
    prog: List[Tuple[int, int, int, int]] = [(ld_abs, 0, 0, 4)]  # A = arch
    arches = list(_FALLOCATE_NR.items())
    # per arch: if arch matches, load nr and compare; tail of each block returns allow
    blocks: List[List[Tuple[int, int, int, int]]] = []
    for _arch, nrs in arches:
        b = [(ld_abs, 0, 0, 0)]  # A = nr
        for i, nr in enumerate(nrs):
            left = len(nrs) - 1 - i  # compares after this one, then the allow
            b.append((jeq, left + 1, 0, nr))  # jump over the rest and the allow, onto the deny
        b += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
        blocks.append(b)
    # dispatch: one jeq per arch to its block; no match: allow
    n = len(arches)
    offset = 0
    for i, (arch, _nrs) in enumerate(arches):
        prog.append((jeq, (n - 1 - i) + 1 + offset, 0, arch))
        offset += len(blocks[i])
    prog.append((ret, 0, 0, allow))
    for b in blocks:
        prog += b
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _bind_listen(fd: int, path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fd))
    try:
        s.bind(path)
        s.listen(128)
    finally:
        s.close()  # the dup only; fd stays open and listening


def _enter_cgroup_then_drop(cg_fd: int, drop: Optional[Tuple[int, int]]):
    # Runs between fork and exec: only async-signal-safe-ish calls (os.write, set*id).
    def fn() -> None:
        os.write(cg_fd, b"0")
        if drop is not None:
            os.setgroups([])
            os.setgid(drop[1])
            os.setuid(drop[0])
    return fn


def _read_info(fd: int, child: subprocess.Popen, timeout: float) -> Dict[str, Any]:
    """bwrap writes {"child-pid": N, ...} to --info-fd once the namespaces exist."""
    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        r, _, _ = select.select([fd], [], [], max(0.0, min(0.2, deadline - time.monotonic())))
        if r:
            chunk = os.read(fd, 4096)
            buf += chunk
            try:
                return json.loads(buf.decode())
            except ValueError:
                pass
            if not chunk:
                raise SandboxStartError("bwrap exited (code %s) before creating the sandbox" % child.wait())
        elif child.poll() is not None:
            raise SandboxStartError("bwrap exited (code %s) before creating the sandbox" % child.returncode)
        if time.monotonic() > deadline:
            raise SandboxStartError("bwrap did not report its sandbox pid within %.1fs" % timeout)
