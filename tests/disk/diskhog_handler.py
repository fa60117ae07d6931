"""A test handler (registered by tests/disk/conftest.py): a bwrap sandbox with a disk quota
that runs one bash command in run, then rewards 1. No LLM."""
from __future__ import annotations

import asyncio

from rolloutd.handlers.base import AgentHandler


class DiskHogHandler(AgentHandler):
    name = "diskhog"
    needs_sandbox = True

    async def init(self, ctx):
        from rolloutd.sandbox import Limits, SandboxSpec

        limits = Limits(disk_mb=int(ctx.instance["disk_mb"]), file_size_mb=int(ctx.instance.get("file_size_mb", 64)))
        await asyncio.to_thread(ctx.create_sandbox, SandboxSpec(limits=limits))

    async def run(self, ctx):
        tools = ctx.tools()
        try:
            r = await tools.call("bash", {"command": ctx.instance["command"], "timeout": 120}, timeout=130)
        finally:
            await tools.close()
        ctx.state["exit_code"] = r.exit_code
        ctx.state["output"] = r.output[-300:]

    async def eval(self, ctx):
        ctx.set_reward(1.0, exit_code=ctx.state.get("exit_code"), output=ctx.state.get("output"))
