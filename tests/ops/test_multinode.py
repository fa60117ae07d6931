"""Several hosts, simulated with network namespaces of our own: the head (gateway, router,
events) in one, two worker nodes (init, run, eval) in two others, joined by a bridge inside
the head's namespace, all over tcp:// with CURVE. Jobs spread over both nodes; then one node
is cut off (its link goes down mid-run) and its jobs finish on the other."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import require_tool

from .helpers import DRIVER, PY, NetNS, netns_unavailable_reason, rolloutd_bin

SUBNET = "10.231.7"
HEAD_IP = f"{SUBNET}.1"
PORT = 5550


def node_config(d: Path, node: str, keys: Path) -> Path:
    cfg = d / f"{node}.toml"
    cfg.write_text(textwrap.dedent(f"""
        node = "{node}"
        keys_dir = "{keys}"

        [endpoints]
        head = "{HEAD_IP}"
        base_port = {PORT}
        runtime_dir = "{d / ('rt-' + node)}"

        [daemon]
        heartbeat_s = 0.25
        drain_s = 1.0
        poll_s = 0.05

        [gateway]
        daemon_dead_s = 1.5
        lease_timeout_s = 4.0
        max_attempts = 5

        [init]
        pool = 2

        [run]
        pool = 3

        [eval]
        pool = 2
    """))
    return cfg


class Cluster:
    def __init__(self, d: Path, procs):
        tag = os.getpid() % 100000
        self.d = d
        self.procs = procs
        self.ns: dict[str, NetNS] = {}
        self.links: dict[str, str] = {}
        self.daemons: dict[str, list] = {}
        try:
            for role in ("head", "nodeA", "nodeB"):
                self.ns[role] = NetNS(f"rtdm{tag}{role[-1].lower()}")
            h = self.ns["head"]
            h.ip("link", "add", "br0", "type", "bridge")
            h.ip("addr", "add", f"{HEAD_IP}/24", "dev", "br0")
            h.ip("link", "set", "br0", "up")
            for i, role in enumerate(("nodeA", "nodeB"), start=2):
                link = f"h{role[-1]}{tag}"[:15]
                h.ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", self.ns[role].name)
                h.ip("link", "set", link, "master", "br0")
                h.ip("link", "set", link, "up")
                self.ns[role].ip("addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
                self.ns[role].ip("link", "set", "eth0", "up")
                self.links[role] = link
        except Exception:
            self.delete()
            raise

    def start(self, role: str, node: str, names: list[str], cfg: Path):
        for name in names:
            p = self.procs.start(self.ns[role].cmd([rolloutd_bin(), name, "--config", str(cfg)]),
                                 name=f"{name}@{node}", log_path=self.d / f"{name}-{node}.log")
            self.daemons.setdefault(node, []).append(p)

    def cut(self, role: str):
        self.ns["head"].ip("link", "set", self.links[role], "down")

    def delete(self):
        for ns in self.ns.values():
            ns.delete()


def test_two_nodes_curve_and_a_node_cut_off(procs):
    reason = netns_unavailable_reason(bridge=True)
    if reason:
        pytest.skip(reason)
    d = Path(tempfile.mkdtemp(prefix="rtd-mn-"))
    cluster = None
    try:
        keys = d / "keys"
        r = subprocess.run([rolloutd_bin(), "keys", "generate", str(keys)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        cluster = Cluster(d, procs)
        # reachability across the bridge, both ways
        ping = require_tool("ping", "iputils-ping")
        for role, ip in (("nodeA", f"{SUBNET}.2"), ("nodeB", f"{SUBNET}.3")):
            assert subprocess.run(cluster.ns[role].cmd([ping, "-c1", "-W2", HEAD_IP]), capture_output=True,
                                  timeout=10).returncode == 0, f"{role} cannot reach the head"
        cluster.start("head", "head", ["events", "router", "gateway"], node_config(d, "head", keys))
        cluster.start("nodeA", "nodeA", ["eval", "run", "init"], node_config(d, "nodeA", keys))
        cluster.start("nodeB", "nodeB", ["eval", "run", "init"], node_config(d, "nodeB", keys))

        # the monitor, over CURVE, sees both worker nodes
        mon = procs.start(cluster.ns["head"].cmd([rolloutd_bin(), "monitor", "--config", str(d / "head.toml"),
                                                  "--once", "--json", "--collect", "6"]),
                          name="monitor", log_path=d / "monitor.err", stdout_pipe=True)
        drv = procs.start(cluster.ns["head"].cmd([PY, DRIVER, "--gateway", f"tcp://{HEAD_IP}:{PORT}",
                                                  "--keys-dir", str(keys), "--jobs", "30", "--ready-nodes", "2",
                                                  "--ready-timeout", "60", "--deadline", "90",
                                                  "--instance", json.dumps({"run": 0.8})]),
                          name="driver", log_path=d / "driver.err", stdout_pipe=True)
        first = drv.next_json(90)
        assert first and first.get("ready"), f"{first}\n{_logs(d)}"
        assert first["nodes"] == ["nodeA", "nodeB"]
        submitted = drv.next_json(30)
        ids = set(submitted["submitted"])
        assert len(ids) == 30

        results: dict[int, dict] = {}
        cut_at = None
        while len(results) < 30:
            msg = drv.next_json(60)
            assert msg is not None and ("job_id" in msg or msg.get("done")), f"{msg}\n{_logs(d)}"
            if msg.get("done"):
                break
            results[msg["job_id"]] = msg
            nodes = {r["node"] for r in results.values()}
            if cut_at is None and nodes == {"nodeA", "nodeB"} and len(results) >= 4:
                cluster.cut("nodeB")        # nodeB drops off the network mid-run
                cut_at = time.time()
        assert cut_at is not None, "results never came from both nodes"
        assert set(results) == ids
        assert {r["status"] for r in results.values()} == {"ok"}, [r for r in results.values() if r["status"] != "ok"]
        before = [r for r in results.values() if r["t"] < cut_at]
        after = [r for r in results.values() if r["t"] > cut_at + 1.5]
        assert {r["node"] for r in before} == {"nodeA", "nodeB"}
        assert after and {r["node"] for r in after} == {"nodeA"}, after
        moved = [r for r in results.values() if r["attempts"] > 1]
        assert moved, "jobs held by the cut-off node should have been re-dispatched"
        assert {r["node"] for r in moved} == {"nodeA"}
        # nodeB's daemons are still running, unreachable: the cut was the network, not a crash
        assert all(p.alive() for p in cluster.daemons["nodeB"])
        gw_log = (d / "gateway-head.log").read_text()
        assert "job_redispatched" in gw_log and "nodeB" in gw_log

        snap = mon.next_json(30)
        assert snap is not None, (d / "monitor.err").read_text()
        up = {(x["daemon"], x["node"]) for x in snap["daemons"] if x["state"] in ("up", "silent")}
        assert {("init", "nodeA"), ("run", "nodeA"), ("eval", "nodeA"), ("init", "nodeB"), ("gateway", "head")} <= up
    finally:
        procs.stop_all()
        if cluster is not None:
            cluster.delete()
        if not os.environ.get("ROLLOUTD_TEST_KEEP"):
            shutil.rmtree(d, ignore_errors=True)
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"rtdm{os.getpid() % 100000}" not in out


def _logs(d: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(d.glob("*.log")))
