"""local runtime: the tool server as a plain child process. NO ISOLATION - development only.

The agent's commands run as the daemon's user with full access to the host's files and
network. Processes are tracked through the tool server, which is a child subreaper, so
destroy() can still find and kill double-forked children. nproc is not applied (without a
user namespace RLIMIT_NPROC would count every process of the daemon's user).
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict

from . import procs
from .errors import SandboxSpecError
from .log import log
from .runtime import LaunchContext, Runtime


class LocalRuntime(Runtime):
    name = "local"
    nproc_scoped = False

    def __init__(self, root_dir=None, **kw: Any) -> None:
        super().__init__(root_dir, **kw)
        self.python = self.python or sys.executable
        log.warning("local_runtime_no_isolation",
                    message="LOCAL SANDBOX RUNTIME: NO ISOLATION. Agent commands run as %s on the host with "
                            "full file and network access. Use only for development." % os.environ.get("USER", os.getuid()),
                    root_dir=str(self.root_dir))

    def _inside(self, ctx: LaunchContext) -> Dict[str, str]:
        ws = str(ctx.workspace)
        wd = ctx.spec.workdir
        # /workspace maps to the host workspace dir; anything else must exist on the host.
        if wd == "/workspace" or wd.startswith("/workspace/"):
            wd = ws + wd[len("/workspace"):]
        return {"socket": str(ctx.run_dir / "tool.sock"), "ctl_dir": str(ctx.run_dir), "workdir": wd,
                "home": str(ctx.dir / "home"), "python": self.python}

    def _launch(self, ctx: LaunchContext) -> Dict[str, Any]:
        if ctx.spec.image is not None:
            raise SandboxSpecError("the local runtime cannot use images (got %s)" % ctx.spec.image)
        if ctx.spec.binds:
            raise SandboxSpecError("the local runtime has no mount namespace; binds are not supported")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "PYTHONPATH": str(ctx.lib_dir), "PYTHONNOUSERSITE": "1", "HOME": str(ctx.dir / "home"),
        }
        log_fd = os.open(ctx.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            child = subprocess.Popen(
                [self.python, "-S", "-m", "rolloutd_toolserver", "--config", str(ctx.config_path)],
                stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env, cwd=str(ctx.workspace),
                pass_fds=[ctx.ready_fd] if ctx.ready_fd is not None else [], start_new_session=True,
            )
        finally:
            os.close(log_fd)
        self._children[ctx.sandbox_id] = child
        return {"pids": [child.pid], "extra": {"pid_starts": [procs.start_time(child.pid)]}}

    def _kill(self, state: Dict[str, Any]) -> None:
        pids = [int(p) for p in state.get("pids") or []]
        starts = list((state.get("extra") or {}).get("pid_starts") or []) + [None] * len(pids)
        for pid, started in zip(pids, starts):
            procs.kill_tree(pid, started)
        procs.wait_gone(pids, timeout=5.0)
