"""Router shards without daemons: which shard owns a backend or serves a node (stable, even-ish),
shard names and addresses, the config key, the supervisor's children, the gateway's merge of the
shards' replies, and a shard ignoring the ``run.leases`` of another shard's nodes."""
from __future__ import annotations

import collections
import subprocess
import sys
import zlib

import pytest

from rolloutd.bus.config import Config, ConfigError
from rolloutd.bus.endpoints import (Endpoints, router_address, router_bind_address, router_ipc_paths, router_name,
                                    router_shard, shard_of)
from tests.conftest import REPO


def test_shard_of_is_stable_across_processes_and_matches_crc32():
    keys = [f"http://10.0.{i // 200}.{i % 200}:8000" for i in range(50)] + [f"node-{i}" for i in range(50)]
    here = [shard_of(k, 4) for k in keys]
    assert here == [zlib.crc32(k.encode()) % 4 for k in keys]
    # Another interpreter with another hash seed (Python's hash() would differ): the same shards.
    code = ("import json,sys; from rolloutd.bus.endpoints import shard_of; "
            "print(json.dumps([shard_of(k, 4) for k in json.loads(sys.argv[1])]))")
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, check=True)
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_shard_of_splits_nodes_and_backends_evenly(k):
    for keys in ([f"node{i:04d}" for i in range(4000)],
                 [f"http://10.1.{i // 250}.{i % 250}:{8000 + i % 4}" for i in range(4000)]):
        counts = collections.Counter(shard_of(key, k) for key in keys)
        assert set(counts) == set(range(k))
        assert max(counts.values()) / min(counts.values()) < 1.25, counts


def test_one_shard_is_shard_zero():
    assert {shard_of(f"x{i}", 1) for i in range(100)} == {0}
    assert router_name(0) == "router"


def test_shard_names_round_trip_and_name_heartbeat_topics():
    from rolloutd.bus.events import heartbeat_topic

    for i in range(12):
        assert router_shard(router_name(i)) == i
        heartbeat_topic(router_name(i), "head")  # a valid daemon name (no '/' or '@')
    for other in ("run", "routers", "router0", "router01", "router-1", "xrouter", ""):
        assert router_shard(other) is None, other
    # shard 0's heartbeat subscription does not select shard 1's, nor the other way round
    t0, t1 = heartbeat_topic("router").encode(), heartbeat_topic("router1").encode()
    assert not heartbeat_topic("router1", "head").encode().startswith(t0)
    assert not heartbeat_topic("router", "head").encode().startswith(t1)


def test_shard_addresses_ipc_and_tcp(tmp_path):
    ep = Endpoints.local(tmp_path)
    assert router_address(ep, 0) == ep.router
    assert router_address(ep, 1) == f"ipc://{tmp_path}/router1.sock"
    assert router_ipc_paths(ep, 3) == [tmp_path / "router1.sock", tmp_path / "router2.sock"]
    tcp = Endpoints.from_config({"runtime_dir": str(tmp_path), "head": "10.0.0.1", "base_port": 6000})
    assert router_address(tcp, 0) == "tcp://10.0.0.1:6003"
    # shards 1.. take the ports after events_out (6005): no collision with the six named ones
    assert [router_address(tcp, i) for i in (1, 2)] == ["tcp://10.0.0.1:6006", "tcp://10.0.0.1:6007"]
    assert router_bind_address(tcp, 2) == "tcp://*:6007"
    assert router_ipc_paths(tcp, 3) == []


def test_config_key_bounds(tmp_path):
    rd = {"endpoints": {"runtime_dir": str(tmp_path)}}
    assert Config(rd).section("router")["shards"] == 1
    assert Config(dict(rd, router={"shards": 3})).section("router")["shards"] == 3
    for bad in (0, -1, 65, 1.5, "2", True):
        with pytest.raises(ConfigError, match="router.shards"):
            Config(dict(rd, router={"shards": bad}))


