"""The router daemon: owns the LLM backends and their in-flight load.

Run daemons lease a backend for a whole job (prefix-cache affinity) over a DEALER socket
and release it when the job leaves the run phase. When every backend is at capacity a
lease request waits (bounded by its ``wait_s``), and so does one that arrives while no
backend is registered at all (a restarted router before the gateway registered them again,
a trainer that submits before it registers). A new or re-registered backend is pending until
its first health check passes, which runs at once. Leases are renewed by the run daemons'
``run.leases`` events (with each full heartbeat listing), which list the leases they hold: a
dead run daemon's leases expire, and a restarted router rebuilds its view from those events. Lease requests waiting here when
the router dies are re-sent by their run daemons when they see the new router.

With ``router.shards`` = K > 1 this is one of K such processes (``--shard``): shard i is the daemon
"router" (i = 0) or "router{i}", listens on its own address, is given the backends whose address
hashes to it and serves the run daemons of the nodes that hash to it, and reads only those nodes'
``run.leases`` (docs/SCALING.md, "Router shards").
"""
from __future__ import annotations

import asyncio
import time

import httpx

from rolloutd.bus import codec, events
from rolloutd.bus.messages import Error, Lease, MessageError, Reply, check_fields, from_wire
from rolloutd.bus.sockets import InWaiter, recv_now, send_now
from rolloutd.bus.config import ConfigError
from rolloutd.bus.daemon import Daemon
from rolloutd.bus.endpoints import router_bind_address, router_name, shard_of
from rolloutd.daemons import lease_rows
from rolloutd.daemons.routing import NoBackend, Pool
from rolloutd.llm.client import parse_prometheus

# Lease messages a second the router asks its run daemons to stay under, together: each batch reply
# says how long its daemon should gather before the next (active daemons / budget, at most
# BATCH_S_MAX). One daemon, or a few, send at once (latency matters, messages are few); at 1,000
# nodes each sends every 0.25 s (docs/SCALING.md: ~30 us of router CPU per message).
LEASE_MSG_BUDGET = 4000.0
BATCH_S_MAX = 0.25

KINDS = ("lease", "lease_batch", "release", "backend_failed", "add_llm_server", "clear_llm_server", "list_llm_servers")


