"""A job's view of the LLM fleet: lease a backend from the router, generate, fail over.

The run daemon gives each job that needs an LLM an ``LLMSession``; it is the ``generate``
callable of the agent loop. The first call leases a backend for the whole job (prefix-cache
affinity). A backend that fails is reported to the router and the call is retried on a new
lease that excludes it. Every call returns the backend and policy version it used, so each
turn records them. ``close`` releases the lease however the job ended.

Getting a lease has one budget (``lease_wait_s``): the router holds a request while every
backend is busy, unhealthy or not yet registered, and an ``unavailable`` answer (the router
stopping, or silent because it died) is retried within that budget rather than failing the
job. Requests a dead router took with it are re-sent when its successor is seen.

``stale_policy = "continue"`` (``continue_stale``): when the run daemon learns that the version of
this job's lease is past ``max_policy_lag`` it calls :meth:`LLMSession.interrupt`. A call in flight
is aborted and comes back as a generation with ``finish_reason == "abort"`` holding the tokens
sampled before the abort, recorded at the old version; the caller continues the same assistant
message (the agent loop and the OpenAI endpoint already do after a server abort), and that next
call goes to a new lease on a current server. SGLang: ``/abort_request`` by rid, which returns the
tokens sampled so far. vLLM has no abort by id and closing the connection returns nothing, so under
``continue`` a vLLM call streams (``stream: true``, llm/client.py): the tokens arrive as they are
sampled, and the interrupt closes the stream and keeps what came (those sampled but not yet
received when the connection closes are lost; a call whose last chunk came first returns finished). Other policies call vLLM without streaming (its
cost: docs/TRAINERS.md).
"""
from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from rolloutd.bus.messages import BackendFailed, Lease, Release
from rolloutd.daemons.router_client import RouterClient, RouterError
from rolloutd.llm.client import BackendError, Generation, LLMClient, Partial

MAX_FAILOVERS = 3


class StaleLease(Exception):
    """The only lease to be had is older than the staleness bound allows."""


class ClientCache:
    """One pooled LLMClient per backend address, shared by every job of the daemon."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.clients: dict[tuple[str, str], object] = {}

    def get(self, address: str, api: str):
        key = (address, api)
        c = self.clients.get(key)
        if c is None:
            c = self.clients[key] = LLMClient(address, api=api, timeout=self.timeout_s)
        return c

    def evict(self, addresses) -> list:
        """Drop the clients of removed backends (a new backend at the same address gets a fresh
        client: new connection pool, model name resolved again). Returns them: close them once
        the jobs that may still hold them are done."""
        gone = set(addresses)
        return [self.clients.pop(k) for k in list(self.clients) if k[0] in gone]

    async def aclose(self):
        for c in self.clients.values():
            await c.aclose()
        self.clients.clear()


class LLMSession:
    def __init__(self, router: RouterClient, clients: ClientCache, job_id: int, lease_wait_s: float = 60.0,
                 call_timeout_s: float | None = None, is_stale=None, continue_stale: bool = False):
        self.router = router
        self.clients = clients
        self.job_id = job_id
        self.lease_wait_s = lease_wait_s
        self.call_timeout_s = call_timeout_s
        self.lease: dict | None = None
        self.failed: list[str] = []
        self.calls = 0
        self.is_stale = is_stale or (lambda version: False)
        self.continue_stale = continue_stale
        self._call: tuple | None = None  # (task, rid, client) of the generation in flight

    @property
    def policy_version(self) -> int | None:
        return None if self.lease is None else self.lease["policy_version"]

    async def _request_lease(self) -> dict:
        """A lease within the budget of ``lease_wait_s``, across router restarts."""
        deadline = time.monotonic() + self.lease_wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.router.request(
                    Lease(job_id=self.job_id, requester=self.router.requester, node=self.router.node,
                          exclude=list(self.failed), wait_s=max(0.0, left)),
                    timeout_s=max(0.0, left) + self.router.timeout_s)
            except RouterError as e:
                # "unavailable" is the router's state, not the job's fault: ask again while the
                # budget lasts (a stopping router's successor answers the next request).
                if e.code != "unavailable" or deadline - time.monotonic() <= 0.5:
                    raise
                await asyncio.sleep(0.2)

    async def acquire(self) -> dict:
        if self.lease is not None and self.continue_stale and self.is_stale(self.lease["policy_version"]):
            await self.close()  # continue: what is left of this job runs on a current server
        for _ in range(3):
            if self.lease is not None:
                return self.lease
            self.lease = await self._request_lease()
            if not self.is_stale(self.lease["policy_version"]):
                return self.lease
            if self.calls and not self.continue_stale:
                # Part of this job already ran on the old version: the daemon's staleness policy decides.
                raise StaleLease(self.lease["policy_version"])
            await self.close()  # granted just before a swap and not yet used: lease again
        raise StaleLease(-1)

    async def __call__(self, prompt_ids, params):
        for _ in range(MAX_FAILOVERS + 1):
            lease = await self.acquire()
            client = self.clients.get(lease["address"], lease["api"])
            version = lease["policy_version"]  # the version that samples this call's tokens
            rid = f"rolloutd-{self.job_id}-{uuid.uuid4().hex[:12]}" if lease["api"] == "sglang" else None
            # vLLM under continue: streamed, so an interrupt keeps the tokens that arrived
            partial = Partial() if self.continue_stale and lease["api"] == "vllm" else None
            task = asyncio.ensure_future(client.generate(prompt_ids, params, timeout=self.call_timeout_s, rid=rid,
                                                         partial=partial))
            self._call = (task, rid, client)
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                self._call = None
            try:
                if task.cancelled():  # interrupt() closed the connection (vLLM's abort): what was streamed
                    g = partial.generation() if partial is not None else Generation(
                        token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32), finish_reason="abort")
                else:
                    g = task.result()
                self.calls += 1
                return g, lease["backend_id"], version
            except BackendError as e:
                self.failed.append(lease["backend_id"])
                self.lease = None
                try:
                    await self.router.request(BackendFailed(lease_id=lease["lease_id"], backend_id=lease["backend_id"],
                                                            error=str(e)[:500]))
                except RouterError:
                    pass
                last = e
        raise last

    def interrupt(self) -> bool:
        """The lease's version is past the lag bound (``continue``): abort the call in flight, if
        any; it returns as an ``abort`` generation and the next call leases a current server.
        Between calls there is nothing to abort: the next ``acquire`` re-leases."""
        call = self._call
        if call is None:
            return False
        task, rid, client = call
        if rid is None:
            task.cancel()
        else:
            async def abort():
                if not await client.abort(rid):
                    task.cancel()  # the server would not abort it: closing the connection does
            self._aborting = asyncio.get_running_loop().create_task(abort())  # referenced until done
        return True

    def backend_versioned(self, backend_id: str, version: int):
        """The lease's server was registered again at ``version`` (weights reloaded in place):
        later calls on it are recorded at that version."""
        if self.lease is not None and self.lease["backend_id"] == backend_id:
            self.lease["policy_version"] = version

    async def close(self):
        lease, self.lease = self.lease, None
        if lease is not None:
            # Fire and forget: the slot frees one router round trip sooner. The router sees this
            # release before any later lease request of this daemon (same DEALER, in order); a
            # lost release expires when our heartbeats stop listing the lease.
            await self.router.send(Release(lease_id=lease["lease_id"]))

    def held(self) -> list | None:
        if self.lease is None:
            return None
        return [self.lease["lease_id"], self.lease["backend_id"], self.job_id, self.lease["policy_version"]]
