"""Qwen3-Coder XML calls::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Parameter values are text. With the tool schemas (``get_parser("qwen3_coder",
tools=[...])``) a value is converted to its declared JSON type (integer, number,
boolean, object, array), as vLLM's qwen3_coder parser does; without them, or for a
``string`` parameter, it stays text. One leading and one trailing newline around a
value belong to the format, not to the value.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..toolparse import ParseResult, ToolCall, ToolParser, _snippet, strip_suffixes

FORMAT_HINT = (
    "Expected format: <tool_call>\n<function=NAME>\n<parameter=NAME>\nVALUE\n</parameter>\n</function>\n</tool_call>"
)
_FUNC = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    sets_content = True
    skip_special_tokens = False

    def __init__(self, tools: list[dict] | None = None, max_calls: int = 32) -> None:
        self.max_calls = max_calls
        self.types: dict[str, dict[str, str]] = {}
        for t in tools or []:
            f = t.get("function", t) if isinstance(t, dict) else None
            if not isinstance(f, dict):
                continue
            props = (f.get("parameters") or {}).get("properties") if isinstance(f.get("parameters"), dict) else None
            if isinstance(props, dict):
                self.types[str(f.get("name"))] = {k: str(v.get("type", "string")) for k, v in props.items()
                                                  if isinstance(v, dict)}

    def with_tools(self, tools: list[dict] | None) -> "Qwen3CoderParser":
        """A parser that types parameter values from these schemas (the loop and the endpoint
        call this with each request's tools)."""
        return Qwen3CoderParser(tools=tools, max_calls=self.max_calls) if tools else self

    def _error(self, res: ParseResult, idx: int, msg: str) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {FORMAT_HINT}")

    def parse(self, text: str) -> ParseResult:
        text = strip_suffixes(text, ("<|im_end|>", "<|endoftext|>"))
        res = ParseResult()
        kept: list[str] = []
        pos = n = 0
        while n < self.max_calls:
            s = text.find("<tool_call>", pos)
            if s < 0:
                break
            kept.append(text[pos:s])
            e = text.find("</tool_call>", s)
            nxt = text.find("<tool_call>", s + 11)
            if e < 0 or 0 <= nxt < e:
                end = nxt if nxt >= 0 else len(text)
                self._error(res, n, f"unterminated <tool_call> (missing </tool_call>): {_snippet(text[s:end])!r}")
                pos, n = end, n + 1
                if nxt < 0:
                    break
                continue
            self._one(res, n, text[s + 11 : e], text[s : e + 12])
            pos, n = e + 12, n + 1
        else:
            if text.find("<tool_call>", pos) >= 0:
                self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored")
                pos = len(text)
        kept.append(text[pos:])
        res.content = "".join(kept).strip() or None
        return res

    def _one(self, res: ParseResult, idx: int, body: str, raw: str) -> None:
        m = _FUNC.search(body)
        if m is None:
            self._error(res, idx, f"no <function=NAME> inside <tool_call>: {_snippet(body)!r}")
            return
        name = m.group(1).strip()
        if not name:
            self._error(res, idx, "empty function name in <function=>")
            return
        fe = body.find("</function>", m.end())
        if fe < 0:
            self._error(res, idx, f"<function={name}> is not closed with </function>")
            return
        inner = body[m.end() : fe]
        args: dict[str, Any] = {}
        params = list(_PARAM.finditer(inner))
        if not params and inner.strip():
            self._error(res, idx, f"text inside <function={name}> that is not a <parameter=...>: {_snippet(inner)!r}")
            return
        for i, p in enumerate(params):
            pname = p.group(1).strip()
            stop = params[i + 1].start() if i + 1 < len(params) else len(inner)
            seg = inner[p.end() : stop]
            pe = seg.find("</parameter>")
            if pe < 0:
                self._error(res, idx, f"<parameter={pname}> of {name} is not closed with </parameter>")
                return
            if not pname:
                self._error(res, idx, f"empty parameter name in a call of {name}")
                return
            value = seg[:pe]
            value = value.removeprefix("\n")
            value = value.removesuffix("\n")
            try:
                args[pname] = self._convert(name, pname, value)
            except ValueError as e:
                self._error(res, idx, str(e))
                return
        res.call(ToolCall(name=name, arguments=args, id=f"call_{idx}", raw=raw))

    def _convert(self, func: str, param: str, value: str) -> Any:
        typ = self.types.get(func, {}).get(param, "string")
        if typ == "string":
            return value
        v = value.strip()
        try:
            if typ == "integer":
                return int(v)
            if typ == "number":
                f = float(v)
                return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
            if typ == "boolean":
                if v.lower() in ("true", "false"):
                    return v.lower() == "true"
                raise ValueError
            if typ in ("object", "array"):
                out = json.loads(v)
                if not isinstance(out, dict if typ == "object" else list):
                    raise ValueError
                return out
        except (ValueError, json.JSONDecodeError):
            raise ValueError(f"parameter {param!r} of {func} must be of type {typ}, got {_snippet(v, 60)!r}") from None
        return value  # unknown schema type: keep the text
