"""File viewer/editor: view, create, str_replace, insert, undo (per-file history).

Paths are as seen inside the sandbox; relative paths resolve against the workdir.
Every failure is an EditorError whose message is meant for the agent to read.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Tuple

from .errors import ToolError
from .files import open_regular

SNIPPET_CONTEXT = 4
HISTORY_DEPTH = 20
MAX_FILE_BYTES = 8 * 1024 * 1024
# Undo history of every file together, in bytes of the kept texts: the oldest edits go first.
HISTORY_BYTES = 64 * 1024 * 1024
# Directory entries one listing reads, over all its directories (a directory of millions of
# files would otherwise be read, sorted and joined in the tool server).
MAX_LIST_ENTRIES = 10000


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


def _cost(text: Optional[str]) -> int:
    return 0 if text is None else sys.getsizeof(text)


def _entries(d: str, budget: List[int]) -> Tuple[List[str], List[str], List[str]]:
    """(dirs, files, dirs to descend into) of d, sorted, hidden ones skipped; reads at most
    budget[0] entries (and spends them)."""
    dirs, files, walk = [], [], []
    try:
        it = os.scandir(d)
    except OSError:
        return dirs, files, walk
    with it:
        for e in it:
            if budget[0] <= 0:
                budget[1] = 1  # more entries than were read
                break
            budget[0] -= 1
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(e.name)
            if is_dir and not e.is_symlink():
                walk.append(e.name)
    return sorted(dirs), sorted(files), sorted(walk)


def _listing(path: str) -> str:
    """Two levels under path (and the files of the third, as os.walk with its dirs cleared at
    depth 2 showed them), at most MAX_LIST_ENTRIES entries read."""
    budget = [MAX_LIST_ENTRIES, 0]
    out: List[str] = []

    def walk(d: str, depth: int) -> None:
        dirs, files, sub = _entries(d, budget)
        if depth >= 2:
            dirs, sub = [], []
        for name in dirs + files:
            full = os.path.join(d, name)
            out.append(full + ("/" if name in dirs else ""))
        for name in sub:
            if name in dirs:
                walk(os.path.join(d, name), depth + 1)

    walk(path, 0)
    head = ["Files and directories up to 2 levels deep in %s (hidden ones skipped):" % path]
    if budget[1]:
        head.append("[more entries than the %d a listing reads: the rest are not listed; use bash (ls, find)]"
                    % MAX_LIST_ENTRIES)
    return "\n".join(head + out)


class Editor:
    def __init__(self, workdir: str, max_output: int = 64 * 1024) -> None:
        self.workdir = workdir
        self.max_output = max_output
        # path -> stack of (seq, previous content); None means "the file did not exist".
        self.history: Dict[str, List[Tuple[int, Optional[str]]]] = {}
        self.history_bytes = 0
        self._seq = 0

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
        fd = open_regular(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # the file may grow after any size check
        if len(data) > MAX_FILE_BYTES:
            raise EditorError("%s is over %d bytes; the editor handles files up to %d bytes, use bash"
                              % (path, MAX_FILE_BYTES, MAX_FILE_BYTES))
        if b"\0" in data:
            raise EditorError("%s looks like a binary file" % path)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError("%s is not UTF-8 text" % path) from None

    def _write(self, path: str, text: str) -> None:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT)
        os.ftruncate(fd, 0)  # only now: the type is known
        with open(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    def _remember(self, path: str, previous: Optional[str]) -> None:
        stack = self.history.setdefault(path, [])
        self._seq += 1
        stack.append((self._seq, previous))
        self.history_bytes += _cost(previous)
        while len(stack) > HISTORY_DEPTH:
            self.history_bytes -= _cost(stack.pop(0)[1])
        while self.history_bytes > HISTORY_BYTES:  # the oldest edit of any file goes first
            oldest = min((st for st in self.history.values() if st), key=lambda st: st[0][0])
            self.history_bytes -= _cost(oldest.pop(0)[1])

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
            return self._cap(_listing(path))
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
        previous = self._read(path) if os.path.exists(path) else None  # refuses dirs, FIFOs, devices
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
            raise EditorError("no edit history for %s (the editor keeps the last %d edits of a file, %d MiB in all)"
                              % (path, HISTORY_DEPTH, HISTORY_BYTES >> 20))
        previous = stack.pop()[1]
        self.history_bytes -= _cost(previous)
        if previous is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return "Undid the creation of %s (file removed)." % path, False
        self._write(path, previous)
        return "Last edit to %s undone. Current content:\n%s" % (path, self._cap(_numbered(_split(previous), 1))[0]), False
