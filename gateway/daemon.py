"""The gateway daemon: the only door for trainers.

Over ~700 lines because it is one loop whose turn order (drain, slice, dispatch, commit, reply)
is the durability promise; the job table, journal and submit slices are modules of their own.

One ROUTER socket answers REQ and DEALER clients, exactly one reply per request. The
gateway assigns job ids, journals jobs before acknowledging them, dispatches them to the
init daemons as their pipes accept, collects results, and answers polls. Each loop turn
drains every ready socket, commits the journal once, then sends the replies. A large submit
(gateway/submits.py) or cancel is worked through a slice per turn, so no request holds the loop
for long (docs/PROTOCOL.md, "Bounds").
"""
from __future__ import annotations

import collections
import time

from rolloutd.bus import codec
from rolloutd import __version__
from rolloutd.bus.messages import (CLIENT_REQUESTS, PROTOCOL_VERSION, Error, Job, MessageError, Reply, Result,
                                   empty_trajectory, from_wire)
from rolloutd.bus import events
from rolloutd.bus.credit import CreditSender
from rolloutd.bus.endpoints import router_address, router_shard, shard_of
from rolloutd.bus.sockets import InWaiter, recv_now, send_now
from rolloutd.bus.daemon import Daemon
from rolloutd.gateway.jobs import JobRecord, JobTable
from rolloutd.gateway.journal import Journal
from rolloutd.gateway.submits import SLICE_S, STEP, Submits
from rolloutd.handlers.registry import handler_names

ROUTER_OPS = ("add_llm_server", "clear_llm_server", "list_llm_servers")
DRAIN_BATCH = 512
CANCEL_SLICE = 256  # job ids the cancels in progress get through per loop turn
LISTING_KEYS = ("jobs", "jobs_added", "jobs_removed")  # a heartbeat's listing (docs/EVENTS.md)
DISPATCH_BYTES = 64 << 20  # jobs sent per loop turn stop past this many bytes (an instance can be MiBs)


