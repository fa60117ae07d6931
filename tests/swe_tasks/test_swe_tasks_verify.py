"""Every task, for real: with the bug, FAIL_TO_PASS fail and PASS_TO_PASS pass; after the
oracle fix the run grades resolved (and equals the pristine sdist); after the wrong fix it
does not. The library test suites run with this interpreter (pytest installed here)."""
from __future__ import annotations

import sys

import pytest

from rolloutd.handlers.swe_tasks import copy_repo, get_task, grade, run_tests, task_ids
from rolloutd.handlers.swe_tasks.verify import verify_all

IDS = task_ids()


@pytest.fixture(scope="session")
def reports(swe_cache):
    # two tasks at a time: the machine has two cores
    return {r["task_id"]: r for r in verify_all(swe_cache, python=sys.executable, jobs=2)}


@pytest.mark.parametrize("task_id", IDS)
def test_task_verifies(reports, task_id):
    r = reports[task_id]
    assert r["problems"] == []
    assert r["buggy"]["f2p_failing"] == r["f2p_total"] > 0
    assert r["buggy"]["p2p_passing"] == r["p2p_total"]
    assert r["oracle_resolved"] is True
    assert r["wrong_resolved"] is False


def test_agent_editing_tests_does_not_help(swe_cache, tmp_path):
    """Deleting the failing test makes it missing, which grades as failed."""
    task = get_task("boltons-parse-int-list-range")
    ws = copy_repo(task["task_id"], tmp_path / "ws", swe_cache)
    test_file = ws / "tests/test_strutils.py"
    test_file.write_text(test_file.read_text().replace("def test_parse_int_list", "def _disabled"))
    out, rc = run_tests(task, ws)
    g = grade(task, out, rc)
    assert not g["resolved"]
    assert g["FAIL_TO_PASS"]["missing"] == task["FAIL_TO_PASS"]


def test_timeout_is_reported_not_raised(swe_cache, tmp_path):
    task = get_task("inflection-ordinal-teens")
    ws = copy_repo(task["task_id"], tmp_path / "ws", swe_cache)
    (ws / "conftest.py").write_text("import time\ntime.sleep(30)\n")
    out, rc = run_tests(task, ws, timeout_s=2)
    assert rc == 124 and "timed out" in out
    assert not grade(task, out, rc)["resolved"]
