"""Mistral ``[TOOL_CALLS]``, both generations of the format:

* tokenizer v2-v7 (Mistral-Nemo, Large 2, Small 3, the tekken/SentencePiece v3 and v7
  instruct formats of ``mistral-common``): ``[TOOL_CALLS][{"name": N, "arguments": {...},
  "id": "abcDEF123"}, ...]``;
* tokenizer v11+ (Magistral, Devstral, Small 3.2): ``[TOOL_CALLS]N[ARGS]{...}`` per call,
  optionally ``[TOOL_CALLS]N[CALL_ID]id[ARGS]{...}``.

Mistral identifies tool results by the call id (9 letters or digits). The model writes
it; a call without one gets a deterministic id derived from its position and text, so a
rollout replays identically. Text before the first ``[TOOL_CALLS]`` is the content.
"""

from __future__ import annotations

import hashlib
import json
import re

from ..toolparse import ParseResult, ToolCall, ToolParser, _snippet, strip_suffixes

FORMAT_HINT = 'Expected format: [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
FORMAT_HINT_V11 = "Expected format: [TOOL_CALLS]<function-name>[ARGS]<args-json-object>"
_ID = re.compile(r"^[A-Za-z0-9]{9}$")
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def call_id(idx: int, raw: str) -> str:
    h = hashlib.sha256(f"{idx}:{raw}".encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in h[:9])


class MistralParser(ToolParser):
    name = "mistral"
    sets_content = True
    skip_special_tokens = False  # [TOOL_CALLS] is a control token

    def __init__(self, max_calls: int = 32) -> None:
        self.max_calls = max_calls

    def _error(self, res: ParseResult, idx: int, msg: str, hint: str = FORMAT_HINT) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {hint}")

    def parse(self, text: str) -> ParseResult:
        text = strip_suffixes(text, ("</s>",))
        res = ParseResult()
        i = text.find("[TOOL_CALLS]")
        res.content = (text if i < 0 else text[:i]).strip() or None
        if i < 0:
            return res
        blocks = text[i:].split("[TOOL_CALLS]")[1:]
        n = 0
        for block in blocks:
            b = block.strip()
            if b.startswith("["):  # v2-v7: a JSON list of calls
                try:
                    obj, end = json.JSONDecoder().raw_decode(b)
                except json.JSONDecodeError as e:
                    self._error(res, n, f"invalid JSON after [TOOL_CALLS] ({e.msg} at column {e.colno}): {_snippet(b)!r}")
                    n += 1
                    continue
                if b[end:].strip():
                    self._error(res, n, f"text after the call list: {_snippet(b[end:], 40)!r}")
                    n += 1
                    continue
                for item in obj:
                    n = self._one(res, n, item, json.dumps(item, ensure_ascii=False))
            else:
                n = self._v11(res, n, block)
        return res

    def _v11(self, res: ParseResult, n: int, block: str) -> int:
        if "[ARGS]" not in block:
            self._error(res, n, f"expected [{{...}}] or NAME[ARGS]{{...}} after [TOOL_CALLS], got {_snippet(block)!r}")
            return n + 1
        head, _, args = block.partition("[ARGS]")
        name, _, cid = head.partition("[CALL_ID]")
        try:
            obj = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            self._error(res, n, f"invalid JSON arguments of {name.strip()!r} ({e.msg})", FORMAT_HINT_V11)
            return n + 1
        item = {"name": name.strip(), "arguments": obj}
        if cid.strip():
            item["id"] = cid.strip()
        return self._one(res, n, item, "[TOOL_CALLS]" + block, FORMAT_HINT_V11)

    def _one(self, res: ParseResult, n: int, item: object, raw: str, hint: str = FORMAT_HINT) -> int:
        if n >= self.max_calls:
            if n == self.max_calls:
                self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored", hint)
            return n + 1
        if not isinstance(item, dict):
            self._error(res, n, f"each call must be a JSON object, got {type(item).__name__}", hint)
            return n + 1
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            self._error(res, n, 'missing or empty "name"', hint)
            return n + 1
        args = item.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                self._error(res, n, f'"arguments" is a string that is not valid JSON ({e.msg})', hint)
                return n + 1
        if args is None:
            args = {}
        if not isinstance(args, dict):
            self._error(res, n, f'"arguments" must be a JSON object, got {type(args).__name__}', hint)
            return n + 1
        cid = item.get("id")
        if not (isinstance(cid, str) and _ID.match(cid)):
            cid = call_id(n, raw)
        res.call(ToolCall(name=name.strip(), arguments=args, id=cid, raw=raw))
        return n + 1
