"""The bash tool against a hostile (or just careless) agent: nothing the agent's command prints,
sets, traps, closes or kills may end a call early, hang it, leak the wrapper into its output,
or leave a dead tool server behind; every shell restart is reported (issue 13 items 14-16).

All of it runs in a real bwrap sandbox (tool_env never falls back to the local runtime)."""
import os
import socket
import threading

import pytest

from rolloutd.sandbox import ToolClient
from rolloutd.sandbox.toolserver.wire import encode
from tests.conftest import wait_for

WRAPPER_TEXT = ("builtin", "RLD", "/dev/fd/25", "__rld", "source")


def no_wrapper(text):
    return not any(w in text for w in WRAPPER_TEXT)


# -- item 15: the end of a call cannot be forged or broken from inside ------------------
def test_printed_markers_do_not_end_the_call(bash):
    # The old marker was PS1 expanded; ${PS1@P} printed it and ended the call before `after`.
    r = bash("echo \"${PS1@P}\"; printf '\\n__RLD_0_1_0__\\nRLDE0123456789ABCDEFRLDE\\n'; sleep 0.3; echo after")
    assert not r.timed_out and r.exit_code == 0
    assert r.output.endswith("after\n")
    assert "RLDE0123456789ABCDEFRLDE\n" in r.output  # not ours: kept verbatim


def test_readonly_prompt_and_wrapper_names_do_not_hang(bash):
    r = bash("readonly PS1='$ ' PS2='> ' __rld_n=1 __rld_rc=0 2>/dev/null; PROMPT_COMMAND='echo pc'; echo set", timeout=5)
    assert r.output == "set\n" and not r.timed_out
    r = bash("echo ok; (exit 4)", timeout=5)
    assert r.output == "ok\n" and r.exit_code == 4 and not r.timed_out  # the old marker hung until the timeout
    bash("unset PROMPT_COMMAND")
    bash(None, restart=True)  # readonly cannot be undone


def test_wrapper_leaves_no_names_in_the_shell(bash):
    r = bash("compgen -v | grep -ci rld; compgen -A function | grep -ci rld; true")
    assert r.output == "0\n0\n"


def test_debug_trap_sees_only_the_users_commands(bash):
    bash("trap 'echo \"DBG:$BASH_COMMAND\"' DEBUG")
    r = bash("echo hi")
    assert r.output == "DBG:echo hi\nhi\n"
    r = bash("echo a\necho b")
    assert r.output == "DBG:echo a\na\nDBG:echo b\nb\n"
    assert bash("trap -p DEBUG").output.startswith("DBG:trap -p DEBUG\ntrap -- 'echo \"DBG:$BASH_COMMAND\"' DEBUG")
    assert bash("trap - DEBUG").output == "DBG:trap - DEBUG\n"
    assert bash("echo x").output == "x\n"


def test_err_trap_fires_once_per_failing_command(bash):
    bash("trap 'echo ERR' ERR")
    try:
        r = bash("false")
        assert r.output == "ERR\n" and r.exit_code == 1
    finally:
        bash("trap - ERR")


def test_xtrace_shows_only_the_users_commands(bash):
    bash("set -x")
    try:
        r = bash("echo hi; v=1")
        traced = [l.lstrip("+").strip() for l in r.output.splitlines() if l.startswith("+")]
        assert traced == ["echo hi", "v=1"]
        assert "hi\n" in r.output and no_wrapper(r.output)
    finally:
        bash("set +x")
    assert bash("echo y").output == "y\n"


@pytest.mark.parametrize("setup,undo", [
    ("set -u", "set +u"),
    ("set -o noclobber", "set +o noclobber"),
    ("shopt -s xpg_echo", "shopt -u xpg_echo"),
    ("set -v", "set +v"),
    ("set -f; IFS=x", "set +f; IFS=$' \\t\\n'"),
    ("alias source=false printf=false trap=false set=false builtin=false unset=false", "unalias -a"),
    ("PS1='$(echo PROMPT)> '; PS0='zero '; PROMPT_COMMAND='echo pc'", "PS1=; PS0=; unset PROMPT_COMMAND"),
    ("stty echo olcuc onlcr -opost", "true"),
    ("set -o posix", "set +o posix"),
])
def test_hostile_shell_state(bash, setup, undo):
    bash(setup)
    try:
        r = bash("echo ok\n(exit 3)", timeout=5)
        assert not r.timed_out and r.error is None
        assert r.exit_code == 3
        assert [l for l in r.output.splitlines() if l.strip() and not l.startswith("(exit")] == ["ok"]
        assert no_wrapper(r.output), r.output
    finally:
        bash(undo)
    assert bash("echo clean").output == "clean\n"


