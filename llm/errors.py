"""Exceptions of the LLM side. Re-exported by :mod:`rolloutd.llm.client`."""

from __future__ import annotations


class LLMError(Exception):
    """Base class of every error raised by ``llm``."""


class BackendError(LLMError):
    """The backend failed: connection error, HTTP 5xx/404/429, malformed reply, or an abort.

    The caller reports the backend to the router and retries the call elsewhere.
    ``status`` is the HTTP status when there was one, ``backend`` the base URL.
    """

    def __init__(self, message: str, *, backend: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.status = status


class LLMTimeout(BackendError):
    """The per-call timeout expired before the backend answered."""


class ContextOverflow(LLMError):
    """The request does not fit the context window (ours or the server's).

    Not a backend fault: retrying elsewhere does not help. The agent loop turns it
    into ``finish_reason == "context_overflow"``. ``tokens`` and ``limit``: the prompt's length and
    the window, when known.
    """

    def __init__(self, message: str, *, tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


class RequestError(LLMError):
    """The backend rejected the request as invalid (HTTP 400/422 other than context length).

    A bug in the request, not a backend fault: retrying elsewhere does not help.
    """

    def __init__(self, message: str, *, backend: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.status = status


class TemplateError(LLMError):
    """The chat template cannot be rendered incrementally (earlier turns would change)."""
