"""The editor tool: unit tests on the Editor class, plus the same through the server."""
import pytest

from rolloutd.sandbox.toolserver.editor import Editor, EditorError


@pytest.fixture
def ed(tmp_path):
    return Editor(str(tmp_path))


def test_create_view_with_ranges(ed, tmp_path):
    out, _ = ed.call({"command": "create", "path": "pkg/a.py", "file_text": "one\ntwo\nthree\nfour\n"})
    assert "created" in out
    assert (tmp_path / "pkg/a.py").read_text() == "one\ntwo\nthree\nfour\n"
    out, _ = ed.call({"command": "view", "path": "pkg/a.py"})
    assert out == "     1\tone\n     2\ttwo\n     3\tthree\n     4\tfour"
    out, _ = ed.call({"command": "view", "path": str(tmp_path / "pkg/a.py"), "view_range": [2, 3]})
    assert out == "     2\ttwo\n     3\tthree"
    out, _ = ed.call({"command": "view", "path": "pkg/a.py", "view_range": [3, -1]})
    assert out == "     3\tthree\n     4\tfour"
    with pytest.raises(EditorError, match="end 9"):
        ed.call({"command": "view", "path": "pkg/a.py", "view_range": [1, 9]})
    with pytest.raises(EditorError, match="view_range must be"):
        ed.call({"command": "view", "path": "pkg/a.py", "view_range": "1-2"})


def test_view_directory_two_levels(ed, tmp_path):
    (tmp_path / "d/e/f").mkdir(parents=True)
    (tmp_path / "d/e/f/deep.txt").write_text("x")
    (tmp_path / "d/top.txt").write_text("x")
    (tmp_path / ".hidden").write_text("x")
    out, _ = ed.call({"command": "view", "path": "."})
    assert "d/top.txt" in out and "d/e/" in out
    assert "deep.txt" not in out and ".hidden" not in out


def test_str_replace_unique_and_errors(ed, tmp_path):
    p = tmp_path / "f.txt"
    p.write_text("a = 1\nb = 1\nc = 2\n")
    with pytest.raises(EditorError, match=r"occurs 2 times .*lines 1, 2"):
        ed.call({"command": "str_replace", "path": "f.txt", "old_str": "= 1", "new_str": "= 9"})
    with pytest.raises(EditorError, match="does not appear verbatim"):
        ed.call({"command": "str_replace", "path": "f.txt", "old_str": "zzz", "new_str": ""})
    assert p.read_text() == "a = 1\nb = 1\nc = 2\n"  # failed edits change nothing
    out, _ = ed.call({"command": "str_replace", "path": "f.txt", "old_str": "b = 1", "new_str": "b = 10\nb2 = 11"})
    assert p.read_text() == "a = 1\nb = 10\nb2 = 11\nc = 2\n"
    assert "     2\tb = 10" in out and "     3\tb2 = 11" in out


def test_insert_and_undo_history(ed, tmp_path):
    p = tmp_path / "g.txt"
    ed.call({"command": "create", "path": "g.txt", "file_text": "l1\nl2\n"})
    ed.call({"command": "insert", "path": "g.txt", "insert_line": 1, "new_str": "mid"})
    assert p.read_text() == "l1\nmid\nl2\n"
    ed.call({"command": "insert", "path": "g.txt", "insert_line": 0, "new_str": "first"})
    assert p.read_text() == "first\nl1\nmid\nl2\n"
    ed.call({"command": "str_replace", "path": "g.txt", "old_str": "mid", "new_str": "MID"})
    ed.call({"command": "undo", "path": "g.txt"})
    assert p.read_text() == "first\nl1\nmid\nl2\n"
    ed.call({"command": "undo_edit", "path": "g.txt"})
    assert p.read_text() == "l1\nmid\nl2\n"
    ed.call({"command": "undo", "path": "g.txt"})
    assert p.read_text() == "l1\nl2\n"
    ed.call({"command": "undo", "path": "g.txt"})  # undo the creation
    assert not p.exists()
    with pytest.raises(EditorError, match="no edit history"):
        ed.call({"command": "undo", "path": "g.txt"})
    ed.call({"command": "create", "path": "h.txt", "file_text": ""})
    with pytest.raises(EditorError, match="outside 0..0"):
        ed.call({"command": "insert", "path": "h.txt", "insert_line": 3, "new_str": "x"})


def test_overwrite_is_undoable_and_crlf_preserved(ed, tmp_path):
    p = tmp_path / "w.txt"
    p.write_bytes(b"x\r\ny\r\n")
    ed.call({"command": "str_replace", "path": "w.txt", "old_str": "y", "new_str": "z"})
    assert p.read_bytes() == b"x\r\nz\r\n"
    ed.call({"command": "create", "path": "w.txt", "file_text": "new"})
    ed.call({"command": "undo", "path": "w.txt"})
    assert p.read_bytes() == b"x\r\nz\r\n"


@pytest.mark.parametrize("args,match", [
    ({"command": "explode", "path": "x"}, "unknown editor command"),
    ({"command": "view"}, "'path'"),
    ({"command": "view", "path": "missing.txt"}, "does not exist"),
    ({"command": "create", "path": "x.txt"}, "'file_text'"),
    ({"command": "str_replace", "path": "x.txt", "old_str": 3}, "must be a string"),
    ({"command": "insert", "path": "x.txt", "new_str": "a"}, "insert_line"),
])
def test_bad_input(ed, args, match):
    with pytest.raises(EditorError, match=match):
        ed.call(args)


def test_binary_file_rejected(ed, tmp_path):
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    with pytest.raises(EditorError, match="binary"):
        ed.call({"command": "view", "path": "b.bin"})


def test_editor_through_server(tool_env):
    _, h, c = tool_env
    r = c.call("editor", {"command": "create", "path": "/workspace/e.py", "file_text": "v = 1\nv = 1\n"})
    assert r.exit_code == 0 and r.error is None
    r = c.call("editor", {"command": "str_replace", "path": "e.py", "old_str": "v = 1", "new_str": "v = 2"})
    assert r.error and "occurs 2 times" in r.error and r.exit_code == 1
    r = c.call("editor", {"command": "view", "path": "/workspace/e.py", "view_range": [1, 1]})
    assert r.output == "     1\tv = 1"
    r = c.call("editor", {"command": "view", "path": "/nonexistent/file"})
    assert r.error and "does not exist" in r.error
    assert c.call("bash", {"command": "cat /workspace/e.py"}).output == "v = 1\nv = 1\n"
