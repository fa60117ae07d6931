"""Run a task's tests, parse per-test outcomes, and grade the SWE-bench way.

The task's ``test_cmd`` runs pytest with ``-rfEsxXp --color=no``: the short test summary then
holds one line per test, ``PASSED <nodeid>`` / ``FAILED <nodeid> - <message>`` /
``ERROR <nodeid> - ...`` / ``XFAIL <nodeid> ...``, and with pytest >= 9 one
``SUBFAILED(<params>) <nodeid> - ...`` line per failing ``unittest`` subTest (pytest 9 then
still reports the parent test ``PASSED``; a SUBFAILED line turns it into a failure here).
Those lines are read from the captured stdout (ANSI escapes and ``\\r`` stripped), so grading
needs only the text the sandbox returned, not a file from the workspace.

A test is *passed* only if it has a PASSED (or XFAIL) line and no FAILED/ERROR/SUBFAILED line;
a test that does not appear at all (collection error, crash, timeout, truncated output)
counts as failed. ``resolved`` = every FAIL_TO_PASS and every PASS_TO_PASS test passed.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable

__all__ = ["parse_test_output", "grade", "run_tests", "apply_edits", "EditError", "task_argv"]

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_STATUS_RE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED|SUBPASSED|SUBFAILED|SUBSKIPPED)(\(.*?\))? (.+)$")
_STATUS_MAP = {
    "PASSED": "passed", "XFAIL": "passed",  # an expected failure is a pass for grading
    "FAILED": "failed", "XPASS": "failed", "SUBFAILED": "failed",
    "ERROR": "error",
    "SKIPPED": "skipped", "SUBSKIPPED": None, "SUBPASSED": None,  # sub-results never make a pass
}
_SUMMARY_RE = re.compile(r"^=+ short test summary info =+$")
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


class EditError(ValueError):
    """An edit's ``old`` string is not found exactly once."""


def _clean(text: str) -> list[str]:
    text = _ANSI_RE.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return text.split("\n")


def _match_known(rest: str, known: set[str]) -> str | None:
    """The test id at the start of ``rest`` (``<id>`` or ``<id> - <message>``), among ``known``."""
    if rest in known:
        return rest
    start = 0
    while True:
        i = rest.find(" - ", start)
        if i < 0:
            return None
        if rest[:i] in known:
            return rest[:i]
        start = i + 1


def parse_test_output(output: str, known_ids: Iterable[str] | None = None) -> dict[str, str]:
    """Map test id -> ``passed | failed | error | skipped`` from pytest ``-r`` summary lines
    (those after the last ``=== short test summary info ===`` header; none without one).

    With ``known_ids`` (recommended) only those ids are reported, and ids that contain spaces
    or `` - `` are matched exactly; without, the id is the text up to the first `` - ``.
    A worse outcome wins when a test appears several times (a failing subtest, or a test
    that passed its call but errored in teardown)."""
    known = set(known_ids) if known_ids is not None else None
    result: dict[str, str] = {}
    lines = _clean(output)
    # Only pytest's own short test summary counts, not look-alike lines in captured output.
    starts = [i for i, line in enumerate(lines) if _SUMMARY_RE.match(line.strip())]
    if not starts:
        return result
    for line in lines[starts[-1] + 1:]:
        m = _STATUS_RE.match(line.rstrip())
        if not m:
            continue
        status = _STATUS_MAP[m.group(1)]
        rest = m.group(3)
        if rest.startswith("[") and m.group(1) in ("SKIPPED", "XFAIL"):
            continue  # "SKIPPED [1] file.py:12: reason": no node id
        if known is not None:
            test_id = _match_known(rest, known)
            if test_id is None and m.group(2):
                # the subtest's parameters may themselves contain ") ": try every split
                full = line.rstrip()[len(m.group(1)):]
                for j in (k + 2 for k in range(len(full)) if full.startswith(") ", k)):
                    test_id = _match_known(full[j:], known)
                    if test_id is not None:
                        break
        else:
            test_id = rest.split(" - ", 1)[0]
            if m.group(1) == "XFAIL":
                test_id = test_id.split(" ", 1)[0]
        if test_id is None:
            continue
        if status is None:
            continue  # a passing/skipped subtest says nothing about its parent test
        prev = result.get(test_id)
        if prev is None or _RANK[status] > _RANK[prev]:
            result[test_id] = status
    return result


