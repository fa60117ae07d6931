"""Multi-turn chat with no tools: after each assistant turn the next scripted user message
(``instance["user_turns"]``) follows. For dialogue-style tasks, and for the end-to-end check
that the service keeps every sampled id exactly across turns.

Instance fields::

    {"messages": [{"role": "user", "content": "..."}],   # the opening
     "user_turns": ["and then?", "thanks"],              # one follow-up after each assistant turn
     "expect": "text",                                   # reward 1 if the last answer contains it
     "sampling": {"max_tokens": 64, "temperature": 1.0, ...}, "tokenizer": "DIR"}
"""
from __future__ import annotations

from rolloutd.handlers.agent import ToolAgentHandler, instance_int, sampling_params
from rolloutd.handlers.base import JobContext


class DialogueHandler(ToolAgentHandler):
    name = "dialogue"
    needs_sandbox = False
    tools = ()

    async def run(self, ctx: JobContext):
        from rolloutd.llm.conversation import Conversation

        tok = await self.tokenizer_async(ctx)
        conv = ctx.conversation = Conversation(tok, list(ctx.instance["messages"]),
                                               max_context=instance_int(ctx.instance, "max_context", self.max_context))
        params = sampling_params(ctx.instance, self.max_tokens)
        final = ""
        for follow_up in [None, *ctx.instance.get("user_turns", [])]:
            if follow_up is not None:
                conv.add_messages([{"role": "user", "content": str(follow_up)}])
            g, backend, version = await ctx.llm(conv.context_ids, params)
            conv.add_generation(g, backend, version)
            final = g.text if g.text is not None else tok.decode(list(g.token_ids), skip_special_tokens=True)
        traj = ctx.trajectory
        traj.update(conv.arrays())
        traj["turns"] = conv.turns
        traj["metrics"]["turns"] = len(conv.turns)
        traj["policy_version"] = conv.turns[0]["policy_version"] if conv.turns else None
        ctx.state["final_text"] = final

    def score(self, ctx: JobContext):
        expect = ctx.instance.get("expect")
        if not expect:
            return 0.0, {"scored": False}
        return float(expect in ctx.state.get("final_text", "")), {"scored": True}
