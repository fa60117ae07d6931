"""Every request the schema allows, and every near miss, gets a documented answer (issue 28 item 2).

Requests are built from the registered message classes' own fields (a field added later is
drawn too), with values of the right type, of the wrong type, at and beyond every bound,
NaN and the infinities, ints beyond int64, binary and non-string map keys; they go over a real
socket to a real ``rolloutd up`` whose gateway keeps a journal (so SQLite sees every job id).
Each reply must be a documented reply or error, echo the request's ``req_id``, refuse every
non-finite number outside ``instance`` with ``invalid``, and the gateway must keep answering.
"""
from __future__ import annotations

import math
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutd.bus import codec
from rolloutd.bus.messages import CLIENT_REQUESTS, ERROR_CODES, REGISTRY, Task
from rolloutd.bus.sockets import Sockets
from tests.conftest import short_tmpdir

# What a success reply's body carries, per kind (docs/PROTOCOL.md, Requests).
BODY = {"submit": {"job_ids", "duplicate"}, "poll": {"results", "last", "pending", "ready"},
        "cancel": {"jobs", "outcome"}, "status": {"version", "protocol", "queued", "dispatched", "malformed"},
        "add_llm_server": {"backend"}, "clear_llm_server": {"cleared"},
        "list_llm_servers": {"backends", "policy", "leases"}, "stop": {"paused"}, "start": {"paused"}}
# Reserved codes are never a request's answer; internal is a bug.
ANSWERS = set(ERROR_CODES) - {"not_found", "already_finished", "internal", "too_large", "malformed"}
CLIENTS = ["fz-a", "fz-b", ""]

ints = st.one_of(st.integers(-3, 5), st.sampled_from([4096, 4097, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -2**63]),
                 st.integers(-2**63, 2**64 - 1))
floats = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 300.0, 300.5, math.nan, math.inf, -math.inf, 1e308]),
                   st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 2 < x <= 300))
keys = st.one_of(st.text(max_size=6), st.binary(max_size=4), st.integers(-2, 2), st.booleans())
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8), st.binary(max_size=8))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(keys, inner, max_size=3)), max_leaves=8)
addresses = st.one_of(st.sampled_from(["http://127.0.0.1:9", "https://127.0.0.1:9/", "http://", "http://:80",
                                       "http://h:99999", "http://h:0", "ftp://h", "http://a b", "127.0.0.1:9", ""]),
                      st.text(max_size=12))


# Values the protocol accepts, per field name (the rest of the schema is drawn from the type hints).
VALID = {"client_id": st.sampled_from(CLIENTS[:2]), "address": st.sampled_from(["http://127.0.0.1:9", "https://[::1]:9/"]),
         "api": st.sampled_from(["vllm", "sglang"]), "handler": st.just("synthetic"),
         "instance": st.sampled_from([{}, {"reward": 0.5}, {"run": 0.01}, {"bogus": 1}]),
         "instance_id": st.one_of(st.none(), st.text(max_size=4)), "n": st.integers(1, 3),
         "timeout_s": st.one_of(st.none(), st.sampled_from([5, 30.0])), "wait_s": st.sampled_from([0, 0.0, 0.2]),
         "phase_timeouts": st.one_of(st.none(), st.just({"run": 10})), "job_ids": st.lists(st.integers(0, 2**40), max_size=3),
         "after": st.just(0), "max_results": st.integers(1, 300), "capacity": st.integers(0, 4),
         "weight": st.sampled_from([0.5, 1, 2.0]), "policy_version": st.integers(0, 3), "node": st.text(max_size=4),
         "idempotency_key": st.one_of(st.none(), st.text(max_size=4)), "inline_arrays": st.booleans()}


def value(name: str, hint):
    """A hostile value for a field: wrong types, bounds, NaN and infinities, huge ints, odd keys."""
    special = {"client_id": st.sampled_from(CLIENTS), "address": addresses,
               "api": st.sampled_from(["vllm", "sglang", "grpc", ""]),
               "handler": st.sampled_from(["synthetic", "nope"]),
               "instance": st.dictionaries(keys, anything, max_size=3),
               "wait_s": st.one_of(st.sampled_from([300.5, -1, math.nan, math.inf]), floats),
               "timeout_s": floats,
               "phase_timeouts": st.dictionaries(
                   st.sampled_from(["init", "run", "eval", "warmup"]), st.one_of(floats, ints, scalars), max_size=3),
               "job_ids": st.lists(st.one_of(ints, scalars), max_size=4)}
    if name in special:
        return st.one_of(special[name], scalars)
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return st.one_of(*[value(name, a) for a in typing.get_args(hint)])
    base = {int: ints, float: floats, str: st.text(max_size=8), bool: st.booleans(), type(None): st.none(),
            dict: st.dictionaries(keys, anything, max_size=3)}.get(hint)
    if base is None and origin in (list, tuple):
        base = st.lists(value(name, typing.get_args(hint)[0]) if typing.get_args(hint) else anything, max_size=3)
    return st.one_of(base, scalars) if base is not None else anything


