"""Red team of the swe grader (issue 24), through the domain's real eval against a real bwrap
sandbox: what the agent leaves in the repository is what pytest runs over, and the host restores
the task's tests into that tree as root. Findings are strict xfails (see test_sandbox_redteam.py)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tests.sandbox.conftest import swe_sandbox


FORCE_PASS = '''
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome, rep.longrepr = "passed", None
'''

# `python3 -m pytest` with cwd /workspace: the cwd is sys.path[0], so this file is "pytest". It
# takes the cwd out of sys.path, imports the real pytest and runs it with the plugin above.
FAKE_PYTEST = '''
import os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
import pytest

class ForcePass:
''' + "\n".join("    " + line for line in FORCE_PASS.splitlines() if "import" not in line).replace(
    "def pytest_runtest_makereport(item", "def pytest_runtest_makereport(self, item") + '''

sys.exit(pytest.main(sys.argv[1:], plugins=[ForcePass()]))
'''


def test_swe_an_agents_conftest_cannot_pass_the_unfixed_repository(bwrap_rt):
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    r = c.call("bash", {"command": "cat >> conftest.py <<'EOF'\n" + FORCE_PASS + "EOF\necho ok", "timeout": 20})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details  # graded, not an error
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details


def test_swe_a_pytest_module_in_the_workspace_is_not_the_grader(bwrap_rt):
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    assert task["test_cmd"][:4] == ["python3", "-B", "-m", "pytest"], task["test_cmd"]
    (Path(h.workspace) / "pytest.py").write_text(FAKE_PYTEST)  # as the agent's editor would
    from rolloutd.handlers.tasks import give_to_sandbox
    give_to_sandbox(h.to_dict(), [Path(h.workspace) / "pytest.py"])
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details


def test_swe_a_fifo_in_place_of_a_test_file_is_graded_not_an_error(bwrap_rt):
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    rel = task["test_files"][0]
    r = c.call("bash", {"command": f"rm -f {rel} && mkfifo {rel} && ls -l {rel}", "timeout": 20})
    assert r.output.startswith("p"), r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 0.0 and details["counts"]["parsed"], details


def test_swe_restore_never_writes_through_a_symlinked_test_file(bwrap_rt, tmp_path):
    """The host (root) restores the task's test files: a test file replaced by a symlink to a host
    file must not make the host overwrite that file (the directory variant is
    test_sandbox_graders.py's). On 88658d9 the victim held the test module afterwards; the fix is
    handlers/swe.py's _unlink_symlinks."""
    os.chmod(tmp_path, 0o755)
    victim = tmp_path / "victim.conf"
    victim.write_text("ORIGINAL\n")
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    rel = task["test_files"][0]
    r = c.call("bash", {"command": f"ln -sf {victim} {rel} && ls -l {rel}", "timeout": 20})
    assert "->" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert victim.read_text() == "ORIGINAL\n"
    assert reward == 0.0 and details["counts"]["parsed"], details


# Started by git itself inside the first swe grade (`git diff`): the agent's .git/config names it as
# core.fsmonitor. It detaches, and its leader thread exits with SYS_exit while a thread lives on
# (/proc/<pid>/stat says Z). The thread waits for the host to restore the task's tests, then
# appends code that makes every test function of the module pass.
FSMONITOR_DAEMON = r'''
import ctypes, os, sys, threading, time
path = "/workspace/" + sys.argv[1]
# Every test function of the module becomes one that passes; functools.wraps keeps its marks
# (parametrize) and signature (fixtures), so the test ids stay those the grader looks for.
PASS_ALL = """
# PASSED-BY-DAEMON
import functools as _ft
def _passes(f):
    @_ft.wraps(f)
    def w(*a, **k):
        return None
    return w
for _n, _f in list(globals().items()):
    if _n.startswith("test_") and callable(_f):
        globals()[_n] = _passes(_f)
"""
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)

def live():
    end = time.time() + 60
    while time.time() < end:
        try:
            src = open(path).read()
        except OSError:
            src = ""
        if src and "# PASSED-BY-DAEMON" not in src:
            with open(path, "a") as f:
                f.write(PASS_ALL)
        time.sleep(0.002)
    os._exit(0)

threading.Thread(target=live).start()
time.sleep(0.1)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the leader only
'''


def test_swe_a_daemon_started_by_the_diff_grader_cannot_outlive_it(bwrap_rt):
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    rel = task["test_files"][0]
    (Path(h.workspace) / ".git" / "d.py").write_text(FSMONITOR_DAEMON)  # as the agent's editor would
    from rolloutd.handlers.tasks import give_to_sandbox
    give_to_sandbox(h.to_dict(), [Path(h.workspace) / ".git" / "d.py"])
    r = c.call("bash", {"command": "printf '#!/bin/sh\\npython3 /workspace/.git/d.py %s\\nexit 1\\n' > .git/fsm.sh "
                                   "&& chmod +x .git/fsm.sh && git config core.fsmonitor /workspace/.git/fsm.sh "
                                   "&& echo ok" % rel, "timeout": 20})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details
    assert "PASSED-BY-DAEMON" not in (Path(h.workspace) / rel).read_text()


# Appended to the library under test (the agent's "fix"): imported by the tests, it prints a
# short test summary of its own at interpreter exit, after pytest's, with every collected test
# (found on pytest's Session object in the same process) PASSED.
LOOKALIKE_SUMMARY = r'''

def _rolloutd_redteam_summary():
    import gc, sys
    try:
        from _pytest.main import Session
    except Exception:
        return
    ids = [i.nodeid for o in gc.get_objects() if isinstance(o, Session) for i in getattr(o, "items", [])]
    if ids:
        sys.stdout.write("\n=== short test summary info ===\n" + "".join("PASSED %s\n" % i for i in ids))
        sys.stdout.flush()

import atexit as _atexit
_atexit.register(_rolloutd_redteam_summary)
'''


def test_swe_code_under_test_cannot_print_a_summary_of_its_own(bwrap_rt):
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    lib = Path(h.workspace) / "boltons" / "strutils.py"
    assert task["test_files"] == ["tests/test_strutils.py"] and lib.is_file(), task
    with lib.open("a") as f:  # as the agent's editor would
        f.write(LOOKALIKE_SUMMARY)
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details


def test_swe_the_repositorys_own_conftest_is_restored_and_others_deleted(bwrap_rt):
    """The agent's hook goes into the repository's own tests/conftest.py and into new conftest.py
    files below the tests and the library: the grade restores the first and deletes the others.
    On the old code (every conftest loaded, only test_files restored) this was reward 1.0."""
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    ws = Path(h.workspace)
    assert (ws / "tests" / "conftest.py").is_file()
    r = c.call("bash", {"command": "cat >> tests/conftest.py <<'EOF'\n" + FORCE_PASS + "EOF\nmkdir -p tests/sub && "
                                   "cp tests/conftest.py tests/sub/conftest.py && cp tests/conftest.py boltons/conftest.py "
                                   "&& echo ok", "timeout": 20})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert details["counts"]["parsed"], details
    assert reward == 0.0 and details["FAIL_TO_PASS_failed"], details
    assert "hookwrapper" not in (ws / "tests" / "conftest.py").read_text()
    assert not (ws / "tests" / "sub" / "conftest.py").exists() and not (ws / "boltons" / "conftest.py").exists()


def test_swe_the_diff_grader_runs_none_of_the_agents_git_programs(bwrap_rt):
    """The agent's .git/config names programs for git to run in `git diff` (fsmonitor hook,
    external diff, textconv, pager) and its .gitattributes selects the textconv driver: the diff
    grade runs none of them (each would leave a file). On the old code the fsmonitor hook ran."""
    handler, ctx, h, c, task = swe_sandbox(bwrap_rt)
    ws = Path(h.workspace)
    cmd = ("printf '#!/bin/sh\\ntouch /workspace/.git/ran-$1\\ncat \"$2\" 2>/dev/null\\nexit 1\\n' > .git/prog.sh && "
           "chmod +x .git/prog.sh && git config core.fsmonitor '/workspace/.git/prog.sh fsmonitor' && "
           "git config diff.external '/workspace/.git/prog.sh external' && "
           "git config diff.tc.textconv '/workspace/.git/prog.sh textconv' && "
           "git config core.pager '/workspace/.git/prog.sh pager' && echo '* diff=tc' > .git/info/attributes && "
           "echo '# changed' >> %s && echo ok" % task["test_files"][0])
    r = c.call("bash", {"command": cmd, "timeout": 20})
    assert "ok" in r.output, r
    reward, details = asyncio.run(handler.evaluate(ctx))
    assert reward == 0.0 and details["counts"]["parsed"], details
    assert sorted(p.name for p in (ws / ".git").glob("ran-*")) == []
    assert "# changed" in (details["patch"] or ""), details  # the diff itself was taken
