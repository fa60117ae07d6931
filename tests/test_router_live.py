"""The router daemon with live scripted vLLM-API backends: leases, failover, health, swaps."""
from __future__ import annotations

import os
import signal
import struct
import time

import pytest

from tests.conftest import synthetic, wait_for


def llm_job(i, calls=2, think=None, **kw):
    return synthetic(i, llm_calls=calls, max_tokens=2, think=think, **kw) | {"handler": "synthetic_llm"}


def idle(c):
    body = c.list_backends()
    return body["leases"] == 0 and all(b["inflight"] == 0 for b in body["backends"])


def test_leases_balance_turn_versions_and_release(up, backends):
    bs = [backends(latency=0.02) for _ in range(3)]
    with up.client() as c:
        for b in bs:
            c.add_backend(b.url, policy_version=0)
        # All three admitted first (a health check each; slower on a loaded machine): the spread
        # asserted below is the router's, not the order in which the checks happened to pass.
        wait_for(lambda: all(b["healthy"] for b in c.list_backends()["backends"]), what="all three backends admitted")
        ids = c.submit([llm_job(i, calls=1 + i % 4, think={"dist": "uniform", "low": 0, "high": 0.05}) for i in range(60)])
        results = list(c.gather(ids, timeout_s=120))
        assert len(results) == 60
        for r in results:
            assert r["status"] == "ok", r["error"]
            assert len(r["turns"]) == 1 + int(r["instance_id"][1:]) % 4
            assert all(t["policy_version"] == 0 and t["backend"] in {b.url for b in bs} for t in r["turns"])
            assert len(r["response_ids"]) == len(r["logprobs"]) == len(r["loss_mask"]) > 0
            # a lease covers the whole job: every turn of one job hit the same backend
            assert len({t["backend"] for t in r["turns"]}) == 1
        wait_for(lambda: idle(c), what="every lease released")
        body = c.list_backends()
        assert all(b["leases_total"] >= 10 for b in body["backends"]), body  # spread over all three


def test_run_daemon_death_expires_its_leases(up_factory, backends):
    up = up_factory("router.lease_ttl_s=2", "gateway.daemon_dead_s=3")
    b = backends(latency=0.3)
    with up.client() as c:
        c.add_backend(b.url)
        ids = c.submit([llm_job(i, calls=8) for i in range(6)])
        wait_for(lambda: c.list_backends()["leases"] >= 6, what="leases taken")
        os.kill(up.daemon_pid("run"), signal.SIGKILL)
        results = list(c.gather(ids, timeout_s=120))
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        assert all(r["attempts"] == 2 for r in results)  # each was re-dispatched once
        wait_for(lambda: idle(c), what="dead daemon's leases expired")


def test_failed_backend_leaves_rotation_and_is_readmitted(up_factory, backends):
    up = up_factory("router.health_interval_s=0.3", "router.health_failures=2")
    good, bad = backends(latency=0.05), backends(latency=0.05)
    port = bad.port
    with up.client() as c:
        def health():
            return {b["address"]: b["healthy"] for b in c.list_backends()["backends"]}

        c.add_backend(good.url)
        c.add_backend(bad.url)
        # A backend serves once its first health check passed: jobs submitted before the second
        # one's all leased the first (a lease covers a job), and it never served (a loaded CI run).
        wait_for(lambda: health() == {good.url: True, bad.url: True}, what="both backends in rotation")
        ids = c.submit([llm_job(i, calls=6) for i in range(10)])
        wait_for(lambda: bad.stats["requests"] >= 12, what="the doomed backend serving")
        bad.stop()  # mid-run: its jobs fail over to the other backend
        results = list(c.gather(ids, timeout_s=120))
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        assert any(len({t["backend"] for t in r["turns"]}) == 2 for r in results), [  # some moved mid-job
            [t["backend"][-5:] for t in r["turns"]] for r in results] + [bad.stats, good.stats]

        wait_for(lambda: health()[bad.url] is False, what="bad backend out of rotation")
        backends(latency=0.05, port=port)  # the server comes back on the same address
        wait_for(lambda: health()[bad.url] is True, what="backend re-admitted")
        r = c.rollout("synthetic_llm", {"llm_calls": 1}, timeout_s=30)
        assert r["status"] == "ok"


