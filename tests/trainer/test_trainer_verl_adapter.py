"""The veRL agent-loop adapter.

* Where veRL's agent-loop module imports (``verl.experimental.agent_loop.agent_loop``: it needs
  ray, hydra, omegaconf, tensordict, ...), the adapter subclasses the real ``AgentLoopBase``
  and the last test drives it with veRL's own ``AgentLoopWorker.generate_sequences`` (veRL's
  padding, masks, ``rm_scores``), against a real ``rolloutd up``.
* Where it does not (the project venv and CI: veRL is not a dependency), the adapter uses
  stand-ins with veRL 0.9.1's fields; if the veRL package is installed but not importable,
  its source is parsed to check that the stand-ins still match it.
Which of the two ran is visible in the test ids / skip reasons (``-ra``).
"""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rolloutd.gateway import verl_adapter as va
from rolloutd.gateway.batch import collate

P_LEN, R_LEN = 96, 16


def verl_config(model_dir=None, agent_loop_yaml=None):
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.rollout.prompt_length = P_LEN
    cfg.actor_rollout_ref.rollout.response_length = R_LEN
    if model_dir is not None:
        cfg.actor_rollout_ref.model.path = str(model_dir)
    if agent_loop_yaml is not None:
        cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(agent_loop_yaml)
    return cfg


def make_loop(tok, **kw):
    """The adapter as veRL's worker constructs it (real veRL config when veRL imports)."""
    if va.VERL_AVAILABLE:
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap

        cfg = verl_config()
        return va.RolloutdAgentLoop(DictConfigWrap(cfg), None, tok, None, None, DictConfigWrap(cfg.data), **kw)
    cfg = {"actor_rollout_ref": {"rollout": {"prompt_length": P_LEN, "response_length": R_LEN}}, "data": {}}
    return va.RolloutdAgentLoop(SimpleNamespace(config=cfg), None, tok, None, None, SimpleNamespace(config={}), **kw)


def fields_of(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.model_fields)  # pydantic (real veRL)


# -- the interface ---------------------------------------------------------------------------
def test_adapter_fits_the_agent_loop_interface():
    assert issubclass(va.RolloutdAgentLoop, va.AgentLoopBase)
    assert inspect.iscoroutinefunction(va.RolloutdAgentLoop.run)
    params = list(inspect.signature(va.RolloutdAgentLoop.run).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "sampling_params"] and params[-1].kind == params[-1].VAR_KEYWORD
    init = inspect.signature(va.RolloutdAgentLoop.__init__).parameters
    for name in ("trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls", "data_config"):
        assert name in init
    assert {"prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score", "num_turns",
            "metrics", "extra_fields"} <= fields_of(va.AgentLoopOutput)
    assert {"generate_sequences", "tool_calls", "compute_score"} <= fields_of(va.AgentLoopMetrics)
    if va.VERL_AVAILABLE:
        from verl.experimental.agent_loop import agent_loop as real

        assert va.AgentLoopBase is real.AgentLoopBase and va.AgentLoopOutput is real.AgentLoopOutput
        assert real._agent_loop_registry[va.AGENT_NAME] == {"_target_": "rolloutd.gateway.verl_adapter.RolloutdAgentLoop"}


def _verl_source() -> Path | None:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "experimental" / "agent_loop" / "agent_loop.py"
    return p if p.exists() else None


def test_stand_ins_match_verl_source():
    """Without an importable veRL: the stand-ins' fields and constructor match veRL's source."""
    src = _verl_source()
    if src is None:
        pytest.skip("veRL is not installed: the adapter is tested against the documented interface only")
    tree = ast.parse(src.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for cls_name, ours in (("AgentLoopOutput", va.AgentLoopOutput), ("AgentLoopMetrics", va.AgentLoopMetrics)):
        theirs = {s.target.id for s in classes[cls_name].body if isinstance(s, ast.AnnAssign)}
        assert fields_of(ours) == theirs, (cls_name, fields_of(ours) ^ theirs)
    init = next(f for f in classes["AgentLoopBase"].body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    theirs = [a.arg for a in init.args.args]
    assert theirs[:7] == ["self", "trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls",
                          "data_config"]
    run = next(f for f in classes["AgentLoopBase"].body if isinstance(f, ast.AsyncFunctionDef) and f.name == "run")
    assert [a.arg for a in run.args.args] == ["self", "sampling_params"] and run.args.kwarg is not None
    reg = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "register")
    assert [a.arg for a in reg.args.args] == ["agent_name"]


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
    loop = make_loop(tiny_tokenizer, handler="h")
    out = loop.to_output(multi_turn_traj(status="timeout"))
    assert out.response_mask == [0] * 8 and out.reward_score == 0.0 and out.response_logprobs == [0.0] * 8
    assert out.extra_fields["rolloutd_ok"] is False
    empty = {"job_id": 1, "status": "failed", "reward": 0.0, "error": {"type": "E", "message": "m"},
             "prompt_ids": np.zeros(0, np.int32), "response_ids": np.zeros(0, np.int32),
             "loss_mask": np.zeros(0, np.int8), "logprobs": np.zeros(0, np.float32), "turns": [],
             "policy_version": None}
    out = loop.to_output(empty)
    assert out.response_ids == [tiny_tokenizer.pad_token_id] and out.response_mask == [0] and out.prompt_ids == []
    assert "min_global_steps" not in out.extra_fields


def test_to_output_cuts_to_response_length(tiny_tokenizer):
    t = multi_turn_traj()
    t["response_ids"] = np.arange(40, dtype=np.int32)
    t["loss_mask"] = np.ones(40, np.int8)
    t["logprobs"] = np.full(40, -1.0, np.float32)
    out = make_loop(tiny_tokenizer, handler="h").to_output(t)
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs) == R_LEN


