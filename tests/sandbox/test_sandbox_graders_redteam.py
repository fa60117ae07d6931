"""Outside red team of the graders (after issue 35's round 2): attacks not in
test_sandbox_graders_round2.py, each run from inside a real bwrap sandbox against the real eval
code. Those that worked on the round-2 code are marked "Before:" in their docstring; the others
are kept as regression guards (docs/SANDBOX.md, "Round 2: graders and abstention").
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.sandbox.test_sandbox_graders_round2 import (CALC_WRONG, DOC_INSTANCE, FORCE_PASS, INIT_PATCH,  # noqa: F401
                                                       TESTS, _as_agent, _harness, graded_zero_after)

# A hidden test that imports none of the agent's code: only the grader's own imports could bring
# the agent's code into pytest's process.
ANSWER_TEST = "def test_answer():\n    with open('answer.txt') as f:\n        assert f.read().strip() == '42'\n"
FRACTIONS_TEST = ("def test_answer():\n    import fractions\n    with open('answer.txt') as f:\n"
                  "        assert fractions.Fraction(f.read().strip()) == 42\n")
ANSWER_INSTANCE = {"command": ["my-agent"], "task_via": "stdin", "task": "Write the answer to answer.txt.",
                   "setup": {"files": {"answer.txt": "0\n"}},
                   "eval": {"pytest": ["tests/test_answer.py"], "files": {"tests/test_answer.py": ANSWER_TEST},
                            "timeout_s": 120}}

# A workspace module named like one pytest (or the test) imports after the workspace is on
# sys.path: it patches pytest's reports to "passed", then hands over the real module.
SHADOW = INIT_PATCH + '''
import importlib as _il, os as _os, sys as _sys
_name = __name__
del _sys.modules[_name]
_saved = _sys.path[:]
_sys.path[:] = [p for p in _sys.path if p not in ("", ".", _os.getcwd())]
_real = _il.import_module(_name)
_sys.path[:] = _saved
_sys.modules[_name] = _real
'''


@pytest.mark.parametrize("module", ["difflib.py", "pdb.py", "unittest/__init__.py", "cmd.py", "fractions.py",
                                    "pluggy/__init__.py", "iniconfig/__init__.py", "packaging/__init__.py"])
def test_a_workspace_module_shadowing_the_stdlib_or_pytests_requirements_is_not_imported(bwrap_rt, module):
    """Before: difflib.py, pdb.py, unittest/ and cmd.py (imported by pytest itself once the
    workspace was sys.path[0]) and fractions.py (imported by the test) were reward 1 with a wrong
    answer and a test that imports none of the agent's code."""
    test = FRACTIONS_TEST if module == "fractions.py" else ANSWER_TEST
    inst = dict(ANSWER_INSTANCE, eval=dict(ANSWER_INSTANCE["eval"], files={"tests/test_answer.py": test}))
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    d = module.rsplit("/", 1)[0] if "/" in module else "."
    ws = Path(h.workspace)
    (ws / d).mkdir(exist_ok=True)
    (ws / module).write_text(SHADOW)
    _as_agent(c, "echo 41 > answer.txt")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0 and "1 failed" in t["eval_details"]["eval_output"], t
    _as_agent(c, "echo 42 > answer.txt")  # the control: the right answer passes with the module there
    asyncio.run(handler.eval(ctx))
    assert ctx.trajectory["reward"] == 1.0, ctx.trajectory["eval_details"]


PYC_PLANT = r"""
import importlib.util, marshal, os, sys
import pytest
# pytest's rewritten test in its cache, valid for the restored test file: pytest 9 checks the
# source's hash (the agent has the pristine source), older ones its mtime and size.
src = "test_calc.py"
data, st = open(src, "rb").read(), os.stat(src)
code = compile("def test_add():\n    pass\n", os.path.abspath(src), "exec")
major = int(pytest.__version__.split(".")[0])
head = (b"\3\0\0\0" + importlib.util.source_hash(data)[:8] if major >= 9 else
        b"\0\0\0\0" + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
os.makedirs("__pycache__", exist_ok=True)
pyc = "__pycache__/%s.%s-pytest-%s.pyc" % (src[:-3], sys.implementation.cache_tag, pytest.__version__)
with open(pyc, "wb") as f:
    f.write(importlib.util.MAGIC_NUMBER + head + marshal.dumps(code))
print("planted", pyc)
"""