@st.composite
def fields_of(draw, cls, hostile: float):
    """The fields of ``cls``: each absent (optional ones), valid, or (with odds ``hostile``) hostile."""
    out = {}
    for name, _check, required in cls._fields:
        if name == "req_id":
            continue
        if not required and draw(st.integers(0, 3)) == 0:
            continue  # absent: takes its default
        bad = draw(st.floats(0, 1)) < hostile or name not in VALID and name != "tasks"
        if name == "tasks":
            out[name] = draw(st.one_of(st.lists(fields_of(Task, hostile), min_size=0 if bad else 1, max_size=3), scalars)
                             if bad else st.lists(fields_of(Task, hostile), min_size=1, max_size=3))
        else:
            out[name] = draw(value(name, cls._hints[name]) if bad else VALID[name])
    return out


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(CLIENT_REQUESTS))
    hostile = draw(st.sampled_from([0.0, 0.1, 0.3, 1.0]))
    body = {"v": 1, "kind": kind, **draw(fields_of(REGISTRY[kind], hostile))}
    rid = draw(st.one_of(st.integers(1, 2**62), st.sampled_from([2**64 - 1, -2**63, True, 1.5, "7", None])))
    body["req_id"] = rid
    if draw(st.integers(0, 9)) == 0:  # an unknown key, of any key type, at the top
        body[draw(keys)] = draw(anything)
    return body


def nonfinite_outside_instance(req) -> bool:
    """A NaN or infinity in a field the protocol reads (not inside a handler's free-form instance)."""
    def walk(v, top=False):
        if isinstance(v, float):
            return not math.isfinite(v)
        if isinstance(v, dict):
            return any(walk(x) for k, x in v.items() if k != "instance" and not (top and k not in fields))
        if isinstance(v, list):
            return any(walk(x) for x in v)
        return False

    fields = {f for f, _c, _r in REGISTRY[req["kind"]]._fields}
    return walk(req, top=True)


@pytest.fixture(scope="module")
def gateway(module_up_factory):
    journal = short_tmpdir("rd-journal-") / "journal.db"
    return module_up_factory(f"gateway.journal={journal}")


def test_every_request_of_the_schema_gets_a_documented_answer(gateway):
    s = Sockets(asyncio=False, linger_ms=0)
    sock = s.connect("DEALER", gateway.gateway)
    seen: dict[str, int] = {}

    def ask(req: dict, timeout_s: float = 60.0) -> dict:
        sock.send_multipart([b""] + [msgpack.packb(req, use_bin_type=True, strict_types=False)])
        # A request is answered at once except a waiting poll (results here come within seconds).
        assert sock.poll(int(timeout_s * 1000)), f"no reply to {req!r}"
        return codec.decode(sock.recv_multipart()[1:])

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(req):
        reply = ask(req)
        rid = req["req_id"]
        want_rid = rid if rid.__class__ is int else 0
        assert reply["req_id"] == want_rid, (req, reply)
        seen[reply.get("code", req["kind"])] = seen.get(reply.get("code", req["kind"]), 0) + 1
        if reply["kind"] == "error":
            assert reply["code"] in ANSWERS, (req, reply)
            assert reply["message"], reply
        else:
            assert reply["kind"] == "reply", reply
            assert BODY[req["kind"]] <= set(reply["body"]), (req, reply)
            assert rid.__class__ is int, f"a req_id of the wrong type was accepted: {req!r}"
            assert not nonfinite_outside_instance(req), f"a NaN or infinity was accepted: {req!r} -> {reply!r}"
        if req["kind"] == "stop" and reply["kind"] == "reply":
            assert ask({"v": 1, "kind": "start", "req_id": 1})["body"] == {"paused": False}

    try:
        one()
        # It keeps answering, and a real job still goes through.
        assert ask({"v": 1, "kind": "clear_llm_server", "req_id": 2})["kind"] == "reply"
        with gateway.client() as c:
            r = c.rollout("synthetic", {"reward": 1.0}, timeout_s=60)
            assert r["status"] == "ok"
    finally:
        s.close()
    assert "internal" not in seen and "request_failed" not in gateway.log()
    assert seen.get("invalid", 0) > 0 and seen.get("submit", 0) > 0, seen  # both sides were drawn


def test_job_ids_beyond_int64_are_not_found(gateway):
    """cancel [2**64-1] answered `internal` (SQLite OverflowError from the journal lookup)."""
    with gateway.client() as c:
        from rolloutd.bus.messages import Cancel

        out = c.request(Cancel(job_ids=[2**64 - 1, 2**63, -2**63, 0]))
    assert out["jobs"] == {str(2**64 - 1): "not_found", str(2**63): "not_found", str(-2**63): "not_found",
                           "0": "not_found"}, out


@pytest.mark.parametrize("key", [1, 1.5, None, True, [1, 2]], ids=["int", "float", "nil", "bool", "list"])
def test_a_map_key_of_the_wrong_type_is_invalid_and_names_the_field(gateway, key):
    """It was `malformed`, req_id 0, "header is not msgpack" (it is valid msgpack)."""
    inner = msgpack.packb(key)
    # {"v":1,"kind":"submit","req_id":42,"client_id":"c","tasks":[{"handler":"synthetic","instance":{"ok":{<key>:2}}}]}
    head = (b"\x85" + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("kind") + msgpack.packb("submit")
            + msgpack.packb("req_id") + msgpack.packb(42) + msgpack.packb("client_id") + msgpack.packb("c")
            + msgpack.packb("tasks") + b"\x91\x82" + msgpack.packb("handler") + msgpack.packb("synthetic")
            + msgpack.packb("instance") + b"\x81" + msgpack.packb("ok") + b"\x81" + inner + msgpack.packb(2))
    s = Sockets(asyncio=False, linger_ms=0)
    try:
        sock = s.connect("DEALER", gateway.gateway)
        sock.send_multipart([b"", head])
        assert sock.poll(10_000)
        reply = codec.decode(sock.recv_multipart()[1:])
    finally:
        s.close()
    assert reply["kind"] == "error" and reply["code"] == "invalid" and reply["req_id"] == 42, reply
    assert reply["message"].startswith("submit.tasks[0].instance.ok: map keys must be strings"), reply
