"""Issue 24: what an agent inside a real bwrap sandbox can and cannot do to the tool server and
to graders. Every attack runs inside the sandbox as the agent's own command would (the bash
tool), with ctypes for the raw syscalls; docs/SANDBOX.md "Threat model" cites these tests.

The forger (tests/sandbox/forger.py) is a detached daemon that reads the shell's memory and
forges calls: the control assertions show that it does own later bash calls (a documented
residual: the agent fooling itself), while every grade call and every domain's grader run
after it is dead."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec
from tests.conftest import wait_for

FORGER = (Path(__file__).parent / "forger.py").read_text()

# Each probe prints one JSON line: attack -> "ok" (it worked) or the errno name that stopped it.
PROBE = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
out = {}
def err():
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def attempt(name, fn):
    try:
        fn(); out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
attempt("mem_write", lambda: open("/proc/1/mem", "r+b", 0).close())
attempt("mem_read", lambda: open("/proc/1/mem", "rb", 0).close())
attempt("maps", lambda: open("/proc/1/maps").read())
attempt("environ", lambda: open("/proc/1/environ", "rb").read())
attempt("fd_list", lambda: os.listdir("/proc/1/fd"))
def fd_open():
    for n in range(0, 64):
        try:
            os.close(os.open("/proc/1/fd/%d" % n, os.O_RDWR))
            return
        except FileNotFoundError:
            continue
    raise OSError(errno.ENOENT, "no fd")
attempt("fd_open", fd_open)
# PTRACE_SEIZE does not stop the tracee; exiting detaches it.
r = libc.ptrace(0x4206, 1, 0, 0)
out["ptrace_seize"] = "ok" if r == 0 else err()
r = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH
out["ptrace_attach"] = "ok" if r == 0 else err()
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(buf), 8), iovec(0x400000, 8)
r = libc.syscall(310, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # process_vm_readv
out["process_vm_readv"] = "ok" if r >= 0 else err()
r = libc.syscall(311, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # process_vm_writev
out["process_vm_writev"] = "ok" if r >= 0 else err()
pidfd = libc.syscall(434, 1, 0)  # pidfd_open
out["pidfd_open"] = "ok" if pidfd >= 0 else err()
got = []
if pidfd >= 0:
    for n in range(0, 64):
        fd = libc.syscall(438, pidfd, n, 0)  # pidfd_getfd
        if fd >= 0:
            got.append(n)
            os.close(fd)
        elif ctypes.get_errno() != errno.EBADF:
            out["pidfd_getfd"] = err()
            break
    if got:
        out["pidfd_getfd"] = "ok"
print(json.dumps(out))
'''


@pytest.fixture
def sandbox(bwrap_rt):
    h = bwrap_rt.create("threat", SandboxSpec(workspace_files={"forger.py": FORGER, "probe.py": PROBE}))
    return h, bwrap_rt.client(h, timeout=20)


def _bash(c, command, timeout=20, **kw):
    return c.call("bash", dict(command=command, timeout=timeout, **kw))


def _alive_tool_server(c):
    assert c.ping().info["pid"] == 1
    r = _bash(c, "echo alive")
    assert r.output == "alive\n" and r.exit_code == 0, r


def _start_forger(c):
    r = _bash(c, "python3 forger.py /tmp/forger.ready; while [ ! -e /tmp/forger.ready ]; do sleep 0.02; done")
    assert r.error is None, r


# -- the tool server: memory, ptrace, descriptors, signals ---------------------------------------
def test_tool_server_memory_ptrace_and_descriptors_are_out_of_reach(sandbox):
    h, c = sandbox
    r = _bash(c, "python3 probe.py")
    got = json.loads(r.output.strip().splitlines()[-1])
    # Before issue 24 every one of these was "ok" (the tool server was dumpable, same uid, no Yama).
    assert got["mem_write"] in ("EACCES", "EPERM") and got["mem_read"] in ("EACCES", "EPERM"), got
    assert got["maps"] in ("EACCES", "EPERM") and got["environ"] in ("EACCES", "EPERM"), got
    assert got["fd_list"] in ("EACCES", "EPERM") and got["fd_open"] in ("EACCES", "EPERM"), got
    assert got["ptrace_seize"] == "EPERM" and got["ptrace_attach"] == "EPERM", got
    assert got["process_vm_readv"] == "EPERM" and got["process_vm_writev"] == "EPERM", got
    assert got.get("pidfd_getfd") == "EPERM", got  # pidfd_open itself is allowed; taking an fd is not
    assert c.ping().info["hardened"] is True
    _alive_tool_server(c)


def test_tool_server_ignores_every_signal_from_inside(sandbox):
    h, c = sandbox
    # From a detached process too (a setsid daemon), every catchable and uncatchable signal.
    r = _bash(c, "setsid -w sh -c 'for s in $(seq 1 31) 34 64; do kill -s $s 1 2>/dev/null; done; "
                 "kill -STOP 1; kill -KILL 1; echo sent' </dev/null 2>&1")
    assert "sent" in r.output, r
    r = _bash(c, "sleep 0.2; awk '{print $3}' /proc/1/stat")
    assert r.output.strip() in ("S", "R"), r  # not T (stopped)
    _alive_tool_server(c)


def test_tool_server_limits_and_nice_value_are_out_of_reach(sandbox):
    # prlimit64/setpriority check only uids, not ptrace access: before, `prlimit --pid 1` gave the
    # tool server RLIMIT_NOFILE 4 (no new connection, no grader pipes) or a CPU hard limit (SIGKILL).
    h, c = sandbox
    r = _bash(c, "prlimit --pid 1 --nofile=4:4 && echo =LOW=; prlimit --pid 1 --cpu=1:1 && echo =CPU=; "
                 "renice -n 19 -p 1 >/dev/null 2>&1 && echo =NICE=; "
                 "python3 -c 'import resource; resource.prlimit(1, resource.RLIMIT_NPROC, (0, 0))' 2>&1 | tail -1; "
                 "ulimit -n 512 && ulimit -n; nice -n 3 nice")  # the agent's own limits and nice value: allowed
    assert "=LOW=" not in r.output and "=CPU=" not in r.output and "=NICE=" not in r.output, r
    assert "PermissionError" in r.output and r.output.endswith("512\n3\n"), r
    limits = _bash(c, "cat /proc/1/limits").output
    assert "Max open files            20000" in limits or "Max open files" in limits, limits
    assert [l for l in limits.splitlines() if l.startswith("Max cpu time")][0].split()[3] == "unlimited", limits
    with c.__class__(h.tool_socket, timeout=20) as fresh:  # a new connection still works
        assert fresh.ping().output == "pong"
    _alive_tool_server(c)


def test_the_agent_cannot_unharden_or_reach_through_a_nested_user_namespace(sandbox):
    # A nested user namespace gives the agent every capability *there*, none over pid 1.
    h, c = sandbox
    r = _bash(c, "command -v unshare >/dev/null || { echo NO-UNSHARE; exit 0; }; "
                 "unshare -Ur python3 probe.py")
    if "NO-UNSHARE" in r.output:
        pytest.skip("no unshare binary in the sandbox image")
    if "unshare failed: No space left on device" in r.output:  # bwrap >= 0.8: --disable-userns
        return _alive_tool_server(c)
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["mem_write"] in ("EACCES", "EPERM") and got["ptrace_seize"] == "EPERM", got
    assert got.get("pidfd_getfd") == "EPERM" and got["process_vm_writev"] == "EPERM", got
    _alive_tool_server(c)


# -- graders: fresh process tree, fresh channel ---------------------------------------------------
LEFTOVERS = (
    "setsid sh -c 'sleep 1001 & exec -a innocent sleep 1002' </dev/null >/dev/null 2>&1 & "  # setsid + renamed
    "( ( sleep 1003 </dev/null >/dev/null 2>&1 & ) & ) ; "                                     # double fork
    "nohup sleep 1004 </dev/null >/dev/null 2>&1 & "                                           # nohup
    "sleep 1005 & kill -STOP $! ; "                                                            # stopped
    "python3 -c 'import ctypes,os,time,signal\n"
    "p=os.fork()\n"
    "if p==0: time.sleep(1006)\n"
    "ctypes.CDLL(None).ptrace(0x4206,p,0,0); time.sleep(1007)' </dev/null >/dev/null 2>&1 & "  # tracer + tracee
    "(unshare -Urpf --mount-proc sleep 1008 </dev/null >/dev/null 2>&1 &) ; "                   # nested pid+user ns
    "python3 -c 'import time; time.sleep(1009)' & disown ; "
    "sleep 0.5; echo planted"
)

LIST_PROCS = ("import os\n"
              "me = os.getpid()\n"
              "for p in sorted(int(x) for x in os.listdir('/proc') if x.isdigit()):\n"
              "    s = open('/proc/%d/stat' % p).read()\n"
              "    print(p, s[s.rfind(')') + 2], open('/proc/%d/cmdline' % p).read()[:40].replace(chr(0), ' ').replace(chr(10), ' ').strip())\n")


def test_grade_runs_as_the_only_process_however_the_agent_detached(sandbox):
    h, c = sandbox
    r = _bash(c, LEFTOVERS)
    assert "planted" in r.output, r
    before = _bash(c, "ps -e -o pid=,stat=,args= 2>/dev/null || ls /proc | grep -c '^[0-9]'").output
    assert "sleep 1003" in before or before.strip().isdigit(), before  # 1008: no nested userns on bwrap >= 0.8
    g = c.call("grade", {"argv": ["python3", "-c", LIST_PROCS], "timeout": 20})
    assert g.error is None and g.exit_code == 0, g
    rows = [line.split(None, 2) for line in g.output.strip().splitlines()]
    pids = [int(r[0]) for r in rows]
    assert pids == [1, g.info["pid"]], g.output  # pid 1 (the tool server) and the grader: nothing else
    assert g.info["purged"]["killed"] >= 8, g.info  # 9 with the nested userns (bwrap < 0.8)
    # The sandbox works on afterwards: a fresh shell (no restart note is owed: the agent's shell died
    # because grading started, which every caller of grade knows).
    r = _bash(c, "echo after; jobs | wc -l")
    assert r.output == "after\n0\n", r


# The controls wait (15 s at most) for the forger to have acted instead of sleeping a guessed
# time: a bash call until its status file (fd 253, empty while the command runs) holds the
# forger's 0; an agent process until the forger holds its stdout (forger.py's marker file).
FORGED_CALL = ("timeout 15 sh -c 'until [ -s /dev/fd/253 ]; do sleep 0.01; done'; "
               "python3 -c 'raise SystemExit(1)'; echo REAL-FAIL")
HELD_AGENT = "timeout 15 sh -c \"until [ -e /tmp/forger.held.$$ ]; do sleep 0.01; done\"; echo 0; exit 3"


def test_grade_output_is_the_graders_own_though_a_forger_owns_the_shell(sandbox):
    h, c = sandbox
    _start_forger(c)
    # Control: the forger really does own later bash calls, across a restart and a new connection
    # (the residual documented in SANDBOX.md: the agent can fool itself, not a grader).
    r = _bash(c, FORGED_CALL)
    assert "FORGED" in r.output and r.exit_code == 0, r
    from rolloutd.sandbox import ToolClient

    with ToolClient(h.tool_socket, timeout=20) as fresh:
        r = fresh.call("bash", {"command": FORGED_CALL, "restart": True, "timeout": 20})
        assert "FORGED" in r.output and r.exit_code == 0, r
        # ...and the old grading path (the agent tool: fresh pipes, but the daemon still alive).
        r = fresh.call("agent", {"argv": ["sh", "-c", HELD_AGENT], "timeout": 20})
        assert r.output.strip().splitlines()[-1] == "1.0", r
        # The grade tool: the daemon is dead before the grader starts; only the grader speaks (the
        # sleep is the window a live forger would have had, not a wait for anything).
        g = fresh.call("grade", {"argv": ["sh", "-c", "sleep 0.3; echo REAL-FAIL; exit 3"], "timeout": 20})
    assert g.output == "REAL-FAIL\n" and g.exit_code == 3 and g.error is None, g
    # The forger is gone for the rest of the episode too: no process of its name is left, and a
    # call with a command running (what it forges) is the shell's own.
    r = _bash(c, "cat /proc/[0-9]*/comm 2>/dev/null | grep -c kworker; sleep 0.3; echo honest")
    assert r.output == "0\nhonest\n", r


def test_a_grader_runs_none_of_the_agents_dotfiles(sandbox):
    # A .pth in the user site of the HOME graders used to get (/tmp) ran inside every Python grader.
    h, c = sandbox
    r = _bash(c, "d=$(python3 -c 'import site; print(site.getusersitepackages())' | sed 's|^/tmp/home|/tmp|'); "
                 "mkdir -p \"$d\" && echo 'import sys; print(\"FORGED\")' > \"$d/x.pth\" && "
                 "printf '[alias]\\n\\tst = !echo FORGED\\n' > /tmp/.gitconfig && echo planted")
    assert "planted" in r.output, r
    g = c.call("grade", {"argv": ["python3", "-c", "import os; print('real', os.environ['HOME'] != '/tmp')"],
                         "env": {"HOME": "/tmp"}, "timeout": 20})
    assert g.output == "real True\n" and g.exit_code == 0, g


PLANT_PYC = r"""
import importlib.util, os
from importlib._bootstrap_external import _code_to_timestamp_pyc
open("m.py", "w").write("print('real')\n")
st = os.stat("m.py")
code = compile("print('FORGED')\n", os.path.abspath("m.py"), "exec")
os.makedirs("__pycache__", exist_ok=True)
with open(importlib.util.cache_from_source("m.py"), "wb") as f:  # a header that matches m.py
    f.write(_code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size))
