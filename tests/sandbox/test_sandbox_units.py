"""Small pure pieces: wire framing, output capping, specs and handles, cgroup setup."""
import json
import socket

import msgpack
import pytest

from rolloutd.sandbox import Limits, SandboxHandle, SandboxSpec, SandboxSpecError, ToolResult
from rolloutd.sandbox.cgroups import CgroupV2
from rolloutd.sandbox.toolserver.output import CappedBuffer, finish_text, strip_ansi
from rolloutd.sandbox.toolserver.wire import FrameError, encode, recv_frame, send_frame


def test_wire_roundtrip_and_errors():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    try:
        send_frame(a, {"id": 1, "tool": "bash", "args": {"command": "échο"}})
        assert recv_frame(b) == {"id": 1, "tool": "bash", "args": {"command": "échο"}}
        a.sendall(encode({"x": 1})[:6])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="middle of a frame"):
            recv_frame(b)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    b.settimeout(5)
    a.close()
    assert recv_frame(b) is None  # clean EOF
    b.close()


def test_capped_buffer_keeps_head_and_tail():
    buf = CappedBuffer(100)
    for i in range(1000):
        buf.write(b"%04d\n" % i)
    data, truncated = buf.getvalue()
    assert truncated
    assert data.startswith(b"0000\n0001\n") and data.endswith(b"0998\n0999\n")
    assert b"output truncated: 4900 bytes omitted" in data
    small = CappedBuffer(100)
    small.write(b"x" * 100)
    assert small.getvalue() == (b"x" * 100, False)


def test_ansi_stripping():
    raw = b"\x1b[1;31mred\x1b[0m \x1b]0;title\x07ok\x1b(B\r\n"
    assert strip_ansi(raw) == b"red ok\r\n"
    assert finish_text(raw) == "red ok\n"


def test_limits_validation():
    with pytest.raises(SandboxSpecError):
        Limits(memory_mb=-1)
    with pytest.raises(SandboxSpecError, match="nproc"):
        Limits(nproc=2)
    with pytest.raises(SandboxSpecError):
        Limits(cpu_seconds=True)
    assert Limits.from_dict(Limits(memory_mb=64, wall_seconds=1.5).to_dict()) == Limits(memory_mb=64, wall_seconds=1.5)


@pytest.mark.parametrize("kw,match", [
    (dict(binds=[("relative", "/x", True)]), "absolute"),
    (dict(binds=[("/nonexistent-src", "/x", True)]), "does not exist"),
    (dict(binds=[("/usr", "/workspace", True)]), "reserved"),
    (dict(env={"BAD-NAME": "x"}), "variable name"),
    (dict(workspace_files={"../escape": "x"}), "escapes"),
    (dict(workspace_files={"/abs": "x"}), "relative"),
    (dict(workdir="relative"), "absolute"),
])
def test_spec_validation(kw, match):
    with pytest.raises(SandboxSpecError, match=match):
        SandboxSpec(**kw).validate()


def test_handle_is_plain_data():
    h = SandboxHandle(runtime="bwrap", job_id="j", sandbox_id="0123456789ab", workspace="/w", tool_socket="/s",
                      loopback="127.1.0.1", pids=[1, 2], created_at=1.5, sandbox_dir="/d",
                      extra={"pid_starts": [3, 4], "pidns": 5})
    d = h.to_dict()
    assert SandboxHandle.from_dict(json.loads(json.dumps(d))) == h
    assert SandboxHandle.from_dict(msgpack.unpackb(msgpack.packb(d))) == h
    with pytest.raises(SandboxSpecError, match="lacks"):
        SandboxHandle.from_dict({"runtime": "bwrap"})


def test_tool_result_from_wire_tolerates_unknown_fields():
    r = ToolResult.from_wire({"output": "o", "exit_code": 0, "duration": 0.1, "timed_out": False,
                              "error": None, "truncated": False, "id": 3, "future_field": 1})
    assert r.ok and r.info == {"future_field": 1}
    assert not ToolResult(exit_code=1).ok


def _fake_cgroup(tmp_path, controllers="cpu memory pids", enabled="memory pids"):
    (tmp_path / "cgroup.controllers").write_text(controllers)
    (tmp_path / "cgroup.subtree_control").write_text(enabled)
    return tmp_path


def test_cgroup_detection_reasons(tmp_path):
    assert "not a cgroup" in CgroupV2.unusable_reason(tmp_path)
    _fake_cgroup(tmp_path, controllers="cpu")
    assert "not available" in CgroupV2.unusable_reason(tmp_path)
    _fake_cgroup(tmp_path, enabled="cpu")
    assert "not enabled" in CgroupV2.unusable_reason(tmp_path)
    _fake_cgroup(tmp_path)
    assert CgroupV2.unusable_reason(tmp_path) is None
    assert CgroupV2.detect(tmp_path).parent == tmp_path


def test_cgroup_create_writes_limits(tmp_path):
    cg = CgroupV2(_fake_cgroup(tmp_path))
    path = cg.create("abc", memory_mb=64, nproc=50)
    assert (path / "memory.max").read_text() == str(64 * 1024 * 1024)
    assert (path / "pids.max").read_text() == "50"
    (path / "cgroup.procs").write_text("")
    fd = CgroupV2.open_procs(path)
    import os

    os.write(fd, b"0")
    os.close(fd)
    assert (path / "cgroup.procs").read_text() == "0"
