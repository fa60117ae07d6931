"""The monitor: its state model fed by hand-made events, its rendering, and `--once` live."""
from __future__ import annotations

import json
import select
import shutil
import subprocess
import time

import pytest

from rolloutd.daemons.monitor import State, render

from .helpers import rolloutd_bin


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def hb(daemon, node, inc="1", **fields):
    return dict(daemon=daemon, node=node, pid=1, ts=0.0, incarnation=inc, uptime_s=5.0, **fields)


def phase_hb(phase, node, inflight, pool, inc="1", **counts):
    c = {"done": 0, "failed": 0, "timeout": 0, "cancelled": 0, "forwarded": 0, "malformed": 0}
    c.update(counts)
    return hb(phase, node, inc, phase=phase, pool=pool, inflight=inflight, jobs=[[i, 1] for i in range(inflight)],
              counts=c)


def test_state_queues_inflight_backends():
    clk = Clock()
    s = State(dead_after_s=3.0, clock=clk)
    s.apply("daemon.heartbeat", hb("gateway", "head", queued=7, dispatched=10, done_unacked=2, clients=1, paused=False))
    s.apply("daemon.heartbeat", hb("router", "head", policy="least_inflight", leases=3, waiting=0, current_version=4,
                                    backends=[{"id": "b1", "address": "http://x:8000", "node": "n1", "inflight": 2,
                                               "capacity": 8, "healthy": True, "policy_version": 4}]))
    s.apply("daemon.heartbeat", phase_hb("init", "n1", 1, 4))
    s.apply("daemon.heartbeat", phase_hb("init", "n2", 2, 4))
    s.apply("daemon.heartbeat", phase_hb("run", "n1", 3, 16))
    s.apply("daemon.heartbeat", phase_hb("run", "n2", 1, 16))
    s.apply("daemon.heartbeat", phase_hb("eval", "n1", 1, 4))
    snap = s.snapshot()
    assert snap["gateway"]["queued"] == 7 and snap["gateway"]["done_unacked"] == 2
    assert snap["phases"]["init"] == {"nodes": 2, "inflight": 3, "pool": 8, "done": 0, "failed": 0, "timeout": 0,
                                      "cancelled": 0, "forwarded": 0, "malformed": 0}
    assert snap["phases"]["run"]["inflight"] == 4 and snap["phases"]["run"]["pool"] == 32
    assert snap["gateway"]["in_transit"] == 10 - (3 + 4 + 1)
    assert snap["nodes"] == ["head", "n1", "n2"]
    assert [b["id"] for b in snap["backends"]] == ["b1"] and snap["router"]["current_version"] == 4
    s.apply("backend.load", dict(daemon="router", node="head", backend="b1", inflight=5, capacity=8, healthy=True,
                                 policy_version=5))
    assert s.snapshot()["backends"][0]["inflight"] == 5
    s.apply("backend.health", dict(daemon="router", node="head", backend="b1", healthy=False, error="boom"))
    snap = s.snapshot()
    assert snap["backends"][0]["healthy"] is False and snap["recent"][0]["kind"] == "backend"
    s.apply("backend.cleared", dict(daemon="router", node="head", backends=["b1"]))
    assert s.snapshot()["backends"] == []
    # liveness by local receive time
    clk.t += 4.0
    s.apply("daemon.heartbeat", phase_hb("run", "n2", 0, 16))
    states = {(d["daemon"], d["node"]): d["state"] for d in s.snapshot()["daemons"]}
    assert states[("run", "n2")] == "up" and states[("run", "n1")] == "silent"
    assert s.snapshot()["phases"]["run"]["nodes"] == 1   # the silent one no longer counts


