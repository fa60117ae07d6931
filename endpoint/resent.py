"""A job's request bodies, decoded without decoding again the history each one resends.

An agent sends its whole history on every call (``messages``, ``input``, ``contents``): at 200
messages a 60-90 KB body, whose ``json.loads`` was 0.3-0.5 ms of the endpoint's ~0.6 ms of
extra work per call. :class:`ResentBodies` keeps the previous body's text and, for its longest
top-level list, where each item ended. When the new body's text is the same up to the end of
item k of that list, the parse state there is the same (JSON is read left to right), so items
0..k-1 are the previous body's objects and only the rest is decoded (the C scanner, item by item).
Any other value under a key (``tools``, ``system``: 10-40 KB that a coding harness resends on
every call) that opens with ``{``, ``[`` or ``"`` and repeats the previous body's value under that
key character for character is the previous body's object too: such a value's text decides where
it ends, so the same text is the same value.

The result, and every error, is what ``json.loads(raw)`` gives: any body the walk does not
expect (not an object, a duplicate key, anything malformed) is handed to ``json.loads`` itself.
Reused items are shared with the previous body: the endpoint never changes a decoded body.
Under a budget of new characters (``decode(raw, new_chars)``: the event loop keeping a request
whose new part is small) the walk raises :class:`Unshared` instead of going past it or handing
the body to ``json.loads``.
"""
from __future__ import annotations

import json
import re
from typing import Any

_WS = re.compile(r"[ \t\n\r]*").match  # JSON's whitespace, as json.decoder's
_SCAN = json.JSONDecoder().raw_decode  # json.loads' own decoder settings (NaN, big ints, strict strings)
# Scanner calls (keys, values, items) in a body, at most (reused items are free): ~1 us each against
# json.loads' ~20 ns for a tiny one, so a 12 MB list of zeros took 4.8 s instead of 0.24
# (measured). Past it, json.loads.
MAX_STEPS = 10_000


class _Malformed(Exception):
    """The walk met something it leaves to ``json.loads`` (which raises the right error, or decodes)."""


class Unshared(Exception):
    """Decoding the body takes more new characters than the caller's budget (or ``json.loads``)."""


class _Kept:
    """One decoded body's longest top-level list: its key, where it opened, its items and the
    offset (in the body's text) where each item ended."""

    __slots__ = ("ends", "items", "key", "start", "text")

    def __init__(self, text: str, key: str, start: int, items: list, ends: list[int]) -> None:
        self.text, self.key, self.start, self.items, self.ends = text, key, start, items, ends

    def shared(self, text: str) -> int:
        """How many leading items ``text`` repeats character for character (with all before them)."""
        ends, mine = self.ends, self.text
        if not ends or not text.startswith(mine[:ends[0]]):
            return 0
        if text.startswith(mine[:ends[-1]]):  # the usual call: all of it, and something appended
            return len(ends)
        lo, hi = 1, len(ends) - 1  # item lo-1 is shared, item hi is not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text.startswith(mine[:ends[mid - 1]]):
                lo = mid
            else:
                hi = mid - 1
        return lo


