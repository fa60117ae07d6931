"""A test handler whose run phase runs the instance's ``command`` in its own sandbox (bash tool):
a hostile one (fork bomb, memory, CPU) beside neighbours through real daemons."""
from __future__ import annotations

import asyncio

from rolloutd.handlers.base import AgentHandler


class SandboxHog(AgentHandler):
    name = "sandbox_hog"
    needs_sandbox = True

    async def init(self, ctx):
        from rolloutd.sandbox import Limits, SandboxSpec

        spec = SandboxSpec(limits=Limits(nproc=64, cpu_seconds=60, address_space_mb=1024, wall_seconds=120))
        await asyncio.to_thread(ctx.create_sandbox, spec)

    async def run(self, ctx):
        async with ctx.tools() as t:
            r = await t.call("bash", {"command": ctx.instance["command"], "timeout": ctx.instance.get("timeout", 20)})
        ctx.state["output"], ctx.state["exit_code"] = r.output, r.exit_code

    async def eval(self, ctx):
        ok = ctx.state.get("exit_code") == 0 and ctx.state.get("output") == ctx.instance.get("expect")
        ctx.set_reward(1.0 if ok else 0.0, output=ctx.state.get("output", "")[-200:], exit_code=ctx.state.get("exit_code"))
