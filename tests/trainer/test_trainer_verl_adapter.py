"""The veRL agent-loop adapter, against real veRL 0.9.1 (installed by `make test`; no stand-ins).

* conversion, prompt trimming, row mapping and sampling precedence on the adapter as veRL's
  worker constructs it (veRL's own config, ``DictConfigWrap``, pydantic ``AgentLoopOutput``);
* veRL's legacy ``AgentLoopWorker.generate_sequences`` (padding, masks, ``rm_scores``) and its
  V1 ``AgentLoopWorkerTQ`` (the default, ``trainer.use_v1: true``) driving the adapter against a
  real ``rolloutd up``; on V1 only TransferQueue's calls are replaced, by an in-memory store
  (they need a TransferQueue cluster), and its tags go through veRL's own int cast;
* the shipped ``examples/verl/agent_loop.yaml`` on a stock veRL chat row.

veRL not importing is a collection error here, not a skip.
"""
from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as real
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap
from verl.protocol import DataProto
from verl.trainer.ppo.v1 import agent_loop_tq
from verl.utils import tensordict_utils as tu

from rolloutd.gateway import verl_adapter as va
from rolloutd.gateway.batch import collate

P_LEN, R_LEN = 96, 16
YAML = Path(__file__).resolve().parents[2] / "examples" / "verl" / "agent_loop.yaml"


def verl_config(model_dir=None, agent_loop_yaml=None, *, use_v1=False, n=1):
    import verl

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.rollout.prompt_length = P_LEN
    cfg.actor_rollout_ref.rollout.response_length = R_LEN
    cfg.actor_rollout_ref.rollout.n = n
    cfg.trainer.use_v1 = use_v1
    if model_dir is not None:
        cfg.actor_rollout_ref.model.path = str(model_dir)
    if agent_loop_yaml is not None:
        cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(agent_loop_yaml)
    return cfg


def make_loop(tok, *, use_v1=False, model_dir=None, **kw):
    """The adapter as veRL's worker constructs it."""
    cfg = verl_config(model_dir, use_v1=use_v1)
    return va.RolloutdAgentLoop(DictConfigWrap(cfg), None, tok, None, None, DictConfigWrap(cfg.data), **kw)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rolloutd.backends.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model"))


# -- the interface ---------------------------------------------------------------------------
def test_adapter_is_a_real_verl_agent_loop():
    import verl

    assert verl.__version__ == "0.9.1"
    assert issubclass(va.RolloutdAgentLoop, real.AgentLoopBase)
    assert va.AgentLoopOutput is real.AgentLoopOutput and va.AgentLoopMetrics is real.AgentLoopMetrics
    # registered at import; veRL merges an agent_loop.yaml entry's settings into the same dict when a
    # worker loads one (another test may have), so only the target is this test's to check
    assert real._agent_loop_registry[va.AGENT_NAME]["_target_"] == "rolloutd.gateway.verl_adapter.RolloutdAgentLoop"
    assert inspect.iscoroutinefunction(va.RolloutdAgentLoop.run)
    assert not inspect.isabstract(va.RolloutdAgentLoop)


# -- conversion --------------------------------------------------------------------------------
def multi_turn_traj(status="ok"):
    # two assistant turns with a 3-token observation between them, versions 4 then 5
    return {"job_id": 9, "instance_id": "x", "sample_index": 0, "status": status, "reward": 0.75, "error": None,
            "prompt_ids": np.arange(1, 11, dtype=np.int32),
            "response_ids": np.array([20, 21, 22, 30, 31, 32, 23, 24], np.int32),
            "loss_mask": np.array([1, 1, 1, 0, 0, 0, 1, 1], np.int8),
            "logprobs": np.array([-.1, -.2, -.3, 0, 0, 0, -.4, -.5], np.float32),
            "turns": [{"span": [0, 3], "policy_version": 4}, {"span": [6, 8], "policy_version": 5}],
            "policy_version": 4, "metrics": {"llm_s": 1.5, "tools_s": 0.5}, "timing": {"eval": 0.25},
            "eval_details": {"passed": 3}}


