"""Batch helpers for trainers: submit a batch, gather it as it completes, pad it for training.

Over ~700 lines because the sync and asyncio forms of one client share its state (batches in
flight, late results, deadlines) and are kept side by side so they cannot drift apart.

``BatchClient`` sits on top of :class:`rolloutd.gateway.client.RolloutClient` (the REQ-envelope DEALER
shim) and adds what a training loop needs:

* ``submit(tasks, n)`` returns a :class:`Batch` (job ids, instance ids, a per-batch deadline);
* ``results(batch)`` yields trajectories as they complete; ``aresults(batch)`` is the same as
  an asyncio async generator; ``gather``/``agather`` collect the whole batch in submission
  order. Several batches may be in flight at once (e.g. an off-policy pipeline that submits
  step k+1 while training on step k): results of other batches are kept until asked for.
* at a batch's deadline the jobs still missing are cancelled at the gateway and replaced by
  placeholder trajectories with ``status == "timeout"`` and ``error.type == "BatchDeadline"``,
  so a batch always comes back complete (``len(tasks) * n`` results) and never stalls a step;
  their late results, if any, are acknowledged and dropped. (``on_deadline="raise"`` raises
  :class:`~rolloutd.gateway.client.GatewayTimeout` instead and leaves the jobs running.)
* a job the gateway no longer knows (e.g. a gateway restarted without a journal) comes back as
  a placeholder with ``status == "failed"`` and ``error.type == "JobLost"``.

Two sockets share one ``client_id``: one for control requests (submit, cancel, backends), one
for polls, so a poll held open at the gateway (``wait_s``) never delays a submit. Only the
poll socket acknowledges results (``after``), so each result is delivered exactly once.

Group sampling (``sample_groups``, ``overprovision``, ``dynamic_sample``): GRPO wants whole
groups (one task, ``n`` samples). ``overprovision`` submits k% extra groups, keeps the first N
that complete and cancels the rest; ``dynamic_sample`` (DAPO's dynamic sampling) keeps
submitting groups until N have a non-zero reward variance. Both stop at a deadline and return a
:class:`GroupSample` that names every job they cancelled and what the gateway said about it.

Segments: a trajectory of the bring-your-own-agent endpoint may carry ``segments`` (2+ token
sequences of one episode; the top-level arrays hold the last). :func:`segments_of` lists them,
:func:`expand_segments` makes one row per segment (same reward, group and job), and ``collate``
takes ``segments="last"`` (default) or ``"expand"``.

Pure helpers (no sockets):

* :func:`group_by_instance`, :func:`group_advantages` (GRPO: reward minus the group mean,
  divided by the group's unbiased std; only ``status == "ok"`` trajectories count);
* :func:`collate`: trajectories -> padded numpy arrays, veRL's layout (see its docstring);
* :func:`to_torch`: those arrays as torch tensors (torch is imported only there);
* :func:`to_message_log`: one trajectory as a NeMo RL ``message_log`` (token-level messages).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import numpy as np

from rolloutd.bus.sockets import Closing
from rolloutd.gateway.client import GatewayError, GatewayTimeout, RolloutClient

__all__ = [
    "Batch", "BatchClient", "collate", "to_torch", "group_by_instance", "group_advantages", "filter_ok",
    "status_counts", "placeholder", "to_message_log", "GatewayError", "GatewayTimeout", "GroupSample",
    "has_reward_variance", "segments_of", "expand_segments", "trainable", "reward_of",
]

SUBMIT_CHUNK = 1024           # tasks per submit request (keeps requests far below max_request_bytes)
LOST_AFTER_IDLE_POLLS = 2     # consecutive "nothing pending, nothing ready" polls before jobs count as lost
# Late results of abandoned jobs are acknowledged in the background for up to LATE_ACK_S (a cancel
# that never reached a daemon leaves its job running: the next poll acknowledges that one).
LATE_ACK_S = 60.0
LATE_ACK_POLL_S = 0.5


def placeholder(job_id: int, instance_id: str, sample_index: int, status: str, error_type: str, message: str,
                handler: str = "") -> dict:
    """A trajectory the client makes itself for a job whose result will not come (deadline, lost)."""
    from rolloutd.bus.messages import empty_trajectory

    t = empty_trajectory(job_id, instance_id, sample_index)
    t.update(handler=handler, status=status, error={"type": error_type, "message": message}, client_side=True)
    return t


@dataclass
class Batch:
    """What ``submit`` returns: the jobs of a batch and where each came from."""

    job_ids: list[int]
    instance_ids: list[str]           # per task, in submission order
    n: list[int]                      # samples per task
    handlers: list[str]
    deadline: float | None            # time.monotonic() value, or None
    submitted_at: float = field(default_factory=time.monotonic)
    key: str = ""
    origin: dict[int, tuple[int, int]] = field(default_factory=dict)   # job id -> (task index, sample index)
    pending: set[int] = field(default_factory=set)                      # not yet delivered to the caller
    delivered: int = 0

    def __post_init__(self):
        if not self.origin:
            it = iter(self.job_ids)
            for ti, k in enumerate(self.n):
                for s in range(k):
                    self.origin[next(it)] = (ti, s)
        if not self.pending and self.delivered == 0:
            self.pending = set(self.job_ids)

    def __len__(self) -> int:
        return len(self.job_ids)

    @property
    def done(self) -> bool:
        return not self.pending

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def order_key(self, traj: dict) -> tuple[int, int]:
        return self.origin.get(traj["job_id"], (len(self.n), traj.get("sample_index", 0)))


@dataclass
class GroupSample:
    """What ``sample_groups`` returns. Every job it submitted is in exactly one of ``groups``,
    ``rejected``, ``surplus``, ``partial`` (delivered before the stop) or ``cancelled``."""

    groups: list[list[dict]]          # the kept groups (<= want), in completion order; each by sample index
    rejected: list[list[dict]]        # complete groups ``accept`` turned down (e.g. zero reward variance)
    surplus: list[list[dict]]         # complete groups accepted after ``want`` was reached (same poll)
    partial: list[dict]               # results of groups that were cut off by the stop
    cancelled: list[int]              # job ids cancelled at the stop (not delivered), sorted
    cancel_outcome: dict[int, str]    # the gateway's answer per cancelled job (cancelling, cancelled, ...)
    submitted_groups: int
    submitted_jobs: int
    timed_out: bool                   # the deadline came before ``want`` groups were kept
    elapsed_s: float

    @property
    def trajectories(self) -> list[dict]:
        return [t for g in self.groups for t in g]


def trainable(t: dict) -> bool:
    """A trajectory that counts for training: ``status == "ok"`` and a finite reward. The handlers
    never send a non-finite one (docs/HANDLERS.md, "Rewards"); one that arrives anyway (a worker
    from before that rule) counts as failed here, in groups, advantages, batches and the trainer
    adapters: masked and out of its group, never a NaN in a trainer's tensor."""
    if t.get("status") != "ok":
        return False
    try:
        return math.isfinite(float(t.get("reward", 0.0)))
    except (TypeError, ValueError, OverflowError):
        return False


