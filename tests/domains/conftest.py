"""Fixtures of the task-domain tests: entry points, the tiny tokenizer, bwrap, swe tasks,
the oracle scripted backend and one ``rolloutd up`` configured for the three domains."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest


@pytest.fixture(scope="module", autouse=True)
def domain_entry_points():
    """Register the domain handlers/policies if the installed metadata predates them (the
    daemons inherit PYTHONPATH, so they see the shim too). Module scope: tests outside this
    folder never see it."""
    from rolloutd.handlers import registry
    from rolloutd.handlers.tasks import entry_point_shim, missing_entry_points

    if not missing_entry_points():
        yield None
        return
    d = entry_point_shim(tempfile.mkdtemp(prefix="rd-eps-"))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = d + (os.pathsep + old if old else "")
    sys.path.insert(0, d)
    registry._entry_points.cache_clear()
    yield d
    sys.path.remove(d)
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
    registry._entry_points.cache_clear()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from rolloutd.backends.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tok"), tokenizer_only=True))


@pytest.fixture(scope="session")
def need_bwrap(bwrap_required):
    """Skips (or, under ROLLOUTD_REQUIRE_BWRAP=1, fails) where bubblewrap does not work."""


@pytest.fixture(scope="session")
def swe_built():
    """Only a cold cache with no package index is a reason to skip; any other error (a bug
    patch that no longer applies, say) fails the tests that need the tasks."""
    from rolloutd.handlers.swe_tasks import DownloadError, build_all

    try:
        return build_all()
    except DownloadError as e:
        pytest.skip(f"swe task sdists are not cached and the package index cannot be reached: {e}")


JSONL_ROWS = [{"question": "A train travels 120 km in 2 hours. What is its speed in km/h?", "answer": "60"},
              {"question": "What is 2/3 + 1/6? Give a fraction.", "answer": "\\frac{5}{6}"}]


@pytest.fixture(scope="session")
def jsonl_rows():
    return [dict(r) for r in JSONL_ROWS]


@pytest.fixture(scope="session")
def math_jsonl(tmp_path_factory):
    p = tmp_path_factory.mktemp("jsonl") / "questions.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    return str(p)


@pytest.fixture(scope="module")
def oracle_backend(tok_dir, math_jsonl):
    """The oracle on an in-process scripted vLLM-API backend: odd keys wrong."""
    from rolloutd.handlers.oracles import Oracle
    from rolloutd.backends.scripted import ScriptedBackend

    pol = Oracle(wrong_every=2, jsonl=math_jsonl)
    pol.warm()
    b = ScriptedBackend(tok_dir, policy=pol)
    b.start()
    yield b
    b.stop()


def _domain_sets(tok_dir: str, sandbox_root: str, runtime: str = "bwrap") -> list[str]:
    hcfg = {name: {"tokenizer": tok_dir} for name in ("math", "code", "swe")}
    return [f"sandbox.runtime={runtime}", f"sandbox.root_dir={sandbox_root}", "handlers=" + json.dumps(hcfg)]


@pytest.fixture(scope="module")
def domain_sets(tok_dir, sandbox_root):
    """``--set`` arguments of a ``rolloutd up`` for the domains: ``domain_sets(runtime)``."""
    return lambda runtime="bwrap": _domain_sets(tok_dir, sandbox_root, runtime)


@pytest.fixture(scope="module")
def domains_up(module_up_factory, domain_sets, need_bwrap, oracle_backend):
    up = module_up_factory(*domain_sets("bwrap"))
    with up.client() as c:
        c.add_backend(oracle_backend.url)
    return up
