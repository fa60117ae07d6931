"""One real harness preset end to end against the real vLLM (issue 36 item 1): mini-swe-agent,
unmodified, in a bubblewrap sandbox, through the run daemon's endpoint, every call sampled by
vLLM. The tiny model's weights are random, so the agent gets nothing right (format errors until
its step limit; reward 0): what is checked is the tokens. Every turn names vLLM as its backend,
and every loss-bearing token's logprob equals vLLM's own recomputation over the whole recorded
sequence (``prompt_logprobs``), which holds only if each call's prompt was exactly the recorded
prefix: the earlier replies kept as the sampled ids, the observations in between rendered once.
"""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.conftest import require_bwrap
from tests.harness.conftest import agent_venv, harness_sets  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CALLS = 2


def recomputed(vllm, ids: list[int]) -> np.ndarray:
    body = {"model": vllm.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    r = httpx.post(vllm.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:500]
    plp = r.json()["choices"][0]["prompt_logprobs"]
    return np.array([np.nan] + [d[str(t)]["logprob"] for d, t in zip(plp[1:], ids[1:])])


def test_mini_swe_agent_on_vllm_records_vllms_own_tokens(up_factory, vllm_server, sandbox_root,  # noqa: F811
                                                        agent_venv):  # noqa: F811
    require_bwrap()
    up = up_factory(*harness_sets(vllm_server.model_dir, sandbox_root, agent_venv))
    task = {"handler": "harness", "instance_id": "mini-vllm",
            "instance": {"preset": "mini-swe-agent",
                         "setup": {"domain": "math", "instance": {"dataset": "basic_arithmetic", "seed": 5, "index": 0}},
                         "limits": {"max_llm_calls": CALLS, "max_tokens": 48, "wall_s": 240}}}
    with up.client() as c:
        c.add_backend(vllm_server.url, api="vllm", policy_version=0)
        [r] = list(c.gather(c.submit([task]), timeout_s=400))
    assert r["status"] == "ok", (r["failed_phase"], r["error"], r["eval_details"].get("agent"))
    assert r["reward"] == 0.0  # random weights
    turns = r["turns"]
    assert 1 <= r["metrics"]["llm_calls"] <= CALLS and len(turns) >= 1
    assert all(t["backend"] == vllm_server.url and t["policy_version"] == 0 for t in turns), turns
    prompt = [int(x) for x in r["prompt_ids"]]
    resp = [int(x) for x in r["response_ids"]]
    mask = np.asarray(r["loss_mask"], dtype=bool)
    assert mask.sum() > 0 and len(resp) == len(mask) == len(r["logprobs"])
    want = recomputed(vllm_server, prompt + resp)[len(prompt):]
    got = np.asarray(r["logprobs"], dtype=np.float64)
    worst = float(np.max(np.abs(got[mask] - want[mask])))
    assert worst < 1e-3, worst
    assert np.all(got[~mask] == 0)
