"""Task definitions of the ``swe`` domain: one JSON file per task in ``tasks/`` and one bug
patch per task in ``patches/``. See README.md in this folder for the format."""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

PKG_DIR = Path(__file__).resolve().parent
TASKS_DIR = PKG_DIR / "tasks"
PATCHES_DIR = PKG_DIR / "patches"

# Bump when the way a repository is built changes (unpacking, patching, git init, ...):
# every cached task is then rebuilt.
BUILD_FORMAT = 1

_TASK_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{2,80}$")
_REQUIRED = {
    "task_id": str,
    "library": str,
    "version": str,
    "sdist": str,
    "sdist_sha256": str,
    "sdist_subdir": str,
    "bug_patch": str,
    "issue": str,
    "FAIL_TO_PASS": list,
    "PASS_TO_PASS": list,
    "test_cmd": list,
    "test_files": list,
    "oracle_fix": list,
    "wrong_fix": list,
    "timeout_s": (int, float),
}


class TaskDefinitionError(ValueError):
    """A task JSON file is malformed."""


class UnknownTask(KeyError):
    pass


def _check_edits(task_id: str, name: str, edits: Any) -> None:
    if not isinstance(edits, list) or not edits:
        raise TaskDefinitionError(f"{task_id}: {name} must be a non-empty list of edits")
    for e in edits:
        if not isinstance(e, dict) or set(e) < {"path", "old", "new"}:
            raise TaskDefinitionError(f"{task_id}: each {name} edit needs path, old and new")
        if not all(isinstance(e[k], str) for k in ("path", "old", "new")) or not e["old"]:
            raise TaskDefinitionError(f"{task_id}: {name} edit fields must be strings, old non-empty")
        if e["old"] == e["new"]:
            raise TaskDefinitionError(f"{task_id}: {name} edit of {e['path']} changes nothing")


def validate_task(task: dict, *, require_tests: bool = True) -> dict:
    """Check a task definition's shape. ``require_tests=False`` is for authoring, before the
    FAIL_TO_PASS / PASS_TO_PASS lists have been computed."""
    tid = task.get("task_id", "<no task_id>")
    for key, typ in _REQUIRED.items():
        if key not in task:
            raise TaskDefinitionError(f"{tid}: missing field {key!r}")
        if not isinstance(task[key], typ):
            raise TaskDefinitionError(f"{tid}: field {key!r} has the wrong type")
    if not _TASK_ID_RE.match(tid):
        raise TaskDefinitionError(f"{tid}: task_id must match {_TASK_ID_RE.pattern}")
    if not re.fullmatch(r"[0-9a-f]{64}", task["sdist_sha256"]):
        raise TaskDefinitionError(f"{tid}: sdist_sha256 must be 64 lowercase hex digits")
    if "/" in task["sdist_subdir"] or task["sdist_subdir"] in ("", ".", ".."):
        raise TaskDefinitionError(f"{tid}: sdist_subdir must be a single directory name")
    cmd = task["test_cmd"]
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise TaskDefinitionError(f"{tid}: test_cmd must be a non-empty argv list of strings")
    if require_tests:
        f2p, p2p = task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
        if not f2p:
            raise TaskDefinitionError(f"{tid}: FAIL_TO_PASS is empty")
        if set(f2p) & set(p2p):
            raise TaskDefinitionError(f"{tid}: a test is in both FAIL_TO_PASS and PASS_TO_PASS")
        if len(set(f2p)) != len(f2p) or len(set(p2p)) != len(p2p):
            raise TaskDefinitionError(f"{tid}: duplicate test ids")
    _check_edits(tid, "oracle_fix", task["oracle_fix"])
    _check_edits(tid, "wrong_fix", task["wrong_fix"])
    if not (PATCHES_DIR / task["bug_patch"]).is_file():
        raise TaskDefinitionError(f"{tid}: bug patch {task['bug_patch']!r} not found in {PATCHES_DIR}")
    if task["timeout_s"] <= 0:
        raise TaskDefinitionError(f"{tid}: timeout_s must be positive")
    return task


def read_task_file(path: Path, *, require_tests: bool = True) -> dict:
    try:
        task = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskDefinitionError(f"{path}: invalid JSON: {exc}") from exc
    if task.get("task_id") != Path(path).stem:
        raise TaskDefinitionError(f"{path}: task_id {task.get('task_id')!r} differs from the file name")
    return validate_task(task, require_tests=require_tests)


@functools.lru_cache(maxsize=1)
def _load_all() -> tuple[dict, ...]:
    return tuple(read_task_file(p) for p in sorted(TASKS_DIR.glob("*.json")))


def load_tasks() -> list[dict]:
    """All task definitions, sorted by task_id (deep copies: callers may mutate them)."""
    return [copy.deepcopy(t) for t in _load_all()]


def task_ids() -> list[str]:
    return [t["task_id"] for t in _load_all()]


def get_task(task_id: str) -> dict:
    for t in _load_all():
        if t["task_id"] == task_id:
            return copy.deepcopy(t)
    raise UnknownTask(f"unknown swe task {task_id!r} (known: {', '.join(task_ids())})")


def read_patch(task: dict) -> str:
    return (PATCHES_DIR / task["bug_patch"]).read_text(encoding="utf-8")


def build_hash(task: dict) -> str:
    """Hash of everything that determines the built repository: the pinned sdist, the subdir,
    the bug patch's content and the build format. Issue text and test lists are not part of
    it (changing them does not require a rebuild)."""
    material = {
        "format": BUILD_FORMAT,
        "library": task["library"],
        "version": task["version"],
        "sdist": task["sdist"],
        "sdist_sha256": task["sdist_sha256"],
        "sdist_subdir": task["sdist_subdir"],
        "bug_patch": read_patch(task),
    }
    blob = json.dumps(material, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()