@pytest.mark.parametrize("text,line", [
    ("echo a\necho b\nif then fi", 3),
    ("echo a\necho 'oops\necho c", 2),
    ("echo a\n)", 2),
    ("echo a\nif true; then\necho b", 4),
    ("echo a\n{ echo b", 3),
    ("f() {\necho", 3),
])
def test_syntax_error_points_at_the_users_line(bash, text, line):
    # What `bash -n` says of the text as a script: its line, never our wrapper's `}`.
    r = bash(text, timeout=5)
    assert r.error and "line %d:" % line in r.error, r.error
    assert "/dev/fd" not in r.error and "`}'" not in r.error and "bash:" not in r.error and r.output == ""


def test_unterminated_heredoc_points_at_its_line(bash):
    r = bash("echo a\ncat <<EOF\nab", timeout=5)
    assert r.error and "here-document at line 2" in r.error, r.error


# -- item 16: the agent cannot break or kill the tool machinery ------------------------
def test_scratch_area_cannot_be_broken(tool_env, bash):
    _, h, _ = tool_env
    assert h.runtime == "bwrap"  # never on the host
    r = bash("mkdir -p /tmp/.rolloutd; chmod 000 /tmp/.rolloutd; rm -rf /tmp/.rolloutd; touch /tmp/.rolloutd;"
             " chmod 000 /tmp/.rolloutd /tmp; echo done")
    assert r.output == "done\n"
    try:
        r = bash("echo works; pwd")
        assert r.output == "works\n/workspace\n" and r.exit_code == 0
        r = bash("exit 0")  # a fresh shell must start too
        assert "fresh shell" in r.output
        assert bash("echo again").output == "again\n"
    finally:
        bash("chmod 1777 /tmp; rm -f /tmp/.rolloutd")


@pytest.mark.parametrize("attack", [
    "rm -f /run/rolloutd/tool.sock; chmod 000 /run/rolloutd",
    "rm -f /run/rolloutd/tool.sock; mkdir /run/rolloutd/tool.sock; touch /run/rolloutd/tool.sock/x",
    "mv /run/rolloutd/tool.sock /run/rolloutd/moved.sock; : > /run/rolloutd/tool.sock",
])
def test_tool_socket_is_put_back(tool_env, attack):
    # The agent shares the tool server's uid and sees /run/rolloutd: without repair the host
    # could never reach the sandbox again (a dead sandbox that looks alive).
    _, h, c = tool_env
    run_dir = os.path.dirname(h.tool_socket)
    mode = os.stat(run_dir).st_mode & 0o7777
    r = c.call("bash", {"command": attack + "; echo done", "timeout": 10})
    assert r.output.endswith("done\n")  # under bwrap the dir is read-only: the attack fails outright

    def reachable():
        try:
            with ToolClient(h.tool_socket, connect_timeout=1) as fresh:
                return fresh.ping(timeout=2).output == "pong"
        except Exception:
            return False

    wait_for(reachable, timeout_s=15, what="the tool socket to be rebound")
    assert os.stat(run_dir).st_mode & 0o7777 == mode
    with ToolClient(h.tool_socket) as fresh:
        assert fresh.call("bash", {"command": "echo reached; rm -rf /run/rolloutd/moved.sock", "timeout": 10}).output == "reached\n"


@pytest.mark.parametrize("tamper", ["exec 254>&-", "exec 254>/dev/null", "exec 250</dev/null", "exec 251>&-",
                                    "exec 252>/dev/null", "exec 253>&-"])
def test_closing_the_wrappers_descriptors_restarts_with_a_note(bash, tamper):
    bash("export MARK=kept")
    r1 = bash(tamper + "; echo tampered", timeout=5)
    assert not r1.timed_out
    r2 = bash("echo ${MARK:-gone}", timeout=5)
    assert r2.exit_code == 0 and not r2.timed_out
    # The restart is reported by the call that broke the shell or by the next one.
    notes = r1.output + r2.output
    assert "fresh shell was started" in notes, (r1, r2)
    assert r2.output.startswith("gone\n")
    assert bash("echo fine").output == "fine\n"


def test_agent_cannot_kill_the_tool_server(tool_env, bash):
    _, _, c = tool_env
    pid = c.ping().info["pid"]
    assert pid == 1  # the namespace's init: SIGKILL/SIGSTOP from inside never reach it
    r = bash("kill -9 $PPID; kill -9 1; kill -STOP 1; kill -INT 1; kill -TERM 1; kill -HUP 1; echo survived", timeout=5)
    assert r.output == "survived\n" and r.exit_code == 0
    assert c.ping().info["pid"] == pid
    r = c.call("python", {"code": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('py survived')",
                          "timeout": 10})
    assert r.output == "py survived\n"
    # kill -9 -1 takes everything the agent can signal but itself; the tools come back with a note.
    c.call("python", {"code": "x = 1"})
    assert bash("kill -9 -1; echo after", timeout=5).output == "after\n"
    r = c.call("python", {"code": "print('back')", "timeout": 10})
    if not r.output.startswith("back\n"):  # the call that finds the session dying reports it
        assert "state lost" in r.output
        r = c.call("python", {"code": "print('back')", "timeout": 10})
    assert r.output.startswith("back\n")
    assert c.ping().info["pid"] == pid


