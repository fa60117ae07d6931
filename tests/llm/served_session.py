"""An ``EndpointSession`` served on a real uvicorn socket in front of the scripted backend, with
the real ``openai`` SDK (and ``anthropic``'s when installed) as the agent's clients; it records
every prompt the backend saw and how many backend calls were in flight at once."""
from __future__ import annotations

import numpy as np

from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession


class ServedSession:
    def __init__(self, tok, url, *, max_context: int = 8192, max_tokens: int = 24):
        self.tok, self.url = tok, url
        self.limits = EndpointLimits(max_context=max_context, max_tokens=max_tokens)
        self.prompts: list[list[int]] = []
        self.inflight = self.max_inflight = 0
        self.an = None

    async def __aenter__(self):
        import openai

        self.llm = LLMClient(self.url, timeout=60)
        inner = simple_generate(self.llm, "b0", 0)

        async def generate(ids, params):
            self.prompts.append(np.asarray(ids).tolist())
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                return await inner(ids, params)
            finally:
                self.inflight -= 1

        self.session = EndpointSession(generate, self.tok, limits=self.limits)
        self.server = await serve(make_app(self.session), host="127.0.0.1", port=0)
        base = f"http://127.0.0.1:{self.server.port}"
        self.oa = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        try:
            import anthropic
        except ImportError:
            pass
        else:
            self.an = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
        return self

    async def __aexit__(self, *exc):
        await self.oa.close()
        if self.an is not None:
            await self.an.close()
        await self.server.stop()
        await self.llm.aclose()
