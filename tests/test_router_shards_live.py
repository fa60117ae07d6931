"""Two router shards with live scripted backends (``router.shards = 2``): a head from ``rolloutd up``
(node A) plus the worker daemons of a second node B on the same machine, the two nodes chosen to
hash to different shards. Backends split as the hash says, each node's jobs lease only its shard's
backends, listings merge, and a restarted shard gets back its own backends and leases only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.bus.config import dump_toml
from rolloutd.bus.endpoints import Endpoints, shard_of
from rolloutd.gateway.client import GatewayError
from tests.conftest import REPO, alive, children_of, remove_tree, short_tmpdir, stop_daemons, synthetic, wait_for

K = 2
FAST = {"daemon": {"heartbeat_s": 0.2, "drain_s": 2.0}, "router": {"shards": K, "lease_ttl_s": 5.0}}


def node_on(shard: int) -> str:
    return next(f"n{i}" for i in range(1000) if shard_of(f"n{i}", K) == shard)


def llm_job(i, calls=2):
    return synthetic(i, llm_calls=calls, max_tokens=2) | {"handler": "synthetic_llm"}


@pytest.fixture
def sharded(up_factory):
    """(up, worker node name): the head + node A, then node B's init, run and eval."""
    na, nb = node_on(0), node_on(1)
    up = up_factory(f"router.shards={K}", f"node={na}", "daemon.heartbeat_s=0.2", "router.lease_ttl_s=5")
    head = Endpoints.local(up.runtime_dir)
    rd = short_tmpdir("rd-nb-")
    shared = {n: getattr(head, n) for n in ("gateway", "gateway_results", "init", "router", "events_in", "events_out")}
    cfg = rd / "nb.toml"
    cfg.write_text(dump_toml({"node": nb, "endpoints": dict(shared, runtime_dir=str(rd / "run")), **FAST}))
    log = open(rd / "nb.log", "w")  # noqa: SIM115 - closed below
    procs = [subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", d, "--config", str(cfg)], stdout=log,
                              stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
             for d in ("eval", "run", "init")]
    try:
        with up.client() as c:
            wait_for(lambda: {(d["daemon"], d["node"]) for d in c.status()["daemons"]}
                     >= {(p, n) for p in ("init", "run", "eval") for n in (na, nb)}, 90, "both nodes' phase daemons")
        yield up, nb
    finally:
        try:
            stop_daemons(procs)
        finally:
            log.close()
            remove_tree(rd)


def split_backends(backends, per_shard=2):
    """Scripted backends until each shard owns ``per_shard`` of them (their ports are random)."""
    by_shard: dict[int, list] = {i: [] for i in range(K)}
    extra = []
    while min(len(v) for v in by_shard.values()) < per_shard:
        b = backends(latency=0.2)
        s = shard_of(b.url, K)
        (by_shard[s] if len(by_shard[s]) < per_shard else extra).append(b)
    for b in extra:
        b.stop()
    return by_shard


def routers(c) -> dict[int, dict]:
    """Each shard's last heartbeat, by shard."""
    out = {}
    for d in c.status()["daemons"]:
        if d["daemon"] == "router":
            out[0] = d
        elif d["daemon"] == "router1":
            out[1] = d
    return out