# -- item 14: a call whose client gave up never starts; restarts are always reported ---
def _send_then_abandon(path, command, after):
    """A raw client: send one bash call, then go away without reading the reply."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    s.sendall(encode({"id": 1, "tool": "bash", "args": {"command": command, "timeout": 10}}))
    after()
    s.close()


def test_queued_call_whose_client_gave_up_never_runs(tool_env):
    _, h, c = tool_env
    c.call("bash", {"command": "rm -f /workspace/queued_ran /workspace/release"})
    before = c.ping().info["abandoned"]
    holder = {}

    def hold():  # holds the bash tool until the test releases it
        holder["r"] = c.call("bash", {"command": "touch /workspace/holding; "
                                                 "while [ ! -e /workspace/release ]; do sleep 0.05; done; echo held",
                                      "timeout": 60})

    t = threading.Thread(target=hold)
    t.start()
    try:
        wait_for(lambda: (h.workspace and os.path.exists(h.workspace + "/holding")), what="the first call")
        # queued behind it (ping's info.waiting says so); then its client gives up
        _send_then_abandon(h.tool_socket, "touch /workspace/queued_ran",
                           lambda: wait_for(lambda: c.ping().info["waiting"]["bash"] == 1, what="the call to wait"))
        wait_for(lambda: c.ping().info.get("abandoned", 0) > before, what="the queued call to be dropped")
    finally:
        open(h.workspace + "/release", "w").close()
        t.join(20)
    assert holder["r"].output == "held\n"
    r = c.call("bash", {"command": "test -e /workspace/queued_ran && echo RAN || echo never; "
                                   "rm -f /workspace/holding /workspace/release"})
    assert r.output == "never\n"
    info = c.ping().info
    assert info["abandoned"] == before + 1 and info["waiting"] == {"bash": 0, "python": 0, "editor": 0}


def test_restart_in_a_cancelled_call_is_reported_to_the_next_call(tool_env):
    _, h, c = tool_env
    c.call("bash", {"command": "export MARK=kept; cd /tmp; rm -f /workspace/loop_started"})
    restarts = c.ping().info["bash_restarts"]
    # A builtin loop ignoring SIGINT: interrupting it needs a fresh shell. The client goes away.
    _send_then_abandon(h.tool_socket, "touch /workspace/loop_started; trap '' INT; while :; do :; done",
                       lambda: wait_for(lambda: os.path.exists(h.workspace + "/loop_started"), what="the loop"))
    wait_for(lambda: c.ping().info["bash_restarts"] > restarts, what="the restart")
    r = c.call("bash", {"command": "echo ${MARK:-gone}; pwd"})
    assert r.output.startswith("gone\n/workspace\n")
    assert "fresh one started" in r.output  # the restart the cancelled call caused
    r = c.call("bash", {"command": "echo once"})
    assert r.output == "once\n"  # reported once, not forever


def test_require_bwrap_fails_when_the_run_demands_it(monkeypatch):
    import rolloutd.sandbox
    from tests import conftest as sc

    monkeypatch.setattr(rolloutd.sandbox, "bwrap_works", lambda *a, **k: (False, "user namespaces denied (test)"))
    monkeypatch.setenv("ROLLOUTD_REQUIRE_BWRAP", "1")
    with pytest.raises(pytest.fail.Exception, match="denied"):
        sc.require_bwrap()
    monkeypatch.delenv("ROLLOUTD_REQUIRE_BWRAP")
    with pytest.raises(pytest.skip.Exception, match="denied"):
        sc.require_bwrap()


def test_killed_tool_server_without_isolation_is_a_clear_error(local_rt):
    # The local runtime (development only) has no pid namespace to protect the tool server:
    # killing it must give the job a transport error at once, never a call that hangs.
    from rolloutd.sandbox import ToolTransportError

    h = local_rt.create("kill-local")
    c = local_rt.client(h, timeout=10)
    assert c.call("bash", {"command": "echo up"}).output == "up\n"
    with pytest.raises(ToolTransportError, match="closed the connection|failed during"):
        c.call("bash", {"command": "kill -9 $PPID; sleep 5", "timeout": 10})
    with pytest.raises(ToolTransportError):  # refused, or reset if it raced the exit
        ToolClient(h.tool_socket, connect_timeout=2).ping()
