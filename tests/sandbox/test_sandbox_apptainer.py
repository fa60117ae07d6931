"""Apptainer/Singularity: golden argv and definition files, the image cache, and a real
integration test wherever an apptainer/singularity binary exists (skipped otherwise)."""
import multiprocessing
import shutil
import time
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, ToolClient, get_runtime
from rolloutd.sandbox.apptainer import exec_argv, instance_start_argv, instance_stop_argv
from rolloutd.sandbox.errors import RuntimeUnavailable, SandboxSpecError
from rolloutd.sandbox.images import ImageBuilder, ImageSpec, build_argv, render_definition

SWE = ImageSpec(
    name="swe-py311", base="python:3.11-slim",
    post=["apt-get update && apt-get install -y --no-install-recommends git", "pip install --no-cache-dir pytest==8.3.3"],
    environment={"PIP_NO_INPUT": "1", "GREETING": "hello world"},
    files=[("/srv/task/repo.tar", "/opt/repo.tar")], labels={"task": "swe"},
)

GOLDEN_DOCKER = """\
Bootstrap: docker
From: python:3.11-slim

%labels
    org.rolloutd.image swe-py311
    org.rolloutd.version 0.1.0
    org.rolloutd.cache-mode versioned
    org.rolloutd.cache-key abc123
    task swe

%files
    /srv/task/repo.tar /opt/repo.tar

%environment
    export LC_ALL=C.UTF-8
    export GREETING='hello world'
    export PIP_NO_INPUT=1

%post
    set -eu
    # mount points of the rolloutd sandbox layout
    mkdir -p /workspace /run/rolloutd /run/rolloutd-lib
    apt-get update && apt-get install -y --no-install-recommends git
    pip install --no-cache-dir pytest==8.3.3

%test
    # the in-sandbox tool server needs python3 >= 3.8 and nothing else
    command -v python3 >/dev/null || { echo "rolloutd: image has no python3" >&2; exit 1; }
    python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)'
"""

GOLDEN_LOCALIMAGE = """\
Bootstrap: localimage
From: /images/base.sif

%labels
    org.rolloutd.image with-tools
    org.rolloutd.version 0.1.0
    org.rolloutd.cache-mode scratch
    org.rolloutd.cache-key none

%environment
    export LC_ALL=C.UTF-8

%post
    set -eu
    # mount points of the rolloutd sandbox layout
    mkdir -p /workspace /run/rolloutd /run/rolloutd-lib
    if true; then
      echo multi
    fi

%test
    # the in-sandbox tool server needs python3 >= 3.8 and nothing else
    command -v python3 >/dev/null || { echo "rolloutd: image has no python3" >&2; exit 1; }
    python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)'
"""


def test_definition_docker_golden(tmp_path):
    text = render_definition(SWE, cache_mode="versioned", cache_key="abc123", version="0.1.0")
    assert text == GOLDEN_DOCKER
    # spython's own parser reads it back the same way
    from spython.main.parse.parsers import SingularityParser

    path = tmp_path / "Singularity"
    path.write_text(text)
    recipe = SingularityParser(str(path)).recipe
    layer = list(recipe.values())[-1] if isinstance(recipe, dict) else recipe
    assert layer.fromHeader == "python:3.11-slim"


def test_definition_localimage_golden():
    spec = ImageSpec(name="with-tools", base="/images/base.sif", bootstrap="localimage",
                     post=["if true; then\n  echo multi\nfi"])
    assert render_definition(spec, version="0.1.0") == GOLDEN_LOCALIMAGE


@pytest.mark.parametrize("kw,match", [
    (dict(name="bad name", base="x"), "image name"),
    (dict(name="n", base="x", bootstrap="library"), "bootstrap"),
    (dict(name="n", base="relative.sif", bootstrap="localimage"), "absolute"),
])
def test_image_spec_validation(kw, match):
    with pytest.raises(SandboxSpecError, match=match):
        ImageSpec(**kw).validate()


