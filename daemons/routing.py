"""The router's state: LLM backends, their in-flight leases, and the lease policy.

Pure Python with no sockets, so the policy can be tested and benchmarked on its own.
``least_inflight`` picks the backend with the lowest in-flight load relative to its
capacity and weight, breaking ties fairly (round-robin among equals) and preferring the
requester's node when loads are within ``node_affinity``. ``least_load`` is the same, counting
besides this router's leases the requests the server reports beyond them (``external``: other
clients of a shared server, read from its ``/metrics`` after each health check; docs/BENCHMARKS.md,
"Router on real vLLM servers"). ``round_robin`` is what the reference paper's code shipped (a counter
per job, never decremented), kept for comparison.

A backend joins (or re-joins, when registered again) *pending*: it gets no lease until a
health check has passed (``mark(id, True)``). A job's ``exclude`` list (backends that
failed it) is a preference: an excluded backend serves the job again when no other
candidate is healthy and free, which it only is after the router re-admitted it.

Versions: a new lease goes only to a backend whose ``policy_version`` is within ``max_policy_lag``
of the newest registered one (pending ones count: registering a version announces it). Older
backends keep the leases they hold (jobs finishing under ``stale_policy = "finish"``) and drain.
"""
from __future__ import annotations

import dataclasses
import itertools
import time


@dataclasses.dataclass
class Backend:
    address: str
    api: str = "vllm"
    policy_version: int = 0
    capacity: int = 0          # max concurrent jobs; 0 = unbounded
    weight: float = 1.0
    node: str = ""
    healthy: bool = False     # pending until a health check passes
    checked: bool = False      # a health check has passed since it was (re)registered
    inflight: int = 0
    leases_total: int = 0
    failures: int = 0          # consecutive failed checks or reported errors
    load_signal: float = 0.0   # requests running + waiting on the server, from its /metrics (health checks)
    external: float = 0.0      # of those, the ones beyond this router's leases when they were read

    @property
    def id(self) -> str:
        return self.address

    def full(self) -> bool:
        return self.capacity > 0 and self.inflight >= self.capacity

    def load(self, external: bool = False) -> float:
        denom = (self.capacity if self.capacity > 0 else 1.0) * self.weight
        return (self.inflight + self.external) / denom if external else self.inflight / denom

    def public(self) -> dict:
        return {"id": self.id, "address": self.address, "api": self.api, "policy_version": self.policy_version,
                "capacity": self.capacity, "weight": self.weight, "node": self.node, "healthy": self.healthy,
                "checked": self.checked, "inflight": self.inflight, "leases_total": self.leases_total,
                "load_signal": self.load_signal}


@dataclasses.dataclass
class LeaseRecord:
    lease_id: str
    backend_id: str
    job_id: int
    requester: str
    policy_version: int
    created: float
    renewed: float


class NoBackend(Exception):
    """No backend is registered (as opposed to all being busy)."""


