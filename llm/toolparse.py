"""Tool-call parsing of assistant text.

``get_parser(name).parse(text) -> ParseResult(calls, errors)``. A malformed call
never raises: it yields an error string meant to be sent back to the model as the
observation of that call, so the model can fix its output; the agent loop counts
them (``metrics["malformed_tool_calls"]``).

Built-in parsers:

* ``hermes``: Qwen2.5 / Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per message.
* ``fenced_bash``: SWE-agent style actions, each fenced block ````` ```bash ... ``` ````` is one
  ``bash`` call with ``arguments == {"command": ...}``.

Model-family parsers live in :mod:`rolloutd.llm.parsers` (``qwen3``, ``qwen3_coder``,
``llama3_json``, ``mistral``, ``harmony``, ``deepseek_v31``; docs/LLM.md, "Model families").
Besides the calls they split off the reasoning (``ParseResult.reasoning``) and the
user-visible text (``ParseResult.content``), which is what an OpenAI-compatible
endpoint returns as ``reasoning_content`` / ``content`` / ``tool_calls``
(:meth:`ParseResult.to_openai_message`).

Parsers read the sampled ids, never the backend's text (:func:`parse_ids`): the ids
are decoded with the handler's tokenizer, each added/special token id as its token
string (a delimiter), and control-token *text* the model wrote with ordinary ids
(``'<|call|>'`` inside a JSON string argument) as a placeholder the parser cannot
mistake for a delimiter, restored in the result. A parser whose format needs
control tokens says ``skip_special_tokens = False``; otherwise special token ids are
dropped before parsing. Content and reasoning never carry a sampled special token.
The agent loop and the OpenAI endpoint both go through :func:`parse_ids`; the endpoint's
reply (content, reasoning, ``tool_calls``) is :func:`parse_reply`, its call ids :class:`CallIds`
(the model's own ids where the family samples them, mapped back when the agent sends the
history, and tool messages named after the call they answer). :func:`parser_name_for` is the
default parser of a tokenizer (its model family's, else ``hermes``).

More parsers can be added with :func:`register_parser` or through the entry-point
group ``rolloutd.toolparsers`` (value: a ``ToolParser`` subclass).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolParser",
    "HermesParser",
    "FencedBashParser",
    "get_parser",
    "register_parser",
    "available_parsers",
    "parse_ids",
    "parser_name_for",
    "CallIds",
]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""
    raw: str = ""  # the exact text of the call, for logs

    def to_openai(self) -> dict[str, Any]:
        """OpenAI ``tool_calls`` entry: arguments as a JSON string."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(slots=True)
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # calls and errors in text order: ("call", ToolCall) | ("error", str)
    items: list[tuple[str, Any]] = field(default_factory=list)
    # the user-visible text (calls and reasoning removed), None when there is none
    content: str | None = None
    # the reasoning text (``<think>`` body, harmony analysis channel), None when there is none
    reasoning: str | None = None
    # the whole message as the agent sees it (decoded from the ids without special tokens)
    text: str | None = None
    # the text the parser looked for calls in, special-token ids as their strings (hermes
    # family): what vLLM's parser returns as the content when a call does not parse
    source: str | None = None

    @property
    def has_actions(self) -> bool:
        return bool(self.calls or self.errors)

    def call(self, c: ToolCall) -> None:
        self.calls.append(c)
        self.items.append(("call", c))

    def error(self, msg: str) -> None:
        self.errors.append(msg)
        self.items.append(("error", msg))

    def to_openai_message(self) -> dict[str, Any]:
        """The assistant message an OpenAI chat-completions server returns for this text."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg


class ToolParser:
    name = "base"
    # False: parse() needs the text decoded with special tokens kept
    skip_special_tokens = True
    # True: parse() sets ParseResult.content (else it is the text minus the calls' raw text)
    sets_content = False

    def parse(self, text: str) -> ParseResult:  # pragma: no cover - interface
        raise NotImplementedError

    def with_tools(self, tools: list[dict] | None) -> "ToolParser":
        """This parser for a request with these tool schemas (a parser that types arguments
        from the schemas returns a new one; the others ignore them)."""
        return self


def split_reasoning(text: str, open_tag: str, close_tag: str) -> tuple[str | None, str, bool]:
    """``(reasoning, rest, closed)`` of a generation that may start with a reasoning block.

    The open tag may be in the generation prompt (DeepSeek's ``<think>``, Qwen3
    thinking models' ``<think>\\n``) and so absent from the sampled text; the close tag
    marks the end. Without a close tag, a text that opens a block is all reasoning
    (``closed`` False: the model ran out of tokens while thinking); a text that does not
    is all content.
    """
    i = text.find(close_tag)
    if i < 0:
        j = text.find(open_tag)
        if j >= 0 and not text[:j].strip():
            return text[j + len(open_tag) :].strip("\n"), "", False
        return None, text, True
    head = text[:i]
    j = head.find(open_tag)
    if j >= 0 and not head[:j].strip():
        head = head[j + len(open_tag) :]
    return head.strip("\n"), text[i + len(close_tag) :], True


def strip_suffixes(text: str, suffixes: tuple[str, ...]) -> str:
    """Drop trailing end-of-turn token strings (kept when decoding with special tokens)."""
    changed = True
    while changed:
        changed = False
        t = text.rstrip()
        for suf in suffixes:
            if suf and t.endswith(suf):
                text = t[: -len(suf)]
                changed = True
    return text


def _whole_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def _snippet(s: str, n: int = 120) -> str:
    s = s.strip()
    return s if len(s) <= n else s[: n - 3] + "..."


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Hermes, many others)."""

    name = "hermes"
    skip_special_tokens = False  # markers may be special tokens; parse_ids strips the rest from content
    sets_content = True
    FORMAT_HINT = (
        'Expected format: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>", max_calls: int = 32) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.max_calls = max_calls

    def parse(self, text: str) -> ParseResult:
        res = ParseResult(source=text)
        if self.open_tag not in text:
            res.content = text.strip() or None
            return res
        pos = 0
        n = 0
        o, c = self.open_tag, self.close_tag
        kept: list[str] = []  # text outside the calls
        while True:
            s = text.find(o, pos)
            if s < 0:
                break
            kept.append(text[pos:s])
            # a call runs to the next close tag, as vLLM's hermes parser reads it: an open tag
            # inside the JSON (a string argument) is part of the call
            e = text.find(c, s + len(o))
            if e < 0:  # a call to the end without its close tag counts when its JSON is whole (vLLM)
                body = text[s + len(o) :].strip()
                if _whole_json(body):
                    self._one(res, n, body, text[s:])
                else:
                    self._error(res, n, f"unterminated {o} (missing {c}): {_snippet(text[s:])!r}")
                n += 1
                pos = len(text)
                break
            body = text[s + len(o) : e]
            self._one(res, n, body.strip(), text[s : e + len(c)])
            n += 1
            pos = e + len(c)
            if n >= self.max_calls:
                if text.find(o, pos) >= 0:
                    self._error(res, n, f"too many tool calls in one message (max {self.max_calls}); the rest were ignored")
                    pos = len(text)
                break
        kept.append(text[pos:])
        res.content = "".join(kept).strip() or None
        return res

    def _error(self, res: ParseResult, idx: int, msg: str) -> None:
        res.error(f"Error: tool call #{idx + 1} is malformed: {msg}. {self.FORMAT_HINT}")

    def _one(self, res: ParseResult, idx: int, body: str, raw: str) -> None:
        if body.startswith("```"):
            # tolerate a fenced json block inside the tags
            body = body.strip("`")
            if body.startswith("json"):
                body = body[4:]
            body = body.strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            self._error(res, idx, f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno}): {_snippet(body)!r}")
            return
        if not isinstance(obj, dict):
            self._error(res, idx, f"expected a JSON object, got {type(obj).__name__}")
            return
        if "function" in obj and isinstance(obj["function"], dict) and "name" not in obj:
            obj = obj["function"]
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            self._error(res, idx, 'missing or empty "name"')
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                self._error(res, idx, f'"arguments" is a string that is not valid JSON ({e.msg})')
                return
        if not isinstance(args, dict):
            self._error(res, idx, f'"arguments" must be a JSON object, got {type(args).__name__}')
            return
        res.call(ToolCall(name=name.strip(), arguments=args, id=f"call_{idx}", raw=raw))


class FencedBashParser(ToolParser):
    """Fenced shell blocks as ``bash`` calls (SWE-agent / mini-swe-agent style)."""

    name = "fenced_bash"
    skip_special_tokens = False
    _FENCE = re.compile(r"```(bash|sh|shell)[ \t]*\r?\n(.*?)```", re.DOTALL)
    _OPEN = re.compile(r"```(bash|sh|shell)\b")

    def __init__(self, tool_name: str = "bash", max_calls: int = 1, argument: str = "command") -> None:
        self.tool_name = tool_name
        self.max_calls = max_calls
        self.argument = argument

    def parse(self, text: str) -> ParseResult:
        res = ParseResult()
        if "```" not in text:
            return res
        matched_until = 0
        n = 0
        for m in self._FENCE.finditer(text):
            cmd = m.group(2).strip("\n")
            matched_until = m.end()
            if n >= self.max_calls:
                msg = (
                    f"Error: only {self.max_calls} ```bash block(s) per message are executed; "
                    "the extra block was ignored. Send one command at a time."
                )
                res.errors.append(msg)
                res.items.append(("error", msg))
                n += 1
                continue
            if not cmd.strip():
                msg = f"Error: bash block #{n + 1} is empty."
                res.errors.append(msg)
                res.items.append(("error", msg))
            else:
                call = ToolCall(name=self.tool_name, arguments={self.argument: cmd}, id=f"call_{n}", raw=m.group(0))
                res.calls.append(call)
                res.items.append(("call", call))
            n += 1
        tail = self._OPEN.search(text, matched_until)
        if tail is not None:
            msg = "Error: unterminated ```bash block (missing closing ```)."
            res.errors.append(msg)
            res.items.append(("error", msg))
        return res


_REGISTRY: dict[str, Callable[..., ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "fenced_bash": FencedBashParser,
}
# Family parsers, imported on first use ("module:Class" under rolloutd.llm.parsers).
_FAMILY_PARSERS = {
    "qwen3": "qwen3:Qwen3Parser",
    "qwen3_coder": "qwen3_coder:Qwen3CoderParser",
    "llama3_json": "llama3:Llama3JsonParser",
    "mistral": "mistral:MistralParser",
    "harmony": "harmony:HarmonyParser",
    "gpt_oss": "harmony:HarmonyParser",
    "deepseek_v31": "deepseek:DeepSeekParser",
    "deepseek_v3": "deepseek:DeepSeekParser",
}


def _family_parser(name: str) -> Callable[..., ToolParser] | None:
    spec = _FAMILY_PARSERS.get(name)
    if spec is None:
        return None
    import importlib

    mod, _, cls = spec.partition(":")
    return getattr(importlib.import_module(f"rolloutd.llm.parsers.{mod}"), cls)


def register_parser(name: str, factory: Callable[..., ToolParser]) -> None:
    _REGISTRY[name] = factory


def _entry_point(name: str) -> Callable[..., ToolParser] | None:
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="rolloutd.toolparsers"):
            if ep.name == name:
                return ep.load()
    except Exception:  # pragma: no cover - broken metadata
        return None
    return None


def available_parsers() -> list[str]:
    names = set(_REGISTRY) | set(_FAMILY_PARSERS)
    try:
        from importlib.metadata import entry_points

        names |= {ep.name for ep in entry_points(group="rolloutd.toolparsers")}
    except Exception:  # pragma: no cover
        pass
    return sorted(names)


def get_parser(name: str, tools: list[dict] | None = None, **options: Any) -> ToolParser:
    """The parser ``name``; with ``tools`` the one for those tool schemas (:meth:`ToolParser.with_tools`)."""
    factory = _REGISTRY.get(name) or _family_parser(name) or _entry_point(name)
    if factory is None:
        raise KeyError(f"unknown tool-call parser {name!r}; available: {', '.join(available_parsers())}")
    p = factory(**options)
    return p.with_tools(tools) if tools else p


def parser_name_for(tokenizer: Any, name: str | None = None) -> str:
    """``name`` when given, else the parser of the tokenizer's model family, else ``hermes``."""
    if name:
        return name
    from .families import family_of

    fam = family_of(tokenizer)
    return fam.parser if fam is not None else "hermes"


# -- parsing the sampled ids -----------------------------------------------------------------
# Placeholders for control-token text written with ordinary ids: one private-use code point
# per added token, from the first base whose range the text does not use.
_PLANES = (0xF0000, 0x100000, 0xE000)


class _IdText:
    """Per tokenizer: which ids are added/special tokens, and their strings."""

    __slots__ = ("tokenizer", "added", "special", "special_strings", "strings", "index", "pattern", "_decode_run")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        dec = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added: dict[int, str] = {int(i): str(getattr(t, "content", t)) for i, t in dec.items()}
        self.special = frozenset(int(i) for i, t in dec.items() if getattr(t, "special", True))
        self.special_strings = frozenset(self.added[i] for i in self.special)
        self.strings = sorted({s for s in self.added.values() if s}, key=len, reverse=True)
        self.index = {s: k for k, s in enumerate(self.strings)}
        from .tokenizer_utils import trie_pattern

        self.pattern = trie_pattern(self.strings)
        # the Rust decoder directly (what HF's decode does, minus its per-call overhead) unless HF
        # post-processes the text
        b = getattr(tokenizer, "backend_tokenizer", None)
        if b is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_run = lambda ids: b.decode(ids, skip_special_tokens=False)
        else:
            self._decode_run = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)

    def decode(self, ids: list[int], skip_special: bool) -> tuple[str, dict[int, str] | None]:
        """``(text, unescape table)``: added-token ids as their strings (special ones dropped
        when ``skip_special``), control-token text inside ordinary ids as placeholders."""
        tok = self.tokenizer
        added = self.added
        runs: list[tuple[bool, Any]] = []  # (is_token, ids | string)
        run: list[int] = []
        for t in ids:
            s = added.get(t)
            if s is None:
                run.append(t)
                continue
            if run:
                runs.append((False, run))
                run = []
            if not (skip_special and t in self.special):
                runs.append((True, s))
        if run:
            runs.append((False, run))
        dec = self._decode_run
        pieces = [(k, s if k else dec(s)) for k, s in runs]
        plain = "".join(p for _, p in pieces)
        if self.pattern is None or not any(not k and self.pattern.search(p) for k, p in pieces):
            return plain, None
        full = tok.decode(ids, skip_special_tokens=skip_special)
        if full != plain:  # a decoder that is not piecewise (SentencePiece's leading space): as decoded
            return full, None
        n = len(self.strings)
        for base in _PLANES:
            lo, hi = chr(base), chr(base + n - 1)
            if not re.search(f"[{re.escape(lo)}-{re.escape(hi)}]", plain):
                break
        else:  # pragma: no cover - every candidate range is used by the text itself
            return plain, None
        idx = self.index
        sub = lambda m: chr(base + idx[m.group(0)])  # noqa: E731
        text = "".join(p if k else self.pattern.sub(sub, p) for k, p in pieces)
        return text, {base + k: s for k, s in enumerate(self.strings)}


