"""The gateway's job table: every job not yet acknowledged, the dispatch queue, and one
ordered result stream per client (sequence numbers make re-sent polls idempotent)."""
from __future__ import annotations

import collections
import dataclasses
import time


@dataclasses.dataclass(slots=True)
class JobRecord:
    job_id: int
    client_id: str
    spec: dict                    # handler, instance, instance_id, sample_index, budget_s, phase_limits
    attempt: int = 1
    state: str = "queued"         # queued | dispatched | done
    seq: int = 0                  # position in the client's result stream, once done
    result: list | None = None    # encoded result frames, kept until acknowledged
    last_seen: float = 0.0        # monotonic time a heartbeat last listed it (or it was dispatched)
    holder: str = ""              # "daemon@node#incarnation" that last listed it
    cancel_requested: bool = False
    submitted: float = 0.0        # wall clock at submit (0 for jobs recovered from the journal)
    status: str = ""              # the result's status, once done ("" until known for recovered results)


@dataclasses.dataclass
class ClientStream:
    next_seq: int = 1
    acked: int = 0
    sent: int = 0                  # highest sequence number a poll reply has carried to this client
    pending: int = 0               # jobs submitted and not yet done
    ready: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # seq -> job_id
    seen: float = dataclasses.field(default_factory=time.time)


class JobTable:
    def __init__(self):
        self.jobs: dict[int, JobRecord] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.clients: dict[str, ClientStream] = {}
        self.idem: dict[tuple[str, str], list[int]] = {}
        self.totals = collections.Counter()

    def client(self, client_id: str) -> ClientStream:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = ClientStream()
        return c

    def touch(self, client_id: str) -> ClientStream:
        """The client spoke to us (submit or poll): its retention clock restarts."""
        c = self.client(client_id)
        c.seen = time.time()
        return c

    def add(self, rec: JobRecord):
        self.jobs[rec.job_id] = rec
        if rec.state == "queued":
            self.queue.append(rec.job_id)
        if rec.state != "done":
            self.client(rec.client_id).pending += 1

    def finish(self, rec: JobRecord, frames, status: str) -> int:
        """Mark done and append to the client's stream; returns the sequence number."""
        c = self.client(rec.client_id)
        rec.state = "done"
        rec.result = frames
        rec.status = status
        rec.seq = c.next_seq
        c.next_seq += 1
        c.pending = max(0, c.pending - 1)
        c.ready[rec.seq] = rec.job_id
        self.totals["done"] += 1
        return rec.seq

    def ack(self, client_id: str, upto: int) -> int:
        """Forget results <= ``upto``. Callers check ``upto <= sent`` first: only what a poll
        reply carried may be acknowledged."""
        c = self.clients.get(client_id)
        if c is None or upto <= c.acked:
            return 0
        n = 0
        while c.ready:
            seq, jid = next(iter(c.ready.items()))
            if seq > upto:
                break
            c.ready.popitem(last=False)
            self.jobs.pop(jid, None)
            n += 1
        c.acked = upto
        return n

    def ready_after(self, client_id: str, after: int, limit: int) -> list[JobRecord]:
        c = self.clients.get(client_id)
        if c is None:
            return []
        out = []
        for seq, jid in c.ready.items():
            if seq > after:
                out.append(self.jobs[jid])
                if len(out) >= limit:
                    break
        return out

    def counts(self) -> dict:
        by_state = collections.Counter(r.state for r in self.jobs.values())
        return {"queued": len(self.queue), "dispatched": by_state["dispatched"], "done_unacked": by_state["done"]}
