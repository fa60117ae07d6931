"""init, run and eval: one daemon class, three phases.

Each pulls jobs only while it has a free slot (its pool), runs its phase of the job's
handler under the job's remaining budget, and pushes the job on: init -> run -> eval ->
gateway. A job that fails, times out or is cancelled goes straight to the gateway as a
well-formed result, and its sandbox is destroyed where it stands.

Stopping (SIGTERM) drains: no new job starts; jobs not yet started (the prefetched backlog,
and any that arrive while the stop is announced upstream) are handed back to the gateway at
once, which runs them again elsewhere without counting an attempt; jobs in flight finish
within ``daemon.drain_s`` and move on as usual; what is still running at the deadline is
abandoned (``daemon.abandoned``) and re-dispatched.
"""
from __future__ import annotations

import asyncio
import collections
import inspect
import os
import time
from collections.abc import Awaitable

from rolloutd.bus import codec
from rolloutd.bus.credit import CreditReceiver, CreditSender
from rolloutd.bus.daemon import Daemon
from rolloutd.bus.endpoints import router_address, router_name, shard_of
from rolloutd.bus.events import HeldJobs, base_topic, heartbeat_topic, pack_listing
from rolloutd.bus.messages import Job, MessageError, Result, empty_trajectory, from_wire
from rolloutd.bus.sockets import SUBSCRIBE as _SUBSCRIBE
from rolloutd.bus.sockets import recv, recv_now, send_now
from rolloutd.daemons import lease_rows
from rolloutd.daemons.deadlines import deadlines
from rolloutd.daemons.llm_session import StaleLease
from rolloutd.handlers.base import JobContext, PhaseTimeout, Services
from rolloutd.handlers.registry import UnknownHandler, get_handler

NEXT = {"init": "run", "run": "eval", "eval": None}