_ID_TEXT: dict[int, tuple[Any, _IdText]] = {}


def _id_text(tokenizer: Any) -> _IdText:
    hit = _ID_TEXT.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    it = _IdText(tokenizer)
    _ID_TEXT[id(tokenizer)] = (tokenizer, it)
    return it


def _restore(obj: Any, table: dict[int, str]) -> Any:
    if isinstance(obj, str):
        return obj.translate(table)
    if isinstance(obj, dict):
        return {_restore(k, table): _restore(v, table) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v, table) for v in obj]
    return obj


def parse_ids(parser: ToolParser, ids: Any, tokenizer: Any, tools: list[dict] | None = None) -> ParseResult:
    """Parse an assistant message from its sampled token ids (never from a server's text).

    Delimiters are token ids: an added or special token id is its token string, while the
    same string written with ordinary ids (control-token text inside an argument or a
    message) is text and comes back unchanged in the arguments and content. ``content``
    and ``reasoning`` never carry a sampled special token (end of turn, channel markup);
    ``text`` is the message decoded without special tokens.
    """
    if tools:
        parser = parser.with_tools(tools)
    ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    it = _id_text(tokenizer)
    skip = getattr(parser, "skip_special_tokens", True)
    text, table = it.decode(ids, skip)
    res = parser.parse(text)
    if not getattr(parser, "sets_content", False):
        content = text
        for c in res.calls:
            if c.raw:
                content = content.replace(c.raw, "", 1)
        res.content = content.strip() or None
    pat = it.pattern
    if pat is not None:  # sampled control tokens are markup, never content
        sp = it.special_strings
        drop = lambda s: pat.sub(lambda m: "" if m.group(0) in sp else m.group(0), s)  # noqa: E731
        if res.content is not None:
            res.content = drop(res.content).strip() or None
        if res.reasoning is not None:
            res.reasoning = drop(res.reasoning)
    visible, vtable = (text, table) if skip else it.decode(ids, True)
    res.text = visible.translate(vtable) if vtable else visible
    if table:
        for c in res.calls:
            c.name = c.name.translate(table)
            c.arguments = _restore(c.arguments, table)
            c.raw = c.raw.translate(table)
        res.errors = [e.translate(table) for e in res.errors]
        res.items = [(k, v.translate(table) if k == "error" else v) for k, v in res.items]
        if res.content is not None:
            res.content = res.content.translate(table)
        if res.reasoning is not None:
            res.reasoning = res.reasoning.translate(table)
        if res.source is not None:
            res.source = res.source.translate(table)
    if res.source is not None and ids and ids[-1] in it.special:
        end = it.added[ids[-1]]  # the token that ended the generation is not text (vLLM's output)
        if res.source.endswith(end):
            res.source = res.source[: -len(end)]
    return res


