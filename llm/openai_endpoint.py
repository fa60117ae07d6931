"""A per-job OpenAI-compatible LLM endpoint that records exact token-level trajectories.

An unmodified agent program (mini-swe-agent, an ``openai`` SDK tool loop) talks to this
endpoint instead of a model server; every call is turned into token ids, sent to the
job's leased backend, and recorded as the trajectory a trainer gets.

Interface (what the harness handler uses)::

    session = EndpointSession(generate, tokenizer, parser="hermes", limits=EndpointLimits(...))
    server = await serve(make_app(session), uds="/path/llm.sock")      # and/or host="127.0.0.1", port=0
    ... run the agent with OPENAI_BASE_URL = server.base_url (or the in-sandbox relay's URL) ...
    session.cancel("cancelled")       # on job cancel / timeout: refuse new calls, abort in-flight ones
    await server.stop()
    traj = session.trajectory()       # prompt_ids, response_ids, loss_mask, logprobs, turns,
                                      # segments (2+ only), policy_version, metrics

* ``generate`` is the job's LLM callable, ``await generate(prompt_ids, SamplingParams) ->
  (Generation, backend_id, policy_version)``: the run daemon passes its leased ``LLMSession``
  (router lease, failover, capacity, staleness, policy_version per turn), tests pass
  ``simple_generate(LLMClient(...))``.
* Routes: ``POST /v1/chat/completions`` (non-streaming and ``stream: true`` SSE),
  ``POST /v1/completions``, ``GET /v1/models``; errors in OpenAI's JSON error shape
  (see :class:`EndpointError`).

The token capture rules and the segment format are in ``docs/HARNESS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EndpointLimits", "EndpointError", "EndpointSession", "make_app", "serve", "EndpointServer"]


@dataclass(slots=True)
class EndpointLimits:
    """Per-job limits. ``deadline`` is a ``time.monotonic()`` instant (None: no deadline)."""

    max_llm_calls: int | None = None
    max_context: int = 32768
    max_tokens: int = 1024  # per call, when the request names none
    deadline: float | None = None


class EndpointError(Exception):
    """A request the endpoint refuses: ``status`` plus OpenAI's ``{"error": {message, type, param, code}}``.

    400 ``invalid_request_error`` (bad body, ``n > 1``, ``context_length_exceeded``),
    404 unknown model / route, 429 ``insufficient_quota`` (``max_llm_calls`` spent),
    503 (job cancelled, past its deadline, backend unavailable).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


class EndpointSession:
    """One job's endpoint state: its conversation segments and limits."""

    def __init__(self, generate: Any, tokenizer: Any, *, parser: str = "hermes", model: str = "rolloutd",
                 limits: EndpointLimits | None = None, api_key: str | None = None) -> None:
        raise NotImplementedError  # interface commit; implementation follows

    async def chat(self, body: dict) -> dict:
        """One ``/v1/chat/completions`` request (non-streaming shape). Raises EndpointError."""
        raise NotImplementedError

    async def complete(self, body: dict) -> dict:
        """One ``/v1/completions`` request (text or token-id prompt; recorded as its own segment)."""
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled") -> None:
        """Refuse every later call (503) and cancel the backend calls in flight (closes their HTTP connections)."""
        raise NotImplementedError

    def trajectory(self) -> dict:
        """The fields a handler copies into the job's trajectory (``metrics`` to be merged)."""
        raise NotImplementedError


def make_app(session: EndpointSession):
    """A raw ASGI app serving ``session``."""
    raise NotImplementedError


class EndpointServer:
    """uvicorn serving an app on a Unix socket and/or 127.0.0.1, inside the caller's event loop."""

    base_url: str  # "http://127.0.0.1:PORT/v1" when on TCP, else "http://localhost/v1" (use ``uds``)
    uds: str | None

    async def stop(self) -> None:
        raise NotImplementedError


async def serve(app, *, uds: str | None = None, host: str | None = None, port: int = 0) -> EndpointServer:
    """Start uvicorn for ``app`` (no signal handlers installed: the daemon owns signals)."""
    raise NotImplementedError
