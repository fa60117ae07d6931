"""What a sandbox should be (SandboxSpec, Limits) and what one is (SandboxHandle)."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Union

from .errors import SandboxSpecError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Limits:
    """Resource limits; None = not limited.

    memory_mb, cpu_seconds and file_size_mb are per process (RLIMIT_AS, RLIMIT_CPU,
    RLIMIT_FSIZE); nproc counts every process of the sandbox, tool server included
    (RLIMIT_NPROC in the sandbox's own user namespace); wall_seconds kills the whole
    sandbox. Where a writable cgroup v2 is configured, memory_mb and nproc also apply to
    the sandbox as a whole.

    address_space_mb, when set, is the per-process RLIMIT_AS instead of memory_mb (which then
    bounds only the sandbox's resident memory, through the cgroup where one is delegated): Node
    and other runtimes that reserve far more address space than they use (V8's WebAssembly
    guard regions, pointer cages) need a large one. See docs/HARNESS.md, "Memory".

    disk_mb bounds what the sandbox's /workspace holds in total (allocated blocks of every
    file). The workspace is a host directory (init fills it, eval reads it), so the quota is
    enforced from the host: the node's init daemon measures every running sandbox's
    workspace each sandbox.quota_interval_s and stops one that holds more; its tool calls
    then raise DiskQuotaExceeded. file_size_mb (RLIMIT_FSIZE: EFBIG at once) bounds how far
    one file can overshoot between two measurements. See docs/SANDBOX.md, "Disk quota".
    """

    memory_mb: Optional[int] = None
    nproc: Optional[int] = None
    cpu_seconds: Optional[int] = None
    file_size_mb: Optional[int] = None
    wall_seconds: Optional[float] = None
    disk_mb: Optional[int] = None
    address_space_mb: Optional[int] = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise SandboxSpecError("Limits.%s must be a positive number or None, got %r" % (f.name, v))
        if self.nproc is not None and self.nproc < 8:
            raise SandboxSpecError("Limits.nproc=%d is too small: the tool server, its shell and "
                                   "Python session already use ~5 processes (use >= 8)" % self.nproc)
        if self.memory_mb is not None and self.memory_mb < 32:
            raise SandboxSpecError("Limits.memory_mb=%d is too small to start bash/python (use >= 32)" % self.memory_mb)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "Limits":
        d = d or {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


Bind = Tuple[str, str, bool]


@dataclass
class SandboxSpec:
    image: Optional[str] = None
    binds: List[Bind] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    network: bool = False
    workspace_files: Dict[str, Union[str, bytes]] = field(default_factory=dict)
    workdir: str = "/workspace"
    loopback: bool = True

    def validate(self) -> "SandboxSpec":
        if self.image is not None and not isinstance(self.image, str):
            raise SandboxSpecError("image must be a path string or None")
        if not isinstance(self.limits, Limits):
            raise SandboxSpecError("limits must be a sandbox.Limits")
        norm = []
        for b in self.binds:
            if not isinstance(b, (list, tuple)) or len(b) not in (2, 3):
                raise SandboxSpecError("a bind is (src, dst, read_only), got %r" % (b,))
            src, dst = str(b[0]), str(b[1])
            ro = bool(b[2]) if len(b) == 3 else True
            if not os.path.isabs(src) or not os.path.isabs(dst):
                raise SandboxSpecError("bind paths must be absolute: %r" % (b,))
            if not os.path.exists(src):
                raise SandboxSpecError("bind source %s does not exist" % src)
            if os.path.normpath(dst) in ("/", "/proc", "/dev", "/run/rolloutd", "/opt/rolloutd", "/workspace"):
                raise SandboxSpecError("bind destination %s is reserved" % dst)
            norm.append((src, os.path.normpath(dst), ro))
        self.binds = norm
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise SandboxSpecError("invalid environment variable name %r" % (k,))
            if not isinstance(v, str) or "\0" in v:
                raise SandboxSpecError("environment value of %s must be a string without NUL" % k)
        for rel, content in self.workspace_files.items():
            if not isinstance(rel, str) or not rel or os.path.isabs(rel):
                raise SandboxSpecError("workspace_files keys are relative paths, got %r" % (rel,))
            if ".." in rel.replace("\\", "/").split("/"):
                raise SandboxSpecError("workspace_files path %r escapes the workspace" % rel)
            if not isinstance(content, (str, bytes)):
                raise SandboxSpecError("workspace_files[%r] must be str or bytes" % rel)
        if not isinstance(self.workdir, str) or not os.path.isabs(self.workdir):
            raise SandboxSpecError("workdir must be an absolute path inside the sandbox, got %r" % (self.workdir,))
        return self


_HANDLE_FIELDS = ("runtime", "job_id", "sandbox_id", "workspace", "tool_socket", "loopback", "pids",
                  "created_at", "sandbox_dir", "extra")


@dataclass
class SandboxHandle:
    """A running sandbox. Plain data: it travels between daemon processes on one node."""

    runtime: str
    job_id: str
    sandbox_id: str
    workspace: str            # host path of the workspace
    tool_socket: str          # host path of the tool server's Unix socket
    loopback: Optional[str]   # 127.x.y.z or None
    pids: List[int]           # processes to kill (runtime-specific meaning)
    created_at: float
    sandbox_dir: str = ""     # host dir holding state.json, workspace, run/, log
    extra: Dict[str, Any] = field(default_factory=dict)  # runtime specifics (pid start times, instance...)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "runtime": self.runtime, "job_id": self.job_id, "sandbox_id": self.sandbox_id,
            "workspace": self.workspace, "tool_socket": self.tool_socket, "loopback": self.loopback,
            "pids": [int(p) for p in self.pids], "created_at": float(self.created_at),
            "sandbox_dir": self.sandbox_dir, "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SandboxHandle":
        missing = [k for k in ("runtime", "job_id", "sandbox_id", "workspace", "tool_socket") if k not in d]
        if missing:
            raise SandboxSpecError("sandbox handle dict lacks %s" % ", ".join(missing))
        return cls(
            runtime=str(d["runtime"]), job_id=str(d["job_id"]), sandbox_id=str(d["sandbox_id"]),
            workspace=str(d["workspace"]), tool_socket=str(d["tool_socket"]), loopback=d.get("loopback"),
            pids=[int(p) for p in d.get("pids") or []], created_at=float(d.get("created_at") or 0.0),
            sandbox_dir=str(d.get("sandbox_dir") or ""), extra=dict(d.get("extra") or {}),
        )
