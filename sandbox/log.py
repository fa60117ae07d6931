"""The package's structlog logger (events named after what happened, key-value fields).

Fields can carry text a sandbox produced (a tool server's error, a log tail): each text field is
cut to 4096 characters (toollog.clip, the tool server's own), so one event stays a few KiB long in
a daemon's log."""
from typing import Any

import structlog

from .toolserver.toollog import clip


class _Clipped:
    """structlog's logger with every str/bytes field clipped (other methods pass through)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        meth = getattr(self._logger, name)
        if name not in ("debug", "info", "warning", "error", "exception", "critical", "msg"):
            return meth

        def call(event: Any = None, *args: Any, **kw: Any) -> Any:
            kw = {k: clip(v) if isinstance(v, str) else clip(repr(v)) if isinstance(v, bytes) else v
                  for k, v in kw.items()}
            return meth(event, *args, **kw)
        return call


log = _Clipped(structlog.get_logger("rolloutd.sandbox"))
