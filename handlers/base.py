"""The AgentHandler contract and the per-job context a handler works on.

A task domain subclasses ``AgentHandler``: ``init`` provisions the sandbox and toolset,
``run`` drives the multi-turn loop and fills the trajectory, ``eval`` scores it. The
``*_exception`` hooks turn a failure in a phase into a well-formed result and
``final_result`` serializes it, so a job that dies partway still answers completely.
Methods may be ``async def`` (run on the daemon's loop) or plain ``def`` (run in a
worker thread so they cannot stall other jobs).
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import time
from typing import Any, Callable

from rolloutd.bus.messages import Job, empty_trajectory

# Every reward that leaves a handler is a finite number within +-REWARD_BOUND (docs/HANDLERS.md,
# "Rewards"): one NaN makes a whole GRPO group's advantages NaN, and 1e308 overflows its std.
REWARD_BOUND = 1e6


class PhaseTimeout(Exception):
    """A phase ran past the job's budget or its own limit."""

    def __init__(self, phase: str, limit_s: float):
        super().__init__(f"{phase} exceeded its time limit of {limit_s:.3g}s")
        self.phase = phase
        self.limit_s = limit_s


class InvalidReward(ValueError):
    """A handler's reward is not a finite number within +-REWARD_BOUND: the grader is broken, the
    job fails (``error.type == "InvalidReward"``)."""


class AgentFault(Exception):
    """Grading cannot run because of what the agent did inside its sandbox (a tree too deep to walk,
    a workspace it filled or made unreadable, its sandbox stopped for its disk quota). Raised in run
    or eval, it scores the job reward 0 with ``eval_details.reason`` = the message, never ``failed``:
    a failed job is dropped from training, so failing would let an agent that will score 0 abstain
    (docs/RELIABILITY.md, "No abstention")."""


def check_reward(value: Any, what: str = "reward") -> float:
    """``value`` as a float, or InvalidReward if it is not a real number (bool and numpy scalars
    count), finite and within +-REWARD_BOUND."""
    if not isinstance(value, numbers.Real):
        raise InvalidReward(f"{what} must be a number, got {type(value).__name__}")
    try:
        r = float(value)
    except OverflowError:  # an int past float's range
        r = math.inf if value > 0 else -math.inf
    if not math.isfinite(r):
        raise InvalidReward(f"{what} {r!r} is not finite")
    if abs(r) > REWARD_BOUND:
        raise InvalidReward(f"{what} {r!r} is outside [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]")
    return r


