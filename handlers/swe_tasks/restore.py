"""Putting a task's test tree back into a repository an agent has shaped, before grading."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from rolloutd.handlers.pytest_grader import restore_paths
from rolloutd.handlers.swe_tasks.build import BuildError, build_task
from rolloutd.handlers.swe_tasks.taskdefs import get_task


def restored_tree(task: dict, src_root: str | os.PathLike) -> list[str]:
    """The paths a grade restores whole: each test path that is a directory, and for a test file
    the directory holding it (its ``__init__.py``, helpers and siblings: pytest imports them), or the
    file alone when it sits at the repository root (its directory is the library's)."""
    out: list[str] = []
    for rel in task["test_files"]:
        parent = os.path.dirname(rel.rstrip("/"))
        tree = rel.rstrip("/") if (Path(src_root) / rel).is_dir() or not parent else parent
        if tree not in out and not any(tree.startswith(t + "/") for t in out):
            out = [t for t in out if not t.startswith(tree + "/")] + [tree]
    return out


def restore_tests(task_id: str, repo_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  also: Iterable[str] = ()) -> list[str]:
    """Put the task's test tree (``restored_tree``) and the paths in ``also`` back to their original
    content in ``repo_dir`` before grading, as SWE-bench does, so an agent cannot pass by editing
    tests: directories whole (a file the agent added there, a patched ``__init__.py``, is gone),
    each a fresh copy whatever stood there (pytest_grader.restore_paths). Call it when no agent
    process is alive (after a grade's purge). Returns the restored paths."""
    task = get_task(task_id)
    src_root = build_task(task_id, cache_dir)
    tree = restored_tree(task, src_root)
    rels = tree + [r for r in also if r not in tree and not any(r.startswith(t + "/") for t in tree)]
    for rel in rels:
        if not os.path.lexists(src_root / rel):
            raise BuildError(f"{task_id}: test path {rel!r} is not in the built repository")
    return restore_paths(src_root, repo_dir, rels)
