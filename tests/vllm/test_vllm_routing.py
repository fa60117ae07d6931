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

import contextlib
import json
import subprocess
import sys

import pytest

from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

OUTSIDE = 4  # requests sent to vLLM directly, not through rolloutd (each re-sent when it ends)
JOBS = 3     # through rolloutd: on the idle server they reach 0, 1, 2 leases, below vLLM's load


@contextlib.contextmanager
def outside_load(vllm_server):
    """OUTSIDE long generations on vLLM from a process the router knows nothing of; killed at
    the end (its connections close: vLLM aborts what they were generating). Started 0.5 s apart,
    so that their re-sends do not fall together: vLLM's count dips by one at a time, never to
    the idle server's. Started once rolloutd is up: vLLM generating on both cores slowed the six
    daemons' start past the 90 s readiness wait in a CI run."""
    body = json.dumps({"model": vllm_server.model, "prompt": [1, 2, 3, 4], "max_tokens": 3000, "ignore_eos": True})
    code = (f"import threading, httpx\n"
            f"import time\n"
            f"def one(i):\n"
            f"    time.sleep(0.5 * i)\n"
            f"    while True:\n"
            f"        httpx.post({vllm_server.url + '/v1/completions'!r}, content={body!r},\n"
            f"                   headers={{'content-type': 'application/json'}}, timeout=600)\n"
            f"ts = [threading.Thread(target=one, args=(i,)) for i in range({OUTSIDE})]\n"
            f"[t.start() for t in ts]\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_least_load_routes_around_load_the_router_did_not_lease(up_factory, vllm_server):
    from rolloutd.backends.policies import get_policy
    from rolloutd.backends.scripted import ScriptedBackend

    idle = ScriptedBackend(vllm_server.model_dir, policy=get_policy("constant", text="ok"))
    idle.start()
    try:
        up = up_factory("router.policy=least_load", "router.health_interval_s=0.3")
        with outside_load(vllm_server), up.client() as c:
            c.add_backend(vllm_server.url, api="vllm", policy_version=0)
            c.add_backend(idle.url, api="vllm", policy_version=0)

            def rows():
                return {b["address"]: b for b in c.list_backends()["backends"]}

            # the router's view: both servers admitted (the idle one's health check, too: on a busy
            # machine it can pass a round later than vLLM's), no lease of its own on vLLM, the
            # OUTSIDE requests on it
            got = wait_for(lambda: (r := rows())[vllm_server.url]["healthy"] and r[idle.url]["healthy"]
                           and r[vllm_server.url]["load_signal"] >= OUTSIDE and r,
                           timeout_s=120, what="both servers admitted and the router reading vLLM's running requests")
            assert got[vllm_server.url]["inflight"] == 0
            ids = c.submit([{"handler": "synthetic_llm", "instance_id": f"j{i}",
                             "instance": {"seed": i, "llm_calls": 2, "max_tokens": 4}} for i in range(JOBS)])
            results = list(c.gather(ids, timeout_s=120))
    finally:
        idle.stop()
    assert [r["status"] for r in results] == ["ok"] * len(ids), [r["error"] for r in results]
    used = {t["backend"] for r in results for t in r["turns"]}
    assert used == {idle.url}, used
    # leases 0, 1, 2 on the idle server against 0 + at least OUTSIDE - 1 on vLLM; least_inflight would split them
