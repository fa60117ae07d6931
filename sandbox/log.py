"""The package's structlog logger (events named after what happened, key-value fields)."""
import structlog

log = structlog.get_logger("rolloutd.sandbox")
