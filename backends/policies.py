"""Scripted policies for the scripted backend (:mod:`rolloutd.backends.scripted`).

A policy sees the request (prompt ids, the prompt decoded with the backend's
tokenizer, sampling params) and returns the reply *text*; the backend tokenizes it
and returns ids plus fake logprobs in vLLM's or SGLang's reply shape.

Policies are looked up by name: built-ins (``echo``, ``tool_then_answer``,
``constant``), then :func:`register_policy`, then the entry-point group
``rolloutd.policies`` (value: a ``Policy`` subclass or a factory taking keyword
options). Task-domain oracle policies plug in through that group.

A spec string ``name:key=value,key=value`` passes options (values parsed as JSON
when possible): ``tool_then_answer:tool_turns=3,answer="42"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

__all__ = [
    "Policy",
    "PolicyRequest",
    "PolicyReply",
    "EchoPolicy",
    "ToolThenAnswerPolicy",
    "ConstantPolicy",
    "register_policy",
    "get_policy",
    "parse_policy_spec",
    "available_policies",
]


@dataclass
class PolicyRequest:
    prompt_ids: list[int]
    api: str  # "vllm" | "sglang"
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    decode: Callable[[list[int]], str] | None = None

    @cached_property
    def prompt_text(self) -> str:
        """The prompt decoded with the backend's tokenizer, special tokens kept."""
        if self.decode is None:
            raise RuntimeError("this backend has no tokenizer to decode the prompt")
        return self.decode(self.prompt_ids)


@dataclass
class PolicyReply:
    """A reply with more control than plain text.

    ``text`` is tokenized by the backend; ``token_ids`` (if given) are returned as-is
    instead (e.g. a non-canonical segmentation). ``finish`` overrides the finish
    reason; by default the end-of-turn token is appended and the finish is ``stop``
    unless ``max_tokens`` truncates the reply (``length``).
    """

    text: str = ""
    token_ids: list[int] | None = None
    finish: str | None = None
    append_eos: bool = True


class Policy:
    """Base class: override :meth:`reply`."""

    name = "base"

    def __init__(self, **options: Any) -> None:
        self.options = options

    def reply(self, request: PolicyRequest) -> str | PolicyReply:  # pragma: no cover - interface
        raise NotImplementedError


def _last_message(prompt_text: str) -> str:
    """Content of the last ChatML block before the trailing generation prompt."""
    blocks = prompt_text.split("<|im_start|>")
    blocks = [b for b in blocks if b.strip()]
    if blocks and blocks[-1].startswith("assistant") and not blocks[-1][len("assistant") :].strip():
        blocks = blocks[:-1]
    if not blocks:
        return prompt_text[-200:]
    last = blocks[-1]
    _, _, content = last.partition("\n")
    return content.replace("<|im_end|>", "").strip()


class EchoPolicy(Policy):
    """Replies with the content of the last message of the prompt."""

    name = "echo"

    def reply(self, request: PolicyRequest) -> str:
        return self.options.get("prefix", "") + _last_message(request.prompt_text)


class ConstantPolicy(Policy):
    """Always the same reply (``text`` option)."""

    name = "constant"

    def reply(self, request: PolicyRequest) -> str:
        return str(self.options.get("text", "OK"))


class ToolThenAnswerPolicy(Policy):
    """Emits a Hermes ``<tool_call>`` until ``tool_turns`` tool responses are in the prompt,
    then a final answer.

    Options: ``tool_turns`` (1), ``tool`` ("bash"), ``arguments`` ({"command": "echo hello"}),
    ``answer`` ("The answer is 42."), ``thought`` (text before the call, "").
    """

    name = "tool_then_answer"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.tool_turns = int(options.get("tool_turns", 1))
        tool = str(options.get("tool", "bash"))
        args = options.get("arguments", {"command": "echo hello"})
        thought = str(options.get("thought", ""))
        call = json.dumps({"name": tool, "arguments": args}, ensure_ascii=False)
        self.call_text = f"{thought}<tool_call>\n{call}\n</tool_call>"
        self.answer = str(options.get("answer", "The answer is 42."))

    def reply(self, request: PolicyRequest) -> str:
        seen = request.prompt_text.count("<tool_response>")
        return self.call_text if seen < self.tool_turns else self.answer


_BUILTINS: dict[str, Callable[..., Policy]] = {
    "echo": EchoPolicy,
    "tool_then_answer": ToolThenAnswerPolicy,
    "constant": ConstantPolicy,
}
_REGISTERED: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str, factory: Callable[..., Policy] | None = None):
    """Register a policy factory by name (usable as a decorator)."""

    def deco(f: Callable[..., Policy]) -> Callable[..., Policy]:
        _REGISTERED[name] = f
        return f

    return deco(factory) if factory is not None else deco


def _entry_points() -> dict[str, Any]:
    try:
        from importlib.metadata import entry_points

        return {ep.name: ep for ep in entry_points(group="rolloutd.policies")}
    except Exception:  # pragma: no cover - broken metadata
        return {}


def available_policies() -> list[str]:
    return sorted(set(_BUILTINS) | set(_REGISTERED) | set(_entry_points()))


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    opts: dict[str, Any] = {}
    if rest:
        # split on commas that are not inside JSON brackets/quotes
        depth, buf, items, quote = 0, [], [], False
        for ch in rest:
            if ch == '"':
                quote = not quote
            elif not quote and ch in "[{":
                depth += 1
            elif not quote and ch in "]}":
                depth -= 1
            if ch == "," and depth == 0 and not quote:
                items.append("".join(buf))
                buf = []
            else:
                buf.append(ch)
        items.append("".join(buf))
        for item in items:
            if not item.strip():
                continue
            k, _, v = item.partition("=")
            try:
                opts[k.strip()] = json.loads(v)
            except ValueError:
                opts[k.strip()] = v
    return name.strip(), opts


def get_policy(spec: str | Policy, **options: Any) -> Policy:
    """Instantiate a policy from a name / spec string (or pass a Policy through)."""
    if isinstance(spec, Policy):
        return spec
    name, opts = parse_policy_spec(spec)
    opts.update(options)
    factory = _REGISTERED.get(name) or _BUILTINS.get(name)
    if factory is None:
        ep = _entry_points().get(name)
        if ep is None:
            raise KeyError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
        factory = ep.load()
    pol = factory(**opts)
    if not hasattr(pol, "reply"):
        raise TypeError(f"policy {name!r} has no reply() method")
    return pol
