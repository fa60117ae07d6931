"""Lease traffic in batches (issue 29): the run daemon's lease requests and releases of one tick
travel as one ``lease_batch`` message, with real daemons and scripted vLLM-API backends."""
from __future__ import annotations

import os
import signal

import msgpack
import zmq

from tests.conftest import synthetic, wait_for


def llm_job(i, calls=2):
    return synthetic(i, llm_calls=calls, max_tokens=2, think={"dist": "uniform", "low": 0.05, "high": 0.2}) | {
        "handler": "synthetic_llm"}


def run_inflight(c) -> int:
    return sum(d.get("inflight", 0) for d in c.status().get("daemons", []) if d.get("daemon") == "run")


def test_leases_and_releases_travel_in_batches_and_waiting_members_are_granted_later(up, backends):
    b = backends(latency=0.1)
    router = up.daemon_pid("router")
    n = 8
    with up.client() as c:
        c.add_backend(b.url, capacity=2)  # 8 jobs, 2 slots: most lease requests must wait
        wait_for(lambda: all(x["healthy"] for x in c.list_backends()["backends"]), what="backend admitted")
        # Hold the router while the jobs reach the run daemon: their lease requests queue behind
        # an unanswered batch and go out together when it answers (or after hold_max_s).
        os.kill(router, signal.SIGSTOP)
        try:
            ids = c.submit([llm_job(i) for i in range(n)])
            wait_for(lambda: run_inflight(c) >= n, timeout_s=60, what="every job in the run daemon")
        finally:
            os.kill(router, signal.SIGCONT)
        results = list(c.gather(ids, timeout_s=120))
        assert len(results) == n
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        wait_for(lambda: c.list_backends()["leases"] == 0, what="every lease released")
        body = c.list_backends()
        t = body["lease_traffic"]
        assert body["backends"][0]["inflight"] == 0 and body["backends"][0]["leases_total"] >= n, body
        # Every lease and release of the run daemon came in a batch, never as a message of its own.
        assert t["batched_leases"] >= n and t["batched_releases"] >= n, t
        assert t["lease_msgs"] == t["batches"], t
        # Fewer messages than operations: the requests queued while the router was held went out together.
        assert t["max_batch"] >= 2, t
        assert t["batches"] < t["batched_leases"] + t["batched_releases"], t
        # Members that had to wait for a free slot were granted later, each on its own reply.
        assert t["granted_later"] >= 1, t


def test_a_raw_client_still_speaks_single_lease_and_release_and_gets_batch_errors(up, backends):
    """The single-op messages of docs/PROTOCOL.md still work beside batches; a bad member is refused
    on its own (its req_id named) while the rest of its batch is served."""
    b = backends(latency=0.01)
    with up.client() as c:
        c.add_backend(b.url)
        wait_for(lambda: all(x["healthy"] for x in c.list_backends()["backends"]), what="backend admitted")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    try:
        s.connect(f"ipc://{up.runtime_dir}/router.sock")

        def ask(msg):
            s.send_multipart([b"", msgpack.packb({"v": 1} | msg)])
            return msgpack.unpackb(s.recv_multipart()[-1])

        one = ask({"kind": "lease", "job_id": 1, "requester": "raw", "wait_s": 0.0, "req_id": 5})
        assert one["req_id"] == 5 and one["body"]["backend_id"] == b.url, one
        batch = ask({"kind": "lease_batch", "requester": "raw", "req_id": 6, "releases": [one["body"]["lease_id"]],
                     "leases": [{"job_id": 2, "wait_s": 0.0, "req_id": 7}, {"job_id": "x", "req_id": 8}]})
        body = batch["body"]
        assert batch["req_id"] == 6 and body["released"] == 1 and 0 <= body["batch_s"] <= 0.25, batch
        assert [g["req_id"] for g in body["granted"]] == [7] and body["granted"][0]["address"] == b.url, batch
        assert len(body["errors"]) == 1 and body["errors"][0][:2] == [8, "invalid"], batch
        assert "job_id" in body["errors"][0][2], batch
        rel = ask({"kind": "release", "lease_id": body["granted"][0]["lease_id"], "req_id": 9})
        assert rel["req_id"] == 9 and rel["body"]["released"] is True, rel
        with up.client() as c:
            assert c.list_backends()["leases"] == 0
    finally:
        s.close()
        ctx.term()
