"""Control-plane load (issue 16): heartbeats and lease traffic of 100, 1,000 and 5,000 nodes
against a real events proxy, router and gateway, with a real client measuring submit and poll.

    python bench/bench_control_plane.py --quick          # 100 nodes, change listings, 4 s windows, three and one heartbeat messages per node (~40 s: CI's smoke run)
    python bench/bench_control_plane.py                  # 100, 1,000, 5,000 nodes, both listing formats, 20 s windows
    python bench/bench_control_plane.py --nodes 1000 --seconds 30 --json out.json --root /patched/copy

Per size, three fresh head daemons (``rolloutd events|router|gateway --set ...``, tcp on
loopback, as the Slurm launcher starts them) and generator processes (``--generators``, default
one per 1,000 nodes, the nodes split between them) that together play every worker node's init,
run and eval daemon with the exact wire formats:

* the jobs are real: the bench submits ``nodes x (init + run + eval) held`` jobs (``run.pool``
  512 + prefetch 64, init and eval 32 + 4: the defaults) and the generator takes them from the
  gateway over the init credit hand-off (``ready`` announcements, as ``CreditReceiver``), so the
  gateway's table holds them as dispatched, as in a cluster that is full; above
  ``--populate-max`` jobs the heartbeats list ids the gateway does not know (said in the output);
* every simulated daemon publishes ``daemon.heartbeat`` once per ``heartbeat_s`` on the events
  stream with the fields a phase daemon sends (``jobs`` = its held [id, attempt] pairs; the run
  daemon's full listings come with a ``run.leases`` event: [lease_id, backend_id, job_id, version]
  per held slot, which the router adopts and renews), spread over the second; with ``--per-node
  one`` each node sends one message instead, the run body carrying its init and eval bodies
  (docs/EVENTS.md, ``carried``; docs/SCALING.md section 15: what one heartbeat per node saves);
* lease traffic: ``lease`` + ``release`` requests to the router at ``nodes x run_pool / job_s``
  per second (one lease per job, held for the job's run phase), against one registered scripted
  backend, so the router publishes its ``backend.load`` event per lease and release;
* a real ``RolloutClient`` alternates ``submit`` (one job) and ``poll`` (wait 0) at 20 Hz;
  latency percentiles over the window.

Figures: each head daemon's CPU as a fraction of one core over the window (from /proc),
submit/poll p50/p99, and what the generators delivered against what they were asked over the
same window (heartbeats/s, leases/s; they share the machine's cores with the head). A row where
they delivered less than 95% is marked ``GENERATOR SHORT`` in the output and
``"generator_short": true`` in ``--json``: it does not judge the head at its size. Lease
operations the router's full queue refused, or the router answered with an error, are counted
apart: those are the head's. A same-run baseline with 0 nodes gives the gateway's idle CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

HERE = Path(__file__).resolve()
PHASES = (("init", 32), ("run", 512), ("eval", 32))


def held_per_node(run_pool: int) -> dict[str, int]:
    from rolloutd.daemons.phase import default_prefetch

    pools = {"init": 32, "run": run_pool, "eval": 32}
    return {p: n + default_prefetch(n) for p, n in pools.items()}


# ---- the generators (child processes) --------------------------------------------------------
def split_nodes(nodes: int, generators: int) -> list[tuple[int, int]]:
    """Consecutive node ranges [lo, hi), one per generator, sizes differing by at most one."""
    g = max(1, min(generators, nodes)) if nodes else 1
    bounds = [nodes * i // g for i in range(g + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(g)]


def generator(a):
    """Plays the init, run and eval daemons of nodes [node_lo, node_hi) of the simulated cluster.
    Node names, pids, fake job ids and request ids are global, so several generators together
    are one cluster to the head."""
    import zmq
    from rolloutd.bus import codec, events
    from rolloutd.bus.messages import PROTOCOL_VERSION, Lease, LeaseBatch, Release
    from rolloutd.daemons.router_client import BEHIND_S, HOLD_MAX_S, lease_member

    if a.lease_rows == "packed":  # as the run daemon sends them (daemons/lease_rows.py)
        from rolloutd.daemons.lease_rows import pack as lease_field
    else:
        def lease_field(rows):
            return rows

    g, lo, hi = a.gen_index, a.node_lo, a.node_hi
    nodes = hi - lo
    ctx = zmq.Context()
    held = held_per_node(a.run_pool)
    want = a.populate  # this generator's share of the jobs the bench submitted
    got: list[tuple[int, int]] = []
    if want:
        inbox = ctx.socket(zmq.DEALER)
        inbox.setsockopt(zmq.IDENTITY, f"init@gen{g}#{os.getpid()}".encode())
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.connect(a.init)
        last, announced = 0.0, 0
        deadline = time.monotonic() + a.populate_timeout
        # Until this generator has its share or the bench says the gateway handed out every job: a
        # receiver the gateway forgot for a moment (credit ttl) can be sent more than its share.
        while len(got) < want and time.monotonic() < deadline:
            if os.path.exists(a.populated_file):
                if not inbox.poll(500):  # what is still on its way
                    break
            now = time.monotonic()
            # The real receiver's protocol: free slots, count received. Also soon after a drain: the
            # gateway forgets a receiver whose pipe is full (its announcements bring it back), and this
            # one's credit, its whole share, fills a pipe in one turn of a fast gateway (every 0.3 s
            # alone, populating 1,000 nodes outlasted --populate-timeout).
            if now - last > 0.3 or (len(got) > announced and now - last > 0.02):
                inbox.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": want - len(got),
                                       "received": len(got), "info": {"node": f"gen{g}"}}))
                last, announced = now, len(got)
            if inbox.poll(100):
                while True:
                    try:
                        frames = inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    h = codec.unpack(frames[0].bytes)
                    got.append((h["job_id"], h["attempt"]))
        inbox.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": 0, "received": len(got),
                               "info": {"node": f"gen{g}"}}))
    fake = iter(range(10**12 + g * 10**10, 10**13))  # ids no generator was handed, disjoint per generator
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100000)
    pub.connect(a.events_in)
    router = ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.LINGER, 0)
    router.connect(a.router)
    # Bodies packed once per simulated daemon with sentinels for ts (float64) and jobs_seq (uint32),
    # patched per publish. protocol "full": every heartbeat lists every held job (before issue 16);
    # "changes": holders over daemon.full_listing_max list changes, a full listing every full_listing_s.
    ts_mark = b"\xcb" + struct.pack(">d", 1234567.0)
    seq_base = 1 << 31  # always packed as uint32, so it can be patched in place
    seq_mark = b"\xce" + struct.pack(">I", seq_base + 0x0ABCDE)

    def stamped(body):
        return dict(body, ts=1234567.0, jobs_seq=seq_base + 0x0ABCDE)

    def packed(body):
        """The packed body cut around each ts and jobs_seq (one pair per body: a node's message
        carries three), to be joined with the publish's values: ts, seq, ts, seq, ..."""
        raw = codec.pack(body)
        parts, at = [], 0
        for _ in range(raw.count(ts_mark)):
            i = raw.index(ts_mark, at) + 1
            j = raw.index(seq_mark, i) + 1
            parts += [raw[at:i], raw[i + 8:j]]
            at = j + 4
        assert parts and raw.count(seq_mark) == len(parts) // 2
        return tuple(parts + [raw[at:]])

    # Listings as the phase daemons send them (packed above events.PACK_MIN pairs), or as lists
    # (--listing list: the format before issue 29).
    enc = events.pack_listing if a.listing == "packed" else (lambda held: [[j, at] for j, at in held.items()])
    sims = []  # (full parts, change parts or None, run.leases event or None)
    ids = iter(got)
    churn = max(1, round(a.run_pool / a.job_s * a.hb_s))  # jobs entering and leaving run per heartbeat
    for n in range(lo, hi):
        node = f"sim{n:05d}"
        bodies = {}  # --per-node one: this node's three bodies, full and as changes
        for phase, pool in (("init", 32), ("run", a.run_pool), ("eval", 32)):
            jobs = [list(next(ids, None) or (next(fake), 1)) for _ in range(held[phase])]
            inc = f"{100000 + n}-{int(time.time() * 1000)}"
            body = {"daemon": phase, "node": node, "pid": 100000 + n, "incarnation": inc,
                    "uptime_s": 1.0, "phase": phase, "pool": pool, "inflight": min(pool, len(jobs)),
                    "counts": {"done": 0, "failed": 0, "timeout": 0, "cancelled": 0, "forwarded": 0, "malformed": 0}}
            full = dict(body, jobs=enc({j: at for j, at in jobs}))
            lease_ev = None  # run.leases, published with each full listing (before the heartbeat)
            if phase == "run":
                lease_ev = codec.pack({"daemon": "run", "node": node, "pid": 100000 + n, "ts": time.time(),
                                     "incarnation": inc,
                                     "leases": lease_field([[f"Lsim{n}-{i}", a.backend_id, j[0], 0]
                                                            for i, j in enumerate(jobs[:pool])])})
            change = None
            if a.protocol == "changes" and len(jobs) > 128:
                change = stamped(dict(body, jobs_added=enc({next(fake): 1 for _ in range(churn)}),
                                      jobs_removed=enc({next(fake): 1 for _ in range(churn)})))
            topic = events.heartbeat_topic(phase, node).encode() if a.hb_topics == "sender" else b"daemon.heartbeat"
            if a.per_node == "one":
                bodies[phase] = (stamped(full), change, lease_ev, topic)
                continue
            sims.append((packed(stamped(full)), None if change is None else packed(change), lease_ev, topic))
        if a.per_node == "one":  # the run daemon's heartbeat carries its node's init and eval ones (docs/EVENTS.md)
            carried = [bodies["init"][0], bodies["eval"][0]]  # <= 128 jobs: full listings every beat
            run_full, run_change, lease_ev, topic = bodies["run"]
            sims.append((packed(dict(run_full, carried=carried)),
                         None if run_change is None else packed(dict(run_change, carried=carried)), lease_ev, topic))
    full_every = max(1, round(5.0 / a.hb_s))
    per_round = sum((len(b"".join(f)) + len(ls or b"")) * (1 if c is None else 1 / full_every)
                    + (0 if c is None else len(b"".join(c)) * (1 - 1 / full_every)) + 12 for f, c, ls, _ in sims)
    hb_asked = len(sims) / a.hb_s
    lease_rate = nodes * a.run_pool / a.job_s
    # Each run daemon's leases once before the window, paced under the router's and the stream's
    # queues: the router adopts them (as after its restart) now, so the window measures the steady
    # state (renewals), not 2.56 million adoptions at 5,000 nodes.
    for i, (_, _, lease_ev, _) in enumerate(sims):
        if lease_ev is not None:
            pub.send_multipart([b"run.leases", lease_ev])
            if i % 200 == 199:
                time.sleep(0.05)
    tmp = Path(a.ready_file + ".tmp")  # renamed into place: the bench polls for the file and must not read it half-written
    tmp.write_text(json.dumps({"populated": min(len(got), nodes * sum(held.values())), "share": want, "got": len(got),
                               "wanted": nodes * sum(held.values()), "bytes_per_s": per_round / a.hb_s}))
    tmp.rename(a.ready_file)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    while not os.path.exists(a.go_file) and not stopped:  # every generator starts at once: one cluster
        time.sleep(0.02)
    slices = 20
    per_slice = max(1, -(-len(sims) // slices))
    # One member as RouterClient makes it, built directly per lease (the same dict, ~10x cheaper
    # than a Lease object per member at 85,000 leases/s); checked against lease_member here.
    r0, n0 = f"run@sim{lo:05d}", f"sim{lo:05d}"
    assert lease_member(Lease(job_id=7, requester=r0, node=n0, wait_s=0.0, req_id=9), r0, n0) == \
        {"job_id": 7, "wait_s": 0.0, "req_id": 9}, "lease_member changed: update the generator's members"
    published = 0
    made = leases = releases = msgs = granted = 0  # made: leases the schedule asked for so far
    qfull = router_refused = 0  # operations the router's full queue took not; leases the router answered with an error
    batched = a.lease_protocol == "batch"
    q_lease = [0] * max(1, nodes)            # per simulated run daemon: leases queued
    q_rel: list[list] = [[] for _ in range(max(1, nodes))]  # releases queued
    out: list = [None] * max(1, nodes)       # when its unanswered batch was sent
    last = [-1e9] * max(1, nodes)            # when its last batch was sent
    batch_node: dict[int, int] = {}
    batch_s = 0.0                              # as the router's batch replies set it
    dirty: set[int] = set()
    lease_carry = 0.0
    # Each generator's slices start a fraction of a slice after the previous one's: together
    # they spread the cluster's heartbeats over the second as one process would.
    t0 = time.monotonic() + a.hb_s / slices * g / max(1, a.generators)
    stop = t0 + a.duration
    k = 0
    req = g * 10**9  # request ids disjoint per generator
    samples = []  # cumulative counters over time: the bench takes its window's rates from them

    skipped = rounds_skipped = 0  # heartbeats (rounds) not sent because the loop was more than a round behind
    lag = [0.0]  # the loop's largest lag behind its schedule since the last sample

    def sample(now):
        samples.append([round(now, 4), published, made, leases, releases, granted, msgs, qfull, router_refused,
                        skipped, round(lag[0], 4)])
        lag[0] = 0.0

    slice_s = a.hb_s / slices
    while time.monotonic() < stop and not stopped:
        now = time.monotonic()
        behind = now - (t0 + k * slice_s)
        lag[0] = max(lag[0], behind)
        if behind > a.hb_s:  # stalled a round or more: skip whole rounds, as a daemon's heartbeat timer does (no burst)
            n_skip = int(behind / a.hb_s)
            k += n_skip * slices
            skipped += n_skip * len(sims)
            rounds_skipped += n_skip  # jobs_seq counts heartbeats sent: no gap for the gateway to see
        tick = t0 + k * slice_s
        k += 1
        rnd, sl = divmod(k - 1, slices)
        if sl == 0:  # at each round's start: between two samples, whole rounds of heartbeats
            sample(time.monotonic())
        ts = struct.pack(">d", time.time())
        seq = struct.pack(">I", seq_base + rnd + 1 - rounds_skipped)
        for i in range(sl * per_slice, min(len(sims), (sl + 1) * per_slice)):
            full, change, lease_ev, hb_topic = sims[i]
            whole = change is None or rnd % full_every == i % full_every
            parts = full if whole else change
            if len(parts) == 3:
                p0, p1, p2 = parts
                msg = p0 + ts + p1 + seq + p2
            else:  # a node's message: a ts and a seq per body
                msg = b"".join(part + (ts if k % 2 == 0 else seq) for k, part in enumerate(parts[:-1])) + parts[-1]
            try:
                if whole and lease_ev is not None:
                    pub.send_multipart([b"run.leases", lease_ev], zmq.NOBLOCK)
                pub.send_multipart([hb_topic, msg], zmq.NOBLOCK)
                published += 1
            except zmq.Again:
                pass
        lease_carry += lease_rate * a.hb_s / slices
        while lease_carry >= 1:
            lease_carry -= 1
            req += 1
            made += 1
            if batched:  # queued at its node (round robin over the nodes), sent with the node's next batch
                node = req % nodes
                q_lease[node] += 1
                dirty.add(node)
                continue
            try:
                router.send_multipart([b""] + codec.encode(Lease(job_id=req, requester="run@simlease", node="simlease",
                                                                  wait_s=0.0, req_id=req).to_wire()), zmq.NOBLOCK)
                leases += 1
                msgs += 1
            except zmq.Again:  # the router is not keeping up: its queue is full
                qfull += 1
        while router.poll(0):  # a grant is released at once: the lease's hold time is in the heartbeats
            frames = router.recv_multipart()
            h = codec.decode(frames[1:])
            if h.get("kind") == "error":  # a lease the router refused (or a batch it could not read)
                router_refused += 1
                batch_node.pop(h.get("req_id"), None)
                continue
            body = h.get("body") or {}
            if batched:
                node = batch_node.pop(h.get("req_id"), None)
                pace = body.get("batch_s")
                if isinstance(pace, (int, float)) and 0 <= pace <= HOLD_MAX_S:
                    batch_s = pace
                router_refused += len(body.get("errors") or ())
                if node is not None:
                    out[node] = None
                    gr = body.get("granted") or ()
                    granted += len(gr)
                    q_rel[node].extend(x["lease_id"] for x in gr)
                    dirty.add(node)
                elif "lease_id" in body:  # a member that waited, granted on its own: released with the next batch
                    granted += 1
                    node = (h.get("req_id") or 0) % nodes
                    q_rel[node].append(body["lease_id"])
                    dirty.add(node)
                continue
            if "lease_id" in body:
                granted += 1
                try:
                    router.send_multipart([b""] + codec.encode(Release(lease_id=body["lease_id"]).to_wire()), zmq.NOBLOCK)
                    releases += 1
                    msgs += 1
                except zmq.Again:
                    qfull += 1
        if batched:  # each node as RouterClient: at most one batch per batch_s (the router's), none while one is overdue (BEHIND_S..HOLD_MAX_S)
            now = time.monotonic()
            for node in list(dirty):
                o = out[node]
                if (o is not None and BEHIND_S < now - o < HOLD_MAX_S) or now - last[node] < batch_s:
                    continue
                dirty.discard(node)
                nl, rel = q_lease[node], q_rel[node]
                q_lease[node], q_rel[node] = 0, []
                members = []
                for _ in range(nl):
                    req += 1
                    members.append({"job_id": req, "wait_s": 0.0, "req_id": req})
                req += 1
                name = f"sim{lo + node:05d}"
                msg = LeaseBatch(requester=f"run@{name}", node=name, leases=members, releases=rel, req_id=req)
                try:
                    router.send_multipart([b""] + codec.encode(msg.to_wire()), zmq.NOBLOCK)
                    batch_node[req] = node
                    out[node] = last[node] = now
                    leases += nl
                    releases += len(rel)
                    msgs += 1
                except zmq.Again:
                    qfull += nl + len(rel)
        now = time.monotonic()
        delay = tick + a.hb_s / slices - now
        if delay > 0:
            time.sleep(delay)
    end = time.monotonic()
    sample(end)
    wall = end - t0
    print(json.dumps({"gen": g, "nodes": [lo, hi], "pid": os.getpid(), "wall_s": wall, "hb_skipped": skipped,
                      "lag_max_s": max(x[10] for x in samples),
                      "hb_per_s": published / wall, "hb_target_per_s": hb_asked,
                      "leases_target_per_s": lease_rate, "leases_made_per_s": made / wall,
                      "leases_per_s": leases / wall, "releases_per_s": releases / wall,
                      "granted_per_s": granted / wall, "lease_msgs_per_s": msgs / wall,
                      "refused": qfull + router_refused, "queue_full": qfull, "router_refused": router_refused,
                      "samples": samples}), flush=True)
    ctx.destroy(linger=0)


# ---- the head -------------------------------------------------------------------------------
class Head:
    """events, router and gateway as the launcher starts them (``rolloutd <daemon> --set ...``)."""

    def __init__(self, root: Path, port: int, sets: dict):
        self.root = root
        self.tmp = common.short_tmpdir("cp-")
        self.port = port
        self.sets = {"node": "head", "endpoints.head": "127.0.0.1", "endpoints.base_port": port,
                     "endpoints.runtime_dir": str(self.tmp / "run"), "logging.level": "warning", **sets}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []

    def _log(self, daemon: str):
        f = open(self.tmp / f"{daemon}.log", "w")  # noqa: SIM115 - the daemon's stdout until stop()
        self.logs.append(f)
        return f

    def addr(self, name: str) -> str:
        i = ["gateway", "gateway_results", "init", "router", "events_in", "events_out"].index(name)
        return f"tcp://127.0.0.1:{self.port + i}"

    def start(self):
        env, cwd = common.source_env(self.root)
        for name in ("events", "router", "gateway"):
            cmd = [sys.executable, "-m", "rolloutd.daemons.cli", name]
            for k, v in self.sets.items():
                cmd += ["--set", f"{k}={v}"]
            self.procs[name] = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                                stdout=self._log(name), stderr=subprocess.STDOUT,
                                                preexec_fn=common.die_with_parent)
        try:
            self.wait_for({"gateway", "router"})
        except BaseException:
            self.stop()  # a head that never came up must not outlive the bench
            raise
        return self

    def wait_for(self, daemons: set, timeout_s: float = 60.0):
        """Until the gateway has seen a heartbeat of each of ``daemons`` (the stream works)."""
        from rolloutd.gateway.client import GatewayTimeout, RolloutClient

        deadline = time.monotonic() + timeout_s
        with RolloutClient(self.addr("gateway"), timeout_s=1.0, retries=0) as c:
            while time.monotonic() < deadline:
                try:
                    if daemons <= {d.get("daemon") for d in c.status().get("daemons", [])}:
                        return
                except GatewayTimeout:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"head daemons {sorted(daemons)} not seen within {timeout_s}s")

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def stop(self):
        common.stop_procs(list(self.procs.values()), self.logs, wait_s=15)
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


