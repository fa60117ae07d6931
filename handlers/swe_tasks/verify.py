"""Prove each task is well-formed by running its tests three ways on this host:

1. the buggy repository: every FAIL_TO_PASS test fails, every PASS_TO_PASS test passes;
2. after ``oracle_fix``: the run grades ``resolved`` (and the edited files equal the
   pristine sdist's: the oracle fix is exactly the reverse of the bug patch);
3. after ``wrong_fix``: the run does not grade ``resolved``.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import structlog

from rolloutd.handlers.swe_tasks.build import build_all, copy_repo, pristine_tree
from rolloutd.handlers.swe_tasks.grading import apply_edits, grade, run_tests
from rolloutd.handlers.swe_tasks.taskdefs import get_task
from rolloutd.handlers.swe_tasks.taskdefs import task_ids as all_task_ids

log = structlog.get_logger("rolloutd.swe_tasks")


def verify_task(task_id: str, cache_dir: str | os.PathLike | None = None, *,
                python: str | None = None) -> dict:
    task = get_task(task_id)
    python = python or sys.executable
    problems: list[str] = []
    t0 = time.monotonic()
    report: dict = {"task_id": task_id, "f2p_total": len(task["FAIL_TO_PASS"]),
                    "p2p_total": len(task["PASS_TO_PASS"])}
    with tempfile.TemporaryDirectory(prefix=f"swe-verify-{task_id}-") as tmp:
        tmp = Path(tmp)
        # 1. buggy
        buggy = copy_repo(task_id, tmp / "buggy", cache_dir)
        out, rc = run_tests(task, buggy, python=python)
        g = grade(task, out, rc)
        report["buggy"] = {"f2p_failing": len(g["FAIL_TO_PASS"]["failure"]),
                           "p2p_passing": len(g["PASS_TO_PASS"]["success"]), "exit_code": rc}
        if g["FAIL_TO_PASS"]["success"]:
            problems.append(f"buggy: FAIL_TO_PASS tests pass: {g['FAIL_TO_PASS']['success'][:5]}")
        if g["PASS_TO_PASS"]["failure"]:
            problems.append(f"buggy: PASS_TO_PASS tests fail: {g['PASS_TO_PASS']['failure'][:5]}")
        if g["resolved"]:
            problems.append("buggy: graded resolved")
        if g["error"]:
            problems.append(f"buggy: {g['error']}; output tail: {out[-1500:]!r}")

        # 2. oracle fix
        fixed = copy_repo(task_id, tmp / "oracle", cache_dir)
        touched = apply_edits(fixed, task["oracle_fix"])
        out, rc = run_tests(task, fixed, python=python)
        g = grade(task, out, rc)
        report["oracle_resolved"] = g["resolved"]
        if not g["resolved"]:
            problems.append(f"oracle: not resolved (F2P failing {g['FAIL_TO_PASS']['failure'][:5]}, "
                            f"P2P failing {g['PASS_TO_PASS']['failure'][:5]}, exit {rc})")
        pristine = pristine_tree(task, tmp / "pristine", cache_dir)
        for rel in touched:
            if (fixed / rel).read_bytes() != (pristine / rel).read_bytes():
                problems.append(f"oracle: {rel} after oracle_fix differs from the pristine sdist")

        # 3. wrong fix
        wrong = copy_repo(task_id, tmp / "wrong", cache_dir)
        apply_edits(wrong, task["wrong_fix"])
        out, rc = run_tests(task, wrong, python=python)
        g = grade(task, out, rc)
        report["wrong_resolved"] = g["resolved"]
        if g["resolved"]:
            problems.append("wrong: wrong_fix graded resolved")
    report["problems"] = problems
    report["ok"] = not problems
    report["seconds"] = time.monotonic() - t0
    log.info("task_verified", task_id=task_id, ok=report["ok"], seconds=round(report["seconds"], 2),
             problems=problems or None)
    return report


def verify_all(cache_dir: str | os.PathLike | None = None, *, task_ids: Iterable[str] | None = None,
               python: str | None = None, jobs: int = 2) -> list[dict]:
    ids = list(task_ids) if task_ids else all_task_ids()
    build_all(cache_dir, task_ids=ids)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda t: verify_task(t, cache_dir, python=python), ids))
