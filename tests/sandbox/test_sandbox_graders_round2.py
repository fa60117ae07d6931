"""Issue 35, round 2 of the graders (items 2, 3, 5, 6), each attack run from inside a real bwrap
sandbox against the domain's real eval code:

* swe: a pytest-report patch in tests/__init__.py (neither restored nor removed before: reward 1
  with the bug unfixed), a 1,100-deep a/a/... tree (the conftest sweep's os.fwalk raised
  RecursionError: a failed job instead of a 0);
* harness ``eval.pytest``: the four ways the documented ``eval.command`` example was passed with a
  wrong calc.py (overwritten tests, a conftest.py, a pytest.ini with ``addopts = -p evilplug``, a
  workspace pytest.py);
* harness ``reward: "stdout"``: nan, inf, -inf, 1e308 printed by the agent's own module.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rolloutd.bus.messages import Job
from rolloutd.handlers.base import JobContext, Services


# -- swe ---------------------------------------------------------------------------------------------
# A swe sandbox of the first task (boltons, tests/test_strutils.py), its repository copied in.
from tests.sandbox.conftest import swe_sandbox  # noqa: E402
from tests.sandbox.test_sandbox_redteam_swe import FORCE_PASS  # noqa: E402


# Imported by pytest as the tests package (rootdir-based import) before any test runs: every report
# made after it says "passed".
INIT_PATCH = '''
import _pytest.reports as _rp
_orig = _rp.TestReport.from_item_and_call.__func__
def _passed(cls, item, call):
    rep = _orig(cls, item, call)
    rep.outcome, rep.longrepr = "passed", None
    return rep
_rp.TestReport.from_item_and_call = classmethod(_passed)
'''


def test_swe_a_report_patch_in_tests_init_cannot_pass_the_unfixed_repository(bwrap_rt):
    """Before: tests/__init__.py was neither restored nor removed, and this was reward 1 (resolved)."""
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    r = c.call("bash", {"command": "cat >> tests/__init__.py <<'EOF'\n" + INIT_PATCH + "EOF\n"
                                   "echo '# mine' > tests/helper_added.py && echo ok", "timeout": 20})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details
    from rolloutd.handlers.swe_tasks import build_task

    ws, src = Path(h.workspace), build_task(task["task_id"])
    init = "tests/__init__.py"
    assert ((ws / init).read_text() == (src / init).read_text()) if (src / init).exists() else not (ws / init).exists()
    assert not (ws / "tests" / "helper_added.py").exists()  # the test tree is the pristine one, whole


DEEP = ("python3 -c \"import os\nos.chdir('{where}')\nfor i in range(1100):\n    os.mkdir('a'); os.chdir('a')\n"
        "os.symlink('.', 'loop'); os.symlink('/workspace', 'up'); open('conftest.py', 'w').write('x')\nprint('deep')\"")


@pytest.mark.parametrize("where", [".", "tests"])
def test_swe_a_1100_deep_tree_is_graded_zero_with_a_reason(bwrap_rt, where):
    """Before: os.fwalk in the conftest sweep raised RecursionError (the job failed: an abstention)."""
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    r = c.call("bash", {"command": DEEP.format(where=where), "timeout": 60})
    assert "deep" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 0.0 and details["resolved"] is False, details
    assert "directories deep" in details["reason"], details
    # the same eval through the handler's phase entry: status ok, reward 0, the reason in eval_details
    asyncio.run(handler.eval(ctx))
    assert ctx.trajectory["status"] == "ok" and ctx.trajectory["reward"] == 0.0, ctx.trajectory
    assert "directories deep" in ctx.trajectory["eval_details"]["reason"]


def test_swe_restore_walks_a_wide_and_looped_tree_without_raising(bwrap_rt):
    """Symlink loops and a wide tree under the test directory: restored, swept, graded (no raise)."""
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    r = c.call("bash", {"command": "mkdir -p tests/x && ln -s .. tests/x/up && ln -s ../tests tests/self && "
                                   "for i in $(seq 200); do mkdir -p tests/w$i/conftest.py; done; ln -s tests/self "
                                   "conftest.py; echo ok", "timeout": 60})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 0.0 and details["counts"]["parsed"] and details["FAIL_TO_PASS_failed"], details
    ws = Path(h.workspace)
    assert not (ws / "tests" / "x").exists() and not (ws / "conftest.py").is_symlink()


# -- harness eval.pytest -----------------------------------------------------------------------------
CALC_WRONG = "def add(a, b):\n    return a - b\n"
CALC_RIGHT = "def add(a, b):\n    return a + b\n"
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# HARNESS.md's example, in the safe form it documents.
DOC_INSTANCE = {"command": ["my-agent", "--task-file", "{task_file}"], "task_via": "file",
                "task": "Make the tests in tests/ pass.",
                "setup": {"files": {"calc.py": CALC_WRONG, "tests/test_calc.py": TESTS}},
                "eval": {"pytest": ["tests"], "timeout_s": 120}}

FAKE_PYTEST = "import sys\nprint('1 passed')\nsys.exit(0)\n"

# Each was reward 1 with a wrong calc.py against the documented eval.command example.
ATTACKS = {
    "overwritten_test": "printf 'def test_add():\\n    pass\\n' > tests/test_calc.py",
    "conftest": "cat > conftest.py <<'EOF'\n" + FORCE_PASS + "EOF",
    "conftest_in_tests": "cat > tests/conftest.py <<'EOF'\n" + FORCE_PASS + "EOF",
    "pytest_ini_addopts": ("printf '[pytest]\\naddopts = -p evilplug\\n' > pytest.ini && cp pytest.ini tests/pytest.ini"
                           " && cat > evilplug.py <<'EOF'\n" + FORCE_PASS + "EOF"),
    "tox_ini_and_setup_cfg": ("printf '[pytest]\\naddopts = -p evilplug\\n' > tox.ini && printf '[tool:pytest]\\n"
                              "python_functions = nothing\\n' > setup.cfg && cat > evilplug.py <<'EOF'\n" + FORCE_PASS
                              + "EOF"),
    "workspace_pytest_py": "cat > pytest.py <<'EOF'\n" + FAKE_PYTEST + "EOF",
    "tests_init": "printf 'import sys\\nsys.exit(0)\\n' > tests/__init__.py",
}


class _Runtime:
    """The tracked bwrap runtime as a handler's Services see it (every sandbox destroyed after)."""

    def __init__(self, tracker):
        self.t, self.name = tracker, tracker.rt.name

    def create(self, job_id, spec):
        return self.t.create(job_id, spec)


