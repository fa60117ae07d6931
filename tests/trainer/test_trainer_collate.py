"""Padding, grouping and advantages (rolloutd.gateway.batch pure helpers): no sockets, no processes."""
from __future__ import annotations

import numpy as np
import pytest

from rolloutd.gateway.batch import collate, filter_ok, group_advantages, group_by_instance, placeholder, status_counts, to_torch


def traj(jid, iid, k, prompt, response, mask=None, lps=None, reward=0.0, status="ok", version=0, turns=None):
    response = list(response)
    return {
        "job_id": jid, "instance_id": iid, "sample_index": k, "status": status, "reward": reward,
        "prompt_ids": np.asarray(prompt, np.int32), "response_ids": np.asarray(response, np.int32),
        "loss_mask": np.asarray(mask if mask is not None else [1] * len(response), np.int8),
        "logprobs": np.asarray(lps if lps is not None else [-0.5] * len(response), np.float32),
        "turns": turns if turns is not None else [{"span": [0, len(response)], "policy_version": version}],
        "policy_version": version, "error": None if status == "ok" else {"type": "X", "message": "x"},
    }


def test_left_pad_prompts_right_pad_responses_like_verl():
    a = traj(1, "i0", 0, [11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 28], mask=[1, 1, 1, 0, 0, 1, 1, 1],
             lps=[-1, -2, -3, 9, 9, -4, -5, -6], reward=1.0)
    b = traj(2, "i0", 1, [31, 32], [41, 42], lps=[-7, -8], reward=0.5)
    out = collate([a, b], pad_id=0)
    # veRL's documented example (agent_loop.py: _agent_loop_postprocess)
    assert out["prompts"].tolist() == [[11, 12, 13, 14], [0, 0, 31, 32]]
    assert out["responses"].tolist() == [[21, 22, 23, 24, 25, 26, 27, 28], [41, 42, 0, 0, 0, 0, 0, 0]]
    assert out["input_ids"].tolist()[1] == [0, 0, 31, 32, 41, 42, 0, 0, 0, 0, 0, 0]
    assert out["attention_mask"].tolist()[1] == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    # veRL's code (compute_position_id_with_mask: clip(cumsum(mask) - 1, 0)); trailing pads repeat the
    # last position (the comment in veRL's agent_loop.py shows 0s there; the code does not)
    assert out["position_ids"].tolist()[1] == [0, 0, 0, 1, 2, 3, 3, 3, 3, 3, 3, 3]
    assert out["position_ids"].tolist()[0] == list(range(12))
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert out["response_mask"] is out["loss_mask"]
    # logprobs: 0 where masked and on padding
    assert out["rollout_logprobs"].tolist() == [[-1, -2, -3, 0, 0, -4, -5, -6], [-7, -8, 0, 0, 0, 0, 0, 0]]
    assert out["rewards"].tolist() == [1.0, 0.5]
    assert out["token_level_rewards"][0, 7] == 1.0 and out["token_level_rewards"][1, 1] == 0.5
    assert out["token_level_rewards"].sum() == 1.5
    assert out["prompt_lengths"].tolist() == [4, 2] and out["response_lengths"].tolist() == [8, 2]
    assert out["status"].tolist() == [True, True]
    assert out["input_ids"].dtype == np.int64 and out["rollout_logprobs"].dtype == np.float32


def test_fixed_lengths_multiple_and_truncation():
    a = traj(1, "i", 0, [1, 2, 3, 4, 5], [6, 7, 8, 9])
    with pytest.raises(ValueError, match="prompt of 5 tokens"):
        collate([a], prompt_length=3, response_length=8)
    with pytest.raises(ValueError, match="response of 4 tokens"):
        collate([a], prompt_length=8, response_length=2)
    out = collate([a], prompt_length=3, response_length=2, truncate=True, pad_id=99)
    assert out["prompts"].tolist() == [[3, 4, 5]]          # left-truncated, as veRL does
    assert out["responses"].tolist() == [[6, 7]]           # right-truncated
    assert out["truncated"].tolist() == [True]
    out = collate([a], pad_id=99, pad_to_multiple_of=8)
    assert out["prompts"].shape == (1, 8) and out["responses"].shape == (1, 8)
    assert out["prompts"][0, :3].tolist() == [99, 99, 99]


