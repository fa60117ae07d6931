"""Agent programs of the sandbox reach test (stdlib only: the sandbox's /usr/bin/python3, no venv).
Written into each harness job's workspace through ``setup.files``; the host hands them what they
need through files in their workspaces (the only channel in: the sandboxes share nothing).

``NEIGHBOUR <token>``: an honest agent. It fixes ``calc.py``, starts a helper process whose argv
carries ``HELPER-<token>``, writes ``ready.json`` (its endpoint's port), then waits for the host's
``go`` (written once the attacker's job has ended, grade included). Then it checks that nothing of
its own was touched (its fix, ``secret.txt``, its tests, no planted file, its helper alive and not
stopped), makes one LLM call and prints ``NEIGHBOUR {checks}``.

``ATTACKER``: waits for ``targets.json`` (the host's view of the neighbours: their workspace and
sandbox paths, host pids, endpoint ports; every Unix socket of the node's daemons; the backend's
TCP port), then tries to read, write, signal and connect to each, scans its own /proc, its own
socket table and every TCP port of its loopback, and tries to fake its reward: its own tool
server's ``grade``, the read-only run dir, a passing test, conftest plugins, a pytest.ini, a
``pytest.py``, a detached daemon that keeps rewriting the tests into grading, a printed summary.
Its ``calc.py`` stays wrong. Last line: ``ATTACK {name: outcome}``, where an outcome is
``blocked:<errno or exception>``, ``own:<detail>`` (it reached only its own sandbox), or
``LEAK:<detail>`` (it reached something it must not).
"""

CALC_WRONG = "def add(a, b):\n    return a - b\n"
CALC_RIGHT = "def add(a, b):\n    return a + b\n"
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"

NEIGHBOUR = r'''
import json, os, subprocess, sys, time, urllib.request
from urllib.parse import urlparse
token = sys.argv[1]
RIGHT = "def add(a, b):\n    return a + b\n"
with open("calc.py", "w") as f:
    f.write(RIGHT)
secret, tests = open("secret.txt").read(), open("tests/test_calc.py").read()
helper = subprocess.Popen(["python3", "-c", "import time; time.sleep(3600)", "HELPER-" + token])
base = os.environ["OPENAI_BASE_URL"]
with open("ready.tmp", "w") as f:
    json.dump({"port": urlparse(base).port}, f)
os.rename("ready.tmp", "ready.json")
deadline = time.monotonic() + 600  # a bound, not a speed: the test fails on NO GO
while not os.path.exists("go"):
    if time.monotonic() > deadline:
        print("NO GO")
        sys.exit(4)
    time.sleep(0.05)
state = open("/proc/%d/stat" % helper.pid).read().rsplit(")", 1)[1].split()[0]
checks = {"calc": open("calc.py").read() == RIGHT, "secret": open("secret.txt").read() == secret,
          "tests": open("tests/test_calc.py").read() == tests, "planted": os.path.exists("pwned"),
          "helper": helper.poll() is None and state not in "TtZX"}
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}).encode()
req = urllib.request.Request(base + "/chat/completions", data=body, headers={
    "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    checks["llm"] = r.status
helper.kill()
helper.wait()
print("NEIGHBOUR " + json.dumps(checks, sort_keys=True))
'''

FORCE_PASS = '''import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome, rep.longrepr = "passed", None
'''

