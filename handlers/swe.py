"""``swe``: the software-engineering tasks of :mod:`rolloutd.handlers.swe_tasks`, graded SWE-bench style.

Instance: ``{"task_id": "semver-bump-build-separator"}`` (``python -m rolloutd.handlers.swe_tasks
--list`` lists the 12 tasks).

init builds the task's buggy repository if the cache lacks it (``$ROLLOUTD_SWE_CACHE``, see
handlers/swe_tasks/README.md) and copies it into the sandbox workspace; the agent gets the
issue text and bash + editor tools. pytest (and its pure-Python requirements) from the
daemon's own environment is bind-mounted read-only at ``/opt/rolloutd-pytest`` and put on
``PYTHONPATH``, so ``python3 -m pytest`` works inside the sandbox with no network (the local
runtime, which has no mounts, gets a directory of symlinks instead).

eval captures the agent's patch (``git diff``, no program-running config of the agent's),
restores the test tree, the repository's own conftest.py files and its pytest ini file (deleting
every other conftest.py), runs the task's ``test_cmd`` in the sandbox through the ``grade`` tool
(every process the agent started is killed first; the output is the test run's own, on fresh
pipes) with the shared pytest hardening (handlers/pytest_grader.py) and the task's timeout, and
grades the output before our plugin's end line: reward 1 only if every FAIL_TO_PASS and every
PASS_TO_PASS test passes and pytest's status agrees with the exit code. A tree the agent made
unrestorable (full, too deep, unreadable) is graded 0 with ``reason``, never a failed job.

``[handlers.swe]`` config (besides the common keys): ``cache_dir`` (the swe_tasks cache).
"""
from __future__ import annotations

import asyncio
import functools
import os
import secrets
from pathlib import Path

from rolloutd.handlers import pytest_grader
from rolloutd.handlers.base import AgentFault, JobContext
from rolloutd.handlers.tasks import (PYTEST_MOUNT, DomainHandler, clean_env, eval_sandbox, give_to_sandbox, pytest_binds,
                            pytest_link_dir, workspace_inside)

MAX_PATCH_CHARS = 20000

# `git diff` of the agent's work. The workspace's .git/config is the agent's: every key that makes
# git run a program in a diff is overridden (fsmonitor hook, hooks, pager, external diff,
# textconv), and no system/global config or attributes file is read. A filter driver named in
# the repository's own config and .gitattributes can still run (its name is the agent's); the
# grade's purge ends whatever it starts (docs/SANDBOX.md).
GIT_DIFF = ["git", "--no-pager", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
            "-c", "core.pager=cat", "-c", "diff.external=", "-c", "core.attributesFile=/dev/null",
            "-c", "core.untrackedCache=false", "diff", "--no-color", "--no-ext-diff", "--no-textconv"]
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}

def grader_argv(task: dict, rootdir: str, config: str) -> list[str]:
    """The task's ``test_cmd`` (``python3 -B -m pytest <args>``) as the grader runs it: the shared
    pytest hardening (handlers/pytest_grader.py), rootdir the workspace, ``config`` the repository's
    own ini file (restored) or the host's empty one (``pytest_grader.pin_config``)."""
    argv = list(task["test_cmd"])
    if argv[:4] != ["python3", "-B", "-m", "pytest"]:
        raise ValueError(f"{task['task_id']}: test_cmd must start with python3 -B -m pytest, not {argv[:4]}")
    return pytest_grader.argv(argv[4:], rootdir=rootdir, config=config)


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

    def _restore(self, task: dict, ws: Path) -> tuple[list[str], str]:
        """Put the task's test tree, the repository's own conftest.py files and its pytest ini file
        back (whatever the agent left in their place: a symlink, a FIFO, a directory, a patched
        ``__init__.py``, added files), delete every other conftest.py, and return the restored paths
        and the ini file. No agent process is alive (the diff's grade purged). What the agent made
        of the tree that stops this (too deep, full, unreadable) is an AgentFault."""
        from rolloutd.handlers.swe_tasks import build_task, restore_tests

        src = str(build_task(task["task_id"], self.cache_dir))
        own = _conftests(src)
        config = pytest_grader.config_of(src)
        try:
            rels = restore_tests(task["task_id"], ws, self.cache_dir, also=list(own) + ([config] if config else []))
            pytest_grader.sweep_conftests(ws, set(own))
            config = pytest_grader.pin_config(ws, config)
        except OSError as e:
            if e.errno not in pytest_grader.AGENT_ERRNOS:
                raise
            raise AgentFault(f"the tests could not be restored into the agent's workspace: "
                             f"{e.strerror or e} ({os.path.basename(e.filename or '') or 'workspace'})") from e
        except pytest_grader.WorkspaceUnfit as e:
            raise AgentFault(f"the tests could not be restored into the agent's workspace: {e}") from e
        return rels, config

    # -- eval ----------------------------------------------------------------------------------
    async def evaluate(self, ctx: JobContext) -> tuple[float, dict]:
        from rolloutd.handlers.swe_tasks import get_task, grade

        task = get_task(ctx.state["task_id"])
        sb, ws = eval_sandbox(ctx, "swe")
        inside = workspace_inside(sb)
        # The grade tool: every process the agent left is killed first and the output is the
        # grading process's own, on fresh pipes (issue 24); the tests' whole output (1 MiB tail).
        # git reads the workspace's .git/config: the keys that run a program are overridden.
        patch = await ctx.grade(GIT_DIFF, cwd=inside, env=clean_env(GIT_ENV), timeout=30)
        # The host (root) writes the tests back into a tree the agent shaped: no symlink on the
        # way may send that write elsewhere on the host (tests -> /etc, say); no conftest.py but
        # the repository's own may load (it could report every test passed).
        try:
            restored, config = await asyncio.to_thread(self._restore, task, ws)
        except AgentFault as e:  # the agent's doing: a grade of 0 with the reason, not a failed job
            return 0.0, {"task_id": task["task_id"], "resolved": False, "exit_code": None, "timed_out": False,
                         "counts": {"parsed": 0}, "error": str(e), "reason": str(e),
                         "FAIL_TO_PASS_failed": list(task["FAIL_TO_PASS"])[:20], "PASS_TO_PASS_failed": []}
        await asyncio.to_thread(give_to_sandbox, sb, [ws / r for r in restored + [config]])
        end = f"ROLLOUTD-PYTEST-END-{secrets.token_hex(16)}"
        argv = grader_argv(task, inside, config)
        r = await ctx.grade(argv, cwd=inside, env=pytest_grader.env(sb, end), timeout=float(task["timeout_s"]))
        exit_code = 124 if r.timed_out else r.exit_code
        output, status = pytest_grader.split_at_end(r.output or "", end)
        result = grade(task, output, exit_code)
        if result["resolved"] and (status != exit_code or status not in (0, 1)):
            # pytest's own end (our plugin's last line, then os._exit) must agree with the exit code.
            result.update(resolved=False, reward=0.0, error=f"pytest's end status {status} does not agree with the "
                                                               f"exit code {exit_code}")
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


@functools.lru_cache(maxsize=64)
def _conftests(src_root: str) -> tuple[str, ...]:
    """Every conftest.py of the built repository (relative paths)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(src_root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        if "conftest.py" in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, "conftest.py"), src_root))
    return tuple(sorted(out))
