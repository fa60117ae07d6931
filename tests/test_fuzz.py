"""Hostile input: random and mutated frames at every socket a daemon binds.

Each daemon stays up (none is restarted), every request to a replying socket gets a reply,
every one-way message is counted as malformed by the daemon that binds the socket, and a
real job still goes through afterwards. Each test checks its own outcome.
"""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import time

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


def reply_within(fs) -> float:
    """How long the request may be held before its reply: a lease waits up to its wait_s
    (10 s when absent) for a backend; an out-of-range wait_s is refused at once."""
    try:
        h = codec.decode(fs)
    except codec.CodecError:
        return 0.0
    if h.get("kind") != "lease":
        return 0.0
    w = h.get("wait_s", 10.0)
    return float(w) if isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w <= 3600 else 0.0


@pytest.mark.parametrize("name", ["gateway", "router"])
def test_every_request_gets_a_reply(shared_up, sockets, name):
    sock = target(shared_up, sockets, name)
    sent, got, longest = [], [], 0.0

    def take(timeout_ms):
        while sock.poll(timeout_ms):
            reply = sock.recv_multipart()
            header = codec.decode(reply[1:])
            assert header["kind"] in ("reply", "error"), header
            got.append(header)
            timeout_ms = 0

    @FUZZ
    @given(frames())
    def one(fs):
        nonlocal longest
        sock.send_multipart([b""] + fs)
        sent.append(fs)
        longest = max(longest, reply_within(fs))
        take(0)

    one()
    # Held requests (leases waiting for a backend) answer later: collect until every one has.
    deadline = time.monotonic() + longest + 10
    while len(got) < len(sent) and time.monotonic() < deadline:
        take(100)
    assert len(got) == len(sent), f"{name}: {len(sent) - len(got)} of {len(sent)} requests got no reply"


def counters(c) -> dict:
    """Per socket: the refusals counted by the daemon that binds it, and that daemon's incarnation."""
    st = c.status()
    by = {d["daemon"]: d for d in st["daemons"]}
    gw = st["malformed"]
    return {"gateway_results": (gw.get("results", 0), by.get("gateway", {}).get("incarnation")),
            "init": (gw.get("credits", 0), by.get("gateway", {}).get("incarnation")),
            "run": (by.get("init", {}).get("counts", {}).get("malformed"), by.get("init", {}).get("incarnation")),
            "eval": (by.get("run", {}).get("counts", {}).get("malformed"), by.get("run", {}).get("incarnation")),
            "events_in": (gw.get("events", 0), by.get("gateway", {}).get("incarnation"))}


def wait_counter(c, name, pred, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = counters(c)[name]
        if got[0] is not None and pred(got[0]):
            return got
        assert time.monotonic() < deadline, f"{name}: counter stuck at {got}"
        time.sleep(0.1)


@pytest.mark.parametrize("name", ["gateway_results", "init", "run", "eval", "events_in"])
def test_one_way_inputs_survive(shared_up, sockets, name):
    with shared_up.client() as c:
        before, incarnation = wait_counter(c, name, lambda n: True)  # the binder's heartbeat is in
        sock = target(shared_up, sockets, name)
        sent = 0

        @FUZZ
        @given(frames())
        def one(fs):
            nonlocal sent
            if name == "events_in":
                fs = [b"daemon.heartbeat"] + fs[:1]
            sock.send_multipart(fs)
            sent += 1

        one()
        if name == "events_in":
            # PUB drops what it sends before its subscription reaches the proxy: some, not all.
            n, now = wait_counter(c, name, lambda n: n > before)
        else:
            n, now = wait_counter(c, name, lambda n: n >= before + sent)
            assert n == before + sent  # every message refused, none taken for a real one
        assert now == incarnation, f"the daemon behind {name} restarted"
        r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=30)
        assert r["status"] == "ok"


def test_everything_still_works_after_the_fuzzing(shared_up):
    with shared_up.client() as c:
        r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=30)
        assert r["status"] == "ok"
        names = {d["daemon"] for d in c.status()["daemons"]}
    assert {"gateway", "router", "init", "run", "eval", "events"} <= names
    log = shared_up.log()
    assert "daemon_restarted" not in log and "daemon_crashed" not in log, log[-3000:]