def agent_fault_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is the agent's doing (then the job is scored 0 with this reason), or None (then it
    stays a failure: host, daemon, backend, a handler bug). Only causes the agent alone can produce
    are listed; anything unknown fails the job (docs/RELIABILITY.md, the table under "No abstention")."""
    if isinstance(exc, AgentFault):
        return str(exc)
    try:
        from rolloutd.sandbox import DiskQuotaExceeded
    except ImportError:  # pragma: no cover
        return None
    if isinstance(exc, DiskQuotaExceeded):
        return f"the agent's workspace outgrew its disk quota and the node stopped the sandbox ({exc})"
    return None


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
        self._llm = None  # set by the run daemon for handlers with needs_llm: an LLM session
        # The job's token-level conversation (an llm.conversation.Conversation), if the handler
        # registers it: however the phase ends, a failed result keeps the tokens sampled so far.
        self.conversation = None
        # Without one, every call through ``ctx.llm`` is captured here instead (handlers that put
        # every sampled token in the trajectory on every path themselves may set it False).
        self.capture_tokens = True

    @property
    def llm(self):
        """The leased LLM: ``await ctx.llm(prompt_ids, params) -> (Generation, backend, version)``.
        Every call through it is recorded (``CallCapture``), so a failed job keeps what it sampled
        whatever the handler did with it."""
        return self._llm

    @llm.setter
    def llm(self, generate):
        self._llm = generate if generate is None or isinstance(generate, CapturingLLM) else CapturingLLM(generate, self)

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
        """An asyncio client for the tool server of this job's sandbox. In eval, its first call
        is preceded by a purge: whatever the agent left running is killed before any eval step
        (issue 24), whichever tools a handler's eval uses."""
        if self.job.sandbox is None:
            raise RuntimeError("this job has no sandbox; create one in init")
        from rolloutd.sandbox import AsyncToolClient

        return AsyncToolClient(self.job.sandbox["tool_socket"], purge_first=self.phase == "eval")

    async def purge(self) -> dict:
        """Kill every process in this job's sandbox (the ``purge`` tool). Files the host writes for
        a grader go in after this: a live agent process could otherwise read or rewrite them."""
        from rolloutd.sandbox import AsyncToolClient

        async with AsyncToolClient(self.job.sandbox["tool_socket"]) as client:
            r = await client.call("purge", {}, timeout=60)
        if r.error:
            raise RuntimeError(f"clearing the sandbox failed: {r.error}")
        return r.info.get("purged") or {}

    async def grade(self, argv: list[str], *, timeout: float, cwd: str | None = None,
                    env: dict[str, str] | None = None, stdin: str | None = None, tail_bytes: int = 1 << 20):
        """Run a grader in this job's sandbox as its only process (the ``grade`` tool): every
        process the agent started is killed first, and the ToolResult holds only what the
        grader printed (stdout+stderr tail), on pipes no earlier process held."""
        from rolloutd.sandbox import AsyncToolClient

        args = {"argv": list(argv), "timeout": float(timeout), "env": dict(env or {}), "tail_bytes": int(tail_bytes)}
        if cwd is not None:
            args["cwd"] = cwd
        if stdin is not None:
            args["stdin"] = stdin
        async with AsyncToolClient(self.job.sandbox["tool_socket"]) as client:
            r = await client.call("grade", args, timeout=float(timeout))
        if r.error and "purged" not in r.info:  # nothing was graded: a failure, not a reward
            raise RuntimeError(f"grading in the sandbox failed: {r.error}")
        return r

    def set_reward(self, reward: float, **details: Any):
        """Score the job. A reward that is not finite or is outside +-REWARD_BOUND raises
        InvalidReward (the job fails: a handler must turn what the agent printed into a valid
        reward or 0 itself, as harness's ``reward: "stdout"`` does)."""
        self.trajectory["reward"] = check_reward(reward)
        self.trajectory["eval_details"].update(details)

    def agent_fault(self, phase: str, reason: str, exc: BaseException | None = None):
        """Score the job 0 because of what the agent did (AgentFault): status ``ok``, reward 0,
        ``eval_details.reason``; a later eval of the job is skipped."""
        self.trajectory.update(status="ok", failed_phase=None, error=None, reward=0.0)
        self.trajectory["eval_details"].update(reason=reason[:2000], agent_fault={
            "phase": phase, "type": type(exc).__name__ if exc is not None else "AgentFault"})
        self.state["agent_fault"] = reason[:2000]
        self.keep_conversation()

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
            capture = self._llm.capture if isinstance(self._llm, CapturingLLM) and self.capture_tokens else None
            if capture is not None and capture.sampled > _sampled(self.trajectory):
                # The handler kept no conversation and its trajectory holds less than was sampled
                # (synthetic_llm writes its tokens only at the end): what the lease saw, instead.
                self.trajectory.update(capture.trajectory())
            return
        self.trajectory.update(conv.arrays())
        self.trajectory["turns"] = list(conv.turns)
        if conv.turns and self.trajectory.get("policy_version") is None:
            self.trajectory["policy_version"] = conv.turns[0].get("policy_version")


def _sampled(traj: dict) -> int:
    """Sampled tokens in a trajectory (every segment's, when it has several)."""
    import numpy as np

    segs = traj.get("segments") or [traj]
    return int(sum(int(np.count_nonzero(np.asarray(s.get("loss_mask", ())))) for s in segs))


class CallCapture:
    """Every generation of one job's LLM lease, as token sequences: a call whose prompt extends
    the current sequence (prompt, sampled tokens and what came between) continues it (the new
    prompt tokens with loss_mask 0, the sampled ones with 1); any other prompt starts a new
    segment. Kept incrementally: one copy of the trajectory, not one prompt per call."""

    def __init__(self):
        self.segments: list[dict] = []  # {"prompt": ids, "parts": [(ids, mask, logprobs)], "turns", "seq"}
        self.sampled = 0

    def add(self, prompt_ids, gen, backend, version):
        import numpy as np

        prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        ids = np.asarray(gen.token_ids, dtype=np.int32).reshape(-1)
        lps = np.asarray(gen.logprobs if gen.logprobs is not None else np.zeros(len(ids)), dtype=np.float32).reshape(-1)
        if len(lps) != len(ids):
            lps = np.zeros(len(ids), np.float32)
        seg = self.segments[-1] if self.segments else None
        if seg is not None and len(prompt) >= len(seg["seq"]) and np.array_equal(prompt[:len(seg["seq"])], seg["seq"]):
            new = prompt[len(seg["seq"]):]  # what came between (observations, template tokens)
            if len(new):
                seg["parts"].append((new, np.zeros(len(new), np.int8), np.zeros(len(new), np.float32)))
                seg["response_len"] += len(new)
        else:
            seg = {"prompt": prompt, "parts": [], "turns": [], "response_len": 0}
            self.segments.append(seg)
        start = seg["response_len"]
        seg["parts"].append((ids, np.ones(len(ids), np.int8), lps))
        seg["response_len"] += len(ids)
        seg["seq"] = np.concatenate([prompt, ids])
        seg["turns"].append({"span": [start, start + len(ids)], "finish_reason": gen.finish_reason,
                             "backend": backend, "policy_version": version})
        self.sampled += len(ids)

    def trajectory(self) -> dict:
        """The captured calls in the trajectory's shape: the last segment at the top level and,
        with two or more, ``segments`` (as the bring-your-own-agent endpoint returns them)."""
        import numpy as np

        out = []
        for i, seg in enumerate(self.segments):
            parts = seg["parts"]
            out.append({"index": i, "prompt_ids": seg["prompt"],
                        "response_ids": np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32),
                        "loss_mask": np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int8),
                        "logprobs": np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.float32),
                        "turns": list(seg["turns"])})
        if not out:
            return {}
        top = {k: v for k, v in out[-1].items() if k != "index"}
        if len(out) > 1:
            top["segments"] = out
        first = next((t for s in out for t in s["turns"]), None)
        top["policy_version"] = first["policy_version"] if first else None
        return top


