"""Authoring helper: turn a hand-written task JSON into a complete task.

    python -m rolloutd.handlers.swe_tasks.author TASK_ID [--runner PYTHON[:PYTHONPATH]] ... [--runs 2]

Reads ``tasks/TASK_ID.json`` as written by hand (library, version, sdist_subdir, issue,
test_cmd, test_files, oracle_fix, wrong_fix, timeout_s; ``sdist``/``sdist_sha256`` may be
empty and are then filled in from a fresh ``pip download``), and:

1. unpacks the pristine sdist and introduces the bug by applying ``oracle_fix`` in reverse
   (each ``new`` string replaced by its ``old``), so the bug is defined once;
2. writes ``patches/<bug_patch>`` as a unified diff pristine -> buggy, and checks that it
   applies with our applier;
3. runs ``test_cmd`` on the pristine and the buggy tree, ``--runs`` times with every
   ``--runner`` interpreter (default: this one), and sets FAIL_TO_PASS = tests failing in
   every buggy run and passing in every pristine run, PASS_TO_PASS = tests passing in every
   run. Use a second runner with only pytest importable (``--runner /venv/bin/python:/dir/with/pytest``
   on a bare venv) so PASS_TO_PASS holds no test that needs an optional dependency.

Then run ``python -m rolloutd.handlers.swe_tasks --task TASK_ID --verify``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rolloutd.handlers.swe_tasks.build import _pip_download, pristine_tree, resolve_cache_dir
from rolloutd.handlers.swe_tasks.grading import parse_test_output, run_tests
from rolloutd.handlers.swe_tasks.patching import apply_unified_diff, make_unified_diff
from rolloutd.handlers.swe_tasks.taskdefs import PATCHES_DIR, TASKS_DIR, validate_task


def _fill_sdist(task: dict) -> None:
    if task.get("sdist") and task.get("sdist_sha256"):
        return
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download([f"{task['library']}=={task['version']}"], Path(tmp))
        (path,) = list(Path(tmp).iterdir())
        task["sdist"] = path.name
        task["sdist_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"sdist: {task['sdist']} sha256 {task['sdist_sha256']}")


def _reverse_edits(repo: Path, edits: list[dict]) -> list[str]:
    touched = []
    for e in edits:
        p = repo / e["path"]
        text = p.read_text(encoding="utf-8")
        n = text.count(e["new"]) if e["new"] else 0
        if n != 1:
            raise SystemExit(f"oracle_fix 'new' text must occur exactly once in pristine {e['path']} (found {n})")
        p.write_text(text.replace(e["new"], e["old"], 1), encoding="utf-8")
        if e["path"] not in touched:
            touched.append(e["path"])
    return touched


def _runners(specs: list[str] | None) -> list[tuple[str, dict]]:
    out = []
    for spec in specs or [sys.executable]:
        py, _, pypath = spec.partition(":")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if pypath:
            env["PYTHONPATH"] = pypath
        out.append((py, env))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rolloutd.handlers.swe_tasks.author")
    ap.add_argument("task_id")
    ap.add_argument("--runner", action="append", help="PYTHON[:PYTHONPATH] to run the tests with (repeatable)")
    ap.add_argument("--runs", type=int, default=2, help="runs per tree and runner (flakiness filter)")
    ap.add_argument("--cache", default=None)
    args = ap.parse_args(argv)

    path = TASKS_DIR / f"{args.task_id}.json"
    task = json.loads(path.read_text(encoding="utf-8"))
    task.setdefault("bug_patch", f"{args.task_id}.diff")
    task.setdefault("FAIL_TO_PASS", [])
    task.setdefault("PASS_TO_PASS", [])
    _fill_sdist(task)
    cache = resolve_cache_dir(args.cache)

    with tempfile.TemporaryDirectory(prefix=f"swe-author-{args.task_id}-") as tmp:
        tmp = Path(tmp)
        pristine = pristine_tree(task, tmp / "p", cache)
        buggy = tmp / "buggy"
        shutil.copytree(pristine, buggy, symlinks=True)
        touched = _reverse_edits(buggy, task["oracle_fix"])
        diff = "".join(make_unified_diff(rel, (pristine / rel).read_text(encoding="utf-8"),
                                         (buggy / rel).read_text(encoding="utf-8")) for rel in touched)
        check = tmp / "check"
        shutil.copytree(pristine, check, symlinks=True)
        apply_unified_diff(check, diff)
        for rel in touched:
            assert (check / rel).read_bytes() == (buggy / rel).read_bytes(), rel
        (PATCHES_DIR / task["bug_patch"]).write_text(diff, encoding="utf-8")
        print(f"wrote {PATCHES_DIR / task['bug_patch']} ({len(diff.splitlines())} lines)")

        results: dict[str, list[dict[str, str]]] = {"pristine": [], "buggy": []}
        for py, env in _runners(args.runner):
            for _ in range(args.runs):
                for name, repo in (("pristine", pristine), ("buggy", buggy)):
                    out, rc = run_tests(task, repo, python=py, env=env)
                    outcomes = parse_test_output(out)
                    if not outcomes:
                        raise SystemExit(f"{name} run with {py} produced no outcomes (exit {rc}):\n{out[-3000:]}")
                    results[name].append(outcomes)
                    print(f"{name:8s} {py}: exit {rc}, {sum(v == 'passed' for v in outcomes.values())} passed, "
                          f"{sum(v in ('failed', 'error') for v in outcomes.values())} failed")
    order = list(results["pristine"][0])
    weird = [t for t in order if " - " in t]
    if weird:
        print(f"warning: dropping ids containing ' - ': {weird}")

    def everywhere(name: str, ok: set[str]) -> set[str]:
        return {t for t in order if all(r.get(t) in ok for r in results[name])}

    pristine_pass = everywhere("pristine", {"passed"})
    buggy_fail = everywhere("buggy", {"failed", "error"})
    buggy_pass = everywhere("buggy", {"passed"})
    task["FAIL_TO_PASS"] = [t for t in order if t in pristine_pass and t in buggy_fail and t not in weird]
    task["PASS_TO_PASS"] = [t for t in order if t in pristine_pass and t in buggy_pass and t not in weird]
    unstable = [t for t in order if t not in task["FAIL_TO_PASS"] and t not in task["PASS_TO_PASS"]]
    print(f"FAIL_TO_PASS={len(task['FAIL_TO_PASS'])} PASS_TO_PASS={len(task['PASS_TO_PASS'])} "
          f"excluded={len(unstable)} {unstable[:10]}")
    if not task["FAIL_TO_PASS"]:
        raise SystemExit("no FAIL_TO_PASS test: the library's tests do not catch this bug")
    validate_task(task)
    path.write_text(json.dumps(task, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