class Pool:
    def __init__(self, policy: str = "least_inflight", node_affinity: float = 0.1, lease_prefix: str = "L",
                 max_policy_lag: int = 0):
        if policy not in ("least_inflight", "least_load", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r} (least_inflight, least_load, round_robin)")
        self.policy = policy
        self.node_affinity = node_affinity
        self.max_policy_lag = int(max_policy_lag)
        self._newest = 0  # newest policy_version registered: kept on add/clear, read on every pick
        self.backends: dict[str, Backend] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self._ids = itertools.count(1)
        self._rr = 0
        self.lease_prefix = lease_prefix  # unique per router incarnation, so adopted ids never collide
        self._released: dict[str, None] = {}  # adopted leases released since (bounded), never re-adopted
        # Renewal by set (``vouch``): the leases each requester holds here, and per requester the time
        # of its last listing and the leases held here that it left out. Every other lease it held
        # then counts as renewed at that time, without touching its record (nor keeping the ids).
        self._held_by: dict[str, set] = {}
        self._vouched: dict[str, tuple[float, set]] = {}

    # -- membership ------------------------------------------------------------------------
    def add(self, address: str, **fields) -> Backend:
        b = self.backends.get(address)
        if b is None:
            b = self.backends[address] = Backend(address=address, **fields)
            # Leases granted before a clear (a checkpoint swap to the same server) still run
            # there and will be released against this entry: count them.
            b.inflight = sum(1 for r in self.leases.values() if r.backend_id == address)
        else:  # re-adding updates its settings (e.g. a new policy_version) and keeps its leases
            for k, v in fields.items():
                setattr(b, k, v)
            # A re-registered server (reloaded weights, restarted) serves again once a check passes.
            b.healthy, b.checked, b.failures = False, False, 0
        self._newest = self.current_version()
        return b

    def clear(self, address: str | None = None) -> list[str]:
        """Remove backends; their live leases stay valid until released (jobs finish)."""
        gone = [a for a in self.backends if address is None or a == address]
        for a in gone:
            del self.backends[a]
        self._newest = self.current_version()
        return gone

    def current_version(self) -> int:
        return max((b.policy_version for b in self.backends.values()), default=0)

    # -- leasing ---------------------------------------------------------------------------
    def candidates(self, exclude=()) -> list[Backend]:
        oldest = self._newest - self.max_policy_lag  # older servers only drain what they hold
        return [b for b in self.backends.values()  # b.full() inlined: this runs for every lease
                if b.healthy and not (b.capacity > 0 and b.inflight >= b.capacity) and b.id not in exclude
                and b.policy_version >= oldest]

    def too_old(self) -> list[Backend]:
        """Backends past the lag bound: no new lease until re-registered at a newer version."""
        oldest = self._newest - self.max_policy_lag
        return [b for b in self.backends.values() if b.policy_version < oldest]

    def pick(self, node: str = "", exclude=()) -> Backend | None:
        if not self.backends:
            raise NoBackend("no LLM backend is registered")
        # Exclusion is a preference: a backend that failed this job but was re-admitted since
        # (healthy again) serves it when nothing else can, instead of the job waiting forever.
        cands = self.candidates(exclude) or (self.candidates() if exclude else [])
        if not cands:
            return None
        if self.policy == "round_robin":
            ordered = list(self.backends.values())
            for i in range(len(ordered)):
                b = ordered[(self._rr + i) % len(ordered)]
                if b in cands:
                    self._rr = (self._rr + i + 1) % len(ordered)
                    return b
            return None
        ext = self.policy == "least_load"
        loads = [b.load(ext) for b in cands]  # once per backend per pick (a batch picks many)
        best = min(loads)
        near = [(x, b) for x, b in zip(loads, cands) if b.node == node and x <= best + self.node_affinity] if node else None
        if near:
            best = min(x for x, _ in near)
            close = [b for x, b in near if x <= best + 1e-12]
        else:
            close = [b for x, b in zip(loads, cands) if x <= best + 1e-12]
        # Fair tie-break: rotate through equals instead of always taking the first.
        self._rr += 1
        return close[self._rr % len(close)]

    def lease(self, job_id: int, requester: str = "", node: str = "", exclude=()) -> LeaseRecord | None:
        b = self.pick(node, exclude)
        if b is None:
            return None
        b.inflight += 1
        b.leases_total += 1
        now = time.monotonic()
        rec = LeaseRecord(f"{self.lease_prefix}{next(self._ids)}", b.id, job_id, requester, b.policy_version, now, now)
        self.leases[rec.lease_id] = rec
        self._hold(rec)
        return rec

    def _hold(self, rec: LeaseRecord):
        held = self._held_by.get(rec.requester)
        if held is None:
            held = self._held_by[rec.requester] = set()
        held.add(rec.lease_id)

    def release(self, lease_id: str) -> bool:
        rec = self.leases.pop(lease_id, None)
        if rec is None:
            return False
        held = self._held_by.get(rec.requester)
        if held is not None:
            held.discard(lease_id)
            if not held:  # requesters are free strings from clients: keep no empty entries
                del self._held_by[rec.requester]
        if not self._minted_here(lease_id):
            self._released[lease_id] = None
            while len(self._released) > 65536:
                self._released.pop(next(iter(self._released)))
        b = self.backends.get(rec.backend_id)
        if b is not None:
            b.inflight = max(0, b.inflight - 1)
        return True

    def adopt(self, lease_id: str, backend_id: str, job_id: int, requester: str, policy_version: int):
        """Re-create a lease a run daemon reports holding (after a router restart). A heartbeat is
        a snapshot that may arrive after the lease it lists was released: a lease this router
        granted, or one it adopted and saw released, is never re-created."""
        if (lease_id in self.leases or backend_id not in self.backends or self._minted_here(lease_id)
                or lease_id in self._released):
            return
        now = time.monotonic()
        rec = self.leases[lease_id] = LeaseRecord(lease_id, backend_id, job_id, requester, policy_version, now, now)
        self._hold(rec)
        self.backends[backend_id].inflight += 1

    def _minted_here(self, lease_id: str) -> bool:
        return lease_id.startswith(self.lease_prefix) and lease_id[len(self.lease_prefix):].isdigit()

    def vouch(self, requester: str, listed: set, now: float | None = None) -> set:
        """``requester`` lists the leases it holds (its ``run.leases`` event): each lease it holds
        here and listed counts as renewed now. Set operations, not a walk of the rows: 512 rows per
        event, ~1,000 events a second at 5,000 nodes (docs/SCALING.md, section 7). Returns the listed
        ids it does not hold here (to adopt after a router restart, or released meanwhile)."""
        now = time.monotonic() if now is None else now
        held = self._held_by.get(requester) or set()
        unlisted = held - listed  # granted after its snapshot, or lost on its side: their own clocks run
        prev = self._vouched.get(requester)
        if prev is not None and unlisted:
            t0, before = prev
            for lid in unlisted - before:  # held at t0 and not left out then: last renewed at t0
                rec = self.leases[lid]
                if rec.created <= t0 and rec.renewed < t0:
                    rec.renewed = t0
        self._vouched[requester] = (now, unlisted)
        return listed - held

    def expire(self, ttl_s: float, now: float | None = None) -> list[LeaseRecord]:
        """Release leases not renewed for ``ttl_s``: their run daemon died (or lost them). A
        requester that listed within ``ttl_s`` renews what it listed; only the leases it left out
        are looked at one by one."""
        now = time.monotonic() if now is None else now
        dead = []
        leases = self.leases
        for requester, held in self._held_by.items():
            v = self._vouched.get(requester)
            if v is not None and now - v[0] <= ttl_s:
                dead.extend(r for r in (leases.get(lid) for lid in v[1])
                            if r is not None and r.requester == requester and now - r.renewed > ttl_s)
                continue
            t0, unlisted = v if v is not None else (0.0, ())
            for lid in held:  # a silent requester: what it listed last was renewed at t0
                r = leases[lid]
                if now - (r.renewed if lid in unlisted else max(r.renewed, t0)) > ttl_s:
                    dead.append(r)
        for r in dead:
            self.release(r.lease_id)
        for requester in [k for k, v in self._vouched.items() if now - v[0] > ttl_s and k not in self._held_by]:
            del self._vouched[requester]
        return dead

    def observe(self, backend_id: str, running: float, waiting: float) -> None:
        """The server's own count of requests (running + waiting, from its ``/metrics``): what it
        holds beyond this router's leases is load from elsewhere (a lease is at most one request
        at a time for the built-in loop; a harness job with concurrent calls counts its extra ones)."""
        b = self.backends.get(backend_id)
        if b is not None:
            b.load_signal = float(running) + float(waiting)
            b.external = max(0.0, b.load_signal - b.inflight)

    def mark(self, backend_id: str, healthy: bool) -> bool:
        """Record a health outcome; returns True when the backend changed state."""
        b = self.backends.get(backend_id)
        if b is None or b.healthy == healthy:
            if b is not None and healthy:
                b.failures = 0
            return False
        b.healthy = healthy
        b.failures = 0
        b.checked = b.checked or healthy
        return True