def _harness(bwrap_rt, instance, config=None):
    from rolloutd.handlers.harness import HarnessHandler

    handler = HarnessHandler(config or {})
    ctx = JobContext(Job(job_id=7, attempt=1, handler="harness", instance=instance, sandbox=None),
                     Services(lambda: _Runtime(bwrap_rt)))
    ctx.phase = "init"
    asyncio.run(handler.init(ctx))
    ctx.phase = "eval"
    return handler, ctx, bwrap_rt.handles[-1], bwrap_rt.client(bwrap_rt.handles[-1], timeout=30)


def _as_agent(c, command):
    r = c.call("bash", {"command": command + "\necho AGENT-DONE", "timeout": 30})
    assert "AGENT-DONE" in r.output, r


def graded_zero_after(bwrap_rt, attack: str) -> None:
    """DOC_INSTANCE with its wrong calc.py, the agent's ``attack`` run in the sandbox: reward 0 from
    the real test."""
    handler, ctx, h, c = _harness(bwrap_rt, DOC_INSTANCE)
    _as_agent(c, attack)
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0, t["eval_details"]
    assert "1 failed" in t["eval_details"]["eval_output"], t["eval_details"]  # graded: the real test ran


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_harness_pytest_grade_is_not_passed_by_the_agents_workspace(bwrap_rt, attack):
    graded_zero_after(bwrap_rt, ATTACKS[attack])


def test_harness_pytest_grade_passes_a_right_fix_and_sees_no_warning(bwrap_rt):
    handler, ctx, h, c = _harness(bwrap_rt, DOC_INSTANCE)
    _as_agent(c, "printf 'def add(a, b):\\n    return a + b\\n' > calc.py && " + ATTACKS["conftest"])
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 1.0 and d["eval_status"] == 0, d
    assert d["restored"] == ["tests"] and d["conftests_removed"] == ["conftest.py"], d
    assert "eval_warning" not in d, d


HIDDEN = "from calc import add\n\n\ndef test_add_hidden():\n    assert add(-1, 1) == 0\n"
REWRITER = r"""
import os, time
if os.fork():
    os._exit(0)
os.setsid()
open("/tmp/rw.ready", "w").close()
end = time.time() + 60
while time.time() < end:  # turn any hidden test the host writes into a pass
    try:
        if "hidden" in open("/workspace/tests/test_hidden.py").read():
            open("/workspace/tests/test_hidden.py", "w").write("def test_add_hidden():\n    pass\n")
    except OSError:
        pass
    time.sleep(0.001)
"""


