"""A small, strict, pure-Python unified-diff applier (and the writer the authoring tool uses).

Why not ``patch``/``git apply``: neither is guaranteed on a clean machine or inside a minimal
sandbox image, and both have fuzzy modes that can apply a stale patch "successfully" in the
wrong place. Our bug patches are tiny and written against one pinned sdist, so we want the
opposite: every context and removed line must match exactly (an offset is tolerated, fuzz is
not), or the build fails loudly.

Supported: ``-p1`` style paths (``a/x`` / ``b/x``), several files per diff, several hunks per
file, new files (``--- /dev/null``), deleted files (``+++ /dev/null``) and
``\\ No newline at end of file`` markers. Not supported: binary diffs, renames, mode changes.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """The diff is malformed or does not apply exactly to the tree."""


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]] = field(default_factory=list)  # (tag, text incl. newline)

    def old_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag in (" ", "-")]

    def new_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag in (" ", "+")]


@dataclass
class FilePatch:
    old_path: str | None  # None for a created file
    new_path: str | None  # None for a deleted file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path if self.new_path is not None else self.old_path  # type: ignore[return-value]


def _strip_path(raw: str, strip: int) -> str | None:
    raw = raw.split("\t", 1)[0].strip()
    if raw == "/dev/null":
        return None
    parts = raw.split("/")
    if strip >= len(parts):
        raise PatchError(f"cannot strip {strip} components from {raw!r}")
    rel = "/".join(parts[strip:])
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise PatchError(f"refusing unsafe path in diff: {raw!r}")
    return rel


def parse_unified_diff(text: str, strip: int = 1) -> list[FilePatch]:
    """Parse a unified diff into file patches. Raises PatchError if it is malformed."""
    lines = text.splitlines(keepends=True)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1  # headers such as "diff --git", "index", free text
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: '---' header without a following '+++' header")
        fp = FilePatch(_strip_path(line[4:], strip), _strip_path(lines[i + 1][4:], strip))
        if fp.old_path is None and fp.new_path is None:
            raise PatchError(f"line {i + 1}: both sides are /dev/null")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"line {i + 1}: bad hunk header {lines[i].rstrip()!r}")
            hunk = Hunk(int(m.group(1)), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1))
            i += 1
            old_seen = new_seen = 0
            while i < len(lines) and (old_seen < hunk.old_len or new_seen < hunk.new_len):
                body = lines[i]
                tag = body[:1]
                if body.startswith("\\"):  # "\ No newline at end of file" for the previous line
                    _drop_trailing_newline(hunk)
                    i += 1
                    continue
                if tag not in (" ", "-", "+"):
                    if body in ("\n", "\r\n"):  # an editor stripped the space of an empty context line
                        tag, body = " ", " " + body
                    else:
                        raise PatchError(f"line {i + 1}: unexpected line in hunk: {body.rstrip()!r}")
                hunk.lines.append((tag, body[1:]))
                if tag in (" ", "-"):
                    old_seen += 1
                if tag in (" ", "+"):
                    new_seen += 1
                i += 1
            if old_seen != hunk.old_len or new_seen != hunk.new_len:
                raise PatchError(
                    f"hunk @@ -{hunk.old_start},{hunk.old_len} +{hunk.new_start},{hunk.new_len} @@ "
                    f"of {fp.path} is truncated (saw -{old_seen} +{new_seen})"
                )
            if i < len(lines) and lines[i].startswith("\\"):
                _drop_trailing_newline(hunk)
                i += 1
            fp.hunks.append(hunk)
        if not fp.hunks and fp.old_path is not None and fp.new_path is not None:
            raise PatchError(f"no hunks for {fp.path}")
        patches.append(fp)
    if not patches:
        raise PatchError("no file headers ('--- a/...' / '+++ b/...') found in diff")
    return patches


def _drop_trailing_newline(hunk: Hunk) -> None:
    if hunk.lines:
        tag, text = hunk.lines[-1]
        hunk.lines[-1] = (tag, text[:-1] if text.endswith("\n") else text)


def _find_hunk(src: list[str], old: list[str], expected_at: int, floor: int) -> int:
    """Index where ``old`` matches ``src`` exactly, nearest to ``expected_at`` and not before
    ``floor`` (hunks apply in order). -1 if nowhere."""
    n = len(old)
    if n == 0:
        return max(min(expected_at, len(src)), floor)
    candidates = range(floor, len(src) - n + 1)
    best = -1
    for start in sorted(candidates, key=lambda s: abs(s - expected_at)):
        if src[start:start + n] == old:
            best = start
            break
    return best


def apply_file_patch(original: str | None, fp: FilePatch) -> str | None:
    """Return the patched text of one file (None if the patch deletes it)."""
    if fp.old_path is None:
        if original is not None:
            raise PatchError(f"{fp.path}: diff creates the file but it already exists")
        return "".join(text for h in fp.hunks for text in h.new_lines())
    if original is None:
        raise PatchError(f"{fp.path}: file to patch does not exist")
    src = original.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for h in fp.hunks:
        old = h.old_lines()
        at = _find_hunk(src, old, max(h.old_start - 1, 0), pos)
        if at < 0:
            raise PatchError(
                f"{fp.path}: hunk @@ -{h.old_start},{h.old_len} @@ does not apply "
                f"(context or removed lines differ from the file)"
            )
        out.extend(src[pos:at])
        out.extend(h.new_lines())
        pos = at + len(old)
    out.extend(src[pos:])
    if fp.new_path is None:
        if out:
            raise PatchError(f"{fp.path}: deletion diff leaves content behind")
        return None
    return "".join(out)


def apply_unified_diff(root: Path, diff_text: str, strip: int = 1) -> list[str]:
    """Apply ``diff_text`` to the tree at ``root``; all-or-nothing. Returns the touched paths."""
    root = Path(root)
    patches = parse_unified_diff(diff_text, strip)
    results: list[tuple[Path, str | None]] = []
    for fp in patches:
        target = root / fp.path
        original = target.read_text(encoding="utf-8") if target.exists() else None
        if fp.old_path is not None and fp.new_path is not None and fp.old_path != fp.new_path:
            raise PatchError(f"renames are not supported ({fp.old_path} -> {fp.new_path})")
        results.append((target, apply_file_patch(original, fp)))
    for target, text in results:  # every hunk matched: now write
        if text is None:
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
    return [fp.path for fp in patches]


def make_unified_diff(path: str, before: str, after: str, context: int = 3) -> str:
    """A ``-p1`` unified diff of one file, as ``apply_unified_diff`` expects it."""
    a = before.splitlines(keepends=True)
    b = after.splitlines(keepends=True)
    out = []
    for line in difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=context):
        out.append(line)
        if not line.endswith("\n"):
            out.append("\n\\ No newline at end of file\n")
    return "".join(out)
