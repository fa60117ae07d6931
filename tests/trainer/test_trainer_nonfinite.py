"""Issue 35 item 3 on the trainer side: a trajectory that arrives ``ok`` with a NaN, inf or 1e308
reward (a worker from before the handlers refused them) never puts a non-finite number into a
trainer: it counts as failed (masked, out of its group) in groups, advantages, collate, the veRL
adapter and the TRL example. Before: one NaN made the whole group's advantages NaN."""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from rolloutd.gateway.batch import collate, filter_ok, group_advantages, has_reward_variance
from tests.conftest import REPO
from tests.trainer.test_trainer_collate import traj


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "nan", None])
def test_a_nonfinite_ok_reward_counts_as_failed_everywhere(bad):
    ts = [traj(1, "a", 0, [1], [5, 6], reward=1.0), traj(2, "a", 1, [1], [5, 6], reward=0.0),
          traj(3, "a", 2, [1], [5, 6], reward=bad), traj(4, "a", 3, [1], [5, 6], reward=0.0)]
    adv = group_advantages(ts)
    assert np.all(np.isfinite(adv)) and adv[2] == 0.0, adv
    r = np.array([1.0, 0.0, 0.0])
    np.testing.assert_allclose(adv[[0, 1, 3]], (r - r.mean()) / (r.std(ddof=1) + 1e-6), rtol=1e-5)
    assert has_reward_variance(ts) and not has_reward_variance([ts[2], ts[2]])
    assert [t["job_id"] for t in filter_ok(ts)] == [1, 2, 4]
    b = collate(ts)
    assert np.all(np.isfinite(b["rewards"])) and np.all(np.isfinite(b["token_level_rewards"]))
    assert b["status"].tolist() == [True, True, False, True] and b["loss_mask"][2].sum() == 0


def test_the_verl_adapter_never_emits_a_nonfinite_reward(tiny_tokenizer):
    from rolloutd.gateway import verl_adapter as va
    from tests.trainer.test_trainer_verl_adapter import make_loop, multi_turn_traj

    va._newest_version[0] = None
    loop = make_loop(tiny_tokenizer, handler="h")
    for bad in (float("nan"), float("inf"), 1e308 * 10):
        out = loop.to_output(dict(multi_turn_traj(), reward=bad))
        assert out.reward_score == 0.0 and set(out.response_mask) == {0}, out.reward_score
        assert out.extra_fields["rolloutd_ok"] is False
    assert loop.to_output(dict(multi_turn_traj(), reward=0.5)).reward_score == 0.5


def test_the_trl_example_never_emits_a_nonfinite_reward():
    spec = importlib.util.spec_from_file_location("grpo_trl_nonfinite", REPO / "examples" / "trl" / "grpo_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ts = [traj(1, "a", 0, [1], [5, 6], reward=float("nan")), traj(2, "a", 1, [1], [5, 6], reward=0.5)]
    out = mod.trajectories_to_trl(ts, pad_id=0)
    assert out["rolloutd_reward"] == [0.0, 0.5] and all(math.isfinite(x) for x in out["rolloutd_reward"])
    assert out["env_mask"][0] == [0]