def default_prefetch(pool: int) -> int:
    """``[phase] prefetch`` when unset: pool/8, at least 2. An upstream slot that finishes while
    this phase is full keeps its job (backpressure), so the backlog is the buffer between two
    phases: with one, a second finish within one phase time blocks a slot upstream, and
    variable phase times lose 3-5% of a small pool (docs/BENCHMARKS.md, overlap)."""
    return max(2, pool // 8)


CANCEL_MEMORY = 100_000  # cancelled ids remembered, for jobs still in a pipe


class PhaseDaemon(Daemon):
    phase = ""

    def __init__(self, cfg):
        self.name = self.phase
        super().__init__(cfg)
        self.pool = int(cfg.section(self.phase)["pool"])
        pf = int(cfg.section(self.phase).get("prefetch", -1))
        # Jobs accepted beyond the pool wait here for a slot: the next job is already on this side
        # when a slot frees, instead of one credit round trip (announce, send) later.
        self.prefetch = default_prefetch(self.pool) if pf < 0 else pf
        self.backlog: collections.deque = collections.deque()  # Job messages accepted, not yet started
        self.inflight: dict[int, tuple[int, asyncio.Task]] = {}
        self.cancelled: dict[int, None] = {}
        self.why_cancelled: dict[int, str] = {}  # job id -> "cancelled" | "stale" | "requeue"
        self.started: set[int] = set()  # jobs whose _process has begun (a cancel then lands inside its try)
        self.counts = {"done": 0, "failed": 0, "timeout": 0, "cancelled": 0, "forwarded": 0, "malformed": 0}
        self.services = Services(self._make_runtime)

    def _make_runtime(self):
        from rolloutd.sandbox import get_runtime

        sb = self.cfg.section("sandbox")
        opts = {"disk_quota": sb["disk_quota"], "disk_pool": sb["disk_pool"]}
        if sb["runtime"] in ("auto", "bwrap"):  # auto drops it again if it falls back to local
            opts["shm_size_mb"] = int(sb["shm_size_mb"])
            opts["uid_range"] = sb["uid_range"]
        return get_runtime(sb["runtime"], root_dir=self.cfg.sandbox_root(), **opts)

    async def setup(self):
        s = self.sockets
        ident = f"{self.phase}@{self.node}#{self.incarnation}".encode()
        self.inbox = s.connect("DEALER", self.phase, hwm=1000, identity=ident)
        self.receiver = CreditReceiver(self.inbox, self.pool, info={"node": self.node})
        nxt = NEXT[self.phase]
        self.outbox = CreditSender(s.bind("ROUTER", nxt, hwm=1000)) if nxt else None
        self._waiting: collections.deque = collections.deque()  # (frames, future): hand-offs waiting for credit
        self.push_results = s.connect("PUSH", "gateway_results", hwm=1000)
        self.control = s.connect("SUB", "events_out", subscribe=[b"control."], hwm=10000)

    def heartbeat(self):
        hb = {"phase": self.phase, "pool": self.pool, "inflight": len(self.inflight), "counts": dict(self.counts)}
        hb.update(self._listing())
        return hb

    def _listing(self) -> dict:
        """The held jobs: whole when few or when a full listing is due, else the changes since the
        previous heartbeat (at 1,000 nodes x 512 slots whole lists cost the gateway more than a core;
        docs/SCALING.md). ``jobs_seq`` lets a reader see a dropped heartbeat and wait for the next whole one."""
        held = {j: a for j, (a, _) in self.inflight.items()}
        for job in self.backlog:
            held[job.job_id] = job.attempt
        now = time.monotonic()
        self._jobs_seq = getattr(self, "_jobs_seq", 0) + 1
        prev = getattr(self, "_listed", None)
        out = {"jobs_seq": self._jobs_seq}
        if (prev is None or len(held) <= int(self.dcfg["full_listing_max"])
                or now - self._listed_at >= float(self.dcfg["full_listing_s"])):
            out["jobs"] = pack_listing(held)  # packed above PACK_MIN jobs (docs/EVENTS.md)
            self._listed_at = now
        else:
            out["jobs_added"] = pack_listing({j: a for j, a in held.items() if prev.get(j) != a})
            out["jobs_removed"] = pack_listing({j: a for j, a in prev.items() if held.get(j) != a})
        self._listed = held
        return out

    async def serve(self):
        side = [asyncio.create_task(self._control_loop())]
        if self.outbox is not None:
            side.append(asyncio.create_task(self._credit_loop()))
        poll_s = float(self.dcfg["poll_s"])
        try:
            while not self.stopping:
                self.receiver.update(self._free())
                frames = await recv(self.inbox, poll_s)
                while frames is not None:
                    self._accept(frames)
                    frames = recv_now(self.inbox)
            self.receiver.update(0, force=True)  # draining: send nothing more here
            await self._drain()
        finally:
            for t in side:
                t.cancel()

    async def _credit_loop(self):
        """Announcements from the next phase's daemon(s) arrive on the outbox."""
        while True:
            frames = await recv(self.outbox.sock, 0.5)
            while frames is not None:
                if not self.outbox.on_message(frames):
                    self.counts["malformed"] += 1
                    self.log.warning("malformed_credit_dropped")
                frames = recv_now(self.outbox.sock)
            self.outbox.expire()
            self._pump()

    def _pump(self):
        """Send waiting hand-offs in arrival order while the next phase has credit."""
        w = self._waiting
        while w:
            frames, fut = w[0]
            if fut.done():  # its job was cancelled while it waited
                w.popleft()
                continue
            if self.outbox.send(frames) is None:
                return
            w.popleft()
            fut.set_result(None)

    def _accept(self, frames):
        received = time.time()
        try:
            job = from_wire(codec.decode(frames), expect=("job",))
        except (codec.CodecError, MessageError) as e:
            self.counts["malformed"] += 1
            self.log.warning("malformed_job_dropped", error=str(e), code=getattr(e, "code", "malformed"))
            self.events.publish("error.malformed", phase=self.phase, error=str(e))
            return
        self.receiver.got()
        if len(self.inflight) < self.pool and not self.stopping:
            self._start(job, received)
        else:
            self.backlog.append(job)

    def _start(self, job, received):
        task = asyncio.create_task(self._process(job, received))
        self.inflight[job.job_id] = (job.attempt, task)

    def _free(self) -> int:
        if self.stopping:  # a slot freed by the drain must not invite more work
            return 0
        return self.pool + self.prefetch - len(self.inflight) - len(self.backlog)

    async def _process(self, job: Job, received: float):
        # No await between here and the try below: once this line ran, a cancel is caught there.
        # A task cancelled before its first step would die before any try (and keep its slot for
        # ever), so _control_loop only cancels started tasks; others see self.cancelled below.
        self.started.add(job.job_id)
        t0 = time.monotonic()
        if job.sent_at:
            job.timing["queue"] = round(job.timing.get("queue", 0.0) + max(0.0, received - job.sent_at), 6)
        ctx = JobContext(job, self.services)
        ctx.phase = self.phase
        handler = None
        outcome = "ok"
        try:
            if job.job_id in self.cancelled:
                raise asyncio.CancelledError()  # cancelled while it waited in a pipe
            handler = get_handler(job.handler, self.cfg.section("handlers"))
            limit = self._limit(job)
            await self.before_phase(ctx, handler)
            await self._run_phase(handler, ctx, limit)
        except (asyncio.CancelledError, StaleLease) as e:
            outcome = self.why_cancelled.pop(job.job_id, "cancelled")
            if isinstance(e, StaleLease):
                outcome = "requeue" if self.cfg.section("router")["stale_policy"] in ("abort_requeue", "continue") else "stale"
            if outcome == "stale":
                ctx.fail(self.phase, StalePolicy("the policy version moved on past max_policy_lag"), status="failed")
                ctx.trajectory["stale"] = True
                outcome = "failed"
            else:
                ctx.fail(self.phase, JobCancelled(f"cancelled during {self.phase}"), status="cancelled")
        except UnknownHandler as e:
            outcome = "failed"
            ctx.fail(self.phase, e)
        except Exception as e:  # noqa: BLE001 - a handler bug becomes a failed result, never a dead worker
            outcome = "timeout" if isinstance(e, PhaseTimeout) else "failed"
            try:
                getattr(handler, f"{self.phase}_exception")(ctx, e)
            except Exception as hook_error:  # noqa: BLE001
                ctx.fail(self.phase, hook_error)
            if ctx.trajectory["status"] == "ok":  # a hook that swallowed the failure still fails the job
                ctx.fail(self.phase, e, "timeout" if isinstance(e, PhaseTimeout) else "failed")
            outcome = ctx.trajectory["status"]
        finally:
            cleanup = self.after_phase(ctx)
            if cleanup is not None:  # a task for nothing to free cost the slot two loop turns
                await _to_completion(cleanup)  # a late cancel must not skip the hand-off
            elapsed = time.monotonic() - t0
            job.timing[self.phase] = round(job.timing.get(self.phase, 0.0) + elapsed, 6)
            job.spent_s += elapsed
        try:
            await self._hand_off(job, ctx, handler, outcome)
        except asyncio.CancelledError:  # cancelled while waiting for a slot downstream
            ctx.fail(self.phase, JobCancelled(f"cancelled after {self.phase}"), status="cancelled")
            await self._hand_off(job, ctx, handler, "cancelled")
        except Exception as e:  # noqa: BLE001
            self._job_log(job).error("hand_off_failed", error=f"{type(e).__name__}: {e}")
        finally:
            self.started.discard(job.job_id)
            self.inflight.pop(job.job_id, None)
            if self.backlog and not self.stopping:
                self._start(self.backlog.popleft(), time.time())  # its wait in the backlog counts as queue
            self.receiver.update(self._free())

    async def before_phase(self, ctx: JobContext, handler) -> None:
        """Set up per-job services for the phase (the run daemon leases an LLM backend)."""

    def after_phase(self, ctx: JobContext) -> Awaitable | None:
        """What frees what ``before_phase`` set up, however the phase ended: an awaitable run to
        its end, or None when there is nothing to free."""
        return None

    def _limit(self, job: Job) -> float | None:
        limits = []
        if job.budget_s is not None:
            limits.append(max(0.0, job.budget_s - job.spent_s))
        per_phase = job.phase_limits.get(self.phase)
        if per_phase:
            limits.append(float(per_phase))
        return min(limits) if limits else None

    async def _run_phase(self, handler, ctx: JobContext, limit: float | None):
        fn = getattr(handler, self.phase)
        coro = fn(ctx) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, ctx)
        if limit is None:
            await coro
            return
        if limit <= 0:
            coro.close()
            raise PhaseTimeout(self.phase, 0.0)
        deadline = deadlines().arm(limit)
        try:
            await coro
        except asyncio.CancelledError:
            if deadline.expired():
                raise PhaseTimeout(self.phase, limit) from None
            raise
        finally:
            # The limit's cancellation can be swallowed inside the handler (3.11's wait_for
            # returns a result that is done at that moment): the phase ran out all the same.
            timed_out = deadline.expired()
        if timed_out:
            raise PhaseTimeout(self.phase, limit)

    def _job_log(self, job: Job):
        """The daemon's logger bound to ``job``: made when a line is written (a bind is ~2.5 us,
        every job paid it and almost none logs)."""
        return self.log.bind(job_id=job.job_id, attempt=job.attempt, handler=job.handler)

    async def _hand_off(self, job: Job, ctx: JobContext, handler, outcome: str):
        nxt = NEXT[self.phase]
        finished = outcome != "ok" or nxt is None
        if finished or (self.phase == "run" and handler is not None and not handler.eval_needs_sandbox):
            await self._destroy_sandbox(job)
        if not finished:
            job.node = self.node
            # The job keeps its slot here until the next phase has one: that is the backpressure.
            job.sent_at = time.time()  # waiting for a downstream slot counts as queue time
            frames = codec.encode(job.to_wire())  # once, however long it waits
            if self._waiting or self.outbox.send(frames) is None:
                # Queue behind earlier hand-offs; _pump sends it when credit arrives. (Waking every
                # waiting task on each announcement, each re-encoding its job, cost O(waiting) per credit.)
                fut = asyncio.get_running_loop().create_future()
                self._waiting.append((frames, fut))
                await fut
            self.counts["forwarded"] += 1
            return
        if outcome == "requeue":
            # Run again from scratch on the new policy: the gateway re-dispatches it (attempt + 1).
            ctx.trajectory["requeue_cause"] = "stale policy version (abort_requeue)"
            ctx.trajectory["stale"] = True  # counts against max_attempts (a handed-back job does not)
            msg = Result(job_id=job.job_id, attempt=job.attempt, trajectory=ctx.trajectory, node=self.node, requeue=True)
            await self._send_result(msg)
            return
        traj = handler.final_result(ctx) if handler is not None else ctx.trajectory
        traj["timing"] = dict(job.timing)
        traj["node"] = self.node
        status = traj["status"]
        self.counts["done" if status == "ok" else status] += 1
        if status != "ok":
            self._job_log(job).info("job_failed", status=status, phase=traj["failed_phase"], error=traj["error"])
        msg = Result(job_id=job.job_id, attempt=job.attempt, trajectory=traj, node=self.node)
        await self._send_result(msg)

    async def _send_result(self, msg: Result) -> None:
        frames = codec.encode(msg.to_wire())
        # At once when the pipe has room (a zmq.asyncio send makes a Future even then: 5% of the
        # eval daemon at the pipeline benchmark's load); else wait in line as a Future, as before.
        if not send_now(self.push_results, frames):
            await self.push_results.send_multipart(frames, copy=False)

    async def _destroy_sandbox(self, job: Job):
        if not job.sandbox:
            return
        handle = job.sandbox
        job.sandbox = None
        try:
            from rolloutd.sandbox import SandboxHandle

            rt = self.services.runtime()
            await asyncio.to_thread(rt.destroy, SandboxHandle.from_dict(handle))
        except Exception as e:  # noqa: BLE001 - the janitor reaps what this misses
            self._job_log(job).warning("sandbox_destroy_failed", error=f"{type(e).__name__}: {e}")

    async def _control_loop(self):
        """Cancels arrive on the events stream (topic control.cancel) from the gateway."""
        while True:
            frames = await recv(self.control, 1.0)
            if frames is None:
                continue
            try:
                topic = base_topic(frames[0].bytes)  # a heartbeat's frame also names its sender
                body = codec.unpack(frames[1].bytes)
                if topic == "control.relist":
                    self._relist_asked(body)
                    continue
                if topic != "control.cancel":
                    self.on_control(topic, body)
                    continue
                ids = [int(j) for j in body.get("job_ids", [])]
            except Exception as e:  # noqa: BLE001
                self.log.warning("malformed_control_dropped", error=str(e))
                continue
            for jid in ids:
                if jid in self.cancelled:
                    continue  # a repeated cancel must not interrupt the clean-up of the first
                self.cancelled[jid] = None
                held = self.inflight.get(jid)
                if held is not None and jid in self.started:
                    held[1].cancel()
            if self.backlog and any(j.job_id in self.cancelled for j in self.backlog):
                # Prefetched jobs do not wait for a slot to learn they were cancelled.
                keep = collections.deque()
                for job in self.backlog:
                    if job.job_id in self.cancelled:
                        self._start(job, time.time())
                    else:
                        keep.append(job)
                self.backlog = keep
            while len(self.cancelled) > CANCEL_MEMORY:
                self.cancelled.pop(next(iter(self.cancelled)))

    def _relist_asked(self, body: dict):
        """A reader saw a gap in this incarnation's heartbeats: the next one lists every held job."""
        if (body.get("holder"), body.get("holder_node"), body.get("incarnation")) == (
                self.name, self.node, self.incarnation):
            self._listed = None
            self.log.info("full_listing_requested", by=body.get("daemon"))

    def on_control(self, topic: str, body: dict):
        """Other events this daemon subscribed to."""

    async def _hand_back(self):
        """Return jobs that never started here to the gateway (stopping): the backlog, and jobs
        sent before the sender saw our zero credit. Each goes back as a requeue result: run
        again elsewhere, from init, as a new attempt that does not count against max_attempts."""
        frames = recv_now(self.inbox)
        while frames is not None:  # accepted into the backlog: nothing starts while stopping
            self._accept(frames)
            frames = recv_now(self.inbox)
        if not self.backlog:
            return
        jobs = list(self.backlog)
        self.backlog.clear()
        for job in jobs:
            await self._destroy_sandbox(job)  # init made it; the next attempt makes its own
            traj = job.trajectory or empty_trajectory(job.job_id, job.instance_id, job.sample_index)
            traj["requeue_cause"] = f"handed back unstarted by {self.phase}@{self.node}, which is stopping"
            msg = Result(job_id=job.job_id, attempt=job.attempt, trajectory=traj, node=self.node, requeue=True)
            await self._send_result(msg)
        self.log.info("backlog_handed_back", jobs=[[j.job_id, j.attempt] for j in jobs])

    async def _drain(self):
        deadline = time.monotonic() + float(self.dcfg["drain_s"])
        await self._hand_back()
        if self.inflight:
            self.log.info("draining", inflight=len(self.inflight))
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            await self._hand_back()
        # A job sent just before the sender saw our zero credit may still be crossing.
        frames = await recv(self.inbox, 0.1)
        if frames is not None:
            self._accept(frames)
        await self._hand_back()
        abandoned = [[j, a] for j, (a, _) in self.inflight.items()]
        for _, task in list(self.inflight.values()):
            task.cancel()
        if abandoned:
            # The gateway re-dispatches these at once instead of waiting for their lease to lapse.
            self.log.warning("drain_deadline_passed", abandoned=len(abandoned))
            self.events.publish("daemon.abandoned", phase=self.phase, jobs=abandoned, incarnation=self.incarnation)


