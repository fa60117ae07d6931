"""File viewer/editor: view, create, str_replace, insert, undo (per-file history).

Paths are as seen inside the sandbox; relative paths resolve against the workdir.
Every failure is an EditorError whose message is meant for the agent to read.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from .errors import ToolError

SNIPPET_CONTEXT = 4
HISTORY_DEPTH = 20
MAX_FILE_BYTES = 8 * 1024 * 1024


class EditorError(ToolError):
    pass


def _numbered(lines: List[str], start: int) -> str:
    return "\n".join("%6d\t%s" % (i, line) for i, line in enumerate(lines, start))


def _split(text: str) -> List[str]:
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


class Editor:
    def __init__(self, workdir: str, max_output: int = 64 * 1024) -> None:
        self.workdir = workdir
        self.max_output = max_output
        # path -> stack of previous contents; None means "the file did not exist".
        self.history: Dict[str, List[Optional[str]]] = {}

    def call(self, args: Dict) -> Tuple[str, bool]:
        """Returns (output, truncated); raises EditorError on bad input."""
        command = args.get("command")
        handlers = {
            "view": self.view, "create": self.create, "str_replace": self.str_replace,
            "insert": self.insert, "undo": self.undo, "undo_edit": self.undo,
        }
        if command not in handlers:
            raise EditorError("unknown editor command %r; use one of: view, create, str_replace, insert, undo" % (command,))
        path = args.get("path")
        if not isinstance(path, str) or not path:
            raise EditorError("'path' (a non-empty string) is required")
        path = os.path.normpath(os.path.join(self.workdir, path))
        return handlers[command](path, args)

    # -- helpers ---------------------------------------------------------------------
    def _read(self, path: str) -> str:
        if not os.path.exists(path):
            raise EditorError("%s does not exist" % path)
        if os.path.isdir(path):
            raise EditorError("%s is a directory" % path)
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise EditorError("%s is %d bytes; the editor handles files up to %d bytes, use bash" % (path, size, MAX_FILE_BYTES))
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data:
            raise EditorError("%s looks like a binary file" % path)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError("%s is not UTF-8 text" % path) from None

    def _write(self, path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    def _remember(self, path: str, previous: Optional[str]) -> None:
        stack = self.history.setdefault(path, [])
        stack.append(previous)
        del stack[:-HISTORY_DEPTH]

    def _cap(self, text: str) -> Tuple[str, bool]:
        data = text.encode("utf-8")
        if len(data) <= self.max_output:
            return text, False
        cut = data[: self.max_output].decode("utf-8", errors="ignore")
        return cut + "\n[... view truncated at %d bytes; use view_range ...]" % self.max_output, True

    def _snippet(self, path: str, text: str, first: int, last: int) -> str:
        lines = _split(text)
        lo = max(1, first - SNIPPET_CONTEXT)
        hi = min(len(lines), last + SNIPPET_CONTEXT)
        return "The file %s has been edited. Here is a snippet (cat -n):\n%s\nReview the change; use undo to revert it." % (
            path, _numbered(lines[lo - 1: hi], lo))

    @staticmethod
    def _str_arg(args: Dict, name: str, required: bool = True, default: str = "") -> str:
        value = args.get(name)
        if value is None:
            if required:
                raise EditorError("'%s' is required for this command" % name)
            return default
        if not isinstance(value, str):
            raise EditorError("'%s' must be a string" % name)
        return value

    # -- commands --------------------------------------------------------------------
    def view(self, path: str, args: Dict) -> Tuple[str, bool]:
        if os.path.isdir(path):
            if args.get("view_range") is not None:
                raise EditorError("view_range is not allowed when viewing a directory")
            out = ["Files and directories up to 2 levels deep in %s (hidden ones skipped):" % path]
            base_depth = path.rstrip("/").count("/")
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                depth = root.rstrip("/").count("/") - base_depth
                if depth >= 2:
                    dirs[:] = []
                for name in sorted(dirs) + sorted(f for f in files if not f.startswith(".")):
                    full = os.path.join(root, name)
                    out.append(full + ("/" if os.path.isdir(full) else ""))
            return self._cap("\n".join(out))
        text = self._read(path)
        lines = _split(text)
        start, end = 1, len(lines)
        rng = args.get("view_range")
        if rng is not None:
            if (not isinstance(rng, (list, tuple)) or len(rng) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng)):
                raise EditorError("view_range must be [start, end] (integers, end -1 = to the end)")
            start, end = rng
            if end == -1:
                end = len(lines)
            if not 1 <= start <= max(1, len(lines)):
                raise EditorError("view_range start %d is outside the file's lines 1..%d" % (start, len(lines)))
            if end < start or end > len(lines):
                raise EditorError("view_range end %d must be in %d..%d (or -1)" % (end, start, len(lines)))
        return self._cap(_numbered(lines[start - 1: end], start))

    def create(self, path: str, args: Dict) -> Tuple[str, bool]:
        text = self._str_arg(args, "file_text")
        previous = self._read(path) if os.path.isfile(path) else None
        if os.path.isdir(path):
            raise EditorError("%s is a directory" % path)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._write(path, text)
        self._remember(path, previous)
        verb = "overwritten" if previous is not None else "created"
        return "File %s %s (%d lines)." % (path, verb, len(_split(text))), False

    def str_replace(self, path: str, args: Dict) -> Tuple[str, bool]:
        old = self._str_arg(args, "old_str")
        new = self._str_arg(args, "new_str", required=False)
        if old == "":
            raise EditorError("old_str must not be empty")
        text = self._read(path)
        count = text.count(old)
        if count == 0:
            raise EditorError("no replacement made: old_str does not appear verbatim in %s" % path)
        if count > 1:
            lines, pos = [], text.find(old)
            while pos != -1:
                lines.append(text.count("\n", 0, pos) + 1)
                pos = text.find(old, pos + 1)
            raise EditorError("no replacement made: old_str occurs %d times in %s (lines %s); include more context to make it unique"
                              % (count, path, ", ".join(map(str, lines))))
        first = text.count("\n", 0, text.find(old)) + 1
        new_text = text.replace(old, new, 1)
        self._write(path, new_text)
        self._remember(path, text)
        return self._snippet(path, new_text, first, first + new.count("\n")), False

    def insert(self, path: str, args: Dict) -> Tuple[str, bool]:
        n = args.get("insert_line")
        if not isinstance(n, int) or isinstance(n, bool):
            raise EditorError("'insert_line' (an integer, 0 = before the first line) is required")
        new = self._str_arg(args, "new_str")
        text = self._read(path)
        lines = _split(text)
        if not 0 <= n <= len(lines):
            raise EditorError("insert_line %d is outside 0..%d" % (n, len(lines)))
        new_lines = _split(new) if new else [""]
        merged = lines[:n] + new_lines + lines[n:]
        new_text = "\n".join(merged) + ("\n" if text.endswith("\n") or not text else "")
        self._write(path, new_text)
        self._remember(path, text)
        return self._snippet(path, new_text, n + 1, n + len(new_lines)), False

    def undo(self, path: str, args: Dict) -> Tuple[str, bool]:
        stack = self.history.get(path)
        if not stack:
            raise EditorError("no edit history for %s" % path)
        previous = stack.pop()
        if previous is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return "Undid the creation of %s (file removed)." % path, False
        self._write(path, previous)
        return "Last edit to %s undone. Current content:\n%s" % (path, self._cap(_numbered(_split(previous), 1))[0]), False
