#!/usr/bin/env python
"""TRL's GRPOTrainer with rolloutd as its rollout function: the tiny policy learns to answer in
digits on the CPU, with TRL's own GRPO loss, every rollout run by `rolloutd up` (toy handler)
against `rolloutd serve-hf`, and the new weights loaded into serve-hf after every step.

TRL 1.16's ``GRPOTrainer(rollout_func=...)`` calls ``rollout_func(prompts, trainer)`` with this
process's slice of the batch: each prompt already repeated ``num_generations`` times in a row
(TRL's RepeatSampler). :func:`make_rollout_func` submits each distinct prompt once with
``n = num_generations`` and returns, per completion, what TRL needs:

==================  ===========================================================================
``prompt_ids``      the trajectory's ``prompt_ids`` (rendered by the handler, never re-tokenized)
``completion_ids``  ``response_ids``: every response token, sampled and environment ones
``logprobs``        the service's per-token logprobs (0 on environment tokens)
``env_mask``        ``loss_mask``: 1 on sampled tokens, 0 on environment tokens (TRL masks those
                    out of its loss, as for its own tool calls); multi-turn episodes arrive intact
``rolloutd_reward`` the handler's reward (0 for infrastructure failures); the reward function
                    :func:`rolloutd_reward` hands it to TRL
``rolloutd_status`` ``ok`` / ``failed`` / ``timeout`` / ``cancelled``
==================  ===========================================================================

A failed trajectory becomes one masked pad token (env_mask 0) with reward 0; TRL has no
per-sample status, so keep failures rare (``deadline_s``, the handler's timeouts).

Every step (a ``TrainerCallback``): save the policy to ``checkpoints/v{k}``, POST
``/update_weights_from_disk`` to serve-hf, re-register it with the gateway at
``policy_version = k``. The rollout function checks that every trajectory of step k says
``policy_version == k`` and that the trainer's own forward pass gives the service's logprobs
(max abs diff < 1e-3 at temperature 1: the data is on-policy).

Run (prints one ``STEP {json}`` per step and a ``SUMMARY {json}``; exit 1 when a check failed)::

    python examples/trl/grpo_trl.py --steps 8 --out /tmp/trl-grpo
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/: the hand-written GRPO example's process helpers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16

import train_tiny_grpo as base  # noqa: E402  (Child, start_rolloutd, start_server, reload_weights)

LOGPROB_TOL = base.LOGPROB_TOL


def rolloutd_reward(completions, rolloutd_reward, **kwargs):
    """TRL reward function: the reward rolloutd's handler computed (forwarded by rollout_func)."""
    return [float(r) for r in rolloutd_reward]


def trajectories_to_trl(trajs, pad_id: int) -> dict:
    """rolloutd trajectories as TRL's rollout_func output (one entry per trajectory)."""
    from rolloutd.gateway.batch import reward_of, token_arrays, token_policy_versions, trainable

    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "rolloutd_reward": [],
           "rolloutd_status": [], "rolloutd_policy_version": [], "token_policy_versions": []}
    for t in trajs:
        prompt, resp, mask, lps = token_arrays(t)
        ok = trainable(t)  # status ok and a finite reward: TRL never sees a NaN
        tokver = [int(v) for v in token_policy_versions(t)]  # TRL's loss has no per-token version: for rewards/logs
        if not ok or len(resp) == 0:  # TRL has no status: one masked token, reward 0
            resp, mask, lps, tokver = [pad_id], [0], [0.0], [-1]
            prompt = prompt if len(prompt) else [pad_id]
        out["prompt_ids"].append([int(x) for x in prompt])
        out["completion_ids"].append([int(x) for x in resp])
        out["logprobs"].append([float(x) if m else 0.0 for x, m in zip(lps, mask)])
        out["env_mask"].append([int(m > 0) for m in mask])
        out["rolloutd_reward"].append(reward_of(t))
        out["rolloutd_status"].append(t.get("status"))
        out["rolloutd_policy_version"].append(t.get("policy_version"))
        out["token_policy_versions"].append(tokver)
    return out


