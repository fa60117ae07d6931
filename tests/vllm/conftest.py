"""One real vLLM (CPU build) per test session: ``vllm_server``.

The venv comes from ``make vllm-venv`` (``$ROLLOUTD_TEST_VLLM_VENV``, which ``make test`` sets;
otherwise ``/var/tmp/rolloutd-vllm-venv-$UID`` when its ready marker names the current pin).
Without one the tests here skip, and fail under ``ROLLOUTD_TEST_STRICT=1`` (CI builds it).

The server serves the tiny model's ``vllm`` variant (head_dim 64; same tokenizer and template as
every other tiny-model test) with ``--enable-scale-out`` (the ``/v1/*/render`` routes), and is
stopped at the end of the session: its whole process group, checked. It runs on
``cpus_beside_daemons()`` (all CPUs but the first): unpinned, its engine kept the daemons under
test off the CPU for seconds (docs/LLM.md, "A real vLLM"). Its log is
``vllm_server.log_path``; a failing test prints its tail (``pytest_runtest_makereport`` below).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# The flags every test session starts vLLM with (docs/LLM.md, "A real vLLM"): the render routes
# (/v1/chat/completions/render, /v1/messages/render, /v1/responses/render) for the endpoint
# comparisons; backends/vllm_cpu.py adds --dtype float32, --no-enable-chunked-prefill,
# --max-num-batched-tokens MAX_MODEL_LEN and --enforce-eager. Prompt logprobs need no flag
# (--max-logprobs defaults to 20; the tests ask for 0).
SERVER_ARGS = ("--enable-scale-out",)
MAX_MODEL_LEN = 4096
START_BUDGET_S = 900  # a bound, not a speed target: ~80 s to ready here (eager), longer when loaded


@dataclass
class VLLMInfo:
    """What the ``vllm_server`` fixture yields."""

    url: str  # http://127.0.0.1:PORT
    model_dir: str  # the served model (also its tokenizer); vLLM's model name is this path
    model: str  # the name to put in requests' "model"
    version: str  # vLLM's /version
    api_key: str | None
    max_model_len: int
    log_path: Path
    server: object  # the rolloutd.backends.vllm_cpu.VLLMServer (post/get helpers, log_tail)

    def log_tail(self, chars: int = 6000) -> str:
        return self.server.log_tail(chars)


def vllm_venv() -> Path | None:
    """The vLLM venv the tests may use, or None (the reason is in ``_missing``)."""
    from rolloutd.backends.vllm_cpu import default_venv, venv_ready

    given = os.environ.get("ROLLOUTD_TEST_VLLM_VENV")
    path = Path(given) if given else default_venv()
    return path if venv_ready(path) else None


def _missing() -> str:
    from rolloutd.backends.vllm_cpu import VLLM_PIN, default_venv

    where = os.environ.get("ROLLOUTD_TEST_VLLM_VENV") or str(default_venv())
    return f"no ready vLLM venv ({VLLM_PIN}) at {where}: run `make vllm-venv` (make test does)"


def require_vllm() -> Path:
    venv = vllm_venv()
    if venv is None:
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + _missing(), pytrace=False)
        pytest.skip(_missing())
    return venv


@pytest.fixture(scope="session")
def vllm_model_dir():
    """The tiny model's vllm variant (built offline in seconds)."""
    from rolloutd.backends.tiny_model import make_tiny_model

    d = Path(tempfile.mkdtemp(prefix="rd-vllm-model-"))
    make_tiny_model(d / "tiny-vllm", seed=0, variant="vllm")
    yield str(d / "tiny-vllm")
    shutil.rmtree(d, ignore_errors=True)


_SERVER = None


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    """One real vLLM server for the whole session (module doc)."""
    global _SERVER
    from rolloutd.backends.vllm_cpu import VLLMServer, cpus_beside_daemons

    venv = require_vllm()
    log_dir = Path(tempfile.mkdtemp(prefix="rd-vllm-log-"))
    srv = VLLMServer(venv, vllm_model_dir, max_model_len=MAX_MODEL_LEN, args=SERVER_ARGS,
                     log_path=log_dir / "vllm.log", cpus=cpus_beside_daemons())
    srv.start()
    _SERVER = srv
    try:
        srv.wait_ready(START_BUDGET_S)
        yield VLLMInfo(url=srv.url, model_dir=vllm_model_dir, model=srv.model, version=srv.version,
                       api_key=srv.api_key, max_model_len=MAX_MODEL_LEN, log_path=srv.log_path, server=srv)
    finally:
        _SERVER = None
        srv.stop()  # raises if any process of its group outlived SIGKILL
        if not os.environ.get("ROLLOUTD_TEST_KEEP"):
            shutil.rmtree(log_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The first test to use the server waits for its start: give the tests here that budget."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(START_BUDGET_S + 300))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test here shows the end of vLLM's log next to its own output."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _SERVER is not None and Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
        rep.sections.append(("vLLM server log (tail)", _SERVER.log_tail()))
