"""A handler with no sandbox and no LLM whose phase latencies and failures are drawn from
distributions the instance gives. Tests and benchmarks drive the pipeline with it.

Instance fields (all optional)::

    {"init": {"dist": "constant", "value": 0.01},
     "run":  {"dist": "lognormal", "mu": -3, "sigma": 1.0},
     "eval": {"dist": "uniform", "low": 0.0, "high": 0.002},
     "fail": {"init": 0.05, "run": 0.0, "eval": 0.0},   # probability of raising in the phase
     "reward": 1.0, "seed": 7,
     "trace": true}   # each phase's start and end (time.monotonic) in eval_details.drawn

Any other key is refused (the job fails in init with ``SyntheticInstanceError`` naming it):
a misspelt ``"rnu"`` would otherwise silently run with no latency at all.
"""
from __future__ import annotations

import math
import random
import time

from rolloutd.handlers.base import AgentHandler, JobContext
from rolloutd.handlers.precise_sleep import precise_sleep


class SyntheticFailure(RuntimeError):
    pass


class SyntheticInstanceError(ValueError):
    """The instance has a key this handler does not know."""


def draw(spec, rng: random.Random) -> float:
    """A latency in seconds from ``{"dist": ..., ...}`` or a bare number."""
    if spec is None:
        return 0.0
    if isinstance(spec, (int, float)):
        return max(0.0, float(spec))
    if not isinstance(spec, dict):
        raise ValueError(f"latency spec must be a number or a map, not {type(spec).__name__}")
    dist = spec.get("dist", "constant")
    scale = float(spec.get("scale", 1.0))
    if dist == "constant":
        v = float(spec.get("value", 0.0))
    elif dist == "uniform":
        v = rng.uniform(float(spec.get("low", 0.0)), float(spec.get("high", 0.0)))
    elif dist == "lognormal":
        v = rng.lognormvariate(float(spec.get("mu", 0.0)), float(spec.get("sigma", 1.0)))
    else:
        raise ValueError(f"unknown latency distribution {dist!r} (constant, uniform, lognormal)")
    return max(0.0, v * scale)


_UNSEEDED = random.Random()
MAX_LATENCY_S = 86400.0  # a day: a phase latency beyond any job budget is a mistake, not a test
_INF = float("inf")


def _range(key: str, path: str) -> tuple[float, float]:
    """The allowed range of the instance number at ``path`` (docs/HANDLERS.md, synthetic)."""
    leaf = path.rpartition(".")[2]
    if key == "fail":
        return 0.0, 1.0  # a probability
    if key in ("init", "run", "eval", "think"):
        if leaf in ("mu", "sigma"):  # lognormal: e^(mu + a few sigma) stays within a day
            return (-50.0, math.log(MAX_LATENCY_S)) if leaf == "mu" else (0.0, 5.0)
        return 0.0, MAX_LATENCY_S  # a bare latency, value, low, high, scale
    if key == "llm_calls":
        return 0.0, 1e6
    if key in ("max_tokens", "prompt_len"):
        return 1.0, 1 << 20
    return -_INF, _INF  # reward (finite), seed


class SyntheticHandler(AgentHandler):
    name = "synthetic"
    instance_keys = frozenset({"init", "run", "eval", "fail", "reward", "seed", "trace"})

    def _check_instance(self, ctx: JobContext):
        unknown = set(ctx.instance) - self.instance_keys
        if unknown:
            raise SyntheticInstanceError(f"{self.name}: unknown instance keys {sorted(unknown)}; "
                                         f"known: {sorted(self.instance_keys)}")
        if not isinstance(ctx.instance.get("trace", False), bool):
            raise SyntheticInstanceError(f"{self.name}: instance trace is {ctx.instance['trace']!r}; true or false")
        for key, val in ctx.instance.items():  # a NaN reward would reach the trainer; an inf latency hangs
            for path, v in ((key, val),) if not isinstance(val, dict) else ((f"{key}.{k}", x) for k, x in val.items()):
                if isinstance(v, float) and not math.isfinite(v):
                    raise SyntheticInstanceError(f"{self.name}: instance {path} is {v!r}; numbers must be finite")
                lo, hi = _range(key, path)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not lo <= v <= hi:
                    # {"run": 1e308} slept past any budget, {"run": -5} passed as 0 (issue 38)
                    raise SyntheticInstanceError(f"{self.name}: instance {path} is {v!r}; must be in [{lo:g}, {hi:g}]")

    def _rng(self, ctx: JobContext, phase: str) -> random.Random:
        seed = ctx.instance.get("seed")
        if seed is None:
            return _UNSEEDED  # a fresh Random() seeds itself from os.urandom: ~20 us per phase
        return random.Random(f"{seed}:{ctx.job.instance_id}:{ctx.job.sample_index}:{phase}")

    async def _phase(self, ctx: JobContext, phase: str):
        start = time.monotonic()
        rng = self._rng(ctx, phase)
        delay = draw(ctx.instance.get(phase), rng)
        fail_p = float((ctx.instance.get("fail") or {}).get(phase, 0.0))
        if delay > 0:  # the phase's nominal time, not up to 1 ms more (asyncio's ms timer)
            await precise_sleep(delay)
        if fail_p > 0 and rng.random() < fail_p:
            raise SyntheticFailure(f"synthetic failure injected in {phase}")
        ctx.state[f"{phase}_s"] = delay
        if ctx.instance.get("trace") is True:  # when the daemon ran the handler: the slot's idle gaps between jobs
            ctx.state[f"{phase}_at"] = [start, time.monotonic()]

    async def init(self, ctx):
        self._check_instance(ctx)
        await self._phase(ctx, "init")

    async def run(self, ctx):
        await self._phase(ctx, "run")

    async def eval(self, ctx):
        await self._phase(ctx, "eval")
        ctx.set_reward(float(ctx.instance.get("reward", 1.0)), drawn={k: v for k, v in ctx.state.items()})


