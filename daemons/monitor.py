"""``rolloutd monitor``: a live terminal view of the events stream.

    rolloutd monitor [--events ADDR] [--config FILE] [--set S.K=V] [--once [--json]] [--duration S]

Two halves kept apart: ``State`` folds events into a model (no I/O, no clock of its own
unless given, unit-testable), ``render`` turns a ``State.snapshot()`` into rich renderables.
The Prometheus exporter (daemons/exporter.py) reads the same snapshot.

What it shows, and where each number comes from (docs/EVENTS.md lists every topic):

* queue depths: the gateway heartbeat (``queued`` = waiting for an init slot, ``dispatched``
  = somewhere in the pipeline, ``done_unacked``), and per phase the sum over nodes of the
  phase daemons' ``inflight`` / ``pool``; ``in transit`` = dispatched minus everything a phase
  daemon holds (jobs in a pipe between phases).
* in flight per daemon and node: phase daemon heartbeats.
* per-backend load and version: the router heartbeat's ``backends`` and ``backend.*`` events.
* throughput: ``job.done`` events per second over 10 s and 60 s.
* failures: phase daemons' outcome counters (failed / timeout / cancelled by phase), the
  gateway's ``job.done`` statuses (and error types when the event carries them), deaths,
  re-dispatches, malformed input, backends leaving rotation.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import signal
import sys
import time

from rolloutd.bus.endpoints import router_shard

PHASES = ("init", "run", "eval")
HEAD = ("events", "router", "gateway")
ROUTER_FIELDS = ("policy", "leases", "waiting", "current_version")
OUTCOMES = ("done", "failed", "timeout", "cancelled", "forwarded", "malformed")
FAIL_OUTCOMES = ("failed", "timeout", "cancelled")
STATUSES = ("ok", "failed", "timeout", "cancelled")
# Phase times of agent rollouts run from milliseconds (direct scoring) to an hour.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
           1800.0, 3600.0, math.inf)
TIMING_KEYS = ("queue", "init", "run", "eval", "llm", "tools")


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets=BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        cum, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            cum.append(["+Inf" if math.isinf(b) else b, acc])
        return {"buckets": cum, "sum": self.sum, "count": self.count}


class DaemonView:
    __slots__ = ("daemon", "node", "state", "incarnation", "pid", "seen", "hb", "error", "restarts")

    def __init__(self, daemon: str, node: str):
        self.daemon, self.node = daemon, node
        self.state = "up"
        self.incarnation = None
        self.pid = None
        self.seen = 0.0          # local receive time of the last event from it
        self.hb: dict = {}       # last heartbeat body
        self.error = ""
        self.restarts = 0        # incarnation changes observed


class State:
    """Everything the monitor and the exporter know, folded from events.

    ``apply(topic, body, now)`` takes one event; ``now`` is the local receive time (heartbeat
    ``ts`` fields come from other hosts' clocks and are only displayed).
    """

    def __init__(self, dead_after_s: float = 5.0, recent: int = 30, clock=time.time):
        self.dead_after_s = dead_after_s
        self.clock = clock
        self.started = clock()
        self.last_event = None
        self.events = collections.Counter()            # by topic
        self.daemons: dict[str, DaemonView] = {}       # "daemon@node"
        self.gateway: dict = {}                        # last gateway heartbeat
        self.routers: dict[str, dict] = {}             # "router@node", "router1@node"...: last heartbeat, no backends
        self.router_lists: dict[str, set] = {}         # the same key -> backend ids its heartbeat listed
        self.backends: dict[str, dict] = {}            # id -> public fields
        self.jobs = collections.Counter()              # job.done by status
        self.redispatched = 0
        self.errors = collections.Counter()            # (phase, error type) from job.done, when present
        self.outcome_base = collections.Counter()      # (phase, node, outcome): earlier incarnations
        self.outcome_last: dict[str, tuple[str, dict]] = {}  # daemon key -> (incarnation, counts)
        self.malformed = collections.Counter()         # phase -> error.malformed events
        self.phase_seconds = {k: Histogram() for k in TIMING_KEYS}
        self.latency = Histogram()
        self.done_times: collections.deque[float] = collections.deque()
        self.recent: collections.deque[dict] = collections.deque(maxlen=recent)
        self.timing_seen = False

    # -- folding ------------------------------------------------------------------------
    def apply(self, topic: str, body: dict, now: float | None = None):
        now = self.clock() if now is None else now
        self.last_event = now
        self.events[topic] += 1
        if not isinstance(body, dict):
            return
        daemon, node = str(body.get("daemon", "?")), str(body.get("node", "?"))
        key = f"{daemon}@{node}"
        if topic.startswith("daemon."):
            self._daemon_event(topic, key, daemon, node, body, now)
        elif topic == "job.done":
            self._job_done(body, now)
        elif topic == "job.redispatched":
            self.redispatched += 1
            self._note(now, "redispatch", key, f"job {body.get('job_id')} attempt {body.get('attempt')}",
                       str(body.get("cause", "")))
        elif topic.startswith("backend."):
            self._backend_event(topic, body, now)
        elif topic == "sandbox.reaped":
            boxes = body.get("sandboxes") or []
            self._note(now, "reaped", key, f"{len(boxes)} orphan sandbox(es) reaped",
                       ", ".join(str(b) for b in boxes[:8]))
        elif topic == "error.malformed":
            phase = str(body.get("phase", daemon))
            self.malformed[phase] += 1
            self._note(now, "malformed", key, f"{phase}: malformed input dropped", str(body.get("error", "")))

    def _view(self, key, daemon, node) -> DaemonView:
        v = self.daemons.get(key)
        if v is None:
            v = self.daemons[key] = DaemonView(daemon, node)
        return v

    def _daemon_event(self, topic, key, daemon, node, body, now):
        v = self._view(key, daemon, node)
        inc = body.get("incarnation")
        if inc is not None and v.incarnation is not None and inc != v.incarnation and topic in (
                "daemon.heartbeat", "daemon.started"):
            v.restarts += 1
            v.hb = {}
        if topic in ("daemon.heartbeat", "daemon.started"):
            v.incarnation = inc if inc is not None else v.incarnation
            v.pid = body.get("pid", v.pid)
            v.seen = now
            v.state = "up"
            v.error = ""
            if topic == "daemon.heartbeat":
                v.hb = body
                if daemon == "gateway":
                    self.gateway = body
                elif router_shard(daemon) is not None:
                    self._router_heartbeat(key, body)
                if isinstance(body.get("counts"), dict):
                    self._outcomes(key, str(body.get("phase", daemon)), node, str(inc), body["counts"], now)
        elif topic == "daemon.stopped":
            if inc is None or inc == v.incarnation or v.incarnation is None:
                v.state, v.seen = "stopped", now
        elif topic == "daemon.died":
            v.state, v.seen, v.error = "died", now, str(body.get("error", ""))
            self._note(now, "died", key, "daemon died", v.error)
        elif topic == "daemon.abandoned":
            jobs = body.get("jobs") or []
            self._note(now, "abandoned", key, f"{len(jobs)} job(s) abandoned at the drain deadline",
                       ", ".join(str(j[0]) for j in jobs[:8] if isinstance(j, (list, tuple)) and j))

    def _router_heartbeat(self, key: str, body: dict):
        """A router shard's heartbeat lists its own backends (docs/SCALING.md, "Router shards"): each
        shard's list replaces what that shard listed before; a backend no shard lists is gone."""
        self.routers[key] = {k: val for k, val in body.items() if k != "backends"}
        if not isinstance(body.get("backends"), list):
            return
        listed = {str(b.get("id")): dict(b) for b in body["backends"] if isinstance(b, dict)}
        self.backends.update(listed)
        self.router_lists[key] = set(listed)
        known = set().union(*self.router_lists.values())
        for bid in [b for b in self.backends if b not in known]:
            del self.backends[bid]

    def router_totals(self, now: float) -> tuple[dict, list[dict]]:
        """The routers' figures summed over the shards heard from lately, and each shard's."""
        shards = []
        for key, hb in self.routers.items():
            v = self.daemons.get(key)
            if v is None or self.daemon_state(v, now) != "up":
                continue
            shards.append({"router": v.daemon, "shard": router_shard(v.daemon), "node": v.node,
                           **{k: hb.get(k) for k in ROUTER_FIELDS if k in hb}})
        shards.sort(key=lambda r: r["shard"])
        if not shards:
            return {}, []
        total: dict = {"shards": len(shards)}
        if "policy" in shards[0]:
            total["policy"] = shards[0]["policy"]
        for k in ("leases", "waiting"):
            vals = [r[k] for r in shards if isinstance(r.get(k), (int, float))]
            if vals:
                total[k] = sum(vals)
        versions = [r["current_version"] for r in shards if isinstance(r.get("current_version"), (int, float))]
        if versions:
            total["current_version"] = max(versions)
        return total, shards

    def _outcomes(self, key, phase, node, inc, counts, now):
        prev = self.outcome_last.get(key)
        if prev is not None and prev[0] != inc:   # a new incarnation counts from zero
            for o, n in prev[1].items():
                self.outcome_base[(phase, node, o)] += n
            prev = None
        old = prev[1] if prev else {}
        clean = {o: int(n) for o, n in counts.items() if isinstance(n, (int, float))}
        if prev is not None:
            for o in FAIL_OUTCOMES:
                d = clean.get(o, 0) - old.get(o, 0)
                if d > 0:
                    self._note(now, o, f"{phase}@{node}", f"{d} job(s) {o} in {phase}", "")
        self.outcome_last[key] = (inc, clean)

    def _job_done(self, body, now):
        status = str(body.get("status", "?"))
        self.jobs[status] += 1
        self.done_times.append(now)
        self._trim(now)
        timing = body.get("timing")
        if isinstance(timing, dict):
            self.timing_seen = True
            for k, val in timing.items():
                if k in self.phase_seconds and isinstance(val, (int, float)) and val >= 0:
                    self.phase_seconds[k].observe(float(val))
        lat = body.get("latency_s")
        if isinstance(lat, (int, float)) and lat >= 0:
            self.latency.observe(float(lat))
        if status != "ok":
            phase = body.get("failed_phase") or "?"
            err = body.get("error")
            etype = body.get("error_type") or (err.get("type") if isinstance(err, dict) else None)
            if etype or body.get("failed_phase"):
                self.errors[(str(phase), str(etype or status))] += 1
            detail = f"{phase}: {etype}" if etype else ""
            self._note(now, status, f"job {body.get('job_id')}", f"attempt {body.get('attempt')} -> {status}", detail)

    def _backend_event(self, topic, body, now):
        bid = str(body.get("backend", body.get("id", "")))
        if topic == "backend.added":
            self.backends[bid] = {k: v for k, v in body.items() if k not in ("daemon", "node", "pid", "ts")}
            self.backends[bid]["node"] = body.get("node", "")
        elif topic == "backend.cleared":
            for b in body.get("backends") or []:
                self.backends.pop(str(b), None)
        elif topic == "backend.load":
            b = self.backends.setdefault(bid, {"id": bid})
            for k in ("inflight", "capacity", "healthy", "policy_version"):
                if k in body:
                    b[k] = body[k]
        elif topic == "backend.health":
            b = self.backends.setdefault(bid, {"id": bid})
            b["healthy"] = bool(body.get("healthy"))
            if not body.get("healthy"):
                self._note(now, "backend", bid, "backend out of rotation", str(body.get("error", "")))

    def _note(self, now, kind, where, what, detail):
        self.recent.append({"t": now, "kind": kind, "where": where, "what": what, "detail": detail[:200]})

    def _trim(self, now):
        while self.done_times and now - self.done_times[0] > 60.0:
            self.done_times.popleft()

    # -- reading ---------------------------------------------------------------------------
    def rate(self, window_s: float, now: float | None = None) -> float:
        now = self.clock() if now is None else now
        self._trim(now)
        n = sum(1 for t in self.done_times if now - t < window_s)
        span = min(window_s, max(now - self.started, 1e-3))
        return n / span

    def outcomes(self) -> dict[tuple[str, str, str], int]:
        total = collections.Counter(self.outcome_base)
        for key, (_, counts) in self.outcome_last.items():
            v = self.daemons.get(key)
            phase = str(v.hb.get("phase", v.daemon)) if v else key.split("@")[0]
            node = v.node if v else key.split("@", 1)[-1]
            for o, n in counts.items():
                total[(phase, node, o)] += n
        return dict(total)

    def daemon_state(self, v: DaemonView, now: float) -> str:
        if v.state == "up" and now - v.seen > self.dead_after_s:
            return "silent"
        return v.state

    def snapshot(self, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        daemons = []
        for key, v in sorted(self.daemons.items(), key=lambda kv: (_order(kv[1].daemon), kv[1].node)):
            st = self.daemon_state(v, now)
            d = {"daemon": v.daemon, "node": v.node, "state": st, "pid": v.pid, "incarnation": v.incarnation,
                 "age_s": round(now - v.seen, 3), "uptime_s": v.hb.get("uptime_s"), "restarts": v.restarts,
                 "error": v.error}
            if v.daemon in PHASES:
                d.update(pool=v.hb.get("pool"), inflight=v.hb.get("inflight"))
            daemons.append(d)
        phases = {}
        held = 0
        for p in PHASES:
            live = [d for d in daemons if d["daemon"] == p and d["state"] == "up"]
            inflight = sum(int(d.get("inflight") or 0) for d in live)
            pool = sum(int(d.get("pool") or 0) for d in live)
            held += inflight
            phases[p] = {"nodes": len(live), "inflight": inflight, "pool": pool}
        outcomes = self.outcomes()
        for (p, _node, o), n in outcomes.items():
            if p in phases:
                phases[p][o] = phases[p].get(o, 0) + n
        router, routers = self.router_totals(now)
        gw = self.gateway
        gateway = {k: gw.get(k) for k in ("queued", "dispatched", "done_unacked", "clients", "paused") if k in gw}
        if "dispatched" in gw:
            gateway["in_transit"] = max(0, int(gw.get("dispatched") or 0) - held)
        return {
            "now": now,
            "collecting_s": round(now - self.started, 3),
            "last_event_age_s": None if self.last_event is None else round(now - self.last_event, 3),
            "events": dict(self.events),
            "gateway": gateway,
            "phases": phases,
            "daemons": daemons,
            "nodes": sorted({d["node"] for d in daemons}),
            "router": router,
            "routers": routers,
            "backends": [self.backends[k] for k in sorted(self.backends)],
            "jobs": {s: self.jobs.get(s, 0) for s in sorted(set(STATUSES) | set(self.jobs))},
            "redispatched": self.redispatched,
            "throughput": {"10s": round(self.rate(10.0, now), 3), "60s": round(self.rate(60.0, now), 3)},
            "outcomes": [{"phase": p, "node": n, "outcome": o, "count": c} for (p, n, o), c in sorted(outcomes.items())],
            "errors": [{"phase": p, "type": t, "count": c} for (p, t), c in sorted(self.errors.items())],
            "malformed": dict(self.malformed),
            "phase_seconds": {k: h.snapshot() for k, h in self.phase_seconds.items()},
            "latency": self.latency.snapshot(),
            "timing_in_events": self.timing_seen,
            "recent": [dict(r, age_s=round(now - r["t"], 1)) for r in reversed(self.recent)],
        }


def _order(daemon: str) -> tuple[int, int]:
    order = HEAD + PHASES
    shard = router_shard(daemon)
    if shard is not None:  # router shards together, in order
        return order.index("router"), shard
    return (order.index(daemon) if daemon in order else len(order)), 0


# -- rendering ----------------------------------------------------------------------------------
def render(snap: dict, source: str = ""):
    """rich renderables for one snapshot."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("rolloutd monitor", "bold"), f"  {source}  ",
        f"{len([d for d in snap['daemons'] if d['state'] == 'up'])}/{len(snap['daemons'])} daemons up on "
        f"{len(snap['nodes'])} node(s)  ",
        f"last event {snap['last_event_age_s']}s ago" if snap["last_event_age_s"] is not None else "no events yet",
        f"  {time.strftime('%H:%M:%S', time.localtime(snap['now']))}")

    gw = snap["gateway"]
    pipe = Table(title="queues", title_justify="left", expand=False)
    for c in ("stage", "nodes", "in flight", "pool", "util", "done", "failed", "timeout", "cancelled"):
        pipe.add_column(c, justify="right" if c != "stage" else "left")
    pipe.add_row("gateway queue", "", str(gw.get("queued", "-")), "", "", "", "", "", "")
    for p in PHASES:
        ph = snap["phases"][p]
        util = f"{100.0 * ph['inflight'] / ph['pool']:.0f}%" if ph["pool"] else "-"
        done = ph.get("done", 0) + ph.get("forwarded", 0)
        pipe.add_row(p, str(ph["nodes"]), str(ph["inflight"]), str(ph["pool"]), util, str(done),
                     _red(ph.get("failed", 0)), _red(ph.get("timeout", 0)), _red(ph.get("cancelled", 0)))
    pipe.add_row("in transit", "", str(gw.get("in_transit", "-")), "", "", "", "", "", "")
    pipe.add_row("done, not yet polled", "", str(gw.get("done_unacked", "-")), "", "", "", "", "", "")

    jobs = snap["jobs"]
    tp = snap["throughput"]
    thr = Text.assemble(("throughput ", "bold"), f"{tp['10s']:.2f} jobs/s (10 s)  {tp['60s']:.2f} jobs/s (60 s)   ",
                        ("jobs ", "bold"), "  ".join(f"{k}={v}" for k, v in jobs.items()),
                        f"  redispatched={snap['redispatched']}",
                        f"  clients={gw.get('clients', '-')}" + ("  PAUSED" if gw.get("paused") else ""))

    dt = Table(title="daemons", title_justify="left")
    for c in ("daemon", "node", "state", "in flight", "pool", "uptime", "last seen", "restarts"):
        dt.add_column(c)
    for d in snap["daemons"]:
        style = {"up": "green", "silent": "yellow", "stopped": "dim", "died": "red"}.get(d["state"], "")
        dt.add_row(d["daemon"], d["node"], Text(d["state"] + (f" ({d['error'][:40]})" if d["error"] else ""), style=style),
                   _s(d.get("inflight")), _s(d.get("pool")), _dur(d.get("uptime_s")), f"{d['age_s']:.1f}s ago",
                   str(d["restarts"]))

    shards = f", {snap['router']['shards']} shards" if snap["router"].get("shards", 1) > 1 else ""
    bt = Table(title="backends" + (f"  (router: {snap['router'].get('policy', '?')}{shards}, leases {snap['router'].get('leases', '-')}, "
                                   f"waiting {snap['router'].get('waiting', '-')}, version {snap['router'].get('current_version', '-')})"
                                   if snap["router"] else ""), title_justify="left")
    for c in ("backend", "address", "node", "in flight", "capacity", "healthy", "policy_version"):
        bt.add_column(c)
    for b in snap["backends"]:
        bt.add_row(str(b.get("id", "")), str(b.get("address", "")), str(b.get("node", "") or "-"), _s(b.get("inflight")),
                   _s(b.get("capacity") or "∞"), Text("yes", style="green") if b.get("healthy", True) else Text("NO", style="red"),
                   _s(b.get("policy_version")))
    if not snap["backends"]:
        bt.add_row("(none registered)", "", "", "", "", "", "")

    parts = [head, pipe, thr, dt, bt]
    if snap["errors"]:
        et = Table(title="failures by phase and error type", title_justify="left")
        for c in ("phase", "error type", "count"):
            et.add_column(c)
        for e in snap["errors"]:
            et.add_row(e["phase"], e["type"], str(e["count"]))
        parts.append(et)
    rt = Table(title="recent failures", title_justify="left")
    for c in ("age", "kind", "where", "what", "detail"):
        rt.add_column(c)
    for r in snap["recent"][:10]:
        rt.add_row(f"{r['age_s']:.0f}s", r["kind"], r["where"], r["what"], r["detail"][:80])
    if not snap["recent"]:
        rt.add_row("", "", "", "(none)", "")
    parts.append(rt)
    return Group(*parts)


def _s(v) -> str:
    return "-" if v is None else str(v)


def _red(n):
    from rich.text import Text

    return Text(str(n), style="red" if n else "")


def _dur(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


# -- command line ---------------------------------------------------------------------------------
def stream_args(p: argparse.ArgumentParser, silent: str = "counts as down"):
    """The options of a tool reading the events stream (monitor, exporter)."""
    p.add_argument("--events", help="events stream address (default: endpoints.events_out of the config)")
    p.add_argument("--config", help="TOML config (default: $ROLLOUTD_CONFIG or built-in defaults)")
    p.add_argument("--runtime-dir", help="runtime directory of a one-machine deployment (`rolloutd up`)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--key-name", default=None, help="CURVE key name to connect with (when keys_dir is set)")
    p.add_argument("--dead-after", type=float, default=5.0, help=f"a daemon silent this long {silent}")
    p.add_argument("--duration", type=float, default=None, help="exit after this many seconds")


def open_stream(a, key_name: str):
    """(Subscriber, address, config) for parsed ``stream_args``; None (the error printed) when
    the config or the address is bad."""
    from rolloutd.bus.config import ConfigError
    from rolloutd.bus.events import Subscriber
    from rolloutd.daemons.supervisor import config_from_args

    try:
        cfg = config_from_args(a.config, a.runtime_dir, a.set)
        address = a.events or cfg.endpoints.events_out
        curve = cfg.curve(a.key_name or key_name) if address.startswith("tcp://") else None
        return Subscriber(address, curve=curve), address, cfg
    except (ConfigError, OSError) as e:
        print(f"rolloutd {key_name}: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rolloutd monitor", description="live view of the rolloutd events stream")
    stream_args(p, "is shown as silent")
    p.add_argument("--once", action="store_true", help="collect for --collect seconds, print one snapshot, exit")
    p.add_argument("--collect", type=float, default=3.0, help="seconds to collect before --once prints (default 3)")
    p.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    p.add_argument("--refresh", type=float, default=0.5, help="seconds between redraws")
    p.add_argument("--width", type=int, default=None, help="output width (default: the terminal's, else 120)")
    a = p.parse_args(argv)

    from rich.console import Console

    opened = open_stream(a, "monitor")
    if opened is None:
        return 2
    sub, address, _ = opened
    state = State(dead_after_s=a.dead_after)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    console = Console(width=a.width or (None if sys.stdout.isatty() else 120))

    live_said = []

    def pump(seconds: float):
        end = time.monotonic() + seconds
        while not stop:
            left = end - time.monotonic()
            if left <= 0:
                return
            ev = sub.next(min(left, 0.25))
            if ev is not None:
                if not live_said:  # scripts wait for this line before they start what they watch
                    live_said.append(1)
                    print(json.dumps({"event": "monitor_stream_live", "events": address}), file=sys.stderr, flush=True)
                state.apply(ev[0], ev[1])

    try:
        if a.once:
            pump(a.collect)
            snap = state.snapshot()
            if a.json:
                print(json.dumps(snap, default=str))
            else:
                console.print(render(snap, address))
            return 0
        from rich.live import Live

        deadline = None if a.duration is None else time.monotonic() + a.duration
        with Live(render(state.snapshot(), address), console=console, refresh_per_second=max(1, int(1 / a.refresh)),
                  screen=False, transient=False) as live:
            while not stop and (deadline is None or time.monotonic() < deadline):
                pump(a.refresh if deadline is None else min(a.refresh, max(0.0, deadline - time.monotonic())))
                live.update(render(state.snapshot(), address))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()


if __name__ == "__main__":
    sys.exit(main())
