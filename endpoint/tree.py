"""One job's conversation tree: the segments its requests were placed in, and the replies we sampled.

A *segment* is a :class:`Conversation` plus the messages it represents, where the assistant
messages are the replies we sampled. A request whose ``messages`` start with exactly one
segment's messages (our replies sent back as text or as structured ``tool_calls``, the same
tools; the longest such segment that no other request is extending) *extends* it
(:meth:`ConversationTree.place`); one that repeats a segment's messages up to one of its
replies and then goes another way *forks* it (:meth:`ConversationTree.fork`); any other opens
a new segment, with our replies spliced in as their sampled ids where the template allows.
The session (:mod:`rolloutd.endpoint.session`) calls these in its endpoint thread, one per job
at a time. docs/HARNESS.md says what a trainer does with segments.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from ..llm.conversation import Conversation
from ..llm.errors import ContextOverflow
from .bounds import EndpointLimits, too_long
from ..llm.encode_worker import EncodeRefused
from .wire import Msg, bad

log = structlog.get_logger("rolloutd.llm")
_CUT = operator.itemgetter(0)


def _same_tools(seg: Segment, tools: list | None) -> bool:
    """``tools`` equals ``seg.tools``. An equal list becomes ``seg.tools``: the job's next body
    resends this very object (endpoint/resent.py), compared by identity then (comparing a coding
    harness's 10-40 KB of tools item by item took ~50 us per conversation per request)."""
    if tools is seg.tools:
        return True
    if tools != seg.tools:
        return False
    seg.tools = tools
    return True


def _chars(m: Msg) -> int:
    """The characters of a message that rendering it reads (text, reasoning, calls' arguments)."""
    return len(m.content) + len(m.reasoning or "") + sum(len(a) for _, a in m.calls)


@dataclass(slots=True, eq=False)
class Gen:
    """One assistant message we returned: what the agent may send back."""

    content: str  # message.content as returned ("" for null)
    raw: str  # the full sampled text (tool-call markup included)
    calls: tuple  # ((name, canonical JSON arguments), ...) as returned in tool_calls
    n_tokens: int
    ids: np.ndarray | None = None  # the sampled ids (what a new segment's prompt holds for it)
    reused: bool = False
    reencoded: bool = False
    seen: Msg | None = None  # the last message found to send this reply back (messages never change once parsed)

    def matches(self, m: Msg) -> bool:
        if m is self.seen:  # the same parsed message as last request's (a history cache reused it)
            return True
        if m.role != "assistant":
            return False
        c = m.content.strip()
        if m.calls:
            ok = m.calls == self.calls and c == self.content.strip()
        else:
            ok = c == self.raw.strip() or (not self.calls and c == self.content.strip())
        if ok:
            self.seen = m
        return ok


class Segment:
    """A self-consistent token sequence: a Conversation (chat) or one raw completion."""

    __slots__ = ("busy", "closed", "conv", "cuts", "entries", "index", "last_call", "matched", "opened_call", "raw",
                 "tools")

    def __init__(self, index: int, conv: Conversation | None, tools: list | None, entries: list) -> None:
        self.index = index
        self.conv = conv
        self.tools = tools
        self.entries: list[Msg | Gen] = entries
        self.closed = False  # a request failed mid-way: never extended again
        self.busy = False  # a request is extending it now
        self.opened_call = self.last_call = 0  # the session's request counter when opened / last extended
        self.raw: dict | None = None  # /v1/completions: arrays and the one turn
        # where a fork may start: (entries, conv turns) just after each reply sampled in it (append-only)
        self.cuts: list[tuple[int, int]] = []
        # (msgs, n): entries[:n] matched msgs[:n] (entries only grow, so they still do): a request
        # resending those very messages (the history cache's objects) is compared from n on
        self.matched: tuple[list[Msg], int] | None = None

    @property
    def n_turns(self) -> int:
        if self.conv is not None:
            return self.conv.num_turns
        return 1 if self.raw is not None else 0

    def record(self) -> dict:
        if self.conv is not None:
            d: dict[str, Any] = dict(self.conv.arrays())
            d["turns"] = turns = self.conv.turns
            end = turns[-1]["end"] if turns else 0
            if turns and len(d["response_ids"]) > end:
                # messages rendered for a call that never sampled (it failed and was not sent again):
                # the trajectory ends with the last sampled turn, as the built-in loop's does
                for k in ("response_ids", "loss_mask", "logprobs"):
                    d[k] = d[k][:end]
                turns[-1]["obs_start"] = turns[-1]["obs_end"] = None
        else:
            assert self.raw is not None
            d = dict(self.raw)
        return d

class ConversationTree:
    """A job's segments and the replies sampled into them; ``metrics`` is the session's dict
    (``assistant_tokens_reused``/``_reencoded``, ``forks``, ``fork_fallbacks`` are counted here)."""

    def __init__(self, tokenizer: Any, call_ids: Any, limits: EndpointLimits, conv_options: dict,
                 metrics: dict) -> None:
        self.tokenizer = tokenizer
        self.call_ids = call_ids  # the model's call ids <-> the agent's (toolparse.CallIds)
        self.limits = limits
        self.conv_options = conv_options  # extra Conversation(...) keywords (model-family options)
        self.metrics = metrics
        self.segments: list[Segment] = []
        self.gens: list[Gen] = []
        self.calls = 0  # requests placed so far: the clock of the segments' side-call accounting

    def add_reply(self, seg: Segment, gen: Gen) -> None:
        """Record a reply sampled into ``seg``: a later request may send it back, or fork after it."""
        seg.entries.append(gen)
        seg.cuts.append((len(seg.entries), seg.conv.num_turns))
        self.gens.append(gen)

    def continued(self, msgs: list[Msg], tools: list | None) -> Segment | None:
        """The open conversation ``msgs`` continues, the longest one if several do: its entries
        are a prefix of ``msgs`` (our replies compared as values) with the same tools, and no
        other request is extending it right now (a concurrent continuation of the same history
        is a fork: it gets its own segment)."""
        best = None
        n = len(msgs)
        for seg in reversed(self.segments):
            if seg.conv is None or seg.closed or seg.busy or not _same_tools(seg, tools):
                continue
            entries = seg.entries
            k = len(entries)
            if k > n or (best is not None and k <= len(best.entries)):
                continue
            if k == n and not seg.conv.awaiting_generation:
                continue  # nothing new to add: a repeated request (its own retry) opens a new segment
            if self._prefix_of(seg, msgs):
                best = seg
        return best

    @staticmethod
    def _prefix_of(seg: Segment, msgs: list[Msg]) -> bool:
        """``seg``'s entries are a prefix of ``msgs`` (our replies compared as values)."""
        entries, start = seg.entries, 0
        if seg.matched is not None:
            done, j = seg.matched
            if msgs[:j] == done[:j]:  # C speed: the same objects (or equal messages) as a matched request's
                start = j
        # `e is m`: a message the request's parse reused from the last request's (chat) is this entry
        if all((e.matches(m) if type(e) is Gen else (e is m or e.key == m.key))
               for e, m in zip(entries[start:], msgs[start:])):
            seg.matched = (msgs, len(entries))
            return True
        return False

    def place(self, msgs: list[Msg], tools: list | None, max_chars: int | None = None) -> Segment | None:
        """The conversation this request continues (its new messages appended), or a new one;
        marked busy until the request is done. Runs in an endpoint thread, one per job at a time,
        or on the loop with ``max_chars``: then only an extension whose new messages hold at most
        that many characters is placed, and None (nothing changed) is returned for any other."""
        seg = self.continued(msgs, tools)
        fork = self.fork_point(msgs, tools, len(seg.entries) if seg is not None else 0)
        if max_chars is not None and (fork is not None or seg is None
                                      or sum(map(_chars, msgs[len(seg.entries):])) > max_chars):
            return None
        self.calls += 1
        if fork is not None:
            forked = self.fork(*fork, msgs, tools)
            if forked is not None:
                forked.busy, forked.opened_call = True, self.calls
                return forked
        if seg is not None:
            entries = seg.entries
            tail = msgs[len(entries):]
            conv = seg.conv
            if conv.awaiting_generation and not tail:  # the same request again after a failure
                seg.busy, seg.last_call = True, self.calls
                return seg
            if tail and not conv.awaiting_generation:
                try:
                    conv.add_messages(self.call_ids.prepare([m.template_dict() for m in tail]))
                except ContextOverflow as e:
                    if e.tokens is None:
                        raise bad(str(e), "messages", "context_length_exceeded") from None
                    raise too_long(e.tokens, self.limits.max_context, str(e)) from None
                except EncodeRefused:
                    raise
                except Exception as e:  # noqa: BLE001 - the template refused them (e.g. raise_exception on role order)
                    raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                              "messages") from None
                for e in entries:
                    if type(e) is Gen and not e.reused:
                        e.reused = True
                        self.metrics["assistant_tokens_reused"] += e.n_tokens
                entries.extend(tail)
                seg.busy, seg.last_call = True, self.calls
                return seg
        seg = self.new_segment(msgs, tools)
        seg.busy, seg.opened_call = True, self.calls
        return seg

    def new_segment(self, msgs: list[Msg], tools: list | None) -> Segment:
        tds = self.call_ids.prepare([m.template_dict() for m in msgs])
        conv, spliced = None, self.replies(msgs, 0)
        if spliced:  # our replies go in as their sampled ids, the rest rendered as an extension would
            try:
                conv = Conversation(self.tokenizer, tds[:spliced[0][0]], tools, self.limits.max_context,
                                    **self.conv_options).splice(self.pieces(spliced, tds))
            except EncodeRefused:
                raise
            except Exception as e:  # noqa: BLE001 - TemplateError, raise_exception, ContextOverflow
                log.info("endpoint_replies_rendered_from_text", messages=len(msgs), error=f"{type(e).__name__}: {e}")
                conv, spliced = None, []
        try:
            if conv is None:
                conv = Conversation(self.tokenizer, tds, tools, self.limits.max_context, **self.conv_options)
        except EncodeRefused:
            raise
        except Exception as e:  # noqa: BLE001 - TemplateError, or the template's own raise_exception
            raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                      "messages") from None
        if conv.remaining_context <= 0:
            raise too_long(conv.num_tokens, self.limits.max_context)
        # earlier requests that never sampled (and are not being served): nothing to keep
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg = Segment(len(self.segments), conv, tools, list(msgs))
        if seg.index:
            log.info("endpoint_segment_opened", segment=seg.index, messages=len(msgs), prompt_tokens=conv.num_tokens,
                     replies_spliced=len(spliced))
        self.count_spliced(msgs, spliced, 0)
        self.segments.append(seg)
        return seg

    def gen_for(self, m: Msg) -> Gen | None:
        """The reply of ours that ``m`` sends back (the latest, if the same text was sampled twice)."""
        if m.role != "assistant":
            return None
        return next((g for g in reversed(self.gens) if g.matches(m)), None)

    def replies(self, msgs: list[Msg], start: int) -> list[tuple[int, Gen]]:
        """Our replies in ``msgs[start:]`` that a new prompt can hold as their sampled ids: each
        after at least one message of the prompt and followed by a message that is not an
        assistant's (the next piece to render)."""
        out: list[tuple[int, Gen]] = []
        for j in range(start + 1, len(msgs) - 1):
            if msgs[j + 1].role != "assistant" and (g := self.gen_for(msgs[j])) is not None and g.ids is not None:
                out.append((j, g))
        return out

    @staticmethod
    def pieces(spliced: list[tuple[int, Gen]], tds: list[dict]) -> list[tuple[Any, list[dict]]]:
        """``Conversation.splice``'s pieces: each reply's ids and the messages up to the next one."""
        ends = [j for j, _ in spliced[1:]] + [len(tds)]
        return [(g.ids, tds[j + 1:end]) for (j, g), end in zip(spliced, ends)]

    def count_spliced(self, msgs: list[Msg], spliced: list[tuple[int, Gen]], start: int) -> None:
        """Metrics for a prompt built from ``msgs[start:]``: spliced replies reused, others of ours
        rendered from their text re-encoded (each message counted once)."""
        at = {j for j, _ in spliced}
        for _, g in spliced:
            if not g.reused:
                g.reused = True
                self.metrics["assistant_tokens_reused"] += g.n_tokens
        self.count_reencoded([m for j, m in enumerate(msgs[start:], start) if j not in at])

    def count_reencoded(self, msgs: list[Msg]) -> None:
        """Our replies among ``msgs``, rendered from their text into a new segment (once each)."""
        for m in msgs:
            if m.role == "assistant":
                g = next((g for g in self.gens if g.matches(m)), None)
                if g is not None and not g.reencoded:
                    g.reencoded = True
                    self.metrics["assistant_tokens_reencoded"] += g.n_tokens

    def fork_point(self, msgs: list[Msg], tools: list | None, beat: int) -> tuple[Segment, int, int] | None:
        """The open conversation sharing the longest prefix with ``msgs`` that ends just after
        one of its sampled replies and is longer than ``beat`` messages (an extension's): that
        conversation, the prefix's length in messages and its number of turns. Busy and closed
        conversations count too: a prefix already sampled never changes."""
        best: tuple[Segment, int, int] | None = None
        n = len(msgs)
        for seg in list(self.segments):
            cuts = list(seg.cuts)  # appended on the loop while this runs in an endpoint thread
            if seg.conv is None or not cuts or not _same_tools(seg, tools):
                continue
            floor = best[1] if best is not None else beat
            i = bisect.bisect_left(cuts, n, key=_CUT)  # cuts ascend (add_reply): the last one before message n
            top = cuts[i - 1][0] if i else 0
            if top <= floor:
                continue
            same = 0
            for e, m in zip(seg.entries[:top], msgs):
                if not (e.matches(m) if type(e) is Gen else (e is m or e.key == m.key)):
                    break
                same += 1
            cut = max(((c, t) for c, t in cuts if c <= same and c < n), default=None)
            if cut is not None and cut[0] > floor:
                best = (seg, cut[0], cut[1])
        return best

    def fork(self, parent: Segment, g: int, turns: int, msgs: list[Msg], tools: list | None) -> Segment | None:
        """A new segment whose prompt is ``parent``'s ids up to its reply that ends message ``g``
        (sampled ids verbatim) plus the rest of ``msgs`` rendered with the template's delimiters;
        None (counted in ``fork_fallbacks``) when the template cannot render it that way or it
        does not fit: the request then gets today's segment rendered from its messages."""
        tail = msgs[g:]
        spliced = self.replies(msgs, g)  # replies of ours sampled elsewhere, in the fork's own messages
        try:
            tds = self.call_ids.prepare([m.template_dict() for m in msgs])
            conv = parent.conv.fork(turns, tds[g:spliced[0][0]] if spliced else tds[g:])
            if spliced:
                conv.splice(self.pieces(spliced, tds))
            if conv.remaining_context <= 0:
                raise ContextOverflow(f"the fork's prompt of {conv.num_tokens} tokens leaves no room")
        except EncodeRefused:
            raise
        except Exception as e:  # noqa: BLE001 - TemplateError, the template's raise_exception, ContextOverflow
            self.metrics["fork_fallbacks"] += 1
            log.info("endpoint_fork_fell_back", parent=parent.index, messages=g, error=f"{type(e).__name__}: {e}")
            return None
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg = Segment(len(self.segments), conv, tools, parent.entries[:g] + list(tail))
        self.metrics["forks"] += 1
        for e in seg.entries[:g]:
            if type(e) is Gen and not e.reused:
                e.reused = True
                self.metrics["assistant_tokens_reused"] += e.n_tokens
        self.count_spliced(msgs, spliced, g)
        log.info("endpoint_segment_forked", segment=seg.index, parent=parent.index, messages=g,
                 prompt_tokens=conv.num_tokens)
        self.segments.append(seg)
        return seg

    def add_raw(self, seg: Segment) -> None:
        self.segments = [s for s in self.segments if s.busy or s.n_turns > 0]
        seg.index = len(self.segments)
        self.segments.append(seg)
