"""The Prometheus exporter against a live `rolloutd up`: scrape /metrics and check values."""
from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .helpers import free_port, rolloutd_bin, wait_for


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


def series(m, name) -> dict[tuple, float]:
    return {lbl: v for (n, lbl), v in m.items() if n == name}


def test_exporter_counts_jobs_and_exposes_gauges(local_up, procs):
    from rolloutd.gateway.client import RolloutClient

    port = free_port()
    exp = procs.start([rolloutd_bin(), "exporter", "--port", str(port), "--events", local_up["events"]],
                      name="exporter", log_path=local_up["dir"] / "exporter.log")

    def ready():
        try:
            m = scrape(port)
        except OSError:
            return None
        up = {dict(lbl)["daemon"] for lbl, v in series(m, "rolloutd_daemon_up").items() if v == 1.0}
        return m if up >= {"events", "router", "gateway", "init", "run", "eval"} else None

    m = wait_for(ready, 20, "the exporter to see the daemons", 0.3)
    node = _node(m)
    for d in ("events", "router", "gateway", "init", "run", "eval"):
        assert value(m, "rolloutd_daemon_up", daemon=d, node=node) == 1.0, d

    with RolloutClient(local_up["gateway"], timeout_s=5.0) as c:
        c.add_backend("http://127.0.0.1:9", api="vllm", policy_version=3, capacity=4, node=node)
        ids = c.submit([{"handler": "synthetic", "instance": {"run": 0.2, "fail": {"eval": 0.5}, "seed": 11}}], n=10)
        results = list(c.gather(ids, timeout_s=60))
    ok = sum(r["status"] == "ok" for r in results)
    failed = sum(r["status"] == "failed" for r in results)
    assert ok + failed == 10 and failed > 0 and ok > 0

    def counted():
        m = scrape(port)
        return m if (value(m, "rolloutd_jobs_total", status="ok") == ok
                     and value(m, "rolloutd_jobs_total", status="failed") == failed) else None

    m = wait_for(counted, 15, "job counters to match the results", 0.3)
    assert value(m, "rolloutd_jobs_total", status="timeout") == 0
    assert value(m, "rolloutd_events_total", topic="job.done") >= 10
    # phase outcomes from the phase daemons' heartbeats
    wait_for(lambda: (value(scrape(port), "rolloutd_phase_jobs_total", phase="eval", node=node, outcome="failed") or 0)
             >= failed, 10, "eval failures in the phase counters", 0.3)
    # init's counter comes with init's own heartbeat, which may follow eval's (it raced: 6 of 10 once)
    wait_for(lambda: (value(scrape(port), "rolloutd_phase_jobs_total", phase="init", node=node,
                            outcome="forwarded") or 0) >= 10, 10, "init's forwarded jobs in the phase counters", 0.3)
    m = scrape(port)
    # queue depth and in-flight gauges
    assert value(m, "rolloutd_gateway_jobs", state="queued") == 0
    assert value(m, "rolloutd_gateway_jobs", state="dispatched") is not None
    for phase in ("init", "run", "eval"):
        assert value(m, "rolloutd_phase_inflight", phase=phase, node=node) is not None
        assert value(m, "rolloutd_phase_pool", phase=phase, node=node) > 0
    # the backend registered above: load, capacity, version
    backends = series(m, "rolloutd_backend_capacity")
    assert len(backends) == 1 and list(backends.values()) == [4.0]
    assert list(series(m, "rolloutd_backend_policy_version").values()) == [3.0]
    assert list(series(m, "rolloutd_backend_inflight").values()) == [0.0]
    assert value(m, "rolloutd_router_current_version") is not None
    # phase-time histograms, filled from job.done's timing: each bucket holds exactly the jobs
    # whose trajectory says their run phase took at most that long
    assert value(m, "rolloutd_phase_seconds_count", phase="run") == 10
    run_times = [r["timing"]["run"] for r in results]
    assert all(t >= 0.2 for t in run_times), run_times
    for (name, labels), count in m.items():
        lbl = dict(labels)
        if name == "rolloutd_phase_seconds_bucket" and lbl.get("phase") == "run":
            le = float(lbl["le"])
            assert count == sum(t <= le for t in run_times), (le, count, run_times)
    assert value(m, "rolloutd_exporter_stream_up", events=local_up["events"]) == 1.0
    with RolloutClient(local_up["gateway"], timeout_s=5.0) as c:
        c.clear_backends()
    exp.stop()
    assert exp.p.returncode == 0


def _node(m) -> str:
    for (name, labels), _ in m.items():
        if name == "rolloutd_daemon_up":
            return dict(labels)["node"]
    return ""


def test_exporter_refuses_a_taken_port(procs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = procs.start([rolloutd_bin(), "exporter", "--port", str(port), "--events", "ipc:///nonexistent/ev.sock"],
                        name="exporter")
        t0 = time.monotonic()
        while p.alive() and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        assert p.p.returncode == 2
