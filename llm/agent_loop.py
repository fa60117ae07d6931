"""The multi-turn agent loop: generate, parse tool calls, execute, append observations.

The loop is agnostic of routing and failover: ``generate(prompt_ids, params)`` returns
``(Generation, backend_id, policy_version)`` and may raise; the run daemon passes a
session that leases a backend from the router and fails over on ``BackendError``.

Stop reasons (``LoopResult.stop_reason``):

* ``"no_tool_call"``: the model answered without calling a tool (``final_text`` is the answer:
  the message's content, without reasoning, call markup or special tokens);
* ``"length"``: the model hit ``params.max_tokens`` (the per-turn budget) without a tool call;
* ``"max_turns"``: ``max_turns`` assistant messages were generated; tool calls in the last one
  are not executed (the model would never see their result);
* ``"context_overflow"``: the context window is full: the generation was cut by it (that turn's
  ``finish_reason`` is ``"context_overflow"``), the server rejected the prompt as too long, or the
  observations do not fit (then they are not appended). Never reported as a server error.

A generation that comes back with ``finish_reason == "abort"`` (server-side abort, e.g. a
weight swap) keeps its tokens (valid samples of the policy version that produced them) and the
same assistant message is continued by the next call, recorded as a separate turn with
``continuation=True`` and its own backend/policy_version. More than ``max_aborts`` aborts in a
row raise ``BackendError``.

What the parser reads comes from the sampled ids, decoded with the conversation's
tokenizer (:func:`~rolloutd.llm.toolparse.parse_ids`), never from the backend's ``text``
field, whatever the backend's detokenization settings: the trainer trains on those ids.
A parser that types arguments from the tool schemas (Qwen3-Coder) gets the
conversation's tools.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np
import structlog

from .client import BackendError, ContextOverflow, Generation, SamplingParams, with_timeout
from .conversation import Conversation
from .toolparse import ToolCall, ToolParser, parse_ids

log = structlog.get_logger("rolloutd.llm")

GenerateFn = Callable[[Any, SamplingParams], Awaitable[tuple[Generation, str, int]]]
ExecuteToolFn = Callable[[ToolCall], Awaitable[str]]


@dataclass(slots=True)
class LoopResult:
    arrays: dict[str, np.ndarray]
    turns: list[dict]
    metrics: dict[str, float]
    stop_reason: str
    final_text: str
    messages: list[dict] = field(default_factory=list)  # observations sent, for debugging/eval


async def run_agent_loop(
    generate: GenerateFn,
    conv: Conversation,
    parser: ToolParser,
    execute_tool: ExecuteToolFn,
    params: SamplingParams,
    max_turns: int,
    tokenizer: Any,
    *,
    tool_timeout: float | None = None,
    max_aborts: int = 3,
    keep_messages: bool = False,
) -> LoopResult:
    if not conv.awaiting_generation:
        raise ValueError("run_agent_loop: the conversation does not end with an open assistant turn")
    metrics: dict[str, float] = {
        "turns": 0,
        "tool_calls": 0,
        "malformed_tool_calls": 0,
        "llm_s": 0.0,
        "tools_s": 0.0,
        "aborts": 0,
    }
    stop_reason = "max_turns"
    final_text = ""
    sent: list[dict] = []
    parser = parser.with_tools(conv.renderer.tools) if hasattr(parser, "with_tools") else parser
    parts: list[int] = []  # ids of the current assistant message (several parts after aborts)

    def answer(ids: list[int]) -> str:
        return parse_ids(parser, ids, tokenizer).content or "" if ids else ""

    used = 0  # tokens already generated in the current assistant message
    aborts = 0
    n_turns = 0
    perf = time.perf_counter

    while n_turns < max_turns:
        remaining = conv.remaining_context
        budget = params.max_tokens - used
        max_new = min(budget, remaining)
        if remaining <= 0:
            stop_reason = "context_overflow"
            if parts:
                conv.set_last_finish_reason("context_overflow")
                final_text = answer(parts)
            break
        p = params if max_new == params.max_tokens else params.replace(max_tokens=max_new)
        t0 = perf()
        try:
            g, backend, policy_version = await generate(conv.context_ids, p)
        except ContextOverflow as e:
            log.info("agent_context_overflow_rejected", error=str(e)[:200], context=conv.num_tokens)
            stop_reason = "context_overflow"
            final_text = answer(parts)
            break
        finally:
            metrics["llm_s"] += perf() - t0
        k = len(g.token_ids)
        if g.finish_reason == "length" and max_new < budget and k >= max_new:
            g.finish_reason = "context_overflow"
        conv.add_generation(g, backend, policy_version)
        parts.extend(np.asarray(g.token_ids).tolist())
        if g.finish_reason == "abort":
            aborts += 1
            metrics["aborts"] += 1
            used += k
            log.info("agent_generation_aborted", backend=backend, tokens=k, aborts=aborts)
            if aborts > max_aborts:
                raise BackendError(f"generation aborted {aborts} times in a row", backend=backend)
            continue
        aborts = 0
        used = 0
        n_turns += 1
        metrics["turns"] = n_turns
        res = parse_ids(parser, parts, tokenizer)
        parts = []
        final_text = res.content or ""
        if g.finish_reason == "context_overflow":
            stop_reason = "context_overflow"
            break
        if not res.has_actions:
            stop_reason = "no_tool_call" if g.finish_reason == "stop" else "length"
            break
        if n_turns >= max_turns:
            stop_reason = "max_turns"
            break
        msgs: list[dict] = []
        for kind, item in res.items:
            if kind == "call":
                t1 = perf()
                try:
                    if tool_timeout is not None:  # not wait_for: on 3.11 it can swallow the job's cancel
                        obs = await with_timeout(execute_tool(item), tool_timeout)
                    else:
                        obs = await execute_tool(item)
                except asyncio.TimeoutError:
                    obs = f"Error: tool call {item.name!r} timed out after {tool_timeout:g}s."
                finally:
                    metrics["tools_s"] += perf() - t1
                metrics["tool_calls"] += 1
                msgs.append({"role": "tool", "name": item.name, "tool_call_id": item.id,
                             "content": obs if isinstance(obs, str) else str(obs)})
            else:
                metrics["malformed_tool_calls"] += 1
                msgs.append({"role": "tool", "content": item})
        try:
            conv.add_messages(msgs)
        except ContextOverflow:
            stop_reason = "context_overflow"
            break
        if keep_messages:
            sent.extend(msgs)
    else:
        stop_reason = "max_turns"

    return LoopResult(
        arrays=conv.arrays(),
        turns=conv.turns,
        metrics=metrics,
        stop_reason=stop_reason,
        final_text=final_text,
        messages=sent,
    )
