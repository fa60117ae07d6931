"""The Runtime interface and what every runtime shares.

Layout under root_dir (one dir per sandbox, the source of truth for the janitor):
  sb/<sandbox_id>/state.json   who/what/pids/deadline (written before launch, updated after)
  sb/<sandbox_id>/workspace/   the job's workspace (/workspace inside); as root a mounted
                               ext4 image (disk.img) or tmpfs of Limits.disk_mb (bounds.py)
  sb/<sandbox_id>/disk.img     that image (sparse, exactly disk_mb)
  sb/<sandbox_id>/run/         tool.sock, config.json, llm.sock (/run/rolloutd inside)
  sb/<sandbox_id>/log          stderr of the runtime and the tool server
  lib/<hash>/                  tool server + ptyprocess, mounted read-only (toollib.py)
  loopback.json/.lock          the loopback allocator
  /run/rolloutd-uids/          as root: the node's uid allocator, one host uid per sandbox (uids.py)
A subclass provides _launch (start processes), _kill (stop them) and _inside (paths as the
tool server sees them).
"""
from __future__ import annotations

import abc
import contextlib
import errno
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import bounds, procs, toollib
from .client import ToolClient
from .errors import SandboxError, SandboxNoSpace, SandboxSpecError, SandboxStartError, ToolTransportError
from .log import log
from .loopback import LoopbackAllocator
from .uids import UidAllocator
from .spec import SandboxHandle, SandboxSpec

# sockaddr_un.sun_path is 108 bytes including the NUL.
MAX_SOCKET_PATH = 107
_SID = re.compile(r"^[0-9a-f]{12}$")
STARTING_GRACE = 60.0   # a sandbox still "starting" this long after creation is garbage
DISK_QUOTAS = ("auto", "loop", "tmpfs", "measured")
EXPIRY_GRACE = 5.0      # the in-sandbox watchdog gets this long to enforce wall_seconds itself


def default_root() -> Path:
    """Where sandboxes live by default. Never the default runtime directory
    (``/tmp/rolloutd-<uid>``): that one is private (0700) while a sandbox root must be
    traversable by the uid sandboxes run as (bus.config.Config.check_layout enforces it)."""
    env = os.environ.get("ROLLOUTD_SANDBOX_ROOT")
    return Path(env) if env else Path("/tmp/rolloutd-sandboxes-%d" % os.getuid())


@dataclass
class LaunchContext:
    sandbox_id: str
    job_id: str
    spec: SandboxSpec
    dir: Path
    workspace: Path
    run_dir: Path
    log_path: Path
    config_path: Path
    loopback: Optional[str]
    deadline: Optional[float]
    lib_dir: Path
    owner: Tuple[int, int]          # host uid/gid the sandbox runs as
    ready_fd: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)


