"""A learnable toy task for trainer integration tests and the GRPO example.

Single turn, no sandbox, one LLM call. The reward is computed from token ids only, so the
daemons need no tokenizer (the trainer renders the prompt, token in / token out).

Instance fields::

    {"prompt_ids": [ints],            # the rendered prompt (required unless messages+tokenizer)
     "messages": [...], "tokenizer": "DIR",   # alternative: render with the chat template
     "target_ids": [ints],            # the target token set
     "reward": "fraction",            # "fraction" (default) | "prefix" | "any"
     "target_prefix_ids": [ints],     # for reward == "prefix"
     "sampling": {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": null}}

Rewards (all in [0, 1]):

* ``fraction``: the fraction of sampled response tokens that are in ``target_ids``
  (the denominator is the number of tokens sampled, the end-of-turn token included).
* ``any``: 1 if any sampled token is in ``target_ids``.
* ``prefix``: 1 if the response starts with ``target_prefix_ids``.

Why ``fraction`` is learnable by a tiny random policy on CPU: with ``target_ids`` = the ten
digit tokens, a randomly initialised 130k-parameter Qwen2 already emits a digit in about
2-3% of its samples, so a GRPO group of 8 x 8 tokens usually contains a sample with a
higher reward than its siblings; the advantage then pushes up exactly the target tokens'
logits (tied embeddings make that a shared direction across positions), which compounds:
~2% -> ~100% digits in 6-8 updates at Adam lr 1e-2 (see examples/train_tiny_grpo.py).

``sampling`` uses the same key and fields as the tool-agent handlers, so a trainer sets
temperature/max_tokens the same way for every handler.
"""
from __future__ import annotations

import numpy as np

from rolloutd.handlers.base import AgentHandler, JobContext


class ToyHandler(AgentHandler):
    name = "toy"
    needs_llm = True
    needs_sandbox = False
    eval_needs_sandbox = False
    max_tokens = 8

    # -- helpers ----------------------------------------------------------------------
    def prompt_ids(self, ctx: JobContext) -> np.ndarray:
        inst = ctx.instance
        if inst.get("prompt_ids") is not None:
            ids = np.asarray(inst["prompt_ids"], dtype=np.int32).reshape(-1)
        elif inst.get("messages") is not None:
            from rolloutd.handlers.agent import tokenizer_at
            from rolloutd.llm.conversation import get_renderer

            path = inst.get("tokenizer") or self.config.get("tokenizer")
            if not path:
                raise ValueError("toy: messages need a tokenizer (instance.tokenizer or [handlers.toy] tokenizer)")
            ids = np.asarray(get_renderer(tokenizer_at(str(path))).render_prompt(inst["messages"]), dtype=np.int32)
        else:
            raise ValueError("toy: the instance needs prompt_ids (or messages + tokenizer)")
        if ids.size == 0:
            raise ValueError("toy: empty prompt")
        return ids

    def sampling(self, ctx: JobContext):
        from rolloutd.llm.client import SamplingParams

        from rolloutd.handlers.agent import sampling_map

        sp = sampling_map(ctx.instance)  # numbers checked against their ranges
        seed = sp.get("seed")
        if seed is not None:  # distinct samples of one instance must not share a seed
            seed = int(seed) + int(ctx.job.sample_index)
        return SamplingParams(max_tokens=int(sp.get("max_tokens", self.max_tokens)),
                              temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                              top_k=int(sp.get("top_k", -1)), seed=seed,
                              stop_token_ids=[int(x) for x in sp.get("stop_token_ids", [])])

    # -- phases -----------------------------------------------------------------------
    async def run(self, ctx: JobContext):
        prompt = self.prompt_ids(ctx)
        g, backend, version = await ctx.llm(prompt, self.sampling(ctx))
        ids = np.asarray(g.token_ids, dtype=np.int32)
        traj = ctx.trajectory
        traj["prompt_ids"] = prompt
        traj["response_ids"] = ids
        traj["logprobs"] = np.asarray(g.logprobs, dtype=np.float32)
        traj["loss_mask"] = np.ones(len(ids), np.int8)
        traj["turns"] = [{"span": [0, int(len(ids))], "finish_reason": g.finish_reason, "backend": backend,
                          "policy_version": version}]
        traj["policy_version"] = version
        traj["metrics"].update(turns=1, llm_s=round(float(g.latency_s), 6), stop_reason=g.finish_reason)

    async def eval(self, ctx: JobContext):
        reward, details = score(ctx.instance, np.asarray(ctx.trajectory["response_ids"]))
        ctx.set_reward(reward, **details)


def score(instance: dict, response_ids: np.ndarray) -> tuple[float, dict]:
    """The toy reward of one response (pure function; the trainer may call it too)."""
    kind = instance.get("reward", "fraction")
    ids = np.asarray(response_ids, dtype=np.int64).reshape(-1)
    if kind == "prefix":
        prefix = np.asarray(instance.get("target_prefix_ids") or [], dtype=np.int64)
        if prefix.size == 0:
            raise ValueError("toy: reward 'prefix' needs target_prefix_ids")
        ok = ids.size >= prefix.size and bool(np.array_equal(ids[:prefix.size], prefix))
        return float(ok), {"kind": kind, "hits": int(ok), "tokens": int(ids.size)}
    if kind not in ("fraction", "any"):
        raise ValueError(f"toy: unknown reward {kind!r} (fraction, any, prefix)")
    target = np.asarray(instance.get("target_ids") or [], dtype=np.int64)
    if target.size == 0:
        raise ValueError(f"toy: reward {kind!r} needs target_ids")
    hits = int(np.isin(ids, target).sum())
    if kind == "any":
        return float(hits > 0), {"kind": kind, "hits": hits, "tokens": int(ids.size)}
    return (hits / ids.size if ids.size else 0.0), {"kind": kind, "hits": hits, "tokens": int(ids.size)}
