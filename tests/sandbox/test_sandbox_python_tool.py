"""The persistent Python session: state, echo, errors, timeouts, restarts."""
import time


def py(c, code, timeout=10, **kw):
    return c.call("python", dict(code=code, timeout=timeout, **kw))


def test_variables_persist_and_last_expression_echoes(tool_env):
    _, _, c = tool_env
    assert py(c, "x = 20\ndef f(y):\n    return x + y").output == ""
    r = py(c, "f(22)")
    assert r.output == "42\n" and r.exit_code == 0
    assert py(c, "print('a'); x * 2").output == "a\n40\n"
    assert py(c, "_ + 1").output == "41\n"


def test_exception_keeps_session(tool_env):
    _, _, c = tool_env
    py(c, "kept = 'yes'")
    r = py(c, "1/0")
    assert r.exit_code == 1 and "ZeroDivisionError" in r.output
    assert "pyrepl" not in r.output  # driver frames are hidden
    assert py(c, "kept").output == "'yes'\n"


def test_syntax_error(tool_env):
    _, _, c = tool_env
    r = py(c, "def broken(:")
    assert r.exit_code == 1 and "SyntaxError" in r.output


def test_timeout_interrupts_and_keeps_state(tool_env):
    _, _, c = tool_env
    py(c, "survivor = 7")
    t0 = time.monotonic()
    r = py(c, "import time\nprint('started', flush=True)\nwhile True: time.sleep(0.01)", timeout=1)
    assert r.timed_out and r.exit_code == 130
    assert "started" in r.output and "KeyboardInterrupt" in r.output
    assert time.monotonic() - t0 < 4
    assert py(c, "survivor").output == "7\n"


def test_uninterruptible_code_restarts_session(tool_env):
    _, _, c = tool_env
    py(c, "lost = 1")
    r = py(c, "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)", timeout=0.5)
    assert r.timed_out and "fresh one starts" in r.output
    r2 = py(c, "'lost' in globals()")
    assert r2.output == "False\n"


def test_stdin_gets_eof(tool_env):
    _, _, c = tool_env
    r = py(c, "input()", timeout=5)
    assert not r.timed_out and "EOFError" in r.output


def test_subprocess_output_is_captured(tool_env):
    _, _, c = tool_env
    r = py(c, "import subprocess; subprocess.run(['echo', 'from-child'])")
    assert "from-child" in r.output


def test_sys_exit_and_os_exit(tool_env):
    _, _, c = tool_env
    py(c, "still = 1")
    r = py(c, "import sys; sys.exit(3)")
    assert r.exit_code == 3
    assert py(c, "still").output == "1\n"  # SystemExit does not end the session
    r = py(c, "import os; os._exit(5)")
    assert r.exit_code == 5 and "fresh session" in r.output
    assert py(c, "1 + 1").output == "2\n"


def test_output_cap(tool_env):
    _, _, c = tool_env
    r = py(c, "print('y' * 100000)")
    assert r.truncated and "output truncated" in r.output


def test_restart_argument_and_bad_args(tool_env):
    _, _, c = tool_env
    py(c, "gone = 1")
    assert py(c, None, restart=True).output == "[python session restarted]"
    assert py(c, "'gone' in globals()").output == "False\n"
    r = c.call("python", {"code": 123})
    assert r.error and "must be a string" in r.error