def test_to_output_multi_turn(tiny_tokenizer):
    out = make_loop(tiny_tokenizer, handler="h").to_output(multi_turn_traj())
    assert out.prompt_ids == list(range(1, 11))
    assert out.response_ids == [20, 21, 22, 30, 31, 32, 23, 24]
    assert out.response_mask == [1, 1, 1, 0, 0, 0, 1, 1]
    np.testing.assert_allclose(out.response_logprobs, [-.1, -.2, -.3, 0, 0, 0, -.4, -.5], rtol=1e-6)
    assert out.reward_score == 0.75
    assert out.num_turns == 4  # user, assistant, tool, assistant
    assert out.metrics.generate_sequences == 1.5 and out.metrics.tool_calls == 0.5
    assert out.metrics.compute_score == 0.25
    ef = out.extra_fields
    assert ef["rolloutd_ok"] is True and ef["rolloutd_status"] == "ok" and ef["rolloutd_job_id"] == 9
    assert (ef["min_global_steps"], ef["max_global_steps"]) == (4, 5)
    assert ef["reward_extra_info"] == {"rolloutd_ok": 1.0} and ef["rolloutd_eval_details"] == {"passed": 3}


def test_to_output_failures_are_masked_not_rewarded(tiny_tokenizer):
    va._newest_version[0] = None
    loop = make_loop(tiny_tokenizer, handler="h")
    out = loop.to_output(multi_turn_traj(status="timeout"))
    assert out.response_mask == [0] * 8 and out.reward_score == 0.0 and out.response_logprobs == [0.0] * 8
    assert out.extra_fields["rolloutd_ok"] is False
    empty = {"job_id": 1, "status": "failed", "reward": 0.0, "error": {"type": "E", "message": "m"},
             "prompt_ids": np.zeros(0, np.int32), "response_ids": np.zeros(0, np.int32),
             "loss_mask": np.zeros(0, np.int8), "logprobs": np.zeros(0, np.float32), "turns": [],
             "policy_version": None}
    out = loop.to_output(empty, global_steps=np.int64(7))
    pad = tiny_tokenizer.pad_token_id
    assert out.response_ids == [pad] and out.response_mask == [0] and out.prompt_ids == [pad]
    # veRL V1 casts these with np.array(..., dtype=int): never None
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (7, 7)
    assert type(out.extra_fields["min_global_steps"]) is int
    out = loop.to_output(empty)  # no step given: the newest version this process saw (the 5 above)
    assert np.array([out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]], dtype=int).tolist() \
        == [5, 5]


def test_to_output_cuts_to_response_length(tiny_tokenizer):
    t = multi_turn_traj()
    t["response_ids"] = np.arange(40, dtype=np.int32)
    t["loss_mask"] = np.ones(40, np.int8)
    t["logprobs"] = np.full(40, -1.0, np.float32)
    out = make_loop(tiny_tokenizer, handler="h").to_output(t)
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs) == R_LEN


def long_episode_traj():
    """The issue's case: 57 response tokens over 6 turns (24 sampled), the answer in the last turn."""
    t = multi_turn_traj()
    mask = np.zeros(57, np.int8)
    spans = [[i * 9, i * 9 + 4] for i in range(6)]
    for s, e in spans:
        mask[s:e] = 1
    t.update(response_ids=np.arange(100, 157, dtype=np.int32), loss_mask=mask,
             logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32), reward=1.0,
             turns=[{"span": sp, "policy_version": 4} for sp in spans])
    return t


