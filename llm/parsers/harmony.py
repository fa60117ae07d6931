"""gpt-oss harmony: a generation is a run of messages::

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant to=functions.bash<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>

The first header's ``<|start|>assistant`` is in the generation prompt. A header holds
the channel (``<|channel|>C``), an optional recipient (`` to=R``, before or after the
channel) and an optional content type (``<|constrain|>json`` or ``json``). Messages end
with ``<|end|>``, ``<|call|>`` (a tool call; a stop token) or ``<|return|>`` (the final
answer; a stop token); the last one may end with the text when the server cut the stop
token.

* ``analysis`` messages are reasoning (``ParseResult.reasoning``, joined by newlines);
* a message with recipient ``functions.NAME`` is a call of ``NAME`` with the JSON body as
  its arguments; another recipient (a built-in tool such as ``browser.search`` or
  ``python``) is a call of that name with ``{"input": body}`` unless the body is a JSON
  object;
* ``final`` messages, and ``commentary`` messages without a recipient (preambles), are
  the content.

Checked against ``openai-harmony``'s own parser (``parse_messages_from_completion_tokens``)
in tests/families.
"""

from __future__ import annotations

import json
import re

from ..toolparse import ParseResult, ToolCall, ToolParser, _snippet

FORMAT_HINT = (
    "Expected format: <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json"
    "<|message|>{...}<|call|>"
)
_TERMINATORS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(ToolParser):
    name = "harmony"
    sets_content = True
    skip_special_tokens = False  # the format is made of special tokens

    def __init__(self, max_calls: int = 32) -> None:
        self.max_calls = max_calls

    def _error(self, res: ParseResult, idx: int, msg: str) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {FORMAT_HINT}")

    def parse(self, text: str) -> ParseResult:
        res = ParseResult()
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        first = True
        text = text.lstrip()
        while pos < len(text):
            if text.startswith("<|start|>", pos):
                pos += len("<|start|>")
            elif not first:
                junk = text[pos:].strip()
                if junk:
                    content.append(junk)  # stray text after a message: keep it visible
                break
            first = False
            m = text.find("<|message|>", pos)
            if m < 0:
                self._error(res, len(res.items), f"a message header without <|message|>: {_snippet(text[pos:])!r}")
                break
            header = text[pos:m]
            t = _TERMINATORS.search(text, m)
            body_end = t.start() if t else len(text)
            body = text[m + len("<|message|>") : body_end]
            pos = t.end() if t else len(text)
            self._message(res, len(res.items), header, body, text[m:pos], reasoning, content)
        res.reasoning = "\n".join(reasoning) if reasoning else None
        res.content = "\n".join(c for c in content if c) or None
        return res

    def _message(self, res, n, header, body, raw, reasoning, content) -> None:
        ch = ""
        if "<|channel|>" in header:
            ch = header.split("<|channel|>", 1)[1]
            ch = re.split(r"[\s<]", ch, 1)[0]
        r = _RECIPIENT.search(header)
        recipient = r.group(1) if r else None
        if recipient and recipient != "assistant":
            if len(res.calls) >= self.max_calls:
                self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored")
                return
            name = recipient.removeprefix("functions.")
            if not name:
                self._error(res, n, f"empty tool name in recipient {recipient!r}")
                return
            b = body.strip()
            try:
                args = json.loads(b) if b else {}
            except json.JSONDecodeError as e:
                if recipient.startswith("functions."):
                    self._error(res, n, f"invalid JSON arguments for {recipient} ({e.msg} at column {e.colno}): {_snippet(b)!r}")
                    return
                args = {"input": body}
            if not isinstance(args, dict):
                if recipient.startswith("functions."):
                    self._error(res, n, f"arguments for {recipient} must be a JSON object, got {type(args).__name__}")
                    return
                args = {"input": body}
            res.call(ToolCall(name=name, arguments=args, id=f"call_{len(res.items)}", raw=raw))
        elif ch == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
