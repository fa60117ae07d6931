"""TRL's GRPOTrainer (TRL 1.16, installed by `make test`) with rolloutd as its rollout function.

* examples/trl/grpo_trl.py end to end, short: TRL's own loss on the CPU, rollouts through
  `rolloutd up` + `rolloutd serve-hf`, the new weights loaded into serve-hf every step;
* multi-turn trajectories (the dialogue handler: user follow-ups inside the response) reach
  TRL's generation step intact: the same prompt and completion ids, logprobs, and the loss mask
  as TRL's tool mask; then one TRL training step runs on them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "trl" / "grpo_trl.py"
sys.path.insert(0, str(REPO / "examples" / "trl"))
sys.path.insert(0, str(REPO / "examples"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import trl  # noqa: E402  (a missing TRL is a collection error: `make test` installs it)


def parse(stdout: str):
    steps = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("STEP ")]
    summary = next((json.loads(line[8:]) for line in stdout.splitlines() if line.startswith("SUMMARY ")), None)
    return steps, summary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trl_grpo_example_learns_on_policy_with_weight_reloads(tmp_path):
    steps_n = 4
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(steps_n), "--seed", "0",
                           "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=560)
    steps, summary = parse(proc.stdout)
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert trl.__version__.startswith("1."), trl.__version__
    assert proc.returncode == 0 and summary is not None, detail
    assert summary["failures"] == [] and summary["steps"] == steps_n, detail
    # step k's rollouts all came from policy version k: serve-hf reloaded and the gateway re-registered it
    assert [s["policy_versions"] for s in steps] == [[k] for k in range(steps_n)], detail
    assert all(s["statuses"] == {"ok": 64} for s in steps), detail
    assert all(s["swap_s"] > 0 for s in steps[1:]), detail
    assert summary["logprob_max_abs_diff"] < 1e-3, detail
    curve = [s["reward_mean"] for s in steps]
    assert curve[-1] > curve[0] + 0.05, curve


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rolloutd.backends.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.mark.timeout(400)
def test_multi_turn_trajectories_reach_trl_intact(up_factory, tiny_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpo_trl import make_rollout_func, rolloutd_reward
    from rolloutd.gateway.batch import BatchClient
    from rolloutd.backends.serve_hf import HFServer

    G = 4
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    prompts = [[{"role": "user", "content": f"Count to {i + 3}."}] for i in range(2)]
    srv = HFServer(tiny_model_dir, max_batch_size=8, served_model_name="tiny", threads=1)
    srv.start()
    seen: list[dict] = []
    try:
        up = up_factory(f"handlers.dialogue.tokenizer={tiny_model_dir}")
        client = BatchClient(up.gateway, poll_wait_s=0.5)
        try:
            client.swap_backends([srv.url], policy_version=0)

            def make_task(prompt, gi, trainer):
                return {"handler": "dialogue", "instance_id": f"g{gi}", "timeout_s": 120.0,
                        "instance": {"messages": prompt, "user_turns": ["Go on."], "expect": "1",
                                     "sampling": {"max_tokens": 5, "temperature": 1.0}}}

            rollout = make_rollout_func(client, make_task, num_generations=G, pad_id=tok.pad_token_id,
                                        deadline_s=120, log_step=lambda trajs, *a: seen.extend(trajs))
            cfg = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_steps=1,
                             per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=64,
                             learning_rate=1e-3, beta=0.0, report_to="none", save_strategy="no",
                             dataloader_num_workers=0, logging_steps=1)
            trainer = GRPOTrainer(model=model, reward_funcs=[rolloutd_reward], args=cfg, processing_class=tok,
                                  train_dataset=Dataset.from_list([{"prompt": p} for p in prompts] * 4),
                                  rollout_func=rollout)
            repeated = [p for p in prompts for _ in range(G)]
            prompt_ids, completion_ids, tool_mask, _, logprobs, extra, _, _ = trainer._generate(repeated)
            n_before = len(seen)
            trainer.train()  # one GRPO step on multi-turn rows, TRL's loss with the tool mask
        finally:
            client.close()
    finally:
        srv.stop()
    trajs = seen[:n_before]
    assert len(trajs) == len(completion_ids) == 2 * G
    assert [t["instance_id"] for t in trajs] == ["g0"] * G + ["g1"] * G
    for t, p, c, m, lp in zip(trajs, prompt_ids, completion_ids, tool_mask, logprobs):
        assert t["status"] == "ok" and len(t["turns"]) == 2, t["error"]
        assert p == t["prompt_ids"].tolist() and c == t["response_ids"].tolist()
        assert m == t["loss_mask"].astype(int).tolist() and 0 in m and 1 in m  # the follow-up is masked out
        np.testing.assert_allclose(lp, t["logprobs"], rtol=0, atol=1e-7)
    assert extra["rolloutd_reward"] == [float(t["reward"]) for t in trajs]
    assert trainer.state.global_step == 1 and len(seen) == n_before + 2 * G
    assert np.isfinite(trainer.state.log_history[0]["loss"])
