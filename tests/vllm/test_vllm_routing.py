"""The router's load signal against the real vLLM's own (issue 36 item 3).

The router counts its leases; vLLM counts the requests it holds (``vllm:num_requests_running`` +
``vllm:num_requests_waiting`` on ``/metrics``). The router reads the server's count with each
health check (``load_signal`` in ``list_llm_servers``), and ``router.policy = "least_load"`` routes
by leases plus what the server holds beyond them: load from clients the router does not see (a
server shared with another deployment, an evaluation). Here the real vLLM is kept busy by
requests sent to it directly, beside an idle second server (the scripted stand-in): the router
sees the load it did not lease and sends every job to the idle server.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

OUTSIDE = 3  # requests sent to vLLM directly, not through rolloutd


@pytest.fixture
def outside_load(vllm_server):
    """OUTSIDE long generations on vLLM from a process the router knows nothing of; killed at
    the end (its connections close: vLLM aborts what they were generating)."""
    body = json.dumps({"model": vllm_server.model, "prompt": [1, 2, 3, 4], "max_tokens": 3000, "ignore_eos": True})
    code = (f"import threading, httpx\n"
            f"def one():\n"
            f"    while True:\n"
            f"        httpx.post({vllm_server.url + '/v1/completions'!r}, content={body!r},\n"
            f"                   headers={{'content-type': 'application/json'}}, timeout=600)\n"
            f"ts = [threading.Thread(target=one) for _ in range({OUTSIDE})]\n"
            f"[t.start() for t in ts]\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def test_least_load_routes_around_load_the_router_did_not_lease(up_factory, vllm_server, outside_load):
    from rolloutd.backends.policies import get_policy
    from rolloutd.backends.scripted import ScriptedBackend

    idle = ScriptedBackend(vllm_server.model_dir, policy=get_policy("constant", text="ok"))
    idle.start()
    try:
        up = up_factory("router.policy=least_load", "router.health_interval_s=0.3")
        with up.client() as c:
            c.add_backend(vllm_server.url, api="vllm", policy_version=0)
            c.add_backend(idle.url, api="vllm", policy_version=0)

            def vllm_row():
                return next(b for b in c.list_backends()["backends"] if b["address"] == vllm_server.url)

            # the router's view of vLLM: no lease of its own, OUTSIDE requests on the server
            row = wait_for(lambda: (r := vllm_row())["healthy"] and r["load_signal"] >= OUTSIDE and r,
                           timeout_s=120, what="the router reading vLLM's running requests")
            assert row["inflight"] == 0
            ids = c.submit([{"handler": "synthetic_llm", "instance_id": f"j{i}",
                             "instance": {"seed": i, "llm_calls": 2, "max_tokens": 4}} for i in range(OUTSIDE)])
            results = list(c.gather(ids, timeout_s=120))
    finally:
        idle.stop()
    assert [r["status"] for r in results] == ["ok"] * len(ids), [r["error"] for r in results]
    used = {t["backend"] for r in results for t in r["turns"]}
    assert used == {idle.url}, used
    # leases 0, 1, 2 on the idle server against 0 + OUTSIDE on vLLM; least_inflight would split them
