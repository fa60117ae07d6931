"""Corner cases of the bash tool (one shared sandbox; every test leaves the shell usable)."""
import time

import pytest


def test_exit_code_and_output(bash):
    r = bash("echo out; echo err >&2; false")
    assert r.output == "out\nerr\n"
    assert r.exit_code == 1 and not r.timed_out and r.error is None
    assert r.duration > 0


def test_cwd_and_env_persist(tool_env, bash):
    assert tool_env[1].runtime == "bwrap"  # writes /tmp/persist: never on the host
    bash("mkdir -p /tmp/persist && cd /tmp/persist && export ROLL_VAR=42 && myfn() { echo fn-$1; }")
    r = bash("pwd; echo $ROLL_VAR; myfn x")
    assert r.output == "/tmp/persist\n42\nfn-x\n"
    bash("cd /workspace")


def test_multiline_and_heredoc(bash):
    r = bash("for i in 1 2 3; do\n  echo line$i\ndone\ncat <<'EOF'\n$NOT_EXPANDED\nEOF")
    assert r.output == "line1\nline2\nline3\n$NOT_EXPANDED\n"
    assert r.exit_code == 0


def test_timeout_returns_partial_output(bash):
    t0 = time.monotonic()
    r = bash("echo before; sleep 30; echo NEVER_PRINTED", timeout=1)
    assert r.timed_out and r.exit_code == 130
    assert "before" in r.output and "NEVER_PRINTED" not in r.output
    assert "timed out" in r.output
    assert time.monotonic() - t0 < 5
    assert bash("echo alive").output == "alive\n"  # the shell survived the interrupt


def test_timeout_of_builtin_loop(bash):
    r = bash("while true; do :; done", timeout=0.5)
    assert r.timed_out
    assert bash("echo alive").output == "alive\n"


def test_command_ignoring_sigint_is_killed(bash):
    r = bash("trap '' INT; sleep 30", timeout=0.5)
    assert r.timed_out
    r2 = bash("echo alive; trap - INT")
    assert "alive" in r2.output


def test_output_cap_keeps_head_and_tail(bash):
    r = bash("seq 1 200000")  # ~1.3 MB, the fixture caps at 16 KiB
    assert r.truncated
    assert r.output.startswith("1\n2\n3\n")
    assert r.output.rstrip().endswith("199999\n200000")
    assert "output truncated" in r.output
    assert len(r.output.encode()) < 17 * 1024


def test_very_long_output_is_fast_and_complete_marker(bash):
    t0 = time.monotonic()
    r = bash("head -c 20000000 /dev/zero | tr '\\0' 'a'; echo; echo END")
    assert r.exit_code == 0 and r.truncated
    assert r.output.endswith("END\n")
    assert time.monotonic() - t0 < 10


def test_long_single_line_without_newline(bash):
    r = bash("printf 'x%.0s' $(seq 1 5000)")
    assert r.output == "x" * 5000


def test_unterminated_quote_is_an_error(bash):
    r = bash("echo 'oops", timeout=5)
    assert r.error and "syntax error" in r.error and "matching" in r.error
    assert r.duration < 4  # an error at once, not a hang until the timeout
    assert bash("echo fine").output == "fine\n"


def test_unterminated_heredoc_is_an_error(bash):
    r = bash("cat <<EOF\nnever closed", timeout=5)
    assert r.error and "here-document" in r.error
    assert r.output == ""  # nothing ran


def test_syntax_error_does_not_run_anything(bash):
    r = bash("touch /tmp/should_not_exist; if then fi")
    assert r.error and "syntax error" in r.error
    assert bash("test -e /tmp/should_not_exist; echo $?").output == "1\n"


def test_background_process_does_not_block(bash):
    t0 = time.monotonic()
    r = bash("sleep 100 &\necho started")
    assert r.output.strip().endswith("started") and r.exit_code == 0
    assert time.monotonic() - t0 < 5
    bash("kill %1 2>/dev/null; wait 2>/dev/null; true")


def test_background_job_with_nohup_output(bash):
    r = bash("(sleep 0.2; echo late) & echo now")
    assert "now" in r.output
    time.sleep(0.4)
    r2 = bash("echo next")
    assert r2.output == "next\n"  # output produced between calls is not mixed into the next call


def test_exit_restarts_a_fresh_shell(bash):
    bash("export BEFORE_EXIT=1; cd /tmp")
    r = bash("exit 7")
    assert r.exit_code == 7 and "fresh shell" in r.output
    r2 = bash("echo ${BEFORE_EXIT:-unset}; pwd")
    assert r2.output == "unset\n/workspace\n"


