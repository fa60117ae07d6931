"""Putting a task's test files back into a repository an agent has shaped, before grading."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from collections.abc import Iterable

from rolloutd.handlers.swe_tasks.build import BuildError, build_task
from rolloutd.handlers.swe_tasks.taskdefs import get_task


def restore_tests(task_id: str, repo_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  also: Iterable[str] = ()) -> list[str]:
    """Put the task's test files (``test_files``, then the paths in ``also``) back to their original
    content in ``repo_dir`` before grading, as SWE-bench does, so an agent cannot pass by editing
    tests. The tree is the agent's: every symlink on the way to or under a restored path is removed
    first and each file is written as a fresh inode, so the write lands in ``repo_dir`` whatever
    stood there (a symlink to a host file, a FIFO, a hard link, a directory). Call it when no agent
    process is alive (after a grade's purge), or one could put a symlink back. Files an agent added
    under a test directory are left alone. Returns the restored paths."""
    task = get_task(task_id)
    src_root = build_task(task_id, cache_dir)
    repo_dir = Path(repo_dir)
    rels = list(task["test_files"]) + [r for r in also if r not in task["test_files"]]
    for rel in rels:
        if not os.path.lexists(src_root / rel):
            raise BuildError(f"{task_id}: test path {rel!r} is not in the built repository")
    _unlink_symlinks(repo_dir, rels)
    for rel in rels:
        _restore_path(src_root / rel, repo_dir / rel)
    return rels


def _unlink_symlinks(root: Path, rels: list[str]) -> None:
    """Remove every symlink on the path to, and under, each ``root/rel`` (no agent process is
    alive by now: the first grade purged, so nothing can put one back)."""
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


def _restore_path(src: Path, dst: Path) -> None:
    """Make ``dst`` a copy of ``src`` (a file, a directory tree or a symlink), replacing whatever
    is there with a fresh inode (never writing through a FIFO, a symlink or a hard link)."""
    if src.is_dir() and not src.is_symlink():
        if dst.is_symlink() or (os.path.lexists(dst) and not dst.is_dir()):
            dst.unlink()
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _restore_path(child, dst / child.name)
        return
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif os.path.lexists(dst):
        dst.unlink()
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)