def reward_of(t: dict) -> float:
    """The reward a trainer sees: the trajectory's when ``trainable``, else 0.0."""
    return float(t.get("reward", 0.0)) if trainable(t) else 0.0


def has_reward_variance(group: Sequence[dict]) -> bool:
    """DAPO's filter: at least two ``ok`` members and not all their rewards equal (a group whose
    rewards are all equal has zero GRPO advantage: no gradient)."""
    r = [reward_of(t) for t in group if trainable(t)]
    return len(r) >= 2 and max(r) > min(r)


class BatchClient(Closing):
    """Batch submit/gather for trainers (thread-safe; async methods usable from any one event loop)."""

    def __init__(self, address: str | None = None, *, client: RolloutClient | None = None,
                 timeout_s: float = 10.0, retries: int = 3, poll_wait_s: float = 1.0, max_results: int = 512,
                 client_id: str | None = None, curve=None, coalesce_s: float = 0.002):
        if client is not None:
            address = client.address
            client_id = client.client_id
            timeout_s, retries = client.timeout_s, client.retries
        self._ctl = client or RolloutClient(address, timeout_s=timeout_s, retries=retries, client_id=client_id,
                                            curve=curve)
        self.address = self._ctl.address
        self.client_id = self._ctl.client_id
        # The poll socket: same client id, its own socket, its own acknowledgement counter.
        self._poller = RolloutClient(self.address, timeout_s=timeout_s, retries=retries, client_id=self.client_id,
                                     curve=curve)
        self._poller.after = self._ctl.after
        self.poll_wait_s = float(poll_wait_s)
        self.max_results = int(max_results)
        self.coalesce_s = float(coalesce_s)
        self._ctl_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._lock = threading.Lock()           # guards the maps below
        self._stash: dict[int, dict] = {}       # received, not yet taken by a consumer
        self._outstanding: set[int] = set()     # submitted, not yet received / abandoned
        self._abandoned: set[int] = set()       # given up at a deadline: late results are dropped
        self._lost: set[int] = set()            # the gateway no longer knows them
        self._idle_polls = 0
        self._batches = itertools.count(1)
        self.dropped_late = 0                   # late results of abandoned jobs, acknowledged and dropped
        self.late_statuses: dict[str, int] = {}  # ...by their status (cancelled, or what they finished as)
        self._acker: threading.Thread | None = None  # acknowledges abandoned jobs' late results (_ack_late)
        # asyncio side (bound to the loop that first uses it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctl_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rolloutd-batch-ctl")
        self._poll_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rolloutd-batch-poll")
        self._cond: asyncio.Condition | None = None
        self._gen = 0
        self._waiting = 0
        self._poll_task: asyncio.Task | None = None
        self._poll_error: BaseException | None = None
        self._coalesce: list[tuple[dict, float | None, asyncio.Future]] = []
        self._coalesce_task: asyncio.Task | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------
    def close(self):
        if self._closed:
            return
        self._closed = True
        task = self._poll_task
        if task is not None and not task.done():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                task.cancel()
            elif self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(task.cancel)
        self._ctl_pool.shutdown(wait=True, cancel_futures=True)
        self._poll_pool.shutdown(wait=True, cancel_futures=True)
        if self._acker is not None:  # it sees _closed within one short poll
            self._acker.join(self._poller.timeout_s + 2 * LATE_ACK_POLL_S)
        with self._poll_lock:  # a zmq socket is one thread's: the acker's last poll (with its retries) may outlast the join
            self._poller.close()
        self._ctl.close()

    async def aclose(self):
        task = self._poll_task
        if task is not None and not task.done() and self._loop is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - it was cancelled
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    # -- control requests (passed through, serialized on the control socket) --------------
    @property
    def client(self) -> RolloutClient:
        """The control-socket client (``add_backend``, ``clear_backends``, ``status``, ...)."""
        return self._ctl

    def _with_ctl(self, fn, *a, **kw):
        with self._ctl_lock:
            return fn(*a, **kw)

    def add_backend(self, address: str, api: str = "vllm", policy_version: int = 0, **kw) -> dict:
        return self._with_ctl(self._ctl.add_backend, address, api=api, policy_version=policy_version, **kw)

    def clear_backends(self, address: str | None = None) -> list[str]:
        return self._with_ctl(self._ctl.clear_backends, address)

    def swap_backends(self, addresses: Sequence[str], policy_version: int, api: str = "vllm", **kw) -> list[dict]:
        """Checkpoint swap: clear every backend, register ``addresses`` at ``policy_version``."""
        with self._ctl_lock:
            self._ctl.clear_backends()
            return [self._ctl.add_backend(a, api=api, policy_version=policy_version, **kw) for a in addresses]

    def status(self) -> dict:
        return self._with_ctl(self._ctl.status)

    def cancel(self, job_ids: Iterable[int]) -> dict:
        return self._with_ctl(self._ctl.cancel, list(job_ids))

    # -- submit --------------------------------------------------------------------------
    def submit(self, tasks: Sequence[dict], n: int = 1, *, deadline_s: float | None = None,
               idempotency_key: str | None = None) -> Batch:
        """Submit ``tasks`` (``{"handler", "instance", "instance_id"?, "n"?, "timeout_s"?,
        "phase_timeouts"?}``), each ``n`` times unless the task says otherwise. The batch's
        deadline (``deadline_s`` from now) is enforced by the client when gathering; give
        tasks a ``timeout_s`` too so the service stops work nobody will wait for."""
        tasks = [dict(t) for t in tasks]
        if not tasks:
            raise ValueError("submit: no tasks")
        for ti, t in enumerate(tasks):
            t["n"] = int(t.get("n") or n)
            if t.get("instance_id") is not None:
                t["instance_id"] = str(t["instance_id"])
        key = idempotency_key or f"{self.client_id}-b{next(self._batches)}-{uuid.uuid4().hex[:8]}"
        job_ids: list[int] = []
        for ci, start in enumerate(range(0, len(tasks), SUBMIT_CHUNK)):
            chunk = tasks[start:start + SUBMIT_CHUNK]
            job_ids += self._with_ctl(self._ctl.submit, chunk, None, f"{key}-{ci}")
        # a task without an instance_id gets the gateway's default, auto-<job id of its first sample>
        # (unique across submits: PROTOCOL.md); placeholders for lost jobs carry the same id
        first, instance_ids = 0, []
        for t in tasks:
            instance_ids.append(t["instance_id"] if t.get("instance_id") is not None else f"auto-{job_ids[first]}")
            first += t["n"]
        batch = Batch(job_ids=job_ids, instance_ids=instance_ids, n=[t["n"] for t in tasks],
                      handlers=[t["handler"] for t in tasks],
                      deadline=None if deadline_s is None else time.monotonic() + float(deadline_s), key=key)
        with self._lock:
            self._outstanding.update(job_ids)
        return batch

    # -- receiving -----------------------------------------------------------------------
    def _poll(self, wait_s: float, ack: bool = False) -> int:
        """One poll; routes results into the stash (an abandoned job's is dropped). Returns the
        number received. Without anything expected it asks nothing, unless ``ack``: a poll that
        only acknowledges what the last reply carried."""
        with self._poll_lock:
            with self._lock:
                expecting = set(self._outstanding)
                if not expecting and not self._abandoned and not ack:
                    return 0
            from rolloutd.bus.messages import Poll

            p = self._poller
            body = p.request(Poll(client_id=self.client_id, after=p.after, max_results=self.max_results,
                                  wait_s=max(0.0, wait_s), inline_arrays=True), timeout_s=p.timeout_s + max(0.0, wait_s))
            p.after = max(p.after, body["last"])
            results = list(body["results"])
            with self._lock:
                for r in results:
                    jid = r["job_id"]
                    if jid in self._abandoned:
                        self._abandoned.discard(jid)
                        self.dropped_late += 1
                        self.late_statuses[r.get("status")] = self.late_statuses.get(r.get("status"), 0) + 1
                        continue
                    self._outstanding.discard(jid)
                    self._stash[jid] = r
                if not results and body.get("pending", 0) == 0 and body.get("ready", 0) == 0:
                    self._idle_polls += 1
                    if self._idle_polls >= LOST_AFTER_IDLE_POLLS:
                        lost = expecting & self._outstanding
                        self._lost |= lost
                        self._outstanding -= lost
                else:
                    self._idle_polls = 0
            return len(results)

    def _start_acker(self):
        """Acknowledge the late results of abandoned (cancelled) jobs in the background, now rather
        than at this client's next poll: until then the gateway holds them (``done_unacked``), and
        a client that polls no more would leave them for ``retention_s``."""
        with self._lock:
            if not self._abandoned or self._closed or (self._acker is not None and self._acker.is_alive()):
                return
            self._acker = threading.Thread(target=self._ack_late, name="rolloutd-batch-ack", daemon=True)
            self._acker.start()

    def _ack_late(self):
        until = time.monotonic() + LATE_ACK_S
        try:
            while not self._closed and time.monotonic() < until:
                with self._lock:
                    if not self._abandoned:
                        break
                self._poll(LATE_ACK_POLL_S)
            if not self._closed:
                self._poll(0.0, ack=True)  # the last reply's results are acknowledged by the next poll
        except (GatewayError, GatewayTimeout):
            pass  # the next poll of this client acknowledges them
        except Exception:  # noqa: BLE001 - e.g. the socket closed under it by close()
            if not self._closed:
                raise

    def _take(self, batch: Batch) -> list[dict]:
        out = []
        with self._lock:
            for jid in list(batch.pending):
                r = self._stash.pop(jid, None)
                if r is None and (jid in self._lost or jid not in self._outstanding):
                    # lost, or never submitted through this client: its result will not come
                    self._lost.discard(jid)
                    ti, s = batch.origin[jid]
                    r = placeholder(jid, batch.instance_ids[ti], s, "failed", "JobLost",
                                    "the gateway no longer knows this job (restarted without its journal?)",
                                    batch.handlers[ti])
                if r is not None:
                    batch.pending.discard(jid)
                    batch.delivered += 1
                    out.append(r)
        out.sort(key=batch.order_key)
        return out

    def _expire(self, batch: Batch, on_deadline: str) -> list[dict]:
        """The deadline passed: cancel what is missing and stand placeholders in for it."""
        missing = sorted(batch.pending)
        if on_deadline == "raise":
            raise GatewayTimeout(f"batch {batch.key}: {len(missing)} of {len(batch)} results missing at the deadline")
        with self._lock:
            self._abandoned.update(j for j in missing if j in self._outstanding)
            self._outstanding.difference_update(missing)
        try:
            self.cancel(missing)
        except (GatewayError, GatewayTimeout):
            pass  # best effort: the jobs' own timeout_s stops them anyway
        self._start_acker()
        out = []
        waited = time.monotonic() - batch.submitted_at
        for jid in missing:
            ti, s = batch.origin[jid]
            out.append(placeholder(jid, batch.instance_ids[ti], s, "timeout", "BatchDeadline",
                                   f"no result {waited:.1f}s after submit (batch deadline); cancelled",
                                   batch.handlers[ti]))
            batch.pending.discard(jid)
            batch.delivered += 1
        return out

    def results(self, batch: Batch, *, on_deadline: str = "cancel") -> Iterator[dict]:
        """Yield the batch's trajectories as they complete (``len(batch)`` of them in all)."""
        while batch.pending:
            got = self._take(batch)
            yield from got
            if not batch.pending:
                return
            left = batch.time_left()
            if left is not None and left <= 0:
                yield from self._expire(batch, on_deadline)
                return
            wait = self.poll_wait_s if left is None else min(self.poll_wait_s, max(0.0, left))
            self._poll(wait)  # everything still pending is outstanding (see _take)

    def gather(self, batch: Batch, *, on_deadline: str = "cancel") -> list[dict]:
        """The whole batch, in submission order (task by task, sample by sample)."""
        return sorted(self.results(batch, on_deadline=on_deadline), key=batch.order_key)

    def run(self, tasks: Sequence[dict], n: int = 1, *, deadline_s: float | None = None) -> list[dict]:
        """``submit`` + ``gather``."""
        return self.gather(self.submit(tasks, n, deadline_s=deadline_s))

    # -- whole groups: over-provisioning and dynamic sampling ------------------------------
    def sample_groups(self, tasks: Iterable[dict], n: int, *, want: int, accept=None, inflight: int | None = None,
                      refill: bool = True, deadline_s: float | None = None) -> GroupSample:
        """Run ``tasks`` as groups of ``n`` samples until ``want`` complete groups pass ``accept``.

        ``inflight`` groups (default ``want``) are submitted at once; with ``refill`` every group
        ``accept`` rejects is replaced by the next task, while ``tasks`` lasts. A group is complete
        when all ``n`` results are in (any status). At ``want`` kept groups, at the deadline
        (``deadline_s`` from now) or when no group can complete any more, every job not yet
        delivered is cancelled at the gateway, listed in ``cancelled`` with the gateway's answer,
        and its late result, if any, is acknowledged and dropped."""
        if want < 1 or n < 1:
            raise ValueError("sample_groups: want and n must be >= 1")
        accept = accept or (lambda g: True)
        source = iter(tasks)
        inflight = max(1, int(inflight if inflight is not None else want))
        t0 = time.monotonic()
        deadline = None if deadline_s is None else t0 + float(deadline_s)
        batches: list[Batch] = []
        buffers: dict[tuple[int, int], list[dict]] = {}   # (batch #, task index) -> results so far
        out = GroupSample([], [], [], [], [], {}, 0, 0, False, 0.0)

        def submit(k: int):
            chunk = list(itertools.islice(source, k))
            if chunk:
                b = self.submit(chunk, n, deadline_s=None)
                batches.append(b)
                out.submitted_groups += len(chunk)
                out.submitted_jobs += len(b)

        submit(inflight)
        if not batches:
            raise ValueError("sample_groups: no tasks")
        while True:
            got = 0
            for bi, b in enumerate(batches):
                for r in self._take(b):
                    got += 1
                    ti, _ = b.origin[r["job_id"]]
                    g = buffers.setdefault((bi, ti), [])
                    g.append(r)
                    if len(g) < b.n[ti]:
                        continue
                    del buffers[(bi, ti)]
                    g.sort(key=b.order_key)
                    if len(out.groups) >= want:
                        out.surplus.append(g)
                    elif accept(g):
                        out.groups.append(g)
                    else:
                        out.rejected.append(g)
                        if refill:
                            submit(1)
            if len(out.groups) >= want:
                break
            if not any(b.pending for b in batches):
                break  # the task source ran dry: nothing left that could complete
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                out.timed_out = True
                break
            if not got:
                self._poll(self.poll_wait_s if left is None else min(self.poll_wait_s, max(0.0, left)))
        # Stop: cancel what is not delivered; results of cut-off groups go to `partial`.
        missing = sorted(j for b in batches for j in b.pending)
        if missing:
            with self._lock:
                self._abandoned.update(j for j in missing if j in self._outstanding)
                self._outstanding.difference_update(missing)
            for b in batches:
                b.delivered += len(b.pending)
                b.pending.clear()
            try:
                reply = self.cancel(missing)
                out.cancel_outcome = {int(k): v for k, v in reply.items()}
            except (GatewayError, GatewayTimeout) as e:
                out.cancel_outcome = {j: f"unknown ({type(e).__name__})" for j in missing}
            self._start_acker()
        out.cancelled = missing
        out.partial = [r for g in buffers.values() for r in g]
        out.elapsed_s = time.monotonic() - t0
        return out

    def overprovision(self, tasks: Sequence[dict], n: int, *, want: int, extra: float = 0.25,
                      deadline_s: float | None = None) -> GroupSample:
        """Submit ``ceil(want * (1 + extra))`` of ``tasks`` at once, keep the first ``want``
        groups to complete, cancel the rest (a long tail of slow episodes no longer sets the
        step time)."""
        k = min(len(tasks), math.ceil(want * (1 + float(extra)) - 1e-9))
        if k < want:
            raise ValueError(f"overprovision: {len(tasks)} tasks for want={want}")
        return self.sample_groups(tasks[:k], n, want=want, inflight=k, refill=False, deadline_s=deadline_s)

    def dynamic_sample(self, tasks: Iterable[dict], n: int, *, want: int, inflight: int | None = None,
                       deadline_s: float | None = None, accept=has_reward_variance) -> GroupSample:
        """DAPO dynamic sampling: keep sampling groups from ``tasks`` until ``want`` of them have a
        non-zero reward variance (``accept``); ``inflight`` > ``want`` also over-provisions."""
        return self.sample_groups(tasks, n, want=want, accept=accept, inflight=inflight, refill=True,
                                  deadline_s=deadline_s)

    # -- asyncio ---------------------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and self._waiting:
                raise RuntimeError("BatchClient: async methods used from two event loops at once")
            self._loop = loop
            self._cond = asyncio.Condition()
            self._poll_task = None
            self._coalesce_task = None
            self._coalesce = []
        return loop

    async def asubmit(self, tasks: Sequence[dict], n: int = 1, *, deadline_s: float | None = None,
                      idempotency_key: str | None = None) -> Batch:
        loop = self._bind_loop()
        return await loop.run_in_executor(
            self._ctl_pool, lambda: self.submit(tasks, n, deadline_s=deadline_s, idempotency_key=idempotency_key))

    async def asubmit_one(self, task: dict, *, deadline_s: float | None = None) -> Batch:
        """Submit one task; calls made within ``coalesce_s`` of each other share one submit
        request (an agent-loop framework calls this once per sample, hundreds at a time)."""
        loop = self._bind_loop()
        fut = loop.create_future()
        self._coalesce.append((dict(task), deadline_s, fut))
        if self._coalesce_task is None or self._coalesce_task.done():
            self._coalesce_task = loop.create_task(self._flush_coalesced())
        return await fut

    async def _flush_coalesced(self):
        # Loops until a wait collects nothing: calls that arrive while a submit is in flight see
        # this task still running and only append, so it must come back for them (without the
        # loop they waited forever: a veRL V1 step hung on it).
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.coalesce_s)
            pending, self._coalesce = self._coalesce, []
            if not pending:
                return
            try:
                big = await loop.run_in_executor(self._ctl_pool, self.submit, [t for t, _, _ in pending], 1)
            except BaseException as e:  # noqa: BLE001 - every caller gets the error
                for _, _, fut in pending:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            it = iter(big.job_ids)
            for i, (t, deadline_s, fut) in enumerate(pending):
                ids = [next(it) for _ in range(big.n[i])]
                b = Batch(job_ids=ids, instance_ids=[big.instance_ids[i]], n=[big.n[i]], handlers=[big.handlers[i]],
                          deadline=None if deadline_s is None else time.monotonic() + float(deadline_s),
                          key=f"{big.key}/{i}")
                if not fut.done():
                    fut.set_result(b)

    async def _poll_loop(self):
        loop = asyncio.get_running_loop()
        try:
            while self._waiting > 0 and not self._closed:
                with self._lock:
                    busy = bool(self._outstanding)
                if busy:
                    await loop.run_in_executor(self._poll_pool, self._poll, self.poll_wait_s)
                else:
                    await asyncio.sleep(0.02)  # our jobs were received by a sync caller or are lost
                self._gen += 1
                async with self._cond:
                    self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - surfaced to every waiting consumer
            self._poll_error = e
            async with self._cond:
                self._cond.notify_all()

    def _ensure_poller(self):
        if self._poll_task is None or self._poll_task.done():
            self._poll_error = None
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_loop())

    async def aresults(self, batch: Batch, *, on_deadline: str = "cancel") -> AsyncIterator[dict]:
        """Async generator: the batch's trajectories as they complete."""
        loop = self._bind_loop()
        self._waiting += 1
        try:
            while batch.pending:
                gen = self._gen
                for r in self._take(batch):
                    yield r
                if not batch.pending:
                    return
                left = batch.time_left()
                if left is not None and left <= 0:
                    for r in await loop.run_in_executor(self._ctl_pool, self._expire, batch, on_deadline):
                        yield r
                    return
                if self._poll_error is not None:
                    raise self._poll_error
                self._ensure_poller()
                async with self._cond:
                    if self._gen == gen:
                        try:
                            await asyncio.wait_for(self._cond.wait(), min(left, 1.0) if left is not None else 1.0)
                        except asyncio.TimeoutError:
                            pass
        finally:
            self._waiting -= 1

    async def agather(self, batch: Batch, *, on_deadline: str = "cancel") -> list[dict]:
        out = [r async for r in self.aresults(batch, on_deadline=on_deadline)]
        return sorted(out, key=batch.order_key)

    async def arollout(self, task: dict, *, deadline_s: float | None = None) -> dict:
        """One sample of one task (coalesced with concurrent calls)."""
        batch = await self.asubmit_one(dict(task, n=1), deadline_s=deadline_s)
        (r,) = await self.agather(batch)
        return r