def grade(task: dict, test_output: str, exit_code: int | None) -> dict:
    """Score one test run of ``task`` SWE-bench style. ``resolved`` only if every
    FAIL_TO_PASS and every PASS_TO_PASS test passed. Returns counts and per-list details."""
    f2p, p2p = list(task["FAIL_TO_PASS"]), list(task["PASS_TO_PASS"])
    outcomes = parse_test_output(test_output or "", known_ids=f2p + p2p)

    def split(ids: list[str]) -> dict:
        ok = [t for t in ids if outcomes.get(t) == "passed"]
        bad = [t for t in ids if outcomes.get(t) != "passed"]
        missing = [t for t in ids if t not in outcomes]
        return {"success": ok, "failure": bad, "missing": missing}

    f, p = split(f2p), split(p2p)
    resolved = not f["failure"] and not p["failure"] and bool(f2p)
    error = None
    if not outcomes:
        error = ("no per-test outcomes found in the test output (collection error, interpreter "
                 "crash, timeout or truncated output?)")
    return {
        "task_id": task["task_id"],
        "resolved": resolved,
        "reward": 1.0 if resolved else 0.0,
        "exit_code": exit_code,
        "FAIL_TO_PASS": f,
        "PASS_TO_PASS": p,
        "counts": {
            "f2p_passed": len(f["success"]), "f2p_total": len(f2p),
            "p2p_passed": len(p["success"]), "p2p_total": len(p2p),
            "parsed": len(outcomes),
        },
        "error": error,
    }


def task_argv(task: dict, python: str | None = None) -> list[str]:
    """The task's ``test_cmd`` with its interpreter placeholder ``python3`` replaced by
    ``python`` (default: leave it, for a sandbox whose PATH has python3)."""
    argv = list(task["test_cmd"])
    if python and argv and argv[0] in ("python3", "python"):
        argv[0] = python
    return argv


def run_tests(task: dict, repo_dir: str | os.PathLike, *, python: str | None = None,
              timeout_s: float | None = None, env: dict | None = None) -> tuple[str, int]:
    """Run the task's test command in ``repo_dir`` on this host (no sandbox) and return
    (combined output, exit code). ``python`` defaults to this interpreter (it needs pytest).
    A timeout returns the partial output and exit code 124. Used by --verify and the tests;
    in production the command runs inside the job's sandbox instead."""
    python = python or sys.executable
    if os.sep in python and not os.path.isabs(python):
        python = os.path.abspath(python)  # the command runs with cwd=repo_dir
    argv = task_argv(task, python)
    run_env = dict(os.environ if env is None else env)
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONSAFEPATH"):
        run_env.pop(var, None)
    run_env.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # like a sandbox with bare pytest
    run_env["PYTHONDONTWRITEBYTECODE"] = "1"
    run_env["COLUMNS"] = "200"
    limit = float(timeout_s if timeout_s is not None else task["timeout_s"])
    # own process group, so a timeout also kills whatever the tests spawned
    proc = subprocess.Popen(argv, cwd=str(repo_dir), env=run_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return (out.decode("utf-8", "replace")
                + f"\n[rolloutd] test command timed out after {limit:.0f}s\n"), 124
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt, ...): leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out.decode("utf-8", "replace"), proc.returncode


def apply_edits(repo_dir: str | os.PathLike, edits: list[dict]) -> list[str]:
    """Apply str_replace edits ``{"path", "old", "new"}`` in order; each ``old`` must occur
    exactly once in its file (like an agent's editor). All-or-nothing per call."""
    root = Path(repo_dir).resolve()
    staged: dict[Path, str] = {}
    for e in edits:
        path = (root / e["path"]).resolve()
        if root not in path.parents:
            raise EditError(f"edit path escapes the repository: {e['path']!r}")
        text = staged.get(path)
        if text is None:
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError as exc:
                raise EditError(f"{e['path']}: no such file") from exc
        n = text.count(e["old"])
        if n != 1:
            raise EditError(f"{e['path']}: old string found {n} times (must be exactly once)")
        staged[path] = text.replace(e["old"], e["new"], 1)
    for path, text in staged.items():
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    return [str(p.relative_to(root)) for p in staged]
