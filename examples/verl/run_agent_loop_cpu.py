#!/usr/bin/env python
"""veRL 0.9.1's own agent-loop workers driving rolloutd on the CPU: the rollout half of a veRL
step, without GPUs, vLLM or a Ray cluster.

* ``--path v1`` (veRL's default, ``trainer.use_v1: true``): ``AgentLoopWorkerTQ`` (the class under
  its Ray actor wrapper) gets a V1 batch (TensorDict with ``uid`` and ``global_steps``, as
  ``trainer_base._submit_batch_to_rollout`` builds it) and puts each finished session into
  TransferQueue. TransferQueue's calls are kept in memory here (the real ones need its
  controller/storage cluster); the tags are then checked with veRL V1's own cast
  (``np.array(..., dtype=int)``).
* ``--path legacy``: ``AgentLoopWorker.generate_sequences`` on a ``DataProto``; the padded batch.

Rows are stock veRL GSM8K-style chat rows (``raw_prompt`` + ``reward_model.ground_truth``, no
rolloutd fields), mapped by ``examples/verl/agent_loop.yaml`` as shipped to the ``dialogue``
handler. The LLM is ``rolloutd serve-hf`` on the tiny model (``make_tiny_model``): a random
policy, so the reward (answer contains the ground truth) is ~0; the figures are the plumbing's.

    python examples/verl/run_agent_loop_cpu.py --path v1 --prompts 8 --n 4
    python examples/verl/run_agent_loop_cpu.py --path legacy --prompts 8 --n 4

Prints ``RESULT {json}`` (rows, statuses, seconds, tokens) and exits 1 if a check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import train_tiny_grpo as base  # noqa: E402  (Child, start_rolloutd, start_server)


class MemoryTransferQueue:
    """TransferQueue 0.1.11's client calls, in memory (the real ones need a TQ cluster)."""

    def __init__(self):
        self.kv: dict[tuple[str, str], dict] = {}

    def init(self, *a, **kw):
        pass

    async def async_kv_put(self, key, partition_id=None, fields=None, tag=None):
        self.kv.setdefault((partition_id, key), {}).update(tag=tag, fields=fields)

    async def async_kv_batch_put(self, keys, partition_id=None, fields=None, tags=None):
        for i, k in enumerate(keys):
            self.kv[(partition_id, k)] = {"tag": tags[i], "fields": fields[i] if fields is not None else None}


def stock_rows(k: int):
    import numpy as np

    rows = []
    for i in range(k):
        a, b = 3 + i, 7 + 2 * i
        q = f"Natalia sold {a} clips in April and {b} in May. How many clips did she sell in total?"
        rows.append({"raw_prompt": [{"role": "user", "content": q + " Let's think step by step."}],
                     "data_source": "openai/gsm8k", "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i, "question": q}, "index": np.int64(i)})
    return rows


def verl_config(model_dir, args):
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    cfg.trainer.use_v1 = args.path == "v1"
    r = cfg.actor_rollout_ref.rollout
    r.name, r.n, r.prompt_length, r.response_length = "vllm", args.n, args.prompt_length, args.response_length
    r.temperature, r.calculate_log_probs = 1.0, True
    r.agent.agent_loop_config_path = str(HERE / "agent_loop.yaml")
    r.agent.default_agent_loop = "rolloutd"
    cfg.actor_rollout_ref.model.path = str(model_dir)
    return cfg


async def run_v1(cfg, rows, global_steps: int):
    import numpy as np
    from verl.trainer.ppo.v1 import agent_loop_tq
    from verl.utils import tensordict_utils as tu

    mem = MemoryTransferQueue()
    agent_loop_tq.tq = mem
    worker = agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__(cfg, llm_client=None)
    batch_dict = {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}
    batch_dict["uid"] = np.array([f"p{i}" for i in range(len(rows))], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    t0 = time.monotonic()
    await worker.generate_sequences(batch)
    await asyncio.gather(*list(worker.background_tasks))
    wall = time.monotonic() - t0
    prompts = {k: v["tag"]["status"] for (_, k), v in mem.kv.items() if "_" not in k}
    trajs = [v for (_, k), v in mem.kv.items() if "_" in k]
    tags = [t["tag"] for t in trajs]
    mins = np.array([t["min_global_steps"] for t in tags], dtype=int)  # veRL V1's own cast
    maxs = np.array([t["max_global_steps"] for t in tags], dtype=int)
    statuses = [t["fields"]["extra_fields"]["rolloutd_status"] for t in trajs]
    return {"rows": len(trajs), "prompt_status": sorted(set(prompts.values())),
            "rolloutd_status": {s: statuses.count(s) for s in set(statuses)},
            "global_steps": sorted(set(mins.tolist()) | set(maxs.tolist())),
            "response_tokens": int(sum(t["response_len"] for t in tags)),
            "reward_mean": float(np.mean([float(t["fields"]["rm_scores"].sum()) for t in trajs])),
            "rollout_s": round(wall, 3)}


async def run_legacy(cfg, rows, global_steps: int):
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    worker = AgentLoopWorker(cfg, llm_client=None)
    rep = [r for r in rows for _ in range(cfg.actor_rollout_ref.rollout.n)]  # veRL repeats rows n times
    nt = {k: np.array([r[k] for r in rep], dtype=object) for k in rep[0]}
    batch = DataProto(batch=None, non_tensor_batch=nt, meta_info={"global_steps": global_steps})
    t0 = time.monotonic()
    out = await worker.generate_sequences(batch)
    wall = time.monotonic() - t0
    st = out.non_tensor_batch["rolloutd_status"].tolist()
    return {"rows": len(st), "rolloutd_status": {s: st.count(s) for s in set(st)},
            "shapes": {k: list(out.batch[k].shape) for k in ("prompts", "responses", "response_mask")},
            "global_steps": sorted({int(x) for x in out.non_tensor_batch["min_global_steps"]}),
            "response_tokens": int(out.batch["response_mask"].sum()),
            "reward_mean": float(out.batch["rm_scores"].sum(-1).mean()), "rollout_s": round(wall, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=["v1", "legacy"], default="v1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--out", default="/tmp/rolloutd-verl-cpu")
    args = ap.parse_args(argv)

    from rolloutd.gateway import verl_adapter as va
    from rolloutd.gateway.batch import BatchClient
    from rolloutd.backends.tiny_model import make_tiny_model

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = make_tiny_model(out / "model", seed=0)
    children = []
    t_start = time.monotonic()
    try:
        env, _ = base.toy_entry_point_env(out)
        up, gateway = base.start_rolloutd(out, args.prompts * args.n, env)
        children.append(up)
        server, url = base.start_server(model_dir, out, 0, 1)
        children.append(server)
        os.environ["ROLLOUTD_GATEWAY"] = gateway
        with BatchClient(gateway) as c:  # veRL's trainer does this after each weight sync
            va.register_verl_servers(c, [url], policy_version=5)
        cfg = verl_config(model_dir, args)
        run = run_v1 if args.path == "v1" else run_legacy
        try:
            res = asyncio.run(run(cfg, stock_rows(args.prompts), global_steps=5))
        finally:
            va.close_shared_clients()
    finally:
        for ch in reversed(children):
            ch.stop()
        shutil.rmtree(getattr(children[0], "runtime_root", out / "none"), ignore_errors=True) if children else None
    res.update(path=args.path, prompts=args.prompts, n=args.n, wall_s=round(time.monotonic() - t_start, 1))
    print("RESULT " + json.dumps(res), flush=True)
    ok = res["rows"] == args.prompts * args.n and set(res["rolloutd_status"]) == {"ok"} and res["global_steps"] == [5]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
