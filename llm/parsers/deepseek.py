"""DeepSeek-V3.1 (and V3 / R1-0528) tool calls and reasoning.

V3.1::

    REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

V3 / R1-0528 write ``function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```\\n`` inside a call; both are
accepted. In thinking mode the generation prompt ends with ``<think>``, so the sampled
text is ``REASONING</think>...``; in non-thinking mode it ends with ``</think>`` and
there is no reasoning.
"""

from __future__ import annotations

import json
import re

from ..toolparse import (
    ParseResult,
    ToolCall,
    ToolParser,
    _snippet,
    split_reasoning,
    strip_suffixes,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"
FORMAT_HINT = f"Expected format: {CALLS_BEGIN}{CALL_BEGIN}NAME{SEP}{{args-json-object}}{CALL_END}{CALLS_END}"
_V3 = re.compile(r"^function\s*$")
_FENCE = re.compile(r"^(.*?)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)


class DeepSeekParser(ToolParser):
    name = "deepseek_v31"
    sets_content = True
    skip_special_tokens = False

    def __init__(self, max_calls: int = 32) -> None:
        self.max_calls = max_calls

    def _error(self, res: ParseResult, idx: int, msg: str) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {FORMAT_HINT}")

    def parse(self, text: str) -> ParseResult:
        text = strip_suffixes(text, (EOS,))
        reasoning, rest, closed = split_reasoning(text, "<think>", "</think>")
        res = ParseResult(reasoning=reasoning)
        if not closed:
            return res
        i = rest.find(CALLS_BEGIN)
        j = rest.find(CALL_BEGIN)
        start = i if i >= 0 else j
        res.content = (rest if start < 0 else rest[:start]).strip() or None
        if start < 0:
            return res
        section = rest[start:]
        section = section.removeprefix(CALLS_BEGIN)
        e = section.find(CALLS_END)
        if e >= 0:
            section = section[:e]
        n = 0
        pos = 0
        while True:
            s = section.find(CALL_BEGIN, pos)
            if s < 0:
                if section[pos:].strip():
                    self._error(res, n, f"text outside {CALL_BEGIN}...{CALL_END}: {_snippet(section[pos:])!r}")
                break
            if n >= self.max_calls:
                self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored")
                break
            ce = section.find(CALL_END, s)
            nxt = section.find(CALL_BEGIN, s + len(CALL_BEGIN))
            if ce < 0 or 0 <= nxt < ce:
                self._error(res, n, f"unterminated call (missing {CALL_END})")
                n += 1
                if nxt < 0:
                    break
                pos = nxt
                continue
            self._one(res, n, section[s + len(CALL_BEGIN) : ce], section[s : ce + len(CALL_END)])
            n += 1
            pos = ce + len(CALL_END)
        return res

    def _one(self, res: ParseResult, idx: int, body: str, raw: str) -> None:
        if SEP not in body:
            self._error(res, idx, f"no {SEP} between the name and the arguments: {_snippet(body)!r}")
            return
        name, _, args_text = body.partition(SEP)
        if _V3.match(name):  # V3: function<sep>NAME\n```json\nARGS\n```
            m = _FENCE.match(args_text)
            if m is None:
                self._error(res, idx, f"V3 call without a ```json block: {_snippet(args_text)!r}")
                return
            name, args_text = m.group(1), m.group(2)
        name = name.strip()
        if not name:
            self._error(res, idx, "empty function name")
            return
        try:
            args = json.loads(args_text) if args_text.strip() else {}
        except json.JSONDecodeError as e:
            self._error(res, idx, f"invalid JSON arguments for {name} ({e.msg} at column {e.colno}): {_snippet(args_text)!r}")
            return
        if not isinstance(args, dict):
            self._error(res, idx, f"arguments for {name} must be a JSON object, got {type(args).__name__}")
            return
        res.call(ToolCall(name=name, arguments=args, id=f"call_{idx}", raw=raw))