def test_state_sums_router_shards_and_keeps_each_shards_backends():
    """router.shards = 2: each shard's heartbeat lists its own backends; the monitor shows both
    shards' backends and their summed leases, and the exporter each shard's figures besides."""
    import threading

    from rolloutd.daemons.exporter import StateCollector

    clk = Clock()
    s = State(dead_after_s=3.0, clock=clk)

    def backend(bid, inflight):
        return {"id": bid, "address": f"http://{bid}:8000", "node": "", "inflight": inflight, "capacity": 0,
                "healthy": True, "policy_version": 2}

    s.apply("daemon.heartbeat", hb("router", "head", policy="least_inflight", leases=3, waiting=1, current_version=2,
                                    backends=[backend("a", 3)]))
    s.apply("daemon.heartbeat", hb("router1", "head", policy="least_inflight", leases=5, waiting=0, current_version=3,
                                    backends=[backend("b", 2), backend("c", 3)]))
    snap = s.snapshot()
    assert [b["id"] for b in snap["backends"]] == ["a", "b", "c"]
    assert snap["router"] == {"shards": 2, "policy": "least_inflight", "leases": 8, "waiting": 1, "current_version": 3}
    assert [(r["router"], r["leases"]) for r in snap["routers"]] == [("router", 3), ("router1", 5)]
    assert [d["daemon"] for d in snap["daemons"]] == ["router", "router1"]
    assert "2 shards, leases 8" in render_text(snap)

    m = {}
    for fam in StateCollector(s, threading.Lock()).collect():
        for smp in fam.samples:
            m[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    assert m[("rolloutd_router_leases", ())] == 8.0
    assert m[("rolloutd_router_shard_leases", (("node", "head"), ("router", "router1")))] == 5.0
    assert m[("rolloutd_router_shard_waiting", (("node", "head"), ("router", "router")))] == 1.0

    # shard 1 no longer lists c: gone; shard 0's backend stays whatever shard 1 lists
    s.apply("daemon.heartbeat", hb("router1", "head", policy="least_inflight", leases=2, waiting=0, current_version=3,
                                    backends=[backend("b", 2)]))
    assert [b["id"] for b in s.snapshot()["backends"]] == ["a", "b"]
    # shard 0 falls silent: the sums are the live shard's
    clk.t += 4.0
    s.apply("daemon.heartbeat", hb("router1", "head", policy="least_inflight", leases=2, waiting=0, current_version=3,
                                    backends=[backend("b", 2)]))
    snap = s.snapshot()
    assert snap["router"]["shards"] == 1 and snap["router"]["leases"] == 2 and snap["router"]["waiting"] == 0


def render_text(snap) -> str:
    from rich.console import Console

    con = Console(record=True, width=200, color_system=None)
    con.print(render(snap, "ipc://test"))
    return con.export_text()


def test_state_outcomes_survive_restarts_and_failures_are_listed():
    clk = Clock()
    s = State(clock=clk)
    s.apply("daemon.heartbeat", phase_hb("eval", "n1", 0, 4, inc="A", done=5, failed=1))
    s.apply("daemon.heartbeat", phase_hb("eval", "n1", 0, 4, inc="A", done=7, failed=2, timeout=1))
    s.apply("daemon.died", dict(daemon="eval", node="n1", incarnation="A", error="RuntimeError: x"))
    assert s.snapshot()["daemons"][0]["state"] == "died"
    s.apply("daemon.heartbeat", phase_hb("eval", "n1", 0, 4, inc="B", done=1))
    snap = s.snapshot()
    out = {(o["phase"], o["outcome"]): o["count"] for o in snap["outcomes"]}
    assert out[("eval", "done")] == 8 and out[("eval", "failed")] == 2 and out[("eval", "timeout")] == 1
    assert snap["daemons"][0]["restarts"] == 1 and snap["daemons"][0]["state"] == "up"
    kinds = [r["kind"] for r in snap["recent"]]
    assert "died" in kinds and "failed" in kinds and "timeout" in kinds
    s.apply("job.redispatched", dict(daemon="gateway", node="head", job_id=9, attempt=2, cause="x went silent"))
    s.apply("daemon.abandoned", dict(daemon="run", node="n1", phase="run", jobs=[[9, 1]], incarnation="C"))
    s.apply("error.malformed", dict(daemon="init", node="n1", phase="init", error="bad frame"))
    s.apply("sandbox.reaped", dict(daemon="init", node="n1", sandboxes=["7.1", "8.2"]))
    snap = s.snapshot()
    assert snap["redispatched"] == 1 and snap["malformed"] == {"init": 1}
    assert {"redispatch", "abandoned", "malformed", "reaped"} <= {r["kind"] for r in snap["recent"]}


def test_state_jobs_throughput_and_timing_histograms():
    clk = Clock()
    s = State(clock=clk)
    for i in range(30):
        clk.t += 0.5
        s.apply("job.done", dict(daemon="gateway", node="head", job_id=i, attempt=1, status="ok"))
    assert s.snapshot()["jobs"]["ok"] == 30
    assert s.rate(10.0) == pytest.approx(20 / 10.0)
    assert s.snapshot()["timing_in_events"] is False
    assert s.snapshot()["phase_seconds"]["run"]["count"] == 0
    # job.done with the fields the gateway is asked to add
    s.apply("job.done", dict(daemon="gateway", node="head", job_id=99, attempt=2, status="failed",
                             timing={"queue": 0.01, "init": 0.2, "run": 3.0, "eval": 0.004}, latency_s=3.5,
                             failed_phase="eval", error_type="SyntheticFailure"))
    snap = s.snapshot()
    assert snap["jobs"]["failed"] == 1 and snap["timing_in_events"] is True
    run = dict((str(le), c) for le, c in snap["phase_seconds"]["run"]["buckets"])
    assert run["2.5"] == 0 and run["5.0"] == 1 and run["+Inf"] == 1 and snap["phase_seconds"]["run"]["sum"] == 3.0
    assert snap["latency"]["count"] == 1
    assert snap["errors"] == [{"phase": "eval", "type": "SyntheticFailure", "count": 1}]
    clk.t += 120
    assert s.rate(60.0) == 0.0


def test_state_tolerates_junk():
    s = State()
    s.apply("daemon.heartbeat", {"daemon": "run"})          # missing fields
    s.apply("daemon.heartbeat", {"daemon": "run", "node": "x", "counts": {"done": "many"}})
    s.apply("job.done", "not a map")
    s.apply("something.new", {"x": 1})
    s.apply("backend.load", {"backend": "b"})
    snap = s.snapshot()
    assert snap["events"]["something.new"] == 1
    render(snap)


def test_render_shows_every_panel():
    from rich.console import Console

    clk = Clock()
    s = State(clock=clk)
    s.apply("daemon.heartbeat", hb("gateway", "head", queued=3, dispatched=2, done_unacked=0, clients=2, paused=True))
    s.apply("daemon.heartbeat", phase_hb("run", "n1", 2, 8, failed=1))
    s.apply("daemon.heartbeat", hb("router", "head", policy="least_inflight", leases=1, waiting=0, current_version=1,
                                    backends=[{"id": "b7", "address": "http://gpu1:8000", "inflight": 1,
                                               "capacity": 4, "healthy": True, "policy_version": 1}]))
    s.apply("job.done", dict(daemon="gateway", node="head", job_id=1, attempt=1, status="timeout"))
    con = Console(record=True, width=160, color_system=None)
    con.print(render(s.snapshot(), "tcp://head:5555"))
    text = con.export_text()
    for needle in ("rolloutd monitor", "tcp://head:5555", "queues", "gateway queue", "run", "25%", "daemons",
                   "backends", "b7", "http://gpu1:8000", "throughput", "timeout=1", "recent failures", "PAUSED"):
        assert needle in text, needle


def submit_and_gather(gateway: str, n: int, instance: dict) -> list[dict]:
    from rolloutd.gateway.client import RolloutClient

    with RolloutClient(gateway, timeout_s=5.0) as c:
        ids = c.submit([{"handler": "synthetic", "instance": instance}], n=n)
        return list(c.gather(ids, timeout_s=60))


def test_monitor_once_json_against_a_live_deployment(local_up):
    mon = subprocess.Popen([rolloutd_bin(), "monitor", "--events", local_up["events"], "--once", "--json",
                            "--collect", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the monitor receives events (heartbeats) before the jobs start, so it sees every job.done
        ready, _, _ = select.select([mon.stderr], [], [], 20)
        assert ready and "monitor_stream_live" in mon.stderr.readline()
        results = submit_and_gather(local_up["gateway"], 6, {"run": 0.3, "fail": {"eval": 0.5}, "seed": 3})
        out, err = mon.communicate(timeout=30)
    finally:
        if mon.poll() is None:
            mon.kill()
            mon.communicate()
    assert mon.returncode == 0, err
    snap = json.loads(out)
    by_status = {}
    for r in results:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    assert {k: v for k, v in snap["jobs"].items() if v} == by_status
    up = {d["daemon"] for d in snap["daemons"] if d["state"] == "up"}
    assert up == {"events", "router", "gateway", "init", "run", "eval"}
    assert snap["phases"]["run"]["pool"] > 0 and snap["gateway"]["queued"] == 0
    assert snap["throughput"]["10s"] > 0


def test_monitor_once_prints_tables(local_up):
    r = subprocess.run([rolloutd_bin(), "monitor", "--runtime-dir", str(local_up["runtime_dir"]), "--once",
                        "--collect", "1.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for needle in ("rolloutd monitor", "queues", "daemons", "backends", "gateway", "eval", "recent failures"):
        assert needle in r.stdout, needle


def test_monitor_live_in_tmux(local_up):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock = f"rtdmon{time.monotonic_ns() % 100000}"
    cmd = f"{rolloutd_bin()} monitor --events {local_up['events']} --duration 8 --refresh 0.3"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-x", "160", "-y", "60", cmd], check=True, timeout=30)
    try:
        def screen():
            r = subprocess.run(["tmux", "-L", sock, "capture-pane", "-p"], capture_output=True, text=True, timeout=10)
            return r.stdout

        deadline = time.monotonic() + 10
        text = ""
        while time.monotonic() < deadline:
            text = screen()
            if "eval" in text and "up" in text and "rolloutd monitor" in text:
                break
            time.sleep(0.3)
        assert "rolloutd monitor" in text and "daemons" in text and "eval" in text, text
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, timeout=10)