def test_instance_start_argv_golden():
    argv = instance_start_argv(
        binary="apptainer", image="/img/swe.sif", instance="rolloutd-0123456789ab",
        workspace="/r/sb/0123456789ab/workspace", run_dir="/r/sb/0123456789ab/run", lib_dir="/r/lib/abc",
        binds=[("/data", "/data", True), ("/scratch", "/scratch", False)], network=False, fakeroot=True)
    assert argv == [
        "apptainer", "instance", "start", "--fakeroot", "--containall", "--writable-tmpfs",
        "--net", "--network", "none",
        "--bind", "/r/sb/0123456789ab/workspace:/workspace",
        "--bind", "/r/sb/0123456789ab/run:/run/rolloutd",
        "--bind", "/r/lib/abc:/run/rolloutd-lib:ro",
        "--bind", "/data:/data:ro", "--bind", "/scratch:/scratch",
        "/img/swe.sif", "rolloutd-0123456789ab",
    ]


def test_instance_start_argv_with_network_no_fakeroot():
    argv = instance_start_argv(binary="singularity", image="/i.sif", instance="rolloutd-x", workspace="/w",
                               run_dir="/r", lib_dir="/l", network=True)
    assert argv == ["singularity", "instance", "start", "--containall", "--writable-tmpfs",
                    "--bind", "/w:/workspace", "--bind", "/r:/run/rolloutd", "--bind", "/l:/run/rolloutd-lib:ro",
                    "/i.sif", "rolloutd-x"]


def test_exec_and_stop_argv_golden():
    assert exec_argv(binary="apptainer", instance="rolloutd-x", workdir="/workspace") == [
        "apptainer", "exec", "--cleanenv", "--pwd", "/workspace",
        "--env", "PYTHONPATH=/run/rolloutd-lib", "--env", "PYTHONNOUSERSITE=1",
        "--env", "PYTHONDONTWRITEBYTECODE=1", "--env", "LANG=C.UTF-8",
        "instance://rolloutd-x", "python3", "-S", "-m", "rolloutd_toolserver", "--config", "/run/rolloutd/config.json",
    ]
    assert instance_stop_argv(binary="apptainer", instance="rolloutd-x") == [
        "apptainer", "instance", "stop", "--force", "rolloutd-x"]
    assert build_argv("apptainer", Path("/c/x.def"), Path("/c/x.sif"), fakeroot=True) == [
        "apptainer", "build", "--fakeroot", "/c/x.sif", "/c/x.def"]


class FakeBuilder:
    """A builder *function* (not a fake apptainer binary): records calls, writes a file."""

    def __init__(self):
        self.calls = []

    def __call__(self, definition, output):
        self.calls.append((Path(definition).read_text(), Path(output)))
        Path(output).write_text("sif built from %s" % definition)


def test_cache_scratch_always_rebuilds(tmp_path):
    fb = FakeBuilder()
    b = ImageBuilder(tmp_path, mode="scratch", builder=fb, version="0.1.0")
    p1, p2 = b.ensure(SWE), b.ensure(SWE)
    assert p1 == p2 == tmp_path / "swe-py311.sif" and len(fb.calls) == 2


def test_cache_versioned(tmp_path):
    fb = FakeBuilder()
    b = ImageBuilder(tmp_path, mode="versioned", builder=fb, version="0.1.0")
    p1 = b.ensure(SWE)
    assert b.ensure(SWE) == p1 and len(fb.calls) == 1  # reused
    assert "org.rolloutd.cache-mode versioned" in fb.calls[0][0]
    ImageSpec_ = type(SWE)
    newer_base = ImageSpec_(**{**SWE.__dict__, "base": "python:3.12-slim"})
    p2 = b.ensure(newer_base)
    assert p2 != p1 and len(fb.calls) == 2  # base changed
    b2 = ImageBuilder(tmp_path, mode="versioned", builder=fb, version="0.2.0")
    p3 = b2.ensure(SWE)
    assert p3 not in (p1, p2) and len(fb.calls) == 3  # rolloutd version changed
    assert (p1.with_suffix(".json")).exists() and p1.with_suffix(".def").read_text().startswith("Bootstrap: docker")


