"""Numbers a request carries are checked against their range where they enter (issue 38, item
4): a ``synthetic`` instance with ``{"run": 1e308}`` was accepted and slept past any budget,
``{"run": -5}`` finished ok; a backend registered with ``policy_version=-1`` was accepted by the
gateway and by the router. Real ``rolloutd up``; the router is also asked directly."""
from __future__ import annotations

import pytest

from rolloutd.bus import codec
from rolloutd.bus.sockets import Sockets
from rolloutd.gateway.client import GatewayError

from tests.conftest import synthetic

BAD = [{"run": 1e308}, {"run": -5}, {"init": {"dist": "uniform", "low": 0, "high": 1e300}},
       {"eval": {"dist": "lognormal", "mu": 400, "sigma": 1}}, {"fail": {"run": 2}}, {"run": {"value": 1, "scale": -1}}]


def test_synthetic_instance_numbers_out_of_range_fail_in_init_with_the_range_named(shared_up):
    with shared_up.client() as c:
        ids = c.submit([dict(synthetic(i), instance=inst) for i, inst in enumerate(BAD)])
        ids += c.submit([dict(synthetic(99), instance={"run": 0.01, "fail": {"run": 0}}, timeout_s=60)])
        got = {r["job_id"]: r for r in c.gather(ids, timeout_s=60)}
    for jid, inst in zip(ids, BAD):
        r = got[jid]
        assert r["status"] == "failed" and r["failed_phase"] == "init", (inst, r["status"], r["error"])
        assert r["error"]["type"] == "SyntheticInstanceError" and "must be in [" in r["error"]["message"], r["error"]
    assert got[ids[-1]]["status"] == "ok"  # in range: runs as before


def test_synthetic_llm_ignore_eos_must_be_a_bool(shared_up):
    with shared_up.client() as c:
        ids = c.submit([{"handler": "synthetic_llm", "instance_id": "e", "instance": {"ignore_eos": "yes"}, "timeout_s": 60}])
        r = next(iter(c.gather(ids, timeout_s=60)))
    assert r["status"] == "failed" and r["failed_phase"] == "init", (r["status"], r["error"])
    assert r["error"]["type"] == "SyntheticInstanceError" and "ignore_eos is 'yes'" in r["error"]["message"], r["error"]


def test_a_negative_policy_version_is_refused_by_the_gateway_and_the_router(shared_up):
    with shared_up.client() as c:
        with pytest.raises(GatewayError) as e:
            c.add_backend("http://127.0.0.1:9", policy_version=-1)
        assert e.value.code == "invalid" and "policy_version must be >= 0, got -1" in e.value.message
        assert c.add_backend("http://127.0.0.1:9", policy_version=0)["address"] == "http://127.0.0.1:9"
        c.clear_backends()
    with Sockets(asyncio=False, linger_ms=0) as s:  # straight to the router, as a run daemon would
        sock = s.connect("DEALER", f"ipc://{shared_up.runtime_dir}/router.sock")
        sock.send_multipart([b""] + codec.encode({"v": 1, "kind": "add_llm_server", "req_id": 5,
                                                  "address": "http://127.0.0.1:9", "policy_version": -1}))
        assert sock.poll(10000), "the router did not answer"
        frames = sock.recv_multipart()
        reply = codec.decode(frames[1:])
    assert reply["kind"] == "error" and reply["code"] == "invalid" and reply["req_id"] == 5, reply
    assert "policy_version" in reply["message"]


SAMPLING_BAD = [{"max_tokens": -5}, {"max_tokens": 10**18}, {"temperature": float("nan")},
                {"top_p": 1.5}, {"top_k": "5"}, {"stop_token_ids": [-1]}]


def test_sampling_numbers_out_of_range_fail_the_job_before_any_llm_call(shared_up, backends, tiny_tokenizer_dir):
    b = backends()
    dialogue = {"messages": [{"role": "user", "content": "hi"}], "tokenizer": str(tiny_tokenizer_dir)}
    with shared_up.client() as c:
        c.add_backend(b.url, policy_version=0)
        try:
            tasks = [{"handler": "toy", "instance": {"prompt_ids": [1, 2, 3], "target_ids": [1], "sampling": sp},
                      "timeout_s": 60}
                     for sp in SAMPLING_BAD + [{"max_tokens": 2, "temperature": 0.5}]]
            extra = c.submit([{"handler": "dialogue", "instance": dict(dialogue, max_context=v), "timeout_s": 60}
                              for v in (0, "4096", 10**12)])
            ids = c.submit(tasks)
            got = {r["job_id"]: r for r in c.gather(ids + extra, timeout_s=90)}
        finally:
            c.clear_backends()
    for jid in extra:
        r = got[jid]
        assert r["status"] == "failed" and r["error"]["type"] == "InstanceError", (r["status"], r["error"])
        assert "max_context" in r["error"]["message"], r["error"]
    for jid, sp in zip(ids, SAMPLING_BAD):
        r = got[jid]
        assert r["status"] == "failed" and r["error"]["type"] == "InstanceError", (sp, r["status"], r["error"])
        assert f"sampling.{next(iter(sp))}" in r["error"]["message"], r["error"]
    assert got[ids[-1]]["status"] == "ok", got[ids[-1]]["error"]  # in range: sampled as before
    assert b.stats["requests"] == 1  # the refused ones never reached the backend
