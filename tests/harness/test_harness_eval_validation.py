"""The harness instance's grading keys (issue 35 item 2): eval.pytest, eval.files, eval.restore and
eval.pytest_config are checked at init like every other key, and eval.pytest's default restore is
the tree of each test path."""
from __future__ import annotations

import pytest

from rolloutd.handlers.harness import HarnessInstanceError, validate

BASE = {"command": ["agent"], "task": "x", "task_via": "stdin",
        "setup": {"files": {"calc.py": "", "tests/test_calc.py": "", "test_root.py": ""}}}


def ev(**e):
    return validate(dict(BASE, eval=e), {})["eval"]


def test_pytest_mode_defaults():
    e = ev(pytest=["tests/test_calc.py::test_add", "-q", "test_root.py", "-k", "add"])
    assert e["restore"] == ["tests", "test_root.py"] and e["files"] == {} and e["pytest_config"] is None
    assert e["timeout_s"] == 300.0
    assert ev(pytest=["tests"], restore=[])["restore"] == []
    assert ev(pytest=["hidden/test_h.py"], files={"hidden/test_h.py": "x"})["restore"] == ["hidden"]


def test_command_mode_restores_nothing_by_default():
    assert ev(command=["python3", "tests/test_calc.py"])["restore"] == []
    assert ev(command=["true"], restore=["tests"])["restore"] == ["tests"]


@pytest.mark.parametrize("bad, msg", [
    ({"pytest": ["tests"], "command": ["true"]}, "exactly one of"),
    ({"pytest": ["tests"], "reward": "stdout"}, "eval.reward goes with eval.command"),
    ({"command": ["true"], "pytest_config": "pytest.ini"}, "goes with eval.pytest"),
    ({"pytest": ["tests"], "restore": ["nope"]}, "not in setup.files"),
    ({"pytest": ["tests"], "restore": ["../etc"]}, "not a relative path"),
    ({"pytest": ["tests"], "files": {"/abs": "x"}}, "not a relative path"),
    ({"pytest": ["tests"], "files": {"a": 1}}, "eval.files maps"),
    ({"pytest": ["tests"], "pytest_config": "pytest.ini"}, "must be one of eval.files"),
    ({"command": ["true"], "reward": "stdout", "timeout_s": float("nan")}, "positive number"),
])
def test_bad_grading_keys_are_refused(bad, msg):
    with pytest.raises(HarnessInstanceError, match=msg):
        validate(dict(BASE, eval=bad), {})


def test_restore_needs_the_setups_files_or_repository():
    inst = {"command": ["agent"], "task": "x", "task_via": "stdin", "setup": {"domain": "swe", "instance": {"task_id": "t"}},
            "eval": {"pytest": ["tests"], "restore": ["tests"]}}
    with pytest.raises(HarnessInstanceError, match="not from a setup.domain"):
        validate(inst, {})
    assert ev(pytest=["tests"], pytest_config="tests/pytest.ini")["pytest_config"] == "tests/pytest.ini"


@pytest.mark.parametrize("key", ["../escape.py", "/etc/passwd", "a/../../b"])
def test_setup_files_never_name_a_path_outside_the_workspace(key):
    with pytest.raises(HarnessInstanceError, match="setup.files"):
        validate(dict(BASE, setup={"files": {key: "x"}}, eval={"pytest": ["tests"]}), {})
