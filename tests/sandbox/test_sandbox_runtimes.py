"""Runtime selection, the bwrap argv (golden), the local runtime, and the doctor."""
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rolloutd.sandbox import Limits, SandboxSpec, SandboxSpecError, get_runtime, procs
from rolloutd.sandbox.bwrap import build_argv, host_system_ops, resolve_run_as, rootfs_ops


def test_bwrap_argv_golden():
    argv = build_argv(
        bwrap="/usr/bin/bwrap",
        fs_ops=[("ro-bind", "/usr", "/usr"), ("symlink", "usr/bin", "/bin"), ("ro-bind", "/etc/passwd", "/etc/passwd")],
        workspace="/r/sb/x/workspace", run_dir="/r/sb/x/run", lib_dir="/r/lib/h",
        binds=[("/data", "/data", True), ("/out", "/out", False)], network=False, workdir="/workspace",
        env={"PATH": "/usr/bin", "PYTHONPATH": "/run/rolloutd-lib"}, python="python3", info_fd=5, tmp_size_mb=64,
    )
    assert argv == [
        "/usr/bin/bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--new-session", "--hostname", "sandbox", "--clearenv", "--as-pid-1",
        "--setenv", "PATH", "/usr/bin", "--setenv", "PYTHONPATH", "/run/rolloutd-lib",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--ro-bind", "/etc/passwd", "/etc/passwd",
        "--proc", "/proc", "--dev", "/dev", "--size", str(64 * 1024 * 1024), "--tmpfs", "/dev/shm",
        "--size", str(64 * 1024 * 1024), "--tmpfs", "/tmp",
        "--bind", "/r/sb/x/workspace", "/workspace", "--ro-bind", "/r/sb/x/run", "/run/rolloutd",
        "--ro-bind", "/r/lib/h", "/run/rolloutd-lib",
        "--ro-bind", "/data", "/data", "--bind", "/out", "/out",
        "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/workspace", "--info-fd", "5",
        "--", "python3", "-S", "-m", "rolloutd_toolserver", "--config", "/run/rolloutd/config.json",
    ]
    assert "--die-with-parent" not in argv  # sandboxes outlive a daemon restart on purpose
    net = build_argv(bwrap="bwrap", fs_ops=[], workspace="/w", run_dir="/r", lib_dir="/l", network=True,
                     tmp_size_mb=None, shm_size_mb=None)
    assert net[:5] == ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--share-net"] and "--size" not in net


def test_host_and_rootfs_ops(tmp_path):
    ops = host_system_ops()
    dsts = [d for _, _, d in ops]
    assert "/usr" in dsts and "/etc/passwd" in dsts
    assert "/etc/shadow" not in dsts
    (tmp_path / "usr").mkdir()
    (tmp_path / "proc").mkdir()
    (tmp_path / "bin").symlink_to("usr/bin")
    assert rootfs_ops(str(tmp_path)) == [("symlink", "usr/bin", "/bin"), ("ro-bind", str(tmp_path / "usr"), "/usr")]
    with pytest.raises(SandboxSpecError):
        rootfs_ops(str(tmp_path / "missing"))


def test_run_as_resolution():
    assert resolve_run_as(None) is None
    assert resolve_run_as("1000:1001") == (1000, 1001)
    assert resolve_run_as(1234) == (1234, 1234)


def test_unknown_runtime(short_root):
    with pytest.raises(SandboxSpecError, match="unknown sandbox runtime"):
        get_runtime("docker", root_dir=short_root)


def test_auto_falls_back_to_local_loudly(short_root, monkeypatch):
    import rolloutd.sandbox as sandbox

    monkeypatch.setattr(sandbox, "bwrap_works", lambda *a, **k: (False, "user namespaces denied (test)"))
    with capture_logs() as logs:
        rt = get_runtime("auto", root_dir=short_root, run_as=None)
    assert rt.name == "local"
    events = {e["event"]: e for e in logs}
    assert events["sandbox_runtime_fallback"]["log_level"] == "warning"
    assert "denied" in events["sandbox_runtime_fallback"]["reason"]
    assert events["local_runtime_no_isolation"]["log_level"] == "warning"


def test_long_root_dir_is_a_clear_error(tmp_path):
    rt = get_runtime("local", root_dir=tmp_path / ("x" * 90))
    with pytest.raises(SandboxSpecError, match="shorter root_dir"):
        rt.create("j")
    assert list(rt.sb_dir.iterdir()) == []


