"""Parsing per-test outcomes and SWE-bench grading, on synthetic pytest output (no network)."""
from __future__ import annotations

import pytest

from rolloutd.handlers.swe_tasks.grading import EditError, apply_edits, grade, parse_test_output

TASK = {
    "task_id": "demo-task",
    "FAIL_TO_PASS": ["tests/test_a.py::test_fixed", "tests/test_a.py::test_param[a - b]"],
    "PASS_TO_PASS": ["tests/test_a.py::test_ok", "tests/test_a.py::Cls::test_sub",
                     "tests/test_a.py::test_space[x y]"],
}

ALL_PASS = """\
..... [100%]
=========================== short test summary info ============================
PASSED tests/test_a.py::test_fixed
PASSED tests/test_a.py::test_param[a - b]
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::Cls::test_sub
PASSED tests/test_a.py::test_space[x y]
SKIPPED [1] tests/test_a.py:40: needs numpy
5 passed, 1 skipped in 0.10s
"""


def test_all_pass_is_resolved():
    g = grade(TASK, ALL_PASS, 0)
    assert g["resolved"] and g["reward"] == 1.0
    assert g["counts"] == {"f2p_passed": 2, "f2p_total": 2, "p2p_passed": 3, "p2p_total": 3, "parsed": 5}
    assert g["error"] is None


def test_a_failing_fail_to_pass_is_not_resolved():
    out = ALL_PASS.replace("PASSED tests/test_a.py::test_fixed",
                           "FAILED tests/test_a.py::test_fixed - AssertionError: assert 1 == 2")
    g = grade(TASK, out, 1)
    assert not g["resolved"] and g["reward"] == 0.0
    assert g["FAIL_TO_PASS"]["failure"] == ["tests/test_a.py::test_fixed"]
    assert g["PASS_TO_PASS"]["failure"] == []


def test_ids_with_spaces_and_dashes_are_matched_exactly():
    out = ALL_PASS.replace("PASSED tests/test_a.py::test_param[a - b]",
                           "FAILED tests/test_a.py::test_param[a - b] - ValueError: x - y")
    g = grade(TASK, out, 1)
    assert g["FAIL_TO_PASS"]["failure"] == ["tests/test_a.py::test_param[a - b]"]
    assert "tests/test_a.py::test_space[x y]" in g["PASS_TO_PASS"]["success"]


def test_missing_tests_count_as_failed():
    out = ALL_PASS.replace("PASSED tests/test_a.py::test_ok\n", "")
    g = grade(TASK, out, 0)
    assert not g["resolved"]
    assert g["PASS_TO_PASS"]["missing"] == ["tests/test_a.py::test_ok"]


def test_no_outcomes_at_all():
    g = grade(TASK, "ImportError while loading conftest '/x/conftest.py'.\n", 4)
    assert not g["resolved"] and g["counts"]["parsed"] == 0
    assert "no per-test outcomes" in g["error"]


def test_failing_subtest_fails_its_parent_even_if_reported_passed():
    # pytest >= 9 reports the parent PASSED plus one SUBFAILED line per failing subTest
    out = ALL_PASS + "SUBFAILED(n=3, step=7) tests/test_a.py::Cls::test_sub - AssertionError: Lists d...\n"
    g = grade(TASK, out, 1)
    assert g["PASS_TO_PASS"]["failure"] == ["tests/test_a.py::Cls::test_sub"]
    # parameters containing ") " are handled too
    out = ALL_PASS + "SUBFAILED(msg='a) b') tests/test_a.py::Cls::test_sub - boom\n"
    assert not grade(TASK, out, 1)["resolved"]
    # passing subtests change nothing
    out = ALL_PASS + "SUBPASSED(n=1) tests/test_a.py::Cls::test_sub\n"
    assert grade(TASK, out, 0)["resolved"]


def test_error_in_teardown_beats_pass():
    out = ALL_PASS + "ERROR tests/test_a.py::test_ok - RuntimeError: teardown\n"
    g = grade(TASK, out, 1)
    assert g["PASS_TO_PASS"]["failure"] == ["tests/test_a.py::test_ok"]


def test_only_the_last_summary_section_counts():
    # a test printing look-alike lines into captured output does not create passes
    fake = ("=================================== FAILURES ===================================\n"
            "----------------------------- Captured stdout call -----------------------------\n"
            "PASSED tests/test_a.py::test_fixed\n")
    out = fake + ALL_PASS.replace("PASSED tests/test_a.py::test_fixed\n", "")
    g = grade(TASK, out, 1)
    assert g["FAIL_TO_PASS"]["missing"] == ["tests/test_a.py::test_fixed"]
    # no summary at all (pytest crashed, killed by a timeout): nothing passes
    assert parse_test_output("PASSED tests/test_a.py::test_ok\n") == {}


def test_ansi_colors_and_crlf_from_a_pty():
    out = ALL_PASS.replace("\n", "\r\n").replace("PASSED", "\x1b[32mPASSED\x1b[0m")
    assert grade(TASK, out, 0)["resolved"]


def test_parse_without_known_ids():
    out = ("PASSED t.py::fake\n=========== short test summary info ===========\n"
           "PASSED t.py::a\nFAILED t.py::b - assert 0\nERROR t.py::c\nXFAIL t.py::d - reason\n"
           "XPASS t.py::e\nSKIPPED [2] t.py:3: no\nSUBFAILED(i=1) t.py::a - x\n")
    assert parse_test_output(out) == {"t.py::a": "failed", "t.py::b": "failed", "t.py::c": "error",
                                      "t.py::d": "passed", "t.py::e": "failed"}


def test_apply_edits(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\ny = 1\n")
    apply_edits(tmp_path, [{"path": "m.py", "old": "x = 1\n", "new": "x = 2\n"}])
    assert (tmp_path / "m.py").read_text() == "x = 2\ny = 1\n"
    with pytest.raises(EditError, match="found 0 times"):
        apply_edits(tmp_path, [{"path": "m.py", "old": "z = 1", "new": ""}])
    (tmp_path / "m.py").write_text("a\na\n")
    with pytest.raises(EditError, match="found 2 times"):
        apply_edits(tmp_path, [{"path": "m.py", "old": "a", "new": "b"}])
    with pytest.raises(EditError, match="escapes"):
        apply_edits(tmp_path, [{"path": "../m.py", "old": "a", "new": "b"}])
    with pytest.raises(EditError, match="no such file"):
        apply_edits(tmp_path, [{"path": "nope.py", "old": "a", "new": "b"}])