class Gateway(Daemon):
    name = "gateway"
    freeze_after_full_gc = True  # its table of jobs / leases (bus/daemon.py)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gcfg = cfg.section("gateway")
        self.table = JobTable()
        self.journal = Journal(self.gcfg["journal"] or None, sync=self.gcfg["journal_sync"])
        self.paused = False
        self.replies: list[tuple[list, dict, list]] = []   # (route, header, buffers) to send after commit
        self.waiters: list[tuple[float, list, object]] = []  # (deadline, route, Poll)
        self.cancels: list[list] = []  # [route, Cancel, ids done, jobs answer, outcome]: see _op_cancel
        self.submits = Submits(self)   # submits being worked through, a slice per loop turn
        self.dispatch_more = False     # _dispatch stopped at DISPATCH_BYTES with credit left
        # router req id -> (deadline, route, client req_id, kind, shard, fan-out or None): see _forward_to_router
        self.router_pending: dict[int, tuple] = {}
        self.router_seq = 0
        self.shards = int(cfg.section("router")["shards"])  # router processes (docs/SCALING.md, "Router shards")
        self.daemons: dict[str, dict] = {}   # "name@node" -> last heartbeat
        self.hb_seen: dict[str, float] = {}  # "name@node" -> monotonic time its last complete report arrived
        self.held: dict[str, events.HeldJobs] = {}  # "name@node" -> the jobs its heartbeats list (holders only)
        self.outgoing: list[tuple[JobRecord, list]] = []  # jobs journalled as dispatched, sent after the commit
        self.suspects: dict[int, tuple[int, float, str]] = {}  # job id -> (attempt, since, cause): see _suspect_unlisted
        self.malformed = collections.Counter()  # input dropped or refused as undecodable, by socket
        self.backends: list = []             # every shard's, in shard order (status.backends)
        self.shard_backends: list[list] = [[] for _ in range(self.shards)]
        self.backends_from_reply = [0.0] * self.shards  # monotonic time a router reply last updated a shard's
        self.backend_regs: dict[str, dict] = {}  # what trainers registered; replayed to a restarted router
        self.handlers = set(handler_names())
        self.next_job_id = 0
        self.last_event_at = time.monotonic()
        self.stream_silent = False
        # When this loop last came back from a stall (a turn that started more than a heartbeat
        # after the one before): _sweep and _sweep_leases count silence only from then.
        self.woke_at = 0.0
        self.last_prune = time.time()

    # -- setup and recovery -------------------------------------------------------------
    async def setup(self):
        s = self.sockets
        self.front = s.bind("ROUTER", "gateway", hwm=10000)
        self.to_init = CreditSender(s.bind("ROUTER", "init", hwm=1000))
        self.results = s.bind("PULL", "gateway_results", hwm=1000)
        self.routers = [s.connect("DEALER", router_address(self.cfg.endpoints, i), hwm=1000) for i in range(self.shards)]
        self.router = self.routers[0]
        self.watch = s.connect("SUB", "events_out", subscribe=[b"daemon."], hwm=10000)
        self._recover()

    def _recover(self):
        dropped = self.journal.rollback_open_submits()
        if dropped:  # a submit was being written when the gateway stopped: it was never answered
            self.log.warning("unanswered_submit_rolled_back", jobs=dropped)
        # Ids stay unique across restarts: from the journal, or from the clock without one.
        self.next_job_id = max(self.journal.max_job_id(), int(time.time() * 1e6) if not self.journal.durable else 0) + 1
        for cid, (next_seq, acked, sent) in self.journal.clients().items():
            c = self.table.client(cid)
            c.next_seq, c.acked, c.sent = next_seq, acked, max(sent, acked)
        self.table.idem.update(self.journal.idempotency())
        self.backend_regs.update(self.journal.backends())
        n = 0
        now = time.monotonic()
        rows = self.journal.unfinished()
        # The queued samples of a task share its instance (stored once): packed once for them all.
        shared = collections.Counter(id(r[2]["instance"]) for r in rows if r[4] == "queued")
        wires: dict[int, list] = {}
        for jid, cid, spec, attempt, state, seq, result in rows:
            rec = JobRecord(jid, cid, spec, attempt=attempt, state=state, last_seen=now)
            if state == "done":
                rec.seq, rec.result = seq, result
            elif state == "queued" and shared[id(spec["instance"])] > 1:
                inst = spec["instance"]
                rec.instance_wire = wires.get(id(inst)) or wires.setdefault(id(inst), codec.encode(inst))
            # In flight when the gateway stopped: daemons may still finish it and deliver the
            # result; if none lists it in a heartbeat within the lease timeout it is re-dispatched.
            self.table.add(rec)
            n += 1
        if n:
            for c in self.table.clients.values():
                c.ready = type(c.ready)(sorted(c.ready.items()))
            self.log.info("journal_recovered", jobs=n, queued=len(self.table.queue))

    def heartbeat(self):
        return {"paused": self.paused, **self.table.counts(), "clients": len(self.table.clients),
                "malformed": dict(self.malformed), "journal_full": self.journal.failing,
                "journal_free_bytes": self.journal.free_bytes()}

    # -- main loop ------------------------------------------------------------------------
    async def serve(self):
        waiter = InWaiter((self.front, self.results, *self.routers, self.watch, self.to_init.sock))
        on_reply = [lambda frames, i=i: self._on_router_reply(frames, i) for i in range(self.shards)]
        poll_ms = int(float(self.dcfg["poll_s"]) * 1000)
        stall_s = float(self.dcfg["heartbeat_s"])
        last_sweep = turn = time.monotonic()
        got = 0
        while not self.stopping:
            timeout = poll_ms if not self.waiters else max(0, min(poll_ms, int((min(w[0] for w in self.waiters) - time.monotonic()) * 1000) + 1))
            # A turn that received something is likely followed by more: drain again after one loop
            # turn, without asking every socket first (that scan was ~8% of the gateway's CPU under load).
            await waiter.wait(0 if got or self.cancels or self.submits or self.dispatch_more else timeout)
            prev, turn = turn, time.monotonic()
            if turn - prev > stall_s:  # we did not run for a heartbeat or more (turns are <= poll_s apart)
                self.woke_at = turn
                self.log.warning("gateway_stalled", gap_s=round(turn - prev, 2))
            # The slices of large requests get what is left of SLICE_S after this turn's receiving
            # (a decode of the largest request may have used it all: then one step each).
            slice_until = time.perf_counter() + SLICE_S
            got = self._drain(self.results, self._on_result) + self._drain(self.front, self._on_request)
            for sock, fn in zip(self.routers, on_reply):
                got += self._drain(sock, fn)
            got += self._drain(self.watch, self._on_event) + self._drain(self.to_init.sock, self._on_credit)
            if (self.cancels or self.submits) and self.replies and self._commit():
                # A large request is being worked: what this turn received is answered before its
                # slice, so another client waits one slice at most, not two (issue 38.3).
                self._flush_replies()
            self._cancel_slices(slice_until)
            if not self.journal.failing:  # its writes wait for the disk, and so does its next slice
                self.submits.work(until=slice_until)
            self._answer_waiters()
            self._dispatch()
            # Everything this turn decided (jobs, results, acks, what the replies will carry, which
            # jobs leave as which attempt) is durable before any reply or job goes out.
            if self._commit():
                self._flush_replies()
                self._send_dispatched()
            now = time.monotonic()
            if now - last_sweep > 1.0:
                last_sweep = now
                self._sweep(now)
        self.journal.commit()

    def _drain(self, sock, fn) -> int:
        """Handle up to DRAIN_BATCH messages queued on ``sock``; how many there were."""
        for n in range(DRAIN_BATCH):
            frames = recv_now(sock)
            if frames is None:
                return n
            try:
                fn(frames)
            except Exception as e:  # noqa: BLE001 - one bad message must not stop the gateway
                self.log.error("message_handling_failed", error=f"{type(e).__name__}: {e}")
        return DRAIN_BATCH

    # -- trainer requests -------------------------------------------------------------------
    def _on_request(self, frames):
        ident = frames[0].bytes
        rest = frames[1:]
        route = [ident]
        if rest and len(rest[0]) == 0:  # REQ (and REQ-style DEALER) envelope delimiter
            route.append(b"")
            rest = rest[1:]
        size = codec.frames_size(rest)
        if size > int(self.gcfg["max_request_bytes"]):
            self.malformed["requests"] += 1
            self._error(route, codec.peek_req_id(rest), "too_large", f"request of {size} bytes exceeds the limit of {self.gcfg['max_request_bytes']}")
            return
        header = None
        try:
            header = codec.decode(rest, max_values=int(self.gcfg["max_request_values"]))
            self._check_counts(header)
            msg = from_wire(header, expect=CLIENT_REQUESTS, head_only=True)  # a submit's tasks: Submits
        except MessageError as e:
            self.malformed["requests"] += 1
            rid = header.get("req_id") if isinstance(header, dict) else None  # decoded: no need to peek
            rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else codec.peek_req_id(rest)
            self._error(route, rid, e.code, str(e))
            return
        except codec.TooManyValues as e:
            self.malformed["requests"] += 1
            self._error(route, codec.peek_req_id(rest), e.code,
                        f"{e}: over gateway.max_request_values ({self.gcfg['max_request_values']}); split it over "
                        "several requests, and send long lists of numbers as numpy arrays (one value each)")
            return
        except codec.CodecError as e:
            self.malformed["requests"] += 1  # req_id read only here: a second decode of every request cost time
            self._error(route, codec.peek_req_id(rest), getattr(e, "code", "malformed"), str(e))
            return
        held, pending = len(self.replies), len(self.journal.pending)
        try:
            getattr(self, f"_op_{msg.KIND}")(route, msg)
        except MessageError as e:
            self._error(route, msg.req_id, e.code, e.message)
        except Exception as e:  # noqa: BLE001 - a bug still owes the client its one reply
            self.log.error("request_failed", kind=msg.KIND, error=f"{type(e).__name__}: {e}")
            self._error(route, msg.req_id, "internal", f"{type(e).__name__}: {e}")
        if self.journal.failing and len(self.journal.pending) == pending:
            # It wrote nothing (status, say): its reply need not wait for the disk.
            for r, frames in self.replies[held:]:
                send_now(self.front, r + frames)
            del self.replies[held:]

    def _check_counts(self, header):
        """Refuse a cancel naming more than ``max_request_ids`` jobs or a submit of more than
        ``max_request_jobs`` tasks before their fields are checked one by one (1,000,000 ids cost
        ~100 ms to check); the sum of a submit's ``n`` is bounded in ``_op_submit``."""
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            return  # from_wire says what is wrong with it
        kind, cap = header.get("kind"), None
        if kind == "cancel":
            field, items, cap = "cancel.job_ids", header.get("job_ids"), int(self.gcfg["max_request_ids"])
        elif kind == "submit":
            field, items, cap = "submit.tasks", header.get("tasks"), int(self.gcfg["max_request_jobs"])
        if cap is not None and isinstance(items, list) and len(items) > cap:
            raise MessageError("invalid", f"{field} has {len(items)} entries; at most {cap} per request "
                               f"(gateway.{'max_request_ids' if kind == 'cancel' else 'max_request_jobs'}): "
                               "split it over several requests")

    def _reply(self, route, req_id: int, inline: bool = True, **body):
        frames = codec.encode(Reply(req_id=req_id, body=body).to_wire(), codec.INLINE_MAX_BYTES if inline else None)
        self.replies.append((route, frames))

    def _error(self, route, req_id: int, code: str, message: str):
        self.log.info("request_rejected", code=code, error=message[:300])
        frames = codec.encode(Error(code=code, message=message, req_id=req_id).to_wire())
        if self.journal.failing:  # an error promises nothing durable: it need not wait for the disk
            send_now(self.front, route + frames)
        else:
            self.replies.append((route, frames))

    def _commit(self) -> bool:
        """Commit the journal; False while the disk is full (replies and jobs then wait: see journal.py)."""
        was = self.journal.failing
        ok = self.journal.commit()
        if ok and was:
            self.log.warning("journal_writable_again", free_bytes=self.journal.free_bytes(), held_replies=len(self.replies))
            self.events.publish("gateway.journal_recovered", path=self.journal.path, free_bytes=self.journal.free_bytes())
        elif not ok and not was:
            self.log.error("journal_full", error=self.journal.error, path=self.journal.path,
                           free_bytes=self.journal.free_bytes(), pending=len(self.journal.pending))
            self.events.publish("gateway.journal_full", path=self.journal.path, error=self.journal.error,
                                free_bytes=self.journal.free_bytes())
        return ok

    def _refuse_if_journal_full(self):
        if self.journal.failing:
            raise MessageError("journal_full", f"the gateway cannot write its journal {self.journal.path} "
                               f"({self.journal.error}; {self.journal.free_bytes()} bytes free): this request "
                               "was not applied; retry once space is back (a submit with the same idempotency_key: "
                               "an earlier try of it may yet be committed)")

    def _flush_replies(self):
        for route, frames in self.replies:
            send_now(self.front, route + frames)
        self.replies.clear()

    def _op_submit(self, route, msg):
        """Checked and made in slices over the next loop turns (gateway/submits.py), answered after the last."""
        self._refuse_if_journal_full()
        self.submits.start(route, msg)

    def _op_poll(self, route, msg):
        self._refuse_if_journal_full()  # a poll journals its acks and what it delivers
        c = self.table.touch(msg.client_id)
        if msg.after > c.sent:
            # Acknowledging what no reply carried would delete results the client never saw.
            raise MessageError("invalid", f"poll.after={msg.after} is beyond the last sequence number delivered to "
                               f"client {msg.client_id!r} ({c.sent}); send the `last` of a poll reply you received "
                               f"(0 at first)")
        acked = self.table.ack(msg.client_id, msg.after)
        if acked:
            self.journal.ack(msg.client_id, msg.after)
        msg.max_results = min(msg.max_results, int(self.gcfg["max_poll_results"]))
        recs = self.table.ready_after(msg.client_id, msg.after, msg.max_results)
        if recs or msg.wait_s <= 0 or self.table.client(msg.client_id).pending == 0:
            self._poll_reply(route, msg, recs)
        else:
            self.waiters.append((time.monotonic() + msg.wait_s, route, msg))

    def _poll_reply(self, route, msg, recs):
        # Each result is encoded into one reply: a result's large arrays are frames of their own
        # (zero-copy views), whose indices change; its small ones pass as the msgpack they came in.
        # A result kept as its decoded trajectory (the usual case) is not decoded again.
        results = [r.result if isinstance(r.result, dict) else codec.decode(r.result)["trajectory"] for r in recs]
        if not msg.inline_arrays:  # this client reads ext 1 frames only
            results = [codec.build_arrays(r) for r in results]
        c = self.table.client(msg.client_id)
        last = recs[-1].seq if recs else msg.after
        if last > c.sent:
            c.sent = last
            self.journal.set_sent(msg.client_id, last)
        self._reply(route, msg.req_id, msg.inline_arrays, results=results, last=last, pending=c.pending,
                    ready=max(0, len(c.ready) - len(recs)))

    def _answer_waiters(self):
        if not self.waiters:
            return
        now = time.monotonic()
        keep = []
        for deadline, route, msg in self.waiters:
            recs = self.table.ready_after(msg.client_id, msg.after, msg.max_results)
            if recs or now >= deadline or self.stopping or self.table.client(msg.client_id).pending == 0:
                self._poll_reply(route, msg, recs)
            else:
                keep.append((deadline, route, msg))
        self.waiters = keep

    def _op_cancel(self, route, msg):
        """Idempotent: the answer is the job's outcome, not what this call did, so a retried
        cancel says the same (or, once the job finished, what it finished as). Worked through
        CANCEL_SLICE ids per loop turn (``_cancel_slices``) and answered after the last: a job
        finished here is journalled and announced, ~50-180 us each, and 1,000 of them in one turn
        held every other client ~180 ms (bench/bench_gateway_requests.py)."""
        self._refuse_if_journal_full()
        self.cancels.append([route, msg, 0, {}, {}])

    def _cancel_slices(self, until: float | None = None):
        """Up to CANCEL_SLICE ids, until ``until`` (default SLICE_S from now), at least STEP of them."""
        budget = CANCEL_SLICE
        until = time.perf_counter() + SLICE_S if until is None else until
        first = True
        while self.cancels and budget > 0 and (first or time.perf_counter() < until):
            first = False
            c = self.cancels[0]
            route, msg, done, out, outcome = c
            part = msg.job_ids[done:done + min(budget, STEP)]
            try:
                self._cancel_part(part, out, outcome)
            except Exception as e:  # noqa: BLE001 - a bug still owes the client its one reply
                self.cancels.pop(0)
                self.log.error("request_failed", kind="cancel", error=f"{type(e).__name__}: {e}")
                self._error(route, msg.req_id, "internal", f"{type(e).__name__}: {e}")
                continue
            c[2] = done + len(part)
            budget -= len(part)
            if c[2] >= len(msg.job_ids):
                self.cancels.pop(0)
                self._reply(route, msg.req_id, jobs=out, outcome=outcome)

    def _cancel_part(self, job_ids, out: dict, outcome: dict):
        to_broadcast = []
        jobs = self.table.jobs
        # Unknown here: its result was delivered and acknowledged (or dropped unclaimed), or it never existed.
        journalled = self.journal.job_states([j for j in job_ids if j not in jobs])
        for jid in job_ids:
            key = str(jid)
            rec = jobs.get(jid)
            if rec is None:
                out[key] = "already_finished" if journalled.get(jid) in ("acked", "dropped") else "not_found"
                continue
            if rec.state == "queued":
                # Left in the queue: _dispatch skips what is no longer queued (deque.remove walked
                # the whole queue per job: O(cancelled x queued)).
                self._finish_locally(rec, "cancelled", "queue", "JobCancelled", "cancelled while queued in the gateway")
            if rec.state == "done":
                status = self._status_of(rec)
                out[key] = "cancelled" if status == "cancelled" else "already_finished"
                outcome[key] = status
            else:
                rec.cancel_requested = True  # a re-broadcast is harmless and covers a dropped first one
                to_broadcast.append(jid)
                out[key] = "cancelling"
        if to_broadcast:
            self.events.publish("control.cancel", job_ids=to_broadcast)

    @staticmethod
    def _status_of(rec: JobRecord) -> str:
        if not rec.status:  # recovered from the journal: read it from the stored result once
            traj = rec.result if isinstance(rec.result, dict) else codec.decode(rec.result)["trajectory"]
            rec.status = traj.get("status", "")
        return rec.status

    def _op_status(self, route, msg):
        now = time.time()
        daemons = [dict(d, age_s=round(now - d.get("ts", now), 3)) for d in self.daemons.values()]
        for d in daemons:
            d.pop("leases", None)  # the router's lease listing; the job listings are not kept (LISTING_KEYS)
        self._reply(route, msg.req_id, version=__version__, protocol=PROTOCOL_VERSION, paused=self.paused,
                    **self.table.counts(), totals=dict(self.table.totals), daemons=daemons, backends=self.backends,
                    journal=self.journal.path or "", journal_full=self.journal.failing, handlers=sorted(self.handlers), malformed=dict(self.malformed))

    def _op_start(self, route, msg):
        self.paused = False
        self._reply(route, msg.req_id, paused=False)

    def _op_stop(self, route, msg):
        self.paused = True
        self._reply(route, msg.req_id, paused=True)

    def _backend_shard(self, address: str, wire: dict | None = None) -> int:
        """The router shard that holds ``address``: the one its registration named, else its hash's."""
        wire = self.backend_regs.get(address) if wire is None else wire
        named = wire.get("shard", -1) if wire else -1
        return named if 0 <= named < self.shards else shard_of(address, self.shards)

    def _forward_to_router(self, route, msg):
        # A backend is its shard's; a clear of every backend and a listing go to every shard, and their
        # replies are merged into one (_merge_replies) before the client gets it.
        address = getattr(msg, "address", None)
        if msg.KIND == "add_llm_server":
            reg = {k: v for k, v in msg.to_wire().items() if k not in ("req_id",)}
            target = self._backend_shard(address, reg)
            if msg.shard >= self.shards:
                raise MessageError("invalid", f"add_llm_server.shard={msg.shard}, but router.shards = {self.shards} "
                                   f"(shards 0..{self.shards - 1}; -1: by address)")
            if address in self.backend_regs and self._backend_shard(address) != target:
                raise MessageError("invalid", f"{address} is registered on router shard {self._backend_shard(address)}: "
                                   "clear it (clear_llm_server) before registering it on another")
            self.backend_regs[address] = reg
            self.journal.set_backend(address, reg)
            targets = [target]
        elif msg.KIND == "clear_llm_server":
            targets = [self._backend_shard(address)] if address is not None else list(range(self.shards))
            for a in [a for a in self.backend_regs if address in (None, a)]:
                del self.backend_regs[a]
            self.journal.set_backend(address or "", None)
        else:
            targets = list(range(self.shards))
        if msg.KIND == "add_llm_server" and self.shards > 1:
            self._warn_empty_shards()
        fan = {"parts": {}, "rids": []} if len(targets) > 1 else None
        deadline = time.monotonic() + float(self.gcfg["router_timeout_s"])
        wire = msg.to_wire()
        for shard in targets:
            self.router_seq += 1
            rid = self.router_seq
            self.router_pending[rid] = (deadline, route, msg.req_id, msg.KIND, shard, fan)
            if fan is not None:
                fan["rids"].append(rid)
            wire["req_id"] = rid
            send_now(self.routers[shard], [b""] + codec.encode(wire))

    def _warn_empty_shards(self):
        """Backends split over the shards by a hash of their address: with few, a shard can get none,
        and the nodes it serves get no lease (docs/SCALING.md, "Router shards")."""
        have = {self._backend_shard(a) for a in self.backend_regs}
        empty = sorted(set(range(self.shards)) - have)
        if empty and len(self.backend_regs) >= self.shards:
            self.log.warning("router_shards_without_backends", shards=empty, backends=len(self.backend_regs))

    _op_add_llm_server = _forward_to_router
    _op_clear_llm_server = _forward_to_router
    _op_list_llm_servers = _forward_to_router

    def _on_router_reply(self, frames, shard: int = 0):
        rest = frames[1:] if frames and len(frames[0]) == 0 else frames
        header = codec.decode(rest)
        pending = self.router_pending.get(header.get("req_id"))
        if pending is None or pending[4] != shard:  # late (timed out), or not this shard's to answer
            return
        del self.router_pending[header["req_id"]]
        _, route, client_req, kind, _, fan = pending
        if header.get("kind") == "reply" and isinstance(header.get("body"), dict):
            self._apply_backends(kind, header["body"], shard)
        if fan is not None:
            fan["parts"][shard] = header
            if len(fan["parts"]) < len(fan["rids"]):
                return  # the other shards' replies are still to come
            header = self._merge_replies(kind, fan["parts"])
        header["req_id"] = client_req
        self.replies.append((route, codec.encode(header)))

    @staticmethod
    def _merge_replies(kind: str, parts: dict) -> dict:
        """One reply from every shard's: the first error if any, else backends (and cleared)
        concatenated in shard order, leases summed, ``lease_traffic`` summed (``max_batch``: the
        largest) with each shard's own in ``shards``."""
        headers = [parts[i] for i in sorted(parts)]
        for h in headers:
            if h.get("kind") != "reply" or not isinstance(h.get("body"), dict):
                return h
        bodies = [h["body"] for h in headers]
        if kind == "clear_llm_server":
            return dict(headers[0], body={"cleared": [a for b in bodies for a in b.get("cleared") or ()]})
        traffic: dict = {}
        for b in bodies:
            for k, v in (b.get("lease_traffic") or {}).items():
                if isinstance(v, (int, float)):
                    traffic[k] = max(traffic.get(k, 0), v) if k == "max_batch" else traffic.get(k, 0) + v
        body = dict(bodies[0], backends=[x for b in bodies for x in b.get("backends") or ()],
                    leases=sum(int(b.get("leases") or 0) for b in bodies), lease_traffic=traffic,
                    shards=[{"shard": i, "backends": len(b.get("backends") or ()), "leases": b.get("leases"),
                             "lease_traffic": b.get("lease_traffic")} for i, b in zip(sorted(parts), bodies)])
        return dict(headers[0], body=body)

    def _apply_backends(self, kind: str, body: dict, shard: int = 0):
        """``status.backends`` follows the router's answers at once instead of its next heartbeat."""
        mine = self.shard_backends[shard]
        if kind == "list_llm_servers" and isinstance(body.get("backends"), list):
            mine = body["backends"]
        elif kind == "add_llm_server" and isinstance(body.get("backend"), dict):
            b = body["backend"]
            mine = [x for x in mine if x.get("address") != b.get("address")] + [b]
        elif kind == "clear_llm_server" and isinstance(body.get("cleared"), list):
            gone = set(body["cleared"])
            mine = [x for x in mine if x.get("address") not in gone]
        else:
            return
        self._set_backends(shard, mine)
        self.backends_from_reply[shard] = time.monotonic()

    def _set_backends(self, shard: int, backends: list):
        self.shard_backends[shard] = backends
        self.backends = backends if self.shards == 1 else [b for bs in self.shard_backends for b in bs]

    # -- pipeline ----------------------------------------------------------------------------
    def _on_credit(self, frames):
        if not self.to_init.on_message(frames):
            self.malformed["credits"] += 1
            self.log.warning("malformed_credit_dropped")

    def _dispatch(self):
        """Take as many queued jobs as the init daemons have credit for and journal them as
        dispatched; ``_send_dispatched`` sends them after the commit. Sent first, a crash before
        the commit would leave them ``queued`` in the journal and recovery would run the same
        (job, attempt) a second time; journalled first, recovery finds them in flight and a re-run
        gets attempt + 1."""
        self.dispatch_more = False
        if self.paused or self.journal.failing:
            return
        q = self.table.queue
        room = self.to_init.credit()
        sent = 0
        while q and room > 0:
            jid = q.popleft()
            rec = self.table.jobs.get(jid)
            if rec is None or rec.state != "queued":
                continue
            s = rec.spec
            job = Job(job_id=jid, attempt=rec.attempt, handler=s["handler"], instance=s["instance"],
                      instance_id=s["instance_id"], sample_index=s["sample_index"], client_id=rec.client_id,
                      budget_s=s.get("budget_s"), phase_limits=s.get("phase_limits") or {}, sent_at=time.time())
            if rec.instance_wire is not None:  # packed once for every sample of its task
                wire = job.to_wire()
                del wire["instance"]
                frames = codec.encode_with(wire, "instance", rec.instance_wire)
                rec.instance_wire = None  # a re-dispatch packs it again
            else:
                frames = codec.encode(job.to_wire())
            self.table.dispatch(rec)
            self.journal.set_state(jid, "dispatched", rec.attempt)
            self.outgoing.append((rec, frames))
            room -= 1
            sent += codec.frames_size(frames)
            if sent > DISPATCH_BYTES:  # the rest next turn (copying GiBs of instances would hold the loop)
                self.dispatch_more = bool(q) and room > 0
                return

    def _send_dispatched(self):
        now = time.monotonic()
        unsent = []
        for rec, frames in self.outgoing:
            if rec.state != "dispatched":
                continue
            peer = self.to_init.send(frames) if not unsent else None
            if peer is None:  # the credit vanished (a receiver went away): it was never sent, queue it again
                unsent.append(rec)
                continue
            rec.last_seen = now
            rec.holder = peer.ident.decode(errors="replace")
        self.outgoing.clear()
        for rec in reversed(unsent):
            self.table.requeue(rec)
            self.journal.set_state(rec.job_id, "queued", rec.attempt)

    def _on_result(self, frames):
        try:
            msg = from_wire(codec.decode_forwarded(frames), expect=("result",))
        except (codec.CodecError, MessageError) as e:
            self.malformed["results"] += 1
            self.log.warning("malformed_result_dropped", error=str(e))
            return
        rec = self.table.jobs.get(msg.job_id)
        if rec is None or rec.state == "done" or rec.attempt != msg.attempt:
            self.log.info("late_result_discarded", job_id=msg.job_id, attempt=msg.attempt,
                          current=None if rec is None else rec.attempt)
            return
        if msg.requeue:
            cause = msg.trajectory.get("requeue_cause") or "stale policy version (abort_requeue)"
            stale = bool(msg.trajectory.get("stale"))  # a stale re-run counts against max_attempts
            self._redispatch(rec.job_id, rec.attempt, str(cause), count=stale, stale=stale)
            return
        traj = msg.trajectory
        traj["attempts"] = rec.attempt
        # Kept decoded, its small arrays as the msgpack they came in (codec.decode_forwarded; large
        # ones are views of the received frames); encoded only for the journal.
        self._complete(rec, traj, traj["status"], traj, msg)

    def _complete(self, rec: JobRecord, result, status: str, traj: dict | None = None, msg=None):
        """``result``: the trajectory dict (``msg`` is its Result), or encoded Result frames."""
        seq = self.table.finish(rec, result, status)
        self.table.totals[status] += 1
        if self.journal.durable:
            self.journal.add_result(rec.job_id, seq, codec.encode(msg.to_wire()) if msg is not None else result)
        c = self.table.clients[rec.client_id]
        self.journal.set_client(rec.client_id, c.next_seq, c.acked)
        traj = traj or {}
        err = traj.get("error") if isinstance(traj.get("error"), dict) else {}
        timing = traj.get("timing") if isinstance(traj.get("timing"), dict) else {}
        self.events.publish("job.done", job_id=rec.job_id, attempt=rec.attempt, status=status,
                            handler=rec.spec.get("handler"), worker_node=traj.get("node"),
                            failed_phase=traj.get("failed_phase"), error_type=err.get("type"),
                            timing={k: float(v) for k, v in timing.items() if isinstance(v, (int, float))},
                            latency_s=round(time.time() - rec.submitted, 6) if rec.submitted else None)

    def _finish_locally(self, rec: JobRecord, status: str, phase: str, etype: str, message: str, stale: bool = False):
        """A result the gateway writes itself (cancelled in queue, attempts exhausted)."""
        traj = empty_trajectory(rec.job_id, rec.spec["instance_id"], rec.spec["sample_index"])
        traj.update(handler=rec.spec["handler"], status=status, failed_phase=phase,
                    error={"type": etype, "message": message}, attempts=rec.attempt, stale=stale)
        self._complete(rec, codec.encode(Result(job_id=rec.job_id, attempt=rec.attempt, trajectory=traj).to_wire()), status,
                       traj)

    # -- liveness: heartbeats, dead daemons, lease expiry ----------------------------------
    def _on_event(self, frames):
        event = events.parse(frames)
        if event is None:
            self.malformed["events"] += 1
            self.log.warning("malformed_event_dropped")
            return
        self.last_event_at = time.monotonic()
        topic, body = event
        who = f"{body.get('daemon')}@{body.get('node')}"
        if topic == "daemon.heartbeat":
            carried = body.pop("carried", None)
            self._on_heartbeat(who, body)
            if carried is not None:
                self._on_carried(body, carried)
        elif topic in ("daemon.died", "daemon.stopped"):
            t = self.held.get(who)
            if t is not None:
                self._unvouch(f"{who}#{t.incarnation}", t.jobs.items(), self.hb_seen.get(who, 0.0))
            self.hb_seen.pop(who, None)
            prev = self.daemons.pop(who, None)
            if prev is not None and topic == "daemon.died":
                self._holder_lost(prev, "died")
            elif prev is not None and who in self.held:
                # A clean stop drained: what it finished moved on, what never started it handed back
                # (requeue results), what outlived the drain it abandoned (daemon.abandoned). Its last
                # heartbeat is stale (jobs moved on since), so nothing is re-dispatched by it; a job
                # that no live holder lists after another round still comes back.
                self._suspect_unlisted(who, f"{who}#{prev.get('incarnation')} stopped")
            self.held.pop(who, None)
        elif topic == "daemon.busy":  # its liveness thread: alive, the loop late by loop_lag_s
            hb = self.daemons.get(who)
            if hb is not None and hb.get("incarnation") == body.get("incarnation"):
                hb["busy_ts"], hb["loop_lag_s"] = body.get("ts"), body.get("loop_lag_s")
        elif topic == "daemon.abandoned":
            for jid, attempt in body.get("jobs", ()):
                self._redispatch(jid, attempt, f"abandoned by {who} at its drain deadline")

    def _on_heartbeat(self, who: str, body: dict):
        """One daemon's heartbeat (``who`` = "name@node"): its liveness, its listing's leases, a
        router shard's backends."""
        prev = self.daemons.get(who)
        if prev is not None and prev.get("incarnation") != body.get("incarnation"):
            self._holder_lost(prev, "restarted")
        self.daemons[who] = body
        now = time.monotonic()
        holder = f"{who}#{body.get('incarnation')}"
        listed = ()
        if events.HeldJobs.lists(body):
            t = self.held.get(who)
            if t is None or t.incarnation != body.get("incarnation"):
                t = self.held[who] = events.HeldJobs(body.get("incarnation"))
            was_valid, before = t.valid, t.jobs
            listed = t.apply(body)
            if listed is None:  # a heartbeat was lost: nothing is known until the next full listing
                listed = ()
                if was_valid:
                    self.log.info("heartbeat_gap", daemon=who, jobs_seq=t.seq, got_jobs_seq=body.get("jobs_seq"))
                    self._unvouch(holder, t.jobs.items(), self.hb_seen.get(who, 0.0))
                self._ask_relist(who, t, now)
            else:
                self.hb_seen[who] = now  # a complete report: _check_suspects counts it
                # What this holder stopped listing was handed on (or finished): its lease restarts here.
                if "jobs" not in body:
                    self._unvouch(holder, body.get("jobs_removed", ()), now)
                else:
                    t.full_at = now
                    # What it listed before it vouches for already (the lease sweep re-vouches one
                    # it unvouched for a late heartbeat): only new pairs are renewed here, and
                    # usually there are none (its changes since the last full listing add up to
                    # this one). By key: items() set operations build a tuple per job.
                    jobs = t.jobs
                    if was_valid and before == jobs:
                        listed = ()
                    elif was_valid:
                        self._unvouch(holder, [(j, a) for j, a in before.items() if jobs.get(j) != a], now)
                        listed = [(j, a) for j, a in jobs.items() if before.get(j) != a]
        else:
            self.hb_seen[who] = now
        shard = router_shard(body.get("daemon")) if isinstance(body.get("daemon"), str) else None
        if shard is not None and shard < self.shards:
            # A heartbeat published before the router answered a backend change can arrive after
            # the answer: within one heartbeat period of an answer, the answer is the fresher view.
            if now - self.backends_from_reply[shard] > float(self.dcfg["heartbeat_s"]):
                self._set_backends(shard, body.get("backends", []))
            self._reconcile_backends(shard)
        unvouched = self.table.unvouched
        for jid, attempt in listed:
            rec = self.table.jobs.get(jid)
            if rec is not None and rec.attempt == attempt and rec.state == "dispatched":
                rec.last_seen = now
                rec.holder = holder
                unvouched.discard(jid)  # this holder's heartbeats renew it from now on
        # The body stays (self.daemons) until the next one; its listing is in self.held already.
        # Kept, its pairs filled the young generation: the collector's count of new objects nets
        # out against the old bodies freed, so ~220,000 of them piled up at 1,000 nodes and a
        # pass over them cost 25-45 ms once a second (docs/SCALING.md, section 8).
        for key in LISTING_KEYS:
            body.pop(key, None)

    def _on_carried(self, carrier: dict, carried):
        """Heartbeats another daemon of the carrier's node handed it to send along (``carried``,
        docs/EVENTS.md: one message per node instead of one per daemon). Each is read as that
        daemon's own heartbeat, checked as a body on the stream is, and only from the carrier's
        own node, not in its own name and not a router's: a daemon vouches for no job held
        elsewhere, and the backends are what the router itself says."""
        node, name = carrier.get("node"), carrier.get("daemon")
        for b in carried if isinstance(carried, list) else (None,):
            b = events.checked_body(b)
            if b is None or b["node"] != node or b["daemon"] == name or router_shard(b["daemon"]) is not None:
                self.malformed["events"] += 1
                self.log.warning("malformed_carried_heartbeat_dropped", carrier=f"{name}@{node}")
                continue
            self._on_heartbeat(f"{b['daemon']}@{node}", b)

    def _ask_relist(self, who: str, t: events.HeldJobs, now: float):
        """After a gap, ask the holder for a full listing now (``control.relist``) when its periodic
        one (every ``daemon.full_listing_s``) would come too late for the lease of the jobs it held.
        Not otherwise: gaps come from an overloaded stream, and extra full listings would add load.
        At most once per heartbeat period per holder: the answer needs one heartbeat to arrive."""
        period = float(self.dcfg["heartbeat_s"])
        # Unknown holder (this gateway just started): its periodic listing is due within full_listing_s.
        due = (t.full_at if t.full_at > float("-inf") else now) + float(self.dcfg["full_listing_s"]) + period
        if due < self.hb_seen.get(who, now) + float(self.gcfg["lease_timeout_s"]) - period:
            return
        if now - t.relist_asked < period:
            return
        t.relist_asked = now
        self.log.info("full_listing_asked", daemon=who)
        daemon, _, node = who.partition("@")
        self.events.publish("control.relist", holder=daemon, holder_node=node, incarnation=t.incarnation)

    def _unvouch(self, holder: str, pairs, since: float):
        """``holder`` ("name@node#incarnation") no longer vouches for these [job, attempt] pairs: it
        handed them on (``since`` = now: counted from the last heartbeat that named them, the
        lease could be spent before the next holder names the job), or its heartbeats had a gap,
        went quiet or stopped (``since`` = its last complete heartbeat). The lease sweep looks at
        each again, its clock at ``since``."""
        jobs, unvouched = self.table.jobs, self.table.unvouched
        for jid, attempt in pairs:
            rec = jobs.get(jid)
            if rec is not None and rec.attempt == attempt and rec.holder == holder and rec.state == "dispatched":
                rec.last_seen = max(rec.last_seen, since)
                unvouched.add(jid)

    def _reconcile_backends(self, shard: int = 0):
        """A restarted router (shard) has forgotten its backends: register them again there (add is
        idempotent); another shard's backends are not its to know."""
        known = {b.get("address") for b in self.shard_backends[shard]}
        for address, wire in self.backend_regs.items():
            if address not in known and self._backend_shard(address, wire) == shard:
                self.log.info("backend_reregistered", backend=address, **({"shard": shard} if self.shards > 1 else {}))
                send_now(self.routers[shard], [b""] + codec.encode(dict(wire, req_id=0)))

    def _holder_lost(self, hb: dict, why: str):
        self._holders_lost([hb], why)

    def _holders_lost(self, hbs: list[dict], why: str):
        """One walk of the job table for every holder lost together: a rack that goes silent costs one
        sweep, not one table walk per daemon (at 1,000 nodes x 512 slots each walk is 648,000 jobs)."""
        holders = {f"{hb.get('daemon')}@{hb.get('node')}#{hb.get('incarnation')}" for hb in hbs}
        for rec in [r for r in self.table.jobs.values() if r.state == "dispatched" and r.holder in holders]:
            self._redispatch(rec.job_id, rec.attempt, f"{rec.holder} {why}")
        listing = sorted(h for h in holders if h.rpartition("#")[0] in self.held)
        if listing:
            more = f" and {len(listing) - 3} more" if len(listing) > 3 else ""
            self._suspect_unlisted({h.rpartition("#")[0] for h in holders}, f"{', '.join(listing[:3])}{more} {why}")

    def _suspect_unlisted(self, lost: str | set, cause: str):
        """A job holder is gone. Its last heartbeat names only what it held then: jobs handed to it
        afterwards (or still in its socket) are in nobody's list and would come back only through
        the lease timeout. Every job in flight that no live holder lists now becomes a suspect;
        one that is still unlisted after every live holder has reported once more is re-dispatched
        (the extra round lets a job that was only crossing between two live daemons show up)."""
        lost = {lost} if isinstance(lost, str) else lost
        listed = set()
        for who, t in self.held.items():
            if who not in lost and who in self.daemons:
                listed.update(t.jobs)
        now = time.monotonic()
        for rec in self.table.jobs.values():
            if rec.state == "dispatched" and rec.job_id not in listed and rec.job_id not in self.suspects:
                self.suspects[rec.job_id] = (rec.attempt, now, cause)

    def _check_suspects(self):
        if not self.suspects:
            return
        holders = [self.hb_seen.get(who, 0.0) for who in self.daemons if who in self.held]
        reported = min(holders) if holders else float("inf")  # no live holder: nothing can be placed
        for jid, (attempt, marked, cause) in list(self.suspects.items()):
            rec = self.table.jobs.get(jid)
            if rec is None or rec.state != "dispatched" or rec.attempt != attempt or rec.last_seen > marked:
                del self.suspects[jid]  # finished, already re-dispatched, or listed by a live holder since
            elif reported > marked:
                del self.suspects[jid]
                self._redispatch(jid, attempt, f"{cause}; unlisted by every live daemon since")

    def _redispatch(self, jid: int, attempt: int, cause: str, count: bool = True, stale: bool = False):
        rec = self.table.jobs.get(jid)
        if rec is None or rec.state != "dispatched" or rec.attempt != attempt:
            return
        if rec.cancel_requested:
            self._finish_locally(rec, "cancelled", "queue", "JobCancelled", f"cancelled; its holder was lost ({cause})")
            return
        if count and rec.attempt >= int(self.gcfg["max_attempts"]):
            self._finish_locally(rec, "failed", "queue", "AttemptsExhausted",
                                 f"attempt {rec.attempt} lost ({cause}); max_attempts={self.gcfg['max_attempts']}",
                                 stale=stale)
            return
        rec.attempt += 1
        self.table.requeue(rec)
        self.table.totals["redispatched"] += 1
        self.journal.set_state(jid, "queued", rec.attempt)
        self.log.warning("job_redispatched", job_id=jid, attempt=rec.attempt, cause=cause)
        self.events.publish("job.redispatched", job_id=jid, attempt=rec.attempt, cause=cause)

    def _sweep(self, now: float):
        dead_s = float(self.gcfg["daemon_dead_s"])
        wall = time.time()
        self._expire_clients(wall)
        for rid, (deadline, route, client_req, _, shard, fan) in list(self.router_pending.items()):
            if now > deadline and rid in self.router_pending:
                del self.router_pending[rid]
                for other in (fan or {}).get("rids", ()):  # one answer for the request, whichever shard is late
                    self.router_pending.pop(other, None)
                who = "the router" if self.shards == 1 else f"router shard {shard}"
                self._error(route, client_req, "unavailable", f"{who} did not answer in time")
        if now - self.last_event_at > dead_s:
            # Not even our own heartbeat came back: the events stream is down, not every daemon.
            # Liveness cannot be judged without it, so nothing is re-dispatched meanwhile.
            if not self.stream_silent:
                self.stream_silent = True
                self.log.warning("events_stream_silent", silent_s=round(now - self.last_event_at, 1))
            if self._commit():
                self._flush_replies()
            return
        if self.stream_silent:
            self.stream_silent = False
            self.log.info("events_stream_back")
            for rec in self.table.jobs.values():  # heartbeats could not be seen: restart the clocks
                rec.last_seen = max(rec.last_seen, now)
        silent = []
        for who, hb in list(self.daemons.items()):
            quiet = min(wall - hb.get("ts", wall), now - self.woke_at)
            if quiet > dead_s and not self._busy(who, wall):
                self.daemons.pop(who)
                self.hb_seen.pop(who, None)
                self.log.warning("daemon_presumed_dead", daemon=who, silent_s=round(quiet, 1))
                silent.append(hb)
        if silent:
            self._holders_lost(silent, "went silent")
            for hb in silent:
                self.held.pop(f"{hb.get('daemon')}@{hb.get('node')}", None)
        self._check_suspects()
        self.to_init.expire()
        self._sweep_leases(now)
        if self._commit():
            self._flush_replies()

    def _busy(self, who: str, wall: float) -> bool:
        """A holder whose loop is late but whose liveness thread still reports (``daemon.busy``
        within ``daemon_dead_s``, lag under ``daemon_hung_s``) is busy, not dead: it keeps its
        jobs (one job's load must not cost every job on the node an attempt)."""
        hb = self.daemons.get(who)
        if hb is None or not isinstance(hb.get("busy_ts"), (int, float)):
            return False
        lag = hb.get("loop_lag_s")
        if wall - hb["busy_ts"] > float(self.gcfg["daemon_dead_s"]) or not isinstance(lag, (int, float)):
            return False
        if lag < float(self.gcfg["daemon_hung_s"]):
            if not hb.get("busy_logged"):
                hb["busy_logged"] = True
                self.log.warning("daemon_busy", daemon=who, loop_lag_s=lag)
            return True
        return False

    def _sweep_leases(self, now: float):
        """Re-dispatch jobs unseen for ``lease_timeout_s``. A job listed by a holder whose heartbeats
        are complete and current is renewed by each of them without being touched (heartbeats that
        carry changes do not name the jobs that stayed): only the unvouched ones are walked, those
        in transit or whose holder stopped listing them, had a gap, or went quiet. (Walking the
        whole table each second was 12% of the gateway at 1,000 nodes, docs/SCALING.md.)"""
        lease = float(self.gcfg["lease_timeout_s"])
        hb_seen, unvouched = self.hb_seen, self.table.unvouched
        wall = time.time()
        woke = self.woke_at  # nothing could be seen while we stalled: a lease runs from our wake-up at most
        for who, t in self.held.items():
            if t.valid and now - max(hb_seen.get(who, 0.0), woke) > lease and not self._busy(who, wall):  # no complete
                # heartbeat for a whole lease (a busy holder keeps its jobs until daemon_hung_s)
                self._unvouch(f"{who}#{t.incarnation}", t.jobs.items(), hb_seen.get(who, 0.0))
        # A busy holder (its loop stalled) cannot list what it took just before the stall: a job
        # unlisted since then may be in its slot, so its lease waits for that holder's next
        # complete heartbeat (or for it to be judged hung or dead: then its jobs come back).
        busy = [hb_seen.get(who, 0.0) for who in self.held if self._busy(who, wall)]
        busy_since = min(busy) - float(self.dcfg["heartbeat_s"]) if busy else float("inf")
        jobs = self.table.jobs
        for jid in list(unvouched):
            rec = jobs.get(jid)
            if rec is None or rec.state != "dispatched":
                unvouched.discard(jid)
                continue
            who, _, inc = rec.holder.rpartition("#")
            t = self.held.get(who)
            if t is not None and t.valid and t.incarnation == inc and t.jobs.get(jid) == rec.attempt:
                seen = hb_seen.get(who, 0.0)
                if now - max(seen, woke) <= lease or self._busy(who, wall):
                    unvouched.discard(jid)  # a current holder lists it: its heartbeats renew it
                    continue
                rec.last_seen = max(rec.last_seen, seen)
            if now - max(rec.last_seen, woke) > lease and rec.last_seen < busy_since:
                self._redispatch(jid, rec.attempt, f"unseen in any heartbeat for {lease:.0f}s")

    def _expire_clients(self, wall: float):
        """Results nobody came for within the retention period are dropped (and the client forgotten)."""
        keep_s = float(self.gcfg["retention_s"])
        for cid, c in list(self.table.clients.items()):
            if wall - c.seen <= keep_s or c.pending:
                continue
            dropped = self.table.drop_results(cid)
            for jid in dropped:
                self.journal.set_state(jid, "dropped")
            if dropped:
                self.log.warning("unclaimed_results_dropped", client_id=cid, results=len(dropped), retention_s=keep_s)
        if wall - self.last_prune > 600:
            self.last_prune = wall
            pruned = self.journal.prune(keep_s)
            if pruned:
                self.log.info("journal_pruned", rows=pruned)

    async def teardown(self):
        while self.cancels:
            self._cancel_slices()
        while self.submits:  # answered, not dropped: its client would only send it again
            self.submits.work()
        for _, route, msg in self.waiters:
            self._poll_reply(route, msg, [])
        self.journal.failing = False  # a last try, whatever the retry clock says
        if self._commit():
            self._flush_replies()
        self.journal.close()
