"""The toy handler: reward function, in-process phases, and through a real ``rolloutd up``."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rolloutd.bus.messages import Job
from rolloutd.handlers.base import JobContext
from rolloutd.handlers.toy import ToyHandler, score


def test_score_modes():
    inst = {"target_ids": [5, 6]}
    assert score(inst, np.array([5, 6, 7, 8]))[0] == 0.5
    assert score(inst, np.array([], np.int32))[0] == 0.0
    assert score(dict(inst, reward="any"), np.array([1, 2, 6]))[0] == 1.0
    assert score(dict(inst, reward="any"), np.array([1, 2]))[0] == 0.0
    pre = {"reward": "prefix", "target_prefix_ids": [3, 4]}
    assert score(pre, np.array([3, 4, 9]))[0] == 1.0
    assert score(pre, np.array([3]))[0] == 0.0
    with pytest.raises(ValueError):
        score({}, np.array([1]))
    with pytest.raises(ValueError):
        score({"reward": "nope", "target_ids": [1]}, np.array([1]))


class FakeLLM:
    def __init__(self, ids, lps):
        self.calls = []
        self.ids, self.lps = ids, lps

    async def __call__(self, prompt_ids, params):
        from rolloutd.llm.client import Generation

        self.calls.append((np.asarray(prompt_ids).tolist(), params))
        return Generation(token_ids=np.asarray(self.ids, np.int32), logprobs=np.asarray(self.lps, np.float32),
                          finish_reason="length"), "http://fake", 7


def run_phases(handler, instance, sample_index=0, llm=None):
    job = Job(job_id=1, attempt=1, handler="toy", instance=instance, instance_id="i", sample_index=sample_index)
    ctx = JobContext(job)
    ctx.llm = llm

    async def go():
        await handler.run(ctx)
        await handler.eval(ctx)

    asyncio.run(go())
    return ctx


def test_toy_phases_in_process():
    llm = FakeLLM([15, 16, 99], [-0.1, -0.2, -0.3])
    inst = {"prompt_ids": [1, 2, 3], "target_ids": [15, 16],
            "sampling": {"max_tokens": 3, "temperature": 0.7, "seed": 10}}
    ctx = run_phases(ToyHandler(), inst, sample_index=2, llm=llm)
    t = ctx.trajectory
    assert t["status"] == "ok"
    assert t["prompt_ids"].tolist() == [1, 2, 3] and t["response_ids"].tolist() == [15, 16, 99]
    assert t["loss_mask"].tolist() == [1, 1, 1] and t["logprobs"].dtype == np.float32
    assert t["reward"] == pytest.approx(2 / 3)
    assert t["policy_version"] == 7 and t["turns"][0]["span"] == [0, 3] and t["turns"][0]["backend"] == "http://fake"
    (prompt, params), = llm.calls
    assert prompt == [1, 2, 3] and params.max_tokens == 3 and params.temperature == 0.7
    assert params.seed == 12  # seed + sample index: the n samples of an instance differ


def test_toy_renders_messages_with_the_chat_template(tiny_tokenizer_dir, tiny_tokenizer):
    llm = FakeLLM([5], [-1.0])
    msgs = [{"role": "user", "content": "Reply with digits only: 42"}]
    ctx = run_phases(ToyHandler(), {"messages": msgs, "tokenizer": str(tiny_tokenizer_dir), "target_ids": [5]}, llm=llm)
    from rolloutd.llm.conversation import get_renderer

    assert ctx.trajectory["prompt_ids"].tolist() == list(get_renderer(tiny_tokenizer).render_prompt(msgs))
    assert ctx.trajectory["reward"] == 1.0


def test_toy_without_prompt_fails_cleanly():
    with pytest.raises(ValueError, match="prompt_ids"):
        run_phases(ToyHandler(), {"target_ids": [1]}, llm=FakeLLM([1], [0.0]))


def test_toy_through_rolloutd(up_factory, backends, tokenizer):
    """The toy handler in real daemons (found through its entry point), against a scripted backend
    that always answers "ok": reward 1 when the target is the token of "ok", 0 otherwise."""
    from rolloutd.gateway.batch import BatchClient
    from rolloutd.handlers.registry import handler_names

    assert "toy" in handler_names(), "toy is an entry point of rolloutd: reinstall it (pip install -e .)"

    up = up_factory()
    b = backends()
    ok_ids = [int(x) for x in tokenizer.encode("ok", add_special_tokens=False)]
    prompt = [int(x) for x in tokenizer.encode("say ok", add_special_tokens=False)]
    with BatchClient(up.gateway) as c:
        assert "toy" in c.status()["handlers"]
        c.swap_backends([b.url], policy_version=3)
        tasks = [{"handler": "toy", "instance_id": "hit", "instance": {"prompt_ids": prompt, "target_ids": ok_ids}},
                 {"handler": "toy", "instance_id": "miss", "instance": {"prompt_ids": prompt, "target_ids": [0]}}]
        res = c.gather(c.submit(tasks, n=2, deadline_s=60))
    assert [(r["instance_id"], r["sample_index"], r["status"]) for r in res] == [
        ("hit", 0, "ok"), ("hit", 1, "ok"), ("miss", 0, "ok"), ("miss", 1, "ok")]
    hit = res[0]
    assert hit["prompt_ids"].tolist() == prompt
    assert set(hit["response_ids"].tolist()) & set(ok_ids)
    assert hit["reward"] > 0 and res[2]["reward"] == 0.0
    assert all(r["policy_version"] == 3 for r in res)
