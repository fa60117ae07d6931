"""``swe``: the software-engineering tasks of :mod:`rolloutd.handlers.swe_tasks`, graded SWE-bench style.

Instance: ``{"task_id": "semver-bump-build-separator"}`` (``python -m rolloutd.handlers.swe_tasks
--list`` lists the 12 tasks).

init builds the task's buggy repository if the cache lacks it (``$ROLLOUTD_SWE_CACHE``, see
handlers/swe_tasks/README.md) and copies it into the sandbox workspace; the agent gets the
issue text and bash + editor tools. pytest (and its pure-Python requirements) from the
daemon's own environment is bind-mounted read-only at ``/opt/rolloutd-pytest`` and put on
``PYTHONPATH``, so ``python3 -m pytest`` works inside the sandbox with no network (the local
runtime, which has no mounts, gets a directory of symlinks instead).

eval captures the agent's patch (``git diff``), restores the test files, runs the task's
``test_cmd`` in the sandbox through the ``grade`` tool (every process the agent started is
killed first; the output is the test run's own, on fresh pipes) with a clean environment and
the task's timeout, and grades it: reward 1 only if every FAIL_TO_PASS and every PASS_TO_PASS
test passes.

``[handlers.swe]`` config (besides the common keys): ``cache_dir`` (the swe_tasks cache).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from rolloutd.handlers.base import JobContext
from rolloutd.handlers.tasks import (PYTEST_MOUNT, DomainHandler, clean_env, eval_sandbox, give_to_sandbox, pytest_binds,
                            pytest_link_dir, workspace_inside)

MAX_PATCH_CHARS = 20000


class SWEHandler(DomainHandler):
    domain = "swe"
    tools = ("bash", "editor")
    max_turns = 30
    max_tokens = 2048
    max_context = 16384
    tool_timeout_s = 120.0
    eval_needs_sandbox = True
    system_prompt = ("You are an expert software engineer. You fix bugs in Python repositories using a bash shell "
                     "and a file editor. The repository is your current working directory.")
    user_template = ("{tag}The repository `{library}` (version {version}) is checked out in the current working "
                     "directory. A user reported this issue:\n\n<issue>\n{issue}\n</issue>\n\n"
                     "Change the library's source code so that the issue is resolved. Do not change the tests. "
                     "pytest is installed: `python3 -m pytest -q <tests>` runs tests. When you are done, reply "
                     "without a tool call.")

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self.cache_dir = self.config.get("cache_dir") or None

    # -- init ----------------------------------------------------------------------------------
    def setup_task(self, ctx: JobContext) -> None:
        from rolloutd.handlers.swe_tasks import build_task, get_task

        task_id = ctx.instance.get("task_id")
        if not isinstance(task_id, str):
            raise ValueError('a swe instance is {"task_id": "<task id>"}')
        task = get_task(task_id)
        build_task(task_id, self.cache_dir)  # cached; downloads the sdist on a cold cache
        ctx.state.update(tag=[task_id], task_id=task_id,
                         prompt_fields={"library": task["library"], "version": task["version"],
                                        "issue": task["issue"].strip()})

    def sandbox_spec(self, ctx: JobContext):
        from rolloutd.sandbox import Limits, SandboxSpec

        limits = Limits(memory_mb=2048, nproc=256, cpu_seconds=900, file_size_mb=256, wall_seconds=3600,
                        disk_mb=4096)
        if ctx.services.runtime().name == "local":
            return SandboxSpec(limits=limits, env={"PYTHONPATH": pytest_link_dir(),
                                                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return SandboxSpec(limits=limits, binds=pytest_binds(),
                           env={"PYTHONPATH": PYTEST_MOUNT, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})

    def prepare_sandbox(self, ctx: JobContext) -> None:
        from rolloutd.handlers.swe_tasks import copy_repo

        ws = Path(ctx.sandbox["workspace"])
        copy_repo(ctx.state["task_id"], ws, self.cache_dir)
        give_to_sandbox(ctx.sandbox, [ws])

    # -- eval ----------------------------------------------------------------------------------
    def _pythonpath(self, sb: dict) -> str:
        return pytest_link_dir() if sb.get("runtime") == "local" else PYTEST_MOUNT

    async def evaluate(self, ctx: JobContext) -> tuple[float, dict]:
        from rolloutd.handlers.swe_tasks import get_task, grade, restore_tests

        task = get_task(ctx.state["task_id"])
        sb, ws = eval_sandbox(ctx, "swe")
        inside = workspace_inside(sb)
        # The grade tool: every process the agent left is killed first and the output is the
        # grading process's own, on fresh pipes (issue 24); the tests' whole output (1 MiB tail).
        patch = await ctx.grade(["git", "-c", "core.pager=cat", "diff", "--no-color", "--no-ext-diff"],
                                cwd=inside, env=clean_env(), timeout=30)
        # The host (root) writes the tests back into a tree the agent shaped: no symlink on the
        # way may send that write elsewhere on the host (tests -> /etc, say).
        await asyncio.to_thread(_unlink_symlinks, ws, task["test_files"])
        restored = await asyncio.to_thread(restore_tests, task["task_id"], ws, self.cache_dir)
        await asyncio.to_thread(give_to_sandbox, sb, [ws / r for r in restored])
        env = clean_env({"PYTHONPATH": self._pythonpath(sb), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        r = await ctx.grade(list(task["test_cmd"]), cwd=inside, env=env, timeout=float(task["timeout_s"]))
        output = r.output or ""
        exit_code = 124 if r.timed_out else r.exit_code
        result = grade(task, output, exit_code)
        details = {
            "task_id": task["task_id"], "resolved": result["resolved"], "exit_code": exit_code,
            "timed_out": r.timed_out, "counts": result["counts"], "error": result["error"],
            "FAIL_TO_PASS_failed": result["FAIL_TO_PASS"]["failure"][:20],
            "PASS_TO_PASS_failed": result["PASS_TO_PASS"]["failure"][:20],
            "patch": (patch.output or "")[:MAX_PATCH_CHARS] if patch.exit_code == 0 else None,
        }
        if r.error:
            details["tool_error"] = r.error
        if not result["counts"]["parsed"]:
            details["output_tail"] = output[-3000:]
        return result["reward"], details


def _unlink_symlinks(root: Path, rels: list[str]) -> None:
    """Remove every symlink on the path to, and under, each ``root/rel`` (no agent process is
    alive by now: the first grade purged, so nothing can put one back)."""
    import os
    import shutil

    for rel in rels:
        p = root
        for part in Path(rel).parts:
            p = p / part
            if p.is_symlink():
                p.unlink()
            elif p.exists() and not p.is_dir() and p != root / rel:
                p.unlink()  # a file where a directory of the path should be
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            for dirpath, dirnames, filenames in os.walk(target):
                for n in dirnames + filenames:
                    q = Path(dirpath) / n
                    if q.is_symlink():
                        q.unlink()
        elif target.exists() and target.is_dir():
            shutil.rmtree(target)