@pytest.mark.parametrize("policy", ["finish", "abort_requeue", "drop"])
def test_checkpoint_swap_with_staleness_policy(up_factory, backends, policy):
    up = up_factory("router.max_policy_lag=0", f"router.stale_policy={policy}")
    old, new = backends(latency=0.15), backends(latency=0.01)
    with up.client() as c:
        c.add_backend(old.url, policy_version=0)
        ids = c.submit([llm_job(i, calls=8) for i in range(6)])
        wait_for(lambda: c.list_backends()["leases"] >= 6, what="jobs running on version 0")
        assert c.clear_backends() == [old.url]
        c.add_backend(new.url, policy_version=1)
        late = c.submit([llm_job(100 + i, calls=2) for i in range(3)])
        results = {r["job_id"]: r for r in c.gather(ids + late, timeout_s=120)}
    early = [results[j] for j in ids]
    for r in (results[j] for j in late):  # started after the swap: version 1 throughout
        assert r["status"] == "ok" and {t["policy_version"] for t in r["turns"]} == {1}
    if policy == "finish":
        assert all(r["status"] == "ok" for r in early)
        assert all({t["policy_version"] for t in r["turns"]} == {0} for r in early)
    elif policy == "abort_requeue":
        assert all(r["status"] == "ok" for r in early)
        assert all({t["policy_version"] for t in r["turns"]} == {1} for r in early), [
            (r["attempts"], [t["policy_version"] for t in r["turns"]]) for r in early]
        assert any(r["attempts"] == 2 for r in early)  # stopped and run again (one whose lease came
        # just before the swap, unused, simply leases again)
    else:
        assert all(r["status"] == "failed" and r["stale"] and r["error"]["type"] == "StalePolicy" for r in early)
        assert all(r["failed_phase"] == "run" for r in early)


def test_router_restart_rebuilds_backends_and_leases(up_factory, backends):
    up = up_factory("router.lease_ttl_s=3")
    b = backends(latency=1.0)  # 10 calls: the jobs outlive the router's restart
    with up.client() as c:
        c.add_backend(b.url, policy_version=4)
        ids = c.submit([llm_job(i, calls=10) for i in range(4)])
        wait_for(lambda: c.list_backends()["leases"] >= 4, what="leases taken")
        os.kill(up.daemon_pid("router"), signal.SIGKILL)
        # The restarted router learns the backend from the gateway and the leases from the run daemon.
        wait_for(lambda: _try(lambda: c.list_backends()["leases"] >= 4), timeout_s=30, what="leases adopted")
        assert c.list_backends()["backends"][0]["policy_version"] == 4
        results = list(c.gather(ids, timeout_s=120))
        assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
        wait_for(lambda: idle(c), what="leases released after the restart")


def test_router_restart_adopts_packed_lease_listings_and_ignores_malformed_ones(up_factory, backends):
    """Above lease_rows.PACK_MIN leases a run daemon lists them packed (docs/EVENTS.md ``run.leases``):
    a restarted router adopts each on the backend the run daemon holds it on, and a malformed
    listing neither crashes the router nor drops a lease."""
    import zmq

    from rolloutd.bus import codec
    from rolloutd.daemons.lease_rows import PACK_MIN

    up = up_factory("router.lease_ttl_s=4", "daemon.full_listing_s=1")
    bs = [backends(latency=0.5) for _ in range(2)]
    n = PACK_MIN + 8
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"run.leases")
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    sub.connect(up.events)
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"ipc://{up.runtime_dir}/events_in.sock")
    try:
        with up.client(timeout_s=3.0, retries=10) as c:
            for b in bs:
                c.add_backend(b.url, policy_version=2)
            wait_for(lambda: all(b["healthy"] for b in c.list_backends()["backends"]), what="both backends admitted")
            ids = c.submit([llm_job(i, calls=200) for i in range(n)])  # outlive the test: cancelled at its end

            def spread():
                return {b["address"]: b["inflight"] for b in c.list_backends()["backends"]}

            wait_for(lambda: c.list_backends()["leases"] >= n, what=f"{n} leases taken")
            before = spread()
            assert sum(before.values()) == n and all(before.values()), before
            packed = None
            for _ in range(10):  # the run daemon's listing of them is the packed form
                body = codec.unpack(sub.recv_multipart()[-1])
                if isinstance(body.get("leases"), dict) and len(body["leases"]["ids"].split("\n")) >= n:
                    packed = body
                    break
            assert packed is not None, "no packed run.leases event seen"

            os.kill(up.daemon_pid("router"), signal.SIGKILL)
            wait_for(lambda: _try(lambda: c.list_backends()["leases"] >= n), timeout_s=30, what="packed leases adopted")
            assert spread() == before  # each on the backend its row names
            router = up.daemon_pid("router")

            stamp = {k: packed[k] for k in ("daemon", "node", "pid", "incarnation")} | {"ts": time.time()}
            good = packed["leases"]
            ids_plus = good["ids"] + "\nL9-999999"  # one lease nobody holds: adopting it reads its row
            row_plus = struct.pack("<3q", 0, 1, 2)
            bad_row = struct.pack("<3q", 99, 1, 2)  # an index past the backends
            for bad in ({"ids": ids_plus, "backends": good["backends"], "rows": good["rows"]},  # a row short
                        {"ids": ids_plus, "backends": good["backends"], "rows": good["rows"] + bad_row},
                        {"ids": ids_plus, "backends": [7], "rows": good["rows"] + row_plus},
                        {"ids": 5, "backends": good["backends"], "rows": good["rows"] + row_plus},
                        {"ids": ids_plus, "backends": good["backends"]},
                        "L9-999999", [["L9-999999", "b", "not a job id", 0]]):
                pub.send_multipart([b"run.leases", codec.pack(stamp | {"leases": bad})])
            time.sleep(5)  # longer than lease_ttl_s: a malformed listing had its chance to drop them
            assert up.daemon_pid("router") == router, "the router restarted on a malformed run.leases"
            assert c.list_backends()["leases"] == n and spread() == before  # none dropped, none made up
            c.cancel(ids)
            wait_for(lambda: idle(c), timeout_s=30, what="leases released after the cancel")
    finally:
        sub.close(0)
        pub.close(0)
        ctx.term()


