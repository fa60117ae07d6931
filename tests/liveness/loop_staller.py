"""A test handler whose run phase blocks its daemon's event loop (``time.sleep`` inside an
``async def``: the way a CPU-bound or GIL-holding call in a handler stalls the loop)."""
from __future__ import annotations

import time

from rolloutd.handlers.base import AgentHandler


class LoopStaller(AgentHandler):
    name = "loop_staller"

    async def run(self, ctx):
        time.sleep(float(ctx.instance.get("stall_s", 0)))  # deliberately on the loop

    async def eval(self, ctx):
        ctx.set_reward(1.0)
