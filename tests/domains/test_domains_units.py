"""Pieces of the task domains without daemons: grading, tags, oracles, HumanEval's harness."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rolloutd.handlers.math import extract_boxed, grade_answer, quick_grade
from rolloutd.handlers.oracles import Oracle, _test_prefix, assistant_turns, last_observation, wrong_answer
from rolloutd.handlers.tasks import find_task_tag, pytest_files, question_key, task_tag


# -- math grading -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{ {a} + {b} }", "{a} + {b}"),
    ("no box here", None),
    ("\\boxed{unbalanced", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("gold,response,reward", [
    ("-204", "so \\boxed{-204}", 1.0),
    ("-204", "\\boxed{-204.0}", 1.0),
    ("-204", "\\boxed{-203}", 0.0),
    ("$\\dfrac{242}{311}$", "\\boxed{\\frac{242}{311}}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("288", "The answer is 288.", 0.0),          # no \boxed{}
    ("Paris", "\\boxed{paris}", 1.0),           # not math: normalized exact match
    ("\\frac{5}{6}", "\\boxed{5/6}", 1.0),
])
def test_grade_answer(gold, response, reward):
    r, details = grade_answer(gold, response)
    assert r == reward, details
    assert details["expected"] == gold


def test_quick_grade_skips_math_verify_only_when_it_can():
    assert quick_grade("42", "\\boxed{42}")[0] == 1.0
    assert quick_grade("42", "no answer")[0] == 0.0
    assert quick_grade("42", "\\boxed{" + "9" * 2000 + "}")[0] == 0.0
    assert quick_grade("0.5", "\\boxed{1/2}") is None  # needs math-verify


def test_math_grader_process_pool_and_thread_mode():
    import asyncio

    from rolloutd.handlers.math import MathGrader

    async def go(mode):
        g = MathGrader(mode, workers=1, timeout_s=60)
        try:
            return await g.grade("0.5", "\\boxed{\\frac{1}{2}}"), await g.grade("0.5", "\\boxed{0.4}")
        finally:
            g.close()

    for mode in ("process", "thread"):
        right, wrong = asyncio.run(go(mode))
        assert right[0] == 1.0 and right[1]["method"] == "math_verify"
        assert wrong[0] == 0.0


# -- tags and oracles -------------------------------------------------------------------------------
def test_task_tags_round_trip_and_reject_ambiguity():
    t = task_tag("math", "basic_arithmetic", 7, 3)
    assert t == "[task math:basic_arithmetic:7:3]"
    assert find_task_tag(f"system\nuser: {t}\nquestion [task code:HumanEval/1]") == ("math", ["basic_arithmetic", "7", "3"])
    assert find_task_tag("nothing here") is None
    for bad in ("a:b", "a]", "a b", ""):
        with pytest.raises(ValueError):
            task_tag("swe", bad)


def _chat(user: str, turns: list[tuple[str, str]]) -> str:
    text = f"<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    for said, obs in turns:
        text += (f"{said}<|im_end|>\n<|im_start|>user\n<tool_response>\n{obs}\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n")
    return text


def _ask(policy, text):
    from rolloutd.backends.policies import PolicyRequest

    return policy.reply(PolicyRequest(prompt_ids=[1], api="vllm", max_tokens=4096, decode=lambda ids: text))


def _calls(reply: str) -> list[dict]:
    from rolloutd.llm.toolparse import get_parser

    res = get_parser("hermes").parse(reply)
    assert not res.errors, res.errors
    return [{"name": c.name, "arguments": c.arguments} for c in res.calls]


def test_turn_counting_and_observations():
    text = _chat("[task math:chain_sum:1:0] q", [("call 1", "out 1"), ("call 2", "out\n2")])
    assert assistant_turns(text) == 2
    assert last_observation(text) == "out\n2"
    assert assistant_turns(_chat("q", [])) == 0 and last_observation(_chat("q", [])) is None


def test_math_oracle_computes_with_python_then_boxes_what_it_printed():
    from rolloutd.handlers.tasks import math_problem

    item = math_problem("basic_arithmetic", 5, 0)
    pol = Oracle(wrong_every=2)
    user = "[task math:basic_arithmetic:5:0]\n" + item["question"]
    (call,) = _calls(_ask(pol, _chat(user, [])))
    assert call["name"] == "python" and item["metadata"]["expression"] in call["arguments"]["code"]
    final = _ask(pol, _chat(user, [("...", item["answer"] + ".0")]))
    assert grade_answer(item["answer"], final)[0] == 1.0 and not _calls(final)
    # index 1 is odd: wrong on purpose
    item1 = math_problem("basic_arithmetic", 5, 1)
    final1 = _ask(pol, _chat("[task math:basic_arithmetic:5:1]", [("...", item1["answer"])]))
    assert grade_answer(item1["answer"], final1)[0] == 0.0


def test_math_oracle_free_form_questions_need_the_jsonl(tmp_path):
    q = {"question": "How many legs have 3 cats?", "answer": "12"}
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps(q) + "\n")
    tag = f"[task math:q:{question_key(q['question'])}]"
    assert "do not know" in _ask(Oracle(), _chat(tag, []))
    pol = Oracle(mode="right", jsonl=str(p))
    assert _calls(_ask(pol, _chat(tag, [])))[0]["name"] == "python"
    assert "\\boxed{12}" in _ask(pol, _chat(tag, [("...", "12")]))


def test_code_and_swe_oracles_play_multi_turn():
    from rolloutd.handlers.swe_tasks import get_task, task_ids

    pol = Oracle(mode="right")
    (c0,) = _calls(_ask(pol, _chat("[task code:HumanEval/0]", [])))
    assert c0["name"] == "editor" and c0["arguments"]["command"] == "create"
    assert c0["arguments"]["path"] == "solution.py" and "def has_close_elements" in c0["arguments"]["file_text"]
    (c1,) = _calls(_ask(pol, _chat("[task code:HumanEval/0]", [("a", "created")])))
    assert c1["name"] == "bash"
    assert not _calls(_ask(pol, _chat("[task code:HumanEval/0]", [("a", "x"), ("b", "y")])))
    tid = sorted(task_ids())[0]
    task = get_task(tid)
    edits = _calls(_ask(pol, _chat(f"[task swe:{tid}]", [])))
    assert [(e["arguments"]["old_str"], e["arguments"]["new_str"]) for e in edits] == \
        [(e["old"], e["new"]) for e in task["oracle_fix"]]
    wrong = _calls(_ask(Oracle(mode="wrong"), _chat(f"[task swe:{tid}]", [])))
    assert [e["arguments"]["new_str"] for e in wrong] == [e["new"] for e in task["wrong_fix"]]
    (run,) = _calls(_ask(pol, _chat(f"[task swe:{tid}]", [("a", "edited")])))
    assert run["name"] == "bash" and "pytest" in run["arguments"]["command"]
    assert "do not know" in _ask(pol, _chat("no tag", []))


def test_swe_test_prefix_drops_only_the_paths():
    from rolloutd.handlers.swe_tasks import load_tasks

    for t in load_tasks():
        pre = _test_prefix(t["test_cmd"])
        assert pre[:4] == ["python3", "-B", "-m", "pytest"]
        assert not any(a.startswith("tests") or a.endswith(".py") for a in pre), pre
        assert "-rfEsxXp" not in pre


def test_wrong_answers_differ():
    assert wrong_answer("41") == "42"
    assert wrong_answer("$\\dfrac{1}{2}$") != "\\dfrac{1}{2}"
    assert grade_answer("\\dfrac{1}{2}", "\\boxed{" + wrong_answer("\\dfrac{1}{2}") + "}")[0] == 0.0
    assert grade_answer("yes", "\\boxed{" + wrong_answer("yes") + "}")[0] == 0.0


# -- code: the check harness on the host --------------------------------------------------------------
def _run_check(task_id: str, body: str, tmp_path) -> bool:
    from rolloutd.handlers.code import check_argv, check_input
    from rolloutd.handlers.tasks import humaneval_problem

    p = humaneval_problem(task_id)
    d = tmp_path / task_id.replace("/", "_") / str(abs(hash(body)))
    d.mkdir(parents=True)
    (d / "solution.py").write_text(p["prompt"] + body)
    r = subprocess.run(check_argv(sys.executable), cwd=d, input=check_input(p, "solution.py", "M"),
                       capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and "ROLLOUTD-CHECK-M" in r.stdout


def test_humaneval_harness_canonical_passes_and_none_fails(tmp_path):
    from rolloutd.handlers.tasks import humaneval_problems

    probs = humaneval_problems()
    assert len(probs) == 164
    ids = [f"HumanEval/{i}" for i in sorted(set(range(0, 164, 9)) | {32, 33, 38, 50})]  # prompt helpers; 33 calls it by name
    with ThreadPoolExecutor(8) as ex:
        right = list(ex.map(lambda t: _run_check(t, probs[t]["canonical_solution"], tmp_path), ids))
        wrong = list(ex.map(lambda t: _run_check(t, "    return None\n", tmp_path), ids))
    assert all(right), [t for t, ok in zip(ids, right) if not ok]
    assert not any(wrong), [t for t, ok in zip(ids, wrong) if ok]


# -- handlers' static bits -----------------------------------------------------------------------
def test_pytest_closure_for_sandboxes():
    names = {n for n, _ in pytest_files()}
    assert {"pytest", "_pytest", "pluggy", "iniconfig", "packaging"} <= names
    assert any(n.startswith("pytest-") and n.endswith(".dist-info") for n in names)


def test_handlers_declare_their_shape_and_take_config():
    from rolloutd.handlers.code import CodeHandler
    from rolloutd.handlers.math import MathHandler
    from rolloutd.handlers.swe import SWEHandler

    m, c, s = MathHandler(), CodeHandler(), SWEHandler()
    assert (m.tools, m.eval_needs_sandbox, m.needs_sandbox) == (("python",), False, True)
    assert c.eval_needs_sandbox and "editor" in c.tools
    assert s.eval_needs_sandbox and set(s.tools) == {"bash", "editor"}
    m2 = MathHandler({"python": False, "max_turns": 2, "task_tag": False})
    assert m2.tools == () and not m2.needs_sandbox and m2.max_turns == 2


def test_registry_finds_the_domains():
    from rolloutd.handlers.registry import get_handler, handler_names

    assert {"math", "code", "swe"} <= set(handler_names())
    assert get_handler("swe").name == "swe"
    from rolloutd.backends.policies import available_policies, get_policy

    assert {"oracle", "math_oracle", "code_oracle", "swe_oracle"} <= set(available_policies())
    assert get_policy("oracle:wrong_every=5").wrong_every == 5


def test_math_without_tools_runs_with_no_sandbox(tok_dir):
    """``[handlers.math] python = false``: no sandbox at all; the answer alone is graded."""
    import asyncio

    from rolloutd.handlers.math import MathHandler
    from rolloutd.handlers.tasks import run_local
    from rolloutd.backends.scripted import ScriptedBackend

    b = ScriptedBackend(tok_dir, policy="constant:text=\"It is \\\\boxed{2}.\"")
    b.start()
    try:
        h = MathHandler({"tokenizer": tok_dir, "python": False, "grader": "thread"})
        # an unknown runtime name would raise if anything asked for a sandbox
        r = asyncio.run(run_local(h, {"question": "What is 1 + 1?", "answer": "2"}, backend_url=b.url,
                                  runtime="no-such-runtime"))
        wrong = asyncio.run(run_local(h, {"question": "What is 1 + 2?", "answer": "3"}, backend_url=b.url,
                                      runtime="no-such-runtime"))
    finally:
        b.stop()
    assert r["status"] == "ok" and r["reward"] == 1.0, (r["error"], r["eval_details"])
    assert len(r["turns"]) == 1 and r["metrics"]["tool_calls"] == 0
    assert wrong["status"] == "ok" and wrong["reward"] == 0.0
    assert r["eval_details"]["task"].startswith("math:q:")
