"""Shared fixtures: a real ``rolloutd up`` in a private runtime directory.

Every process a test starts is stopped, and the stop is checked: no child survives and no
ipc file is left behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rolloutd.sandbox.procs import children_map, is_running

REPO = Path(__file__).resolve().parent.parent


def short_tmpdir(prefix: str = "rd-") -> Path:
    # ipc paths must fit in sockaddr_un (108 bytes); pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def children_of(pid: int) -> list[int]:
    return children_map().get(pid, [])


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

    def wait_ready(self, timeout_s: float = 30.0):
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

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                for pid in self.children:
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
                raise AssertionError("rolloutd up did not stop in time")
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
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def up(up_factory):
    return up_factory()


def synthetic(i: int, **instance) -> dict:
    return {"handler": "synthetic", "instance_id": f"i{i}", "instance": dict({"seed": i}, **instance)}


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tiny model's tokenizer and chat template as a directory (no weights)."""
    from rolloutd.llm.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_tok"), tokenizer_only=True)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tokenizer():
    from rolloutd.llm.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def backends(tokenizer):
    from rolloutd.llm.scripted import ScriptedBackend

    made = []

    def make(latency=0.01, port=0):
        b = ScriptedBackend(tokenizer, policy="constant:text=ok", latency=latency, port=port)
        b.start()
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