async def _to_completion(aw):
    """Await ``aw`` to its end even if the awaiting task is cancelled meanwhile (clean-up that
    must finish: releasing the LLM lease); the cancel is absorbed."""
    fut = asyncio.ensure_future(aw)
    while True:
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.done():
                return fut.result()
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()


class JobCancelled(Exception):
    pass


class StalePolicy(Exception):
    pass


class InitDaemon(PhaseDaemon):
    """The init phase, plus the node's sandbox janitor.

    The janitor destroys sandboxes that no daemon of this node holds: the job finished, was
    cancelled, or its holder crashed. A sandbox must be unheld in two scans in a row (and be
    older than the grace period) before it goes, so one in a hand-off is never touched.
    """

    phase = "init"

    @staticmethod
    def heartbeat_topics(node: str) -> list[bytes]:
        """The janitor's: this node's run and eval heartbeats, not the cluster's (docs/EVENTS.md)."""
        return [heartbeat_topic(d, node).encode() for d in ("run", "eval")]

    async def setup(self):
        await super().setup()
        for t in self.heartbeat_topics(self.node):
            self.control.setsockopt(_SUBSCRIBE, t)
        self.held_elsewhere: dict[str, tuple[set, float]] = {}
        self._trackers: dict[str, HeldJobs] = {}  # run/eval of this node: their listings, rebuilt
        self._strikes: set[str] = set()
        self._janitor = asyncio.create_task(self._janitor_loop())
        self._quota = asyncio.create_task(self._quota_loop())

    def on_control(self, topic: str, body: dict):
        if topic == "daemon.heartbeat" and body.get("node") == self.node and body.get("daemon") in ("run", "eval"):
            t = self._trackers.get(body["daemon"])
            if t is None or t.incarnation != body.get("incarnation"):
                t = self._trackers[body["daemon"]] = HeldJobs(body.get("incarnation"))
            # A dropped heartbeat leaves the holdings unknown: not refreshed, so the janitor judges nothing.
            if t.apply(body) is not None:
                self.held_elsewhere[body["daemon"]] = ({f"{j}.{a}" for j, a in t.jobs.items()}, time.monotonic())

    async def _janitor_loop(self):
        while True:
            await asyncio.sleep(float(self.cfg.section("sandbox")["janitor_interval_s"]))
            if not self.cfg.sandbox_root().exists():
                continue  # no handler on this node ever made a sandbox
            try:
                await self._sweep_sandboxes()
            except Exception as e:  # noqa: BLE001 - the janitor must not take the daemon down
                self.log.warning("janitor_failed", error=f"{type(e).__name__}: {e}")

    async def _sweep_sandboxes(self):
        now = time.monotonic()
        held = {f"{j}.{a}" for j, (a, _) in self.inflight.items()}
        for daemon in ("run", "eval"):
            jobs, seen = self.held_elsewhere.get(daemon, (None, 0.0))
            if jobs is None or now - seen > 3 * float(self.dcfg["heartbeat_s"]) + 1:
                return  # that daemon's holdings are unknown right now: judge nothing
            held |= jobs
        grace = float(self.cfg.section("sandbox")["janitor_grace_s"])
        rt = self.services.runtime()
        handles = await asyncio.to_thread(rt.list)
        wall = time.time()
        orphans = {h.job_id for h in handles if h.job_id not in held and wall - h.created_at > grace}
        doomed = orphans & self._strikes
        self._strikes = orphans - doomed
        if doomed:
            reaped = await asyncio.to_thread(rt.reap, {h.job_id for h in handles if h.job_id not in doomed})
            self.log.warning("orphan_sandboxes_reaped", sandboxes=sorted(reaped))
            self.events.publish("sandbox.reaped", sandboxes=sorted(reaped))

    async def _quota_loop(self):
        """Limits.disk_mb: the workspace is a host dir, so the node measures it (docs/SANDBOX.md).
        Also the sandbox root's free space: node.disk every 10 s, node.disk_low while below
        [sandbox] disk_low_mb (on entering, then each minute)."""
        from rolloutd.sandbox.runtime import free_space

        next_report, low_since, low_told = 0.0, None, 0.0
        while True:
            await asyncio.sleep(float(self.cfg.section("sandbox")["quota_interval_s"]))
            now = time.monotonic()
            if now >= next_report:
                next_report = now + 10.0
                fs = await asyncio.to_thread(free_space, self.cfg.sandbox_root())
                self.events.publish("node.disk", node=self.node, what="sandboxes", **fs)
                low_b = float(self.cfg.section("sandbox")["disk_low_mb"]) * 2**20
                if fs["free_bytes"] < low_b:
                    if low_since is None or now - low_told >= 60:
                        low_since, low_told = low_since or now, now
                        self.log.warning("node_disk_low", what="sandboxes", **fs)
                        self.events.publish("node.disk_low", node=self.node, what="sandboxes",
                                            threshold_bytes=int(low_b), **fs)
                elif low_since is not None:
                    low_since = None
                    self.log.info("node_disk_ok", what="sandboxes", **fs)
            if not self.cfg.sandbox_root().exists():
                continue
            try:
                stopped = await asyncio.to_thread(self.services.runtime().enforce_disk_quotas)
            except Exception as e:  # noqa: BLE001 - a failed measurement must not take the daemon down
                self.log.warning("disk_quota_check_failed", error=f"{type(e).__name__}: {e}")
                continue
            for info in stopped:
                self.events.publish("sandbox.disk_quota_exceeded", node=self.node, **info)

    async def teardown(self):
        self._janitor.cancel()
        self._quota.cancel()


