"""A job travels trainer -> gateway -> init -> run -> eval -> gateway -> trainer for real."""
from __future__ import annotations

import numpy as np

from rolloutd.bus import codec
from rolloutd.bus.messages import STATUSES, empty_trajectory
from tests.conftest import synthetic, wait_for

SHAPE = set(empty_trajectory())


def well_formed(r: dict):
    assert set(r) >= SHAPE, f"missing keys: {SHAPE - set(r)}"
    assert r["status"] in STATUSES
    for key in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
        assert isinstance(r[key], np.ndarray), key
    if r["status"] == "ok":
        assert r["failed_phase"] is None and r["error"] is None
        assert {"init", "run", "eval"} <= set(r["timing"])
    else:
        assert r["failed_phase"] in ("queue", "init", "run", "eval")
        assert set(r["error"]) == {"type", "message"}


def test_200_jobs_with_mixed_failures(up):
    tasks = [synthetic(i, init={"dist": "uniform", "low": 0, "high": 0.01},
                       run={"dist": "lognormal", "mu": -5, "sigma": 1.0},
                       eval={"dist": "constant", "value": 0.001},
                       fail={"init": 0.1, "run": 0.1, "eval": 0.1}, reward=0.5) for i in range(200)]
    with up.client() as c:
        ids = c.submit(tasks)
        assert len(ids) == len(set(ids)) == 200
        results = list(c.gather(ids, timeout_s=60))
    assert sorted(r["job_id"] for r in results) == sorted(ids)
    for r in results:
        well_formed(r)
    by_phase = {}
    for r in results:
        by_phase.setdefault(r["failed_phase"], []).append(r)
    # Seeds make the draw deterministic: each phase fails for some jobs, most jobs succeed.
    assert {"init", "run", "eval"} <= set(by_phase), set(by_phase)
    for phase in ("init", "run", "eval"):
        for r in by_phase[phase]:
            assert r["status"] == "failed"
            assert r["error"]["type"] == "SyntheticFailure" and phase in r["error"]["message"]
            assert r["reward"] == 0.0
    ok = by_phase[None]
    assert len(ok) > 100
    assert all(r["reward"] == 0.5 for r in ok)
    # Phases a failed job never reached are not timed.
    assert all("run" not in r["timing"] for r in by_phase["init"])


def test_n_samples_per_instance_and_rollout(up):
    with up.client() as c:
        ids = c.submit([synthetic(1), synthetic(2)], n=3)
        assert len(ids) == 6
        results = sorted(c.gather(ids, timeout_s=30), key=lambda r: r["job_id"])
        assert [(r["instance_id"], r["sample_index"]) for r in results] == [
            ("i1", 0), ("i1", 1), ("i1", 2), ("i2", 0), ("i2", 1), ("i2", 2)]
        one = c.rollout("synthetic", {"reward": 0.25}, timeout_s=30)
        assert one["status"] == "ok" and one["reward"] == 0.25


def test_results_are_delivered_once_and_poll_is_idempotent(up):
    from rolloutd.bus.messages import Poll

    with up.client() as c:
        ids = c.submit([synthetic(i) for i in range(20)])
        wait_for(lambda: c.status()["done_unacked"] >= 20, what="all 20 results ready")
        first = c.poll(max_results=100)
        assert sorted(r["job_id"] for r in first) == sorted(ids)
        # The same poll re-sent (as after a lost reply) returns the same results...
        again = c.request(Poll(client_id=c.client_id, after=0, max_results=100, wait_s=0))
        assert [r["job_id"] for r in again["results"]] == [r["job_id"] for r in first]
        # ...until the client's next poll acknowledges them; then they are gone for good.
        assert c.poll() == []
        gone = c.request(Poll(client_id=c.client_id, after=0, max_results=100, wait_s=0))
        assert gone["results"] == [] and c.status()["done_unacked"] == 0