print("planted")
"""


def test_a_grader_runs_no_bytecode_the_agent_planted(sandbox):
    h, c = sandbox
    (Path(h.workspace) / "plant.py").write_text(PLANT_PYC)
    from rolloutd.handlers.tasks import give_to_sandbox
    give_to_sandbox(h.to_dict(), [Path(h.workspace) / "plant.py"])
    r = _bash(c, "python3 plant.py && python3 -c 'import m'")
    assert r.output == "planted\nFORGED\n", r  # the plant works for the agent's own python
    g = c.call("grade", {"argv": ["python3", "-c", "import m"], "cwd": "/workspace",
                         "env": {"PYTHONDONTWRITEBYTECODE": "1"}, "timeout": 20})
    assert g.output == "real\n", g


def test_no_process_starts_beside_a_running_grader(sandbox):
    """The seal: an agent process that reached the tool socket cannot start anything while a
    grader runs (its request is refused), and its own process dies in the purge."""
    h, c = sandbox
    from rolloutd.sandbox import ToolClient

    done = {}

    def grade():
        with ToolClient(h.tool_socket, timeout=20) as g:
            done["r"] = g.call("grade", {"argv": ["sh", "-c", "touch /workspace/grading; sleep 1.5"], "timeout": 20})

    t = threading.Thread(target=grade)
    t.start()
    try:
        with ToolClient(h.tool_socket, timeout=20) as other:
            wait_for(lambda: (Path(h.workspace) / "grading").exists(), timeout_s=20, what="the grader started")
            refused = [other.call("agent", {"argv": ["true"], "timeout": 5}),
                       other.call("bash", {"command": "true", "timeout": 5})]
    finally:
        t.join(30)
    assert done["r"].exit_code == 0, done
    for r in refused:
        assert r.error and "being graded" in r.error, r
    _alive_tool_server(c)


def test_eval_clients_purge_before_their_first_call(sandbox):
    """JobContext.tools() in eval purges before its first call: a custom handler's eval that uses
    bash meets no process the agent started."""
    import asyncio

    from rolloutd.bus.messages import Job
    from rolloutd.handlers.base import JobContext

    h, c = sandbox
    _start_forger(c)
    ctx = JobContext(Job(job_id=1, attempt=1, handler="custom", instance={}, sandbox=h.to_dict()))
    ctx.phase = "eval"

    async def custom_eval():
        client = ctx.tools()
        try:
            return await client.call("bash", {"command": "sleep 0.3; echo mine", "timeout": 20})
        finally:
            await client.close()

    r = asyncio.run(custom_eval())
    assert r.output == "mine\n", r


INSIDE_CLIENT = r"""
import json, socket, struct
ok = refused = 0
for i in range(300):  # a flood too: each is closed at once, no thread, no call
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("/run/rolloutd/tool.sock")
    except OSError as e:
        print("CONNECT", e.errno); break
    body = json.dumps({"id": 1, "tool": "ping", "args": {}}).encode()
    try:
        s.sendall(struct.pack(">I", len(body)) + body)
        s.settimeout(10)
        data = s.recv(4)
    except OSError:
        data = b""
    if data:
        ok += 1
    else:
        refused += 1
    s.close()
print("answered", ok, "refused", refused)
"""


def test_connections_from_inside_the_sandbox_are_refused(short_root):
    """The tool socket is the host's: a process of the agent that can reach it (here the sandbox
    runs as the socket's owner: run_as=None) gets its connection closed, never a call, even in a
    flood; the host's own calls go on."""
    from tests.sandbox.conftest import Tracker, _make
    from tests.conftest import require_bwrap

    require_bwrap()
    t = Tracker(_make("bwrap", short_root, run_as=None))
    try:
        h = t.create("inside", SandboxSpec(workspace_files={"client.py": INSIDE_CLIENT}))
        c = t.client(h, timeout=30)
        r = _bash(c, "python3 client.py", timeout=60)
        assert r.output.strip() == "answered 0 refused 300", r  # before: answered 300 refused 0
        assert c.ping().info["refused_inside"] >= 300
        _alive_tool_server(c)
    finally:
        t.cleanup()
