"""`rolloutd keys` and CURVE on tcp: strangers are refused, key holders are served."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from .helpers import PY, free_port, isolated_net, rolloutd_bin, run, wait_for


def keys(*args) -> subprocess.CompletedProcess:
    return subprocess.run([rolloutd_bin(), "keys", *args], capture_output=True, text=True, timeout=60)


def test_generate_layout_and_refuses_to_overwrite(tmp_path):
    d = tmp_path / "keys"
    r = keys("generate", str(d))
    assert r.returncode == 0, r.stderr
    for n in ("server", "gateway", "router", "events", "init", "run", "eval", "client", "monitor", "exporter"):
        assert (d / f"{n}.key").exists() and (d / f"{n}.key_secret").exists(), n
        assert stat.S_IMODE((d / f"{n}.key_secret").stat().st_mode) == 0o600
    # head daemons bind the tcp sockets: their pair is the server pair
    for n in ("gateway", "router", "events"):
        assert (d / f"{n}.key_secret").read_bytes() == (d / "server.key_secret").read_bytes()
    authorized = sorted(p.stem for p in (d / "authorized").glob("*.key"))
    assert {"client", "init", "run", "eval", "monitor", "exporter", "server"} <= set(authorized)
    r = keys("generate", str(d))
    assert r.returncode == 2 and "--force" in r.stderr
    old = (d / "server.key").read_bytes()
    assert keys("generate", str(d), "--force", "--names", "client,init").returncode == 0
    assert (d / "server.key").read_bytes() != old
    shown = json.loads(keys("show", str(d)).stdout)
    assert shown["server"] and "client" in shown["authorized"]


def test_bundle_per_role(tmp_path):
    d = tmp_path / "keys"
    assert keys("generate", str(d)).returncode == 0
    w = tmp_path / "worker"
    assert keys("bundle", str(d), str(w), "--role", "worker").returncode == 0
    names = sorted(p.name for p in w.iterdir())
    assert "server.key" in names and "server.key_secret" not in names and "authorized" not in names
    assert {"init.key_secret", "run.key_secret", "eval.key_secret"} <= set(names)
    h = tmp_path / "head"
    assert keys("bundle", str(d), str(h), "--role", "head").returncode == 0
    assert (h / "server.key_secret").exists() and (h / "authorized" / "client.key").exists()
    c = tmp_path / "client"
    assert keys("bundle", str(d), str(c), "--role", "client").returncode == 0
    assert (c / "client.key_secret").exists() and not (c / "server.key_secret").exists()
    r = keys("bundle", str(d), str(tmp_path / "x"), "--role", "worker", "--names", "nosuch")
    assert r.returncode == 2


CLIENT = textwrap.dedent("""
    import json, sys, shutil, tempfile
    from pathlib import Path
    import zmq.auth
    from rolloutd.bus.sockets import Curve
    from rolloutd.gateway.client import RolloutClient, GatewayTimeout
    addr, keys = sys.argv[1], Path(sys.argv[2])
    def attempt(curve, timeout=1.5):
        with RolloutClient(addr, timeout_s=timeout, retries=0, curve=curve) as c:
            try:
                return "ok" if "queued" in c.status() else "odd"
            except GatewayTimeout:
                return "refused"
    out = {}
    out["authorized"] = attempt(Curve.from_dir(keys, "client"), 5.0)
    out["no_keys"] = attempt(None)
    tmp = Path(tempfile.mkdtemp())
    pub, sec = zmq.auth.load_certificate(zmq.auth.create_certificates(tmp, "stranger")[1])
    stranger = Curve.from_dir(keys, "client")
    stranger.public_key, stranger.secret_key = pub, sec
    out["unauthorized_key"] = attempt(stranger)
    wrong_server = Curve.from_dir(keys, "client")
    wrong_server.server_key = pub
    out["wrong_server_key"] = attempt(wrong_server)
    out["authorized_again"] = attempt(Curve.from_dir(keys, "client"), 5.0)
    shutil.rmtree(tmp)
    print(json.dumps(out))
""")


def test_curve_refuses_strangers_over_tcp(procs):
    """A gateway with keys_dir on tcp loopback (in a private network namespace when possible)."""
    d = Path(tempfile.mkdtemp(prefix="rtd-keys-"))
    net = isolated_net("k")
    try:
        kd = d / "keys"
        assert keys("generate", str(kd)).returncode == 0
        port = 15550 if net.name else free_port(6)
        cfg = d / "gw.toml"
        cfg.write_text(textwrap.dedent(f"""
            node = "head"
            keys_dir = "{kd}"
            [endpoints]
            head = "127.0.0.1"
            base_port = {port}
            runtime_dir = "{d / 'rt'}"
            [daemon]
            heartbeat_s = 0.3
            drain_s = 1.0
        """))
        gw = procs.start(net.cmd([rolloutd_bin(), "gateway", "--config", str(cfg)]), name="gateway",
                         log_path=d / "gateway.log")
        ev = procs.start(net.cmd([rolloutd_bin(), "events", "--config", str(cfg)]), name="events",
                         log_path=d / "events.log")
        wait_for(lambda: "daemon_started" in gw.log_text() or not gw.alive(), 20, "the gateway to start")
        assert gw.alive(), gw.log_text()
        r = run(net.cmd([PY, "-c", CLIENT, f"tcp://127.0.0.1:{port}", str(kd)]), timeout_s=60)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out == {"authorized": "ok", "no_keys": "refused", "unauthorized_key": "refused",
                       "wrong_server_key": "refused", "authorized_again": "ok"}, out
        assert gw.alive() and ev.alive()
        gw.stop()
        ev.stop()
        assert '"daemon_crashed"' not in gw.log_text() and "daemon_crashed" not in gw.log_text()
    finally:
        procs.stop_all()
        net.delete()
        shutil.rmtree(d, ignore_errors=True)


def test_keys_help_and_errors():
    r = keys("--help")
    assert r.returncode == 0 and "generate" in r.stdout
    r = keys("generate", "/tmp/x", "--names", "server")
    assert r.returncode == 2
    r = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "keys", "bundle", "/nonexistent", "/tmp/y", "--role", "head"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "server.key" in r.stderr


@pytest.fixture(autouse=True)
def _no_leftover_namespaces():
    yield
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True) if shutil.which("ip") else None
    if r is not None:  # only this process's namespace (isolated_net names it by pid); others' are theirs
        mine = f"rtdk{os.getpid() % 100000}"
        assert mine not in [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
