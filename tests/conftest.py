"""Shared fixtures: a real ``rolloutd up`` in a private runtime directory.

Every process a test starts is stopped, and the stop is checked: no child survives and no
ipc file is left behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rolloutd.sandbox.procs import children_map, is_running

REPO = Path(__file__).resolve().parent.parent

# Variables that steer the test run itself; every other ROLLOUTD_* is a deployment setting of
# the machine running the tests and must not reach the deployments the tests start.
TEST_CONTROL = ("ROLLOUTD_TEST_", "ROLLOUTD_REQUIRE_")
_SESSION_DIR: Path | None = None
_SHORT_DIRS: list[Path] = []  # every short_tmpdir of this process, removed when the session ends


def short_tmpdir(prefix: str = "rd-") -> Path:
    """A fresh dir under /tmp, removed at the end of the session if its test did not remove it."""
    # ipc paths must fit in sockaddr_un (108 bytes); pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _SHORT_DIRS.append(d)
    return d


def traversable_tmpdir(prefix: str) -> Path:
    """A temp dir a sandbox can enter: sandboxes started by root run as nobody."""
    d = short_tmpdir(prefix)
    os.chmod(d, 0o711)
    return d


def stop_daemons(procs, wait_s: float = 20.0) -> None:
    """SIGTERM daemons a test started itself and wait; one that outlives ``wait_s`` is killed and
    fails the test (a daemon must stop on SIGTERM)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    stuck = []
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            stuck.append(" ".join(map(str, p.args[2:4])))
    assert not stuck, f"did not stop on SIGTERM within {wait_s}s: {stuck}"


def remove_tree(d: Path) -> None:
    """Sandboxes may leave chmod 000 dirs owned by nobody behind; root's rm -rf takes them."""
    shutil.rmtree(d, ignore_errors=True)
    if d.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def pytest_configure(config):
    """No test depends on the machine's ROLLOUTD_* settings or on global default paths: the
    session gets its own runtime dir, sandbox root and caches (each test then its own runtime
    dir and sandbox root, see ``isolated_layout``)."""
    global _SESSION_DIR
    for k in [k for k in os.environ if k.startswith("ROLLOUTD_") and not k.startswith(TEST_CONTROL)]:
        del os.environ[k]
    _SESSION_DIR = traversable_tmpdir("rd-session-")
    os.environ["ROLLOUTD_RUNTIME_DIR"] = str(_SESSION_DIR / "run")
    os.environ["ROLLOUTD_SANDBOX_ROOT"] = str(_SESSION_DIR / "sb")
    os.environ["ROLLOUTD_CACHE_DIR"] = str(_SESSION_DIR / "cache")
    os.environ["ROLLOUTD_SWE_CACHE"] = str(_SESSION_DIR / "swe_tasks")


