"""Exceptions of the sandbox package."""


class SandboxError(Exception):
    """Base class."""


class SandboxSpecError(SandboxError, ValueError):
    """The SandboxSpec (or a runtime option) is invalid."""


class SandboxStartError(SandboxError):
    """The sandbox or its tool server did not come up; the message carries the log tail."""


class SandboxNoSpace(SandboxStartError):
    """The node's sandbox root is full: the sandbox was not created (nothing half-made is left)."""


class RuntimeUnavailable(SandboxError):
    """The requested runtime cannot work on this machine (binary missing, userns denied...)."""


class ToolTransportError(SandboxError, ConnectionError):
    """The tool server could not be reached or did not answer in time.

    This is an infrastructure failure (the sandbox is gone or wedged), never something to
    show the agent as a tool observation.

    ``agent_caused``: True on the subclasses whose cause is something the agent did inside its
    sandbox (it must cost the agent reward 0, not drop the job: RELIABILITY.md); False here.
    What the agent does to a tool (a flooded Python reply pipe, a FIFO for the editor) is a tool
    error in the reply instead, never a ToolTransportError.
    """

    agent_caused = False


class DiskQuotaExceeded(ToolTransportError):
    """The sandbox's workspace outgrew Limits.disk_mb and the node stopped the sandbox.

    A ToolTransportError (the sandbox is gone), named for the cause so the job's
    error.type says why.
    """

    agent_caused = True
