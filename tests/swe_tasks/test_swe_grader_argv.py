"""The swe grader's pinned pytest (handlers/pytest_grader.py: rootdir, ini file, no addopts, no
cache, no plugin autoload) grades every task as its own configuration does: each task resolves
with its oracle fix, and its restored test tree holds no file of that fix (restoring the tree must
never undo the agent's work). Run on the host with the grader's exact argv and environment."""
from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from rolloutd.handlers import pytest_grader
from rolloutd.handlers.swe import grader_argv
from rolloutd.handlers.swe_tasks import apply_edits, copy_repo, get_task, grade, task_ids
from rolloutd.handlers.swe_tasks.restore import restored_tree


@pytest.mark.parametrize("task_id", sorted(task_ids()))
def test_every_task_resolves_with_its_fix_under_the_pinned_grader(swe_cache, tmp_path, task_id):
    task = get_task(task_id)
    src = swe_cache / "repos" / task_id
    tree = restored_tree(task, src)
    fixed = {e["path"] for e in task["oracle_fix"]}
    assert not [p for p in fixed for t in tree if p == t or p.startswith(t + "/")], (tree, fixed)
    ws = copy_repo(task_id, tmp_path / "ws", swe_cache)
    apply_edits(ws, task["oracle_fix"])
    (ws / "pytest.ini").write_text("[pytest]\naddopts = -p no_such_plugin\npython_files = nothing_*.py\n")
    config = pytest_grader.pin_config(ws, pytest_grader.config_of(src))
    end = "END-" + secrets.token_hex(8)
    argv = grader_argv(task, str(ws), config)
    argv[0] = sys.executable  # the host has pytest itself; in the sandbox PYTHONPATH brings it
    p = subprocess.run(argv, cwd=ws, env=pytest_grader.env({"runtime": "local"}, end), capture_output=True,
                       text=True, timeout=600)
    out, status = pytest_grader.split_at_end(p.stdout + p.stderr, end)
    result = grade(task, out, p.returncode)
    assert result["resolved"] and status == 0 == p.returncode, (result["counts"], (p.stdout + p.stderr)[-3000:])
