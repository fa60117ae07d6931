"""The AgentHandler contract and the per-job context a handler works on.

A task domain subclasses ``AgentHandler``: ``init`` provisions the sandbox and toolset,
``run`` drives the multi-turn loop and fills the trajectory, ``eval`` scores it. The
``*_exception`` hooks turn a failure in a phase into a well-formed result and
``final_result`` serializes it, so a job that dies partway still answers completely.
Methods may be ``async def`` (run on the daemon's loop) or plain ``def`` (run in a
worker thread so they cannot stall other jobs).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from rolloutd.bus.messages import Job, empty_trajectory


class PhaseTimeout(Exception):
    """A phase ran past the job's budget or its own limit."""

    def __init__(self, phase: str, limit_s: float):
        super().__init__(f"{phase} exceeded its time limit of {limit_s:.3g}s")
        self.phase = phase
        self.limit_s = limit_s


class JobContext:
    """What a handler sees of its job. ``state`` is the handler's own serializable
    scratch space; it travels with the job from daemon to daemon."""

    def __init__(self, job: Job, services: "Services | None" = None):
        self.job = job
        self.services = services or Services()
        if not job.trajectory:
            job.trajectory = empty_trajectory(job.job_id, job.instance_id, job.sample_index)
        self.trajectory: dict = job.trajectory
        self.trajectory["handler"] = job.handler
        self.trajectory["attempts"] = job.attempt
        self.phase = "queue"
        self.llm = None  # set by the run daemon for handlers with needs_llm: an LLM session
        # The job's token-level conversation (an llm.conversation.Conversation), if the handler
        # registers it: however the phase ends, a failed result keeps the tokens sampled so far.
        self.conversation = None

    # -- job fields ---------------------------------------------------------------------
    @property
    def job_id(self) -> int:
        return self.job.job_id

    @property
    def attempt(self) -> int:
        return self.job.attempt

    @property
    def instance(self) -> dict:
        return self.job.instance

    @property
    def state(self) -> dict:
        return self.job.state

    @property
    def sandbox(self) -> dict | None:
        return self.job.sandbox

    # -- services -----------------------------------------------------------------------
    def create_sandbox(self, spec) -> dict:
        """Create this job's sandbox through the node's runtime; the handle travels with the job."""
        handle = self.services.runtime().create(f"{self.job_id}.{self.attempt}", spec)
        self.job.sandbox = handle.to_dict()
        return self.job.sandbox

    def tools(self):
        """An asyncio client for the tool server of this job's sandbox."""
        if self.job.sandbox is None:
            raise RuntimeError("this job has no sandbox; create one in init")
        from rolloutd.sandbox import AsyncToolClient

        return AsyncToolClient(self.job.sandbox["tool_socket"])

    def set_reward(self, reward: float, **details: Any):
        self.trajectory["reward"] = float(reward)
        self.trajectory["eval_details"].update(details)

    def fail(self, phase: str, exc: BaseException, status: str = "failed"):
        self.trajectory["status"] = status
        self.trajectory["failed_phase"] = phase
        self.trajectory["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000]}
        self.trajectory["reward"] = 0.0
        self.keep_conversation()

    def keep_conversation(self):
        """Copy the registered conversation's tokens and turns into the trajectory (every
        failure path calls this through ``fail``: a backend error on turn 2, a timeout, a
        cancel still return turn 1's sampled ids, mask and logprobs)."""
        conv = self.conversation
        if conv is None:
            return
        self.trajectory.update(conv.arrays())
        self.trajectory["turns"] = list(conv.turns)
        if conv.turns and self.trajectory.get("policy_version") is None:
            self.trajectory["policy_version"] = conv.turns[0].get("policy_version")


class Services:
    """Node-local services a daemon lends to handlers; created lazily."""

    def __init__(self, runtime_factory: Callable[[], Any] | None = None):
        self._runtime_factory = runtime_factory
        self._runtime = None

    def runtime(self):
        if self._runtime is None:
            if self._runtime_factory is None:
                raise RuntimeError("no sandbox runtime configured on this daemon")
            self._runtime = self._runtime_factory()
        return self._runtime


class AgentHandler:
    """Base class of every task domain. Subclasses override the phases they need."""

    name: str = ""
    needs_sandbox: bool = False       # init creates a sandbox
    eval_needs_sandbox: bool = False  # if False, the sandbox is freed as soon as run ends
    needs_llm: bool = False           # the run daemon leases a backend for the whole run phase
    tools: tuple[str, ...] = ()
    max_turns: int = 1

    def __init__(self, config: dict | None = None):
        self.config = config or {}

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        return None

    async def eval(self, ctx: JobContext) -> None:
        return None

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.fail("init", exc, _status_of(exc))

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.fail("run", exc, _status_of(exc))

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.fail("eval", exc, _status_of(exc))

    def final_result(self, ctx: JobContext) -> dict:
        """The trajectory dict sent to the trainer: every key of the design's shape."""
        traj = ctx.trajectory
        traj["timing"] = dict(ctx.job.timing)
        traj["attempts"] = ctx.attempt
        return traj


def _status_of(exc: BaseException) -> str:
    import asyncio

    if isinstance(exc, PhaseTimeout):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "failed"


def now() -> float:
    return time.monotonic()
