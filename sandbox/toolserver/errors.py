"""Errors a tool reports to the caller (as ToolResult.error), never crashing the server."""


class ToolError(Exception):
    """The call failed in a way the agent should read (exit_code 1)."""


class ArgError(ToolError):
    """The call's arguments are invalid (exit_code None: nothing ran)."""


class BusyError(ToolError):
    """Another call holds the tool (one shell, one Python session per sandbox)."""


class Abandoned(Exception):
    """The client went away before its call could start: nothing runs, nothing is sent."""