# -- the OpenAI-compatible endpoint's side ----------------------------------------------------
class CallIds:
    """Tool-call ids between the model and an OpenAI-style agent, for one session.

    The agent gets the id the model sampled where the family samples ids (Mistral's 9
    characters; a call without a valid one gets the parser's deterministic id, which is what
    the family's template then renders), else ``call_<n>_<k>``; an id the session already
    handed out is replaced by ``call_<n>_<k>`` too (agents need unique ids). When the agent
    sends the history back, :meth:`prepare` maps its ids back to the model's and gives a
    tool message without a ``name`` the name of the call it answers (gpt-oss renders
    ``functions.<name>``).
    """

    __slots__ = ("samples", "to_model", "names", "_n")

    def __init__(self, tokenizer: Any = None, *, samples: bool | None = None) -> None:
        if samples is None:
            from .families import family_of

            fam = family_of(tokenizer) if tokenizer is not None else None
            samples = bool(fam is not None and fam.samples_call_ids)
        self.samples = samples
        self.to_model: dict[str, str] = {}  # id the agent got -> id the model wrote
        self.names: dict[str, str] = {}  # id the agent got -> function name
        self._n = 0

    def assign(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """OpenAI ``tool_calls`` entries for these calls (ids recorded)."""
        n, self._n = self._n, self._n + 1
        out = []
        for k, c in enumerate(calls):
            oid = c.id if self.samples and c.id and c.id not in self.to_model else f"call_{n}_{k}"
            self.to_model[oid] = c.id if self.samples and c.id else oid
            self.names[oid] = c.name
            d = c.to_openai()
            d["id"] = oid
            out.append(d)
        return out

    def prepare(self, msgs: list[dict]) -> list[dict]:
        """Template messages of a request with the model's call ids and resolved tool names."""
        names = self.names
        local: dict[str, str] | None = None
        out = []
        for m in msgs:
            role = m.get("role")
            if role == "assistant" and m.get("tool_calls"):
                tcs = []
                for tc in m["tool_calls"]:
                    tid = tc.get("id")
                    fn = tc.get("function") or {}
                    if isinstance(tid, str) and isinstance(fn.get("name"), str):
                        local = local if local is not None else {}
                        local[tid] = fn["name"]
                    tcs.append({**tc, "id": self.to_model[tid]} if tid in self.to_model else tc)
                m = {**m, "tool_calls": tcs}
            elif role == "tool":
                tid = m.get("tool_call_id")
                upd: dict[str, Any] = {}
                if not m.get("name") and isinstance(tid, str):
                    name = (local or {}).get(tid) or names.get(tid)
                    if name:
                        upd["name"] = name
                if tid in self.to_model:
                    upd["tool_call_id"] = self.to_model[tid]
                if upd:
                    m = {**m, **upd}
            out.append(m)
        return out


def parse_reply(ids: Any, tokenizer: Any, parser: ToolParser, tools: list[dict] | None = None, *,
                call_ids: CallIds | None = None, parse_calls: bool = True) -> tuple[ParseResult, list[dict]]:
    """An assistant reply as an OpenAI-compatible endpoint returns it: ``(result, tool_calls)``.

    ``result.content`` is the text without markup (None when there is none), ``result.reasoning``
    the reasoning, ``tool_calls`` the OpenAI entries (ids from ``call_ids``); all from the ids.
    With ``parse_calls`` False (``tool_choice: none``) calls are not returned: a message that
    holds one comes back as its text.

    As vLLM's hermes parser: a reply with a call that does not parse (invalid JSON, cut off by
    the length limit) has no calls, and its content is the sampled text, special-token ids as
    their strings (vLLM decodes with ``skip_special_tokens=False`` when tools are offered), the
    reasoning apart and the token that ended it left out; a reply without calls likewise. A
    parser without such a text (other families) gives the text without special tokens."""
    res = parse_ids(parser, ids, tokenizer, tools)
    if not parse_calls:
        if res.calls or res.errors:
            res.content = (res.text or "").strip() or None
        return res, []
    if res.errors or not res.calls:
        if res.source is not None:
            res.content = res.source.strip() or None
        elif res.errors:
            res.content = (res.text or "").strip() or None
        if res.errors:
            res.calls = []
            return res, []
    calls = res.calls
    return res, (call_ids.assign(calls) if call_ids is not None else [c.to_openai() for c in calls])
