"""``rolloutd exporter``: Prometheus metrics fed by the events stream.

    rolloutd exporter --port P [--addr 127.0.0.1] [--events ADDR] [--config FILE] [--set S.K=V]

A SUB socket folds events into ``rolloutd.daemons.monitor.State`` (the monitor's model); a custom
collector turns the state into metric families at scrape time, so a scrape never waits on
the stream and the stream never waits on a scrape. Metric names and their sources are listed
in docs/OPERATIONS.md. Counters that come from heartbeats (phase outcomes) survive daemon
restarts: each incarnation's counts are added to what earlier incarnations reached.

Phase time histograms (``rolloutd_phase_seconds``) are filled from ``job.done`` events that
carry the trajectory's ``timing``; ``rolloutd_job_latency_seconds`` from ``latency_s``.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from rolloutd.daemons.monitor import OUTCOMES, PHASES, STATUSES, TIMING_KEYS, State, open_stream, stream_args


class StateCollector:
    """prometheus_client collector over a ``State`` guarded by ``lock``."""

    def __init__(self, state: State, lock: threading.Lock, address: str = "", disk: dict | None = None):
        self.state = state
        self.lock = lock
        self.address = address
        self.disk = {} if disk is None else disk  # (node, what) -> last node.disk event (fold_disk)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self.lock:
            snap = self.state.snapshot()
            journal = {k: self.state.gateway.get(k) for k in ("journal_full", "journal_free_bytes")}
            disk = sorted(self.disk.items())

        up = GaugeMetricFamily("rolloutd_exporter_stream_up", "1 when an event arrived within the last 5 s", labels=["events"])
        age = snap["last_event_age_s"]
        up.add_metric([self.address], 1.0 if age is not None and age < 5.0 else 0.0)
        yield up
        ev = CounterMetricFamily("rolloutd_events", "events received, by topic", labels=["topic"])
        for topic, n in sorted(snap["events"].items()):
            ev.add_metric([topic], n)
        yield ev

        jobs = CounterMetricFamily("rolloutd_jobs", "jobs finished (job.done), by status", labels=["status"])
        for status in sorted(set(STATUSES) | set(snap["jobs"])):
            jobs.add_metric([status], snap["jobs"].get(status, 0))
        yield jobs
        red = CounterMetricFamily("rolloutd_jobs_redispatched", "jobs re-dispatched after their holder was lost")
        red.add_metric([], snap["redispatched"])
        yield red
        errs = CounterMetricFamily("rolloutd_job_errors", "failed jobs by phase and error type (from job.done)",
                                   labels=["phase", "error_type"])
        for e in snap["errors"]:
            errs.add_metric([e["phase"], e["type"]], e["count"])
        yield errs
        outc = CounterMetricFamily("rolloutd_phase_jobs", "jobs leaving a phase daemon, by outcome (heartbeat counters)",
                                   labels=["phase", "node", "outcome"])
        for o in snap["outcomes"]:
            if o["outcome"] in OUTCOMES:
                outc.add_metric([o["phase"], o["node"], o["outcome"]], o["count"])
        yield outc
        mal = CounterMetricFamily("rolloutd_malformed", "malformed messages dropped (error.malformed)", labels=["phase"])
        for phase, n in sorted(snap["malformed"].items()):
            mal.add_metric([phase], n)
        yield mal

        h = HistogramMetricFamily("rolloutd_phase_seconds", "time a job spent per phase (job.done timing)",
                                  labels=["phase"])
        for phase in TIMING_KEYS:
            hs = snap["phase_seconds"][phase]
            h.add_metric([phase], [(str(le), c) for le, c in hs["buckets"]], hs["sum"])
        yield h
        lat = snap["latency"]
        h = HistogramMetricFamily("rolloutd_job_latency_seconds", "submit to result, per job (job.done latency_s)")
        h.add_metric([], [(str(le), c) for le, c in lat["buckets"]], lat["sum"])
        yield h

        gw = snap["gateway"]
        q = GaugeMetricFamily("rolloutd_gateway_jobs", "jobs in the gateway by state (gateway heartbeat)", labels=["state"])
        for k in ("queued", "dispatched", "done_unacked", "in_transit"):
            if gw.get(k) is not None:
                q.add_metric([k], float(gw[k]))
        yield q
        g = GaugeMetricFamily("rolloutd_gateway_clients", "trainer clients known to the gateway")
        if gw.get("clients") is not None:
            g.add_metric([], float(gw["clients"]))
        yield g
        g = GaugeMetricFamily("rolloutd_gateway_paused", "1 while dispatch is paused")
        if gw.get("paused") is not None:
            g.add_metric([], 1.0 if gw["paused"] else 0.0)
        yield g
        g = GaugeMetricFamily("rolloutd_gateway_journal_full", "1 while the gateway cannot commit its journal")
        if journal["journal_full"] is not None:
            g.add_metric([], 1.0 if journal["journal_full"] else 0.0)
        yield g
        free = GaugeMetricFamily("rolloutd_disk_free_bytes", "free bytes where a node keeps sandboxes (node.disk "
                                 "events) and where the gateway keeps its journal (gateway heartbeat)",
                                 labels=["node", "what"])
        for (node, what), body in disk:
            free.add_metric([node, what], float(body["free_bytes"]))
        if journal["journal_free_bytes"] is not None:
            free.add_metric(["gateway", "journal"], float(journal["journal_free_bytes"]))
        yield free

        infl = GaugeMetricFamily("rolloutd_phase_inflight", "jobs held by a phase daemon", labels=["phase", "node"])
        pool = GaugeMetricFamily("rolloutd_phase_pool", "slots of a phase daemon", labels=["phase", "node"])
        dup = GaugeMetricFamily("rolloutd_daemon_up", "1 when the daemon's heartbeat is current", labels=["daemon", "node"])
        dage = GaugeMetricFamily("rolloutd_daemon_heartbeat_age_seconds", "seconds since the daemon was last heard",
                                 labels=["daemon", "node"])
        drs = CounterMetricFamily("rolloutd_daemon_restarts", "new incarnations observed", labels=["daemon", "node"])
        for d in snap["daemons"]:
            lbl = [d["daemon"], d["node"]]
            dup.add_metric(lbl, 1.0 if d["state"] == "up" else 0.0)
            dage.add_metric(lbl, d["age_s"])
            drs.add_metric(lbl, d["restarts"])
            if d["daemon"] in PHASES and d["state"] == "up":
                if d.get("inflight") is not None:
                    infl.add_metric(lbl, float(d["inflight"]))
                if d.get("pool") is not None:
                    pool.add_metric(lbl, float(d["pool"]))
        yield from (infl, pool, dup, dage, drs)

        labels = ["backend", "address", "node"]
        bi = GaugeMetricFamily("rolloutd_backend_inflight", "jobs leased to an LLM backend", labels=labels)
        bc = GaugeMetricFamily("rolloutd_backend_capacity", "an LLM backend's capacity (0 = unbounded)", labels=labels)
        bh = GaugeMetricFamily("rolloutd_backend_healthy", "1 while the backend is in rotation", labels=labels)
        bv = GaugeMetricFamily("rolloutd_backend_policy_version", "policy version the backend serves", labels=labels)
        for b in snap["backends"]:
            lbl = [str(b.get("id", "")), str(b.get("address", "")), str(b.get("node", "") or "")]
            for fam, key in ((bi, "inflight"), (bc, "capacity"), (bv, "policy_version")):
                if isinstance(b.get(key), (int, float)):
                    fam.add_metric(lbl, float(b[key]))
            bh.add_metric(lbl, 1.0 if b.get("healthy", True) else 0.0)
        yield from (bi, bc, bh, bv)
        r = snap["router"]
        for key, doc in (("leases", "leases the routers hold (all shards)"),
                         ("waiting", "lease requests waiting for capacity (all shards)"),
                         ("current_version", "newest policy version among the backends")):
            g = GaugeMetricFamily(f"rolloutd_router_{key}", doc)
            if isinstance(r.get(key), (int, float)):
                g.add_metric([], float(r[key]))
            yield g
        # Each router shard's own (router.shards > 1: docs/SCALING.md, "Router shards"); the
        # unlabelled families above stay the sums, as they were with one router.
        for key, doc in (("leases", "leases this router shard holds"),
                         ("waiting", "lease requests waiting in this router shard")):
            g = GaugeMetricFamily(f"rolloutd_router_shard_{key}", doc, labels=["router", "node"])
            for shard in snap.get("routers", []):
                if isinstance(shard.get(key), (int, float)):
                    g.add_metric([shard["router"], shard["node"]], float(shard[key]))
            yield g


def fold_disk(disk: dict, topic: str, body: dict):
    """node.disk / node.disk_low events -> disk[(node, what)] (the last one wins)."""
    if topic in ("node.disk", "node.disk_low") and isinstance(body.get("free_bytes"), (int, float)):
        disk[(str(body.get("node", "?")), str(body.get("what", "?")))] = body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rolloutd exporter", description="Prometheus exporter fed by the events stream")
    stream_args(p)
    p.add_argument("--port", type=int, required=True, help="HTTP port for /metrics")
    p.add_argument("--addr", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    a = p.parse_args(argv)

    from prometheus_client import CollectorRegistry, start_http_server

    from rolloutd.bus import logs

    opened = open_stream(a, "exporter")
    if opened is None:
        return 2
    sub, address, cfg = opened
    lc = cfg.section("logging")
    logs.configure(lc["format"], lc["level"], daemon="exporter", node=cfg.node)
    log = logs.get("rolloutd.exporter")
    state, lock = State(dead_after_s=a.dead_after), threading.Lock()
    registry = CollectorRegistry(auto_describe=False)
    disk: dict = {}
    registry.register(StateCollector(state, lock, address, disk))
    try:
        server, thread = start_http_server(a.port, addr=a.addr, registry=registry)
    except OSError as e:
        print(f"rolloutd exporter: cannot listen on {a.addr}:{a.port}: {e}", file=sys.stderr)
        sub.close()
        return 2
    log.info("exporter_started", port=a.port, addr=a.addr, events=address)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    deadline = None if a.duration is None else time.monotonic() + a.duration
    warned = False
    try:
        while not stop and (deadline is None or time.monotonic() < deadline):
            ev = sub.next(0.25)
            if ev is None:
                continue
            with lock:
                state.apply(ev[0], ev[1])
                fold_disk(disk, ev[0], ev[1])
            if ev[0] == "job.done" and not warned and "timing" not in ev[1]:
                warned = True
                log.warning("job_done_without_timing",
                            note="job.done carries no timing; rolloutd_phase_seconds stays empty")
    finally:
        server.shutdown()
        server.server_close()
        sub.close()
        log.info("exporter_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
