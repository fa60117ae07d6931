"""A run daemon upgraded before its head: its RouterClient meets a router that predates
``lease_batch``. The old router answers the batch ``unknown_kind`` (bus.messages.from_wire with the
old router's kinds, exactly as it did); the client must then send that batch's operations, and
every later one, as single ``lease``/``release`` messages, so no job waits out its lease budget."""
from __future__ import annotations

import asyncio

import zmq

from rolloutd.bus import codec
from rolloutd.bus.endpoints import Endpoints
from rolloutd.bus.messages import Error, Lease, MessageError, Release, Reply, from_wire
from rolloutd.bus.sockets import Sockets
from rolloutd.daemons.router_client import RouterClient

OLD_KINDS = ("lease", "release", "backend_failed", "add_llm_server", "clear_llm_server", "list_llm_servers")


async def _old_router(sock, seen: list, stop: asyncio.Event):
    """The pre-batch router's request handling: from_wire with its kinds, one reply per message."""
    n = 0
    while not stop.is_set():
        if not await sock.poll(50):
            continue
        frames = await sock.recv_multipart()
        route, rest = frames[:2], frames[2:]
        try:
            msg = from_wire(codec.decode(rest), expect=OLD_KINDS)
        except MessageError as e:
            seen.append("refused:" + codec.decode(rest)["kind"])
            out = Error(code=e.code, message=str(e), req_id=codec.peek_req_id(rest))
        else:
            seen.append(msg.KIND)
            n += msg.KIND == "lease"
            body = {"lease_id": f"L{n}", "backend_id": "b", "address": "http://127.0.0.1:9", "api": "vllm",
                    "policy_version": 0} if msg.KIND == "lease" else {"released": True}
            out = Reply(req_id=msg.req_id, body=body)
        await sock.send_multipart(route + codec.encode(out.to_wire()))


def test_a_router_without_lease_batch_gets_single_messages(tmp_path):
    async def main():
        ep = Endpoints.local(tmp_path)
        server = Sockets(ep, linger_ms=0)
        client = Sockets(ep, linger_ms=0)
        try:
            sock = server.bind("ROUTER", "router")
            rc = RouterClient(client, requester="run@n1", node="n1")
            rc.sock.setsockopt(zmq.LINGER, 0)
            seen: list[str] = []
            stop = asyncio.Event()
            srv = asyncio.create_task(_old_router(sock, seen, stop))
            rc.start()
            try:
                first = await asyncio.gather(*(rc.request(Lease(job_id=i, wait_s=1.0), timeout_s=10) for i in range(3)))
                assert sorted(g["lease_id"] for g in first) == ["L1", "L2", "L3"], first
                assert rc.single and seen[0] == "refused:lease_batch", seen
                await rc.send(Release(lease_id="L1"))
                later = await rc.request(Lease(job_id=9, wait_s=1.0), timeout_s=10)
                assert later["lease_id"] == "L4"
                for _ in range(100):
                    if seen.count("release") == 1:
                        break
                    await asyncio.sleep(0.02)
                # one refused batch, then one message per operation
                assert seen == ["refused:lease_batch", "lease", "lease", "lease", "release", "lease"], seen
            finally:
                stop.set()
                rc.stop()
                await srv
        finally:
            client.close()
            server.close()

    asyncio.run(main())