class RunDaemon(PhaseDaemon):
    """The run phase: many agent loops at once on one asyncio loop, each with an LLM lease."""

    phase = "run"

    async def setup(self):
        await super().setup()
        from rolloutd.daemons.llm_session import ClientCache
        from rolloutd.daemons.router_client import RouterClient

        rcfg = self.cfg.section("router")
        # Every lease of this node goes to one router shard (docs/SCALING.md, "Router shards").
        shard = shard_of(self.node, int(rcfg["shards"]))
        self.router_name = router_name(shard)
        self.router = RouterClient(self.sockets, requester=f"run@{self.node}", node=self.node,
                                   endpoint=router_address(self.cfg.endpoints, shard))
        self.router.start()
        self.llm_clients = ClientCache(float(self.cfg.section("run")["llm_timeout_s"]))
        self.sessions: dict[int, object] = {}
        self.max_lag = int(rcfg["max_policy_lag"])
        self.stale_policy = rcfg["stale_policy"]
        if self.stale_policy not in ("finish", "abort_requeue", "drop", "continue"):
            raise ValueError(f"router.stale_policy must be finish, abort_requeue, drop or continue, "
                             f"not {self.stale_policy!r}")
        self.current_version = 0
        self.control.setsockopt(_SUBSCRIBE, b"backend.added")
        self.control.setsockopt(_SUBSCRIBE, b"backend.cleared")
        for t in self.heartbeat_topics(self.node, self.router_name):
            self.control.setsockopt(_SUBSCRIBE, t)
        await self._preload_tokenizers()

    @staticmethod
    def heartbeat_topics(node: str, router: str = "router") -> list[bytes]:
        """The incarnation of its router (shard) ``router`` (a restarted router lost the lease
        requests it held): its heartbeats alone, on whatever node, and start notices (docs/EVENTS.md)."""
        return [heartbeat_topic(router).encode(), b"daemon.started"]

    async def _preload_tokenizers(self):
        """Load the configured tokenizers before the first heartbeat: loading one takes seconds and
        pauses the event loop (the JSON parses hold the GIL) even from a thread; at start it only
        delays the daemon's start, later it would stall every job and the heartbeats."""
        from rolloutd.llm.tokenizer_utils import preload_tokenizers

        handlers = self.cfg.section("handlers")
        paths = [c.get("tokenizer") for c in handlers.values() if isinstance(c, dict)]
        paths.append(os.environ.get("ROLLOUTD_TOKENIZER"))
        for fut in preload_tokenizers(p for p in paths if p):
            try:
                await asyncio.wrap_future(fut)
            except Exception as e:  # noqa: BLE001 - a job that needs it fails with the error
                self.log.warning("tokenizer_preload_failed", error=f"{type(e).__name__}: {e}")

    async def before_phase(self, ctx, handler):
        if handler.needs_llm:
            from rolloutd.daemons.llm_session import LLMSession

            ctx.llm = self.sessions[ctx.job_id] = LLMSession(self.router, self.llm_clients, ctx.job_id,
                                                             is_stale=self._is_stale,
                                                             continue_stale=self.stale_policy == "continue")

    def after_phase(self, ctx):
        session = self.sessions.pop(ctx.job_id, None)
        return session.close() if session is not None else None

    def heartbeat(self):
        hb = super().heartbeat()
        if "jobs" in hb:  # with the full listings only: the router renews within lease_ttl_s >> full_listing_s
            # On their own topic, published just before the heartbeat: the router reads them, and the
            # gateway (subscribed to daemon.*) never unpacks 512 rows it does not use (docs/SCALING.md).
            self.events.publish("run.leases", incarnation=self.incarnation,
                                leases=lease_rows.pack([h for h in (s.held() for s in self.sessions.values()) if h]))
        return hb

    def on_control(self, topic: str, body: dict):
        if topic in ("daemon.heartbeat", "daemon.started"):
            if body.get("daemon") == self.router_name:
                asyncio.get_running_loop().create_task(self._router_seen(body.get("incarnation")))
        elif topic == "backend.added":
            v = int(body.get("policy_version", 0))
            for session in self.sessions.values():  # a server reloaded in place: its leases are at v now
                session.backend_versioned(body.get("id"), v)
            if v > self.current_version:
                self.current_version = v
                self._enforce_staleness()
        elif topic == "backend.cleared":
            loop = asyncio.get_running_loop()
            grace = self.llm_clients.timeout_s + 5.0  # a job still leasing the old server may finish
            for client in self.llm_clients.evict(body.get("backends") or []):
                loop.call_later(grace, lambda c=client: loop.create_task(c.aclose()))

    async def _router_seen(self, incarnation):
        n = await self.router.router_seen(incarnation)
        if n:
            self.log.warning("lease_requests_resent", requests=n, router_incarnation=incarnation)

    def _is_stale(self, version: int) -> bool:
        return self.stale_policy != "finish" and self.current_version - version > self.max_lag

    def _enforce_staleness(self):
        """Stop jobs running on a version too far behind (a lease granted but not yet seen is
        checked by its session when it arrives)."""
        for jid, session in list(self.sessions.items()):
            pv = session.policy_version
            if pv is not None and self._is_stale(pv):
                if self.stale_policy == "continue":
                    # Abort the generation in flight; the job continues it on a current server.
                    if session.interrupt():
                        self.log.info("stale_generation_interrupted", job_id=jid, policy_version=pv,
                                      current=self.current_version)
                    continue
                held = self.inflight.get(jid)
                if held is not None:
                    self.why_cancelled[jid] = "requeue" if self.stale_policy == "abort_requeue" else "stale"
                    self.log.info("stale_job_stopped", job_id=jid, policy_version=pv,
                                  current=self.current_version, policy=self.stale_policy)
                    held[1].cancel()

    async def teardown(self):
        self.router.stop()
        await self.llm_clients.aclose()


class EvalDaemon(PhaseDaemon):
    phase = "eval"