class ResentBodies:
    """Decodes one job's request bodies in turn (one at a time: the job's endpoint thread).
    ``decode`` then, once the body passed the caller's checks, ``keep``."""

    __slots__ = ("body", "_kept", "_text", "_values", "_pending")

    def __init__(self) -> None:
        self.body: dict | None = None  # the last body kept
        self._kept: _Kept | None = None
        self._text = ""  # the last body kept, as text
        self._values: dict[str, tuple[int, int, Any]] = {}  # key -> (where its value starts and ends in _text, the value)
        self._pending: tuple | None = None

    def decode(self, raw: bytes, new_chars: int | None = None) -> Any:
        """``json.loads(raw)``: the same value, the same errors. ``new_chars``: raise
        :class:`Unshared` instead once more than that many characters that are not the previous
        body's were decoded, or where ``json.loads`` would be called."""
        self._pending = None
        if not isinstance(raw, (bytes, bytearray)):
            if new_chars is not None:
                raise Unshared
            return json.loads(raw)
        try:
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads decodes bytes
            if new_chars is not None and len(text) - len(self._text) > new_chars:
                raise Unshared  # grown by more than that: so much is new at least
            body, kept, values = self._walk(text, new_chars if new_chars is not None else len(text))
        except (_Malformed, ValueError, IndexError, RecursionError):
            if new_chars is not None:
                raise Unshared from None
            return json.loads(raw)
        self._pending = (body, kept, values, text)
        return body

    def keep(self, body: dict) -> None:
        """``body`` (the last decoded) passed the checks: the next body may reuse its items."""
        pending, self._pending = self._pending, None
        self.body = body
        ours = pending is not None and pending[0] is body
        self._kept, self._values, self._text = pending[1:] if ours else (None, {}, "")

    def _walk(self, text: str, left: int) -> tuple[dict, _Kept | None, dict[str, tuple[int, int, Any]]]:
        """The body's object, its longest list that changed and its other values that open
        with ``{``, ``[`` or ``"``; ``left``: new characters it may decode (``Unshared`` past them)."""
        prev, prev_values, prev_text = self._kept, self._values, self._text
        values: dict[str, tuple[int, int, Any]] = {}
        k = prev.shared(text) if prev is not None else 0
        pos = _WS(text, 0).end()
        if text[pos] != "{":
            raise _Malformed
        obj: dict = {}
        best: _Kept | None = None
        steps = 0
        pos = _WS(text, pos + 1).end()
        if text[pos] == "}":
            pos += 1
        else:
            while True:
                steps += 1
                if text[pos] != '"' or steps > MAX_STEPS:
                    raise _Malformed
                key, end = _SCAN(text, pos)
                left -= end - pos
                pos = end
                if key in obj:
                    raise _Malformed  # json.loads keeps the last; not worth a second path
                pos = _WS(text, pos).end()
                if text[pos] != ":":
                    raise _Malformed
                pos = _WS(text, pos + 1).end()
                seen = prev_values.get(key)
                if seen is not None and text.startswith(prev_text[seen[0]:seen[1]], pos):  # the previous body's value
                    value, end = seen[2], pos + seen[1] - seen[0]
                    steps += 1
                elif text[pos] == "[":  # a list that changed (a history grew): item by item
                    reuse = k if k and key == prev.key and pos + 1 == prev.start else 0  # k > 0 only with a prev
                    value, ends, end, steps, left = self._items(text, pos + 1, prev, reuse, steps, left)
                    if best is None or len(ends) > len(best.ends):
                        best = _Kept(text, key, pos + 1, value, ends)
                else:
                    value, end = _SCAN(text, pos)
                    steps += 1
                    left -= end - pos
                if left < 0:
                    raise Unshared
                if text[pos] in '{["':  # a value whose text decides where it ends
                    values[key] = (pos, end, value)
                pos = end
                obj[key] = value
                pos = _WS(text, pos).end()
                c = text[pos]
                pos += 1
                if c == "}":
                    break
                if c != ",":
                    raise _Malformed
                pos = _WS(text, pos).end()
        if _WS(text, pos).end() != len(text):
            raise _Malformed  # "Extra data"
        if best is not None:
            del values[best.key]  # the kept list is reused item by item
        return obj, best, values

    @staticmethod
    def _items(text: str, pos: int, prev: _Kept | None, reuse: int, steps: int,
               left: int) -> tuple[list, list[int], int, int, int]:
        """The list opened just before ``pos``: its items, where each ended, the offset after its
        ``]``, ``steps`` plus the items decoded and ``left`` minus their characters (``Unshared``
        below 0). ``reuse``: leading items that are ``prev``'s, character for character."""
        if reuse:
            items, ends = prev.items[:reuse], prev.ends[:reuse]
            pos = _next_item(text, ends[-1])
        else:
            items, ends = [], []
            pos = _WS(text, pos).end()
            if text[pos] == "]":
                pos = ~(pos + 1)
        while pos >= 0:
            steps += 1
            if steps > MAX_STEPS:
                raise _Malformed  # not a history: json.loads, at its own speed
            value, end = _SCAN(text, pos)
            left -= end - pos
            if left < 0:
                raise Unshared
            items.append(value)
            ends.append(end)
            pos = _next_item(text, end)
        return items, ends, ~pos, steps, left


def _next_item(text: str, end: int) -> int:
    """After a list item that ended at ``end``: where the next item starts, or ``~`` the offset
    after the list's ``]``."""
    pos = _WS(text, end).end()
    c = text[pos]
    if c == "]":
        return ~(pos + 1)
    if c != ",":
        raise _Malformed
    return _WS(text, pos + 1).end()