def test_failed_rows_are_masked_and_flagged():
    ok = traj(1, "i", 0, [1, 2], [3, 4], reward=1.0)
    bad = traj(2, "i", 1, [1, 2], [5], reward=0.0, status="failed")
    empty = placeholder(3, "i", 2, "timeout", "BatchDeadline", "late")
    out = collate([ok, bad, empty])
    assert out["status"].tolist() == [True, False, False]
    assert out["loss_mask"][1].sum() == 0 and out["loss_mask"][2].sum() == 0
    assert out["attention_mask"][2].sum() == 0          # no tokens at all
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert out["policy_versions"].tolist() == [0, 0, -1]
    assert status_counts([ok, bad, empty]) == {"ok": 1, "failed": 1, "timeout": 1}
    assert [t["job_id"] for t in filter_ok([ok, bad, empty])] == [1]


def test_policy_versions_min_max_over_turns():
    t = traj(1, "i", 0, [1], [2, 3, 4, 5], turns=[{"span": [0, 2], "policy_version": 3},
                                                 {"span": [2, 4], "policy_version": 4}], version=3)
    out = collate([t])
    assert out["policy_versions"].tolist() == [3]
    assert out["min_policy_versions"].tolist() == [3] and out["max_policy_versions"].tolist() == [4]


def test_length_mismatch_is_an_error():
    t = traj(1, "i", 0, [1], [2, 3])
    t["logprobs"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="differ in length"):
        collate([t])


def test_group_by_instance_orders_groups_and_samples():
    ts = [traj(5, "b", 1, [1], [1]), traj(1, "a", 1, [1], [1]), traj(2, "b", 0, [1], [1]), traj(3, "a", 0, [1], [1])]
    g = group_by_instance(ts)
    assert list(g) == ["b", "a"]
    assert [t["sample_index"] for t in g["a"]] == [0, 1] and [t["job_id"] for t in g["b"]] == [2, 5]


def test_group_advantages_grpo_and_failures():
    ts = [traj(1, "a", 0, [1], [1], reward=1.0), traj(2, "a", 1, [1], [1], reward=0.0),
          traj(3, "a", 2, [1], [1], reward=0.0, status="failed"),   # must not count as reward 0
          traj(4, "b", 0, [1], [1], reward=0.3), traj(5, "b", 1, [1], [1], reward=0.3),
          traj(6, "c", 0, [1], [1], reward=1.0)]                   # lone ok member -> 0
    adv = group_advantages(ts)
    r = np.array([1.0, 0.0])
    expect = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[:2], expect, rtol=1e-5)
    assert adv[2] == 0.0 and adv[3] == 0.0 and adv[4] == 0.0 and adv[5] == 0.0
    np.testing.assert_allclose(group_advantages(ts, normalize="none")[:2], [0.5, -0.5])
    with pytest.raises(ValueError):
        group_advantages(ts, normalize="bogus")


def test_to_torch_dtypes_and_aliases():
    torch = pytest.importorskip("torch")
    out = to_torch(collate([traj(1, "i", 0, [1, 2], [3, 4], reward=1.0)]))
    assert out["input_ids"].dtype == torch.int64 and out["attention_mask"].dtype == torch.int64
    assert out["rollout_logprobs"].dtype == torch.float32 and out["status"].dtype == torch.bool
    assert out["loss_mask"] is out["response_mask"]
    assert isinstance(out["instance_ids"], np.ndarray)  # object arrays pass through


