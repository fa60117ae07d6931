"""Isolation and execution: rootless sandboxes and the in-sandbox tool server.

    from rolloutd.sandbox import get_runtime, SandboxSpec, Limits, ToolClient
    rt = get_runtime("auto", root_dir="/var/tmp/rolloutd")
    h = rt.create("job-1", SandboxSpec(limits=Limits(memory_mb=512, wall_seconds=600)))
    with ToolClient(h.tool_socket) as c:
        print(c.call("bash", {"command": "ls -la", "timeout": 10}).output)
    rt.destroy(h)

This package knows nothing of the bus (see docs/SANDBOX.md).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Tuple

from .client import AsyncToolClient, ToolClient, ToolResult
from .errors import (DiskQuotaExceeded, RuntimeUnavailable, SandboxError, SandboxNoSpace, SandboxSpecError,
                     SandboxStartError, ToolTransportError)
from .log import log
from .runtime import Runtime, default_root
from .spec import Limits, SandboxHandle, SandboxSpec

RUNTIMES = ("auto", "bwrap", "apptainer", "singularity", "local")
_BWRAP_ONLY = ("bwrap", "run_as", "tmp_size_mb", "shm_size_mb", "cgroup", "max_ptys", "uid_range", "uid_state_dir",
               "grade_scratch_mb")
_probe_cache: Dict[Tuple[Any, ...], Tuple[bool, str]] = {}
_probe_lock = threading.Lock()


def bwrap_works(bwrap: str = "bwrap", run_as: Any = "auto") -> Tuple[bool, str]:
    """Probe bubblewrap once per process (a real `bwrap --unshare-all true`)."""
    from . import bwrap as bw

    key = (bwrap, str(run_as), os.geteuid())
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = bw.probe(bwrap, bw.resolve_run_as(run_as))
        return _probe_cache[key]


def get_runtime(name: str = "auto", root_dir: Optional[os.PathLike] = None, **opts: Any) -> Runtime:
    """A runtime by name. "auto" = bwrap where it really works, else local (loudly)."""
    if name == "auto":
        ok, detail = bwrap_works(opts.get("bwrap", "bwrap"), opts.get("run_as", "auto"))
        if ok:
            name = "bwrap"
        else:
            log.warning("sandbox_runtime_fallback", chosen="local", reason=detail,
                        message="bubblewrap does not work here; falling back to the UNISOLATED local runtime")
            name = "local"
            opts = {k: v for k, v in opts.items() if k not in _BWRAP_ONLY}
    if name == "bwrap":
        from .bwrap import BwrapRuntime
        return BwrapRuntime(root_dir, **opts)
    if name in ("apptainer", "singularity"):
        from .apptainer import ApptainerRuntime
        opts.setdefault("binary", name)
        return ApptainerRuntime(root_dir, **opts)
    if name == "local":
        from .local import LocalRuntime
        return LocalRuntime(root_dir, **opts)
    raise SandboxSpecError("unknown sandbox runtime %r; choose one of %s" % (name, ", ".join(RUNTIMES)))


__all__ = [
    "get_runtime", "bwrap_works", "Runtime", "RUNTIMES", "default_root",
    "SandboxSpec", "Limits", "SandboxHandle",
    "ToolClient", "AsyncToolClient", "ToolResult",
    "SandboxError", "SandboxSpecError", "SandboxStartError", "RuntimeUnavailable", "ToolTransportError",
    "DiskQuotaExceeded", "SandboxNoSpace",
]
