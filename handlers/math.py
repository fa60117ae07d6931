"""``math``: reasoning-gym problems or your own question/answer pairs, graded with math-verify.

Instances::

    {"dataset": "basic_arithmetic", "seed": 7, "index": 3}   # a reasoning-gym generator item
    {"question": "What is 6 * 7?", "answer": "42"}            # your own (e.g. a JSONL line)

Any offline reasoning-gym dataset name works (``basic_arithmetic``, ``chain_sum``,
``gsm_symbolic``, ``simple_equations``, ``fraction_simplification``, ...); the item is a pure
function of (dataset, seed, index). The agent may run code with the ``python`` tool or answer
directly; the reward is 1 when the last ``\\boxed{...}`` of its final message equals the
reference answer by math-verify (exact string match after normalisation for answers
math-verify cannot parse).

Eval needs no sandbox (``eval_needs_sandbox = False``): the sandbox is destroyed as soon as
the run ends. Grading runs in a small pool of worker processes: math-verify's timeouts use
``SIGALRM``, which only works in a main thread, and a pathological answer must not stall the
eval daemon. ``[handlers.math]`` config (besides the common keys, see handlers/tasks.py):
``python`` (false: no sandbox, no tools), ``grader`` ("process" | "thread"),
``grader_workers`` (2), ``grade_timeout_s`` (20).
"""
from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from rolloutd.handlers.base import JobContext
from rolloutd.handlers.tasks import DomainHandler, math_problem, question_key

MAX_ANSWER_CHARS = 1000


# -- grading (module level: runs in worker processes) ------------------------------------------
def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text or ""):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[m.end():i - 1]
    return best.strip() if best is not None else None


def _norm(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    return re.sub(r"\s+", " ", s).strip().rstrip(".").lower()


def quick_grade(gold: str, response: str) -> tuple[float, dict] | None:
    """The cases that need no math-verify: no answer, an oversized one, an exact match."""
    answer = extract_boxed(response)
    if answer is None or len(answer) > MAX_ANSWER_CHARS or _norm(answer) == _norm(gold):
        return grade_answer(gold, response)
    return None


def grade_answer(gold: str, response: str, use_timeouts: bool = True) -> tuple[float, dict]:
    """(reward, details) of ``response`` (the agent's final message) against ``gold``.
    ``use_timeouts`` needs a main thread (math-verify's SIGALRM timeouts)."""
    answer = extract_boxed(response)
    details: dict[str, Any] = {"answer": answer, "expected": gold}
    if answer is None:
        details["reason"] = "no \\boxed{} answer in the final message"
        return 0.0, details
    if len(answer) > MAX_ANSWER_CHARS:
        details.update(answer=answer[:200] + "...", reason=f"answer longer than {MAX_ANSWER_CHARS} characters")
        return 0.0, details
    if _norm(answer) == _norm(gold):
        details["method"] = "exact"
        return 1.0, details
    from math_verify import parse, verify

    kw: dict = {} if use_timeouts else {"parsing_timeout": None}
    vkw: dict = {} if use_timeouts else {"timeout_seconds": None}
    g = gold.strip()
    gold_parsed = parse(g if ("$" in g or "\\" in g) else f"${g}$", **kw)
    pred_parsed = parse(f"\\boxed{{{answer}}}", **kw)
    details["method"] = "math_verify"
    if not gold_parsed or not pred_parsed:
        details["reason"] = "math-verify could not parse " + ("the reference" if not gold_parsed else "the answer")
        return 0.0, details
    ok = bool(verify(gold_parsed, pred_parsed, **vkw))
    return (1.0 if ok else 0.0), details


def _warm() -> None:
    """Worker start-up: die with the eval daemon, and import math-verify once."""
    from ..daemons.children import die_with_parent

    die_with_parent()
    import math_verify  # noqa: F401  (sympy + the LaTeX parser: seconds, once per worker)


class MathGrader:
    """math-verify in worker processes, with a backstop timeout that recycles the pool."""

    def __init__(self, mode: str = "process", workers: int = 2, timeout_s: float = 20.0):
        if mode not in ("process", "thread"):
            raise ValueError(f"grader must be 'process' or 'thread', not {mode!r}")
        self.mode = mode
        self.workers = max(1, int(workers))
        self.timeout_s = float(timeout_s)
        self._pool = None
        self._lock = threading.Lock()

    def _get_pool(self):
        with self._lock:
            if self._pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_warm)
            return self._pool

    def _recycle(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        # A worker stuck in sympy ignores shutdown(): terminate it (private but stable attribute).
        for p in list(getattr(pool, "_processes", {}).values()):
            try:
                p.terminate()
            except Exception:  # noqa: BLE001
                pass
        pool.shutdown(wait=False, cancel_futures=True)

    async def grade(self, gold: str, response: str) -> tuple[float, dict]:
        quick = quick_grade(gold, response)
        if quick is not None:  # no answer, or the very string: no need for math-verify
            return quick
        if self.mode == "thread":
            return await asyncio.wait_for(asyncio.to_thread(grade_answer, gold, response, False), self.timeout_s)
        from concurrent.futures.process import BrokenProcessPool

        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            fut = loop.run_in_executor(self._get_pool(), grade_answer, gold, response, True)
            try:
                return await asyncio.wait_for(fut, self.timeout_s)
            except asyncio.TimeoutError:
                self._recycle()
                return 0.0, {"answer": extract_boxed(response), "expected": gold,
                             "reason": f"grading timed out after {self.timeout_s:g}s"}
            except BrokenProcessPool:
                self._recycle()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._recycle()


# -- the handler -------------------------------------------------------------------------------
class MathHandler(DomainHandler):
    domain = "math"
    tools = ("python",)
    max_turns = 4
    max_tokens = 1024
    max_context = 8192
    tool_timeout_s = 20.0
    eval_needs_sandbox = False
    system_prompt = ("You are a careful mathematician. You can run Python code with the python tool. "
                     "Put your final answer in \\boxed{}.")
    user_template = ("{tag}{question}\n\n"
                     "You may use the python tool to compute. When you are done, reply without a tool call and "
                     "give the final answer as \\boxed{{ANSWER}}.")

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        if self.config.get("python") is False:
            self.tools = ()
            self.needs_sandbox = False
        self.grader = MathGrader(str(self.config.get("grader", "process")), int(self.config.get("grader_workers", 2)),
                                 float(self.config.get("grade_timeout_s", 20.0)))

    def sandbox_spec(self, ctx: JobContext):
        from rolloutd.sandbox import Limits, SandboxSpec

        return SandboxSpec(limits=Limits(memory_mb=1024, nproc=64, cpu_seconds=120, file_size_mb=64,
                                         wall_seconds=900, disk_mb=256))

    def setup_task(self, ctx: JobContext) -> None:
        inst = ctx.instance
        if "dataset" in inst:
            name, seed, index = inst["dataset"], int(inst.get("seed", 0)), int(inst.get("index", 0))
            item = math_problem(name, seed, index)
            question, answer, tag = item["question"], item["answer"], [name, seed, index]
        elif "question" in inst and "answer" in inst:
            question, answer = str(inst["question"]), str(inst["answer"])
            tag = ["q", question_key(question)]
        else:
            raise ValueError('a math instance is {"dataset", "seed", "index"} or {"question", "answer"}')
        if not question.strip():
            raise ValueError("empty question")
        ctx.state.update(tag=tag, gold=answer, prompt_fields={"question": question.strip()})

    async def evaluate(self, ctx: JobContext) -> tuple[float, dict]:
        return await self.grader.grade(ctx.state["gold"], ctx.state.get("final_text") or "")
