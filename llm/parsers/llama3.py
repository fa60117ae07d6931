"""Llama 3.1 / 3.2 / 3.3 JSON tool calls.

A message that starts with ``{`` (optionally after ``<|python_tag|>``) is one or more
calls ``{"name": NAME, "parameters": {...}}`` separated by ``;`` (what Llama 3.2
emits for parallel calls; vLLM's ``llama3_json`` parser splits the same way). Any
other message is plain content. ``"arguments"`` is accepted for ``"parameters"``.
"""

from __future__ import annotations

import json

from ..toolparse import ParseResult, ToolCall, ToolParser, _snippet, strip_suffixes

END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
FORMAT_HINT = 'Expected format: {"name": <function-name>, "parameters": <args-json-object>}'


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    sets_content = True
    skip_special_tokens = False  # <|python_tag|> is special

    def __init__(self, max_calls: int = 32) -> None:
        self.max_calls = max_calls

    def _error(self, res: ParseResult, idx: int, msg: str) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {FORMAT_HINT}")

    def parse(self, text: str) -> ParseResult:
        res = ParseResult()
        body = strip_suffixes(text, END_TOKENS).strip()
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>") :].strip()
        if not body.startswith("{"):
            if tagged and body:
                self._error(res, 0, f"<|python_tag|> not followed by a JSON object: {_snippet(body)!r}")
            else:
                res.content = body or None
            return res
        dec = json.JSONDecoder()
        pos, n = 0, 0
        while pos < len(body):
            if n >= self.max_calls:
                self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored")
                break
            try:
                obj, end = dec.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                self._error(res, n, f"invalid JSON ({e.msg} at column {e.colno}): {_snippet(body[pos:])!r}")
                break
            self._one(res, n, obj, body[pos:end])
            n += 1
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n":
                pos += 1
            if pos < len(body):
                if body[pos] != ";":
                    self._error(res, n, f"calls must be separated by ';', got {_snippet(body[pos:], 40)!r}")
                    break
                pos += 1
                while pos < len(body) and body[pos] in " \t\r\n":
                    pos += 1
        return res

    def _one(self, res: ParseResult, idx: int, obj: object, raw: str) -> None:
        if not isinstance(obj, dict):
            self._error(res, idx, f"expected a JSON object, got {type(obj).__name__}")
            return
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            self._error(res, idx, 'missing or empty "name"')
            return
        args = obj.get("parameters", obj.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                self._error(res, idx, f'"parameters" is a string that is not valid JSON ({e.msg})')
                return
        if args is None:
            args = {}
        if not isinstance(args, dict):
            self._error(res, idx, f'"parameters" must be a JSON object, got {type(args).__name__}')
            return
        res.call(ToolCall(name=name.strip(), arguments=args, id=f"call_{idx}", raw=raw))
