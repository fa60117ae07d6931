"""The pure-Python unified-diff applier (no network)."""
from __future__ import annotations

import pytest

from rolloutd.handlers.swe_tasks.patching import PatchError, apply_unified_diff, make_unified_diff, parse_unified_diff

BEFORE = "".join(f"line {i}\n" for i in range(1, 21))


def _write(tmp_path, rel, text):
    p = tmp_path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_roundtrip_with_make_unified_diff(tmp_path):
    after = BEFORE.replace("line 5\n", "line five\n").replace("line 17\n", "")
    p = _write(tmp_path, "pkg/mod.py", BEFORE)
    diff = make_unified_diff("pkg/mod.py", BEFORE, after)
    assert diff.startswith("--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ ")
    assert apply_unified_diff(tmp_path, diff) == ["pkg/mod.py"]
    assert p.read_text() == after


def test_offset_is_tolerated_but_not_fuzz(tmp_path):
    after = BEFORE.replace("line 10\n", "line ten\n")
    diff = make_unified_diff("m.py", BEFORE, after)
    p = _write(tmp_path, "m.py", "new header\n" * 3 + BEFORE)  # hunk now 3 lines lower
    apply_unified_diff(tmp_path, diff)
    assert p.read_text() == "new header\n" * 3 + after
    _write(tmp_path, "m.py", BEFORE.replace("line 9\n", "line nine\n"))  # context differs
    with pytest.raises(PatchError, match="does not apply"):
        apply_unified_diff(tmp_path, diff)


def test_all_or_nothing_across_files(tmp_path):
    a = _write(tmp_path, "a.py", BEFORE)
    _write(tmp_path, "b.py", "something else\n")
    diff = make_unified_diff("a.py", BEFORE, BEFORE.replace("line 1\n", "x\n")) + \
        make_unified_diff("b.py", BEFORE, BEFORE.replace("line 2\n", "y\n"))
    with pytest.raises(PatchError):
        apply_unified_diff(tmp_path, diff)
    assert a.read_text() == BEFORE  # a.py untouched: b.py's hunk failed first


def test_no_newline_at_end_of_file(tmp_path):
    before, after = "a\nb\nc", "a\nB\nc"
    p = _write(tmp_path, "f.txt", before)
    diff = make_unified_diff("f.txt", before, after)
    assert "\\ No newline at end of file" in diff
    apply_unified_diff(tmp_path, diff)
    assert p.read_text() == after


def test_create_and_delete_files(tmp_path):
    _write(tmp_path, "old.txt", "bye\n")
    diff = ("--- /dev/null\n+++ b/new/dir/new.txt\n@@ -0,0 +1,2 @@\n+hello\n+world\n"
            "--- a/old.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n")
    apply_unified_diff(tmp_path, diff)
    assert (tmp_path / "new/dir/new.txt").read_text() == "hello\nworld\n"
    assert not (tmp_path / "old.txt").exists()


@pytest.mark.parametrize("bad", [
    "",
    "just text\n",
    "--- a/x\n@@ -1 +1 @@\n-a\n+b\n",                      # no +++ header
    "--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-a\n+b\n",          # truncated hunk
    "--- a/../evil\n+++ b/../evil\n@@ -1 +1 @@\n-a\n+b\n",  # path traversal
    "--- a/x\n+++ b/x\n@@ garbage @@\n",
])
def test_malformed_diffs_are_rejected(bad):
    with pytest.raises(PatchError):
        parse_unified_diff(bad)


def test_missing_target_file(tmp_path):
    with pytest.raises(PatchError, match="does not exist"):
        apply_unified_diff(tmp_path, make_unified_diff("nope.py", "a\n", "b\n"))