def test_cache_lock_follows_lockfile_hash(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("numpy==2.0.0\n")
    fb = FakeBuilder()
    spec = ImageSpec(name="locked", base="python:3.11-slim", lockfile=str(lock))
    b = ImageBuilder(tmp_path / "cache", mode="lock", builder=fb, version="0.1.0")
    p1 = b.ensure(spec)
    assert b.ensure(spec) == p1 and len(fb.calls) == 1
    lock.write_text("numpy==2.1.0\n")
    p2 = b.ensure(spec)
    assert p2 != p1 and len(fb.calls) == 2
    lock.write_text("numpy==2.0.0\n")  # back to the first hash: its image is still cached
    assert b.ensure(spec) == p1 and len(fb.calls) == 2
    with pytest.raises(SandboxSpecError, match="lockfile"):
        b.ensure(ImageSpec(name="nolock", base="x"))


def test_failed_build_leaves_no_image(tmp_path):
    def broken(definition, output):
        Path(output).write_text("half")
        raise RuntimeError("build failed")

    b = ImageBuilder(tmp_path, mode="versioned", builder=broken, version="0.1.0")
    with pytest.raises(RuntimeError):
        b.ensure(SWE)
    assert not list(tmp_path.glob("*.sif")) and not list(tmp_path.glob(".*.sif"))


class SlowLoggingBuilder:
    def __init__(self, log_path):
        self.log_path = log_path

    def __call__(self, definition, output):
        with open(self.log_path, "a") as f:
            f.write("start %f\n" % time.time())
        time.sleep(0.3)
        with open(self.log_path, "a") as f:
            f.write("end %f\n" % time.time())
        Path(output).write_text("sif")


def _build_in_process(cache, log_path, mode):
    ImageBuilder(cache, mode=mode, builder=SlowLoggingBuilder(log_path), version="0.1.0").ensure(SWE)


@pytest.mark.parametrize("mode,expected_builds", [("versioned", 1), ("scratch", 3)])
def test_concurrent_builds_are_serialized_across_processes(tmp_path, mode, expected_builds):
    log_path = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    ps = [ctx.Process(target=_build_in_process, args=(str(tmp_path / "cache"), str(log_path), mode)) for _ in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(30)
        assert p.exitcode == 0
    events = [line.split() for line in log_path.read_text().splitlines()]
    assert len(events) == 2 * expected_builds
    # strictly alternating start/end: no two builds of the same image ever overlapped
    assert [e[0] for e in events] == ["start", "end"] * expected_builds
    times = [float(e[1]) for e in events]
    assert times == sorted(times)


def test_runtime_unavailable_without_binary(short_root, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeUnavailable, match="not installed"):
        get_runtime("apptainer", root_dir=short_root)
    with pytest.raises(RuntimeUnavailable, match="singularity"):
        get_runtime("singularity", root_dir=short_root)


BINARY = shutil.which("apptainer") or shutil.which("singularity")


@pytest.mark.skipif(BINARY is None, reason="no apptainer or singularity binary on PATH: the real integration "
                                           "test cannot run here (argv and .def files are golden-tested above)")
@pytest.mark.timeout(900)
def test_apptainer_integration(short_root):  # pragma: no cover - needs a real binary
    import os

    image = os.environ.get("ROLLOUTD_TEST_SIF")
    if not image:
        builder = ImageBuilder(short_root / "images", mode="versioned", binary=BINARY,
                               fakeroot=os.geteuid() != 0)
        image = str(builder.ensure(ImageSpec(name="rolloutd-test", base="python:3.11-slim")))
    rt = get_runtime(Path(BINARY).name, root_dir=short_root, fakeroot=os.geteuid() != 0, ready_timeout=120)
    h = rt.create("it", SandboxSpec(image=image, workspace_files={"a.txt": "hi"}))
    try:
        with ToolClient(h.tool_socket) as c:
            assert c.call("bash", {"command": "cat /workspace/a.txt"}).output == "hi"
            assert c.call("python", {"code": "1 + 1"}).output == "2\n"
    finally:
        rt.destroy(h)
    assert rt.list() == []