def test_a_response_cut_to_response_length_is_flagged_and_masked(tiny_tokenizer):
    """Issue 28 item 4: it was cut with no flag and trained with reward 1.0 on its last kept token."""
    out = make_loop(tiny_tokenizer, handler="h").to_output(long_episode_traj())
    assert out.response_ids == list(range(100, 100 + R_LEN))
    assert out.extra_fields["rolloutd_response_truncated"] is True
    assert out.response_mask == [0] * R_LEN and out.response_logprobs == [0.0] * R_LEN  # no gradient...
    assert out.reward_score == 1.0  # ...but the episode's reward stays in its group's statistics
    kept = make_loop(tiny_tokenizer, handler="h", truncated_rows="keep").to_output(long_episode_traj())
    assert kept.extra_fields["rolloutd_response_truncated"] is True and kept.reward_score == 1.0
    assert kept.response_mask == long_episode_traj()["loss_mask"][:R_LEN].tolist() and sum(kept.response_mask) == 8
    short = make_loop(tiny_tokenizer, handler="h").to_output(multi_turn_traj())
    assert short.extra_fields["rolloutd_response_truncated"] is False and sum(short.response_mask) == 5
    with pytest.raises(ValueError, match="truncated_rows"):
        make_loop(tiny_tokenizer, handler="h", truncated_rows="drop")


def test_prompt_longer_than_prompt_length_is_left_truncated_as_verl_does(tiny_tokenizer):
    t = multi_turn_traj()
    t["prompt_ids"] = np.arange(1, P_LEN + 31, dtype=np.int32)
    loop = make_loop(tiny_tokenizer, handler="h")
    out = loop.to_output(t)
    assert out.prompt_ids == list(range(31, P_LEN + 31))
    assert out.prompt_ids == loop._cap_text_prompt_length(list(range(1, P_LEN + 31)))  # veRL's own rule
    assert out.extra_fields["rolloutd_prompt_truncated"] is True
    assert make_loop(tiny_tokenizer, handler="h").to_output(multi_turn_traj()).extra_fields[
        "rolloutd_prompt_truncated"] is False


def two_segment_traj():
    t = multi_turn_traj()
    t["segments"] = [
        {"index": 0, "prompt_ids": np.array([1, 2, 3], np.int32), "response_ids": np.array([7, 8], np.int32),
         "loss_mask": np.array([1, 1], np.int8), "logprobs": np.array([-.5, -.6], np.float32),
         "turns": [{"span": [0, 2], "policy_version": 3}]},
        {"index": 1, **{k: t[k] for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "turns")}},
    ]
    return t


def test_segments(tiny_tokenizer):
    with pytest.raises(ValueError, match="use_v1"):
        make_loop(tiny_tokenizer, handler="h", segments="all")
    legacy = make_loop(tiny_tokenizer, handler="h")
    assert legacy.segments == "last"
    (only,) = legacy.to_outputs(two_segment_traj())
    assert only.response_ids == [20, 21, 22, 30, 31, 32, 23, 24] and only.extra_fields["rolloutd_segment"] == 1
    v1 = make_loop(tiny_tokenizer, handler="h", use_v1=True)
    assert v1.segments == "all"
    first, last = v1.to_outputs(two_segment_traj())
    assert first.prompt_ids == [1, 2, 3] and first.response_ids == [7, 8] and first.response_mask == [1, 1]
    assert (first.extra_fields["min_global_steps"], first.extra_fields["max_global_steps"]) == (3, 3)
    assert (last.extra_fields["min_global_steps"], last.extra_fields["max_global_steps"]) == (4, 5)
    assert first.reward_score == last.reward_score == 0.75 and first.num_turns == 2


def stock_row(i, question="What is 8 * 9?", answer="72"):
    """A row as veRL's RLHFDataset yields it for its GSM8K preprocessing (examples/data_preprocess)."""
    return {"raw_prompt": np.array([{"role": "user", "content": question}], dtype=object),
            "data_source": "openai/gsm8k", "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {answer}", "question": question},
            "index": np.int64(i)}