# `make test` runs the suite (tests/vllm apart: Makefile) on two pytest-xdist workers. A work unit
# is a test module, or a whole directory whose session fixtures are expensive (a Slurm cluster and
# a shared `rolloutd up`, a chromium, one real vLLM): never two of those. Units go out in collection
# order, these directories and the slowest modules first (the last unit to start decides when the
# run ends).
WHOLE_DIRS = ("vllm", "ops", "viewer")
FIRST = ("tests/ops", "tests/viewer", "tests/install/test_packaging.py", "tests/harness/test_presets.py",
         "tests/trainer/test_trainer_grpo_example.py", "tests/harness/test_presets_compaction.py")


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: ``tests/<dir>`` for WHOLE_DIRS, else its module's path."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 and parts[1] in WHOLE_DIRS else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with :func:`work_unit` as its scope (xdist's own xdist_group marker
    does not group under pytest 9.2: it rewrites ``item._nodeid``, which no longer is the id)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker; a plain or shuffled run keeps its order
        rank = {unit: i for i, unit in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable within a unit


def pytest_unconfigure(config):
    if os.environ.get("ROLLOUTD_TEST_KEEP"):
        return
    for d in [*_SHORT_DIRS, *([_SESSION_DIR] if _SESSION_DIR is not None else [])]:
        if d.exists():
            remove_tree(d)


@pytest.fixture(autouse=True)
def isolated_layout(monkeypatch):
    """Each test's own runtime directory and sandbox root (never nested, never global)."""
    base = traversable_tmpdir("rd-t-")
    monkeypatch.setenv("ROLLOUTD_RUNTIME_DIR", str(base / "run"))
    monkeypatch.setenv("ROLLOUTD_SANDBOX_ROOT", str(base / "sb"))
    yield base
    remove_tree(base)


def destroy_sandboxes(root: Path) -> None:
    """Destroy every bwrap sandbox left under ``root`` (a test that failed midway, its deployment
    stopped): no process or mount of it may outlive the test."""
    from rolloutd.sandbox import get_runtime

    rt = get_runtime("bwrap", root_dir=str(root))
    for h in rt.list():
        try:
            rt.destroy(h)
        except Exception as e:  # noqa: BLE001 - best effort, said
            print(f"could not destroy sandbox {h.sandbox_id}: {e!r}")


@pytest.fixture(scope="module")
def sandbox_root():
    """A private sandbox root for the module's deployments, a sandbox left in it destroyed and the
    tree removed afterwards (no janitor of another deployment on this machine sees these)."""
    d = traversable_tmpdir("rd-sb-")
    yield str(d)
    destroy_sandboxes(d)
    remove_tree(d)


def require_tool(tool: str, package: str) -> str:
    """The path of a system tool a test needs: skip with the reason where it is missing, fail
    instead under ROLLOUTD_TEST_STRICT=1 (CI installs every such package)."""
    path = shutil.which(tool)
    if path is None:
        msg = f"`{tool}` is not installed (Debian package {package}; .ci/run installs it)"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    return path


def require_bwrap() -> None:
    """For tests that need a real sandbox: skip with the reason where bubblewrap does not work,
    but fail when the run demands it (CI sets ROLLOUTD_REQUIRE_BWRAP=1). Never a fallback to the
    local runtime: it has no mount namespace, so a test's rm -rf /tmp/* would hit the host."""
    from rolloutd.sandbox import bwrap_works

    ok, detail = bwrap_works()
    if ok:
        return
    if os.environ.get("ROLLOUTD_REQUIRE_BWRAP") == "1":
        pytest.fail(f"ROLLOUTD_REQUIRE_BWRAP=1 but bubblewrap does not work here: {detail}", pytrace=False)
    pytest.skip(f"bubblewrap does not work here: {detail}")


@pytest.fixture(scope="session")
def bwrap_required():
    require_bwrap()


def wait_for(pred, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.05):
    """Poll ``pred`` until it returns something true (returned); fail the test naming ``what``
    and the last value after ``timeout_s``. Tests wait on observable state, never on a sleep."""
    end = time.monotonic() + timeout_s
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment holds ROLLOUTD_TEST_DEMO_TAG=tag: what a child started with that
    tag (and everything it started) left running; other runs on the machine carry other tags."""
    needle = f"ROLLOUTD_TEST_DEMO_TAG={tag}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "environ").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def children_of(pid: int) -> list[int]:
    return children_map().get(pid, [])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    return is_running(pid)


class Up:
    """A running ``rolloutd up``."""

    def __init__(self, runtime_dir: Path, sets: list[str], log: Path):
        self.runtime_dir = runtime_dir
        self.log_path = log
        cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(runtime_dir)]
        for s in sets:
            cmd += ["--set", s]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.gateway = f"ipc://{runtime_dir}/gateway.sock"
        self.events = f"ipc://{runtime_dir}/events_out.sock"
        self.children: list[int] = []

    def wait_ready(self, timeout_s: float = 90.0):  # a bound, not a speed target: loaded CI boxes start slowly
        from rolloutd.daemons.supervisor import wait_ready

        st = wait_ready(self.gateway, timeout_s)
        self.children = children_of(self.proc.pid)
        return st

    def client(self, **kw):
        from rolloutd.gateway.client import RolloutClient

        return RolloutClient(self.gateway, **kw)

    def daemon_pid(self, name: str) -> int:
        for pid in children_of(self.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"rolloutd.daemons.cli" in cmd and name.encode() in cmd:
                return pid
        raise LookupError(name)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, event: str) -> list[dict]:
        """The structured log lines of this deployment with this event name."""
        out = []
        for line in self.log().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == event:
                out.append(rec)
        return out

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            # Daemons restarted since wait_ready have new pids: check those too.
            self.children = sorted(set(self.children) | set(children_of(self.proc.pid)))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                left = {pid: _cmdline(pid) for pid in self.children if alive(pid)}
                self.proc.kill()
                self.proc.wait(5)
                for pid in self.children:
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"rolloutd up did not stop in {timeout_s}s; still running: {left}; "
                                     f"log tail:\n{self.log()[-3000:]}")
        return self.proc.returncode


@pytest.fixture
def up_factory():
    yield from _up_factory()


@pytest.fixture(scope="module")
def module_up_factory():
    yield from _up_factory()


@pytest.fixture(scope="module")
def shared_up(module_up_factory):
    """One ``rolloutd up`` for a whole module, for tests that do not disturb it."""
    return module_up_factory()


def _up_factory():
    made: list[Up] = []
    dirs: list[Path] = []

    def make(*sets: str, ready: bool = True) -> Up:
        rd = short_tmpdir()
        dirs.append(rd)
        u = Up(rd / "run", list(sets), rd / "up.log")
        made.append(u)
        if ready:
            u.wait_ready()
        return u

    yield make
    for u in made:
        try:
            u.stop()
        finally:
            leftover = [p for p in u.children if alive(p)]
            for p in leftover:
                os.kill(p, signal.SIGKILL)
            assert not leftover, f"daemons outlived rolloutd up: {leftover}\n{u.log()[-3000:]}"
    for d in dirs:
        remove_tree(d)


@pytest.fixture
def up(up_factory):
    return up_factory()


class RawGateway:
    """A DEALER speaking the REQ envelope to a gateway, sending whatever frames a test likes."""

    def __init__(self, address):
        from rolloutd.bus.sockets import Sockets

        self.sockets = Sockets(asyncio=False, linger_ms=0)
        self.sock = self.sockets.connect("DEALER", address)

    def ask(self, frames, timeout_s=10.0) -> dict:
        from rolloutd.bus import codec

        self.sock.send_multipart([b""] + frames)
        assert self.sock.poll(int(timeout_s * 1000)), "no reply: every request must get one"
        reply = self.sock.recv_multipart()
        assert reply[0] == b""
        return codec.decode(reply[1:])

    def ask_body(self, body: dict, timeout_s=10.0) -> dict:
        """``body`` with protocol version 1 and req_id 1, encoded as the client does."""
        from rolloutd.bus import codec

        return self.ask(codec.encode(dict({"v": 1, "req_id": 1}, **body)), timeout_s)

    def close(self):
        self.sockets.close()


@pytest.fixture
def raw(shared_up):
    r = RawGateway(shared_up.gateway)
    yield r
    r.close()


def synthetic(i: int, **instance) -> dict:
    return {"handler": "synthetic", "instance_id": f"i{i}", "instance": dict({"seed": i}, **instance)}


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tiny model's tokenizer and chat template as a directory (no weights)."""
    from rolloutd.backends.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_tok"), tokenizer_only=True)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny random Qwen2 model (torch; weights and tokenizer), built once per session."""
    pytest.importorskip("torch", reason="torch is not installed (pip install rolloutd[torch])")
    from rolloutd.backends.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0))