class Runtime(abc.ABC):
    name = "abstract"
    uses_ready_fd = True       # the tool server can signal readiness on an inherited fd
    nproc_scoped = False       # RLIMIT_NPROC counts only this sandbox's processes
    run_dir_read_only = False  # the sandbox cannot write its run dir (bwrap binds it read-only)

    def __init__(
        self,
        root_dir: Optional[os.PathLike] = None,
        *,
        ready_timeout: float = 20.0,
        max_output: int = 64 * 1024,
        default_timeout: float = 60.0,
        interrupt_grace: float = 1.0,
        loopback_range: Iterable[str] = ("127.1.0.1", "127.254.255.254"),
        python: Optional[str] = None,
        shell: str = "/bin/bash",
        disk_quota: str = "auto",
        disk_pool: int = 2,
    ) -> None:
        self.root_dir = Path(root_dir or default_root()).absolute()
        self.sb_dir = self.root_dir / "sb"
        # Every directory made here (missing ancestors too, whatever the umask) must let the
        # sandbox uid through; existing ancestors are the operator's (doctor checks them).
        made = [d for d in (self.sb_dir, *self.sb_dir.parents) if not d.exists()]
        self.sb_dir.mkdir(parents=True, exist_ok=True)
        for d in {self.root_dir, self.sb_dir, *made}:
            _chmod_traversable(d)
        self.ready_timeout = float(ready_timeout)
        self.max_output = int(max_output)
        self.default_timeout = float(default_timeout)
        self.interrupt_grace = float(interrupt_grace)
        self.python = python
        self.shell = shell
        first, last = tuple(loopback_range)
        self.loopback = LoopbackAllocator(self.root_dir, first, last)
        self._children: Dict[str, subprocess.Popen] = {}
        self.uids: Optional[UidAllocator] = None  # one host uid per sandbox (bwrap as root sets it)
        self.disk_quota, self.disk_quota_reason = resolve_disk_quota(disk_quota)
        # Loop workspaces made ahead of demand, `disk_pool` of each recent size (0: off). Only a
        # runtime that creates loop sandboxes ever fills it; closed with the runtime.
        if isinstance(disk_pool, bool) or not isinstance(disk_pool, int) or disk_pool < 0:
            raise SandboxSpecError("disk_pool must be a number >= 0, got %r" % (disk_pool,))
        self._disk_pool: Optional[bounds.WorkspacePool] = None
        if self.disk_quota == "loop" and disk_pool:
            self._disk_pool = bounds.WorkspacePool(self.root_dir / "disk-templates", depth=disk_pool)
            weakref.finalize(self, self._disk_pool.close)

    # -- hooks -----------------------------------------------------------------------
    @abc.abstractmethod
    def _launch(self, ctx: LaunchContext) -> Dict[str, Any]:
        """Start the sandbox and its tool server; return {"pids": [...], "extra": {...}}.
        Register a Popen in self._children[sandbox_id] if this process is its parent."""

    @abc.abstractmethod
    def _kill(self, state: Dict[str, Any]) -> None:
        """Kill every process of the sandbox described by state and wait until they are gone."""

    @abc.abstractmethod
    def _inside(self, ctx: LaunchContext) -> Dict[str, str]:
        """Paths as the tool server sees them: socket, ctl_dir, workdir, home, lib, python."""

    def _prepare_dirs(self, ctx: LaunchContext) -> None:
        """Hook: e.g. chown the workspace to the uid the sandbox runs as."""

    def _pre_launch(self, ctx: LaunchContext) -> None:
        """Hook before the config is written (e.g. bind the tool socket); fds put in
        ctx.extra["fds"] are closed once _launch returns or fails."""

    def _held_unlinked(self, state: Dict[str, Any]) -> int:
        """Bytes of workspace files the sandbox deleted but keeps open (the walk cannot see
        them). 0 where the runtime cannot tell (bwrap overrides)."""
        return 0

    def _owner(self) -> Tuple[int, int]:
        """uid/gid the sandbox's processes run as when they do not get one of their own."""
        return os.geteuid(), os.getegid()

    def _sandbox_owner(self, sid: str, d: Path) -> Tuple[int, int]:
        """This sandbox's uid/gid (owner of the mounted workspace): its own from the node's uid
        range where the runtime has one (held while d exists), else the runtime's."""
        if self.uids is None:
            return self._owner()
        uid = self.uids.allocate(sid, d)
        return uid, uid

    def _bound_dirs(self, d: Path, disk_mb: Optional[float], owner: Tuple[int, int]) -> Dict[str, str]:
        """Mount the hard bounds (root): the workspace on an image/tmpfs of disk_mb, a writable run
        dir on a tiny tmpfs. Returns how each writable host dir is bounded (kept in state.json)."""
        uid, gid = owner
        # With a uid per sandbox, images are made root-owned (one template and pool kind for all
        # sandboxes of a size) and the workspace root is given to the sandbox once mounted.
        iuid, igid = (0, 0) if self.uids is not None else owner
        out = {"workspace": "none" if not disk_mb else "measured",
               "run": "read-only" if self.run_dir_read_only else "measured"}
        if self.disk_quota == "measured":
            return out
        if disk_mb:
            size = int(float(disk_mb) * 2**20) // 4096 * 4096
            mode = "tmpfs" if size < bounds.MIN_IMAGE_BYTES else self.disk_quota  # a few MB of RAM at most
            if mode == "loop":  # made ahead by the pool when it has one of this kind, else here
                ready = self._disk_pool.take(size, iuid, igid) if self._disk_pool is not None else None
                if ready is None:
                    ready = bounds.prepare_ext4(self.root_dir / "disk-templates", size, iuid, igid, image=d / "disk.img")
                ready.install(d / "workspace", d / "disk.img")
                if (iuid, igid) != (uid, gid):
                    os.chown(d / "workspace", uid, gid)
            else:
                bounds.mount_tmpfs(d / "workspace", size, uid, gid, nr_inodes=max(1024, size // 16384))
            out["workspace"] = mode
        if not self.run_dir_read_only:
            bounds.mount_tmpfs(d / "run", bounds.RUN_DIR_BYTES, uid, gid, bounds.RUN_DIR_INODES)
            out["run"] = "tmpfs"
        return out

    # -- public API ------------------------------------------------------------------
    def create(self, job_id: str, spec: Optional[SandboxSpec] = None) -> SandboxHandle:
        if self._disk_pool is None:
            return self._create(job_id, spec)
        with self._disk_pool.hold():  # the pool refills between starts, not during them
            return self._create(job_id, spec)

    def _create(self, job_id: str, spec: Optional[SandboxSpec]) -> SandboxHandle:
        t0 = time.monotonic()
        if not isinstance(job_id, str) or not job_id:
            raise SandboxSpecError("job_id must be a non-empty string")
        spec = (spec or SandboxSpec()).validate()
        self._poll_children()
        sid = secrets.token_hex(6)
        d = self.sb_dir / sid
        d.mkdir(mode=0o755)
        _chmod_traversable(d)
        sock = d / "run" / "tool.sock"
        try:
            owner = self._sandbox_owner(sid, d)
        except BaseException:
            _rmtree(d)
            raise
        state: Dict[str, Any] = {
            "status": "starting", "runtime": self.name, "job_id": job_id, "sandbox_id": sid,
            "created_at": time.time(), "creator_pid": os.getpid(),
            "creator_start": procs.start_time(os.getpid()), "pids": [], "extra": {},
            "workspace": str(d / "workspace"), "tool_socket": str(sock), "loopback": None, "deadline": None,
            "disk_mb": spec.limits.disk_mb, "bounds": {}, "owner": list(owner), "own_uid": self.uids is not None,
        }
        try:
            self._write_state(d, state)
        except OSError as e:  # a full sandbox root: leave nothing half-made behind
            _rmtree(d)
            self._release_uid(d, state)
            raise _start_error(self.name, job_id, self.root_dir, e) from e
        ready_r = ready_w = None
        ctx: Optional[LaunchContext] = None
        try:
            if len(str(sock).encode()) > MAX_SOCKET_PATH:
                raise SandboxSpecError("socket path %s is longer than %d bytes; use a shorter root_dir"
                                       % (sock, MAX_SOCKET_PATH))
            for sub in ("workspace", "run"):
                (d / sub).mkdir(mode=0o755)
            # Before any file lands there; unmounted by destroy/reap from the mount table alone.
            state["bounds"] = self._bound_dirs(d, spec.limits.disk_mb, owner)
            self._write_workspace(d / "workspace", spec.workspace_files)
            if spec.loopback:
                state["loopback"] = self.loopback.allocate(sid, path=str(d))
            if spec.limits.wall_seconds:
                state["deadline"] = time.time() + float(spec.limits.wall_seconds)
            self._write_state(d, state)
            if self.uses_ready_fd:
                ready_r, ready_w = os.pipe()
            ctx = LaunchContext(
                sandbox_id=sid, job_id=job_id, spec=spec, dir=d, workspace=d / "workspace", run_dir=d / "run",
                log_path=d / "log", config_path=d / "run" / "config.json", loopback=state["loopback"],
                deadline=state["deadline"], lib_dir=toollib.prepare(self.root_dir), owner=owner, ready_fd=ready_w,
                extra={"bounds": state["bounds"]},
            )
            self._pre_launch(ctx)
            self._write_config(ctx)
            self._prepare_dirs(ctx)
            try:
                launched = self._launch(ctx)
            finally:
                for fd in ctx.extra.pop("fds", ()):
                    os.close(fd)
            state["pids"] = list(launched.get("pids", []))
            state["extra"] = dict(launched.get("extra", {}))
            self._write_state(d, state)  # from here on, destroy() can find the processes
            if ready_w is not None:
                os.close(ready_w)
                ready_w = None
            self._wait_ready(ctx, state, ready_r, t0)
            state["status"] = "running"
            self._write_state(d, state)
            if state["loopback"] and state["pids"]:
                self.loopback.update(state["loopback"], state["pids"][-1])
        except BaseException as e:
            for fd in [ready_r, ready_w] + list(ctx.extra.pop("fds", ()) if ctx else ()):
                if fd is not None:
                    os.close(fd)
            tail = _tail(d / "log")
            self._destroy_state(d, state)
            log.warning("sandbox_start_failed", job_id=job_id, sandbox_id=sid, runtime=self.name,
                        error=repr(e), log_tail=tail)
            if isinstance(e, SandboxSpecError) or not isinstance(e, Exception):
                raise
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                raise _start_error(self.name, job_id, self.root_dir, e) from e
            raise SandboxStartError("%s sandbox for job %s did not start: %s%s" % (
                self.name, job_id, e, ("\n--- sandbox log ---\n" + tail) if tail else "")) from e
        if ready_r is not None:
            os.close(ready_r)
        handle = self._handle(d, state)
        log.info("sandbox_created", job_id=job_id, sandbox_id=sid, runtime=self.name,
                 loopback=state["loopback"], duration_ms=round((time.monotonic() - t0) * 1000, 1))
        return handle

    def destroy(self, handle: SandboxHandle) -> bool:
        """Kill every process of the sandbox, remove its dir, release its address. Idempotent."""
        sid = handle.sandbox_id
        if not _SID.match(sid):
            raise SandboxSpecError("not a sandbox id: %r" % sid)
        d = self.sb_dir / sid  # never trust a path from a handle: it decides what gets deleted
        state = self._read_state(d)
        if state is None:
            if not d.exists() and not self._children.get(sid):
                self.loopback.release(handle.loopback, owner=sid)
                return False
            state = {**handle.to_dict(), "extra": dict(handle.extra)}
        t0 = time.monotonic()
        self._destroy_state(d, state)
        log.info("sandbox_destroyed", job_id=state.get("job_id"), sandbox_id=sid, runtime=self.name,
                 duration_ms=round((time.monotonic() - t0) * 1000, 1))
        return True

    def list(self) -> List[SandboxHandle]:
        out = []
        for d in sorted(self.sb_dir.iterdir()) if self.sb_dir.is_dir() else []:
            state = self._read_state(d)
            if state and state.get("runtime") == self.name:
                out.append(self._handle(d, state))
        return out

    def reap(self, keep: Iterable[str]) -> List[str]:
        """Destroy sandboxes whose job is not in keep (plus expired and abandoned ones)."""
        keep = set(keep)
        reaped: List[str] = []
        now = time.time()
        for d in sorted(self.sb_dir.iterdir()) if self.sb_dir.is_dir() else []:
            if not _SID.match(d.name):
                continue
            state = self._read_state(d)
            if state is None:
                # A dir without state: a create() that crashed before its first write.
                try:
                    age = now - d.stat().st_mtime
                except OSError:
                    continue
                if age > STARTING_GRACE:
                    _remove_sandbox_dir(d)
                continue
            if state.get("runtime") != self.name:
                continue
            starting = state.get("status") == "starting"
            creator_alive = procs.is_running(int(state.get("creator_pid") or 0), state.get("creator_start"))
            if starting and creator_alive and now - float(state.get("created_at") or 0) < STARTING_GRACE:
                continue  # being created right now by a live process
            deadline = state.get("deadline")
            expired = deadline is not None and now > float(deadline) + EXPIRY_GRACE
            abandoned = starting and not creator_alive
            if state.get("job_id") not in keep or expired or abandoned:
                why = "expired" if expired else "abandoned" if abandoned else "not_kept"
                self._destroy_state(d, state)
                log.info("sandbox_reaped", job_id=state.get("job_id"), sandbox_id=d.name, runtime=self.name, reason=why)
                reaped.append(str(state.get("job_id")))
        self.loopback.reclaim_stale()
        if self.uids is not None:
            self.uids.reclaim_stale()
        self._poll_children()
        return reaped

    def enforce_disk_quotas(self) -> List[Dict[str, Any]]:
        """Stop every running sandbox whose workspace holds more than its Limits.disk_mb.

        The state says why before the processes die (a tool client that loses its connection
        reads it and raises DiskQuotaExceeded); the workspace is emptied at once so the node
        gets its space back before the job's holder destroys the sandbox."""
        stopped: List[Dict[str, Any]] = []
        for d in sorted(self.sb_dir.iterdir()) if self.sb_dir.is_dir() else []:
            if not _SID.match(d.name):
                continue
            state = self._read_state(d)
            if not state or state.get("runtime") != self.name or state.get("status") != "running":
                continue
            if not state.get("disk_mb"):
                continue
            b = state.get("bounds") or {}
            if b.get("workspace") in ("loop", "tmpfs") and b.get("run") != "measured":
                continue  # hard bounds: the kernel says ENOSPC, there is nothing to measure
            measured = [d / "workspace"] + ([d / "run"] if b.get("run", "measured") == "measured" else [])
            limit = int(float(state["disk_mb"]) * 1024 * 1024)
            held = used = self._held_unlinked(state)  # deleted files still open: gone with the processes
            for p in measured:
                if used > limit:
                    break
                used += disk_usage(p, stop_above=limit - used)
            if used <= limit:
                continue
            state.update(status=DISK_QUOTA_STATUS, disk_used_bytes=used, stopped_at=time.time())
            try:
                self._write_state(d, state)
            except FileNotFoundError:  # its holder destroyed it meanwhile: nothing left to stop
                continue
            try:
                self._kill(state)
            finally:
                # Exact, not where the walk stopped: the processes are gone, nothing grows now. The
                # holder may destroy the sandbox as soon as they are (its tool call failed): then the
                # figure stays the one measured before the kill, and the stop is reported all the same.
                exact = held + sum(disk_usage(p) for p in measured)
                if d.is_dir():
                    used = exact
                    state.update(disk_used_bytes=used)
                    with contextlib.suppress(FileNotFoundError):
                        self._write_state(d, state)
                    _empty_dir(d / "workspace")
            info = {"job_id": state.get("job_id"), "sandbox_id": d.name, "disk_mb": state["disk_mb"],
                    "used_bytes": used}
            log.warning("sandbox_disk_quota_exceeded", runtime=self.name, **info)
            stopped.append(info)
        return stopped

    def get(self, sandbox_id: str) -> Optional[SandboxHandle]:
        if not _SID.match(sandbox_id):
            return None
        state = self._read_state(self.sb_dir / sandbox_id)
        return self._handle(self.sb_dir / sandbox_id, state) if state else None

    def client(self, handle: SandboxHandle, **kw: Any) -> ToolClient:
        return ToolClient(handle.tool_socket, **kw)

    # -- internals -------------------------------------------------------------------
    def _destroy_state(self, d: Path, state: Dict[str, Any]) -> None:
        try:
            self._kill(state)
        finally:
            child = self._children.pop(str(state.get("sandbox_id")), None)
            if child is not None:
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    child.kill()
            _remove_sandbox_dir(d)
            if state.get("loopback"):
                self.loopback.release(state["loopback"], owner=str(state.get("sandbox_id")))
            self._release_uid(d, state)

    def _release_uid(self, d: Path, state: Dict[str, Any]) -> None:
        # Only once its dir (the workspace it owns) is gone: a dir left behind (a mount that would
        # not go) keeps the uid held until the janitor removes it and reclaims it as stale.
        if state.get("own_uid") and self.uids is not None and state.get("owner") and not d.exists():
            self.uids.release(int(state["owner"][0]), owner=str(state.get("sandbox_id")))

    def _poll_children(self) -> None:
        # Reap exited launchers we are the parent of (sandboxes killed by their watchdog).
        for sid, child in list(self._children.items()):
            if child.poll() is not None and not (self.sb_dir / sid).exists():
                self._children.pop(sid, None)

    def _handle(self, d: Path, state: Dict[str, Any]) -> SandboxHandle:
        extra = dict(state.get("extra") or {})
        extra.setdefault("status", state.get("status"))
        if state.get("deadline") is not None:
            extra["deadline"] = state["deadline"]
        return SandboxHandle(
            runtime=self.name, job_id=str(state["job_id"]), sandbox_id=d.name,
            workspace=str(d / "workspace"), tool_socket=str(d / "run" / "tool.sock"),
            loopback=state.get("loopback"), pids=[int(p) for p in state.get("pids") or []],
            created_at=float(state.get("created_at") or 0.0), sandbox_dir=str(d), extra=extra,
        )

    @staticmethod
    def _write_state(d: Path, state: Dict[str, Any]) -> None:
        tmp = d / ".state.json.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, d / "state.json")

    @staticmethod
    def _read_state(d: Path) -> Optional[Dict[str, Any]]:
        try:
            with open(d / "state.json", "r", encoding="utf-8") as f:
                state = json.load(f)
            return state if isinstance(state, dict) else None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _write_workspace(ws: Path, files: Dict[str, Any]) -> None:
        root = ws.resolve()
        for rel, content in files.items():
            target = (ws / rel).resolve()
            if root not in target.parents:
                raise SandboxSpecError("workspace file %r escapes the workspace" % rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")

    def _session_env(self, ctx: LaunchContext) -> Dict[str, str]:
        env = dict(ctx.spec.env)
        env.setdefault("ROLLOUTD_SANDBOX_ID", ctx.sandbox_id)
        env.setdefault("ROLLOUTD_JOB_ID", ctx.job_id)
        if ctx.loopback:
            env.setdefault("ROLLOUTD_LOOPBACK", ctx.loopback)
        return env

    def _write_config(self, ctx: LaunchContext) -> None:
        inside = self._inside(ctx)
        limits = {k: v for k, v in ctx.spec.limits.to_dict().items() if k != "wall_seconds" and v is not None}
        if ctx.extra.get("bounds", {}).get("workspace") == "measured":
            # The walk cannot see a file grow between two passes: no single file may outgrow the
            # quota (RLIMIT_FSIZE); with fallocate denied (bwrap) blocks come only from writes.
            cap = int(-(-float(ctx.spec.limits.disk_mb) // 1))
            limits["file_size_mb"] = min(int(limits.get("file_size_mb") or cap), cap)
        cfg = {
            "socket": inside["socket"], "workdir": inside["workdir"],
            "home": inside["home"], "python": inside.get("python"), "shell": self.shell,
            "env": self._session_env(ctx), "limits": limits,
            "apply_nproc": self.nproc_scoped, "max_output": self.max_output,
            "default_timeout": self.default_timeout, "interrupt_grace": self.interrupt_grace,
            "deadline": ctx.deadline, "ready_fd": ctx.ready_fd, "sandbox_id": ctx.sandbox_id, "job_id": ctx.job_id,
            "grade_scratch": inside.get("grade_scratch"),
        }
        if ctx.extra.get("socket_fd") is not None:
            cfg["socket_fd"] = ctx.extra["socket_fd"]
        with open(ctx.config_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)

    def _wait_ready(self, ctx: LaunchContext, state: Dict[str, Any], ready_r: Optional[int], t0: float) -> None:
        deadline = t0 + self.ready_timeout
        sock = str(ctx.run_dir / "tool.sock")
        child = self._children.get(ctx.sandbox_id)
        if ready_r is not None:
            r, _, _ = select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise SandboxStartError("tool server not ready after %.1fs" % self.ready_timeout)
            if not os.read(ready_r, 64):
                raise SandboxStartError("the sandbox exited before its tool server was ready")
        else:
            while not os.path.exists(sock):
                if child is not None and child.poll() is not None:
                    raise SandboxStartError("the sandbox exited (code %s) before its tool server was ready" % child.returncode)
                if time.monotonic() > deadline:
                    raise SandboxStartError("tool server socket did not appear after %.1fs" % self.ready_timeout)
                time.sleep(0.005)
        remaining = max(1.0, deadline - time.monotonic())
        with ToolClient(sock, connect_timeout=remaining) as c:
            try:
                r = c.ping(timeout=remaining)
            except ToolTransportError as e:
                raise SandboxStartError("tool server did not answer a ping: %s" % e) from e
        if r.output != "pong":
            raise SandboxStartError("unexpected ping answer: %r" % (r,))


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
DISK_QUOTA_STATUS = "disk_quota_exceeded"


def _start_error(runtime: str, job_id: str, root: Path, e: OSError) -> SandboxError:
    if e.errno in _NO_SPACE:
        return SandboxNoSpace("%s sandbox for job %s not created: no space left on the sandbox root %s (%s)"
                              % (runtime, job_id, root, e))
    return SandboxStartError("%s sandbox for job %s did not start: %s" % (runtime, job_id, e))


def resolve_disk_quota(mode: str) -> Tuple[str, str]:
    """("loop" | "tmpfs" | "measured", why). auto: a loop-mounted ext4 image per workspace
    where this process can mount (root), else the measured fallback."""
    if mode not in DISK_QUOTAS:
        raise SandboxSpecError("disk_quota must be one of %s, got %r" % (", ".join(DISK_QUOTAS), mode))
    if mode == "measured":
        return mode, "chosen"
    why_not = bounds.why_no_mounts()
    if why_not is not None:
        if mode != "auto":
            raise SandboxSpecError("disk_quota=%r needs mounts: %s" % (mode, why_not))
        return "measured", why_not
    return ("loop" if mode == "auto" else mode), "root: mounts available"


def _remove_sandbox_dir(d: Path) -> None:
    """Unmount whatever is mounted under d (the mount table is the truth: this works after a
    crash, without state), then delete it. rmtree never crosses into a live mount."""
    try:
        bounds.unmount_under(d)
    except OSError as e:
        log.warning("sandbox_unmount_failed", dir=str(d), error=str(e))
        if bounds.mounts_under(d):
            return  # leave it to the next reap rather than empty a mount still in use
    _rmtree(d)


def disk_usage(path: Path, stop_above: Optional[int] = None) -> int:
    """Bytes allocated under path (st_blocks, hard links once, symlinks not followed);
    stops counting once past stop_above. Files vanishing mid-walk are skipped."""
    total = 0
    seen = set()
    stack = [str(path)]
    while stack:
        top = stack.pop()
        try:
            it = os.scandir(top)
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if stop_above is not None and total > stop_above:
                    return total
    return total


def free_space(path: os.PathLike) -> Dict[str, Any]:
    """Free and total bytes of the filesystem holding path (its nearest existing ancestor)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return {"path": str(path), "probe": str(probe), "free_bytes": st.f_bavail * st.f_frsize,
            "total_bytes": st.f_blocks * st.f_frsize}


def _empty_dir(d: Path) -> None:
    try:
        entries = list(d.iterdir())
    except OSError:
        return
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            _rmtree(p)
        else:
            try:
                p.unlink()
            except OSError:
                pass


def _chmod_traversable(d: Path) -> None:
    """The sandbox may run as another uid (root drops to nobody): it must be able to
    traverse into its own dirs."""
    try:
        mode = d.stat().st_mode & 0o7777
        if mode & 0o011 != 0o011:
            os.chmod(d, mode | 0o011)
    except OSError:
        pass


def make_world_readable(root: str | os.PathLike) -> None:
    """Every dir under ``root`` 0755 and every file readable by all: host trees that sandboxes
    bind read-only (a pytest copy, an agent venv) must be readable as nobody."""
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in files:
            fp = os.path.join(dirpath, f)
            if not os.path.islink(fp):
                os.chmod(fp, os.stat(fp).st_mode | 0o444)


def _rmtree(d: Path) -> None:
    def onerror(func, path, exc_info):  # a sandbox may leave chmod 000 dirs behind
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    if d.exists():
        if sys.version_info >= (3, 12):
            shutil.rmtree(d, onexc=lambda f, p, e: onerror(f, p, None))
        else:
            shutil.rmtree(d, onerror=onerror)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


__all__ = ["Runtime", "LaunchContext", "default_root", "SandboxError"]