# ---------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------
def filter_ok(trajs: Iterable[dict]) -> list[dict]:
    """Only the trajectories that count for training (``status == "ok"``, a finite reward)."""
    return [t for t in trajs if trainable(t)]


def status_counts(trajs: Iterable[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trajs:
        out[t.get("status", "?")] = out.get(t.get("status", "?"), 0) + 1
    return out


def group_by_instance(trajs: Iterable[dict], key: str = "instance_id") -> dict[Any, list[dict]]:
    """Trajectories grouped by ``key`` (first-seen order of groups; by sample index within)."""
    groups: dict[Any, list[dict]] = {}
    for t in trajs:
        groups.setdefault(t[key], []).append(t)
    for g in groups.values():
        g.sort(key=lambda t: (t.get("sample_index", 0), t.get("job_id", 0)))
    return groups


def group_advantages(trajs: Sequence[dict], *, key: str = "instance_id", normalize: str = "std",
                     eps: float = 1e-6) -> np.ndarray:
    """GRPO outcome advantages, aligned with ``trajs``: ``(r - mean_g) / (std_g + eps)`` over the
    ``status == "ok"`` members of each group (std unbiased, as veRL's GRPO); ``normalize="none"``
    gives ``r - mean_g`` (Dr. GRPO). Failed trajectories, and groups with one ok member, get 0:
    an infrastructure failure neither counts as reward 0 nor shifts its siblings' baseline."""
    if normalize not in ("std", "none"):
        raise ValueError("normalize must be 'std' or 'none'")
    adv = np.zeros(len(trajs), np.float32)
    # group -> job -> row indices: rows of one job (segments of one trajectory, expand_segments)
    # are one sample of the group, counted once in its mean and std and given the same advantage.
    members: dict[Any, dict[Any, list[int]]] = {}
    for i, t in enumerate(trajs):
        if trainable(t):
            members.setdefault(t[key], {}).setdefault(t.get("job_id", ("row", i)), []).append(i)
    for jobs in members.values():
        if len(jobs) < 2:
            continue
        rows = list(jobs.values())
        r = np.asarray([reward_of(trajs[idx[0]]) for idx in rows], np.float64)
        a = r - r.mean()
        if normalize == "std":
            a = a / (r.std(ddof=1) + eps)
        for idx, ai in zip(rows, a):
            adv[idx] = np.float32(ai)
    return adv


def token_arrays(traj: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A trajectory's ``prompt_ids``, ``response_ids``, ``loss_mask`` (int64) and ``logprobs``
    (float32) as flat arrays; a response whose mask or logprobs differ in length is a ValueError."""
    prompt = np.asarray(traj.get("prompt_ids", ()), dtype=np.int64).reshape(-1)
    resp = np.asarray(traj.get("response_ids", ()), dtype=np.int64).reshape(-1)
    mask = np.asarray(traj.get("loss_mask", ()), dtype=np.int64).reshape(-1)
    lps = np.asarray(traj.get("logprobs", ()), dtype=np.float32).reshape(-1)
    if len(mask) != len(resp) or len(lps) != len(resp):
        raise ValueError(f"trajectory {traj.get('job_id')}: response_ids ({len(resp)}), loss_mask ({len(mask)}) and "
                         f"logprobs ({len(lps)}) differ in length")
    return prompt, resp, mask, lps


SEGMENT_KEYS = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "turns")


def token_policy_versions(traj: dict) -> np.ndarray:
    """The policy version that sampled each response token (int64, ``-1`` on observation tokens),
    from the turns' spans: ``turns[i]`` covers ``response_ids[start:end]`` at ``policy_version``
    (after a swap under ``stale_policy = "continue"`` one message spans two versions)."""
    n = len(traj.get("response_ids") if traj.get("response_ids") is not None else ())
    out = np.full(n, -1, np.int64)
    for turn in traj.get("turns") or ():
        start, end = turn.get("start"), turn.get("end")
        if start is None and turn.get("span") is not None:
            start, end = turn["span"]
        if start is not None and end is not None and turn.get("policy_version") is not None:
            out[int(start):int(end)] = int(turn["policy_version"])
    return out


def segments_of(traj: dict) -> list[dict]:
    """The token sequences of a trajectory, in order: its ``segments`` (2+ of them, each
    ``{"index", "prompt_ids", "response_ids", "loss_mask", "logprobs", "turns"}``), or the
    trajectory itself as the only one (index 0). The last is always the top-level arrays."""
    segs = traj.get("segments")
    if not segs:
        return [{"index": 0, **{k: traj.get(k, ()) for k in SEGMENT_KEYS}}]
    out = [dict(sg) for sg in segs]
    if [int(sg.get("index", i)) for i, sg in enumerate(out)] != list(range(len(out))):
        raise ValueError(f"trajectory {traj.get('job_id')}: segments are not indexed 0..{len(out) - 1} in order")
    return out


def expand_segments(trajs: Iterable[dict]) -> list[dict]:
    """One row per segment: a copy of the trajectory (reward, status, job id, instance id: the
    group) with the segment's arrays, ``segment_index`` and ``num_segments``; no ``segments`` key.
    A trajectory without segments is one row (``segment_index`` 0, ``num_segments`` 1)."""
    out = []
    for t in trajs:
        segs = segments_of(t)
        base = {k: v for k, v in t.items() if k != "segments"}
        for sg in segs:
            row = dict(base)
            row.update({k: sg.get(k, ()) for k in SEGMENT_KEYS})
            row["segment_index"], row["num_segments"] = int(sg.get("index", 0)), len(segs)
            out.append(row)
    return out


def collate(trajs: Sequence[dict], *, pad_id: int = 0, prompt_length: int | None = None,
            response_length: int | None = None, truncate: bool = False,
            pad_to_multiple_of: int = 1, segments: str = "last") -> dict[str, np.ndarray]:
    """Pad trajectories into arrays, the way veRL's agent loop does.

    Prompts are **left**-padded to ``P`` and responses **right**-padded to ``R`` (both default
    to the longest in the batch, rounded up to ``pad_to_multiple_of``), with ``pad_id``::

        input_ids      = [pad pad p1 p2 p3 | r1 r2 r3 r4 pad]
        attention_mask = [ 0   0   1  1  1 |  1  1  1  1   0]
        position_ids   = [ 0   0   0  1  2 |  3  4  5  6   6]   clip(cumsum(attention_mask) - 1, 0)
        loss_mask      =                    [ 1  1  0  1   0]   1 on sampled tokens only

    (veRL's ``compute_position_id_with_mask``; pads are masked, their positions do not matter.)
    The logit predicting response token ``j`` sits at column ``P + j - 1`` of the model output.

    Returns (``B`` trajectories):

    ============================  ==========  ==================================================
    ``prompts``                   [B, P] i64  left-padded prompt ids
    ``responses``                 [B, R] i64  right-padded response ids (sampled + observation)
    ``input_ids``                 [B, P+R]    ``prompts ++ responses``
    ``attention_mask``            [B, P+R]    1 on real tokens
    ``position_ids``              [B, P+R]    as above
    ``loss_mask``                 [B, R] i64  1 on sampled tokens of ``status == ok`` rows
                                              (veRL: ``response_mask``; same array)
    ``rollout_logprobs``          [B, R] f32  the service's logprobs, 0 on pads/masked tokens
    ``rewards``                   [B] f32     0 unless ``status == ok``
    ``token_level_rewards``       [B, R] f32  the reward on the last response token (veRL's
                                              ``rm_scores``)
    ``status``                    [B] bool    ``status == "ok"``: False rows are infrastructure
                                              failures (failed/timeout/cancelled/stale) to filter
    ``prompt_lengths``,
    ``response_lengths``          [B] i64     unpadded lengths (after truncation)
    ``truncated``                 [B] bool    the prompt or response was cut (``truncate=True``)
    ``policy_versions``           [B] i64     the first turn's policy version, -1 if none
    ``min_policy_versions``,
    ``max_policy_versions``       [B] i64     over all turns (-1 if none)
    ``token_policy_versions``     [B, R] i64  the version that sampled each response token
                                              (:func:`token_policy_versions`; -1 on pads and
                                              observations)
    ``job_ids``, ``sample_index``,
    ``segment_index``             [B] i64     (segment: which segment of its trajectory the row is)
    ``instance_ids``              [B] object
    ============================  ==========  ==================================================

    ``segments="expand"`` first makes one row per segment of each trajectory (:func:`expand_segments`:
    same reward on each segment's last token, same ``instance_ids``/``job_ids``; ``segment_index``
    says which); ``"last"`` (default) keeps the top-level arrays, i.e. the last segment.

    A prompt longer than ``prompt_length`` is left-truncated and a response longer than
    ``response_length`` right-truncated when ``truncate`` (veRL's behaviour); otherwise that
    is a ``ValueError``. Rows of failed jobs may be all padding (no tokens): keep them out of
    the model with ``status`` (or ``filter_ok`` before collating).
    """
    if segments not in ("last", "expand"):
        raise ValueError("collate: segments must be 'last' or 'expand'")
    if segments == "expand":
        trajs = expand_segments(trajs)
    B = len(trajs)
    arrays_in = [token_arrays(t) for t in trajs]
    mult = max(1, int(pad_to_multiple_of))

    def _round(x: int) -> int:
        return -(-x // mult) * mult

    P = int(prompt_length) if prompt_length is not None else _round(max((len(a[0]) for a in arrays_in), default=0))
    R = int(response_length) if response_length is not None else _round(max((len(a[1]) for a in arrays_in), default=0))
    prompts = np.full((B, P), pad_id, np.int64)
    responses = np.full((B, R), pad_id, np.int64)
    pmask = np.zeros((B, P), np.int64)
    rmask = np.zeros((B, R), np.int64)
    loss_mask = np.zeros((B, R), np.int64)
    logprobs = np.zeros((B, R), np.float32)
    rewards = np.zeros(B, np.float32)
    token_rewards = np.zeros((B, R), np.float32)
    status = np.zeros(B, bool)
    truncated = np.zeros(B, bool)
    plen = np.zeros(B, np.int64)
    rlen = np.zeros(B, np.int64)
    versions = np.full(B, -1, np.int64)
    vmin = np.full(B, -1, np.int64)
    vmax = np.full(B, -1, np.int64)
    tokver = np.full((B, R), -1, np.int64)
    job_ids = np.zeros(B, np.int64)
    sample_index = np.zeros(B, np.int64)
    segment_index = np.zeros(B, np.int64)
    instance_ids = np.empty(B, dtype=object)
    for i, t in enumerate(trajs):
        p, r, lm, lp = arrays_in[i]
        if len(p) > P:
            if not truncate:
                raise ValueError(f"trajectory {t.get('job_id')}: prompt of {len(p)} tokens > prompt_length {P}")
            p = p[len(p) - P:]
            truncated[i] = True
        if len(r) > R:
            if not truncate:
                raise ValueError(f"trajectory {t.get('job_id')}: response of {len(r)} tokens > response_length {R}")
            r, lm, lp = r[:R], lm[:R], lp[:R]
            truncated[i] = True
        ok = trainable(t)
        status[i] = ok
        plen[i], rlen[i] = len(p), len(r)
        if len(p):
            prompts[i, P - len(p):] = p
            pmask[i, P - len(p):] = 1
        if len(r):
            responses[i, :len(r)] = r
            rmask[i, :len(r)] = 1
            logprobs[i, :len(r)] = np.where(lm > 0, lp, 0.0)
            tokver[i, :len(r)] = token_policy_versions(t)[:len(r)]
            if ok:
                loss_mask[i, :len(r)] = (lm > 0)
        if ok:
            rewards[i] = reward_of(t)
            if len(r):
                token_rewards[i, len(r) - 1] = rewards[i]
        pv = t.get("policy_version")
        turn_versions = [int(x["policy_version"]) for x in t.get("turns") or () if x.get("policy_version") is not None]
        if pv is None and turn_versions:
            pv = turn_versions[0]
        versions[i] = -1 if pv is None else int(pv)
        if turn_versions:
            vmin[i], vmax[i] = min(turn_versions), max(turn_versions)
        elif pv is not None:
            vmin[i] = vmax[i] = int(pv)
        job_ids[i] = int(t.get("job_id", -1))
        sample_index[i] = int(t.get("sample_index", 0))
        segment_index[i] = int(t.get("segment_index", len(t.get("segments") or [None]) - 1))
        instance_ids[i] = t.get("instance_id")
    attention = np.concatenate([pmask, rmask], axis=1)
    position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "response_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "rewards": rewards,
        "token_level_rewards": token_rewards,
        "status": status,
        "prompt_lengths": plen,
        "response_lengths": rlen,
        "truncated": truncated,
        "policy_versions": versions,
        "min_policy_versions": vmin,
        "max_policy_versions": vmax,
        "token_policy_versions": tokver,
        "job_ids": job_ids,
        "sample_index": sample_index,
        "segment_index": segment_index,
        "instance_ids": instance_ids,
    }


def to_torch(arrays: dict[str, Any], device=None) -> dict[str, Any]:
    """The numeric arrays of ``collate`` as torch tensors (ids and masks int64, logprobs and
    rewards float32, ``status``/``truncated`` bool); object arrays are passed through."""
    import torch

    out: dict[str, Any] = {}
    seen: dict[int, Any] = {}
    for k, v in arrays.items():
        if isinstance(v, np.ndarray) and v.dtype != object:
            if id(v) in seen:            # aliases (loss_mask / response_mask) stay one tensor
                out[k] = seen[id(v)]
                continue
            t = torch.from_numpy(np.ascontiguousarray(v))
            out[k] = seen[id(v)] = t.to(device) if device is not None else t
        else:
            out[k] = v
    return out


def to_message_log(traj: dict, *, as_torch: bool = False, observation_role: str = "environment") -> list[dict]:
    """One trajectory as NeMo RL's ``message_log``: ``[{"role": "user", "token_ids"}, {"role":
    "assistant", "token_ids", "generation_logprobs"}, {"role": observation_role, "token_ids"}, ...]``.

    The response is split where ``loss_mask`` changes: runs of sampled tokens become assistant
    messages (with the service's logprobs as ``generation_logprobs``), runs of observation /
    template tokens become ``observation_role`` messages. Concatenating every ``token_ids`` gives
    exactly ``prompt_ids ++ response_ids`` (nothing is re-tokenized), so NeMo RL's own
    ``token_loss_mask`` rule (assistant messages only) reproduces ``loss_mask``. ``content`` is
    left empty: the token ids are the truth. Failed trajectories should be kept out of the loss
    with NeMo RL's per-sample ``loss_multiplier`` (0 where ``status != "ok"``)."""
    prompt, resp, mask, lps = token_arrays(traj)
    if as_torch:
        import torch

        def conv(a):
            return torch.from_numpy(np.ascontiguousarray(a))
    else:
        def conv(a):
            return a
    log = [{"role": "user", "content": "", "token_ids": conv(prompt)}]
    start = 0
    for end in range(1, len(resp) + 1):
        if end == len(resp) or mask[end] != mask[start]:
            sampled = mask[start] > 0
            m = {"role": "assistant" if sampled else observation_role, "content": "",
                 "token_ids": conv(resp[start:end].copy())}
            if sampled:
                m["generation_logprobs"] = conv(lps[start:end].copy())
            log.append(m)
            start = end
    return log
