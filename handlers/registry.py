"""Handlers are found by name through the ``rolloutd.handlers`` entry-point group, never by
importing a module path that a request names."""
from __future__ import annotations

import functools
from importlib.metadata import entry_points

from rolloutd.handlers.base import AgentHandler

GROUP = "rolloutd.handlers"


class UnknownHandler(LookupError):
    pass


@functools.lru_cache(maxsize=None)
def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def handler_names() -> list[str]:
    return sorted(_entry_points())


_instances: dict[str, AgentHandler] = {}


def get_handler(name: str, config: dict | None = None) -> AgentHandler:
    """The handler instance registered as ``name`` (one per process)."""
    h = _instances.get(name)
    if h is None:
        ep = _entry_points().get(name)
        if ep is None:
            raise UnknownHandler(f"no handler named {name!r}; registered: {', '.join(handler_names()) or 'none'}")
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, AgentHandler)):
            raise UnknownHandler(f"entry point {name!r} is not an AgentHandler subclass")
        h = _instances[name] = cls((config or {}).get(name, {}))
        h.name = h.name or name
    return h
