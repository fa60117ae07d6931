"""Token fidelity per model family through the run daemon, against the scripted vLLM stand-in.

For each family a real ``rolloutd up`` runs the math handler (python tool in a bubblewrap
sandbox) with the family's tokenizer and parser. The scripted backend emits, as exact
token ids, the family's own format: a first turn with two tool calls (reasoning first
where the family has it; gpt-oss calls once per turn because ``<|call|>`` stops
sampling, so it gets two turns of one call), then the final answer. The trajectory must
hold the emitted ids in the sampled spans (loss_mask 1), the tool results in the
observation spans (loss_mask 0, logprob 0), and what the backend received for each
generation must be exactly the trajectory so far.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from rolloutd.llm.families import FAMILIES, get_family
from rolloutd.backends.policies import Policy, PolicyReply

from .conftest import family_dir_or_skip, family_or_skip

pytestmark = pytest.mark.slow

CODES = ["print(6*7)", "print(40+2)"]
ANSWER = "The answer is \\boxed{42}."
THINK = "Two ways to check the product."


def _calls_json(style: str) -> str:
    if style == "hermes":
        return "\n".join('<tool_call>\n{"name": "python", "arguments": ' + json.dumps({"code": c}) + "}\n</tool_call>"
                         for c in CODES)
    raise ValueError(style)


def script(family: str, thinking: bool = False) -> list[str]:
    """The texts of the assistant turns, each ending with the family's end token."""
    if family == "deepseek_v31" and thinking:  # the generation prompt ends with <think>
        calls = "".join(f"<｜tool▁call▁begin｜>python<｜tool▁sep｜>{json.dumps({'code': c})}<｜tool▁call▁end｜>"
                        for c in CODES)
        return [THINK + "</think>Checking.<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                ANSWER + "<｜end▁of▁sentence｜>"]
    if family == "qwen3":
        return ["<think>\n" + THINK + "\n</think>\n\n" + _calls_json("hermes") + "<|im_end|>",
                "<think>\nBoth print 42.\n</think>\n\n" + ANSWER + "<|im_end|>"]
    if family == "qwen3_coder":
        calls = "".join(f"\n<tool_call>\n<function=python>\n<parameter=code>\n{c}\n</parameter>\n</function>\n</tool_call>"
                        for c in CODES)
        return ["Checking." + calls + "<|im_end|>", ANSWER + "<|im_end|>"]
    if family == "llama3":
        return ["; ".join(json.dumps({"name": "python", "parameters": {"code": c}}) for c in CODES) + "<|eot_id|>",
                ANSWER + "<|eot_id|>"]
    if family == "mistral":
        return ["[TOOL_CALLS]" + json.dumps([{"name": "python", "arguments": {"code": c}, "id": f"call{i}ABCD"}
                                             for i, c in enumerate(CODES)]) + "</s>", ANSWER + "</s>"]
    if family == "gpt_oss":
        return [f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant to=functions.python<|channel|>"
                f"commentary <|constrain|>json<|message|>{json.dumps({'code': c})}<|call|>" for c in CODES] + [
            f"<|channel|>final<|message|>{ANSWER}<|return|>"]
    if family == "deepseek_v31":
        calls = "".join(f"<｜tool▁call▁begin｜>python<｜tool▁sep｜>{json.dumps({'code': c})}<｜tool▁call▁end｜>"
                        for c in CODES)
        return ["Checking.<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                ANSWER + "<｜end▁of▁sentence｜>"]
    raise KeyError(family)


class Scripted(Policy):
    """Replies turn k of the script (k = how many scripted turns the prompt already holds)
    and records every prompt it was sent."""

    name = "family_script"

    def __init__(self, turns: list[list[int]]):
        super().__init__()
        self.turns = turns
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    def reply(self, req):
        p = list(req.prompt_ids)
        with self.lock:
            self.prompts.append(p)
        k = sum(1 for t in self.turns if _contains(p, t[-6:]))
        ids = self.turns[min(k, len(self.turns) - 1)]
        return PolicyReply(token_ids=ids, finish="stop", append_eos=False)


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


CASES = [(f, "keep", None) for f in sorted(FAMILIES)] + [
    ("qwen3", "drop", None),
    ("deepseek_v31", "drop", {"thinking": True}),
    ("deepseek_v31", "keep", {"thinking": True}),
]


@pytest.mark.parametrize("family,reasoning,template_kwargs", CASES)
def test_family_token_fidelity_through_run_daemon(family, reasoning, template_kwargs, up_factory, bwrap_required,
                                                  sandbox_root):
    from rolloutd.backends.scripted import ScriptedBackend

    tok_dir = str(family_dir_or_skip(family))
    tok = family_or_skip(family)
    turns = [tok.encode(t, add_special_tokens=False) for t in script(family, bool(template_kwargs))]
    pol = Scripted(turns)
    backend = ScriptedBackend(tok_dir, policy=pol)
    backend.start()
    try:
        hcfg = {"math": {"tokenizer": tok_dir, "max_turns": 4, "reasoning": reasoning}}
        if template_kwargs:
            hcfg["math"]["template_kwargs"] = template_kwargs
        if reasoning == "keep":  # the drop cases take the parser from the tokenizer's family
            hcfg["math"]["parser"] = get_family(family).parser
        up = up_factory("sandbox.runtime=bwrap", f"sandbox.root_dir={sandbox_root}", "handlers=" + json.dumps(hcfg))
        with up.client() as c:
            c.add_backend(backend.url)
            r = c.rollout("math", {"question": "What is 6*7?", "answer": "42"}, timeout_s=240)
    finally:
        backend.stop()
    assert r["status"] == "ok", r.get("error")
    assert r["reward"] == 1.0, r.get("eval_details")
    resp = np.asarray(r["response_ids"])
    mask = np.asarray(r["loss_mask"])
    lps = np.asarray(r["logprobs"])
    ts = r["turns"]
    assert len(ts) == len(turns)
    for t, want in zip(ts, turns):
        s, e = t["span"]
        assert resp[s:e].tolist() == want  # sampled spans are the emitted ids
        assert mask[s:e].all()
    for t in ts[:-1]:
        o0, o1 = t["obs_start"], t["obs_end"]
        assert o0 == t["end"] and not mask[o0:o1].any() and not lps[o0:o1].any()
        assert "42" in tok.decode(resp[o0:o1].tolist())  # the python tool's output
    assert ts[-1]["obs_start"] is None and ts[-1]["end"] == len(resp)
    n_calls = 1 if family == "gpt_oss" else 2
    assert tok.decode(resp[ts[0]["obs_start"]:ts[0]["obs_end"]].tolist()).count("42") == n_calls
    # every generation request carried exactly the trajectory so far
    # (the backend may see a context more than once: the client's retries, the run daemon's probes)
    prompt = list(r["prompt_ids"])
    full = prompt + resp.tolist()
    p = len(prompt)
    hidden = [t["hidden"] for t in ts if t["hidden"] is not None]
    if reasoning == "drop":  # the first turn's reasoning is hidden from the second generation
        assert len(hidden) == 1 and ts[0]["hidden"] is not None
        s, e = ts[0]["hidden"]
        assert THINK in tok.decode(full[p + s:p + e]) and ts[0]["start"] - 1 <= s < e <= ts[0]["end"]
    else:
        assert hidden == []

    def context(upto: int) -> list[int]:
        keep = np.ones(p + upto, bool)
        for s, e in hidden:
            if p + e <= p + upto:
                keep[p + s:p + e] = False
        return [i for i, k in zip(full[: p + upto], keep) if k]

    want = [context(t["start"]) for t in ts]
    assert all(p in want for p in pol.prompts)
    assert all(w in pol.prompts for w in want)
