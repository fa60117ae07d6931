"""What a trainer gets from a trajectory that crossed a swap under stale_policy=continue (issue 27):
per-token versions from collate, the veRL adapter and the TRL example, from the turns' spans."""
from __future__ import annotations

import importlib.util

import numpy as np

from tests.conftest import REPO


def crossed_swap():
    # one assistant message aborted after 3 tokens on v4 and continued on v5 (2 tokens), a
    # 2-token observation, then one more message on v5
    return {"job_id": 3, "instance_id": "x", "sample_index": 0, "status": "ok", "reward": 1.0, "error": None,
            "prompt_ids": np.arange(1, 6, dtype=np.int32),
            "response_ids": np.array([20, 21, 22, 23, 24, 30, 31, 25, 26], np.int32),
            "loss_mask": np.array([1, 1, 1, 1, 1, 0, 0, 1, 1], np.int8),
            "logprobs": np.array([-.1, -.2, -.3, -.4, -.5, 0, 0, -.6, -.7], np.float32),
            "turns": [{"span": [0, 3], "start": 0, "end": 3, "policy_version": 4, "finish_reason": "abort"},
                      {"span": [3, 5], "start": 3, "end": 5, "policy_version": 5, "continuation": True},
                      {"span": [7, 9], "start": 7, "end": 9, "policy_version": 5}],
            "policy_version": 4, "metrics": {}, "timing": {}, "eval_details": {}}


EXPECTED = [4, 4, 4, 5, 5, -1, -1, 5, 5]


def test_collate_and_token_policy_versions():
    from rolloutd.gateway.batch import collate, token_policy_versions

    assert token_policy_versions(crossed_swap()).tolist() == EXPECTED
    a = collate([crossed_swap()], pad_id=0, response_length=11)
    assert a["token_policy_versions"].tolist() == [EXPECTED + [-1, -1]]
    assert (a["min_policy_versions"][0], a["max_policy_versions"][0]) == (4, 5)


def test_verl_adapter_passes_per_token_versions(tiny_tokenizer):
    from tests.trainer.test_trainer_verl_adapter import make_loop

    out = make_loop(tiny_tokenizer, handler="h").to_output(crossed_swap())
    assert out.extra_fields["rolloutd_token_policy_versions"] == EXPECTED
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (4, 5)


def test_trl_example_passes_per_token_versions():
    spec = importlib.util.spec_from_file_location("grpo_trl_for_test", REPO / "examples" / "trl" / "grpo_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.trajectories_to_trl([crossed_swap(), dict(crossed_swap(), status="failed")], pad_id=0)
    assert out["token_policy_versions"] == [EXPECTED, [-1]]
