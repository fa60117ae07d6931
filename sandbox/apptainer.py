"""Apptainer / Singularity runtime: one instance per sandbox, the tool server exec'd into it.

    apptainer instance start [--fakeroot] --containall --writable-tmpfs [--net --network none]
        --bind WS:/workspace --bind RUN:/run/rolloutd --bind LIB:/run/rolloutd-lib:ro [binds]
        IMAGE rolloutd-<sandbox_id>
    apptainer exec --cleanenv --pwd WORKDIR --env ... instance://rolloutd-<id> \
        python3 -m rolloutd_toolserver --config /run/rolloutd/config.json
    apptainer instance stop --force rolloutd-<id>

The argv builders are pure functions (golden-tested). Commands run through spython's
command runner; spython's higher-level Instance API is not used because it hard-codes the
`singularity` binary name and calls sys.exit() on errors, which a daemon cannot afford.
Rlimits and the wall-clock watchdog are applied by the tool server exactly as under bwrap.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import procs
from .errors import RuntimeUnavailable, SandboxSpecError, SandboxStartError
from .images import ImageBuilder, ImageSpec
from .log import log
from .runtime import LaunchContext, Runtime

WORKSPACE = "/workspace"
RUN_DIR = "/run/rolloutd"
LIB_DIR = "/run/rolloutd-lib"
CONFIG = RUN_DIR + "/config.json"


def instance_name(sandbox_id: str) -> str:
    return "rolloutd-" + sandbox_id


def instance_start_argv(
    *,
    binary: str,
    image: str,
    instance: str,
    workspace: str,
    run_dir: str,
    lib_dir: str,
    binds: Sequence[Tuple[str, str, bool]] = (),
    network: bool = False,
    fakeroot: bool = False,
    extra_options: Sequence[str] = (),
) -> List[str]:
    argv = [binary, "instance", "start"]
    if fakeroot:
        argv.append("--fakeroot")
    argv += ["--containall", "--writable-tmpfs"]
    if not network:
        argv += ["--net", "--network", "none"]  # a network namespace with only loopback
    argv += ["--bind", "%s:%s" % (workspace, WORKSPACE), "--bind", "%s:%s" % (run_dir, RUN_DIR),
             "--bind", "%s:%s:ro" % (lib_dir, LIB_DIR)]
    for src, dst, ro in binds:
        argv += ["--bind", "%s:%s%s" % (src, dst, ":ro" if ro else "")]
    argv += list(extra_options)
    return argv + [image, instance]


def exec_argv(*, binary: str, instance: str, workdir: str = WORKSPACE, python: str = "python3") -> List[str]:
    env = ["PYTHONPATH=" + LIB_DIR, "PYTHONNOUSERSITE=1", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8"]
    argv = [binary, "exec", "--cleanenv", "--pwd", workdir]
    for e in env:
        argv += ["--env", e]
    return argv + ["instance://" + instance, python, "-S", "-m", "rolloutd_toolserver", "--config", CONFIG]


def instance_stop_argv(*, binary: str, instance: str) -> List[str]:
    return [binary, "instance", "stop", "--force", instance]


def _run(argv: List[str]) -> Tuple[int, str]:
    from spython.utils import run_command

    res = run_command(argv, quiet=True)
    return int(res["return_code"]), "".join(res.get("message") or [])


def binary_version(binary: str) -> Optional[str]:
    if shutil.which(binary) is None:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or out.stderr.strip() or None


class ApptainerRuntime(Runtime):
    name = "apptainer"
    uses_ready_fd = False  # the starter does not promise to pass extra fds through; poll the socket

    def __init__(self, root_dir=None, *, binary: str = "apptainer", fakeroot: bool = False,
                 default_image: Optional[str] = None, image_builder: Optional[ImageBuilder] = None,
                 default_image_spec: Optional[ImageSpec] = None, extra_options: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(root_dir, **kw)
        self.name = binary if binary in ("apptainer", "singularity") else "apptainer"
        path = shutil.which(binary)
        if path is None:
            raise RuntimeUnavailable("%s is not installed (not on PATH)" % binary)
        self.binary = path
        self.fakeroot = bool(fakeroot)
        self.nproc_scoped = self.fakeroot  # only then is there a user namespace of our own
        self.default_image = default_image
        self.image_builder = image_builder
        self.default_image_spec = default_image_spec
        self.extra_options = list(extra_options)
        self.python = self.python or "python3"

    def _inside(self, ctx: LaunchContext) -> Dict[str, str]:
        # per-call scratch files live on the sandbox's private tmpfs: half the latency of disk
        return {"socket": RUN_DIR + "/tool.sock", "ctl_dir": "/tmp/.rolloutd", "workdir": ctx.spec.workdir,
                "home": "/tmp/home", "python": None}

    def _image(self, ctx: LaunchContext) -> str:
        image = ctx.spec.image or self.default_image
        if image is None and self.default_image_spec is not None:
            builder = self.image_builder or ImageBuilder(self.root_dir / "images", binary=self.binary,
                                                         fakeroot=self.fakeroot)
            image = str(builder.ensure(self.default_image_spec))
        if image is None:
            raise SandboxSpecError("the %s runtime needs an image (.sif or sandbox dir): set SandboxSpec.image "
                                   "or the runtime's default_image" % self.name)
        if "://" not in image and not os.path.exists(image):
            raise SandboxSpecError("image %s does not exist" % image)
        return image

    def _launch(self, ctx: LaunchContext) -> Dict[str, Any]:
        inst = instance_name(ctx.sandbox_id)
        start = instance_start_argv(
            binary=self.binary, image=self._image(ctx), instance=inst, workspace=str(ctx.workspace),
            run_dir=str(ctx.run_dir), lib_dir=str(ctx.lib_dir), binds=ctx.spec.binds, network=ctx.spec.network,
            fakeroot=self.fakeroot, extra_options=self.extra_options)
        rc, out = _run(start)
        if rc != 0:
            raise SandboxStartError("%s failed (exit %d): %s" % (" ".join(start), rc, out[-2000:]))
        log_fd = os.open(ctx.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            child = subprocess.Popen(exec_argv(binary=self.binary, instance=inst, workdir=ctx.spec.workdir,
                                               python=self.python),
                                     stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True)
        except OSError:
            _run(instance_stop_argv(binary=self.binary, instance=inst))
            raise
        finally:
            os.close(log_fd)
        self._children[ctx.sandbox_id] = child
        return {"pids": [child.pid], "extra": {"instance": inst, "binary": self.binary,
                                               "pid_starts": [procs.start_time(child.pid)]}}

    def _kill(self, state: Dict[str, Any]) -> None:
        extra = state.get("extra") or {}
        inst = extra.get("instance") or instance_name(str(state.get("sandbox_id")))
        rc, out = _run(instance_stop_argv(binary=extra.get("binary") or self.binary, instance=inst))
        if rc != 0 and "no instance found" not in out.lower():
            log.warning("apptainer_instance_stop_failed", instance=inst, output=out[-500:])
        pids = [int(p) for p in state.get("pids") or []]
        starts = list(extra.get("pid_starts") or []) + [None] * len(pids)
        for pid, started in zip(pids, starts):
            procs.kill_tree(pid, started)
        procs.wait_gone(pids, timeout=5.0)
