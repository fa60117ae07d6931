"""systemd units: lint with systemd-analyze, and the properties the design asks for."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from rolloutd import systemd as units
from rolloutd.bus.config import DEFAULTS

from .helpers import rolloutd_bin

SERVICES = [f"rolloutd-{n}@.service" for n in units.DAEMONS]


def parse(path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values...]}} (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def test_every_daemon_has_a_unit_and_targets_group_them():
    names = {p.name for p in units.unit_files()}
    assert set(SERVICES) <= names
    assert {"rolloutd@.target", "rolloutd-head@.target", "rolloutd-worker@.target"} <= names
    head = parse(units.HERE / "rolloutd-head@.target")["Unit"]["Wants"][0].split()
    worker = parse(units.HERE / "rolloutd-worker@.target")["Unit"]["Wants"][0].split()
    assert sorted(head) == sorted(f"rolloutd-{n}@%i.service" for n in units.HEAD)
    assert sorted(worker) == sorted(f"rolloutd-{n}@%i.service" for n in units.WORKER)
    top = parse(units.HERE / "rolloutd@.target")["Unit"]["Wants"][0].split()
    assert sorted(top) == ["rolloutd-head@%i.target", "rolloutd-worker@%i.target"]


@pytest.mark.parametrize("name", SERVICES)
def test_service_properties(name):
    u = parse(units.HERE / name)
    s = u["Service"]
    daemon = name[len("rolloutd-"):].split("@")[0]
    assert s["Type"] == ["exec"]                      # foreground, no self-daemonizing
    assert "PIDFile" not in s and "GuessMainPID" not in s
    assert s["Restart"] == ["on-failure"]
    assert s["RuntimeDirectory"] == ["rolloutd/%i"] and s["RuntimeDirectoryPreserve"] == ["yes"]
    assert s["KillMode"] == ["mixed"]
    stop = float(s["TimeoutStopSec"][0])
    assert stop > float(DEFAULTS["daemon"]["drain_s"]) + 5, "the stop timeout must outlast the drain deadline"
    exec_start = s["ExecStart"][0].split()
    assert exec_start[0] == units.DEFAULT_BIN and exec_start[1] == daemon
    assert "--config" in exec_start and "${ROLLOUTD_CONFIG}" in exec_start
    assert "--set" in exec_start and "endpoints.runtime_dir=%t/rolloutd/%i" in exec_start
    assert "ROLLOUTD_CONFIG=/etc/rolloutd/%i.toml" in s["Environment"]
    assert s["EnvironmentFile"] == ["-/etc/rolloutd/%i.env"]
    assert u["Unit"]["PartOf"][0].startswith("rolloutd-")
    if daemon in units.WORKER:
        # Hardening that would break bwrap's user/mount/pid namespaces or its fresh /proc.
        for forbidden in ("RestrictNamespaces", "PrivateUsers", "ProtectProc", "ProtectKernelTunables",
                          "ProtectKernelLogs", "SystemCallFilter", "DeviceAllow", "ProtectClock",
                          "CapabilityBoundingSet", "PrivateDevices", "MemoryDenyWriteExecute"):
            assert forbidden not in s, f"{name}: {forbidden}= breaks rootless sandboxes"
        assert "AF_NETLINK" in s["RestrictAddressFamilies"][0]
    else:
        assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"]
        assert s["RestrictNamespaces"] == ["yes"]


@pytest.mark.parametrize("name", SERVICES + ["rolloutd-exporter@.service"])
def test_exec_start_is_accepted_by_the_cli(name, tmp_path):
    """ExecStart, with systemd's specifiers and variables filled in, parses into a valid config."""
    import shlex

    from rolloutd.daemons.cli import build_parser
    from rolloutd.daemons.supervisor import config_from_args

    cfg = tmp_path / "main.toml"
    cfg.write_text(units.EXAMPLE_CONFIG.format(instance="main", head="10.1.2.3").replace(
        'keys_dir = "/etc/rolloutd/keys"', 'keys_dir = ""'))
    line = parse(units.HERE / name)["Service"]["ExecStart"][0]
    line = line.replace("%t", "/run").replace("%i", "main").replace("${ROLLOUTD_CONFIG}", str(cfg))
    argv = [a for a in shlex.split(line)[1:] if not a.startswith("$")]
    if argv[0] == "exporter":   # the exporter's own parser: the stream options plus --port/--addr
        import argparse

        from rolloutd.daemons.monitor import stream_args

        p = argparse.ArgumentParser()
        stream_args(p)
        a, _ = p.parse_known_args(argv[1:])
    else:
        a = build_parser().parse_args(argv)
    c = config_from_args(a.config, a.runtime_dir, a.set)
    assert c.endpoints.run == "ipc:///run/rolloutd/main/run.sock"
    assert c.endpoints.gateway == "tcp://10.1.2.3:5550"


