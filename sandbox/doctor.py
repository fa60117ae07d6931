"""`rolloutd doctor`: which sandbox runtimes really work on this machine, and why not.

check() runs real probes (a `bwrap --unshare-all true`, and by default a full bwrap
sandbox start + ping + destroy); nothing is inferred from the presence of a binary alone.
It creates nothing that outlives it: the full start runs in a temporary root, removed after
(in the deployment's sandbox root only with in_root=True / --in-root).
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .runtime import MAX_SOCKET_PATH, _remove_sandbox_dir, default_root, free_space, resolve_disk_quota
from .uids import DEFAULT_UID_RANGE

MIN_FREE_GB = 10.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    optional: bool = False  # a failed optional check only narrows the choice of runtime


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _userns() -> Check:
    notes, ok = [], True
    max_ns = _read("/proc/sys/user/max_user_namespaces")
    if max_ns is not None:
        notes.append("max_user_namespaces=%s" % max_ns)
        ok = ok and max_ns != "0"
    clone = _read("/proc/sys/kernel/unprivileged_userns_clone")
    if clone is not None:
        notes.append("unprivileged_userns_clone=%s" % clone)
        ok = ok and clone == "1"
    apparmor = _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if apparmor is not None:
        notes.append("apparmor_restrict_unprivileged_userns=%s" % apparmor)
        ok = ok and apparmor == "0"
    return Check("user_namespaces", ok, ", ".join(notes) or "no sysctl found (kernel default)")


def _python() -> Check:
    py = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if py is None:
        return Check("host_python3", False, "no python3 in /usr: image=None sandboxes cannot start their tool server")
    try:
        v = subprocess.run([py, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return Check("host_python3", False, "%s does not run: %s" % (py, e))
    ok = tuple(int(x) for x in v.split(".")[:2]) >= (3, 8)
    return Check("host_python3", ok, "%s %s (tool server needs >= 3.8; used by image=None sandboxes)" % (py, v))


def _bwrap(root_dir: Path, deep: bool, disk_quota: str = "auto", shm_size_mb: int = 64,
           in_root: bool = False, seen: Optional[Dict[str, object]] = None,
           uid_range: str = DEFAULT_UID_RANGE) -> List[Check]:
    from . import bwrap as bw

    out = []
    path = shutil.which("bwrap")
    if path is None:
        return [Check("bwrap", False, "bubblewrap not installed (apt-get install bubblewrap)")]
    version = bw.bwrap_version(path)
    out.append(Check("bwrap", True, "%s %s" % (path, ".".join(map(str, version or ())) or "?")))
    run_as = bw.resolve_run_as("auto")
    ok, detail = bw.probe(path, run_as)
    out.append(Check("bwrap_unshare_all", ok, detail))
    if ok and deep:
        from .bwrap import BwrapRuntime
        from .client import ToolClient
        from .spec import Limits, SandboxSpec

        where = root_dir if in_root else Path(tempfile.mkdtemp(prefix="rolloutd-doctor-"))
        if not in_root:
            os.chmod(where, 0o711)  # the sandbox uid (nobody, as root) must get through
        try:
            rt = BwrapRuntime(where, ready_timeout=30, disk_quota=disk_quota, shm_size_mb=shm_size_mb,
                              disk_pool=0, uid_range=uid_range)  # one sandbox: filesystems made ahead would go unused
            h = rt.create("doctor", SandboxSpec(loopback=False, limits=Limits(disk_mb=16)))
            try:
                with ToolClient(h.tool_socket) as c:
                    r = c.call("bash", {"command": "echo ok; df -kP /dev/shm /workspace | tail -n +2", "timeout": 10})
                    ping = c.ping(timeout=10)
                lines = r.output.splitlines()
                good = bool(lines) and lines[0] == "ok"
                if seen is not None:
                    seen["hardened"] = ping.info.get("hardened")
                    rows = [ln.split() for ln in lines[1:]]
                    seen["df"] = {f[-1]: int(f[1]) for f in rows if len(f) == 6 and f[1].isdigit()}
                    seen["bounds"] = dict(rt._read_state(Path(h.sandbox_dir)) or {}).get("bounds")
                    seen["uid"] = h.extra.get("uid")
                out.append(Check("bwrap_sandbox", good, "created in %s, ran `echo ok` through the tool server, destroyed"
                                 % ("the sandbox root" if in_root else "a temporary root (removed)")
                                 if good else "tool server answered %r" % r))
            finally:
                rt.destroy(h)
        except Exception as e:
            out.append(Check("bwrap_sandbox", False, "full sandbox start failed: %s" % str(e)[-400:]))
        finally:
            if not in_root:
                _remove_sandbox_dir(where)
    return out


def _ptrace(seen: Dict[str, object], deep: bool) -> Check:
    """What keeps the agent's processes out of the tool server's memory and descriptors."""
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    yama = ("Yama ptrace_scope=%s" % scope) if scope is not None else "no Yama LSM"
    hardened = seen.get("hardened")
    if hardened is True:
        how, ok = "the tool server is non-dumpable (PR_SET_DUMPABLE 0: /proc/<pid>/mem, ptrace, " \
                  "process_vm_*, pidfd_getfd refused; verified in the test sandbox)", True
    elif hardened is False:
        how, ok = "the tool server could NOT make itself non-dumpable: the agent can read its memory", False
    else:
        how, ok = "the tool server makes itself non-dumpable at start (PR_SET_DUMPABLE 0; not verified: %s)" % (
            "--quick" if not deep else "no sandbox started"), True
    extra = [yama]
    status = _read_status("Seccomp")
    extra.append("seccomp %s" % ("available" if status is not None else "unknown"))
    abi = _landlock_abi()
    extra.append("Landlock ABI %d" % abi if abi > 0 else "no Landlock")
    return Check("ptrace_protection", ok, "%s; %s (docs/SANDBOX.md threat model)" % (how, ", ".join(extra)))


def _read_status(field: str) -> Optional[str]:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _landlock_abi() -> int:
    """landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION): the ABI, or <= 0."""
    import ctypes
    import platform

    nr = {"x86_64": 444, "aarch64": 444}.get(platform.machine())
    if nr is None:
        return 0
    try:
        return int(ctypes.CDLL(None, use_errno=True).syscall(nr, None, 0, 1))
    except Exception:
        return 0


def _shm(shm_size_mb: int, seen: Dict[str, object]) -> Check:
    df = seen.get("df") or {}
    got = df.get("/dev/shm")
    if got is not None:
        ok = got <= shm_size_mb * 1024
        return Check("shm_bound", ok, "/dev/shm is a tmpfs of %d KiB in the test sandbox (sandbox.shm_size_mb=%d)%s"
                     % (got, shm_size_mb, "" if ok else ": NOT bounded"))
    return Check("shm_bound", True, "/dev/shm: a tmpfs of %d MB per bwrap sandbox (sandbox.shm_size_mb; "
                 "not verified without a sandbox start)" % shm_size_mb)


def _disk_quota(disk_quota: str, seen: Dict[str, object]) -> Check:
    try:
        mode, why = resolve_disk_quota(disk_quota)
    except Exception as e:
        return Check("disk_quota", False, str(e))
    if mode == "loop":
        what = "hard: a loop-mounted ext4 image of Limits.disk_mb per workspace (ENOSPC inside, 0 bytes past)"
    elif mode == "tmpfs":
        what = "hard: a tmpfs of Limits.disk_mb per workspace (in RAM)"
    else:
        what = ("measured: the init daemon walks each workspace every sandbox.quota_interval_s and stops a "
                "sandbox over its quota; it can overshoot between two walks (%s)" % why)
    b = seen.get("bounds")
    if isinstance(b, dict):
        what += "; test sandbox: workspace %s, /run/rolloutd %s, /workspace %s KiB" % (
            b.get("workspace"), b.get("run"), (seen.get("df") or {}).get("/workspace", "?"))
    return Check("disk_quota", True, "%s=%s: %s" % (disk_quota, mode, what))


def _uids(uid_range: str, seen: Dict[str, object]) -> Check:
    """One host uid per sandbox (root), or what is shared when every sandbox has the same one."""
    from .uids import STATE_DIR, parse_uid_range, passwd_uids

    shared = ("so per-uid kernel limits (epoll and inotify watches, inotify instances, pipe pages, "
              "RLIMIT_NPROC's host count, mqueue bytes, keys) are shared by every sandbox of the node: one "
              "sandbox can use them up for all (docs/SANDBOX.md \"Round 2: one host uid per sandbox\")")
    try:
        span = parse_uid_range(uid_range)
    except Exception as e:
        return Check("sandbox_uids", False, str(e))
    if os.geteuid() != 0:
        return Check("sandbox_uids", False, "not root: every sandbox runs as uid %d (the daemons'), %s"
                     % (os.geteuid(), shared), optional=True)
    if span is None:
        return Check("sandbox_uids", False, "sandbox.uid_range is off: every sandbox runs as nobody (65534), %s"
                     % shared, optional=True)
    first, last = span
    notes = []
    named = passwd_uids(first, last)
    if named:
        notes.append("%d uid(s) of the range are accounts in /etc/passwd (skipped)" % len(named))
    for f in ("/etc/subuid", "/etc/subgid"):
        for line in (_read(f) or "").splitlines():
            parts = line.split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                lo, n = int(parts[1]), int(parts[2])
                if lo <= last and first < lo + n:
                    notes.append("overlaps %s's range in %s" % (parts[0], f))
    uid = seen.get("uid")
    ok = not notes and (uid is None or first <= int(uid) <= last)
    tested = "; the test sandbox ran as uid %s" % uid if uid is not None else ""
    return Check("sandbox_uids", ok, "each sandbox runs as a host uid of its own from %d-%d (%d uids, state in %s)%s%s"
                 % (first, last, last - first + 1, STATE_DIR, tested, ("; " + "; ".join(notes)) if notes else ""))


def _apptainer() -> List[Check]:
    from .apptainer import binary_version

    out = []
    for binary in ("apptainer", "singularity"):
        v = binary_version(binary)
        out.append(Check(binary, v is not None, v or "%s not on PATH" % binary, optional=True))
    return out


def _fakeroot() -> Check:
    user = pwd.getpwuid(os.getuid()).pw_name
    entries = []
    for f in ("/etc/subuid", "/etc/subgid"):
        text = _read(f) or ""
        if any(line.split(":")[0] in (user, str(os.getuid())) for line in text.splitlines() if line):
            entries.append(f)
    if len(entries) == 2:
        return Check("fakeroot", True, "%s has ranges in /etc/subuid and /etc/subgid" % user, optional=True)
    userns = _userns()
    if userns.ok:
        return Check("fakeroot", True, "no subuid/subgid ranges for %s; apptainer >= 1.1 can still use "
                     "--fakeroot in root-mapped user-namespace mode (single uid)" % user, optional=True)
    return Check("fakeroot", False, "no subuid/subgid ranges for %s and unprivileged user namespaces are off" % user,
                 optional=True)


def _cgroup() -> Check:
    from .cgroups import CgroupV2, own_cgroup

    cg = CgroupV2.detect()
    if cg is not None:
        return Check("cgroup_v2", True, "sandbox memory/pids limits via %s" % cg.parent, optional=True)
    own = own_cgroup()
    why = CgroupV2.unusable_reason(own) if own else "no cgroup2 mount"
    return Check("cgroup_v2", False, "not usable (%s%s); rlimits only" % (why, ", own cgroup %s" % own if own else ""),
                 optional=True)


def _disk(root_dir: Path) -> Check:
    probe = root_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    free = usage.free / 1e9
    return Check("disk_free", free >= MIN_FREE_GB, "%.1f GB free at %s (images want >= %.0f GB)" % (free, probe, MIN_FREE_GB),
                 optional=True)


def disk_checks(places: Dict[str, Optional[os.PathLike]], low_mb: float) -> List[Check]:
    """Free space where sandboxes, images and the journal live; not ok below low_mb
    (the [sandbox] disk_low_mb threshold that also raises node.disk_low events)."""
    out = []
    for what, path in places.items():
        if not path:
            out.append(Check("disk_free_%s" % what, True, "not configured"))
            continue
        fs = free_space(path)
        ok = fs["free_bytes"] >= low_mb * 2**20
        out.append(Check("disk_free_%s" % what, ok, "%.2f GB free of %.2f GB at %s%s" % (
            fs["free_bytes"] / 1e9, fs["total_bytes"] / 1e9, fs["probe"],
            "" if ok else " (below %d MB: disk low)" % low_mb), optional=True))  # a warning
    return out


def _socket_path(root_dir: Path) -> Check:
    example = root_dir / "sb" / ("0" * 12) / "run" / "tool.sock"
    n = len(str(example).encode())
    return Check("socket_path", n <= MAX_SOCKET_PATH, "%s is %d bytes (limit %d)" % (example, n, MAX_SOCKET_PATH))


def _traversable(root_dir: Path, uid_range: str = DEFAULT_UID_RANGE) -> Check:
    """Every existing directory from / down to the sandbox root must let the sandbox uid
    through (as root: one of the uid range, or nobody); the rest is created traversable."""
    from .bwrap import resolve_run_as
    from .uids import parse_uid_range

    run_as = resolve_run_as("auto")
    uid, gid = run_as if run_as else (os.geteuid(), os.getegid())
    try:
        span = parse_uid_range(uid_range)
    except Exception:
        span = None
    if run_as and span:
        uid = gid = span[0]
    if uid == 0:
        return Check("sandbox_root_traversable", True, "sandboxes run as root here")
    path = Path("/")
    for part in root_dir.absolute().parts[1:] + ("",):
        try:
            st = path.stat()
        except FileNotFoundError:
            break
        except OSError as e:
            return Check("sandbox_root_traversable", False, "cannot stat %s: %s" % (path, e))
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return Check("sandbox_root_traversable", False,
                         "uid %d cannot enter %s (mode %o, owner %d): every sandbox would fail to start; "
                         "chmod o+x %s or choose another sandbox root" % (uid, path, st.st_mode & 0o7777,
                                                                          st.st_uid, path))
        if part:
            path = path / part
    return Check("sandbox_root_traversable", True, "uid %d can reach %s" % (uid, root_dir))


def check(root_dir: Optional[os.PathLike] = None, deep: bool = True, runtime_dir: Optional[os.PathLike] = None,
          *, disk_quota: str = "auto", shm_size_mb: int = 64, in_root: bool = False,
          uid_range: str = DEFAULT_UID_RANGE) -> List[Check]:
    """Creates nothing that outlives it unless in_root (then the full start runs in root_dir)."""
    root = Path(root_dir or default_root())
    checks = [_python(), _userns(), _traversable(root, uid_range)]
    if runtime_dir is not None:
        rt, sb = Path(runtime_dir).resolve(), root.resolve()
        nested = rt == sb or rt in sb.parents or sb in rt.parents
        checks.append(Check("layout", not nested, "runtime dir %s and sandbox root %s %s" % (
            rt, sb, "nest: set [sandbox] root_dir or --runtime-dir so neither contains the other" if nested
            else "are apart")))
    seen: Dict[str, object] = {}
    checks += _bwrap(root, deep, disk_quota, shm_size_mb, in_root, seen, uid_range)
    checks += [_ptrace(seen, deep), _shm(shm_size_mb, seen), _disk_quota(disk_quota, seen), _uids(uid_range, seen)]
    checks += _apptainer()
    checks += [_fakeroot(), _cgroup(), _disk(root), _socket_path(root)]
    bw_ok = all(c.ok for c in checks if c.name in ("bwrap", "bwrap_unshare_all", "bwrap_sandbox", "host_python3"))
    app = [c.name for c in checks if c.name in ("apptainer", "singularity") and c.ok]
    works = (["bwrap"] if bw_ok else []) + app + ["local (no isolation)"]
    checks.append(Check("runtime_auto", bw_ok, "auto picks %s; usable here: %s" % (
        "bwrap" if bw_ok else "LOCAL (unisolated)", ", ".join(works))))
    return checks


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="rolloutd doctor", description="Which sandbox runtimes work here, and why not.")
    p.add_argument("--root-dir", default=None,
                   help="sandbox root dir (default: the deployment's, from --config / --runtime-dir)")
    p.add_argument("--config", default=None, help="the deployment's TOML config (default: $ROLLOUTD_CONFIG)")
    p.add_argument("--runtime-dir", default=None, help="the deployment's runtime directory")
    p.add_argument("--quick", action="store_true", help="skip the full sandbox start test")
    p.add_argument("--in-root", action="store_true",
                   help="run the full sandbox start in the sandbox root itself, creating it if missing "
                        "(default: a temporary root, removed after; the doctor creates nothing)")
    p.add_argument("--images-dir", default=os.environ.get("ROLLOUTD_IMAGE_CACHE"),
                   help="where .sif images are built and cached (default: $ROLLOUTD_IMAGE_CACHE)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = p.parse_args(argv)
    import structlog

    if not structlog.is_configured():  # keep stdout for the report (the CLI may configure logging itself)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from rolloutd.bus.config import Config, ConfigError

    try:
        cfg = Config.load(ns.config)
    except ConfigError as e:
        print("rolloutd doctor: %s" % e, file=sys.stderr)
        return 2
    if ns.runtime_dir:
        cfg = Config(dict(cfg.data, endpoints=dict(cfg.data["endpoints"], runtime_dir=ns.runtime_dir)), cfg.path)
    root = ns.root_dir or cfg.sandbox_root()
    sb = cfg.section("sandbox")
    checks = check(root, deep=not ns.quick, runtime_dir=cfg.runtime_dir, disk_quota=sb["disk_quota"],
                   shm_size_mb=int(sb["shm_size_mb"]), in_root=ns.in_root, uid_range=sb["uid_range"])
    checks += disk_checks({"sandboxes": root, "images": ns.images_dir, "journal": cfg.section("gateway")["journal"]},
                          float(cfg.section("sandbox")["disk_low_mb"]))
    if ns.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="rolloutd doctor: sandboxes")
        t.add_column("check")
        t.add_column("status")
        t.add_column("detail", overflow="fold")
        for c in checks:
            status = "[green]ok[/]" if c.ok else ("[yellow]no[/]" if c.optional else "[red]FAIL[/]")
            t.add_row(c.name, status, c.detail)
        Console().print(t)
    # Healthy when some isolating runtime works.
    return 0 if any(c.ok for c in checks if c.name in ("runtime_auto", "apptainer", "singularity")) else 1


if __name__ == "__main__":
    sys.exit(main())
