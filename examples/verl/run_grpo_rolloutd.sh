#!/usr/bin/env bash
# GRPO with veRL, rollouts through rolloutd. A sketch for a real cluster (GPUs, veRL with its own
# dependencies installed): the hydra overrides that matter for rolloutd are marked.
# veRL keeps training and serving (its vLLM replicas); rolloutd runs the episodes (sandboxes,
# tools, reward) and calls veRL's replicas, which the trainer registers with the gateway after
# every weight sync (rolloutd.gateway.verl_adapter.register_verl_servers, see docs/TRAINERS.md).
set -euo pipefail
: "${ROLLOUTD_GATEWAY:?set ROLLOUTD_GATEWAY, e.g. tcp://head:5550}"
HERE="$(cd "$(dirname "$0")" && pwd)"

python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.norm_adv_by_std_in_grpo=true \
  data.train_files="$HOME/data/train.parquet" \
  data.val_files="$HOME/data/val.parquet" \
  data.train_batch_size=64 \
  data.max_prompt_length=4096 \
  data.max_response_length=16384 \
  actor_rollout_ref.model.path="$HOME/models/Qwen2.5-7B-Instruct" \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.prompt_length=4096 \
  actor_rollout_ref.rollout.response_length=16384 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  `# --- rolloutd: every sample goes through the adapter (V1, veRL 0.9.1's default, and legacy alike) ---` \
  trainer.use_v1=true \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loop.yaml" \
  actor_rollout_ref.rollout.agent.default_agent_loop=rolloutd \
  `# --- the service's logprobs are the behaviour policy's: correct for staleness with them ---` \
  algorithm.rollout_correction.rollout_is=token \
  algorithm.rollout_correction.rollout_is_threshold=2.0 \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  "$@"