# Each must leave the wrong calc.py graded 0 with the real test run (they did on the round-2 code).
ATTACKS = {
    "pyproject_ini_options": ("printf '[tool.pytest.ini_options]\\naddopts = \"-p evilplug\"\\npython_files = \"nothing_*\"\\n'"
                              " > pyproject.toml && cat > evilplug.py <<'EOF'\n" + FORCE_PASS + "EOF"),
    "pytest_toml": ("printf '[pytest]\\naddopts = [\"-p\", \"evilplug\"]\\n' > pytest.toml && cp pytest.toml .pytest.toml"
                    " && cp pytest.toml tests/pytest.toml && cat > evilplug.py <<'EOF'\n" + FORCE_PASS + "EOF"),
    "conftest_deep_and_outside": ("mkdir -p tests/sub/deeper src && for d in tests/sub tests/sub/deeper src; do "
                                  "cat > $d/conftest.py <<'EOF'\n" + FORCE_PASS + "EOF\ndone"),
    "usercustomize_in_home_and_tmp": (
        "for h in /tmp /tmp/home \"$HOME\"; do d=$h/.local/lib/python3.$(python3 -c 'import sys;print(sys.version_info[1])')"
        "/site-packages; mkdir -p $d && cat > $d/usercustomize.py <<'EOF'\n" + INIT_PATCH + "EOF\n"
        "echo 'import usercustomize' > $d/evil.pth; done"),
    "sitecustomize_and_pth_in_workspace": ("cat > sitecustomize.py <<'EOF'\n" + INIT_PATCH + "EOF\n"
                                           "cp sitecustomize.py usercustomize.py && echo 'import sitecustomize' > evil.pth"),
    "symlinked_tests_dir": ("mkdir -p /tmp/t && printf 'def test_add():\\n    pass\\n' > /tmp/t/test_calc.py && "
                            "rm -rf tests && ln -s /tmp/t tests"),
    "symlinked_test_file": ("printf 'def test_add():\\n    pass\\n' > /tmp/p.py && rm tests/test_calc.py && "
                            "ln -s /tmp/p.py tests/test_calc.py"),
    "hardlinked_test_file": ("printf 'def test_add():\\n    pass\\n' > fake.py && rm tests/test_calc.py && "
                             "ln fake.py tests/test_calc.py"),
    "pytest_plugins_in_tests_init": ("cat > evilplug.py <<'EOF'\n" + FORCE_PASS + "EOF\n"
                                     "echo 'pytest_plugins = [\"evilplug\"]' > tests/__init__.py"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_harness_pytest_grade_holds_against_more_workspace_attacks(bwrap_rt, attack):
    graded_zero_after(bwrap_rt, ATTACKS[attack])


def test_a_planted_pyc_for_a_root_level_restored_test_is_not_run(bwrap_rt):
    """The test file sits at the workspace root (restored alone, its __pycache__ the agent's): pytest's
    rewritten pyc, valid for the restored source (planted by the agent), is never read (without the
    grade tool's PYTHONPYCACHEPREFIX this plant turns the failing test into a pass: checked on the
    host with pytest 9.2)."""
    inst = dict(DOC_INSTANCE, setup={"files": {"calc.py": CALC_WRONG, "test_calc.py": TESTS}},
                eval={"pytest": ["test_calc.py"], "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    (Path(h.workspace) / "plant.py").write_text(PYC_PLANT)
    _as_agent(c, "PYTHONPATH=/opt/rolloutd-pytest python3 plant.py")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["reward"] == 0.0 and "1 failed" in t["eval_details"]["eval_output"], t["eval_details"]


@pytest.mark.parametrize("calc", ["import os, signal\nos.kill(-1, signal.SIGKILL)\n",
                                  "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
                                  "import os\nos.chmod('/workspace/tests', 0)\nos.chmod('/workspace', 0)\n"])
def test_code_under_test_that_kills_or_locks_out_its_grader_is_reward_zero_not_failed(bwrap_rt, calc):
    handler, ctx, h, c = _harness(bwrap_rt, dict(DOC_INSTANCE, eval={"pytest": ["tests"], "timeout_s": 30}))
    _as_agent(c, f"printf '{calc.encode('unicode_escape').decode()}' > calc.py")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0, t
    asyncio.run(handler.eval(ctx))  # and the sandbox still grades
    assert ctx.trajectory["status"] == "ok", ctx.trajectory


def test_an_unreadable_tests_dir_is_reward_zero_not_failed(bwrap_rt):
    """chmod 000 on the test tree (and a dir outside it) before the grade: reward 0, never failed."""
    handler, ctx, h, c = _harness(bwrap_rt, DOC_INSTANCE)
    _as_agent(c, "mkdir -p other/x && chmod 000 other tests")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0, t


@pytest.mark.parametrize("printed", ["1_0", "\u0661", "0x1p0", " 1e0x", "9" * 400])
def test_the_stdout_reward_is_a_plain_decimal(bwrap_rt, printed):
    """Before: float() also took '1_0' (reward 10) and Arabic-Indic digits (reward 1); a 400-digit
    number was inf (reward 0 with 'not finite', which stays)."""
    inst = dict(DOC_INSTANCE, eval={"command": ["python3", "score.py"], "reward": "stdout", "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    (Path(h.workspace) / "score.py").write_text(f"print({printed!r})\n", encoding="utf-8")
    asyncio.run(handler.eval(ctx))
    t = ctx.trajectory
    assert t["status"] == "ok" and t["reward"] == 0.0 and t["eval_details"]["reason"], t


ATEXIT_CALC = "import atexit\natexit.register(print, 1000000)\n\ndef add(a, b):\n    return a - b\n"


def test_the_stdout_reward_is_the_last_line_whoever_prints_it(bwrap_rt):
    """A residual, pinned: the agent's module prints after the restored scorer (atexit); the reward
    is what it printed (docs/SANDBOX.md; the job's eval_warning says so)."""
    score = "import calc\nprint(1.0 if calc.add(2, 3) == 5 else 0.0)\n"
    inst = dict(DOC_INSTANCE, setup={"files": {"calc.py": CALC_WRONG, "score.py": score}},
                eval={"command": ["python3", "score.py"], "reward": "stdout", "restore": ["score.py"], "timeout_s": 60})
    handler, ctx, h, c = _harness(bwrap_rt, inst)
    (Path(h.workspace) / "calc.py").write_text(ATEXIT_CALC)
    asyncio.run(handler.eval(ctx))
    d = ctx.trajectory["eval_details"]
    assert ctx.trajectory["reward"] == 1e6 and "last stdout line" in d["eval_warning"], d


@pytest.mark.parametrize("files, why", [({"a\0b.py": ""}, "not a relative path"),
                                        ({"tests": "x", "tests/test_a.py": ""}, "both a file and a directory"),
                                        ({"x" * 256: ""}, "not a relative path"),
                                        ({"t/a.py": "", "./t/a.py": ""}, "given twice")])
@pytest.mark.parametrize("where", ["setup", "eval"])
def test_a_files_map_that_cannot_be_written_is_refused_at_validation(files, why, where):
    """Before: accepted, then writing it at eval raised in the host's temp dir (ValueError: a failed
    job; NotADirectoryError / ENAMETOOLONG: read as the agent's doing, reward 0)."""
    from rolloutd.handlers.harness import HarnessInstanceError, validate

    inst = {"command": ["a"], "task": "t", "task_via": "stdin", "setup": {"files": {}},
            "eval": {"pytest": ["tests"], "files": {}}}
    inst[where]["files"] = files
    with pytest.raises(HarnessInstanceError, match=why):
        validate(inst, {})
