"""`rolloutd up` + `serve-hf` on the tiny model: real multi-turn trajectories through the client,
whose logprobs a trainer-side forward pass reproduces (nothing was re-tokenized anywhere)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install rolloutd[torch])")


def test_multi_turn_trajectories_match_a_forward_pass(up_factory, tiny_model_dir, hf_server):
    from transformers import AutoModelForCausalLM

    up = up_factory(f"handlers.dialogue.tokenizer={tiny_model_dir}")
    tasks = [{"handler": "dialogue", "instance_id": f"d{i}",
              "instance": {"messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                           "user_turns": ["Go on.", "And now backwards?"],
                           "sampling": {"max_tokens": 6, "temperature": 1.0}}} for i in range(4)]
    with up.client() as c:
        c.add_backend(hf_server.url, policy_version=3)
        results = list(c.gather(c.submit(tasks), timeout_s=180))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True).eval()
    for r in results:
        assert r["status"] == "ok", r["error"]
        assert len(r["turns"]) == 3 and all(t["policy_version"] == 3 for t in r["turns"])
        mask = r["loss_mask"].astype(bool)
        spans = sum(t["span"][1] - t["span"][0] for t in r["turns"])
        assert mask.sum() == spans > 0
        assert (~mask).sum() > 0  # the user follow-ups are in the response, masked out
        assert np.all(r["logprobs"][~mask] == 0)
        ids = np.concatenate([r["prompt_ids"], r["response_ids"]]).astype(np.int64)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor(ids[None])).logits[0].float(), dim=-1).numpy()
        p = len(r["prompt_ids"])
        pos = np.nonzero(mask)[0] + p  # position of each sampled token in the full sequence
        recomputed = logp[pos - 1, ids[pos]]
        assert np.max(np.abs(recomputed - r["logprobs"][mask])) < 1e-3
