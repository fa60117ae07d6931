"""Fixtures for the sandbox tests: short root dirs, runtimes that clean up after themselves.

Every sandbox a test creates is destroyed by a finalizer, and the finalizer then checks
that nothing leaked: no process of the sandbox, no sandbox dir, no loopback reservation.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # until the project is pip-installed
    sys.path.insert(0, str(ROOT))

from rolloutd.sandbox import SandboxSpec, ToolClient, bwrap_works  # noqa: E402
from rolloutd.sandbox import procs  # noqa: E402
from tests.conftest import require_bwrap  # noqa: E402,F401 - one rule for every folder

# Short timeouts everywhere: a stuck test should fail, not hang.
FAST = dict(ready_timeout=20.0, interrupt_grace=0.5, default_timeout=20.0)


def bwrap_ok():
    ok, detail = bwrap_works()
    return ok, detail


@pytest.fixture
def need_bwrap():
    require_bwrap()


requires_bwrap = pytest.mark.usefixtures("need_bwrap")


@pytest.fixture
def short_root():
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path can be too long.
    d = Path(tempfile.mkdtemp(prefix="rld", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Tracker:
    """Creates sandboxes on a runtime and guarantees their destruction."""

    def __init__(self, rt):
        self.rt = rt
        self.handles = []
        self.clients = []

    def create(self, job_id="job", spec=None):
        h = self.rt.create(job_id, spec or SandboxSpec())
        self.handles.append(h)
        return h

    def client(self, h, **kw):
        c = ToolClient(h.tool_socket, **kw)
        self.clients.append(c)
        return c

    def cleanup(self):
        for c in self.clients:
            c.close()
        for h in self.handles:
            self.rt.destroy(h)
        # Also whatever other processes created under this root (a test that failed midway).
        stray = self.rt.reap(set())
        assert not stray, "sandboxes not tracked by the test were left running: %s" % stray
        for h in self.handles:
            assert procs.wait_gone(h.pids, timeout=5), "sandbox %s left processes %s" % (h.sandbox_id, h.pids)
            assert not Path(h.sandbox_dir).exists(), "sandbox dir %s left behind" % h.sandbox_dir
        leftover = self.rt.loopback.allocated()
        assert not leftover, "loopback addresses not released: %s" % leftover


def _make(kind, root, **kw):
    from rolloutd.sandbox import get_runtime

    opts = dict(FAST)
    opts.update(kw)
    return get_runtime(kind, root_dir=root, **opts)


@pytest.fixture
def bwrap_rt(short_root):
    require_bwrap()
    t = Tracker(_make("bwrap", short_root))
    yield t
    t.cleanup()


@pytest.fixture
def local_rt(short_root):
    t = Tracker(_make("local", short_root))
    yield t
    t.cleanup()


@pytest.fixture(scope="module")
def tool_env():
    """One bwrap sandbox shared by a module's tool tests. Only ever a real sandbox: these tests
    write to /tmp, kill processes and delete files, which the local runtime would do on the host."""
    require_bwrap()
    d = Path(tempfile.mkdtemp(prefix="rld", dir="/tmp"))
    os.chmod(d, 0o755)
    t = Tracker(_make("bwrap", d, max_output=16 * 1024))
    try:
        h = t.create("tools", SandboxSpec(workspace_files={"hello.txt": "hello\n"}))
        c = t.client(h, timeout=10)
        yield t, h, c
    finally:
        try:
            t.cleanup()
        finally:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def bash(tool_env):
    _, _, c = tool_env

    def run(command, timeout=10, **args):
        return c.call("bash", dict(command=command, timeout=timeout, **args))

    return run


def swe_sandbox(bwrap_rt, workspace_files: dict | None = None):
    """A swe sandbox of the first task, its repository copied in (and ``workspace_files`` beside
    it); (handler, ctx, handle, client, task). Skips when the task cannot be built."""
    from rolloutd.bus.messages import Job
    from rolloutd.handlers.base import JobContext, Services
    from rolloutd.handlers.swe import SWEHandler
    from rolloutd.handlers.swe_tasks import DownloadError, build_task, get_task, task_ids

    task_id = sorted(task_ids())[0]
    try:
        build_task(task_id)
    except DownloadError as e:  # only a cold cache with no package index
        pytest.skip(f"swe task sdist not cached and the package index cannot be reached: {e}")
    handler = SWEHandler()
    ctx = JobContext(Job(job_id=1, attempt=1, handler="swe", instance={"task_id": task_id}, sandbox=None),
                     Services(lambda: bwrap_rt.rt))
    ctx.phase = "eval"
    handler.setup_task(ctx)
    spec = handler.sandbox_spec(ctx)
    if workspace_files:
        spec.workspace_files = dict(spec.workspace_files or {}, **workspace_files)
    h = bwrap_rt.create("swe", spec)
    ctx.job.sandbox = h.to_dict()
    handler.prepare_sandbox(ctx)
    return handler, ctx, h, bwrap_rt.client(h, timeout=30), get_task(task_id)