def test_local_runtime_end_to_end(local_rt):
    h = local_rt.create("loc", SandboxSpec(workspace_files={"sub/f.txt": b"bytes"}, env={"K": "v"}))
    c = local_rt.client(h)
    r = c.call("bash", {"command": "cat sub/f.txt; echo; echo $K; pwd"})
    assert r.output == "bytes\nv\n%s\n" % h.workspace
    # a double-forked daemon is still found (the tool server is a child subreaper) and killed
    c.call("bash", {"command": "(setsid sleep 1000 >/dev/null 2>&1 &); true"})
    tree = procs.descendants(h.pids[0])
    assert tree
    local_rt.rt.destroy(h)
    assert procs.wait_gone(tree, timeout=5)


def test_local_runtime_rejects_images_and_binds(local_rt):
    with pytest.raises(SandboxSpecError, match="images"):
        local_rt.rt.create("x", SandboxSpec(image="/"))
    with pytest.raises(SandboxSpecError, match="binds"):
        local_rt.rt.create("x", SandboxSpec(binds=[("/usr", "/u", True)]))
    assert list(local_rt.rt.sb_dir.iterdir()) == []


def test_local_wall_clock(local_rt):
    h = local_rt.create("wall", SandboxSpec(limits=Limits(wall_seconds=2.0)))
    local_rt.client(h).call("bash", {"command": "sleep 1000 &"})
    tree = [h.pids[0]] + procs.descendants(h.pids[0])
    assert procs.wait_gone(tree, timeout=15)


@pytest.fixture
def restore_structlog():
    import structlog

    was = structlog.is_configured()
    yield
    if not was:
        structlog.reset_defaults()


def test_doctor_checks_and_cli(short_root, capsys, restore_structlog):
    from rolloutd.sandbox import doctor

    checks = doctor.check(short_root, deep=False)
    names = [c.name for c in checks]
    for expected in ("host_python3", "user_namespaces", "bwrap", "apptainer", "singularity", "fakeroot",
                     "cgroup_v2", "disk_free", "socket_path", "runtime_auto"):
        assert expected in names
    assert all(isinstance(c.detail, str) and c.detail for c in checks)
    rc = doctor.main(["--root-dir", str(short_root), "--quick", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in out} >= {"bwrap", "runtime_auto"}
    assert rc in (0, 1)
    doctor.main(["--root-dir", str(short_root), "--quick"])
    assert "rolloutd doctor" in capsys.readouterr().out


def test_doctor_deep_check_really_starts_a_sandbox(short_root, need_bwrap):
    from rolloutd.sandbox import doctor

    checks = {c.name: c for c in doctor.check(short_root, deep=True)}
    assert checks["bwrap_sandbox"].ok, checks["bwrap_sandbox"].detail
    assert not (Path(short_root) / "sb").exists()  # it ran in a temporary root: nothing made here


def _old_python():
    import os
    import shutil
    import subprocess

    for cand in (os.environ.get("ROLLOUTD_TEST_OLD_PYTHON"), shutil.which("python3.8")):
        if cand:
            try:
                if subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 8)"],
                                  capture_output=True, timeout=20).returncode == 0:
                    return cand
            except OSError:
                pass
    return None


OLD_PY = _old_python()


@pytest.mark.skipif(OLD_PY is None, reason="no working python3.8 (set ROLLOUTD_TEST_OLD_PYTHON): images may ship "
                                           "an old python3, the tool server supports >= 3.8")
def test_tool_server_runs_on_python38(local_rt, short_root):
    from rolloutd.sandbox import get_runtime

    rt = get_runtime("local", root_dir=short_root / "py38", python=OLD_PY, interrupt_grace=0.5)
    h = rt.create("py38")
    try:
        from rolloutd.sandbox import ToolClient

        with ToolClient(h.tool_socket) as c:
            assert c.ping().info["python"].startswith("3.8")
            assert c.call("bash", {"command": "echo hi"}).output == "hi\n"
            assert c.call("python", {"code": "1 + 1"}).output == "2\n"
            assert c.call("bash", {"command": "sleep 5", "timeout": 0.5}).timed_out
    finally:
        rt.destroy(h)
