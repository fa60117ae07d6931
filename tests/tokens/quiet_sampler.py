"""A third-party handler that samples through ``ctx.llm`` and never touches ``ctx.conversation``
or the trajectory until it is done (issue 28 item 3): the service must still return what it
sampled when the job fails, times out or is cancelled. Registered by tests/tokens/conftest.py."""
from __future__ import annotations

import asyncio

import numpy as np

from rolloutd.handlers.base import AgentHandler


class QuietSampler(AgentHandler):
    needs_llm = True

    async def run(self, ctx):
        from rolloutd.llm.client import SamplingParams

        params = SamplingParams(max_tokens=4, temperature=1.0)
        context = np.arange(1, 9, dtype=np.int32)
        for i in range(int(ctx.instance.get("calls", 1000))):
            g, _backend, _version = await ctx.llm(context, params)
            observation = np.array([7, 7, 7], np.int32)  # a tool's output, say: not sampled
            context = np.concatenate([context, np.asarray(g.token_ids, np.int32), observation])
            if ctx.instance.get("fail_after") == i + 1:
                raise RuntimeError("the quiet sampler gives up")
            await asyncio.sleep(float(ctx.instance.get("think", 0.0)))
        ctx.trajectory["prompt_ids"] = np.arange(1, 9, dtype=np.int32)  # only here, at the end