def shard_pid(up, shard: int) -> int:
    for pid in children_of(up.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in cmd and (shard == 0) == (b"--shard" not in cmd) and (shard == 0 or str(shard).encode() in cmd):
            return pid
    raise LookupError(shard)


def test_two_shards_split_backends_and_nodes_and_survive_a_shard_restart(sharded, backends):
    up, nb = sharded
    by_shard = split_backends(backends)
    urls = {i: {b.url for b in bs} for i, bs in by_shard.items()}
    with up.client(timeout_s=3.0, retries=10) as c:
        for i in (1, 0):
            for b in by_shard[i]:
                assert c.add_backend(b.url)["address"] == b.url
        wait_for(lambda: len(c.list_backends()["backends"]) == 4
                 and all(b["healthy"] for b in c.list_backends()["backends"]), what="all four admitted")
        body = c.list_backends()
        assert {b["address"] for b in body["backends"]} == urls[0] | urls[1]
        assert [(s["shard"], s["backends"]) for s in body["shards"]] == [(0, 2), (1, 2)]
        # Each shard holds the backends the hash gives it, and only those (its heartbeat).
        wait_for(lambda: {i: {b["address"] for b in hb["backends"]} for i, hb in routers(c).items()} == urls,
                 what="each shard's heartbeat listing its own backends")
        assert len(c.status()["backends"]) == 4
        # The monitor shows both shards: every backend, and the shards' figures summed.
        mon = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "monitor", "--events", up.events, "--once",
                              "--json", "--collect", "3"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert mon.returncode == 0, mon.stderr[-2000:]
        snap = json.loads(mon.stdout)
        assert {b["address"] for b in snap["backends"]} == urls[0] | urls[1]
        assert snap["router"]["shards"] == K and [r["router"] for r in snap["routers"]] == ["router", "router1"]

        # A registration may name its shard (add_llm_server.shard): held there, not where its hash says;
        # another shard, or one past router.shards, is refused; a clear finds it on its shard.
        extra = backends(latency=0.2)
        there = 1 - shard_of(extra.url, K)
        c.add_backend(extra.url, shard=there)
        wait_for(lambda: extra.url in {b["address"] for b in routers(c)[there]["backends"]},
                 what="the named shard's heartbeat listing the backend")
        assert extra.url not in {b["address"] for b in routers(c)[1 - there]["backends"]}
        for bad in (1 - there, K):
            with pytest.raises(GatewayError) as e:
                c.add_backend(extra.url, shard=bad)
            assert e.value.code == "invalid", e.value
        assert c.add_backend(extra.url, shard=there)["address"] == extra.url  # the same again: idempotent
        assert c.clear_backends(extra.url) == [extra.url]
        wait_for(lambda: extra.url not in {b["address"] for hb in routers(c).values() for b in hb["backends"]},
                 what="the cleared backend gone from its shard")

        ids = c.submit([llm_job(i) for i in range(40)])
        results = list(c.gather(ids, timeout_s=120))
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        nodes = {r["node"] for r in results}
        assert len(nodes) == 2, nodes  # both nodes, so both shards, leased
        for r in results:  # a node's jobs lease its shard's backends only
            assert {t["backend"] for t in r["turns"]} <= urls[shard_of(r["node"], K)], (r["node"], r["turns"])
        hbs = routers(c)
        for i in range(K):
            served = {b["address"]: b["leases_total"] for b in hbs[i]["backends"]}
            assert set(served) == urls[i] and sum(served.values()) > 0, (i, served)
        body = c.list_backends()
        assert sum(b["leases_total"] for b in body["backends"]) == len(results)
        assert body["lease_traffic"]["batched_leases"] == sum(s["lease_traffic"]["batched_leases"] for s in body["shards"])

        # Kill shard 1 while node B's jobs hold leases on it: it comes back with its own two backends
        # (replayed by the gateway to it alone) and node B's leases, and every job finishes.
        ids = c.submit([llm_job(100 + i, calls=30) for i in range(12)])
        wait_for(lambda: all(s["leases"] > 0 for s in c.list_backends()["shards"]), what="leases on both shards")
        inc0 = routers(c)[0]["incarnation"]
        before = len(up.logged("backend_reregistered"))
        victim = shard_pid(up, 1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not alive(victim), what="shard 1 killed")

        def back():
            try:
                body = c.list_backends()
            except Exception:  # noqa: BLE001 - the gateway answers unavailable until shard 1 is up
                return False
            return body["shards"][1]["backends"] == 2 and body["shards"][1]["leases"] > 0 and body

        body = wait_for(back, 40, "shard 1 back with its backends and adopted leases")
        assert {b["address"] for b in body["backends"]} == urls[0] | urls[1]
        again = up.logged("backend_reregistered")[before:]
        assert again and {r["backend"] for r in again} == urls[1] and {r["shard"] for r in again} == {1}, again
        assert routers(c)[0]["incarnation"] == inc0  # shard 0 untouched
        results = list(c.gather(ids, timeout_s=120))
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        for r in results:
            assert {t["backend"] for t in r["turns"]} <= urls[shard_of(r["node"], K)]
        assert {r["node"] for r in results} >= {nb}


def test_two_shards_over_tcp_with_curve(backends):
    """The shards over tcp with CURVE, as a multi-node deployment runs them: the head (events, both
    router shards, gateway) and two nodes' phase daemons, one node per shard, every socket on
    loopback tcp with keys. A backend registered on each shard (``add_llm_server.shard``); each
    node's jobs lease over CURVE from its own shard's backend only."""
    from rolloutd.bus.sockets import Curve
    from rolloutd.gateway.client import RolloutClient
    from tests.ops.helpers import free_port

    d = short_tmpdir("rd-tcp-")
    keys = d / "keys"
    r = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "keys", "generate", str(keys)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    port = free_port(6 + K)
    na, nb = node_on(0), node_on(1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs, logs = [], []

    def start(node: str, daemon: str, *extra: str):
        cfg = d / f"{node}.toml"
        if not cfg.exists():
            cfg.write_text(dump_toml({"node": node, "keys_dir": str(keys), **FAST,
                                      "endpoints": {"head": "127.0.0.1", "base_port": port, "runtime_dir": str(d / node)}}))
        log = open(d / f"{daemon}{''.join(extra)}-{node}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", daemon, *extra, "--config", str(cfg)],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env))

    try:
        for daemon, extra in (("events", ()), ("router", ()), ("router", ("--shard", "1")), ("gateway", ())):
            start(na, daemon, *extra)
        for node in (na, nb):
            for daemon in ("eval", "run", "init"):
                start(node, daemon)
        shard_b = [backends(latency=0.05) for _ in range(K)]
        with RolloutClient(f"tcp://127.0.0.1:{port}", timeout_s=3.0, retries=20, curve=Curve.from_dir(keys, "client")) as c:
            wait_for(lambda: {(x["daemon"], x["node"]) for x in c.status()["daemons"]}
                     >= {(p, n) for p in ("init", "run", "eval") for n in (na, nb)} | {("router1", na)}, 90,
                     "every daemon over tcp with CURVE")
            for i, b in enumerate(shard_b):
                c.add_backend(b.url, shard=i)
            wait_for(lambda: len(c.list_backends()["backends"]) == K
                     and all(b["healthy"] for b in c.list_backends()["backends"]), what="both backends admitted")
            ids = c.submit([llm_job(i) for i in range(16)])
            results = list(c.gather(ids, timeout_s=120))
        assert all(x["status"] == "ok" for x in results), [x["error"] for x in results]
        by_node = {n: {t["backend"] for x in results if x["node"] == n for t in x["turns"]} for n in (na, nb)}
        assert by_node == {na: {shard_b[0].url}, nb: {shard_b[1].url}}, by_node
    finally:
        try:
            stop_daemons(procs)
        finally:
            for f in logs:
                f.close()
            remove_tree(d)
