"""stale_policy=continue through the harness endpoint (issue 27): an unmodified agent (the openai
SDK tool loop, in a real bwrap sandbox) is mid-call when a new version is registered; the endpoint
continues the aborted reply on the new server within the same request, and the trajectory keeps
the tokens of both versions. Real daemons, two scripted servers answering as the oracle, on the
SGLang API (abort by rid) and the vLLM API (the call streams; the interrupt closes the stream)."""
from __future__ import annotations

import time

import pytest

from tests.conftest import require_bwrap, wait_for
from tests.harness.conftest import agent_venv, harness_sets, tok_dir  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def oracle_servers(tok_dir):  # noqa: F811
    from rolloutd.handlers.harness_presets import HarnessOracle
    from rolloutd.backends.scripted import ScriptedBackend

    made = []
    for _ in range(2):
        pol = HarnessOracle(wrong_every=2)
        pol.warm()
        b = ScriptedBackend(tok_dir, policy=pol, latency="constant:0.02,0.05")  # 50 ms per token
        b.start()
        made.append(b)
    yield made
    for b in made:
        b.stop()


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_continue_through_the_harness_endpoint(up_factory, tok_dir, sandbox_root, agent_venv,  # noqa: F811
                                               oracle_servers, api):
    require_bwrap()
    old, new = oracle_servers
    up = up_factory(*harness_sets(tok_dir, sandbox_root, agent_venv),
                    "router.max_policy_lag=0", "router.stale_policy=continue")
    task = {"handler": "harness", "instance_id": "t0",
            "instance": {"preset": "openai-tools", "limits": {"wall_s": 180},
                         "setup": {"domain": "math", "instance": {"dataset": "basic_arithmetic", "seed": 5,
                                                                  "index": 0}}}}
    with up.client() as c:
        c.add_backend(old.url, api=api, policy_version=0)
        ids = c.submit([task])
        wait_for(lambda: old.num_running >= 1, timeout_s=120, what="the agent's first call generating on v0")
        time.sleep(0.3)  # not a timing assertion: lets some tokens be sampled before the swap
        c.add_backend(new.url, api=api, policy_version=1)
        [r] = list(c.gather(ids, timeout_s=240))
    assert r["status"] == "ok", (r["failed_phase"], r["error"], r["eval_details"].get("agent"))
    turns = r["turns"]
    cut = [i for i, t in enumerate(turns) if t["finish_reason"] == "abort"]
    assert len(cut) == 1 and turns[cut[0]]["policy_version"] == 0, turns
    assert turns[cut[0] + 1]["continuation"] and turns[cut[0] + 1]["policy_version"] == 1, turns
    assert all(t["policy_version"] == 1 for t in turns[cut[0] + 1:])
    assert turns[cut[0]]["end"] > turns[cut[0]]["start"]  # the partial tokens were kept
    assert r["metrics"]["aborts"] == 1
    if api == "sglang":
        assert old.stats["aborted"] == 1
    else:  # vLLM's abort: the stream closed
        assert old.stats["disconnects"] >= 1 and old.stats["aborted"] == 0
