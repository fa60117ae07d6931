"""Conversation state, token-in/token-out.

Over ~700 lines because it is one invariant (every sampled token kept as sampled, every other
token rendered with the template's own delimiters) and its pieces (render, extend, fork, truncate,
check) each break it if read apart.

A :class:`Conversation` is the exact token sequence a policy saw and produced:

* the initial prompt, rendered once with ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``;
* every generation appended **as sampled** (ids and logprobs straight from the
  backend, ``loss_mask == 1``); assistant text is never decoded and re-encoded;
* every batch of new messages (tool observations, user turns) tokenized on its own,
  with the template's own delimiters: the text the template puts between the end of
  the previous assistant content and the next generation prompt
  (``loss_mask == 0``, ``logprob == 0``).

How the delimiters are found (:class:`ChatRenderer`): the template is rendered for a
fixed probe conversation ``[system, user, assistant=MARKER]`` and for the same probe
plus the new messages with ``add_generation_prompt=True``. The second rendering
must start with the first (checked: a template that rewrites history cannot be
rendered incrementally and raises :class:`~rolloutd.llm.errors.TemplateError`); the extra text
is the new messages plus the next generation prompt. The text after ``MARKER`` in
the probe is how the template closes an assistant turn (``<|im_end|>\\n`` for
ChatML). If the sampled ids already end with that end-of-turn token only the rest of
the closer (``\\n``) is added, otherwise the whole closer is.

Untrusted content (tool output) that contains control-token strings such as
``<|im_end|>`` is encoded as plain text, never as control tokens, so a tool cannot
forge turn boundaries (same idea as transformers' ``sanitize_control_tokens``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import structlog

from .errors import ContextOverflow, TemplateError
from .families import ReasoningRule, end_token_ids, family_of
from .tokenizer_utils import FastEncoder, fast_encoder

log = structlog.get_logger("rolloutd.llm")

_MARK_START = "\ue000"
_MARK_END = "\ue001"


class TokenIds(np.ndarray):
    """int32 ids; ``json_ids`` caches their JSON array text (kept incrementally by Conversation)."""

    json_ids: str | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self.json_ids = None


def _join_ids(ids: Any) -> str:
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    return ",".join(map(str, ids))


class GenerationLike(Protocol):
    token_ids: Any
    logprobs: Any
    finish_reason: str
    latency_s: float


@dataclass(slots=True)
class Turn:
    """One generation call. Spans are in response coordinates (``response_ids[start:end]``)."""

    index: int
    start: int
    end: int
    finish_reason: str
    backend: str
    policy_version: int
    latency_s: float = 0.0
    obs_start: int | None = None
    obs_end: int | None = None
    continuation: bool = False  # continues the previous assistant message (after an abort)
    hidden: tuple[int, int] | None = None  # reasoning span hidden from later prompts (reasoning="drop")
    cause: str | None = None  # why it ended where the finish reason does not say (a context window cut)


class _Spliced:
    """A reply sampled elsewhere, as :meth:`Conversation.add_generation` takes it (its logprobs
    are its own conversation's business: here it is prompt)."""

    __slots__ = ("token_ids", "logprobs")
    finish_reason = "stop"
    latency_s = 0.0

    def __init__(self, ids: Sequence[int]) -> None:
        self.token_ids = np.asarray(ids, dtype=np.int32)
        self.logprobs = np.zeros(len(self.token_ids), dtype=np.float32)


def _compile(template: str):
    """transformers' own compiled Jinja template (same sandbox, filters, extensions), or None."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - very old transformers
        return None
    try:
        return _compile_jinja_template(template)
    except Exception:  # pragma: no cover
        return None


_PLAIN = (str, int, float, bool, type(None))
_REASONING_KEYS = frozenset(("reasoning_content", "reasoning", "thinking"))


def _plain_message(m: Any) -> bool:
    """A dict of scalars (what the fast render path is verified for)."""
    return (
        type(m) is dict
        and all(type(v) in _PLAIN for v in m.values())
        and not (_REASONING_KEYS & m.keys())
    )


class ChatRenderer:
    """Template-faithful incremental rendering for one tokenizer and tool list.

    Rendering goes through transformers' compiled chat template directly (what
    ``apply_chat_template`` does, minus its per-call input normalization) once that has
    been checked to give exactly ``apply_chat_template``'s text for the probe
    conversations; otherwise it falls back to ``apply_chat_template``. Continuations are
    rendered without the tool list when that is checked to change nothing after the
    probe (the tools only go into the system prompt), which saves re-serializing the
    tool schemas on every turn.
    """

    MARKER = "rolloutdAssistantMarker7c1f"
    _PROBE_SYSTEM = "rolloutd probe system"
    _PROBE_USER = "rolloutd probe user"
    _CHECK_MSGS = (
        {"role": "tool", "content": "rolloutd probe tool 1"},
        {"role": "tool", "content": "rolloutd probe tool 2"},
        {"role": "user", "content": "rolloutd probe user 2"},
    )

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict] | None = None,
        *,
        sanitize: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.sanitize = sanitize
        # extra template variables (enable_thinking, thinking, reasoning_effort, date_string, ...)
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.family = family_of(tokenizer)
        self.enc: FastEncoder = fast_encoder(tokenizer)
        self._marked_re: re.Pattern[str] | None = None
        self._control_ids: dict[str, int] = {}
        self._tool_json = self.family is not None and self.family.tool_content == "json"
        self._probe = [
            {"role": "system", "content": self._PROBE_SYSTEM},
            {"role": "user", "content": self._PROBE_USER},
            {"role": "assistant", "content": self.MARKER},
        ]
        self._compiled = None
        self._kwargs: dict[str, Any] = {}
        try:
            template = tokenizer.get_chat_template(None, self.tools)
            self._compiled = _compile(template)
            self._kwargs = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
            self._kwargs.update(self.template_kwargs)
        except Exception:  # pragma: no cover - exotic tokenizers
            self._compiled = None
        if self._compiled is not None:
            probe_msgs = self._probe + list(self._CHECK_MSGS)
            for tools in (self.tools, None):
                for gp in (False, True):
                    for msgs in (self._probe, probe_msgs, self._probe[:2]):
                        if self._render_fast(msgs, tools, gp) != self._render_slow(msgs, tools, gp):
                            self._compiled = None
                            break
        self._probe_text = self._render(self._probe, add_generation_prompt=False)
        i = self._probe_text.rfind(self.MARKER)
        if i < 0:
            raise TemplateError("chat template does not render assistant content verbatim")
        self.closer_text = self._probe_text[i + len(self.MARKER) :]
        self.eot_id: int | None = None
        self.closer_after_eot = self.closer_text
        for tok in self.enc.control_tokens:  # longest first
            if tok and self.closer_text.startswith(tok):
                tid = tokenizer.convert_tokens_to_ids(tok)
                if isinstance(tid, int) and tid >= 0:
                    self.eot_id = tid
                    self.closer_after_eot = self.closer_text[len(tok) :]
                break
        # A turn that ends with any end-of-turn token of its family (gpt-oss <|call|>, Llama
        # <|eom_id|>) was closed by the model too; only the rest of the closer is added.
        self.end_ids: frozenset[int] = frozenset(
            ({self.eot_id} if self.eot_id is not None else set()) | end_token_ids(tokenizer, self.family)
        )
        # Continuations without the tools, if that renders the same suffix.
        self._cont_tools = self.tools
        self._cont_probe_text = self._probe_text
        if self.tools is not None:
            check = self._probe + list(self._CHECK_MSGS)
            with_tools = self._render(check, add_generation_prompt=True)
            no_tools_probe = self._render(self._probe, add_generation_prompt=False, tools=None)
            no_tools = self._render(check, add_generation_prompt=True, tools=None)
            if (
                with_tools.startswith(self._probe_text)
                and no_tools.startswith(no_tools_probe)
                and with_tools[len(self._probe_text) :] == no_tools[len(no_tools_probe) :]
            ):
                self._cont_tools = None
                self._cont_probe_text = no_tools_probe
        # Templates that render the LAST assistant message differently (Qwen3 adds an empty
        # <think></think> to it) change the probe's assistant message once messages follow it.
        # That is allowed: rolloutd never re-renders an assistant turn, the model keeps seeing
        # what it sampled. Everything before that message (system, tools, user) must not change.
        head = self._render(self._probe[:2], add_generation_prompt=False, tools=self._cont_tools)
        self._cont_head_text = head if self._cont_probe_text.startswith(head) else None
        # Generation prompt, for information (e.g. "<|im_start|>assistant\n").
        with_gp = self._render(self._probe[:2], add_generation_prompt=True)
        without_gp = self._render(self._probe[:2], add_generation_prompt=False)
        self.generation_prompt = with_gp[len(without_gp) :] if with_gp.startswith(without_gp) else ""

    # -- rendering -----------------------------------------------------------------
    def _render_slow(self, messages: list[dict], tools: list[dict] | None, gp: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gp, **self.template_kwargs
        )

    def _render_fast(self, messages: list[dict], tools: list[dict] | None, gp: bool) -> str:
        assert self._compiled is not None
        return self._compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=gp, **self._kwargs
        )

    @property
    def fast_path(self) -> bool:
        """True when the compiled template is used directly."""
        return self._compiled is not None

    def _render(self, messages: list[dict], *, add_generation_prompt: bool, tools: Any = "default") -> str:
        t = self.tools if tools == "default" else tools
        if self._compiled is not None:
            return self._render_fast(messages, t, add_generation_prompt)
        return self._render_slow(messages, t, add_generation_prompt)

    def _needs_marking(self, obj: Any) -> bool:
        if isinstance(obj, str):
            return self.enc.has_control_tokens(obj) or _MARK_START in obj or _MARK_END in obj
        if isinstance(obj, dict):
            return any(self._needs_marking(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(self._needs_marking(v) for v in obj)
        return False

    def _mark(self, obj: Any) -> Any:
        if isinstance(obj, str):
            obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
            pat = self.enc.control_token_pattern()
            return pat.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj) if pat is not None else obj
        if isinstance(obj, dict):
            return {k: self._mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self._mark(v) for v in obj]
        return obj

    def _encode_marked(self, text: str) -> list[int]:
        """Encode text in which content control tokens are wrapped in private-use markers.

        The text between two of the template's own control tokens is encoded as ONE piece of
        plain text, marked control-token strings included: that is how each family's reference
        encodes untrusted text (mistral-common's ``encode(json.dumps(...))``, harmony's and the
        HF templates' text between special tokens), so the ids equal the reference's, not
        only the characters."""
        if _MARK_START not in text and _MARK_END not in text:
            return self.enc.encode(text)
        rx = self._marked_re
        if rx is None:
            pat = self.enc.control_token_pattern()
            alt = "|" + pat.pattern if pat is not None else ""
            rx = self._marked_re = re.compile(_MARK_START + "([^" + _MARK_END + "]*)" + _MARK_END + alt)
        ids: list[int] = []
        buf: list[str] = []
        pos = 0
        to_id = self._control_id
        for m in rx.finditer(text):
            buf.append(text[pos : m.start()])
            if m.group(1) is not None:
                buf.append(m.group(1))
            else:
                ids += self.enc.encode_plain("".join(buf).replace(_MARK_START, "").replace(_MARK_END, ""))
                buf = []
                ids.append(to_id(m.group(0)))
            pos = m.end()
        buf.append(text[pos:])
        ids += self.enc.encode_plain("".join(buf).replace(_MARK_START, "").replace(_MARK_END, ""))
        return ids

    def _control_id(self, token: str) -> int:
        tid = self._control_ids.get(token)
        if tid is None:
            tid = self._control_ids[token] = int(self.enc.encode(token)[0])
        return tid

    def _prepare(self, msgs: list[dict]) -> list[dict]:
        """The family's reference form of the messages: Mistral embeds a tool result that is
        valid JSON as the JSON value (mistral-common's ``_parse_json_content``), not as a string."""
        if not self._tool_json:
            return msgs
        out = []
        for m in msgs:
            c = m.get("content") if type(m) is dict and m.get("role") == "tool" else None
            if isinstance(c, str):
                try:
                    m = {**m, "content": json.loads(c)}
                except ValueError:
                    pass
            out.append(m)
        return out

    def render_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (``apply_chat_template``)."""
        msgs = self._prepare(list(messages))
        if self.sanitize and self._needs_marking(msgs):
            return self._encode_marked(self._render_slow(self._mark(msgs), self.tools, True))
        return self.enc.encode(self._render_slow(msgs, self.tools, True))

    def render_continuation(self, messages: Sequence[dict], *, ended_with_eot: bool) -> list[int]:
        """Token ids that close the current assistant turn, add ``messages`` and open the next one."""
        msgs = self._prepare(list(messages))
        marked = self.sanitize and self._needs_marking(msgs)
        if marked:
            msgs = self._mark(msgs)
        if self._compiled is not None and all(_plain_message(m) for m in msgs):
            full = self._render_fast(self._probe + msgs, self._cont_tools, True)
        else:  # structured content, reasoning fields, custom objects: let transformers normalize
            full = self._render_slow(self._probe + msgs, self._cont_tools, True)
        probe = self._cont_probe_text
        if full.startswith(probe):
            rest = full[len(probe) :]
        else:
            rest = self._after_assistant(full)
        head = self.closer_after_eot if ended_with_eot else self.closer_text
        text = head + rest
        return self._encode_marked(text) if marked else self.enc.encode(text)

    def _after_assistant(self, full: str) -> str:
        """The text after the probe assistant message's closer in ``full``, when only that
        message rendered differently; TemplateError when earlier turns changed."""
        h = self._cont_head_text
        j = full.find(self.MARKER, len(h)) if h is not None and full.startswith(h) else -1
        if j < 0 or not full.startswith(self.closer_text, j + len(self.MARKER)):
            raise TemplateError(
                "the chat template renders earlier turns differently once new messages are appended; "
                "incremental (token-in/token-out) rendering is impossible with it"
            )
        return full[j + len(self.MARKER) + len(self.closer_text) :]


_RENDERERS: dict[tuple[int, str, bool, str], tuple[Any, ChatRenderer]] = {}


def get_renderer(
    tokenizer: Any,
    tools: list[dict] | None = None,
    *,
    sanitize: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatRenderer:
    """A cached :class:`ChatRenderer` per (tokenizer, tools, template variables)."""
    key = (
        id(tokenizer),
        json.dumps(tools, sort_keys=True, default=str) if tools else "",
        sanitize,
        json.dumps(template_kwargs, sort_keys=True, default=str) if template_kwargs else "",
    )
    hit = _RENDERERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    r = ChatRenderer(tokenizer, tools, sanitize=sanitize, template_kwargs=template_kwargs)
    if len(_RENDERERS) > 256:
        _RENDERERS.clear()
    _RENDERERS[key] = (tokenizer, r)
    return r


class Conversation:
    """Token-level trajectory of one rollout.

    ``Conversation(tokenizer, messages, tools, max_context)``; then alternate
    :meth:`add_generation` and :meth:`add_messages`. ``context_ids`` is what to send
    to the backend next; :meth:`arrays` is what the trainer gets.
    """

    __slots__ = (
        "tokenizer",
        "max_context",
        "renderer",
        "_ids",
        "_mask",
        "_lp",
        "_n",
        "_n_prompt",
        "_turns",
        "_open",
        "_last_abort",
        "_json",
        "_view",
        "reasoning",
        "_rule",
        "_hidden",
        "_n_hidden",
    )

    def __init__(
        self,
        tokenizer: Any,
        messages: list[dict],
        tools: list[dict] | None = None,
        max_context: int = 32768,
        *,
        sanitize: bool = True,
        renderer: ChatRenderer | None = None,
        template_kwargs: dict[str, Any] | None = None,
        reasoning: str = "keep",
        reasoning_rule: ReasoningRule | None = None,
    ) -> None:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        if reasoning not in ("keep", "drop"):
            raise ValueError(f"reasoning must be 'keep' or 'drop', not {reasoning!r}")
        self.tokenizer = tokenizer
        self.max_context = int(max_context)
        self.renderer = (
            renderer
            if renderer is not None
            else get_renderer(tokenizer, tools, sanitize=sanitize, template_kwargs=template_kwargs)
        )
        # keep: later turns see earlier reasoning as sampled (the trajectory is one sequence);
        # drop: it is hidden from later prompts as the family's template would render them
        # (the trajectory still holds every sampled token; hidden spans are listed per turn).
        self.reasoning = reasoning
        fam = self.renderer.family
        self._rule = reasoning_rule or (fam.reasoning if fam is not None else None)
        if reasoning == "drop" and self._rule is None:
            raise ValueError("reasoning='drop' needs a reasoning_rule (or a tokenizer of a known model family)")
        self._start(self.renderer.render_prompt(messages))

    def _start(self, prompt: Sequence[int]) -> None:
        self._hidden: list[tuple[int, int]] = []  # absolute [start, end) spans not sent to the model
        self._n_hidden = 0
        cap = max(256, 2 * len(prompt))
        self._ids = np.zeros(cap, dtype=np.int32)
        self._mask = np.zeros(cap, dtype=np.int8)
        self._lp = np.zeros(cap, dtype=np.float32)
        self._ids[: len(prompt)] = prompt
        self._n = self._n_prompt = len(prompt)
        self._turns: list[Turn] = []
        self._open = True  # a generation prompt is open: the next thing must be a generation
        self._last_abort = False
        self._json = _join_ids(prompt)
        self._view: TokenIds | None = None

    # -- buffers ---------------------------------------------------------------------
    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        cap = len(self._ids)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        for name in ("_ids", "_mask", "_lp"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: self._n] = old[: self._n]
            setattr(self, name, new)

    # -- properties ------------------------------------------------------------------
    @property
    def context_ids(self) -> np.ndarray:
        """What the model sees next: prompt + everything so far, minus hidden reasoning
        (read-only int32 view, with its JSON text cached)."""
        v = self._view
        if v is None or v.shape[0] != self._n - self._n_hidden:
            if self._hidden:
                parts, pos = [], 0
                for a, b in self._hidden:
                    parts.append(self._ids[pos:a])
                    pos = b
                parts.append(self._ids[pos : self._n])
                v = np.concatenate(parts).view(TokenIds)
                v.flags.writeable = False
                v.json_ids = "[" + _join_ids(v) + "]"
            else:
                v = self._ids[: self._n].view(TokenIds)
                v.flags.writeable = False
                v.json_ids = "[" + self._json + "]"
            self._view = v
        return v

    @property
    def hidden_spans(self) -> list[tuple[int, int]]:
        """Reasoning spans hidden from later prompts (``reasoning="drop"``), in response
        coordinates; a span may start at -1 when the template opened the block in the prompt."""
        p = self._n_prompt
        return [(a - p, b - p) for a, b in self._hidden]

    @property
    def num_tokens(self) -> int:
        return self._n

    @property
    def prompt_length(self) -> int:
        return self._n_prompt

    @property
    def response_length(self) -> int:
        return self._n - self._n_prompt

    @property
    def remaining_context(self) -> int:
        return self.max_context - (self._n - self._n_hidden)

    @property
    def turns(self) -> list[dict]:
        return [
            {
                "index": t.index,
                "span": [t.start, t.end],  # the trajectory field every handler reports
                "start": t.start,
                "end": t.end,
                "finish_reason": t.finish_reason,
                "backend": t.backend,
                "policy_version": t.policy_version,
                "latency_s": t.latency_s,
                "obs_start": t.obs_start,
                "obs_end": t.obs_end,
                "continuation": t.continuation,
                "hidden": list(t.hidden) if t.hidden is not None else None,
                "cause": t.cause,
            }
            for t in self._turns
        ]

    @property
    def num_turns(self) -> int:
        return len(self._turns)

    @property
    def awaiting_generation(self) -> bool:
        """True when the context ends with an open generation prompt (or a partial turn after an abort)."""
        return self._open

    @property
    def last_turn(self) -> Turn | None:
        return self._turns[-1] if self._turns else None

    # -- mutation --------------------------------------------------------------------
    def add_generation(self, g: GenerationLike, backend: str, policy_version: int) -> Turn:
        """Append the sampled ids exactly as returned (loss_mask 1, logprobs kept)."""
        if not self._open:
            raise ValueError("add_generation: no open assistant turn (call add_messages first)")
        ids = np.asarray(g.token_ids, dtype=np.int32).reshape(-1)
        lps = np.asarray(g.logprobs, dtype=np.float32).reshape(-1)
        k = ids.shape[0]
        if lps.shape[0] != k:
            raise ValueError(f"generation has {k} token ids but {lps.shape[0]} logprobs")
        self._reserve(k)
        n = self._n
        self._ids[n : n + k] = ids
        self._mask[n : n + k] = 1
        self._lp[n : n + k] = lps
        self._n = n + k
        if k:
            self._json = self._json + "," + _join_ids(ids) if self._json else _join_ids(ids)
        p = self._n_prompt
        turn = Turn(
            index=len(self._turns),
            start=n - p,
            end=n + k - p,
            finish_reason=str(g.finish_reason),
            backend=str(backend),
            policy_version=int(policy_version),
            latency_s=float(getattr(g, "latency_s", 0.0) or 0.0),
            continuation=self._last_abort,
        )
        self._turns.append(turn)
        self._last_abort = g.finish_reason == "abort"
        # After an abort the assistant message is still open: the next call continues it.
        self._open = self._last_abort
        return turn

    def _can_add_messages(self) -> bool:
        # After a generation (or a partial, aborted one); not before the first generation
        # and not twice in a row (the generation prompt is already open).
        return bool(self._turns) and (not self._open or self._last_abort)

    def render_messages(self, msgs: Sequence[dict]) -> list[int]:
        """The ids :meth:`add_messages` would append (no mutation)."""
        if not self._can_add_messages():
            raise ValueError("add_messages must follow a generation (and cannot be called twice in a row)")
        n = self._n
        ended_eot = n > self._n_prompt and int(self._ids[n - 1]) in self.renderer.end_ids
        return self.renderer.render_continuation(msgs, ended_with_eot=ended_eot)

    def _reasoning_span(self, last: int | None = None) -> tuple[int, int] | None:
        """Absolute span of the reasoning of the assistant message that just ended (or that
        ends with turn ``last``)."""
        rule = self._rule
        if rule is None:
            return None
        last = len(self._turns) - 1 if last is None else last
        first = last
        while first > 0 and self._turns[first].continuation:
            first -= 1
        p = self._n_prompt
        a, b = self._turns[first].start + p, self._turns[last].end + p
        enc = self.renderer.enc
        ids = self._ids
        close = enc.tokenizer.convert_tokens_to_ids(rule.close)
        open_ = enc.tokenizer.convert_tokens_to_ids(rule.open)
        hits = np.flatnonzero(ids[a:b] == close)
        if hits.size == 0:
            return None
        c = a + int(hits[0])
        if int(ids[a]) == open_:
            start = a
        elif a > 0 and int(ids[a - 1]) == open_:
            start = a - 1  # the template put the open tag in the generation prompt
        else:
            start = a
        end = c + 1 if rule.hide_close else c
        if rule.hide_whitespace:
            while end < b and not self.tokenizer.decode([int(ids[end])]).strip():
                end += 1
        return (start, end) if end > start else None

    def add_messages(self, msgs: Sequence[dict], *, check_context: bool = True) -> int:
        """Append new messages (tool observations / user turns) plus the next generation prompt.

        loss_mask 0, logprob 0. Raises :class:`ContextOverflow` without changing
        anything if the result would not fit ``max_context`` and ``check_context``.
        Returns the number of tokens appended.
        """
        if not msgs:
            raise ValueError("add_messages: no messages")
        ids = self.render_messages(msgs)
        k = len(ids)
        span = self._reasoning_span() if self.reasoning == "drop" else None
        hide = span[1] - span[0] if span else 0
        if check_context and self._n - self._n_hidden - hide + k > self.max_context:
            raise ContextOverflow(
                f"observation of {k} tokens does not fit: {self._n} used of {self.max_context}",
                tokens=self._n - self._n_hidden - hide + k,
                limit=self.max_context,
            )
        if span:
            self._hidden.append(span)
            self._n_hidden += hide
            last = self._turns[-1]
            last.hidden = (span[0] - self._n_prompt, span[1] - self._n_prompt)
        self._reserve(k)
        n = self._n
        self._ids[n : n + k] = ids
        # mask / logprobs are already zero in fresh buffer space
        self._mask[n : n + k] = 0
        self._lp[n : n + k] = 0.0
        self._n = n + k
        if k:
            self._json = self._json + "," + _join_ids(ids) if self._json else _join_ids(ids)
        last = self._turns[-1]
        p = self._n_prompt
        last.obs_start, last.obs_end = n - p, n + k - p
        self._open = True
        self._last_abort = False
        return k

    def fork(self, turns: int, messages: Sequence[dict]) -> "Conversation":
        """A new conversation at a shared prefix: its prompt is this one's context after the
        assistant message that ends with turn ``turns - 1`` (the sampled ids verbatim; reasoning
        hidden as :meth:`add_messages` would hide it) followed by ``messages`` rendered with the
        template's delimiters and the next generation prompt: the ids this conversation would
        have had, had it been extended by ``messages`` right after that message. Raises
        :class:`TemplateError` when the template cannot render them incrementally and
        :class:`ContextOverflow` when they do not fit; this conversation is never changed (it
        may be extended concurrently: only ids before the cut are read)."""
        if not messages:
            raise ValueError("fork: no messages")
        tlist = self._turns
        if not 0 < turns <= len(tlist) or tlist[turns - 1].finish_reason == "abort":
            raise ValueError(f"fork: turn {turns - 1} does not end an assistant message")
        p = self._n_prompt
        cut = p + tlist[turns - 1].end
        buf = self._ids  # add_generation may swap in a larger buffer meanwhile: the prefix is in both
        ended_eot = cut > p and int(buf[cut - 1]) in self.renderer.end_ids
        hidden = [(a, b) for a, b in self._hidden if b <= cut]
        if self.reasoning == "drop":
            span = self._reasoning_span(turns - 1)
            if span and span not in hidden:
                hidden.append(span)
        parts, pos = [], 0
        for a, b in sorted(hidden):
            parts.append(buf[pos:a])
            pos = b
        parts.append(buf[pos:cut])
        rest = self.renderer.render_continuation(messages, ended_with_eot=ended_eot)
        prompt = np.concatenate(parts + [np.asarray(rest, dtype=np.int32)])
        if len(prompt) > self.max_context:
            raise ContextOverflow(f"the fork's prompt of {len(prompt)} tokens does not fit {self.max_context}")
        new = object.__new__(Conversation)
        new.tokenizer, new.max_context, new.renderer = self.tokenizer, self.max_context, self.renderer
        new.reasoning, new._rule = self.reasoning, self._rule
        new._start(prompt)
        return new

    def splice(self, pieces: Sequence[tuple[Sequence[int], Sequence[dict]]]) -> "Conversation":
        """Append assistant messages sampled in another conversation, each as its sampled ids
        verbatim, each followed by messages rendered with the template's delimiters; all of it
        prompt (``loss_mask`` 0), the reasoning hidden as :meth:`add_messages` would hide it. The
        result is the prompt an extension would have built had those replies been sampled here:
        a compaction request with other tools or another system prompt still shows the model its
        own ids, never a re-encoding of their text. ``pieces``: ``(ids, messages)``, each with at
        least one message. Only before the first generation; raises :class:`TemplateError` when
        the template cannot render the messages incrementally and :class:`ContextOverflow` when
        they do not fit (the conversation is then unusable)."""
        if self._turns or not self._open:
            raise ValueError("splice: only into a prompt that awaits its first generation")
        for ids, msgs in pieces:
            if not msgs:
                raise ValueError("splice: a reply must be followed by messages")
            self.add_generation(_Spliced(ids), "", 0)
            self.add_messages(msgs)
        self._start(np.array(self.context_ids, dtype=np.int32))
        return self

    def set_last_finish_reason(self, reason: str, cause: str | None = None) -> None:
        if self._turns:
            self._turns[-1].finish_reason = reason
            if cause is not None:
                self._turns[-1].cause = cause

    # -- output ----------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        p, n = self._n_prompt, self._n
        return {
            "prompt_ids": self._ids[:p].copy(),
            "response_ids": self._ids[p:n].copy(),
            "loss_mask": self._mask[p:n].copy(),
            "logprobs": self._lp[p:n].copy(),
        }

    def decode(self, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(self._ids[: self._n].tolist(), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Conversation(prompt={self._n_prompt}, response={self._n - self._n_prompt}, "
            f"turns={len(self._turns)}, max_context={self.max_context})"
        )