class SyntheticLLMHandler(SyntheticHandler):
    """The synthetic handler plus real LLM calls: the run phase makes ``llm_calls`` calls
    through the leased backend (any vLLM/SGLang-API server), sleeping ``think`` between them.
    Used to test and benchmark the router, failover and checkpoint swaps.

    Extra instance fields: ``{"llm_calls": 3, "max_tokens": 4, "prompt_len": 16, "think": <latency>,
    "ignore_eos": false}`` (``ignore_eos``: every call samples exactly ``max_tokens``)
    """

    name = "synthetic_llm"
    needs_llm = True
    instance_keys = SyntheticHandler.instance_keys | {"llm_calls", "max_tokens", "prompt_len", "think", "ignore_eos"}

    def _check_instance(self, ctx: JobContext):
        super()._check_instance(ctx)
        if not isinstance(ctx.instance.get("ignore_eos", False), bool):
            raise SyntheticInstanceError(f"{self.name}: instance ignore_eos is {ctx.instance['ignore_eos']!r}; "
                                         "must be true or false")

    async def run(self, ctx):
        import numpy as np

        from rolloutd.llm.client import SamplingParams

        rng = self._rng(ctx, "run")
        calls = int(ctx.instance.get("llm_calls", 1))
        params = SamplingParams(max_tokens=int(ctx.instance.get("max_tokens", 4)), temperature=1.0,
                                ignore_eos=bool(ctx.instance.get("ignore_eos", False)))
        prompt = np.arange(1, 1 + int(ctx.instance.get("prompt_len", 16)), dtype=np.int32)
        traj = ctx.trajectory
        response, logprobs, turns = [], [], []
        for i in range(calls):
            context = np.concatenate([prompt, *response]) if response else prompt
            continuation = False
            while True:  # an aborted generation (a swap under stale_policy=continue) is continued, same call
                g, backend, version = await ctx.llm(context, params)
                start = sum(len(r) for r in response)
                response.append(np.asarray(g.token_ids, dtype=np.int32))
                logprobs.append(np.asarray(g.logprobs, dtype=np.float32))
                turns.append({"span": [start, start + len(g.token_ids)], "start": start, "end": start + len(g.token_ids),
                              "finish_reason": g.finish_reason, "backend": backend, "policy_version": version,
                              "continuation": continuation})
                if g.finish_reason != "abort" or len(turns) > 4 * calls:
                    break
                continuation = True
                context = np.concatenate([prompt, *response])
                params = params.replace(max_tokens=max(1, params.max_tokens - len(g.token_ids)))
            params = params.replace(max_tokens=int(ctx.instance.get("max_tokens", 4)))
            think = draw(ctx.instance.get("think"), rng)
            if think > 0 and i < calls - 1:
                await precise_sleep(think)
        traj["prompt_ids"] = prompt
        traj["response_ids"] = np.concatenate(response) if response else np.zeros(0, np.int32)
        traj["logprobs"] = np.concatenate(logprobs) if logprobs else np.zeros(0, np.float32)
        traj["loss_mask"] = np.ones(len(traj["response_ids"]), np.int8)
        traj["turns"] = turns
        traj["policy_version"] = turns[0]["policy_version"] if turns else None
        await self._phase(ctx, "run")
