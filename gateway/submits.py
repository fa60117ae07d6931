"""Submits worked through in slices (issue 38): a submit's tasks are checked, then its jobs made
and journalled, ``SUBMIT_SLICE`` items per gateway loop turn (or fewer: a turn's slice stops after
``SLICE_S``, so a loaded machine gets smaller slices, not longer turns), and it is answered after
the last. In one turn, 4,096 one-sample tasks held the gateway's loop 135-215 ms (every other
client waited); a slice is a few milliseconds. What a client sees does not change:

- refused (a bad task, an unknown handler, too many jobs): nothing was made, since every task is
  checked before the first job is;
- accepted: every job is journalled before the reply, and the jobs join the job table (and the
  dispatch queue) in the turn of the reply, all together;
- a retry with the same ``(client_id, idempotency_key)`` gets the same job ids (``duplicate:
  true``), also one that comes while the first try is still being worked through: it is answered
  when the first one is;
- a gateway killed part-way: the rows written so far sit under an ``open_submits`` mark in the
  journal, which recovery deletes with them (the submit was never answered; a retry makes it anew).

A task run ``n > 1`` times keeps one instance for its samples: in memory (one object), in the
journal (one row) and on the way to the init daemons (packed once, ``JobRecord.instance_wire``).
"""
from __future__ import annotations

import dataclasses
import time

from rolloutd.bus import codec
from rolloutd.bus.messages import MessageError, Submit
from rolloutd.gateway.jobs import JobRecord

SUBMIT_SLICE = 512  # tasks checked or jobs made per loop turn (~20 us a job at load ~6: ~10 ms)
SLICE_S = 0.02      # ...and no more once a turn's slice has taken this long (a cancel's too)
STEP = 32           # items between two looks at the clock


@dataclasses.dataclass(slots=True)
class OpenSubmit:
    route: list
    msg: Submit
    key: tuple | None
    retries: list = dataclasses.field(default_factory=list)  # (route, req_id) of retries waiting for it
    checked: int = 0        # tasks checked so far
    first: int = 0          # its job ids are first .. first + jobs - 1 (reserved once every task passed)
    jobs: int = 0
    task: int = 0           # where making jobs goes on: task index, sample index
    sample: int = 0
    made: list = dataclasses.field(default_factory=list)  # JobRecords, joining the table at the end
    base: dict | None = None  # the current task's spec without its sample index
    wire: list | None = None  # the current task's instance, packed once for its samples