def make_rollout_func(client, make_task, *, num_generations: int, pad_id: int, deadline_s: float = 300.0,
                      log_step=None):
    """``rollout_func(prompts, trainer)`` for TRL's GRPOTrainer, running the episodes in rolloutd.
    ``make_task(prompt, group_index, trainer)`` turns one distinct prompt into a rolloutd task."""
    def rollout_func(prompts, trainer):
        G = num_generations
        if len(prompts) % G:
            raise ValueError(f"rollout_func: {len(prompts)} prompts is not a multiple of num_generations={G}")
        groups = [prompts[i:i + G] for i in range(0, len(prompts), G)]
        for g in groups:  # TRL repeats each prompt G times in a row; one task with n=G per group
            if any(p != g[0] for p in g):
                raise ValueError("rollout_func: expected each prompt repeated num_generations times in a row")
        tasks = [make_task(g[0], i, trainer) for i, g in enumerate(groups)]
        t0 = time.monotonic()
        trajs = client.gather(client.submit(tasks, n=G, deadline_s=deadline_s))
        out = trajectories_to_trl(trajs, pad_id)
        if log_step is not None:
            log_step(trajs, out, trainer, time.monotonic() - t0)
        return out

    return rollout_func


def trainer_logprobs(model, prompt_ids, completion_ids):
    """log p(completion token) under ``model`` for each row (lists, unpadded)."""
    import torch

    res = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):
            ids = torch.tensor([list(p) + list(c)])
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
            pos = torch.arange(len(p), len(p) + len(c))
            res.append(logp[pos - 1, ids[0, pos]].tolist())
    return res


