"""Fixtures of the harness tests: bwrap sandboxes that are destroyed and checked afterwards
(the sandbox tests' Tracker), and the agent virtual environment built from PyPI."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import require_bwrap as need_bwrap
from tests.sandbox.conftest import Tracker, _make


@pytest.fixture
def sandboxes():
    """A bwrap runtime under a short root; every sandbox made through it is destroyed and
    checked for leftovers at the end."""
    need_bwrap()
    d = Path(tempfile.mkdtemp(prefix="rlh", dir="/tmp"))
    os.chmod(d, 0o755)
    t = Tracker(_make("bwrap", d))
    try:
        yield t
    finally:
        try:
            t.cleanup()
        finally:
            shutil.rmtree(d, ignore_errors=True)


# -- the live tests: agent venv, tokenizer, swe tasks, oracle backend, one `rolloutd up` --------
def _default_venv() -> str:
    # Not under /root or a private home: bwrap started by root runs the sandbox as nobody, which
    # must be able to traverse to the venv (mounted read-only at the same path).
    # ROLLOUTD_TEST_*: the one prefix tests/conftest.py leaves in the environment.
    return os.environ.get("ROLLOUTD_TEST_AGENT_VENV") or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}"


@pytest.fixture(scope="session")
def agent_venv():
    """mini-swe-agent and openai from PyPI in a venv of the system python (pip's cache makes a
    rebuild fast; the venv itself is reused while its package list matches)."""
    from rolloutd.handlers.harness_presets import build_agent_venv, venv_ready

    path = _default_venv()
    # Without npm (no Node on this machine) the venv holds the PyPI agents only, and the npm
    # presets' tests say so; CI (strict) installs them all.
    npm = None if shutil.which("npm") or os.environ.get("ROLLOUTD_TEST_STRICT") == "1" else ()
    if not venv_ready(path, npm=npm):
        try:
            build_agent_venv(path, npm=npm)
        except Exception as e:  # noqa: BLE001 - no index / no system python: a skip, said why
            msg = f"cannot build the agent venv at {path} (mini-swe-agent, openai, aider, the npm harnesses): {e}"
            if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":  # CI: the agents must really run
                pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
            pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from rolloutd.backends.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tok"), tokenizer_only=True))


SWE_TASKS_USED = 2  # the first two of the sorted task list: the oracle gets the second wrong


@pytest.fixture(scope="session")
def swe_built():
    from rolloutd.handlers.swe_tasks import DownloadError, build_all, task_ids

    try:
        return build_all(task_ids=sorted(task_ids())[:SWE_TASKS_USED])
    except DownloadError as e:
        pytest.skip(f"swe task sdists are not cached and the package index cannot be reached: {e}")


@pytest.fixture(scope="module")
def oracle_backend(tok_dir):
    """Both presets' oracle on an in-process scripted vLLM-API backend: odd keys wrong."""
    from rolloutd.handlers.harness_presets import HarnessOracle
    from rolloutd.backends.scripted import ScriptedBackend

    pol = HarnessOracle(wrong_every=2)
    pol.warm()
    b = ScriptedBackend(tok_dir, policy=pol)
    b.start()
    yield b
    b.stop()


def long_prompt_backend(tok_dir: str, policy):
    """A scripted backend for the coding harnesses, whose system prompts and tool lists run to
    ~40K tokens of the tiny vocabulary (far beyond the default 32K window): ``yield from`` it in a
    fixture; stopped at teardown."""
    from rolloutd.backends.scripted import ScriptedBackend

    b = ScriptedBackend(tok_dir, policy=policy, max_model_len=1 << 20)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def recorded_rows(record_dir: str, r: dict) -> list[dict]:
    """The requests ``record_requests`` wrote for the run that made result ``r``: a job re-dispatched
    under load ran (and recorded) more than once, its earlier runs under earlier attempts."""
    import json

    rows = [json.loads(line) for line in Path(record_dir, f"{r['job_id']}.jsonl").read_text().splitlines()]
    return [x for x in rows if x["attempt"] == r["attempts"]]


def harness_sets(tok_dir: str, sandbox_root: str, venv: str, **extra) -> list[str]:
    import json

    cfg = {"harness": dict({"tokenizer": tok_dir, "agent_venv": venv}, **extra)}
    return ["sandbox.runtime=bwrap", f"sandbox.root_dir={sandbox_root}", "handlers=" + json.dumps(cfg)]


def harness_deployment(factory, tok_dir: str, sandbox_root: str, venv: str, backend_url: str, **extra):
    """A ``rolloutd up`` (from ``factory``) running the harness domain in bwrap, one backend registered."""
    need_bwrap()
    up = factory(*harness_sets(tok_dir, sandbox_root, venv, **extra))
    with up.client() as c:
        c.add_backend(backend_url)
    return up


@pytest.fixture(scope="module")
def harness_up(module_up_factory, tok_dir, sandbox_root, agent_venv, oracle_backend):
    return harness_deployment(module_up_factory, tok_dir, sandbox_root, agent_venv, oracle_backend.url)
