"""Issue 24 in the built-in domains: a leftover daemon that owns the agent's shell (it forges
every later bash call, across a restart and a new connection) cannot replace what the code, swe
and harness graders see. Each test first shows the daemon at work on a bash call (the control),
then runs the domain's real eval code against the same real bwrap sandbox.

Before issue 24 the code eval ran `restart: true` + the check in the shell (forged: reward 1 for
a wrong solution) and the harness eval ran its command with the agent tool (its stdout pipe
taken over from /proc: the forged "1.0" was the last line)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rolloutd.bus.messages import Job
from rolloutd.handlers.base import JobContext, Services
from rolloutd.sandbox import SandboxSpec
from tests.sandbox.conftest import swe_sandbox

FORGER = (Path(__file__).parent / "forger.py").read_text()


def _ctx(h, rt, **state):
    ctx = JobContext(Job(job_id=1, attempt=1, handler="test", instance={}, sandbox=h.to_dict()),
                     Services(lambda: rt))
    ctx.state.update(state)
    ctx.phase = "eval"
    return ctx


def _forger_owns_the_shell(c):
    r = c.call("bash", {"command": "python3 forger.py /tmp/forger.ready; "
                                   "while [ ! -e /tmp/forger.ready ]; do sleep 0.02; done", "timeout": 20})
    assert r.error is None, r
    r = c.call("bash", {"command": "sleep 0.3; python3 -c 'raise SystemExit(1)'; echo REAL-FAIL",
                        "restart": True, "timeout": 20})
    assert "FORGED" in r.output and r.exit_code == 0, r  # the control: the daemon is at work


def test_code_grader_ignores_a_forger_daemon(bwrap_rt):
    from rolloutd.handlers.code import CodeHandler
    from rolloutd.handlers.tasks import humaneval_problem

    p = humaneval_problem("HumanEval/0")
    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    h = bwrap_rt.create("code", SandboxSpec(workspace_files={"solution.py": wrong, "forger.py": FORGER}))
    c = bwrap_rt.client(h, timeout=20)
    _forger_owns_the_shell(c)
    handler = CodeHandler()
    ctx = _ctx(h, bwrap_rt.rt, task_id="HumanEval/0")
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 0.0 and details["passed"] is False, details
    assert "FORGED" not in details["output"], details
    # The same path passes a right solution (the grader works; nothing of the daemon is left).
    (Path(h.workspace) / "solution.py").write_text(p["prompt"] + p["canonical_solution"])
    from rolloutd.handlers.tasks import give_to_sandbox
    give_to_sandbox(h.to_dict(), [Path(h.workspace) / "solution.py"])
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 1.0 and details["passed"] is True, details


def test_harness_eval_command_ignores_a_forger_daemon(bwrap_rt):
    from rolloutd.handlers.harness import HarnessHandler

    h = bwrap_rt.create("harness", SandboxSpec(workspace_files={"forger.py": FORGER}))
    c = bwrap_rt.client(h, timeout=20)
    _forger_owns_the_shell(c)
    ctx = _ctx(h, bwrap_rt.rt)
    ev = {"command": ["sh", "-c", "sleep 0.3; echo 0"], "timeout_s": 20.0, "reward": "last_line"}
    reward, details = asyncio.run(HarnessHandler()._eval_command(ctx, ev))
    assert reward == 0.0 and details["eval_output"] == "0\n", details


def test_swe_grader_ignores_a_forger_daemon(bwrap_rt):
    handler, ctx, h, c, _ = swe_sandbox(bwrap_rt, {"forger.py": FORGER})
    _forger_owns_the_shell(c)
    reward, details = asyncio.run(handler.evaluate(ctx))  # the unfixed repository: its tests fail
    assert reward == 0.0 and details["resolved"] is False, details
    assert details["counts"]["parsed"], details
    assert details["FAIL_TO_PASS_failed"], details


REWRITER = r"""
import glob, os, re, sys, time
if os.fork():
    os._exit(0)
os.setsid()
open("/tmp/rewriter.ready", "w").close()
while True:  # rewrite any check file the grader puts in the workspace into a pass
    for path in glob.glob("/workspace/.rolloutd_check_*.py"):
        try:
            src = open(path).read()
        except OSError:
            continue
        m = re.search(r"ROLLOUTD-CHECK-\" \+ '([0-9a-f]{32})'", src)
        if m and "FORGED" not in src:
            with open(path, "w") as f:
                f.write("print('FORGED'); print('ROLLOUTD-CHECK-%s')\n" % m.group(1))
    time.sleep(0.001)
"""


def test_code_grader_files_are_written_after_the_purge(bwrap_rt):
    """A daemon that rewrites the check file as soon as it appears (before grade's own purge could
    stop it) must find no file while it lives: the eval purges first, then writes the file."""
    from rolloutd.handlers.code import CodeHandler

    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    h = bwrap_rt.create("code-rw", SandboxSpec(workspace_files={"solution.py": wrong, "rw.py": REWRITER}))
    c = bwrap_rt.client(h, timeout=20)
    r = c.call("bash", {"command": "python3 rw.py; while [ ! -e /tmp/rewriter.ready ]; do sleep 0.02; done; "
                                   "echo up", "timeout": 20})
    assert "up" in r.output, r
    reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    assert reward == 0.0 and "FORGED" not in details["output"], details  # before: 1.0, output FORGED


def test_swe_restore_never_writes_through_an_agents_symlink(bwrap_rt, tmp_path):
    """The tests are restored by the host: a `tests` symlink to a host directory must not make
    the host write there (before: the restored test file appeared in the victim directory)."""
    from rolloutd.handlers.swe import SWEHandler
    from rolloutd.handlers.swe_tasks import DownloadError, build_task, task_ids

    task_id = sorted(task_ids())[0]
    try:
        build_task(task_id)
    except DownloadError as e:
        import pytest
        pytest.skip(f"swe task sdist not cached and the package index cannot be reached: {e}")
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chmod(tmp_path, 0o755)
    handler = SWEHandler()
    ctx = _ctx(type("H", (), {"to_dict": lambda self: None})(), bwrap_rt.rt)
    ctx.job.instance = {"task_id": task_id}
    handler.setup_task(ctx)
    h = bwrap_rt.create("swe-ln", handler.sandbox_spec(ctx))
    ctx.job.sandbox = h.to_dict()
    handler.prepare_sandbox(ctx)
    c = bwrap_rt.client(h, timeout=20)
    r = c.call("bash", {"command": f"rm -rf tests && ln -s {victim} tests && ls -ld tests", "timeout": 20})
    assert "->" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert list(victim.iterdir()) == [], list(victim.iterdir())
    assert (Path(h.workspace) / "tests").is_dir() and not (Path(h.workspace) / "tests").is_symlink()
    assert reward == 0.0 and details["counts"]["parsed"], details  # the unfixed repository, graded