def test_build_task(tiny_tokenizer):
    loop = make_loop(tiny_tokenizer, handler="math", task_timeout_s=60)
    msgs = np.array([{"role": "user", "content": "1+1?"}], dtype=object)
    spec = {"handler": "toy", "instance": {"prompt_ids": [1, 2], "sampling": {"max_tokens": 4, "temperature": 0.5}},
            "instance_id": "abc", "timeout_s": 5}
    t = loop.build_task({"temperature": 0.9, "top_p": 1.0, "top_k": -1, "logprobs": True}, raw_prompt=msgs,
                        data_source="gsm", extra_info={"rolloutd": spec, "index": 7}, index=np.int64(7))
    assert t["handler"] == "toy" and t["instance_id"] == "abc" and t["timeout_s"] == 5 and t["n"] == 1
    # veRL's sampling wins over the instance's own values; max_tokens is capped by response_length
    assert t["instance"]["sampling"] == {"max_tokens": 4, "temperature": 0.9, "top_p": 1.0, "top_k": -1}
    t = loop.build_task({"temperature": 0, "top_p": 1.0, "top_k": -1}, raw_prompt=msgs,  # greedy validation
                        extra_info={"rolloutd": dict(spec, instance={"prompt_ids": [1], "sampling": {
                            "temperature": 1.0, "max_tokens": 10 * R_LEN}})})
    assert t["instance"]["sampling"] == {"temperature": 0, "top_p": 1.0, "top_k": -1, "max_tokens": R_LEN}
    # ... unless the row's spec says otherwise
    t = loop.build_task({"temperature": 0}, extra_info={"rolloutd": dict(spec, sampling={"temperature": 0.7})})
    assert t["instance"]["sampling"]["temperature"] == 0.7
    # handlers whose instances take no sampling map are left alone (they refuse unknown keys)
    for h in ("harness", "synthetic_llm"):
        t = loop.build_task({"temperature": 0}, extra_info={"rolloutd": {"handler": h, "instance": {"task": "x"}}})
        assert t["instance"] == {"task": "x"}
    # V1 passes veRL's uid: the instance id, so the n sessions of a prompt form one group
    t = loop.build_task({}, uid="u-1", extra_info={"rolloutd": {"handler": "toy", "instance": {}}})
    assert t["instance_id"] == "u-1"
    with pytest.raises(ValueError, match="no handler"):
        make_loop(tiny_tokenizer).build_task({}, raw_prompt=msgs)


