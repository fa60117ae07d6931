"""Bad input gets an error reply with a code; the gateway stays up; other clients are unaffected."""
from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

from rolloutd.bus import codec
from rolloutd.bus.sockets import Sockets
from tests.conftest import synthetic


def header(**kw):
    return msgpack.packb(dict({"v": 1, "req_id": 7}, **kw))


CASES = [
    ("not msgpack", [b"\xc1\xc1garbage"], "malformed"),
    ("header not a map", [msgpack.packb([1, 2, 3])], "malformed"),
    ("missing array frame", [msgpack.packb({"v": 1, "kind": "status", "x": msgpack.ExtType(1, msgpack.packb([1, "<i4", [3]]))})], "malformed"),
    ("wrong array size", [msgpack.packb({"v": 1, "kind": "status", "x": msgpack.ExtType(1, msgpack.packb([1, "<i4", [3]]))}), b"\0" * 5], "malformed"),
    ("object dtype", [msgpack.packb({"v": 1, "kind": "status", "x": msgpack.ExtType(1, msgpack.packb([1, "|O", [1]]))}), b"\0" * 8], "malformed"),
    ("no version", [msgpack.packb({"kind": "status"})], "bad_version"),
    ("wrong version", [header(v=99, kind="status")], "bad_version"),
    ("unknown op", [header(kind="launch_missiles")], "unknown_kind"),
    ("internal kind from a client", [header(kind="job", job_id=1, attempt=1, handler="x", instance={})], "unknown_kind"),
    ("missing field", [header(kind="cancel")], "invalid"),
    ("version as a float", [header(v=1.0, kind="status")], "bad_version"),
    ("version as a bool", [header(v=True, kind="status")], "bad_version"),
    ("wrong type", [header(kind="submit", client_id="c", tasks="all of them")], "invalid"),
    ("empty batch", [header(kind="submit", client_id="c", tasks=[])], "invalid"),
    ("n out of range", [header(kind="submit", client_id="c", tasks=[{"handler": "synthetic", "instance": {}, "n": 0}])], "invalid"),
    ("no client_id", [header(kind="submit", tasks=[{"handler": "synthetic", "instance": {}}])], "invalid"),
    ("no instance", [header(kind="submit", client_id="c", tasks=[{"handler": "synthetic"}])], "invalid"),
    ("instance_id not a string", [header(kind="submit", client_id="c", tasks=[{"handler": "synthetic", "instance": {}, "instance_id": 5}])], "invalid"),
    ("poll without client_id", [header(kind="poll", after=0)], "invalid"),
    ("unknown handler", [header(kind="submit", client_id="c", tasks=[{"handler": "os.system", "instance": {}}])], "unknown_handler"),
    ("bad backend api", [header(kind="add_llm_server", address="http://127.0.0.1:1", api="grpc")], "invalid"),
]


@pytest.mark.parametrize("name,frames,code", CASES, ids=[c[0] for c in CASES])
def test_error_reply(raw, name, frames, code):
    reply = raw.ask(frames)
    assert reply["kind"] == "error", reply
    assert reply["code"] == code, reply
    assert reply["message"]


def test_oversize_request_is_refused_and_others_carry_on(shared_up, raw):
    up = shared_up
    big = np.zeros(17 << 20, dtype=np.uint8)  # over the 16 MiB default limit
    reply = raw.ask(codec.encode({"v": 1, "kind": "submit", "req_id": 3, "client_id": "big",
                                  "tasks": [{"handler": "synthetic", "instance": {"blob": big}}]}), timeout_s=20)
    assert reply["kind"] == "error" and reply["code"] == "too_large" and reply["req_id"] == 3
    with up.client() as c:  # another client, at the same time, is served normally
        r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=30)
        assert r["status"] == "ok"
    # ...and so is the misbehaving one, afterwards.
    reply = raw.ask([header(kind="status")])
    assert reply["kind"] == "reply" and reply["req_id"] == 7


def test_unknown_fields_are_tolerated(raw):
    reply = raw.ask([header(kind="status", from_the_future={"a": 1})])
    assert reply["kind"] == "reply"


def test_req_socket_client(shared_up):
    up = shared_up
    """A plain REQ socket (what a client in another language would use) gets its reply."""
    s = Sockets(asyncio=False, linger_ms=0)
    try:
        req = s.connect("REQ", up.gateway)
        req.send_multipart(codec.encode({"v": 1, "kind": "submit", "req_id": 1, "client_id": "req-client",
                                         "tasks": [synthetic(1)]}))
        assert req.poll(5000)
        reply = codec.decode(req.recv_multipart())
        assert reply["kind"] == "reply" and len(reply["body"]["job_ids"]) == 1
    finally:
        s.close()


GARBAGE = [[b"junk"], [msgpack.packb({"v": 1, "kind": "job"})], [header(kind="job", job_id="x")],
           [msgpack.packb({"v": 1, "kind": "ready", "free": "all", "received": 0})], [b"a", b"b"]]


def malformed_counts(c) -> dict:
    """Input each socket's binder refused, from its own counters (status and heartbeats)."""
    st = c.status()
    phase = {d["daemon"]: d.get("counts", {}).get("malformed", 0) for d in st["daemons"] if "counts" in d}
    return {"gateway_results": st["malformed"].get("results", 0), "init": st["malformed"].get("credits", 0),
            "run": phase.get("init"), "eval": phase.get("run")}


def test_garbage_into_pipeline_sockets_is_counted_and_dropped(up):
    """Daemon inputs are not trainer-facing, but garbage there must not kill them either.

    init.sock, run.sock and eval.sock are ROUTER sockets (the sender's end of a credit hand-off,
    bound by gateway, init and run): only a DEALER reaches them (ZeroMQ never delivers PUSH to
    ROUTER). gateway_results is the gateway's PULL."""
    with up.client() as c:
        before = {}

        def ready():
            before.update(malformed_counts(c))
            return None not in before.values()

        deadline = time.monotonic() + 20
        while not ready():  # the phase daemons' first heartbeats
            assert time.monotonic() < deadline
            time.sleep(0.1)
        s = Sockets(asyncio=False, linger_ms=1000)
        try:
            for name in ("init", "run", "eval"):
                dealer = s.connect("DEALER", f"ipc://{up.runtime_dir}/{name}.sock")
                for frames in GARBAGE:
                    dealer.send_multipart(frames)
            res = s.connect("PUSH", f"ipc://{up.runtime_dir}/gateway_results.sock")
            for frames in GARBAGE:
                res.send_multipart(frames)
        finally:
            s.close()
        want = {k: v + len(GARBAGE) for k, v in before.items()}
        deadline = time.monotonic() + 20
        while (now := malformed_counts(c)) != want:  # phase counters arrive with the next heartbeat
            assert time.monotonic() < deadline, f"malformed counters {now}, expected {want}"
            time.sleep(0.1)
        r = c.rollout("synthetic", {}, timeout_s=30)
        assert r["status"] == "ok"
    assert up.proc.poll() is None and "daemon_restarted" not in up.log()
