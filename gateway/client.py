"""The client shim trainers use to talk to the gateway.

A DEALER socket speaking the REQ envelope, so every call has a timeout: on a timeout the
socket is closed, reopened and the request sent again. That is safe because every request
is idempotent: submit carries an idempotency key, poll carries the sequence number it has
seen (a re-sent poll returns the same results), cancel answers with the job's outcome
(a retry says the same), status changes nothing.
"""
from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Iterable, Iterator

from rolloutd.bus import codec
from rolloutd.bus.messages import (PROTOCOL_VERSION, AddLLMServer, Cancel, ClearLLMServer, ListLLMServers, Poll, Start, Status,
                          Stop, Submit)
from rolloutd.bus.sockets import Closing, Sockets


# The gateway's default bounds on work per request (docs/PROTOCOL.md, "Bounds"): larger calls are split.
SUBMIT_JOBS = 4096
SUBMIT_VALUES = (1 << 19) - 64  # gateway.max_request_values, less the request's own fields
CANCEL_IDS = 10000


class GatewayError(RuntimeError):
    """The gateway answered with an error reply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class GatewayTimeout(TimeoutError):
    pass


class RolloutClient(Closing):
    def __init__(self, address: str | None = None, *, timeout_s: float = 10.0, retries: int = 3,
                 client_id: str | None = None, curve=None):
        if address is None:
            from rolloutd.bus.config import Config

            address = Config.load(None).endpoints.gateway
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sockets = Sockets(asyncio=False, curve=curve, linger_ms=0)
        self._sock = None
        self._req = itertools.count(1)
        self.after = 0          # highest result sequence number received; acknowledges all up to it

    # -- transport ---------------------------------------------------------------------
    def _socket(self):
        if self._sock is None:
            self._sock = self.sockets.connect("DEALER", self.address, hwm=1000)
        return self._sock

    def request(self, msg, timeout_s: float | None = None, retries: int | None = None) -> dict:
        """Send one request and return the reply body; raises GatewayError or GatewayTimeout.
        ``timeout_s`` and ``retries`` override the client's own for this call."""
        msg.req_id = next(self._req)
        frames = [b""] + codec.encode(msg.to_wire())
        wait = self.timeout_s if timeout_s is None else timeout_s
        tries = (self.retries if retries is None else retries) + 1
        for attempt in range(tries):
            sock = self._socket()
            sock.send_multipart(frames, copy=False)
            deadline = time.monotonic() + wait
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    break
                reply = sock.recv_multipart(copy=False)
                rest = reply[1:] if reply and len(reply[0]) == 0 else reply
                header = codec.decode(rest)
                if header.get("req_id") != msg.req_id:
                    continue  # a late reply to an earlier, abandoned try
                if header.get("kind") == "error":
                    raise GatewayError(header.get("code", "?"), header.get("message", ""))
                if header.get("v") != PROTOCOL_VERSION:
                    raise GatewayError("bad_version", f"gateway speaks protocol {header.get('v')}")
                return header.get("body", {})
            # No answer: start over on a fresh socket (the old one may hold a dead connection).
            self.sockets.forget(sock)
            self._sock = None
        raise GatewayTimeout(f"no reply from {self.address} after {tries} tries of {wait:.1f}s")

    def close(self):
        self.sockets.close()

    # -- operations ----------------------------------------------------------------------
    def submit(self, tasks: Iterable[dict], n: int | None = None, idempotency_key: str | None = None) -> list[int]:
        """Submit tasks (``{"handler", "instance", "instance_id", "n", "timeout_s"}``); returns job ids,
        ``n`` per task in order."""
        tasks = [dict(t, n=n) if n is not None else dict(t) for t in tasks]
        key = idempotency_key or uuid.uuid4().hex
        # In requests of at most SUBMIT_JOBS jobs and SUBMIT_VALUES values (the gateway's default
        # gateway.max_request_jobs and max_request_values); each part has its own key (the first
        # the given one), so a retried submit repeats none.
        parts, part, jobs, values = [], [], 0, 0
        for t in tasks:
            k, v = int(t.get("n") or 1), codec.count_values(t) + 1
            if part and (jobs + k > SUBMIT_JOBS or values + v > SUBMIT_VALUES):
                parts.append(part)
                part, jobs, values = [], 0, 0
            part.append(t)
            jobs += k
            values += v
        parts.append(part)
        job_ids: list[int] = []
        for i, p in enumerate(parts):
            body = self.request(Submit(tasks=p, client_id=self.client_id, idempotency_key=key if i == 0 else f"{key}#{i}"))
            job_ids += body["job_ids"]
        return job_ids

    def poll(self, wait_s: float = 0.0, max_results: int = 256) -> list[dict]:
        """Results finished since the last poll (acknowledging everything before)."""
        body = self.request(Poll(client_id=self.client_id, after=self.after, max_results=max_results, wait_s=wait_s,
                                 inline_arrays=True),
                            timeout_s=self.timeout_s + wait_s)
        # Results come in sequence order after ``self.after``; a re-sent poll (lost reply) asks for the
        # same ``after`` and gets the same results, so each is delivered here exactly once.
        self.after = max(self.after, body["last"])
        return list(body["results"])

    def gather(self, job_ids: Iterable[int] | None = None, timeout_s: float | None = None,
               wait_s: float = 1.0) -> Iterator[dict]:
        """Yield results as they complete, until every job in ``job_ids`` (or every pending job) is in."""
        want = set(job_ids) if job_ids is not None else None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while want is None or want:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise GatewayTimeout(f"{len(want) if want else 'some'} results still missing at the deadline")
            body_results = self.poll(wait_s=min(wait_s, left) if left is not None else wait_s)
            for r in body_results:
                if want is not None:
                    want.discard(r["job_id"])
                yield r
            if want is None and not body_results and self._pending() == 0:
                return

    def _pending(self) -> int:
        body = self.request(Poll(client_id=self.client_id, after=self.after, max_results=1, wait_s=0, inline_arrays=True))
        return body["pending"] + body["ready"] + len(body["results"])

    def rollout(self, handler: str, instance: dict, timeout_s: float | None = None, **task) -> dict:
        """Run one instance once and return its trajectory."""
        (jid,) = self.submit([dict(task, handler=handler, instance=instance)])
        for r in self.gather([jid], timeout_s=timeout_s):
            return r
        raise GatewayTimeout(f"job {jid} did not finish")

    def cancel(self, job_ids: Iterable[int]) -> dict:
        """Each job's answer (job id as a string -> cancelled | cancelling | already_finished |
        not_found), asked CANCEL_IDS at a time (the gateway's default gateway.max_request_ids)."""
        ids, out = list(job_ids), {}
        for i in range(0, max(1, len(ids)), CANCEL_IDS):
            out.update(self.request(Cancel(job_ids=ids[i:i + CANCEL_IDS]))["jobs"])
        return out

    def status(self) -> dict:
        return self.request(Status())

    def add_backend(self, address: str, api: str = "vllm", policy_version: int = 0, capacity: int = 0,
                    weight: float = 1.0, node: str = "", shard: int = -1) -> dict:
        """``shard``: with router.shards > 1, the router shard that holds it (-1: by address hash)."""
        return self.request(AddLLMServer(address=address, api=api, policy_version=policy_version,
                                         capacity=capacity, weight=weight, node=node, shard=shard))["backend"]

    def clear_backends(self, address: str | None = None) -> list[str]:
        return self.request(ClearLLMServer(address=address))["cleared"]

    def list_backends(self) -> dict:
        return self.request(ListLLMServers())

    def pause(self):
        return self.request(Stop())

    def resume(self):
        return self.request(Start())