def free_port_block(n: int = 6) -> int:
    import socket

    for _ in range(100):
        base = random.randint(20000, 60000)
        ok = True
        for i in range(n):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", base + i))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            return base
    raise RuntimeError("no free port block")


SHORT = 0.95  # a generator that delivered less than this share of what it was asked fell short


def auto_generators(nodes: int) -> int:
    """One generator per 1,000 nodes (one delivered 3,000 heartbeats/s and ~17,000 leases/s at
    1,000 nodes; one for 5,000 nodes delivered 8,435 of 15,000 heartbeats/s)."""
    return max(1, -(-nodes // 1000))


def window_rates(samples: list, w0: float, w1: float) -> dict | None:
    """Rates of a generator's cumulative counters between its first and last sample inside
    [w0, w1]: samples are taken at round starts, so the span holds whole rounds of heartbeats
    (monotonic clock, shared by every process of the machine). None if the window holds too few."""
    inside = [s for s in samples if w0 <= s[0] <= w1]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5 * (w1 - w0):
        return None
    a, b = inside[0], inside[-1]
    dt = b[0] - a[0]
    keys = ("hb", "leases_made", "leases", "releases", "granted", "lease_msgs", "queue_full", "router_refused", "hb_skipped")
    return {k: (b[i + 1] - a[i + 1]) / dt for i, k in enumerate(keys)} | {
        "span_s": round(dt, 2), "lag_max_s": max(s[10] for s in inside[1:])}


def generator_verdict(reports: list[dict], w0: float, w1: float) -> dict:
    """Asked vs delivered over the measured window, per generator and together; ``short`` and its
    reasons when the cluster was not offered the load the row names."""
    per, reasons = [], []
    tot = {"hb_target_per_s": 0.0, "hb_per_s": 0.0, "leases_target_per_s": 0.0, "leases_made_per_s": 0.0,
           "leases_per_s": 0.0, "releases_per_s": 0.0, "granted_per_s": 0.0, "lease_msgs_per_s": 0.0,
           "refused_per_s": 0.0, "hb_skipped_per_s": 0.0, "queue_full": 0, "router_refused": 0, "refused": 0}
    for r in reports:
        w = window_rates(r.get("samples") or [], w0, w1)
        if w is None:  # no samples around the window: the whole run's rates
            w = {"hb": r["hb_per_s"], "leases_made": r["leases_made_per_s"], "leases": r["leases_per_s"],
                 "releases": r["releases_per_s"], "granted": r["granted_per_s"], "lease_msgs": r["lease_msgs_per_s"],
                 "queue_full": 0.0, "router_refused": 0.0, "hb_skipped": r["hb_skipped"] / r["wall_s"], "span_s": None,
                 "lag_max_s": r["lag_max_s"]}
        row = {"gen": r["gen"], "nodes": r["nodes"], "hb_target_per_s": r["hb_target_per_s"], "hb_per_s": w["hb"],
               "leases_target_per_s": r["leases_target_per_s"], "leases_made_per_s": w["leases_made"],
               "leases_per_s": w["leases"], "releases_per_s": w["releases"], "granted_per_s": w["granted"],
               "lease_msgs_per_s": w["lease_msgs"], "refused_per_s": w["queue_full"] + w["router_refused"],
               "hb_skipped_per_s": w["hb_skipped"], "lag_max_s": w["lag_max_s"], "window_s": w["span_s"]}
        per.append(row)
        for k in tot:
            if k in row:
                tot[k] += row[k]
        for k in ("queue_full", "router_refused", "refused"):
            tot[k] += r.get(k, 0)
    tot["lag_max_s"] = max((r["lag_max_s"] for r in per), default=0.0)
    hb_share = tot["hb_per_s"] / tot["hb_target_per_s"] if tot["hb_target_per_s"] else 1.0
    lease_share = tot["leases_made_per_s"] / tot["leases_target_per_s"] if tot["leases_target_per_s"] else 1.0
    if not reports:
        reasons.append("no generator report")
    if hb_share < SHORT:
        reasons.append(f"heartbeats {tot['hb_per_s']:,.0f} of {tot['hb_target_per_s']:,.0f}/s ({hb_share:.0%}; "
                       f"{tot['hb_skipped_per_s']:,.0f}/s skipped, up to {tot['lag_max_s']:.2f} s behind schedule)")
    if lease_share < SHORT:
        reasons.append(f"leases made {tot['leases_made_per_s']:,.0f} of {tot['leases_target_per_s']:,.0f}/s ({lease_share:.0%})")
    return {**tot, "hb_share": hb_share, "lease_share": lease_share, "short": bool(reasons),
            "short_reasons": reasons, "per_generator": per}


def gateway_heard(st: dict, hb_s: float) -> dict:
    """How many simulated daemons the gateway had heard from within 3 heartbeat periods, from the
    status taken right after the window (``age_s`` is the age of the last heartbeat it handled)."""
    ages = [d.get("age_s", 1e9) for d in st.get("daemons") or () if str(d.get("node", "")).startswith("sim")]
    return {"sim_daemons": len(ages), "current": sum(1 for x in ages if x <= 3 * hb_s),
            "oldest_s": round(max(ages), 2) if ages else None}


def wait_adopted(client, want: int, timeout_s: float) -> float | None:
    """Seconds until the router holds ``want`` leases (the generators' run.leases, adopted), or
    None (printed) when it did not within ``timeout_s``: the window then includes adoptions."""
    t0 = time.monotonic()
    held = 0
    while time.monotonic() - t0 < timeout_s:
        try:
            held = client.list_backends().get("leases") or 0
        except Exception:  # noqa: BLE001 - a busy router: ask again
            pass
        if held >= want:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    print(f"  (the router held {held:,} of {want:,} simulated leases after {timeout_s:.0f} s: the window includes adoptions)")
    return None


def run_size(a, nodes: int, backend, protocol: str = "changes", lease_protocol: str = "batch",
             per_node: str = "three") -> dict:
    from rolloutd.gateway.client import GatewayTimeout, RolloutClient

    head = Head(Path(a.root), free_port_block(), {"daemon.heartbeat_s": a.hb_s,
                # Populating a full cluster takes longer than a lease: jobs handed out early must not
                # expire before their first heartbeat. The sweep's cost per job does not depend on it.
                "gateway.lease_timeout_s": 3600,
                # The generator shares two loaded cores with the head: when it falls seconds behind,
                # its daemons must not be presumed dead (a mass loss is measured apart, not by accident).
                "gateway.daemon_dead_s": a.dead_s}).start()
    gens: list[subprocess.Popen] = []
    try:
        client = RolloutClient(head.addr("gateway"), timeout_s=30.0)
        client.add_backend(backend.url)
        backend_id = ""
        for _ in range(100):
            bl = client.status().get("backends") or []
            if bl:
                backend_id = bl[0]["id"]
                break
            time.sleep(0.1)
        held = sum(held_per_node(a.run_pool).values())
        want = min(nodes * held, a.populate_max)
        ranges = split_nodes(nodes, a.generators or auto_generators(nodes)) if nodes else []
        shares = [want * hi // nodes - want * lo // nodes for lo, hi in ranges] if nodes else []  # populate_max split by nodes
        env = common.source_env(a.root)[0]
        go, populated = head.tmp / "go", head.tmp / "populated"
        readies = []
        for g, ((lo, hi), share) in enumerate(zip(ranges, shares)):
            readies.append(head.tmp / f"gen{g}.json")
            gens.append(subprocess.Popen(
                [sys.executable, str(HERE), "--_gen", "--gen-index", str(g), "--generators", str(len(ranges)),
                 "--node-lo", str(lo), "--node-hi", str(hi), "--run-pool", str(a.run_pool), "--populate", str(share),
                 "--populate-timeout", str(a.populate_timeout), "--init", head.addr("init"),
                 "--events-in", head.addr("events_in"), "--router", head.addr("router"),
                 "--ready-file", str(readies[-1]), "--go-file", str(go), "--populated-file", str(populated),
                 "--backend-id", backend_id, "--hb-s", str(a.hb_s),
                 "--job-s", str(a.job_s), "--protocol", protocol, "--listing", a.listing, "--lease-protocol", lease_protocol,
                 "--lease-rows", a.lease_rows, "--hb-topics", a.hb_topics, "--per-node", per_node,
                 "--duration", str(a.seconds + a.warmup + 30)],
                env=env, stdout=subprocess.PIPE, text=True, preexec_fn=common.die_with_parent))
        t_pop = time.monotonic()
        left = want
        while left > 0:  # submits of 4096-job tasks, 64 tasks a request
            tasks = []
            while left > 0 and len(tasks) < 64:
                n = min(4096, left)
                tasks.append({"handler": "synthetic_llm", "instance": {"llm_calls": 1}, "n": n})
                left -= n
            client.submit(tasks)
        give_up = time.monotonic() + a.populate_timeout + 120  # each generator stops populating at populate_timeout
        while not all(r.exists() for r in readies):
            if any(p.poll() is not None for p in gens):
                raise RuntimeError("a generator exited early")
            if time.monotonic() > give_up:
                raise TimeoutError(f"generators not ready after {a.populate_timeout + 120:.0f} s")
            if not populated.exists():
                try:
                    st = client.status()
                    if not st.get("queued") and (st.get("dispatched") or 0) >= want:  # every job handed out
                        populated.write_text("done")
                except GatewayTimeout:
                    pass
            time.sleep(0.2)
        infos = [json.loads(r.read_text()) for r in readies]
        uneven = [(g, i["got"], i["share"]) for g, i in enumerate(infos) if i["got"] != i["share"]]
        if uneven:
            print(f"  (populate: generator(s) got another share of the jobs than asked, (generator, got, share): {uneven})")
        adopt_s = wait_adopted(client, nodes * a.run_pool, a.populate_timeout)
        go.write_text("go")
        populate_s = time.monotonic() - t_pop
        time.sleep(a.warmup)
        gen_pids = {f"gen{g}": p.pid for g, p in enumerate(gens)}
        meter = common.CpuMeter({**head.pids(), **gen_pids}).start()
        w0 = time.monotonic()
        # the head and one generator (the others do the same work; py-spy on each would load the cores)
        prof = common.pyspy_start({**head.pids(), **dict(list(gen_pids.items())[:1])}, a.seconds,
                                  Path(a.profile) / str(nodes)) if a.profile else []
        sub, pol = [], []
        lost = 0
        probe = RolloutClient(head.addr("gateway"), timeout_s=a.probe_timeout, retries=0)
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            for xs in (sub, pol):
                t = time.perf_counter()
                try:
                    if xs is sub:
                        probe.submit([{"handler": "synthetic_llm", "instance": {"llm_calls": 1}}])
                    else:
                        probe.poll(wait_s=0.0)
                except GatewayTimeout:  # counted at the timeout: a p99 must not hide a request never answered
                    lost += 1
                    probe.close()
                    probe = RolloutClient(head.addr("gateway"), timeout_s=a.probe_timeout, retries=0)
                xs.append((time.perf_counter() - t) * 1000)
                time.sleep(0.025)
        probe.close()
        meter.stop()
        w1 = time.monotonic()
        util = meter.utilisation()
        util["generator"] = sum(util.pop(k, 0.0) for k in gen_pids)  # all generators together
        profile = common.pyspy_report(prof) if prof else {}
        try:
            st = client.status()
        except GatewayTimeout:
            st = {}
        gstats = {"dispatched": st.get("dispatched"), "queued": st.get("queued"),
                  "redispatched": (st.get("totals") or {}).get("redispatched", 0)}
        client.close()
        for p in gens:
            p.send_signal(signal.SIGTERM)
        reports = []
        for g, p in enumerate(gens):
            gout = ""
            try:
                gout = p.communicate(timeout=30)[0]
                reports.append(json.loads(gout.strip().splitlines()[-1]))
            except (subprocess.TimeoutExpired, IndexError, ValueError) as e:
                print(f"  (generator {g}'s report unreadable: {type(e).__name__}: {gout[-500:]})")
        verdict = generator_verdict(reports, w0, w1) if nodes else {"short": False, "short_reasons": [], "per_generator": []}
        if nodes and len(reports) < len(gens):
            verdict["short"] = True
            verdict["short_reasons"].append(f"{len(gens) - len(reports)} of {len(gens)} generator reports missing")
        out = {"nodes": nodes, "protocol": protocol, "lease_protocol": lease_protocol, "lease_rows": a.lease_rows, "hb_topics": a.hb_topics, "per_node": per_node,
               "populated": sum(i["populated"] for i in infos), "held": sum(i["wanted"] for i in infos),
               "hb_mb_per_s": sum(i["bytes_per_s"] for i in infos) / 1e6, "populate_s": round(populate_s, 1), "adopt_s": adopt_s,
               "generators": len(gens),
               "cpu": {k: round(v, 4) for k, v in util.items()},
               "cpu_generators": {k: round(v, 4) for k, v in meter.utilisation().items() if k in gen_pids},
               "submit_ms": {"p50": common.percentile(sub, 50), "p99": common.percentile(sub, 99), "n": len(sub)},
               "poll_ms": {"p50": common.percentile(pol, 50), "p99": common.percentile(pol, 99), "n": len(pol)},
               "unanswered": lost,
               "gateway": gstats, "gateway_heard": gateway_heard(st, a.hb_s), "load": common.loadavg(), "profile": profile,
               "generator": {k: v for k, v in verdict.items() if k != "per_generator"},
               "generator_short": verdict["short"],
               "per_generator": verdict["per_generator"]}
        return out
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        head.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", default=None, help="comma list (default 100,1000,5000; quick 100)")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--run-pool", type=int, default=512)
    ap.add_argument("--job-s", type=float, default=30.0, help="run-phase length: one lease per job")
    ap.add_argument("--hb-s", type=float, default=1.0)
    ap.add_argument("--dead-s", type=float, default=30.0, help="gateway.daemon_dead_s for the run")
    ap.add_argument("--protocol", default=None,
                    help="heartbeat listings to measure: changes (current daemons), full (every job, every beat); "
                         "default changes,full (quick: changes)")
    ap.add_argument("--listing", default="packed", choices=("packed", "list"),
                    help="listing encoding: packed (current daemons, issue 29) or list (before)")
    ap.add_argument("--lease-protocol", default="batch",
                    help="router lease traffic, comma list: batch (lease_batch per node per tick, as RouterClient; issue 29) "
                         "or single (one message per lease and per release: before)")
    ap.add_argument("--lease-rows", default="packed", choices=("packed", "list"),
                    help="run.leases rows: packed (current run daemons, issue 40) or list (before; a --root tree "
                         "older than packed rows reads only list)")
    ap.add_argument("--hb-topics", default="sender", choices=("sender", "plain"),
                    help="heartbeat topic frames: sender (daemon.heartbeat/<daemon>@<node>/, current daemons) or "
                         "plain (daemon.heartbeat: before; a --root tree older than sender topics reads only plain)")
    ap.add_argument("--per-node", default=None,
                    help="heartbeat messages per node, comma list: three (each daemon its own, current daemons), one "
                         "(the run daemon's carrying its node's init and eval heartbeats, docs/EVENTS.md `carried`); "
                         "default three, quick three,one")
    ap.add_argument("--probe-timeout", type=float, default=5.0, help="a probe unanswered this long counts as lost")
    ap.add_argument("--populate-max", type=int, default=700_000)
    ap.add_argument("--populate-timeout", type=float, default=240.0)
    ap.add_argument("--root", default=str(common.REPO))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG of head CPU and poll p99 per size and listing protocol")
    ap.add_argument("--replot", nargs="*", default=None, help="only plot these --json files (merged) to --plot")
    ap.add_argument("--profile", default=None, help="py-spy the head daemons during each window into this dir")
    ap.add_argument("--generators", type=int, default=0,
                    help="load generator processes per size, the nodes split between them (default: one per 1,000 nodes)")
    # generator mode
    ap.add_argument("--_gen", action="store_true", help=argparse.SUPPRESS)
    for k in ("--init", "--events-in", "--router", "--ready-file", "--go-file", "--populated-file", "--backend-id"):
        ap.add_argument(k, default="", help=argparse.SUPPRESS)
    for k in ("--gen-index", "--node-lo", "--node-hi", "--populate"):
        ap.add_argument(k, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=60.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._gen:
        return generator(a)
    if a.replot:
        rows = [r for f in a.replot for r in json.loads(Path(f).read_text())["rows"]]
        return plot(rows, a.plot or str(common.IMG_DIR / "scale_control_plane.png"))
    sizes = [int(x) for x in (a.nodes or ("100" if a.quick else "100,1000,5000")).split(",")]
    a.seconds = a.seconds or (4.0 if a.quick else 20.0)
    a.protocol = a.protocol or ("changes" if a.quick else "changes,full")
    a.per_node = a.per_node or ("three,one" if a.quick else "three")
    if set(a.per_node.split(",")) - {"three", "one"}:
        ap.error(f"--per-node takes three and/or one, not {a.per_node!r}")
    from rolloutd.backends.scripted import ScriptedBackend

    print(f"control plane: sizes {sizes}, {a.seconds:.0f} s windows, heartbeat {a.hb_s} s, {a.listing} listings, run pool {a.run_pool}, "
          f"tree {common.revision(a.root)}, {common.machine()}, load {common.loadavg()}", flush=True)
    rows = []
    with ScriptedBackend() as backend:
        for n, proto, lp, pn in [(0, "changes", "batch", "three")] + [
                (n, p, lp, pn) for n in sizes for p in a.protocol.split(",") for lp in a.lease_protocol.split(",")
                for pn in a.per_node.split(",")]:
            r = run_size(a, n, backend, proto, lp, pn)
            rows.append(r)
            c = r["cpu"]
            g = r.get("generator", {})
            # Per operation, from /proc: the gateway's CPU above the 0-node row per heartbeat received,
            # the router's per lease or release answered (bench_head_cpu.py measures both in process).
            idle = rows[0]["cpu"] if rows[0] is not r else {}
            hb, ops = g.get("hb_per_s") or 0, (g.get("leases_per_s") or 0) + (g.get("releases_per_s") or 0)
            r["per_op_us"] = {
                "gateway_per_hb": (c.get("gateway", 0) - idle.get("gateway", 0)) * 1e6 / hb if hb else None,
                # per node-second: the same unit for --per-node three and one (a message per daemon or per node)
                "gateway_per_node_s": (c.get("gateway", 0) - idle.get("gateway", 0)) * 1e6 * a.hb_s / n if n else None,
                "router_per_lease_op": (c.get("router", 0) - idle.get("router", 0)) * 1e6 / ops if ops else None}
            heard = r["gateway_heard"]
            # Per operation *offered*: a daemon that is behind handled fewer, so its figure is then too low.
            r["behind"] = {"gateway": bool(n) and heard["current"] < SHORT * heard["sim_daemons"],
                           "router": bool(n) and (g.get("granted_per_s") or 0) < SHORT * (g.get("leases_per_s") or 0)}
            per_op = "".join(f" {k} {v:.0f} us" + (" (behind: per op offered, not handled)" if r["behind"][k.split("_")[0]] else "")
                             for k, v in r["per_op_us"].items() if v is not None)
            print(f"  {n:>5} nodes, {proto:>7} listings, {lp} leases, {pn} heartbeat message(s) per node ({r['held']:,} held jobs, {r['populated']:,} in the gateway, "
                  f"{r['hb_mb_per_s']:.1f} MB/s of heartbeats): gateway {c.get('gateway', 0):.1%} "
                  f"router {c.get('router', 0):.1%} events {c.get('events', 0):.1%} of a core | "
                  f"submit p50/p99 {r['submit_ms']['p50']:.1f}/{r['submit_ms']['p99']:.1f} ms, "
                  f"poll p50/p99 {r['poll_ms']['p50']:.1f}/{r['poll_ms']['p99']:.1f} ms, {r['unanswered']} unanswered | "
                  f"redispatched {r['gateway'].get('redispatched')} |{per_op or ' -'} | load {r['load']}", flush=True)
            if n:
                print(f"         load offered by {r['generators']} generator(s), {c.get('generator', 0):.1%} of a core, "
                      f"delivered / asked over the window: heartbeats {g['hb_per_s']:,.0f} / {g['hb_target_per_s']:,.0f} per s "
                      f"({g['hb_share']:.0%}), leases {g['leases_made_per_s']:,.0f} / {g['leases_target_per_s']:,.0f} per s "
                      f"({g['lease_share']:.0%}; {g['leases_per_s']:,.0f} leases + {g['releases_per_s']:,.0f} releases/s sent "
                      f"in {g['lease_msgs_per_s']:,.0f} msgs/s, {g['granted_per_s']:,.0f} leases/s granted), up to {g['lag_max_s']:.2f} s behind schedule | refused: {g['queue_full']} by the router's full queue, "
                      f"{g['router_refused']} by the router | gateway heard {heard['current']:,} of "
                      f"{heard['sim_daemons']:,} simulated daemons within {3 * a.hb_s:g} s (oldest {heard['oldest_s']} s)", flush=True)
            if r["behind"]["router"]:  # not a refusal, and worse: the leases sent were left unanswered
                print(f"  !! ROUTER BEHIND at {n} nodes: it granted {g['granted_per_s']:,.0f} of the {g['leases_per_s']:,.0f} "
                      f"leases/s sent and refused none; the rest were unanswered in the window", flush=True)
            if r["behind"]["gateway"]:
                print(f"  !! GATEWAY BEHIND at {n} nodes: it had heard {heard['current']:,} of {heard['sim_daemons']:,} "
                      f"simulated daemons within {3 * a.hb_s:g} s; its last handled heartbeats were up to "
                      f"{heard['oldest_s']} s old", flush=True)
            if r["generator_short"]:
                print(f"  !! GENERATOR SHORT at {n} nodes: {'; '.join(g['short_reasons'])}. The head was not offered "
                      f"{n} nodes' load: this row does not judge it (more --generators, or fewer other processes).", flush=True)
    short = [f"{r['nodes']} nodes ({r['protocol']}, {r['lease_protocol']})" for r in rows if r["generator_short"]]
    print(f"generators short of the asked load in: {', '.join(short)}" if short
          else f"generators delivered >= {SHORT:.0%} of the asked heartbeats and leases in every row", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "args": {k: v for k, v in vars(a).items()}}, indent=1))
    if a.plot:
        plot(rows, a.plot)


def plot(rows, path):
    plt = common.plt()
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    for proto, mark in (("full", "s--"), ("changes", "o-")):
        rs = sorted((r for r in rows if r["nodes"] and r.get("protocol", "full") == proto), key=lambda r: r["nodes"])
        if not rs:
            continue
        ns = [r["nodes"] for r in rs]
        for d in ("gateway", "router"):
            ax[0].plot(ns, [r["cpu"].get(d, 0) for r in rs], mark, label=f"{d}, {proto} listings")
        ax[1].plot(ns, [min(r["poll_ms"]["p99"], 5000) for r in rs], mark, label=f"poll p99, {proto} listings")
        for r in rs:  # a row whose generators fell short did not get the load its size names
            if r.get("generator_short"):
                ax[1].annotate("generator short", (r["nodes"], min(r["poll_ms"]["p99"], 5000)), fontsize=6)
    ax[0].axhline(0.2, color="grey", lw=0.8, ls=":")
    ax[1].axhline(50, color="grey", lw=0.8, ls=":")
    for x in ax:
        x.set_xscale("log")
        x.set_xlabel("simulated nodes (x 648 held jobs)")
        x.legend(fontsize=7)
    ax[0].set_ylabel("CPU, fraction of one core")
    ax[1].set_ylabel("ms")
    ax[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