def test_stock_chat_row_maps_to_dialogue_or_is_refused(tiny_tokenizer, tiny_tokenizer_dir):
    loop = make_loop(tiny_tokenizer, handler="dialogue", model_dir=tiny_tokenizer_dir)
    t = loop.build_task({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, **stock_row(3))
    assert t["handler"] == "dialogue" and t["instance_id"] == "openai/gsm8k-3"
    inst = t["instance"]
    assert inst["messages"] == [{"role": "user", "content": "What is 8 * 9?"}]
    assert inst["expect"] == inst["ground_truth"] == "72" and inst["tokenizer"] == str(tiny_tokenizer_dir)
    assert inst["extra_info"]["question"] == "What is 8 * 9?"
    assert inst["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": R_LEN}
    # a handler that cannot run a chat row is refused with what the row lacks
    with pytest.raises(va.RowRefused, match=r"handler 'swe' cannot run an ordinary veRL chat row.*instance"):
        make_loop(tiny_tokenizer, handler="swe", model_dir=tiny_tokenizer_dir).build_task({}, **stock_row(0))
    row = stock_row(0)
    row["reward_model"] = {"style": "model"}
    with pytest.raises(va.RowRefused, match="lacks reward_model.ground_truth"):
        loop.build_task({}, **row)
    row = stock_row(0)
    row["raw_prompt"] = np.array([], dtype=object)
    with pytest.raises(va.RowRefused, match="lacks raw_prompt"):
        loop.build_task({}, **row)


# -- end to end through rolloutd ----------------------------------------------------------------
def synthetic_row(i, calls=2, **inst):
    return {"raw_prompt": np.array([{"role": "user", "content": f"q{i}"}], dtype=object), "data_source": "syn",
            "index": np.int64(i),
            "extra_info": {"index": i, "rolloutd": {"handler": "synthetic_llm", "sampling": False,  # takes none
                                                     "instance": dict({"llm_calls": calls, "max_tokens": 3}, **inst)}}}


def test_run_through_rolloutd(up, backends, tiny_tokenizer):
    b = backends()
    with up.client() as c:
        c.add_backend(b.url, policy_version=5)
    loop = make_loop(tiny_tokenizer, gateway=up.gateway, deadline_s=60, handler="synthetic_llm")
    submitted = []

    async def main():
        orig = loop.client._ctl.submit

        def counting(tasks, *a, **kw):
            submitted.extend(t["instance"].get("fail", {}).get("run", 0) for t in tasks)
            return orig(tasks, *a, **kw)

        loop.client._ctl.submit = counting
        outs = await asyncio.gather(*(loop.run({"temperature": 1.0}, **synthetic_row(i)) for i in range(6)))
        failing = make_loop(tiny_tokenizer, gateway=up.gateway, deadline_s=60, resubmit_failed=1)
        bad = await failing.run({}, **synthetic_row(99, fail={"run": 1.0}))
        raising = make_loop(tiny_tokenizer, gateway=up.gateway, deadline_s=60, failed_rows="raise", use_v1=True)
        with pytest.raises(va.SampleFailed, match="failed"):  # V1 then marks the group "failure"
            await raising.run({}, **synthetic_row(98, fail={"init": 1.0}))
        return outs, bad

    try:
        outs, bad = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        va.close_shared_clients()
    for o in outs:
        assert o.extra_fields["rolloutd_ok"] is True, o.extra_fields["rolloutd_error"]
        assert len(o.response_ids) == 6 and o.response_mask == [1] * 6 and o.reward_score == 1.0
        assert all(lp <= 0 for lp in o.response_logprobs) and len(o.prompt_ids) == 16
        assert o.extra_fields["min_global_steps"] == o.extra_fields["max_global_steps"] == 5
        assert o.num_turns == 3 and o.extra_fields["rolloutd_ok"] is True
    assert bad.extra_fields["rolloutd_status"] == "failed" and bad.response_mask == [0] * len(bad.response_mask)
    assert submitted.count(1.0) == 2  # the infrastructure failure was re-run once




def dataproto(rows, agent_name="rolloutd"):
    keys = list(rows[0])
    nt = {k: np.array([r[k] for r in rows] if k != "raw_prompt" else [list(r[k]) for r in rows], dtype=object)
          for k in keys}
    nt["agent_name"] = np.array([agent_name] * len(rows), dtype=object)
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


def recording_client(up):
    seen = []
    client = va.shared_client(up.gateway)
    orig = client.arollout

    async def recording(task, **kw):
        r = await orig(task, **kw)
        seen.append(r)
        return r

    client.arollout = recording
    return seen


def run_legacy_worker(up, backend, tiny_model_dir, rows, monkeypatch):
    """veRL's legacy AgentLoopWorker over ``up`` (``backend`` added at policy version 2) on
    ``rows``: (its DataProto, the trajectories the adapter's client got, the worker)."""
    monkeypatch.setenv("ROLLOUTD_GATEWAY", up.gateway)
    with up.client() as c:
        c.add_backend(backend.url, policy_version=2)
    worker = AgentLoopWorker(verl_config(tiny_model_dir, YAML), llm_client=None)

    async def main():
        seen = recording_client(up)
        return await worker.generate_sequences(dataproto(rows)), seen

    try:
        return (*asyncio.run(asyncio.wait_for(main(), 120)), worker)
    finally:
        va.close_shared_clients()


def test_legacy_agent_loop_worker_drives_the_adapter(up, backends, tiny_model_dir, monkeypatch):
    """veRL's own (legacy, trainer.use_v1: false) AgentLoopWorker, the plain class without a Ray
    actor, runs the adapter for a batch and pads it; the result equals
    rolloutd.gateway.batch.collate of the same trajectories. One prompt is longer than
    rollout.prompt_length: before the fix it made the whole batch fail in veRL's padding."""
    rows = [synthetic_row(i, calls=1 + i % 3) for i in range(5)]
    rows[4]["extra_info"]["rolloutd"]["instance"]["prompt_len"] = P_LEN + 20
    out, seen, worker = run_legacy_worker(up, backends(), tiny_model_dir, rows, monkeypatch)
    td = out.batch
    assert td["prompts"].shape == (5, P_LEN) and td["responses"].shape == (5, R_LEN)
    by_job = {int(r["job_id"]): r for r in seen}
    trajs = [by_job[int(j)] for j in out.non_tensor_batch["rolloutd_job_id"]]
    assert len(trajs[4]["prompt_ids"]) == P_LEN + 20
    ref = collate(trajs, pad_id=worker.tokenizer.pad_token_id, prompt_length=P_LEN, response_length=R_LEN,
                  truncate=True)
    assert ref["truncated"].tolist() == [False] * 4 + [True]
    for ours, theirs in (("prompts", "prompts"), ("responses", "responses"), ("input_ids", "input_ids"),
                         ("attention_mask", "attention_mask"), ("position_ids", "position_ids"),
                         ("loss_mask", "response_mask"), ("rollout_logprobs", "rollout_log_probs"),
                         ("token_level_rewards", "rm_scores")):
        np.testing.assert_allclose(ref[ours], td[theirs].numpy(), rtol=0, atol=1e-6, err_msg=ours)
    assert td["prompts"][4].tolist() == list(range(21, P_LEN + 21))  # the last P_LEN prompt tokens
    assert out.non_tensor_batch["__num_turns__"].tolist() == [1 + 1 + i % 3 for i in range(5)]
    assert [int(v) for v in out.non_tensor_batch["min_global_steps"]] == [2] * 5
    assert out.non_tensor_batch["rolloutd_prompt_truncated"].tolist() == [False] * 4 + [True]
    assert torch.all(td["rm_scores"].sum(-1) == 1.0)


class MemoryTransferQueue:
    """TransferQueue's client calls (``transfer_queue`` module functions) kept in memory: the real
    ones need a TransferQueue controller and storage cluster. Same signatures as 0.1.11."""

    def __init__(self):
        self.kv: dict[tuple[str, str], dict] = {}

    def init(self, *a, **kw):
        pass

    async def async_kv_put(self, key, partition_id=None, fields=None, tag=None):
        self.kv.setdefault((partition_id, key), {}).update(tag=tag, fields=fields)

    async def async_kv_batch_put(self, keys, partition_id=None, fields=None, tags=None):
        for i, k in enumerate(keys):
            self.kv[(partition_id, k)] = {"tag": tags[i], "fields": fields[i] if fields is not None else None}


def v1_batch(rows, global_steps):
    """What veRL V1's trainer hands AgentLoopManagerTQ: the dataloader's dict + uid, as a TensorDict."""
    keys = list(rows[0])
    batch_dict = {k: np.array([r[k] for r in rows] if k != "raw_prompt" else [list(r[k]) for r in rows], dtype=object)
                  for k in keys}
    batch_dict["uid"] = np.array([f"u{i}" for i in range(len(rows))], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch


def test_legacy_worker_flags_and_masks_a_response_cut_to_response_length(up, backends, tiny_model_dir, monkeypatch):
    """Issue 28 item 4 through veRL's own worker and a real rolloutd up: an 8-call episode (24
    sampled tokens) is cut to R_LEN, flagged, masked; its reward sits on the last kept token."""
    rows = [synthetic_row(0, calls=1), synthetic_row(1, calls=8)]
    out, seen, _ = run_legacy_worker(up, backends(), tiny_model_dir, rows, monkeypatch)
    td = out.batch
    by_job = {int(r["job_id"]): r for r in seen}
    trajs = [by_job[int(j)] for j in out.non_tensor_batch["rolloutd_job_id"]]
    assert len(trajs[0]["response_ids"]) <= R_LEN < len(trajs[1]["response_ids"])
    assert out.non_tensor_batch["rolloutd_response_truncated"].tolist() == [False, True]
    assert td["response_mask"][0].sum() > 0 and td["response_mask"][1].sum() == 0
    assert td["responses"][1].tolist() == np.asarray(trajs[1]["response_ids"][:R_LEN]).tolist()
    assert td["rm_scores"][1].tolist() == [0.0] * (R_LEN - 1) + [1.0]  # veRL: the reward on the last kept token


def test_v1_agent_loop_worker_tq_drives_the_adapter(up, backends, tiny_model_dir, monkeypatch):
    """veRL's default path (trainer.use_v1: true): AgentLoopWorkerTQ (the class under its Ray actor
    wrapper) runs rollout.n sessions per prompt through the adapter and puts them in
    TransferQueue. Every trajectory tag has int min/max_global_steps (veRL casts them with
    np.array(dtype=int); before the fix a row failed before sampling had None and the cast
    raised), failed rows are masked, every prompt ends "finished"."""
    mem = MemoryTransferQueue()
    monkeypatch.setattr(agent_loop_tq, "tq", mem)
    monkeypatch.setenv("ROLLOUTD_GATEWAY", up.gateway)
    b = backends()
    with up.client() as c:
        c.add_backend(b.url, policy_version=3)
    cfg = verl_config(tiny_model_dir, YAML, use_v1=True, n=2)
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "rolloutd"  # rows name no agent_name: the documented way
    worker = agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__(cfg, llm_client=None)
    rows = [synthetic_row(i, calls=1 + i % 2) for i in range(3)]
    rows.append(synthetic_row(3, fail={"init": 1.0}))  # fails before sampling: no turn, no version
    rows[2]["extra_info"]["rolloutd"]["instance"]["prompt_len"] = P_LEN + 5

    async def main():
        recording_client(up)
        await worker.generate_sequences(v1_batch(rows, global_steps=3))
        await asyncio.gather(*list(worker.background_tasks))

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        va.close_shared_clients()
    prompts = {k: v["tag"] for (part, k), v in mem.kv.items() if "_" not in k}
    assert prompts == {f"u{i}": {"status": "finished"} for i in range(4)}
    traj_keys = sorted(k for (part, k) in mem.kv if "_" in k)
    assert traj_keys == [f"u{i}_{s}_0" for i in range(4) for s in range(2)]
    tags = [mem.kv[("train", k)]["tag"] for k in traj_keys]
    fields = [mem.kv[("train", k)]["fields"] for k in traj_keys]
    # veRL V1's own metric code (trainer_base._compute_metrics) on these tags
    mins = np.array([t["min_global_steps"] for t in tags], dtype=int)
    maxs = np.array([t["max_global_steps"] for t in tags], dtype=int)
    assert mins.tolist() == maxs.tolist() == [3] * 8
    assert all(t["status"] == "success" and t["global_steps"] == 3 for t in tags)
    assert [t["prompt_len"] for t in tags] == [16] * 4 + [P_LEN] * 2 + [1] * 2  # failed: one pad token
    for k, f, t in zip(traj_keys, fields, tags):
        ef = f["extra_fields"]
        mask = f["response_mask"]
        assert len(f["responses"]) == len(mask) == t["response_len"] <= R_LEN
        if k.startswith("u3"):
            assert ef["rolloutd_status"] == "failed" and mask.sum() == 0 and f["rm_scores"].sum() == 0
            assert ef["rolloutd_policy_version"] is None  # no turn ran: the steps above are the row's own
        else:
            assert ef["rolloutd_ok"] is True and mask.sum() == len(mask) and f["rm_scores"][-1] == 1.0
            assert torch.equal(f["loss_mask"], mask)
    assert [fields[i]["extra_fields"]["rolloutd_prompt_truncated"] for i in range(8)] == [False] * 4 + [True] * 2 + \
        [False] * 2


def test_v1_postprocess_takes_one_row_per_segment(tiny_tokenizer, tiny_model_dir, monkeypatch):
    """segments: all (V1's default): veRL's own V1 postprocess stores each segment as a row of
    the same prompt and session ({uid}_{session}_{i}), the final reward copied to each."""
    mem = MemoryTransferQueue()
    monkeypatch.setattr(agent_loop_tq, "tq", mem)
    worker = agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__(verl_config(tiny_model_dir, YAML, use_v1=True),
                                                                 llm_client=None)
    loop = make_loop(worker.tokenizer, handler="h", use_v1=True)
    outs = loop.to_outputs(two_segment_traj(), global_steps=5)
    asyncio.run(worker._agent_loop_postprocess(outs, False, uid="u9", session_id=1, global_steps=5,
                                               raw_prompt=[{"role": "user", "content": "x"}]))
    assert sorted(k for _, k in mem.kv) == ["u9_1_0", "u9_1_1"]
    f0, f1 = mem.kv[("train", "u9_1_0")]["fields"], mem.kv[("train", "u9_1_1")]["fields"]
    assert f0["prompts"].tolist() == [1, 2, 3] and f0["responses"].tolist() == [7, 8]
    assert f1["responses"].tolist() == [20, 21, 22, 30, 31, 32, 23, 24]
    assert f0["rm_scores"].tolist() == [0.0, 0.75] and f1["rm_scores"][-1] == 0.75
    t0, t1 = mem.kv[("train", "u9_1_0")]["tag"], mem.kv[("train", "u9_1_1")]["tag"]
    assert (t0["min_global_steps"], t0["max_global_steps"], t1["min_global_steps"], t1["max_global_steps"]) == \
        (3, 3, 4, 5)


def test_shipped_yaml_runs_a_stock_verl_chat_row(up_factory, tiny_model_dir, monkeypatch):
    """examples/verl/agent_loop.yaml as shipped (handler: dialogue), veRL's legacy worker, stock
    GSM8K-style rows (raw_prompt + reward_model, nothing rolloutd-specific): each row runs (status
    ok, sampled tokens unmasked) and is scored by whether the answer contains the ground truth.
    The LLM is a scripted vLLM-protocol server answering "72" (no GPU vLLM here)."""
    from rolloutd.backends.scripted import ScriptedBackend

    shipped = OmegaConf.load(YAML)
    assert shipped[0].handler == "dialogue"
    up = up_factory()
    monkeypatch.setenv("ROLLOUTD_GATEWAY", up.gateway)
    srv = ScriptedBackend(str(tiny_model_dir), policy="constant:text=72", latency=0.01)
    srv.start()
    try:
        with up.client() as c:
            c.add_backend(srv.url, policy_version=1)
        worker = AgentLoopWorker(verl_config(tiny_model_dir, YAML), llm_client=None)
        rows = [stock_row(0), stock_row(1, "What is 2 + 3?", "5")]

        async def main():
            return await worker.generate_sequences(dataproto(rows))

        try:
            out = asyncio.run(asyncio.wait_for(main(), 120))
        finally:
            va.close_shared_clients()
    finally:
        srv.stop()
    nt = out.non_tensor_batch
    assert nt["rolloutd_status"].tolist() == ["ok", "ok"], nt["rolloutd_error"]
    assert out.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0]
    assert out.batch["response_mask"].sum(-1).min() > 0
