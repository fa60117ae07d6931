"""Task logic: the AgentHandler contract, the handler registry and the task domains. No zmq."""
from rolloutd.handlers.base import AgentHandler, JobContext, PhaseTimeout
from rolloutd.handlers.registry import get_handler, handler_names, UnknownHandler

__all__ = ["AgentHandler", "JobContext", "PhaseTimeout", "get_handler", "handler_names", "UnknownHandler"]