def test_exit_with_background_job_holding_the_pty(bash):
    r = bash("sleep 60 & exit 0", timeout=5)
    assert "fresh shell" in r.output
    assert bash("echo ok").output == "ok\n"


def test_stdin_reader_gets_eof(bash):
    t0 = time.monotonic()
    r = bash("cat; read -r line; echo read-rc=$?", timeout=5)
    assert not r.timed_out and "read-rc=1" in r.output
    assert time.monotonic() - t0 < 4


def test_python_input_gets_eof(bash):
    r = bash("python3 -c 'input()'", timeout=5)
    assert not r.timed_out and "EOFError" in r.output


def test_ansi_colours_are_stripped(bash):
    r = bash(r"printf '\033[31mred\033[0m \033[1;32mbold\033[0m\n'; ls --color=always /workspace")
    assert "\x1b" not in r.output
    assert r.output.startswith("red bold\n")
    assert "hello.txt" in r.output


def test_crlf_is_normalized(bash):
    r = bash(r"printf 'a\r\nb\n'")
    assert r.output == "a\nb\n"


def test_ps1_tampering_is_harmless(bash):
    bash("PS1='$ '; PROMPT_COMMAND='echo pc'")
    r = bash("echo still")
    assert "still" in r.output and not r.timed_out
    bash("unset PROMPT_COMMAND")


def test_unicode_round_trip(bash):
    r = bash("echo 'héllo wörld ✓ 日本'")
    assert r.output == "héllo wörld ✓ 日本\n"


def test_restart_argument(bash):
    bash("export GONE=1")
    r = bash(None, restart=True)
    assert r.output == "[shell restarted]"
    assert bash("echo ${GONE:-unset}").output == "unset\n"


@pytest.mark.parametrize("args,needle", [
    ({}, "'command'"),
    ({"command": 5}, "must be a string"),
    ({"command": "true", "timeout": -1}, "positive"),
    ({"command": "true", "timeout": "x"}, "positive"),
])
def test_bad_arguments_are_errors_not_crashes(tool_env, args, needle):
    _, _, c = tool_env
    r = c.call("bash", args, timeout=5) if "timeout" in args else c.call("bash", dict(args))
    assert r.error and needle in r.error
    assert c.ping().output == "pong"


def test_unknown_tool(tool_env):
    _, _, c = tool_env
    r = c.call("rm_rf", {})
    assert r.error and "unknown tool" in r.error
    assert c.ping().output == "pong"


def test_garbage_frame_does_not_kill_server(tool_env):
    import socket
    import struct

    _, h, c = tool_env
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(h.tool_socket)
    body = b"this is not json"
    s.sendall(struct.pack("!I", len(body)) + body)
    from rolloutd.sandbox.toolserver.wire import recv_frame

    resp = recv_frame(s)
    assert resp and "bad frame" in resp["error"]
    s.close()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(h.tool_socket)
    s.sendall(struct.pack("!I", 2**31))  # absurd length
    resp = recv_frame(s)
    assert resp and "exceeds" in resp["error"]
    s.close()
    assert c.ping().output == "pong"


def test_ping_works_while_bash_is_busy(tool_env):
    import threading

    _, h, c = tool_env
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", c.call("bash", {"command": "sleep 3; echo done", "timeout": 10})))
    t.start()
    time.sleep(0.3)
    assert c.ping().output == "pong"
    assert "r" not in out  # answered while the shell was still busy
    t.join(15)
    assert out["r"].output == "done\n"


def test_sigpipe_behaves_like_a_terminal(bash):
    # Python ignores SIGPIPE; the shell must not inherit that.
    t0 = time.monotonic()
    r = bash("yes | head -n 2; ls -la /usr/bin | head -n 1 >/dev/null; echo rc=$?", timeout=5)
    assert r.output == "y\ny\nrc=0\n"
    assert "Broken pipe" not in r.output and time.monotonic() - t0 < 3
    sigign = bash("grep SigIgn /proc/self/status").output.split()[1]
    assert not int(sigign, 16) & (1 << (13 - 1))  # SIGPIPE not ignored


def test_scratch_dir_removal_is_harmless(tool_env, bash):
    assert tool_env[1].runtime == "bwrap"  # destructive: only ever inside a real mount namespace
    bash("rm -rf /tmp/.rolloutd /tmp/* 2>/dev/null; true")
    assert bash("echo survived").output == "survived\n"