def test_collate_matches_a_model_forward():
    """The layout is what a causal LM needs: the logit at column P + j - 1 predicts response token j,
    identically for a left-padded row and the same row alone."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    a = traj(1, "i", 0, [5, 6, 7, 8, 9], [10, 11, 12])
    b = traj(2, "i", 1, [5, 6], [13, 14, 15, 16])
    out = to_torch(collate([a, b], pad_id=0))
    P = out["prompts"].shape[1]
    with torch.no_grad():
        logits = m(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                   position_ids=out["position_ids"]).logits
        lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
        alone = m(input_ids=torch.tensor([[5, 6, 13, 14, 15, 16]])).logits
        lp_alone = torch.log_softmax(alone[0, 1:-1], -1).gather(-1, torch.tensor([[13], [14], [15], [16]])).squeeze(-1)
    torch.testing.assert_close(lp[1, :4], lp_alone, atol=1e-5, rtol=0)


def test_to_message_log_for_nemo_rl():
    from rolloutd.gateway.batch import to_message_log

    t = traj(1, "i", 0, [1, 2, 3], [20, 21, 30, 31, 32, 22], mask=[1, 1, 0, 0, 0, 1],
             lps=[-1, -2, 0, 0, 0, -3])
    log = to_message_log(t)
    assert [m["role"] for m in log] == ["user", "assistant", "environment", "assistant"]
    flat = np.concatenate([m["token_ids"] for m in log]).tolist()
    assert flat == [1, 2, 3, 20, 21, 30, 31, 32, 22]
    assert log[1]["generation_logprobs"].tolist() == [-1, -2] and log[3]["generation_logprobs"].tolist() == [-3]
    assert "generation_logprobs" not in log[2]
    # NeMo RL's rule (loss on assistant messages only) gives back loss_mask
    rebuilt = np.concatenate([np.full(len(m["token_ids"]), m["role"] == "assistant") for m in log[1:]])
    assert rebuilt.astype(int).tolist() == t["loss_mask"].tolist()
    assert to_message_log(traj(2, "i", 0, [1], []))[0]["token_ids"].tolist() == [1]
    torch = pytest.importorskip("torch")
    assert to_message_log(t, as_torch=True)[1]["token_ids"].dtype == torch.int64


def test_segments_expand_into_rows_sharing_reward_and_group():
    import numpy as np

    from rolloutd.gateway.batch import collate, expand_segments, group_advantages, segments_of

    def traj(job, reward, segs):
        last = segs[-1]
        t = {"job_id": job, "instance_id": "g", "sample_index": job, "status": "ok", "reward": reward,
             "policy_version": 1, "turns": [], **{k: np.asarray(v) for k, v in last.items()}}
        if len(segs) > 1:
            t["segments"] = [dict({k: np.asarray(v) for k, v in sg.items()}, index=i, turns=[])
                             for i, sg in enumerate(segs)]
        return t

    seg = lambda p, r: {"prompt_ids": p, "response_ids": r, "loss_mask": [1] * len(r),  # noqa: E731
                        "logprobs": [-0.5] * len(r)}
    a = traj(1, 1.0, [seg([1, 2], [3]), seg([1, 2, 3, 9], [4, 5])])
    b = traj(2, 0.0, [seg([1], [6, 7])])
    assert [s["index"] for s in segments_of(a)] == [0, 1] and len(segments_of(b)) == 1
    rows = expand_segments([a, b])
    assert [(r["job_id"], r["segment_index"], r["num_segments"]) for r in rows] == [(1, 0, 2), (1, 1, 2), (2, 0, 1)]
    assert all("segments" not in r for r in rows)
    last = collate([a, b])
    assert last["responses"].tolist() == [[4, 5], [6, 7]] and last["segment_index"].tolist() == [1, 0]
    ex = collate([a, b], segments="expand")
    assert ex["responses"].tolist() == [[3, 0], [4, 5], [6, 7]]
    assert ex["token_level_rewards"].tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    assert ex["job_ids"].tolist() == [1, 1, 2] and ex["segment_index"].tolist() == [0, 1, 0]
    # one vote per trajectory: two segments of job 1 do not count twice in the group's mean/std
    adv = group_advantages(rows)
    assert adv[0] == adv[1] and np.isclose(adv[0], -adv[2]) and adv[0] > 0
    bad = dict(a, segments=[dict(s, index=1 - i) for i, s in enumerate(a["segments"])])
    with pytest.raises(ValueError, match="not indexed"):
        segments_of(bad)