class Submits:
    """The open submits, oldest first. The gateway calls ``start`` for each submit request and
    ``work`` once per loop turn; ``reply`` and ``error`` queue answers as the gateway's own do."""

    def __init__(self, gw):
        self.gw = gw
        self.queue: list[OpenSubmit] = []
        self.by_key: dict[tuple, OpenSubmit] = {}

    def __bool__(self) -> bool:
        return bool(self.queue)

    def start(self, route, msg: Submit):
        key = (msg.client_id, msg.idempotency_key) if msg.idempotency_key else None
        if key and key in self.gw.table.idem:
            self.gw._reply(route, msg.req_id, job_ids=self.gw.table.idem[key], duplicate=True)
        elif key and key in self.by_key:
            self.by_key[key].retries.append((route, msg.req_id))
        else:
            s = OpenSubmit(route, msg, key)
            self.queue.append(s)
            if key:
                self.by_key[key] = s

    def work(self, budget: int = SUBMIT_SLICE, until: float | None = None):
        """Up to ``budget`` tasks checked or jobs made, oldest submit first, until ``time.perf_counter()``
        passes ``until`` (default: ``SLICE_S`` from now), at least ``STEP`` of them. Writes go to the
        journal's pending statements: the gateway commits them at the end of the turn."""
        until = time.perf_counter() + SLICE_S if until is None else until
        first = True
        while self.queue and budget > 0 and (first or time.perf_counter() < until):
            first = False
            s = self.queue[0]
            step = min(budget, STEP)
            try:
                budget -= self._check(s, step) if s.checked < len(s.msg.tasks) else self._make(s, step)
            except MessageError as e:
                self._end(s, error=(e.code, e.message))
            except Exception as e:  # noqa: BLE001 - a bug still owes the client its one reply
                self.gw.log.error("request_failed", kind="submit", error=f"{type(e).__name__}: {e}")
                self._end(s, error=("internal", f"{type(e).__name__}: {e}"))

    def _check(self, s: OpenSubmit, budget: int) -> int:
        tasks, handlers = s.msg.tasks, self.gw.handlers
        stop = min(len(tasks), s.checked + budget)
        s.msg.check_tasks(s.checked, stop)
        for i in range(s.checked, stop):
            if tasks[i]["handler"] not in handlers:
                raise MessageError("unknown_handler", f"tasks[{i}]: no handler named {tasks[i]['handler']!r}; "
                                   f"registered: {', '.join(sorted(handlers))}")
        done, s.checked = stop - s.checked, stop
        if s.checked == len(tasks):
            cap, n = int(self.gw.gcfg["max_request_jobs"]), sum(t.get("n", 1) for t in tasks)
            if n > cap:
                raise MessageError("invalid", f"submit would create {n} jobs (the sum of its tasks' n); at most {cap} "
                                   "per request (gateway.max_request_jobs): split the tasks over several submits")
            s.first, s.jobs = self.gw.next_job_id, n
            self.gw.next_job_id += n
            self.gw.journal.open_submit(s.first, s.first + n - 1)
        return done

    def _make(self, s: OpenSubmit, budget: int) -> int:
        tasks, cid, journal = s.msg.tasks, s.msg.client_id, self.gw.journal
        default_budget = float(self.gw.gcfg["default_budget_s"])
        rows, made, now = [], 0, time.time()
        jid = s.first + len(s.made)
        while made < budget and s.task < len(tasks):
            t = tasks[s.task]
            n = t.get("n", 1)
            if s.sample == 0:
                # Default: unique per task across submits (job ids never repeat), so GRPO grouping by
                # instance_id never merges two unrelated tasks. All n samples of the task share it.
                iid = t.get("instance_id")
                s.base = {"handler": t["handler"], "instance": t.get("instance", {}),
                          "instance_id": f"auto-{jid}" if iid is None else iid,
                          "budget_s": float(t.get("timeout_s") or default_budget),
                          "phase_limits": t.get("phase_timeouts") or {}}
                s.wire = None
                if n > 1:
                    journal.add_instance(jid, n, s.base["instance"])
                    s.wire = codec.encode(s.base["instance"])
            ref = jid - s.sample if n > 1 else None
            while s.sample < n and made < budget:
                spec = dict(s.base, sample_index=s.sample)
                rec = JobRecord(jid, cid, spec, submitted=now)
                rec.instance_wire = s.wire
                s.made.append(rec)
                rows.append((jid, cid, spec, ref))
                jid += 1
                s.sample += 1
                made += 1
            if s.sample == n:
                s.task, s.sample = s.task + 1, 0
        journal.add_jobs(rows)
        if s.task == len(tasks):
            self._end(s)
        return max(made, 1)

    def _end(self, s: OpenSubmit, error: tuple[str, str] | None = None):
        self.queue.remove(s)
        if s.key:
            self.by_key.pop(s.key, None)
        gw = self.gw
        if error is not None:
            if s.jobs:  # part-way through making jobs (only a bug gets here): undo what it wrote
                gw.journal.drop_submit(s.first, s.first + s.jobs - 1)
            for route, req_id in [(s.route, s.msg.req_id), *s.retries]:
                gw._error(route, req_id, *error)
            return
        job_ids = list(range(s.first, s.first + s.jobs))
        gw.journal.close_submit(s.first)
        gw.table.add_many(s.made)
        c = gw.table.touch(s.msg.client_id)
        gw.journal.set_client(s.msg.client_id, c.next_seq, c.acked)
        if s.key:
            gw.table.idem[s.key] = job_ids
            gw.journal.add_idempotency(s.msg.client_id, s.msg.idempotency_key, job_ids)
        gw.table.totals["submitted"] += len(job_ids)
        gw._reply(s.route, s.msg.req_id, job_ids=job_ids, duplicate=False)
        for route, req_id in s.retries:
            gw._reply(route, req_id, job_ids=job_ids, duplicate=True)
