"""The committed task definitions are complete and consistent (no network)."""
from __future__ import annotations

import json

import pytest

from rolloutd.handlers.swe_tasks import get_task, load_tasks, task_ids
from rolloutd.handlers.swe_tasks.patching import parse_unified_diff
from rolloutd.handlers.swe_tasks.taskdefs import (
    PATCHES_DIR,
    TASKS_DIR,
    TaskDefinitionError,
    UnknownTask,
    build_hash,
    read_patch,
    validate_task,
)

TASKS = load_tasks()


def test_enough_tasks_and_libraries():
    assert len(TASKS) >= 10
    assert len({t["library"] for t in TASKS}) >= 6
    assert [t["task_id"] for t in TASKS] == sorted(task_ids())


def test_every_patch_belongs_to_a_task():
    patches = {p.name for p in PATCHES_DIR.glob("*.diff")}
    assert patches == {t["bug_patch"] for t in TASKS}
    assert {p.stem for p in TASKS_DIR.glob("*.json")} == set(task_ids())


def test_get_task_returns_a_copy():
    t = get_task(TASKS[0]["task_id"])
    t["FAIL_TO_PASS"].clear()
    assert get_task(TASKS[0]["task_id"])["FAIL_TO_PASS"]
    with pytest.raises(UnknownTask):
        get_task("no-such-task")


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t["task_id"])
def test_task_is_consistent(task):
    patched = {fp.path for fp in parse_unified_diff(read_patch(task))}
    # the oracle and the wrong fix edit the files the bug patch touched
    assert {e["path"] for e in task["oracle_fix"]} <= patched
    assert {e["path"] for e in task["wrong_fix"]} <= patched
    assert task["oracle_fix"] != task["wrong_fix"]
    # pinned, exact version; the sdist name matches it
    assert task["version"] in task["sdist"] and task["sdist"].startswith(task["sdist_subdir"])
    # the test command: our interpreter placeholder and the per-test summary the grader reads
    cmd = task["test_cmd"]
    assert cmd[:4] == ["python3", "-B", "-m", "pytest"]
    assert "-rfEsxXp" in cmd and "--color=no" in cmd
    assert task["test_files"]
    # every test id lives in a file the task restores before grading
    for tid in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]:
        path = tid.split("::", 1)[0]
        assert any(path == f or path.startswith(f.rstrip("/") + "/") for f in task["test_files"]), tid
        assert " - " not in tid
    # the issue reads like a user's report: it does not point at the patched file
    for path in patched:
        assert path not in task["issue"]
    assert len(task["issue"]) > 200 and "```" in task["issue"]
    assert 0 < task["timeout_s"] <= 300


def test_build_hash_depends_on_build_inputs_only():
    t = get_task(TASKS[0]["task_id"])
    h = build_hash(t)
    t["issue"] = "changed"
    t["PASS_TO_PASS"] = []
    assert build_hash(t) == h
    t["version"] = "0.0.0"
    assert build_hash(t) != h


def test_validation_rejects_bad_definitions():
    good = get_task(TASKS[0]["task_id"])
    for mutate, msg in [
        (lambda t: t.pop("issue"), "missing field"),
        (lambda t: t.update(FAIL_TO_PASS=[]), "FAIL_TO_PASS is empty"),
        (lambda t: t.update(PASS_TO_PASS=t["PASS_TO_PASS"] + t["FAIL_TO_PASS"][:1]), "both"),
        (lambda t: t.update(sdist_sha256="abc"), "sha256"),
        (lambda t: t.update(bug_patch="missing.diff"), "not found"),
        (lambda t: t.update(oracle_fix=[{"path": "x", "old": "a", "new": "a"}]), "changes nothing"),
        (lambda t: t.update(test_cmd=[]), "test_cmd"),
    ]:
        bad = json.loads(json.dumps(good))
        mutate(bad)
        with pytest.raises(TaskDefinitionError, match=msg):
            validate_task(bad)
