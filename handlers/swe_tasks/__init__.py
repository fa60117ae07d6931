"""The data side of the ``swe`` task domain: small software-engineering tasks built, the way
SWE-bench builds them, from real small pure-Python libraries and their own test suites.

Each task pins a PyPI sdist, a bug patch we wrote (the library's own tests catch it), an
issue text, the FAIL_TO_PASS / PASS_TO_PASS test ids and the test command. Third-party
source is never committed: ``build_task`` downloads and patches it into a cache.

    from rolloutd.handlers.swe_tasks import load_tasks, build_task, copy_repo, grade, run_tests
    repo = copy_repo("inflection-ordinal-teens", workspace)   # buggy repo in the sandbox dir
    ... the agent edits it; the sandbox runs task["test_cmd"] in it ...
    result = grade(task, output, exit_code)                   # result["resolved"], ["reward"]

See README.md in this folder.
"""
import importlib

_EXPORTS = {
    "rolloutd.handlers.swe_tasks.build": ["BuildError", "DownloadError", "build_all", "build_task", "copy_repo",
                                 "default_cache_dir", "pristine_tree", "repo_path"],
    "rolloutd.handlers.swe_tasks.restore": ["restore_tests"],
    "rolloutd.handlers.swe_tasks.grading": ["EditError", "apply_edits", "grade", "parse_test_output", "run_tests",
                                   "task_argv"],
    "rolloutd.handlers.swe_tasks.patching": ["PatchError", "apply_unified_diff"],
    "rolloutd.handlers.swe_tasks.taskdefs": ["TaskDefinitionError", "UnknownTask", "get_task", "load_tasks", "task_ids"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    # Lazy, so that `python -m rolloutd.handlers.swe_tasks.build` does not import build.py twice.
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_WHERE)  # noqa: F822