def test_harness_eval_files_are_written_after_the_purge(bwrap_rt):
    """A daemon of the agent's waits for the hidden test the host writes: it is dead by then."""
    inst = dict(DOC_INSTANCE, eval={"pytest": ["tests/test_hidden.py"], "files": {"tests/test_hidden.py": HIDDEN},
                                    "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    (Path(h.workspace) / "rw.py").write_text(REWRITER)
    _as_agent(c, "python3 rw.py; while [ ! -e /tmp/rw.ready ]; do sleep 0.02; done")
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 0.0 and "1 failed" in d["eval_output"], d
    assert d["written"] == ["tests/test_hidden.py"] and d["restored"] == ["tests"], d


def test_harness_eval_command_with_restore_and_the_warning(bwrap_rt):
    """eval.command: eval.restore puts the setup's tests back; without it the job says it was open."""
    check = "import calc, sys\nsys.exit(0 if calc.add(2, 3) == 5 else 1)\n"
    inst = dict(DOC_INSTANCE, setup={"files": {"calc.py": CALC_WRONG, "tests/check.py": check}},
                eval={"command": ["python3", "tests/check.py"], "restore": ["tests"], "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    _as_agent(c, "echo 'raise SystemExit(0)' > tests/check.py")
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 0.0 and d["restored"] == ["tests"] and "eval_warning" not in d, d
    open_inst = dict(DOC_INSTANCE, eval={"command": ["python3", "-m", "pytest", "-q"], "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, open_inst)
    asyncio.run(handler.eval(ctx))
    assert "use eval.pytest" in ctx.trajectory["eval_details"]["eval_warning"], ctx.trajectory["eval_details"]


# -- harness reward: "stdout" ------------------------------------------------------------------------
@pytest.mark.parametrize("printed", ["nan", "inf", "-inf", "1e308", "-1e7"])
def test_harness_stdout_reward_is_never_non_finite_or_out_of_range(bwrap_rt, printed):
    """Before: the agent's module printing nan gave an ok job with reward NaN (inf, -inf, 1e308 too)."""
    inst = dict(DOC_INSTANCE, eval={"command": ["python3", "score.py"], "reward": "stdout", "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    _as_agent(c, f"echo 'print(\"{printed}\")' > score.py")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0, t
    assert ("not finite" if "inf" in printed or printed == "nan" else "outside") in t["eval_details"]["reason"], t
    _as_agent(c, "echo 'print(0.25)' > score.py")  # the control: a valid number is the reward
    ctx.trajectory["eval_details"].clear()
    asyncio.run(handler.eval(ctx))
    assert ctx.trajectory["reward"] == 0.25 and "reason" not in ctx.trajectory["eval_details"], ctx.trajectory


@pytest.mark.parametrize("calc, why", [("import os\nos.kill(os.getpid(), 9)\n", "killed by signal 9"),
                                       ("import time\ntime.sleep(60)\n", "ran out of time")])
def test_harness_a_grader_the_agents_code_kills_or_stalls_is_reward_zero_with_a_reason(bwrap_rt, calc, why):
    inst = dict(DOC_INSTANCE, eval={"pytest": ["tests"], "timeout_s": 5})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    _as_agent(c, f"printf '{calc.encode('unicode_escape').decode()}' > calc.py")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0 and why in t["eval_details"]["reason"], t["eval_details"]


def test_harness_pytest_that_restores_nothing_warns(bwrap_rt):
    inst = dict(DOC_INSTANCE, eval={"pytest": ["tests"], "restore": [], "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 0.0 and "restored and wrote nothing" in d["eval_warning"], d


def test_harness_pytest_restores_from_a_setup_repository(bwrap_rt, tmp_path):
    """eval.restore's other source: a repository named in the config, copied back after the purge."""
    repo = tmp_path / "lib"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC_WRONG)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    inst = {"command": ["agent"], "task": "fix calc", "task_via": "stdin", "setup": {"repository": "lib"},
            "eval": {"pytest": ["tests/test_calc.py"], "timeout_s": 60}}
    handler, ctx, h, c = _harness(bwrap_rt, inst, {"repositories": {"lib": str(repo)}})
    _as_agent(c, ATTACKS["overwritten_test"] + " && " + ATTACKS["tests_init"])
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 0.0 and d["restored"] == ["tests"] and "1 failed" in d["eval_output"], d
    _as_agent(c, "printf 'def add(a, b):\\n    return a + b\\n' > calc.py")
    asyncio.run(handler.eval(ctx))
    assert ctx.trajectory["reward"] == 1.0, ctx.trajectory["eval_details"]