class Router(Daemon):
    name = "router"
    freeze_after_full_gc = True  # its table of jobs / leases (bus/daemon.py)

    def __init__(self, cfg, shard: int = 0):
        self.shards = int(cfg.section("router")["shards"])
        if not 0 <= shard < self.shards:
            raise ConfigError(f"router shard {shard} does not exist: router.shards = {self.shards} (shards 0..{self.shards - 1})")
        self.shard = shard
        self.name = router_name(shard)  # before the base: its logger, heartbeat topic and keys use it
        super().__init__(cfg)
        self.rcfg = cfg.section("router")
        self.mine: dict[str, bool] = {}  # node -> its run daemon leases here (shards > 1)
        self.pool = Pool(self.rcfg["policy"], float(self.rcfg["node_affinity"]), lease_prefix=f"L{self.incarnation}-",
                         max_policy_lag=int(self.rcfg["max_policy_lag"]))
        self.waiters: list[tuple[float, list, object]] = []
        self.out: list = []
        self.checks: set[asyncio.Task] = set()  # first checks of newly registered backends
        # Lease traffic counters (heartbeat and list_llm_servers): messages vs operations in them.
        self.requesters: dict = {}  # requester (or DEALER identity) -> last batch: the daemons sharing the budget
        self.batch_s = 0.0
        self.stats = {"lease_msgs": 0, "batches": 0, "batched_leases": 0, "batched_releases": 0,
                      "max_batch": 0, "granted_later": 0}

    async def setup(self):
        self.front = self.sockets.bind("ROUTER", router_bind_address(self.cfg.endpoints, self.shard), hwm=10000)
        self.watch = self.sockets.connect("SUB", "events_out", subscribe=[b"run.leases"], hwm=10000)
        self.http = httpx.AsyncClient(timeout=2.0)

    def heartbeat(self):
        return {"policy": self.pool.policy, "backends": [b.public() for b in self.pool.backends.values()],
                "leases": len(self.pool.leases), "waiting": len(self.waiters),
                "current_version": self.pool.current_version(), "lease_traffic": dict(self.stats),
                **({"shard": self.shard, "shards": self.shards} if self.shards > 1 else {})}

    async def serve(self):
        health = asyncio.create_task(self._health_loop())
        waiter = InWaiter((self.front, self.watch))
        ttl = float(self.rcfg["lease_ttl_s"])
        last_expire = time.monotonic()
        try:
            while not self.stopping:
                await waiter.wait(100)
                for _ in range(512):
                    frames = recv_now(self.front)
                    if frames is None:
                        break
                    self._on_request(frames)
                for _ in range(512):
                    frames = recv_now(self.watch)
                    if frames is None:
                        break
                    event = events.parse(frames)
                    if event is not None:
                        self._on_heartbeat(event[1])
                self._serve_waiters()
                now = time.monotonic()
                if now - last_expire > 1.0:
                    last_expire = now
                    self._pace(now)
                    for rec in self.pool.expire(ttl):
                        self.log.warning("lease_expired", lease_id=rec.lease_id, backend=rec.backend_id,
                                         job_id=rec.job_id, requester=rec.requester)
                self._flush()
        finally:
            health.cancel()

    def _pace(self, now: float):
        """The interval batch replies ask for: the run daemons heard from in the last 5 s share
        ``LEASE_MSG_BUDGET`` messages a second."""
        self.requesters = {k: t for k, t in self.requesters.items() if now - t < 5.0}
        self.batch_s = min(BATCH_S_MAX, len(self.requesters) / LEASE_MSG_BUDGET)

    def _flush(self):
        for frames in self.out:  # a ROUTER without ROUTER_MANDATORY drops, never refuses (bus/sockets.py)
            send_now(self.front, frames)
        self.out.clear()

    def _reply(self, route, req_id, **body):
        self.out.append(route + codec.encode(Reply(req_id=req_id, body=body).to_wire()))

    def _error(self, route, req_id, code, message):
        self.out.append(route + codec.encode(Error(code=code, message=message, req_id=req_id).to_wire()))

    def _on_request(self, frames):
        route = [frames[0].bytes]
        rest = frames[1:]
        if rest and len(rest[0]) == 0:
            route.append(b"")
            rest = rest[1:]
        try:
            msg = from_wire(codec.decode(rest), expect=KINDS)
            getattr(self, f"_op_{msg.KIND}")(route, msg)
        except (codec.CodecError, MessageError) as e:  # req_id read only here: ~10% of a lease (bench_head_cpu)
            self._error(route, codec.peek_req_id(rest), getattr(e, "code", "malformed"), str(e))
        except Exception as e:  # noqa: BLE001 - the router stays up
            self.log.error("request_failed", error=f"{type(e).__name__}: {e}")
            self._error(route, codec.peek_req_id(rest), "internal", f"{type(e).__name__}: {e}")

    def _pick(self, msg):
        """A lease for ``msg`` (a ``Lease``) now, or None when it must wait."""
        try:
            return self.pool.lease(msg.job_id, msg.requester, msg.node, msg.exclude)
        except NoBackend:
            return None  # held: backends may be registered any moment (after a router restart)

    def _grant_body(self, rec) -> dict:
        b = self.pool.backends[rec.backend_id]
        return {"lease_id": rec.lease_id, "backend_id": b.id, "address": b.address, "api": b.api,
                "policy_version": b.policy_version}

    def _load(self, b):
        self.events.publish("backend.load", backend=b.id, inflight=b.inflight, capacity=b.capacity,
                            healthy=b.healthy, policy_version=b.policy_version)

    def _grant(self, route, msg) -> bool:
        rec = self._pick(msg)
        if rec is None:
            return False
        self._reply(route, msg.req_id, **self._grant_body(rec))
        self._load(self.pool.backends[rec.backend_id])
        return True

    def _op_lease(self, route, msg):
        self.stats["lease_msgs"] += 1
        if not self._grant(route, msg):
            self.waiters.append((time.monotonic() + msg.wait_s, route, msg))

    def _op_lease_batch(self, route, msg):
        """A run daemon's releases and lease requests of one tick (docs/PROTOCOL.md, router requests):
        releases first (a slot freed in the batch serves its leases), each lease picked as a single
        ``lease`` is (least in flight, updated grant by grant), one reply for the batch and one
        ``backend.load`` per backend touched. A lease that must wait is answered later on its own,
        with its member ``req_id``, exactly as a single ``lease`` that waited."""
        st = self.stats
        st["lease_msgs"] += 1
        now = time.monotonic()
        who = msg.requester or route[0]
        new = who not in self.requesters
        self.requesters[who] = now
        if new and len(self.requesters) % 64 == 0:  # many daemons starting at once: pace before the sweep
            self._pace(now)
        st["batches"] += 1
        st["batched_leases"] += len(msg.leases)
        st["batched_releases"] += len(msg.releases)
        st["max_batch"] = max(st["max_batch"], len(msg.leases) + len(msg.releases))
        touched = {}
        released = 0
        leases, backends = self.pool.leases, self.pool.backends
        for lid in msg.releases:
            rec = leases.get(lid)
            if self.pool.release(lid):
                released += 1
                b = backends.get(rec.backend_id)
                if b is not None:
                    touched[b.id] = b
        granted, waiting, errors = [], [], []
        for i, d in enumerate(msg.leases):
            try:
                lm = Lease(**check_fields(Lease, d, f"lease_batch.leases[{i}]"))
                lm.validate()
            except MessageError as e:
                rid = d.get("req_id")
                errors.append([rid if rid.__class__ is int else 0, e.code, e.message])
                continue
            lm.requester = lm.requester or msg.requester
            lm.node = lm.node or msg.node
            rec = self._pick(lm)
            if rec is None:
                self.waiters.append((now + lm.wait_s, route, lm))
                waiting.append(lm.req_id)
                continue
            body = self._grant_body(rec)
            body["req_id"] = lm.req_id
            granted.append(body)
            touched[rec.backend_id] = backends[rec.backend_id]
        self._reply(route, msg.req_id, granted=granted, waiting=waiting, errors=errors, released=released,
                    batch_s=self.batch_s)
        for b in touched.values():
            self._load(b)

    def _serve_waiters(self):
        if not self.waiters:
            return
        now = time.monotonic()
        keep = []
        for deadline, route, msg in self.waiters:
            if self._grant(route, msg):
                self.stats["granted_later"] += 1
                continue
            if now >= deadline:
                why = ("no LLM backend is registered" if not self.pool.backends
                       else "every backend within max_policy_lag of the newest version is at capacity or unhealthy")
                self._error(route, msg.req_id, "unavailable", f"{why} (waited {msg.wait_s:g}s)")
            else:
                keep.append((deadline, route, msg))
        self.waiters = keep

    def _op_release(self, route, msg):
        self.stats["lease_msgs"] += 1
        rec = self.pool.leases.get(msg.lease_id)
        ok = self.pool.release(msg.lease_id)
        if rec is not None and rec.backend_id in self.pool.backends:
            self._load(self.pool.backends[rec.backend_id])
        self._reply(route, msg.req_id, released=ok)

    def _op_backend_failed(self, route, msg):
        self.pool.release(msg.lease_id)
        if self.pool.mark(msg.backend_id, False):
            self.log.warning("backend_out_of_rotation", backend=msg.backend_id, error=msg.error[:300])
            self.events.publish("backend.health", backend=msg.backend_id, healthy=False, error=msg.error[:300])
        self._reply(route, msg.req_id, ok=True)

    def _op_add_llm_server(self, route, msg):
        b = self.pool.add(msg.address, api=msg.api, policy_version=msg.policy_version, capacity=msg.capacity,
                          weight=msg.weight, node=msg.node)
        self.log.info("backend_added", backend=b.id, api=b.api, policy_version=b.policy_version, capacity=b.capacity)
        self.events.publish("backend.added", **b.public())
        self._reply(route, msg.req_id, backend=b.public())
        # Pending until a check passes: check now rather than at the next health round.
        t = asyncio.get_running_loop().create_task(self._first_check(b))
        self.checks.add(t)
        t.add_done_callback(self.checks.discard)

    async def _first_check(self, b):
        ok = await self._check(b)
        if self.pool.backends.get(b.id) is b:
            self._checked(b, ok, limit=1 << 30)  # a failed first check only leaves it pending
            self._serve_waiters()
            self._flush()
            if ok:
                await self._observe(b)

    def _op_clear_llm_server(self, route, msg):
        gone = self.pool.clear(msg.address)
        self.log.info("backends_cleared", backends=gone)
        self.events.publish("backend.cleared", backends=gone)
        self._reply(route, msg.req_id, cleared=gone)

    def _op_list_llm_servers(self, route, msg):
        self._reply(route, msg.req_id, backends=[b.public() for b in self.pool.backends.values()],
                    policy=self.pool.policy, leases=len(self.pool.leases), lease_traffic=dict(self.stats))

    def _on_heartbeat(self, hb: dict):
        """A run daemon's ``run.leases``: renew what it lists, adopt what this router does not hold."""
        if hb.get("daemon") != "run":
            return
        if self.shards > 1:  # another shard's node: its leases are not held here (nor adopted)
            node = hb.get("node")
            if node.__class__ is not str:  # a malformed stamp: nobody's node
                return
            mine = self.mine.get(node)
            if mine is None:
                mine = self.mine[node] = shard_of(node, self.shards) == self.shard
                if len(self.mine) > 100_000:  # node names are few; a flood of made-up ones is not kept
                    self.mine.clear()
            if not mine:
                return
        listed = lease_rows.unpack(hb.get("leases"))
        if listed is None:
            return
        requester = f"run@{hb.get('node')}"
        others = self.pool.vouch(requester, set(listed.ids))
        leases, pos = self.pool.leases, None
        for lid in others:  # few: leases released since its snapshot, or all of them after a restart
            if lid in leases:
                continue  # another requester's: not renewed by this one
            if pos is None:
                pos = {x: i for i, x in enumerate(listed.ids)}
            row = listed.row(pos[lid])
            if row is not None:
                self.pool.adopt(lid, row[0], row[1], requester, row[2])

    async def _health_loop(self):
        interval = float(self.rcfg["health_interval_s"])
        limit = int(self.rcfg["health_failures"])
        while True:
            await asyncio.sleep(interval)
            backends = list(self.pool.backends.values())
            results = await asyncio.gather(*(self._check(b) for b in backends), return_exceptions=True)
            for b, ok in zip(backends, results):
                if self.pool.backends.get(b.id) is b:  # not cleared or replaced meanwhile
                    self._checked(b, ok is True, limit)
            await asyncio.gather(*(self._observe(b) for b, ok in zip(backends, results) if ok is True),
                                 return_exceptions=True)

    def _checked(self, b, ok: bool, limit: int):
        """Apply one health check's outcome to backend ``b``."""
        if ok:
            first = not b.checked
            if self.pool.mark(b.id, True):
                self.log.info("backend_admitted" if first else "backend_readmitted", backend=b.id)
                self.events.publish("backend.health", backend=b.id, healthy=True)
            b.failures = 0
        else:
            b.failures += 1
            if b.failures >= limit and self.pool.mark(b.id, False):
                self.log.warning("backend_out_of_rotation", backend=b.id, failed_checks=limit)
                self.events.publish("backend.health", backend=b.id, healthy=False, error="health checks failed")

    async def _check(self, b) -> bool:
        path = "/health" if b.api == "vllm" else "/health_generate"
        try:
            r = await self.http.get(b.address.rstrip("/") + path)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _observe(self, b):
        """The server's own load (running + waiting requests from its ``/metrics``): ``least_load``
        routes by it, ``list_llm_servers`` shows it. Advisory: a server without ``/metrics`` is
        still healthy. Read after the health check, so it never delays an admission."""
        try:
            m = await self.http.get(b.address.rstrip("/") + "/metrics")
            if m.status_code == 200:
                g = parse_prometheus(m.text)
                self.pool.observe(b.id, g.get("num_requests_running", 0.0), g.get("num_requests_waiting", 0.0))
        except httpx.HTTPError:
            pass

    async def teardown(self):
        for t in list(self.checks):
            t.cancel()
        for _, route, msg in self.waiters:
            self._error(route, msg.req_id, "unavailable", "the router is stopping")
        self._flush()
        await self.http.aclose()