def test_poll_replies_use_ext_1_frames_unless_the_client_asks_for_inline_arrays(up):
    """PROTOCOL.md's minimal client knows ext 1 only: a poll without ``inline_arrays`` gets every
    array in a frame of its own; the shipped client asks for ext 2 (one frame for small arrays)."""
    import msgpack

    from rolloutd.bus.sockets import Sockets

    with up.client() as c:
        ids = c.submit([synthetic(i) for i in range(3)])
        wait_for(lambda: c.status()["done_unacked"] >= 3, what="3 results ready")
        s = Sockets(asyncio=False, linger_ms=0)
        try:
            sock = s.connect("DEALER", up.gateway)

            def poll(**extra):
                sock.send_multipart([b"", msgpack.packb({"v": 1, "kind": "poll", "req_id": 5, "client_id": c.client_id,
                                                         "max_results": 10, **extra})])
                assert sock.poll(10_000), "no reply"
                return sock.recv_multipart()[1:]

            def ext1_only(frames):  # the prose client's decoder
                def hook(code, data):
                    assert code == 1, f"ext {code} sent to a client that did not ask for it"
                    idx, dt, shape = msgpack.unpackb(data)
                    return np.frombuffer(frames[idx], dtype=dt).reshape(shape)
                return msgpack.unpackb(frames[0], ext_hook=hook)

            plain = poll()
            body = ext1_only(plain)["body"]
            assert sorted(r["job_id"] for r in body["results"]) == sorted(ids)
            assert len(plain) == 1 + 4 * len(ids)  # prompt_ids, response_ids, loss_mask, logprobs each
            inline = poll(inline_arrays=True)
            assert len(inline) == 1
            same = codec.decode(inline)["body"]["results"]
            for a, b in zip(body["results"], same):
                for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
                    assert a[k].dtype == b[k].dtype and a[k].tolist() == b[k].tolist()
            bad = codec.decode(poll(inline_arrays=1))  # a bool, as every flag of the protocol
            assert bad["kind"] == "error" and bad["code"] == "invalid", bad
        finally:
            s.close()


def test_status_reports_daemons_and_counts(up):
    with up.client() as c:
        c.submit([synthetic(i) for i in range(5)])
        list(c.gather(timeout_s=120))

        seen: list = []

        def counted():  # a daemon is listed, with its counts, from its heartbeats: on a loaded machine a
            st = c.status()  # late one can be missing from one listing (CI: init and router were) and back in the next
            phase = {d["daemon"]: d for d in st["daemons"]}
            seen[:] = sorted(phase)
            everyone = {"events", "router", "init", "run", "eval", "gateway"} <= set(phase)
            return st if everyone and phase["run"]["counts"]["forwarded"] >= 5 else None

        try:
            st = wait_for(counted, timeout_s=60, what="every daemon listed and the run daemon counting the five jobs")
        except AssertionError as e:
            raise AssertionError(f"{e}; the last listing had {seen}") from None
    assert st["totals"]["submitted"] == 5 and st["totals"]["done"] == 5
    phase = {d["daemon"]: d for d in st["daemons"]}
    assert phase["run"]["pool"] > 0 and phase["run"]["counts"]["forwarded"] >= 5
    assert "synthetic" in st["handlers"]


def test_a_failed_job_is_logged_with_its_ids(up):
    """Operators find a failed job's line by its id: ``job_failed`` carries job, attempt, handler
    (the per-job logger is bound only when a line is written)."""
    with up.client() as c:
        [jid] = c.submit([synthetic(0, fail={"run": 1.0})])
        [r] = list(c.gather([jid], timeout_s=30))
    assert r["status"] == "failed" and r["failed_phase"] == "run"
    lines = wait_for(lambda: up.logged("job_failed"), timeout_s=10)
    [line] = lines
    assert (line["job_id"], line["attempt"], line["handler"]) == (jid, 1, "synthetic"), line
    assert line["daemon"] == "run" and line["phase"] == "run" and line["status"] == "failed", line