def test_stop_order_follows_the_pipeline():
    """systemd stops in reverse start order: init, run, eval, gateway, router, events."""
    order = ["events", "router", "gateway", "eval", "run", "init"]
    for i, name in enumerate(order):
        after = parse(units.HERE / f"rolloutd-{name}@.service")["Unit"]["After"][0].split()
        for earlier in order[:i]:
            assert f"rolloutd-{earlier}@%i.service" in after, f"{name} must start after {earlier}"


def test_systemd_analyze_verify_is_clean(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    written = units.write_units(tmp_path, rolloutd_bin())
    assert len(written) == len(units.unit_files())
    for p in written:
        assert f"ExecStart={rolloutd_bin()} " in p.read_text() or p.suffix == ".target"
    rc, out = units.verify(tmp_path, "main")
    assert rc == 0 and out == "", f"systemd-analyze verify reported:\n{out}"
    # A second deployment name must lint as well (specifiers, paths).
    rc, out = units.verify(tmp_path, "exp2")
    assert rc == 0 and out == "", out


def test_verify_catches_a_broken_unit(tmp_path):
    """The lint really lints: an unknown key and a missing binary are reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    units.write_units(tmp_path, "/nonexistent/rolloutd")
    rc, out = units.verify(tmp_path)
    assert rc != 0 or out
    assert "nonexistent" in out


def test_module_cli_install_render_and_paths(tmp_path):
    dest = tmp_path / "units"
    cfgdir = tmp_path / "etc"
    r = subprocess.run([sys.executable, "-m", "systemd", "install", "--dest", str(dest), "--config-dir", str(cfgdir),
                        "--bin", rolloutd_bin(), "--no-reload", "--head", "10.0.0.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (dest / "rolloutd-gateway@.service").read_text().count(rolloutd_bin()) == 1
    cfg = (cfgdir / "main.toml").read_text()
    assert 'head = "10.0.0.1"' in cfg
    # the example config is valid for the daemons and the CLI tools
    import tomllib

    from rolloutd.bus.config import Config

    c = Config(tomllib.loads(cfg))
    assert c.endpoints.gateway == "tcp://10.0.0.1:5550" and c.endpoints.run == "ipc:///run/rolloutd/main/run.sock"
    # launcher paths
    r = subprocess.run([sys.executable, "-m", "systemd", "slurm-path"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip().endswith("rolloutd-slurm.sh")


def test_router_shard_units_start_each_shard(tmp_path):
    """router.shards = 3: `install --router-shards 3` writes a unit for shards 1 and 2 (the router's,
    with --shard i) and a head target that wants them; they lint clean and their ExecStart parses."""
    from rolloutd.daemons.cli import build_parser

    r = subprocess.run([sys.executable, "-m", "rolloutd.systemd", "render", str(tmp_path), "--bin", rolloutd_bin(),
                        "--router-shards", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for i in (1, 2):
        u = parse(tmp_path / f"rolloutd-router{i}@.service")
        argv = u["Service"]["ExecStart"][0].split()
        assert argv[0] == rolloutd_bin() and argv[1:4] == ["router", "--shard", str(i)]
        assert u["Service"]["SyslogIdentifier"] == [f"rolloutd-router{i}"]
        assert u["Install"]["WantedBy"] == ["rolloutd-head@%i.target"]
        line = [a.replace("${ROLLOUTD_CONFIG}", "/etc/rolloutd/main.toml").replace("%t", "/run").replace("%i", "main")
                for a in argv[1:] if not a.startswith("$ROLLOUTD")]
        assert build_parser().parse_args(line).shard == i
    head = parse(tmp_path / "rolloutd-head@.target")["Unit"]["Wants"][0].split()
    assert sorted(head) == sorted(f"rolloutd-{n}@%i.service" for n in (*units.HEAD, "router1", "router2"))
    assert not (tmp_path / "rolloutd-router3@.service").exists()
    if shutil.which("systemd-analyze") is not None:
        rc, out = units.verify(tmp_path, "main", router_shards=3)
        assert rc == 0 and out == "", out
