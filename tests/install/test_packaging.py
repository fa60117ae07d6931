"""rolloutd installs like a real package (issue 15): one import namespace, a wheel that works
when installed for real (not editable), and a client that needs only pyzmq, msgpack and numpy.

The wheel is built once per session with `python -m build` (isolated build, as pip would);
each check installs it into a virtual environment of its own."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import synthetic

REPO = Path(__file__).resolve().parents[2]
OLD = r"(bus|daemons|gateway|handlers|sandbox|llm|endpoint|backends|systemd)"
OLD_IMPORT = re.compile(rf"^\s*(from {OLD}(\.| import)|import {OLD}\b)|(^|[\s\x22'])-m {OLD}\b|-m\", \"{OLD}\.", re.M)
TEXT = {".py", ".md", ".sh", ".sbatch", ".service", ".target", ".toml", ".yaml", ".j2", ".txt"}


def test_no_old_top_level_import_names_anywhere():
    """Code, tests, docs, units and scripts all use rolloutd.*: an old name would only work
    from a source checkout (the repository root on sys.path) and break every install."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for rel in tracked:
        p = REPO / rel
        if p.suffix not in TEXT or not p.is_file():
            continue
        for m in OLD_IMPORT.finditer(p.read_text(errors="replace")):
            line = p.read_text(errors="replace")[:m.start()].count("\n") + 1
            bad.append(f"{rel}:{line}: {m.group(0).strip()}")
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="session")
def dist(tmp_path_factory):
    """The wheel and sdist, built once (the first test that needs them pays for the build)."""
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--sdist", "--outdir", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(out.glob("rolloutd-*.whl"))
    sdists = list(out.glob("rolloutd-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return wheels[0], sdists[0]


def make_venv(path: Path, *pip_args: str) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    py = path / "bin" / "python"
    if pip_args:
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pip_args],
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return py


def test_wheel_holds_only_the_rolloutd_package_and_its_data(dist):
    wheel, _ = dist
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"rolloutd"}, top
    for needed in ("rolloutd/sandbox/templates/apptainer.def.j2", "rolloutd/llm/templates/qwen2_5_chatml.j2",
                   "rolloutd/systemd/rolloutd-run@.service", "rolloutd/systemd/rolloutd@.target",
                   "rolloutd/systemd/slurm/rolloutd.sbatch", "rolloutd/systemd/slurm/rolloutd-slurm.sh",
                   "rolloutd/handlers/swe_tasks/tasks/toolz-get-in-default.json",
                   "rolloutd/handlers/swe_tasks/patches/toolz-get-in-default.diff",
                   "rolloutd/sandbox/toolserver/__main__.py", "rolloutd/handlers/swe_tasks/__main__.py"):
        assert needed in names, needed
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    eps = zipfile.ZipFile(wheel).read(meta).decode()
    assert "rolloutd = rolloutd.daemons.cli:main" in eps
    assert re.search(r"^code = rolloutd\.handlers\.code:CodeHandler$", eps, re.M)


def test_sdist_carries_the_source_folders(dist):
    import tarfile

    _, sdist = dist
    names = tarfile.open(sdist).getnames()
    for folder in ("bus", "daemons", "gateway", "handlers", "sandbox", "llm", "endpoint", "backends", "systemd", "rolloutd"):
        assert any(n.split("/")[1:2] == [folder] for n in names), folder


@pytest.mark.timeout(900)
def test_client_needs_only_pyzmq_msgpack_numpy(dist, up, tmp_path):
    """A trainer node: a venv with the three client packages and the wheel (no extras). The client
    shim and the batch client import, import nothing else of the server stack, and talk to a
    real gateway."""
    wheel, _ = dist
    py = make_venv(tmp_path / "client-venv", "pyzmq", "msgpack", "numpy")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = f"""
import json, sys
from rolloutd import RolloutClient, BatchClient, PROTOCOL_VERSION, __version__
import rolloutd.gateway.client, rolloutd.gateway.batch
heavy = sorted(m for m in ("structlog", "transformers", "httpx", "rich", "prometheus_client", "jinja2", "spython",
                           "ptyprocess", "torch", "rolloutd.daemons", "rolloutd.sandbox", "rolloutd.llm", "rolloutd.endpoint",
                           "rolloutd.backends")
               if m in sys.modules)
with RolloutClient({up.gateway!r}, timeout_s=30) as c:
    st = c.status()
    ids = c.submit([{json.dumps(synthetic(1))}])
    res = list(c.gather(ids, timeout_s=120))
print(json.dumps({{"heavy": heavy, "version": __version__, "protocol": PROTOCOL_VERSION,
                  "status": [r["status"] for r in res], "daemons": len(st["daemons"])}}))
"""
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], got
    assert got["status"] == ["ok"] and got["daemons"] >= 3
    from rolloutd import __version__
    from rolloutd.bus.messages import PROTOCOL_VERSION

    assert got["version"] == __version__ and got["protocol"] == PROTOCOL_VERSION
    # without the daemon extra the command says what to install instead of a traceback
    cli = subprocess.run([str(tmp_path / "client-venv" / "bin" / "rolloutd"), "up"], capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 2 and "rolloutd[daemon]" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr


@pytest.mark.timeout(1800)  # a fresh venv with the daemon and tasks extras, then the demo
def test_installed_wheel_runs_demo_and_doctor(dist, tmp_path, bwrap_required):
    """Not editable: every template, unit file, chat template, task patch and data file must be
    in the wheel for the demo (math, code, swe on bubblewrap) to pass."""
    wheel, _ = dist
    env_dir = tmp_path / "full-venv"
    py = make_venv(env_dir, f"{wheel}[daemon,tasks]")
    exe = env_dir / "bin" / "rolloutd"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    v = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, env=env)
    from rolloutd import __version__
    from rolloutd.bus.messages import PROTOCOL_VERSION

    assert v.returncode == 0 and v.stdout.strip() == f"rolloutd {__version__} (wire protocol {PROTOCOL_VERSION})"
    where = subprocess.run([str(py), "-c", "import rolloutd.bus, rolloutd.sandbox.templates; "
                            "print(rolloutd.bus.__file__, rolloutd.sandbox.templates.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert str(env_dir) in where.stdout and str(REPO) not in where.stdout, where.stdout + where.stderr
    doc = subprocess.run([str(exe), "doctor", "--json"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=str(tmp_path))
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert doc.returncode == 0 and checks["bwrap_sandbox"]["ok"], doc.stdout[-2000:] + doc.stderr[-2000:]
    demo = subprocess.run([str(exe), "demo", "--per-domain", "1", "--no-progress", "--out", str(tmp_path / "t.jsonl")],
                          capture_output=True, text=True, timeout=900, env=dict(env, COLUMNS="160"),
                          cwd=str(tmp_path))
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {r["handler"] for r in rows} >= {"math", "code", "swe"}
    assert all(r["status"] == "ok" for r in rows), [(r["instance_id"], r["error"]) for r in rows]