def _try(fn):
    from rolloutd.gateway.client import GatewayError

    try:
        return fn()
    except GatewayError:
        return False


def router_waiting(c) -> int:
    """Lease requests the router holds, from its last heartbeat."""
    for d in c.status().get("daemons", []):
        if d.get("daemon") == "router":
            return int(d.get("waiting", 0))
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_new_backend_gets_no_lease_before_a_health_check_passes(up_factory, backends):
    up = up_factory("router.health_interval_s=0.3", "daemon.heartbeat_s=0.2")
    port = free_port()  # registered before its server is up (or while it still loads weights)
    url = f"http://127.0.0.1:{port}"
    with up.client() as c:
        added = c.add_backend(url)
        assert added["healthy"] is False and added["checked"] is False
        ids = c.submit([llm_job(0, calls=2)])
        wait_for(lambda: router_waiting(c) >= 1, what="the lease request held, not granted")
        assert [b["healthy"] for b in c.list_backends()["backends"]] == [False]
        b = backends(latency=0.01, port=port)
        [r] = c.gather(ids, timeout_s=30)
        assert r["status"] == "ok" and r["attempts"] == 1, r["error"]
        assert {t["backend"] for t in r["turns"]} == {url} and b.stats["requests"] == 2
        assert c.list_backends()["backends"][0]["checked"] is True
    assert "backend_admitted" in up.log()


def test_lease_requests_wait_for_backends_to_be_registered(up_factory, backends):
    up = up_factory("daemon.heartbeat_s=0.2")
    with up.client() as c:
        ids = c.submit([llm_job(i, calls=2) for i in range(3)])  # no backend registered yet
        wait_for(lambda: router_waiting(c) >= 3, what="lease requests held by a router with no backend")
        b = backends(latency=0.01)
        c.add_backend(b.url)
        results = list(c.gather(ids, timeout_s=30))
    assert all(r["status"] == "ok" and r["attempts"] == 1 for r in results), [r["error"] for r in results]


def test_router_restart_fails_no_job_that_waits_for_a_lease(up_factory, backends):
    up = up_factory("daemon.heartbeat_s=0.2", "router.health_interval_s=0.5")
    b = backends(latency=0.2)
    with up.client(timeout_s=3.0, retries=10) as c:
        c.add_backend(b.url, capacity=1)  # one job at a time: the others wait in the router
        ids = c.submit([llm_job(i, calls=3) for i in range(5)])
        wait_for(lambda: router_waiting(c) >= 3, what="lease requests waiting in the router")
        victim = up.daemon_pid("router")
        os.kill(victim, signal.SIGKILL)
        # Jobs the dead router held are re-sent to its successor; jobs whose requests reach the
        # successor before the gateway registered the backend again are held, not failed.
        results = list(c.gather(ids, timeout_s=50))
    assert all(r["status"] == "ok" for r in results), [r["error"] for r in results]
    assert all(r["attempts"] == 1 for r in results)
    assert "lease_requests_resent" in up.log()


def test_jobs_whose_only_backend_died_resume_when_it_is_readmitted(up_factory, backends):
    up = up_factory("router.health_interval_s=0.3", "router.health_failures=1", "daemon.heartbeat_s=0.2")
    b = backends(latency=0.1)
    port = b.port
    with up.client() as c:
        c.add_backend(b.url)
        ids = c.submit([llm_job(i, calls=6) for i in range(4)])
        wait_for(lambda: b.stats["requests"] >= 6, what="the backend serving")
        b.stop()  # every job's next call fails: each excludes the backend and waits for another

        def healthy():
            return c.list_backends()["backends"][0]["healthy"]

        wait_for(lambda: healthy() is False, what="the backend out of rotation")
        wait_for(lambda: router_waiting(c) >= 1, what="jobs waiting for a backend")
        back = backends(latency=0.01, port=port)  # the same server comes back
        results = list(c.gather(ids, timeout_s=40))
    assert all(r["status"] == "ok" and r["attempts"] == 1 for r in results), [r["error"] for r in results]
    assert all(len(r["turns"]) == 6 for r in results)
    assert back.stats["requests"] >= 4  # the excluded backend served the jobs that excluded it