@pytest.fixture(scope="module")
def hf_server(tiny_model_dir):
    """serve-hf on the tiny model (4 in a batch, one thread), one per test module."""
    from rolloutd.backends.serve_hf import HFServer

    srv = HFServer(tiny_model_dir, max_batch_size=4, served_model_name="tiny", threads=1)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def scripted():
    """Factory: scripted(tokenizer, policy, **kw) -> started ScriptedBackend (stopped at teardown)."""
    from rolloutd.backends.scripted import ScriptedBackend

    started: list[ScriptedBackend] = []

    def make(tokenizer, policy="echo", **kw) -> ScriptedBackend:
        be = ScriptedBackend(tokenizer, policy, **kw)
        be.start()
        started.append(be)
        return be

    yield make
    for be in started:
        be.stop()


@pytest.fixture
def backends(tokenizer, scripted):
    """Factory: backends(latency=0.01, port=0) -> a started scripted backend answering "ok"."""
    return lambda latency=0.01, port=0: scripted(tokenizer, "constant:text=ok", latency=latency, port=port)


@contextlib.contextmanager
def handler_entry_point(source: Path, name: str, cls: str):
    """Register the handler class ``cls`` of the file ``source`` as ``name`` through a throwaway
    entry-point dist on PYTHONPATH (the daemons a test starts inherit it, so they load it too);
    yields the dist's directory and undoes everything afterwards."""
    from rolloutd.handlers import registry

    module = f"rd_{name}_handler"
    d = Path(tempfile.mkdtemp(prefix=f"rd-{name}-"))
    shutil.copy(source, d / f"{module}.py")
    info = d / f"rd_{name}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rd-{name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[rolloutd.handlers]\n{name} = {module}:{cls}\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(d) + (os.pathsep + old if old else "")
    sys.path.insert(0, str(d))
    registry._entry_points.cache_clear()
    try:
        yield str(d)
    finally:
        sys.path.remove(str(d))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        registry._entry_points.cache_clear()
        shutil.rmtree(d, ignore_errors=True)
