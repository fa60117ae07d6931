"""Token fidelity per model family through the OpenAI-compatible endpoint.

The real ``openai`` SDK is the agent: it gets the family's sampled turn back as OpenAI
``tool_calls`` (and ``reasoning_content``), sends it back as structured history with the
tool results, and the endpoint must reuse the sampled ids (one segment), mask the tool
results and send the backend exactly the trajectory so far.
"""

from __future__ import annotations

import json

import pytest
from rolloutd.llm.families import FAMILIES, get_family
from rolloutd.llm.policies import Policy, PolicyReply

from .conftest import BASH, family_dir_or_skip, family_or_skip

pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from tests.llm.test_llm_openai_endpoint import Endpoint, check_exact

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def arun():
    from tests.llm.conftest import run_async

    return lambda coro: run_async(coro, timeout=240)


@pytest.fixture
def scripted():
    from rolloutd.llm.scripted import ScriptedBackend

    started = []

    def make(tokenizer, policy):
        be = ScriptedBackend(tokenizer, policy)
        be.start()
        started.append(be)
        return be

    yield make
    for be in started:
        be.stop()

CALLS = [{"command": "ls"}, {"command": "pwd"}]
THINK = "List, then locate."


def turns_of(family: str) -> list[str]:
    if family == "qwen3":
        return ["<think>\n" + THINK + "\n</think>\n\nRunning.\n" + "\n".join(
            '<tool_call>\n{"name": "bash", "arguments": ' + json.dumps(a) + "}\n</tool_call>" for a in CALLS)
            + "<|im_end|>", "Done.<|im_end|>"]
    if family == "qwen3_coder":
        return ["Running." + "".join(f"\n<tool_call>\n<function=bash>\n<parameter=command>\n{a['command']}\n"
                                     "</parameter>\n</function>\n</tool_call>" for a in CALLS) + "<|im_end|>",
                "Done.<|im_end|>"]
    if family == "llama3":
        return ["; ".join(json.dumps({"name": "bash", "parameters": a}) for a in CALLS) + "<|eot_id|>", "Done.<|eot_id|>"]
    if family == "mistral":
        return ["[TOOL_CALLS]" + json.dumps([{"name": "bash", "arguments": a, "id": f"c{i}abcdefg"}
                                             for i, a in enumerate(CALLS)]) + "</s>", "Done.</s>"]
    if family == "gpt_oss":
        return [f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant to=functions.bash<|channel|>"
                f"commentary <|constrain|>json<|message|>{json.dumps(CALLS[0])}<|call|>",
                "<|channel|>final<|message|>Done.<|return|>"]
    if family == "deepseek_v31":
        return ["Running.<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>bash<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for a in CALLS)
            + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "Done.<｜end▁of▁sentence｜>"]
    raise KeyError(family)


class Ids(Policy):
    def __init__(self, turns):
        super().__init__()
        self.turns, self.n = turns, 0

    def reply(self, request):
        ids = self.turns[min(self.n, len(self.turns) - 1)]
        self.n += 1
        return PolicyReply(token_ids=ids, finish="stop", append_eos=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_through_openai_endpoint(family, scripted, arun):
    tok_dir = family_dir_or_skip(family)
    tok = family_or_skip(family)
    fam = get_family(family)
    turns = [tok.encode(t, add_special_tokens=False) for t in turns_of(family)]
    be = scripted(str(tok_dir), Ids(turns))
    n_calls = 1 if family == "gpt_oss" else 2

    async def main():
        async with Endpoint(tok, be.url, parser=fam.parser) as ep:
            msgs = [{"role": "system", "content": "You run shell commands."}, {"role": "user", "content": "where am I?"}]
            r1 = await ep.client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            m = r1.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            for tc, out in zip(m.tool_calls, ("a.txt", "/work")):
                msgs.append({"role": "tool", "tool_call_id": tc.id, "name": tc.function.name, "content": out})
            r2 = await ep.client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            return ep, r1, r2

    ep, r1, r2 = arun(main())
    m = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("bash", a) for a in CALLS[:n_calls]]
    if family in ("qwen3", "gpt_oss"):
        assert (m.model_extra or {}).get("reasoning_content") == THINK
    assert r2.choices[0].message.content == "Done."
    t = ep.session.trajectory()
    check_exact(tok, t, ep.seen)
    assert t["metrics"]["segments"] == 1  # the sampled turn was reused, not re-rendered
    assert [ids for _, ids, _ in ep.seen] == turns