def test_supervisor_starts_and_stops_every_shard(tmp_path):
    from rolloutd.daemons.supervisor import START_ORDER, Supervisor, with_shards

    rd = {"endpoints": {"runtime_dir": str(tmp_path)}}
    assert Supervisor(Config(rd)).names == START_ORDER  # one router: exactly as before
    names = Supervisor(Config(dict(rd, router={"shards": 3}))).names
    assert names == ["events", "router", "router1", "router2", "gateway", "eval", "run", "init"]
    assert with_shards(["gateway", "router", "events"], 2) == ["gateway", "router", "router1", "events"]


def test_shard_refuses_an_index_out_of_range(tmp_path):
    from rolloutd.daemons.router import Router

    cfg = Config({"endpoints": {"runtime_dir": str(tmp_path)}, "router": {"shards": 2}})
    assert Router(cfg, shard=1).name == "router1"
    with pytest.raises(ConfigError, match="shard 2 does not exist"):
        Router(cfg, shard=2)


def _node_on(shard: int, k: int) -> str:
    return next(f"n{i}" for i in range(1000) if shard_of(f"n{i}", k) == shard)


def test_a_shard_adopts_only_its_own_nodes_leases(tmp_path):
    """After a restart a shard rebuilds its leases from ``run.leases``: those of its own nodes only
    (another shard's node never leases here; its rows are not even unpacked)."""
    from rolloutd.daemons.router import Router

    cfg = Config({"endpoints": {"runtime_dir": str(tmp_path)}, "router": {"shards": 2}})
    r = Router(cfg, shard=1)
    r.pool.add("http://127.0.0.1:1")
    mine, other = _node_on(1, 2), _node_on(0, 2)
    row = ["L9-1", "http://127.0.0.1:1", 7, 0]
    r._on_heartbeat({"daemon": "run", "node": other, "leases": [row]})
    assert r.pool.leases == {} and f"run@{other}" not in r.pool._vouched
    r._on_heartbeat({"daemon": "run", "node": [mine], "leases": [row]})  # a malformed stamp: ignored, no crash
    assert r.pool.leases == {}
    r._on_heartbeat({"daemon": "run", "node": mine, "leases": [row]})
    assert list(r.pool.leases) == ["L9-1"] and r.pool.leases["L9-1"].requester == f"run@{mine}"
    # one router: every node is its own
    one = Router(Config({"endpoints": {"runtime_dir": str(tmp_path)}}))
    one.pool.add("http://127.0.0.1:1")
    one._on_heartbeat({"daemon": "run", "node": other, "leases": [row]})
    assert list(one.pool.leases) == ["L9-1"]


def test_gateway_merges_shard_replies():
    from rolloutd.gateway.daemon import Gateway

    a = {"kind": "reply", "req_id": 1, "body": {"backends": [{"address": "a"}], "policy": "least_inflight", "leases": 3,
                                                "lease_traffic": {"lease_msgs": 5, "max_batch": 4}}}
    b = {"kind": "reply", "req_id": 2, "body": {"backends": [{"address": "b"}, {"address": "c"}],
                                                "policy": "least_inflight", "leases": 2,
                                                "lease_traffic": {"lease_msgs": 1, "max_batch": 9}}}
    m = Gateway._merge_replies("list_llm_servers", {1: b, 0: a})["body"]
    assert [x["address"] for x in m["backends"]] == ["a", "b", "c"]
    assert m["leases"] == 5 and m["policy"] == "least_inflight"
    assert m["lease_traffic"] == {"lease_msgs": 6, "max_batch": 9}
    assert [(s["shard"], s["backends"], s["leases"]) for s in m["shards"]] == [(0, 1, 3), (1, 2, 2)]
    cleared = Gateway._merge_replies("clear_llm_server", {0: {"kind": "reply", "body": {"cleared": ["a"]}},
                                                          1: {"kind": "reply", "body": {"cleared": ["b"]}}})
    assert cleared["body"] == {"cleared": ["a", "b"]}
    err = {"kind": "error", "code": "internal", "message": "boom"}
    assert Gateway._merge_replies("list_llm_servers", {0: a, 1: err}) is err
