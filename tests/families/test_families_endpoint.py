"""Token fidelity per model family through the OpenAI-compatible endpoint.

The real ``openai`` SDK is the agent: it gets the family's sampled turn back as OpenAI
``tool_calls`` (and ``reasoning_content``), sends it back as structured history with the
tool results, and the endpoint must reuse the sampled ids (one segment), mask the tool
results and send the backend exactly the trajectory so far.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from rolloutd.llm.families import FAMILIES, get_family
from rolloutd.backends.policies import Policy, PolicyReply

from .conftest import BASH, family_dir_or_skip, family_or_skip

pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from tests.llm.test_llm_openai_endpoint import Endpoint, check_exact

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def arun():
    from tests.llm.conftest import run_async

    return lambda coro: run_async(coro, timeout=240)


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


# -- reference equality through the endpoint (issue 26.4-5, issue 28.1) ---------------------------
FINAL = {"qwen3": "Done.<|im_end|>", "qwen3_coder": "Done.<|im_end|>", "llama3": "Done.<|eot_id|>",
         "mistral": "Done.</s>", "gpt_oss": "<|channel|>final<|message|>Done.<|return|>",
         "deepseek_v31": "Done.<｜end▁of▁sentence｜>"}


NEVER_READ = "<tool_call>not this</tool_call>"  # the Anthropic, Responses and Gemini shapes render from ids


def reference_backend(family: str, scripted):
    """The family's reference case and a scripted backend sampling its turns, then FINAL."""
    from .test_families_ids import reference_case

    case = reference_case(family)
    final = case.tok.encode(FINAL[family], add_special_tokens=False)
    return case, scripted(str(family_dir_or_skip(family)), Ids(case.turns + [final]))


@contextlib.asynccontextmanager
async def endpoint_over(be, tok, seen: list, text):
    """An EndpointSession over the scripted backend ``be``, served on 127.0.0.1: yields
    (session, server). Each prompt the backend is sent is appended to ``seen``; a generation's
    text is ``text(g)``."""
    import numpy as np
    from rolloutd.llm.client import LLMClient, simple_generate
    from rolloutd.endpoint.app import make_app
    from rolloutd.endpoint.bounds import EndpointLimits
    from rolloutd.endpoint.server import serve
    from rolloutd.endpoint.session import EndpointSession

    llm = LLMClient(be.url, timeout=60)
    inner = simple_generate(llm, "b0", 7)

    async def generate(ids, params):
        g, b, v = await inner(ids, params)
        g.text = text(g)
        seen.append(np.asarray(ids).tolist())
        return g, b, v

    session = EndpointSession(generate, tok, limits=EndpointLimits(max_context=8192))
    server = await serve(make_app(session), host="127.0.0.1", port=0)
    try:
        yield session, server
    finally:
        await server.stop()
        await llm.aclose()