def train(args) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rolloutd.gateway.batch import BatchClient, status_counts
    from rolloutd.backends.tiny_model import make_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    shutil.rmtree(ckpt_root, ignore_errors=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.train_threads:
        torch.set_num_threads(args.train_threads)
    v0 = make_tiny_model(ckpt_root / "v0", seed=args.model_seed)
    tok = AutoTokenizer.from_pretrained(str(v0), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(v0), dtype=torch.float32, local_files_only=True)
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    rng = random.Random(args.seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Reply with digits only: {rng.randrange(10, 10_000)}"}]}
                                 for _ in range(args.batch * (args.steps + 2))])

    history: list[dict] = []
    failures: list[str] = []
    children: list = []
    state = {"version": 0, "url": None, "swap_s": 0.0}
    metrics_f = open(out / "metrics.jsonl", "w")
    t_start = time.monotonic()
    client = None
    try:
        env, _ = base.toy_entry_point_env(out)
        up, gateway = base.start_rolloutd(out, args.batch * args.n, env)
        children.append(up)
        server, url = base.start_server(v0, out, 0, args.server_threads)
        children.append(server)
        state["url"] = url
        client = BatchClient(gateway, poll_wait_s=0.5)
        client.swap_backends([url], policy_version=0)

        def make_task(prompt, gi, trainer):
            step = trainer.state.global_step
            return {"handler": "toy", "instance_id": f"s{step}-g{gi}", "timeout_s": 120.0,
                    "instance": {"messages": prompt, "tokenizer": str(v0), "target_ids": digit_ids,
                                 "reward": "fraction",
                                 "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0,
                                              "seed": (args.seed * 1_000_003 + step * 1009 + gi * 101) % 2 ** 31}}}

        def log_step(trajs, trl_out, trainer, roll_s):
            step = trainer.state.global_step
            counts = status_counts(trajs)
            # every sampled token, not only the first turn: a swap under stale_policy=continue mixes versions
            versions = sorted({v for row, m in zip(trl_out["token_policy_versions"], trl_out["env_mask"])
                               for v, k in zip(row, m) if k} | {t["policy_version"] for t in trajs if t["status"] == "ok"})
            if versions != [state["version"]]:
                failures.append(f"step {step}: trajectories from policy versions {versions}, expected "
                                f"[{state['version']}]")
            ours = trainer_logprobs(trainer.model, trl_out["prompt_ids"], trl_out["completion_ids"])
            diffs = [abs(a - b) for row_o, row_s, m in zip(ours, trl_out["logprobs"], trl_out["env_mask"])
                     for a, b, k in zip(row_o, row_s, m) if k]
            lp_diff = max(diffs) if diffs else 0.0
            if lp_diff > LOGPROB_TOL:
                failures.append(f"step {step}: trainer logprobs differ from the service's by {lp_diff:.2e}")
            rewards = trl_out["rolloutd_reward"]
            rec = {"step": step, "reward_mean": round(float(np.mean(rewards)), 4), "statuses": counts,
                   "policy_versions": versions, "logprob_max_abs_diff": float(f"{lp_diff:.3g}"),
                   "rollout_s": round(roll_s, 3), "swap_s": round(state["swap_s"], 3),
                   "env_tokens": int(sum(len(m) - sum(m) for m in trl_out["env_mask"]))}
            history.append(rec)
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
            base.log("STEP " + json.dumps(rec))

        class SyncWeights(TrainerCallback):
            """After every optimizer step: the new weights into serve-hf, the new version to the gateway."""

            def on_step_end(self, targs, tstate, control, model=None, **kw):
                t0 = time.monotonic()
                k = tstate.global_step
                d = ckpt_root / f"v{k}"
                model.save_pretrained(d, safe_serialization=True)
                tok.save_pretrained(d)
                if not base.reload_weights(state["url"], d):
                    raise RuntimeError("serve-hf has no /update_weights_from_disk")
                client.swap_backends([state["url"]], policy_version=k)
                state["version"] = k
                state["swap_s"] = time.monotonic() - t0
                if k > 1:  # keep the disk small: only the newest two checkpoints
                    shutil.rmtree(ckpt_root / f"v{k - 2}", ignore_errors=True)

        cfg = GRPOConfig(
            output_dir=str(out / "trl"), use_cpu=True, bf16=False, seed=args.seed, max_steps=args.steps,
            per_device_train_batch_size=args.batch * args.n, num_generations=args.n,
            max_completion_length=args.max_tokens, temperature=1.0, learning_rate=args.lr, beta=0.0,
            logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0,
            shuffle_dataset=False, disable_dropout=True, lr_scheduler_type="constant", warmup_steps=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[rolloutd_reward], args=cfg, train_dataset=dataset,
                              processing_class=tok, callbacks=[SyncWeights()],
                              rollout_func=make_rollout_func(client, make_task, num_generations=args.n, pad_id=pad_id,
                                                             deadline_s=args.deadline, log_step=log_step))
        trainer.train()
    finally:
        metrics_f.close()
        if client is not None:
            client.close()
        for c in reversed(children):
            c.stop()
        for c in children:
            root = getattr(c, "runtime_root", None)
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
    rewards = [h["reward_mean"] for h in history]
    summary = {"steps": len(history), "reward_first": rewards[0] if rewards else None,
               "reward_last": rewards[-1] if rewards else None,
               "reward_max": max(rewards) if rewards else None,
               "logprob_max_abs_diff": max((h["logprob_max_abs_diff"] for h in history), default=None),
               "wall_s": round(time.monotonic() - t_start, 1), "failures": failures}
    base.log("SUMMARY " + json.dumps(summary))
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="distinct prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (TRL's num_generations)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--train-threads", type=int, default=1)
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--out", default="/tmp/rolloutd-trl-grpo")
    return p.parse_args(argv)


def main(argv=None) -> int:
    summary = train(parse_args(argv))
    return 1 if summary["failures"] or not summary["steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