class CapturingLLM:
    """``ctx.llm``: the daemon's LLM session (or any generate callable), recording each call's
    prompt and generation in ``capture``. Everything else is the session's."""

    def __init__(self, generate, ctx: "JobContext"):
        self._generate = generate
        self._ctx = ctx
        self.capture = CallCapture()

    async def __call__(self, prompt_ids, params):
        g, backend, version = await self._generate(prompt_ids, params)
        if self._ctx.conversation is None and self._ctx.capture_tokens:  # else the handler's record wins: no copy
            self.capture.add(prompt_ids, g, backend, version)
        return g, backend, version

    def __getattr__(self, name):
        return getattr(self._generate, name)


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

    def __init_subclass__(cls, **kw):
        # Every handler, custom ones included, goes through these checks whatever it overrides:
        # an AgentFault (or a cause agent_fault_reason names) raised in run or eval scores the job
        # 0 instead of failing it, an eval after such a score is skipped, and a final result's
        # reward is finite and bounded (a handler that wrote NaN into ctx.trajectory fails its job).
        super().__init_subclass__(**kw)
        for phase in ("run", "eval"):
            fn = cls.__dict__.get(phase)
            if fn is not None and not getattr(fn, "_rolloutd_checked", False):
                setattr(cls, phase, _phase_guard(fn, phase))
        fn = cls.__dict__.get("final_result")
        if fn is not None and not getattr(fn, "_rolloutd_checked", False):
            cls.final_result = _checked_result(fn)

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


@contextlib.contextmanager
def _fault_scope(ctx: JobContext, phase: str):
    """Around a phase: in the outermost call (not a subclass's ``super()``), an agent's fault
    becomes a score of 0 (JobContext.agent_fault); anything else goes on up."""
    outer = not getattr(ctx, "_rolloutd_in_phase", False)
    ctx._rolloutd_in_phase = True
    try:
        yield
    except Exception as e:
        reason = agent_fault_reason(e) if outer else None
        if reason is None:
            raise
        ctx.agent_fault(phase, reason, e)
    finally:
        if outer:
            ctx._rolloutd_in_phase = False


def _phase_guard(fn, phase: str):
    """``run``/``eval`` of a handler class under _fault_scope; an eval after a fault is skipped."""
    import inspect

    def skip(ctx) -> bool:
        return phase == "eval" and ctx.state.get("agent_fault") is not None

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def guarded(self, ctx):
            if not skip(ctx):
                with _fault_scope(ctx, phase):
                    return await fn(self, ctx)
    else:
        @functools.wraps(fn)
        def guarded(self, ctx):
            if not skip(ctx):
                with _fault_scope(ctx, phase):
                    return fn(self, ctx)
    guarded._rolloutd_checked = True
    return guarded


def _checked_result(fn):
    @functools.wraps(fn)
    def final_result(self, ctx):
        traj = fn(self, ctx)
        if not isinstance(traj, dict):
            return traj
        try:
            traj["reward"] = check_reward(traj.get("reward"))
        except InvalidReward as e:
            if traj.get("status") != "ok":
                traj["reward"] = 0.0  # a failed job's reward is 0 whatever the handler left there
                return traj
            ctx.trajectory = traj
            ctx.fail("eval", e)
            traj = ctx.trajectory
        return traj
    final_result._rolloutd_checked = True
    return final_result


AgentHandler.final_result = _checked_result(AgentHandler.final_result)


def _status_of(exc: BaseException) -> str:
    import asyncio

    if isinstance(exc, PhaseTimeout):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "failed"


def now() -> float:
    return time.monotonic()
