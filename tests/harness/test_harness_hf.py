"""The presets against ``serve-hf`` with the tiny random model: real sampling through the whole
system. The model solves nothing (rewards 0), but every sampled token must be exact: the
trajectory's logprobs are recomputed with the reference model (transformers, float32) on the
trajectory's own ids, which only agree if the ids are what was sampled in that context.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install rolloutd[torch])")

from tests.harness.conftest import harness_deployment  # noqa: E402
from tests.harness.test_harness_live import gather, swe_ids, well_formed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hf_up(module_up_factory, tiny_model_dir, sandbox_root, agent_venv, hf_server):
    return harness_deployment(module_up_factory, tiny_model_dir, sandbox_root, agent_venv, hf_server.url)


def logprob_parity(r, model):
    full = np.concatenate([r["prompt_ids"], r["response_ids"]]).astype(np.int64)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(full[None])).logits[0].float(), dim=-1).numpy()
    p = len(r["prompt_ids"])
    idx = np.nonzero(np.asarray(r["loss_mask"]))[0]
    assert len(idx) == sum(t["span"][1] - t["span"][0] for t in r["turns"]) > 0
    diff = np.abs(logp[p + idx - 1, full[p + idx]] - np.asarray(r["logprobs"])[idx]).max()
    assert diff < 1e-3, diff


def test_presets_against_serve_hf_tiny_model(hf_up, swe_built, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()
    tasks = [
        {"handler": "harness", "instance_id": "mini-hf", "instance": {
            "preset": "mini-swe-agent", "setup": {"domain": "swe", "instance": {"task_id": swe_ids()[0]}},
            "limits": {"max_llm_calls": 3, "max_tokens": 48, "max_context": 4096, "wall_s": 240}}},
        {"handler": "harness", "instance_id": "tools-hf", "instance": {
            "preset": "openai-tools",
            "setup": {"domain": "math", "instance": {"dataset": "basic_arithmetic", "seed": 1, "index": 0}},
            "limits": {"max_llm_calls": 2, "max_tokens": 48, "wall_s": 240}}},
    ]
    results = gather(hf_up, tasks, timeout_s=600)
    for r in results:
        agent = r["eval_details"].get("agent") or {}
        # A random model's replies are format errors to mini (it carries on to its step limit) and
        # a plain answer to the tool loop: both agents exit normally.
        assert r["status"] == "ok", (r["instance_id"], r["error"], agent.get("output_tail", "")[-2000:])
        well_formed(r)
        segs = r.get("segments") or [r]
        assert r["metrics"]["segments"] == len(segs) >= 1
        for seg in segs:
            logprob_parity(seg, ref)
        assert sum(len(s["turns"]) for s in segs) == r["metrics"]["llm_calls"] >= 1
        assert all(t["policy_version"] == 0 for s in segs for t in s["turns"])
        assert r["reward"] == 0.0
    mini = results[0]
    assert mini["metrics"]["llm_calls"] == 3  # its step limit (= max_llm_calls) ended it