@pytest.mark.parametrize("mode", ["skip", "keep"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_endpoint_equals_reference(family, mode, scripted, arun):
    """An OpenAI-SDK agent through the endpoint, no parser configured (the tokenizer's family
    picks it), the backend's text detokenized with special tokens skipped or kept (never used):
    the replies carry no markup, the reasoning, the calls with their control-token text and
    typed parameters, Mistral's sampled call ids; the agent's tool messages have no ``name``;
    what the backend is finally sent equals the family's reference id for id."""
    import openai

    from .test_families_ids import HEAD, TOOLS, assert_same_ids

    case, be = reference_backend(family, scripted)
    tok = case.tok
    seen: list[list[int]] = []

    def text(g):
        return tok.decode(g.token_ids.tolist(), skip_special_tokens=mode == "skip")

    async def main():
        async with endpoint_over(be, tok, seen, text) as (session, server):
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0)
            try:
                msgs, replies = list(HEAD), []
                for results in case.results:
                    r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
                    replies.append(r)
                    m = r.choices[0].message
                    msgs.append(m.model_dump(exclude_none=True))
                    for tc, out in zip(m.tool_calls or [], results):  # OpenAI style: no name
                        msgs.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                replies.append(await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS))
                return session, replies
            finally:
                await client.close()

    session, replies = arun(main())
    for i, r in enumerate(replies[:-1]):
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == case.calls[i]
        if case.call_ids:  # the ids the model sampled, not the endpoint's
            assert [c.id for c in m.tool_calls] == case.call_ids[i]
        assert m.content == case.content  # no markup; null when there is none
        assert (m.model_extra or {}).get("reasoning_content") == case.reasoning
    last = replies[-1].choices[0]
    assert last.finish_reason == "stop" and last.message.content == "Done." and not last.message.tool_calls
    assert_same_ids(seen[-1], case.want, tok)
    t = session.trajectory()
    assert t["metrics"]["segments"] == 1 and t["metrics"]["malformed_tool_calls"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_endpoint_anthropic_shape_equals_reference(family, scripted, arun):
    """The same reference conversation through the Anthropic Messages shape (the real anthropic SDK
    as the agent): thinking/text/tool_use blocks from the sampled ids, Mistral's sampled call ids
    inside the ``toolu_`` ids, ``tool_result`` blocks without names; what the backend is finally
    sent equals the family's reference id for id."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (pip install rolloutd[harness])")

    from .test_families_ids import SYSTEM, TOOLS, USER, assert_same_ids

    case, be = reference_backend(family, scripted)
    tok = case.tok
    seen: list[list[int]] = []
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]

    async def main():
        async with endpoint_over(be, tok, seen, lambda g: NEVER_READ) as (session, server):
            client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="k", max_retries=0)
            try:
                msgs, replies = [{"role": "user", "content": USER}], []
                for results in case.results:
                    r = await client.messages.create(model="m", max_tokens=1024, system=SYSTEM, messages=msgs, tools=tools)
                    replies.append(r)
                    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
                    uses = [b for b in r.content if b.type == "tool_use"]
                    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": out}
                                                             for b, out in zip(uses, results)]})
                replies.append(await client.messages.create(model="m", max_tokens=1024, system=SYSTEM, messages=msgs,
                                                            tools=tools))
                return session, replies
            finally:
                await client.close()

    session, replies = arun(main())
    for i, r in enumerate(replies[:-1]):
        assert r.stop_reason == "tool_use"
        uses = [b for b in r.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in uses] == case.calls[i]
        if case.call_ids:
            assert [b.id for b in uses] == ["toolu_" + c for c in case.call_ids[i]]
        texts = [b.text for b in r.content if b.type == "text"]
        assert texts == ([case.content] if case.content else [])
        thinking = [b.thinking for b in r.content if b.type == "thinking"]
        assert thinking == ([case.reasoning] if case.reasoning else [])
    last = replies[-1]
    assert last.stop_reason == "end_turn" and [b.text for b in last.content if b.type == "text"] == ["Done."]
    assert_same_ids(seen[-1], case.want, tok)
    assert session.trajectory()["metrics"]["segments"] == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_endpoint_responses_shape_equals_reference(family, scripted, arun):
    """The same through the Responses shape (the openai SDK's responses.create): reasoning,
    message and function_call items from the sampled ids, Mistral's sampled call ids,
    function_call_output items; the backend is finally sent the reference's ids."""
    import openai

    from .test_families_ids import SYSTEM, TOOLS, USER, assert_same_ids

    case, be = reference_backend(family, scripted)
    tok = case.tok
    seen: list[list[int]] = []
    tools = [{"type": "function", **t["function"]} for t in TOOLS]

    async def main():
        async with endpoint_over(be, tok, seen, lambda g: NEVER_READ) as (session, server):
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0)
            try:
                items, replies = [{"role": "user", "content": USER}], []
                for results in case.results:
                    r = await client.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools)
                    replies.append(r)
                    items += [o.model_dump(exclude_none=True) for o in r.output]
                    calls = [o for o in r.output if o.type == "function_call"]
                    items += [{"type": "function_call_output", "call_id": c.call_id, "output": out}
                              for c, out in zip(calls, results)]
                replies.append(await client.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools))
                return session, replies
            finally:
                await client.close()

    session, replies = arun(main())
    for i, r in enumerate(replies[:-1]):
        calls = [o for o in r.output if o.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == case.calls[i]
        if case.call_ids:
            assert [c.call_id for c in calls] == case.call_ids[i]
        assert (r.output_text or None) == case.content
    assert replies[-1].output_text == "Done."
    assert_same_ids(seen[-1], case.want, tok)
    assert session.trajectory()["metrics"]["segments"] == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_endpoint_gemini_shape_equals_reference(family, scripted, arun):
    """The same through the Gemini shape (google-genai's generate_content): functionCall parts from
    the sampled ids, functionResponse parts ``{"output": text}`` back; the backend is finally sent
    the reference's ids."""
    genai = pytest.importorskip("google.genai", reason="google-genai is not installed (pip install rolloutd[harness])")
    from google.genai import types

    from .test_families_ids import SYSTEM, TOOLS, USER, assert_same_ids

    case, be = reference_backend(family, scripted)
    tok = case.tok
    seen: list[list[int]] = []
    decls = [types.FunctionDeclaration(name=t["function"]["name"], description=t["function"]["description"],
                                       parameters_json_schema=t["function"]["parameters"]) for t in TOOLS]
    cfg = types.GenerateContentConfig(system_instruction=SYSTEM, tools=[types.Tool(function_declarations=decls)],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))

    async def main():
        async with endpoint_over(be, tok, seen, lambda g: NEVER_READ) as (session, server):
            client = genai.Client(api_key="k", http_options=types.HttpOptions(
                base_url=f"http://127.0.0.1:{server.port}", api_version="v1beta",
                retry_options=types.HttpRetryOptions(attempts=1)))
            try:
                contents, replies = [types.Content(role="user", parts=[types.Part(text=USER)])], []
                for results in case.results:
                    r = await client.aio.models.generate_content(model="m", contents=contents, config=cfg)
                    replies.append(r)
                    contents.append(r.candidates[0].content)
                    contents.append(types.Content(role="user", parts=[
                        types.Part(function_response=types.FunctionResponse(id=c.id, name=c.name, response={"output": out}))
                        for c, out in zip(r.function_calls or [], results)]))
                replies.append(await client.aio.models.generate_content(model="m", contents=contents, config=cfg))
                return session, replies
            finally:
                await client.aio.aclose()

    session, replies = arun(main())
    for i, r in enumerate(replies[:-1]):
        assert [(c.name, c.args) for c in r.function_calls] == case.calls[i]
    assert replies[-1].text == "Done."
    assert_same_ids(seen[-1], case.want, tok)
    assert session.trajectory()["metrics"]["segments"] == 1
