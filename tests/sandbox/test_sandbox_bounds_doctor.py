"""`rolloutd doctor` (issue 24 item 5): reports the ptrace protection in effect, the /dev/shm bound
and the disk-quota mechanism, and creates nothing unless asked (--in-root)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from rolloutd.sandbox import bounds

from tests.conftest import require_bwrap, short_tmpdir
from tests.disk.test_disk_quota import remove_tree  # reaps and unmounts first


def _run(*args: str, tmp=None) -> dict:
    """The real CLI in its own process (TMPDIR: where its temporary root goes)."""
    env = dict(os.environ, **({"TMPDIR": str(tmp)} if tmp else {}))
    r = subprocess.run([sys.executable, "-m", "rolloutd.sandbox.doctor", "--json", *args], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    return {c["name"]: c for c in json.loads(r.stdout)}


def test_doctor_creates_nothing_and_reports_the_bounds():
    require_bwrap()
    base = short_tmpdir("rd-doc-")
    scratch = short_tmpdir("rd-doctmp-")
    os.chmod(base, 0o755)
    os.chmod(scratch, 0o755)
    try:
        root = base / "not" / "yet"
        checks = _run("--root-dir", str(root), tmp=scratch)  # deep: a full sandbox start
        assert not (base / "not").exists(), "the doctor created the sandbox root"
        assert not os.listdir(scratch), "the doctor left its temporary root: %s" % os.listdir(scratch)
        assert not bounds.mounts_under(scratch)
        assert checks["bwrap_sandbox"]["ok"], checks["bwrap_sandbox"]
        assert "temporary root" in checks["bwrap_sandbox"]["detail"]
        ptrace = checks["ptrace_protection"]
        assert ptrace["ok"] and "non-dumpable" in ptrace["detail"] and "verified" in ptrace["detail"], ptrace
        assert ("Yama" in ptrace["detail"]) and ("Landlock" in ptrace["detail"])
        shm = checks["shm_bound"]
        assert shm["ok"] and "65536 KiB" in shm["detail"], shm  # the default 64 MB, seen by df inside
        dq = checks["disk_quota"]
        mode = "loop" if bounds.why_no_mounts() is None else "measured"
        assert dq["ok"] and ("auto=%s" % mode) in dq["detail"], dq
        assert "workspace %s" % mode in dq["detail"] and "/run/rolloutd read-only" in dq["detail"], dq
        # asked to: the full start runs in the root, which then exists (and holds no sandbox)
        checks = _run("--root-dir", str(root), "--in-root", tmp=scratch)
        assert checks["bwrap_sandbox"]["ok"] and root.is_dir() and not os.listdir(root / "sb")
    finally:
        remove_tree(base)
        remove_tree(scratch)


def test_doctor_quick_names_the_mechanisms_without_a_sandbox():
    base = short_tmpdir("rd-docq-")
    try:
        checks = _run("--root-dir", str(base / "r"), "--quick")
        assert not (base / "r").exists()
        assert "not verified" in checks["ptrace_protection"]["detail"]
        assert "64 MB" in checks["shm_bound"]["detail"]
        assert checks["disk_quota"]["detail"].startswith("auto=")
    finally:
        remove_tree(base)