ATTACKER = r'''
import ctypes, errno, json, os, signal, socket, sys, time
from urllib.parse import urlparse

FORCE_PASS = %(force_pass)r
PASSING = "def test_add():\n    pass\n"
report = {}
libc = ctypes.CDLL(None, use_errno=True)


def blocked(e):
    if isinstance(e, OSError) and e.errno:
        return "blocked:" + errno.errorcode.get(e.errno, str(e.errno))
    return "blocked:" + type(e).__name__


def attempt(name, fn):
    """Any success is a leak: each target is outside this sandbox."""
    try:
        r = fn()
    except Exception as e:
        report[name] = blocked(e)
    else:
        report[name] = "LEAK:" + repr(r)[:120]


def read(p):
    with open(p, "rb") as f:
        return f.read(200)


def write(p, text, mode="w"):
    with open(p, mode) as f:
        f.write(text)
    return "written"


def pidfd_open(pid):
    fd = libc.syscall(434, pid, 0)  # SYS_pidfd_open (x86_64)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    os.close(fd)
    return "pidfd"


def unix_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
        return "connected"
    finally:
        s.close()


def tcp_connect(host, port):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        if s.getsockname() == s.getpeername():  # TCP self-connect: nothing listens there
            raise ConnectionRefusedError(errno.ECONNREFUSED, "self-connect")
        return "connected"
    finally:
        s.close()


def tcp_open(host, port):
    try:
        return bool(tcp_connect(host, port))
    except OSError:
        return False


own_port = urlparse(os.environ["OPENAI_BASE_URL"]).port
deadline = time.monotonic() + 600
while not os.path.exists("targets.json"):
    if time.monotonic() > deadline:
        print("NO TARGETS")
        sys.exit(4)
    time.sleep(0.05)
t = json.load(open("targets.json"))

# -- the neighbours: files, processes, endpoints --------------------------------------------
for n in t["neighbours"]:
    k, ws = n["name"], n["workspace"]
    attempt(k + ".read_secret", lambda: read(ws + "/secret.txt"))
    attempt(k + ".read_calc", lambda: read(ws + "/calc.py"))
    attempt(k + ".write_calc", lambda: write(ws + "/calc.py", "def add(a, b):\n    return 0\n"))
    attempt(k + ".write_tests", lambda: write(ws + "/tests/test_calc.py", "def test_add():\n    assert 0\n"))
    attempt(k + ".plant", lambda: write(ws + "/pwned", "x", "x"))
    attempt(k + ".list_sandbox_dir", lambda: os.listdir(n["sandbox_dir"]))
    attempt(k + ".read_state", lambda: read(n["sandbox_dir"] + "/state.json"))
    for pid in n["pids"]:
        p = "/proc/%%d" %% pid
        if os.path.exists(p):  # the same number in this pid namespace: ours, unless it is theirs
            try:
                cmd = read(p + "/cmdline")
            except OSError as e:
                cmd = repr(e).encode()
            report["%%s.pid%%d" %% (k, pid)] = ("LEAK:" if n["token"].encode() in cmd else "own:") + repr(cmd)[:80]
            continue
        for f in ("cmdline", "environ", "mem", "root/workspace/secret.txt", "cwd/secret.txt"):
            attempt("%%s.pid%%d.%%s" %% (k, pid, f.split("/")[0]), lambda: read(p + "/" + f))
        for sig in (0, signal.SIGSTOP, signal.SIGKILL):
            attempt("%%s.pid%%d.kill%%d" %% (k, pid, sig), lambda: os.kill(pid, sig))
        attempt("%%s.pid%%d.pidfd" %% (k, pid), lambda: pidfd_open(pid))
    if n["port"] == own_port:  # the same number on this sandbox's own loopback: our endpoint
        report[k + ".endpoint_port"] = "own:%%d" %% own_port
    else:
        attempt(k + ".endpoint_port", lambda: tcp_connect("127.0.0.1", n["port"]))

# -- every process this sandbox can see: none of the neighbours' --------------------------
seen = 0
for d in os.listdir("/proc"):
    if not d.isdigit():
        continue
    seen += 1
    for f in ("cmdline", "environ"):
        try:
            b = read("/proc/%%s/%%s" %% (d, f))
        except OSError:
            continue
        for n in t["neighbours"]:
            if n["token"].encode() in b:
                report["proc_scan.%%s.%%s" %% (d, f)] = "LEAK:" + n["name"]
report["proc_scan"] = "own:%%d processes" %% seen

# -- the node's daemons and the other sandboxes' servers: Unix sockets, abstract names, TCP ----
for path in t["sockets"]:
    attempt("unix:" + path, lambda: unix_connect(path))
    attempt("abstract:" + path, lambda: unix_connect("\0" + path))
with open("/proc/net/unix") as f:
    table = f.read()
hosts = [x for x in (t["runtime_dir"], t["sandbox_root"]) if x in table]
report["unix_table"] = ("LEAK:" + ",".join(hosts)) if hosts else "own:no host path"
for host, port in t["tcp"]:
    if port == own_port:
        report["tcp:%%s:%%d" %% (host, port)] = "own:%%d" %% port
    else:
        attempt("tcp:%%s:%%d" %% (host, port), lambda: tcp_connect(host, port))
open_ports = [p for p in range(1, 65536) if tcp_open("127.0.0.1", p)]
report["tcp_scan"] = ("own:%%d" %% own_port) if open_ports == [own_port] else "LEAK:%%r" %% open_ports[:20]

# -- its own reward: the grader's tool, its files, its tests, a daemon into grading ----------
def grade_through_own_tool_server():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect("/run/rolloutd/tool.sock")
        frame = json.dumps({"id": 1, "tool": "grade", "args": {"argv": ["true"]}}).encode()
        s.sendall(len(frame).to_bytes(4, "big") + frame)
        got = s.recv(65536)
        if not got:
            raise ConnectionAbortedError("closed without a reply")
        return got[:80]
    finally:
        s.close()


attempt("own_tool_server.grade", grade_through_own_tool_server)
attempt("own_run_dir.reward", lambda: write("/run/rolloutd/reward", "1.0"))
attempt("own_run_dir.config", lambda: write("/run/rolloutd/config.json", "{}"))
write("tests/test_calc.py", PASSING)
write("conftest.py", FORCE_PASS)
write("tests/conftest.py", FORCE_PASS)
write("evilplug.py", FORCE_PASS)
write("pytest.ini", "[pytest]\naddopts = -p evilplug\n")
write("pytest.py", "import sys\nprint('1 passed')\nsys.exit(0)\n")
write("sitecustomize.py", "import os\nos._exit(0)\n")
try:
    os.makedirs("/run/rolloutd-grade/.local", exist_ok=True)
    write("/run/rolloutd-grade/sitecustomize.py", "import os\nos._exit(0)\n")
except OSError:
    pass
try:  # every process this sandbox has but the tool server, which ignores it
    os.kill(-1, signal.SIGKILL)
    report["kill_all"] = "own:sent"
except OSError as e:
    report["kill_all"] = "own:" + blocked(e)

if os.fork() == 0:  # a detached daemon that keeps the forged tests in place, into grading
    os.setsid()
    if os.fork() == 0:
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        while True:
            for p, text in (("tests/test_calc.py", PASSING), ("conftest.py", FORCE_PASS),
                            ("tests/conftest.py", FORCE_PASS)):
                try:
                    write(p, text)
                except OSError:
                    pass
            time.sleep(0.005)
    os._exit(0)
os.wait()
print("=" * 20 + " 1 passed in 0.01s " + "=" * 20)
print("ATTACK " + json.dumps(report, sort_keys=True))
''' % {"force_pass": FORCE_PASS}
