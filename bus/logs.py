"""structlog set-up: JSON lines when not on a terminal (systemd, srun), readable console
output on one. Every line carries the daemon and node; job lines add job_id and attempt."""
from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info", stream=None, **context):
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty()) if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def get(name: str = "rolloutd"):
    return structlog.get_logger(name)