def test_build_task(tiny_tokenizer):
    loop = make_loop(tiny_tokenizer, handler="math", task_timeout_s=60)
    msgs = np.array([{"role": "user", "content": "1+1?"}], dtype=object)
    t = loop.build_task({"temperature": 0.9, "top_p": 1.0, "top_k": -1, "logprobs": True},
                        raw_prompt=msgs, reward_model={"ground_truth": "2"}, data_source="gsm",
                        extra_info={"index": np.int64(7), "split": "train"}, index=np.int64(7))
    assert t["handler"] == "math" and t["instance_id"] == "gsm-7" and t["timeout_s"] == 60 and t["n"] == 1
    inst = t["instance"]
    assert inst["messages"] == [{"role": "user", "content": "1+1?"}] and inst["ground_truth"] == "2"
    assert inst["extra_info"] == {"index": 7, "split": "train"} and isinstance(inst["extra_info"]["index"], int)
    assert inst["sampling"] == {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "max_tokens": R_LEN}
    # a row may name its own handler and instance
    t = loop.build_task({"temperature": 1.0}, raw_prompt=msgs,
                        extra_info={"rolloutd": {"handler": "toy", "instance": {"prompt_ids": [1, 2],
                                                                                "sampling": {"max_tokens": 4}},
                                                 "instance_id": "abc", "timeout_s": 5}})
    assert t["handler"] == "toy" and t["instance_id"] == "abc" and t["timeout_s"] == 5
    assert t["instance"]["sampling"] == {"max_tokens": 4, "temperature": 1.0}  # the row's own values win
    with pytest.raises(ValueError, match="no handler"):
        make_loop(tiny_tokenizer).build_task({}, raw_prompt=msgs)


# -- end to end through rolloutd ----------------------------------------------------------------
def synthetic_row(i, calls=2, **inst):
    return {"raw_prompt": np.array([{"role": "user", "content": f"q{i}"}], dtype=object), "data_source": "syn",
            "index": np.int64(i),
            "extra_info": {"index": i, "rolloutd": {"handler": "synthetic_llm",
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
        return outs, bad

    try:
        outs, bad = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        va.close_shared_clients()
    for o in outs:
        assert len(o.response_ids) == 6 and o.response_mask == [1] * 6 and o.reward_score == 1.0
        assert all(lp <= 0 for lp in o.response_logprobs) and len(o.prompt_ids) == 16
        assert o.extra_fields["min_global_steps"] == o.extra_fields["max_global_steps"] == 5
        assert o.num_turns == 3 and o.extra_fields["rolloutd_ok"] is True
    assert bad.extra_fields["rolloutd_status"] == "failed" and bad.response_mask == [0] * len(bad.response_mask)
    assert submitted.count(1.0) == 2  # the infrastructure failure was re-run once


@pytest.mark.skipif(not va.VERL_AVAILABLE, reason=f"veRL's agent loop does not import here ({va.VERL_IMPORT_ERROR}); "
                                                  "the adapter was tested against the documented interface only")
def test_verl_agent_loop_worker_drives_the_adapter(up, backends, tmp_path, monkeypatch):
    """veRL's own AgentLoopWorker (no Ray actor: the plain class), configured with the shipped
    examples/verl/agent_loop.yaml, runs the adapter for a batch and pads it; the result equals
    rolloutd.gateway.batch.collate of the same trajectories."""
    torch = pytest.importorskip("torch")
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    from rolloutd.llm.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model")
    yaml = Path(__file__).resolve().parents[2] / "examples" / "verl" / "agent_loop.yaml"
    monkeypatch.setenv("ROLLOUTD_GATEWAY", up.gateway)
    b = backends()
    with up.client() as c:
        c.add_backend(b.url, policy_version=2)
    worker = AgentLoopWorker(verl_config(model_dir, yaml), llm_client=None)
    rows = [synthetic_row(i, calls=1 + i % 3) for i in range(5)]
    batch = DataProto(batch=None, non_tensor_batch={
        k: np.array([r[k] for r in rows] if k != "raw_prompt" else [list(r[k]) for r in rows], dtype=object)
        for k in rows[0]} | {"agent_name": np.array(["rolloutd"] * 5, dtype=object)}, meta_info={})
    seen = []

    async def main():
        client = va.shared_client(up.gateway)
        orig = client.arollout

        async def recording(task, **kw):
            r = await orig(task, **kw)
            seen.append(r)
            return r

        client.arollout = recording
        return await worker.generate_sequences(batch)

    try:
        out = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        va.close_shared_clients()
    td = out.batch
    assert td["prompts"].shape == (5, P_LEN) and td["responses"].shape == (5, R_LEN)
    by_index = {int(r["job_id"]): r for r in seen}
    job_ids = [int(j) for j in out.non_tensor_batch["rolloutd_job_id"]]
    trajs = [by_index[j] for j in job_ids]
    ref = collate(trajs, pad_id=worker.tokenizer.pad_token_id, prompt_length=P_LEN, response_length=R_LEN)
    for ours, theirs in (("prompts", "prompts"), ("responses", "responses"), ("input_ids", "input_ids"),
                         ("attention_mask", "attention_mask"), ("position_ids", "position_ids"),
                         ("loss_mask", "response_mask"), ("rollout_logprobs", "rollout_log_probs"),
                         ("token_level_rewards", "rm_scores")):
        np.testing.assert_allclose(ref[ours], td[theirs].numpy(), rtol=0, atol=1e-6, err_msg=ours)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [1 + 1 + i % 3 for i in range(5)]
    assert [int(v) for v in out.non_tensor_batch["min_global_steps"]] == [2] * 5
    assert torch.all(td["rm_scores"].sum(-1) == 1.0)
