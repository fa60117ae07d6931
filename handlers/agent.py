"""A tool-using agent handler: sandbox in init, the token-in/token-out loop in run.

Task domains subclass ``ToolAgentHandler`` and supply the task (``setup_task``), the
opening messages (``messages``) and the score (``score``). The loop itself lives in
``rolloutd.llm.agent_loop``; tools run in the job's sandbox through its tool server.
"""
from __future__ import annotations

import asyncio
import os

from rolloutd.handlers.base import AgentHandler, JobContext

TOOL_SPECS = {
    "bash": {"type": "function", "function": {
        "name": "bash", "description": "Run a command in a persistent bash shell in /workspace.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run code in a persistent Python session; print what you need to see.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    "editor": {"type": "function", "function": {
        "name": "editor",
        "description": "View or edit files: command is view, create, str_replace, insert or undo.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo"]},
            "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
            "new_str": {"type": "string"}, "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"}}},
            "required": ["command", "path"]}}},
}
OBSERVATION_CHARS = 8000  # what one tool result may add to the context


def tokenizer_at(path: str):
    """The tokenizer at ``path``, loaded once per process (blocking: use ``tokenizer_async`` on
    an event loop)."""
    from rolloutd.llm.tokenizer_utils import shared_tokenizer

    return shared_tokenizer(path)


def tokenizer_path(handler_config: dict, instance: dict) -> str:
    path = instance.get("tokenizer") or handler_config.get("tokenizer") or os.environ.get("ROLLOUTD_TOKENIZER")
    if not path:
        raise ValueError("no tokenizer: set [handlers.<name>] tokenizer, $ROLLOUTD_TOKENIZER or instance.tokenizer")
    return str(path)


class ToolAgentHandler(AgentHandler):
    needs_sandbox = True
    needs_llm = True
    tools: tuple[str, ...] = ("bash", "python", "editor")
    max_turns = 8
    parser = "hermes"
    max_tokens = 512          # per assistant turn
    max_context = 8192
    tool_timeout_s = 30.0
    system_prompt = "You are a helpful assistant that solves tasks using the tools you are given."

    # -- what a task domain supplies ---------------------------------------------------------
    def setup_task(self, ctx: JobContext) -> None:
        """Fill ``ctx.state`` with the task (runs in the init daemon, in a thread)."""

    def sandbox_spec(self, ctx: JobContext):
        from rolloutd.sandbox import Limits, SandboxSpec

        return SandboxSpec(limits=Limits(memory_mb=2048, nproc=256, cpu_seconds=600, file_size_mb=256,
                                         wall_seconds=1800))

    def prepare_sandbox(self, ctx: JobContext) -> None:
        """Put task files into the workspace after the sandbox exists (in a thread)."""

    def messages(self, ctx: JobContext) -> list[dict]:
        raise NotImplementedError

    def score(self, ctx: JobContext) -> tuple[float, dict]:
        """Reward and details (runs in the eval daemon, in a thread)."""
        raise NotImplementedError

    # -- the phases --------------------------------------------------------------------------
    def tokenizer(self, ctx: JobContext):
        """Blocking (for threads); ``run`` on the daemon's loop uses ``tokenizer_async``."""
        return tokenizer_at(tokenizer_path(self.config, ctx.instance))

    async def tokenizer_async(self, ctx: JobContext):
        """The job's tokenizer, loaded off the event loop once per daemon (the run daemon
        preloads the configured ones at start)."""
        from rolloutd.llm.tokenizer_utils import shared_tokenizer_async

        return await shared_tokenizer_async(tokenizer_path(self.config, ctx.instance))

    async def init(self, ctx: JobContext):
        await asyncio.to_thread(self.setup_task, ctx)
        if self.needs_sandbox:
            await asyncio.to_thread(ctx.create_sandbox, self.sandbox_spec(ctx))
            await asyncio.to_thread(self.prepare_sandbox, ctx)

    async def run(self, ctx: JobContext):
        from rolloutd.llm.agent_loop import run_agent_loop
        from rolloutd.llm.conversation import Conversation
        from rolloutd.llm.toolparse import get_parser

        tok = await self.tokenizer_async(ctx)
        specs = [TOOL_SPECS[t] for t in self.tools]
        # model-family options (docs/LLM.md, "Model families"): template variables, reasoning
        # keep|drop, and the parser of the tokenizer's family unless one is configured
        opt = lambda k, d=None: ctx.instance.get(k, self.config.get(k, d))  # noqa: E731
        conv = ctx.conversation = Conversation(tok, self.messages(ctx), tools=specs or None,
                                               max_context=int(ctx.instance.get("max_context", self.max_context)),
                                               template_kwargs=opt("template_kwargs"), reasoning=opt("reasoning", "keep"))
        fam = conv.renderer.family
        parser = self.config.get("parser") or (fam.parser if fam is not None and self.parser == "hermes" else self.parser)
        params = sampling_params(ctx.instance, self.max_tokens)
        client = ctx.tools() if ctx.sandbox else None
        allowed = set(self.tools)

        async def execute(call) -> str:
            if call.name not in allowed:
                return f"Error: no tool named {call.name!r}; available: {', '.join(sorted(allowed))}."
            if client is None:
                return "Error: this task has no sandbox."
            args = dict(call.arguments)
            args.setdefault("timeout", self.tool_timeout_s)
            r = await client.call(call.name, args)
            return observation(r)

        try:
            res = await run_agent_loop(ctx.llm, conv, get_parser(parser), execute, params,
                                       int(ctx.instance.get("max_turns", self.max_turns)), tok,
                                       tool_timeout=self.tool_timeout_s + 10)
        finally:
            if client is not None:
                await client.close()
        traj = ctx.trajectory
        traj.update(res.arrays)
        traj["turns"] = res.turns
        # the tokenizer that decodes these ids (`rolloutd view` reads it; a path on the node)
        traj["metrics"].update(res.metrics, stop_reason=res.stop_reason, tokenizer=tokenizer_path(self.config, ctx.instance))
        traj["policy_version"] = res.turns[0]["policy_version"] if res.turns else None
        ctx.state["final_text"] = res.final_text

    async def eval(self, ctx: JobContext):
        reward, details = await asyncio.to_thread(self.score, ctx)
        ctx.set_reward(reward, **details)


def sampling_params(instance: dict, max_tokens: int):
    """The instance's ``sampling`` map as SamplingParams (the same keys for every handler)."""
    from rolloutd.llm.client import SamplingParams

    sp = instance.get("sampling") or {}
    return SamplingParams(max_tokens=int(sp.get("max_tokens", max_tokens)),
                          temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                          top_k=int(sp.get("top_k", -1)), seed=sp.get("seed"),
                          stop_token_ids=[int(x) for x in sp.get("stop_token_ids") or []],
                          stop=[str(x) for x in sp.get("stop") or []])


def observation(r) -> str:
    """A tool result as the text the model sees next."""
    parts = []
    if r.error:
        parts.append(f"Error: {r.error}")
    if r.output:
        out = r.output
        if len(out) > OBSERVATION_CHARS:
            out = out[:OBSERVATION_CHARS // 2] + "\n[... output truncated ...]\n" + out[-OBSERVATION_CHARS // 2:]
        parts.append(out)
    if r.timed_out:
        parts.append("[the command timed out and was interrupted]")
    if r.exit_code not in (None, 0):
        parts.append(f"[exit code {r.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"
