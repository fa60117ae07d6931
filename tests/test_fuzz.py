"""Hostile input: random and mutated frames at every socket a daemon binds.

Each daemon stays up (none is restarted), every request to a replying socket gets a reply,
and a real job still goes through afterwards.
"""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutd.bus import codec
from rolloutd.bus.messages import Status, Submit
from rolloutd.bus.sockets import Sockets

VALID = [
    codec.encode(Submit(tasks=[{"handler": "synthetic", "instance": {"reward": 1.0}}], client_id="fuzz").to_wire()),
    codec.encode(Status().to_wire()),
    [msgpack.packb({"v": 1, "kind": "poll", "client_id": "fuzz", "after": 0, "wait_s": 0})],
    [msgpack.packb({"v": 1, "kind": "lease", "job_id": 1, "wait_s": 0.0})],
]


@st.composite
def frames(draw):
    if draw(st.booleans()):
        return draw(st.lists(st.binary(min_size=0, max_size=200), min_size=1, max_size=4))
    base = [bytearray(f) for f in draw(st.sampled_from(VALID))]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(base) - 1))
        f = base[i]
        op = draw(st.sampled_from(["flip", "truncate", "extend", "drop"]))
        if op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            f[j] ^= draw(st.integers(1, 255))
        elif op == "truncate" and f:
            del f[draw(st.integers(0, len(f) - 1)):]
        elif op == "extend":
            f.extend(draw(st.binary(max_size=16)))
        elif op == "drop" and len(base) > 1:
            base.pop(i)
    return [bytes(f) for f in base]


@pytest.fixture(scope="module")
def sockets():
    s = Sockets(asyncio=False, linger_ms=0)
    yield s
    s.close()


def target(up, sockets, name):
    rd = up.runtime_dir
    kind = {"gateway": "DEALER", "router": "DEALER", "gateway_results": "PUSH", "init": "DEALER",
            "run": "DEALER", "eval": "DEALER", "events_in": "PUB"}[name]
    return sockets.connect(kind, f"ipc://{rd}/{name}.sock")


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", ["gateway", "router"])
def test_every_request_gets_a_reply(shared_up, sockets, name):
    sock = target(shared_up, sockets, name)

    @FUZZ
    @given(frames())
    def one(fs):
        sock.send_multipart([b""] + fs)
        assert sock.poll(5000), f"{name} did not reply to {fs!r}"
        reply = sock.recv_multipart()
        header = codec.decode(reply[1:])
        assert header["kind"] in ("reply", "error")

    one()


@pytest.mark.parametrize("name", ["gateway_results", "init", "run", "eval", "events_in"])
def test_one_way_inputs_survive(shared_up, sockets, name):
    sock = target(shared_up, sockets, name)

    @FUZZ
    @given(frames())
    def one(fs):
        if name == "events_in":
            fs = [b"daemon.heartbeat"] + fs[:1]
        sock.send_multipart(fs)

    one()


def test_everything_still_works_after_the_fuzzing(shared_up):
    import time

    time.sleep(1.0)
    with shared_up.client() as c:
        r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=30)
        assert r["status"] == "ok"
        names = {d["daemon"] for d in c.status()["daemons"]}
    assert {"gateway", "router", "init", "run", "eval", "events"} <= names
    log = shared_up.log()
    assert "daemon_restarted" not in log and "daemon_crashed" not in log, log[-3000:]
