"""The agent loop against the scripted backend: tool calls, malformed calls, limits, aborts."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.llm.agent_loop import run_agent_loop
from rolloutd.llm.client import BackendError, LLMClient, SamplingParams, simple_generate
from rolloutd.llm.conversation import Conversation
from rolloutd.backends.policies import Policy, PolicyReply
from rolloutd.llm.toolparse import get_parser


class Script(Policy):
    """Reply number k (k = tool responses seen so far) comes from a fixed list."""

    def __init__(self, replies):
        super().__init__()
        self.replies = replies

    def reply(self, request):
        k = request.prompt_text.count("<tool_response>")
        return self.replies[min(k, len(self.replies) - 1)]


def _loop(tok, url, api="vllm", *, max_context=4096, max_turns=8, max_tokens=256, tools=None, parser="hermes",
          messages=None, **kw):
    async def execute(call):
        return f"result of {call.name}"

    async def main():
        async with LLMClient(url, api, timeout=10) as c:
            conv = Conversation(tok, messages or [{"role": "user", "content": "go"}], tools, max_context)
            res = await run_agent_loop(
                simple_generate(c, "b0", 1), conv, get_parser(parser), execute, SamplingParams(max_tokens), max_turns, tok, **kw
            )
            return res, conv

    return main()


def test_malformed_and_missing_name_are_counted_and_sent_back(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    replies = [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',  # malformed JSON
        '<tool_call>{"arguments": {"command": "ls"}}</tool_call>'  # missing name
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',  # + a good one
        "Done.",
    ]
    be = scripted(tok, Script(replies))
    res, conv = arun(_loop(tok, be.url, keep_messages=True))
    assert res.stop_reason == "no_tool_call" and res.final_text == "Done."
    assert res.metrics["turns"] == 3
    assert res.metrics["tool_calls"] == 1
    assert res.metrics["malformed_tool_calls"] == 2
    errors = [m["content"] for m in res.messages if m["content"].startswith("Error:")]
    assert len(errors) == 2 and "invalid JSON" in errors[0] and '"name"' in errors[1]
    # the error observations are in the trajectory, masked out
    text = tok.decode(res.arrays["response_ids"][res.arrays["loss_mask"] == 0].tolist())
    assert "invalid JSON" in text and "result of bash" in text
    assert res.metrics["llm_s"] > 0 and res.metrics["tools_s"] >= 0


def test_fenced_bash_loop(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(["Let me check.\n```bash\nls -la\n```", "```bash\nls -la", "All good."]))
    res, _ = arun(_loop(tok, be.url, "sglang", parser="fenced_bash"))
    assert res.stop_reason == "no_tool_call"
    assert res.metrics["tool_calls"] == 1 and res.metrics["malformed_tool_calls"] == 1


def test_max_turns(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer:tool_turns=100")
    res, conv = arun(_loop(tok, be.url, max_turns=3))
    assert res.stop_reason == "max_turns"
    assert res.metrics["turns"] == 3 and res.metrics["tool_calls"] == 2  # the last call is not executed
    assert conv.turns[-1]["obs_start"] is None
    assert res.arrays["loss_mask"][-1] == 1  # trajectory ends with the sampled turn


def test_context_overflow_clips_generation(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    long = "word " * 400
    be = scripted(tok, Script(['<tool_call>{"name": "bash", "arguments": {}}</tool_call>', long]))
    res, conv = arun(_loop(tok, be.url, max_context=200, max_tokens=1000))
    assert res.stop_reason == "context_overflow"
    assert conv.num_tokens == 200 and conv.remaining_context == 0
    assert res.turns[-1]["finish_reason"] == "context_overflow"
    assert res.turns[0]["finish_reason"] == "stop"


def test_context_overflow_on_observation(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer")

    async def huge(call):
        return "x" * 5000

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 300)
            return await run_agent_loop(simple_generate(c), conv, get_parser("hermes"), huge, SamplingParams(64), 5, tok)

    res = arun(main())
    assert res.stop_reason == "context_overflow"
    assert res.metrics["tool_calls"] == 1 and len(res.turns) == 1
    assert res.arrays["loss_mask"][-1] == 1  # the observation was not appended


def test_context_overflow_rejected_by_server(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer:tool_turns=5", max_model_len=100)
    res, _ = arun(_loop(tok, be.url, "sglang", max_context=4096, max_tokens=64))
    assert res.stop_reason == "context_overflow"  # a ContextOverflow, never a BackendError
    assert be.stats["rejected_context"] == 1


def test_no_room_at_all(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "echo")
    res, conv = arun(_loop(tok, be.url, max_context=5))
    assert res.stop_reason == "context_overflow" and res.turns == [] and be.stats["requests"] == 0


class Aborts(Policy):
    """Every reply is ``ids`` with finish ``abort`` (what vLLM/SGLang return for an aborted request)."""

    def __init__(self, ids):
        super().__init__()
        self.ids = ids
        self.prompts: list[list[int]] = []

    def reply(self, request):
        self.prompts.append(list(request.prompt_ids))
        return PolicyReply(token_ids=self.ids, finish="abort", append_eos=False)


class Continues(Policy):
    """The rest of the interrupted message, then (after the tool response) a final answer."""

    def __init__(self, rest_text):
        super().__init__()
        self.rest_text = rest_text
        self.prompts: list[list[int]] = []

    def reply(self, request):
        self.prompts.append(list(request.prompt_ids))
        return "done" if "<tool_response>" in request.prompt_text else self.rest_text


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_abort_keeps_tokens_and_continues_the_message(api, qwen_tokenizer, scripted, arun):
    # an abort on one backend (say, a weight swap) and the message continued on another, as when the
    # run daemon takes a new lease: two real scripted servers, the generate callable switches after the abort
    tok = qwen_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    part1 = tok.encode('<tool_call>\n{"name": "bash", ', add_special_tokens=False)
    rest = '"arguments": {"command": "ls"}}\n</tool_call>'
    part2 = tok.encode(rest, add_special_tokens=False) + [eot]
    old_policy, new_policy = Aborts(part1), Continues(rest)
    old, new = scripted(tok, old_policy), scripted(tok, new_policy)
    seen = []

    async def execute(call):
        assert call.arguments == {"command": "ls"}
        return "a b c"

    async def main():
        async with LLMClient(old.url, api, timeout=10) as c_old, LLMClient(new.url, api, timeout=10) as c_new:
            gen_old, gen_new = simple_generate(c_old, "old", 1), simple_generate(c_new, "new", 2)

            async def gen(ids, params):
                seen.append((len(ids), params.max_tokens))
                return await (gen_old if len(seen) == 1 else gen_new)(ids, params)

            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 4096)
            return await run_agent_loop(gen, conv, get_parser("hermes"), execute, SamplingParams(100), 5, tok)

    res = arun(main())
    assert res.stop_reason == "no_tool_call" and res.final_text == "done"
    assert res.metrics["aborts"] == 1 and res.metrics["tool_calls"] == 1 and res.metrics["turns"] == 2
    t = res.turns
    assert [x["backend"] for x in t] == ["old", "new", "new"] and [x["policy_version"] for x in t] == [1, 2, 2]
    assert t[0]["finish_reason"] == "abort" and t[1]["continuation"] and t[0]["end"] == t[1]["start"]
    assert res.arrays["response_ids"][t[0]["start"] : t[1]["end"]].tolist() == part1 + part2
    assert res.arrays["loss_mask"][t[0]["start"] : t[1]["end"]].tolist() == [1] * (len(part1) + len(part2))
    # the second server continued from the exact sampled ids, with the per-message budget left
    assert new_policy.prompts[0] == old_policy.prompts[0] + part1
    assert seen[1] == (seen[0][0] + len(part1), 100 - len(part1))
    assert old.stats["requests"] == 1 and new.stats["requests"] == 2


def test_repeated_aborts_raise_backend_error(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Aborts([15]))

    async def main():
        async with LLMClient(be.url, "sglang", timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 4096)
            await run_agent_loop(simple_generate(c, "b"), conv, get_parser("hermes"), None, SamplingParams(100), 5, tok,
                                 max_aborts=2)

    with pytest.raises(BackendError, match="aborted 3 times"):
        arun(main())
    assert be.stats["requests"] == 3  # max_aborts=2: the third abort in a row gives up


def test_tool_timeout_becomes_an_observation(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer")

    async def slow(call):
        await asyncio.sleep(10)
        return "never"

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 4096)
            return await run_agent_loop(
                simple_generate(c), conv, get_parser("hermes"), slow, SamplingParams(64), 5, tok,
                tool_timeout=0.05, keep_messages=True,
            )

    res = arun(main())
    assert res.stop_reason == "no_tool_call" and "timed out" in res.messages[0]["content"]


def test_many_concurrent_rollouts_one_loop(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "tool_then_answer:tool_turns=3", latency="uniform:0,0.01")

    async def execute(call):
        await asyncio.sleep(0)
        return "ok"

    async def main():
        async with LLMClient(be.url, "vllm", timeout=30) as c:
            gen = simple_generate(c)

            async def one(i):
                conv = Conversation(tok, [{"role": "user", "content": f"task {i}"}], None, 4096)
                return await run_agent_loop(gen, conv, get_parser("hermes"), execute, SamplingParams(64), 10, tok)

            return await asyncio.gather(*[one(i) for i in range(200)])

    results = arun(main(), timeout=120)
    assert all(r.stop_reason == "no_tool_call" and r.metrics["turns"] == 4 for r in results)
    assert be.stats["requests"] == 800


# -- the parser reads the sampled ids, never the backend's text (issue 28.1) ----------------------
@pytest.fixture(scope="module")
def special_marker_tokenizer(qwen_tokenizer, tmp_path_factory):
    """The Qwen2.5 tokenizer with <tool_call> and </tool_call> made special tokens: a backend that
    detokenizes with skip_special_tokens (vLLM's and SGLang's default) drops them from its text."""
    import json

    from rolloutd.llm.tokenizer_utils import load_tokenizer

    d = tmp_path_factory.mktemp("special_markers")
    qwen_tokenizer.save_pretrained(str(d))
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        data = json.loads((d / name).read_text())
        items = data.get(key) or []
        items = items if isinstance(items, list) else items.values()
        for t in items:
            if t["content"] in ("<tool_call>", "</tool_call>"):
                t["special"] = True
        (d / name).write_text(json.dumps(data))
    tok = load_tokenizer(d)
    assert "<tool_call>" not in tok.decode(tok.encode("<tool_call>x</tool_call>"), skip_special_tokens=True)
    return tok


def _text_mode(tok, generate, mode):
    """The backend's ``text``: with special tokens kept, skipped, or a lie (never to be used)."""
    import numpy as np

    async def gen(ids, params):
        g, b, v = await generate(ids, params)
        toks = np.asarray(g.token_ids).tolist()
        g.text = {"keep": lambda: tok.decode(toks, skip_special_tokens=False),
                  "skip": lambda: tok.decode(toks, skip_special_tokens=True),
                  "lie": lambda: '<tool_call>{"name": "rm", "arguments": {}}</tool_call><|im_end|>'}[mode]()
        return g, b, v

    return gen


@pytest.mark.parametrize("mode", ["keep", "skip", "lie"])
@pytest.mark.parametrize("parser", ["hermes", "qwen3"])
def test_parser_reads_the_sampled_ids_not_the_backend_text(mode, parser, special_marker_tokenizer, scripted, arun):
    tok = special_marker_tokenizer
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo \'<|im_end|>\'"}}\n</tool_call>'
    be = scripted(tok, Script([call, "Done."]))
    seen = []

    async def execute(c):
        seen.append((c.name, c.arguments))
        return "ok"

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "go"}], None, 4096)
            gen = _text_mode(tok, simple_generate(c, "b0", 1), mode)
            return await run_agent_loop(gen, conv, get_parser(parser), execute, SamplingParams(128), 4, tok)

    res = arun(main())
    # the call's markers are special ids (a skip-special backend text has none); the argument's
    # "<|im_end|>" is text the model wrote (the scripted backend encodes the reply as text)
    assert seen == [("bash", {"command": "echo '<|im_end|>'"})], seen
    assert res.stop_reason == "no_tool_call" and res.final_text == "Done."  # no <|im_end|> in it
    assert res.metrics["tool_calls"] == 1 and res.metrics["malformed_tool_calls"] == 0


def test_loop_passes_the_tools_to_a_parser_that_types_arguments(qwen_tokenizer, scripted, arun):
    """Qwen3-Coder's XML parameters are text; with the conversation's tool schemas the loop's parser
    types them (the code handler's editor refused insert_line "0" as not an integer)."""
    tok = qwen_tokenizer
    editor = {"type": "function", "function": {"name": "editor", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "insert_line": {"type": "integer"}, "dry": {"type": "boolean"}}}}}
    call = ("<tool_call>\n<function=editor>\n<parameter=command>\ninsert\n</parameter>\n<parameter=insert_line>\n0\n"
            "</parameter>\n<parameter=dry>\ntrue\n</parameter>\n</function>\n</tool_call>")
    be = scripted(tok, Script([call, "Done."]))
    seen = []

    async def execute(c):
        seen.append(c.arguments)
        return "ok"

    async def main():
        async with LLMClient(be.url, "vllm", timeout=10) as c:
            conv = Conversation(tok, [{"role": "user", "content": "go"}], [editor], 4096)
            return await run_agent_loop(simple_generate(c, "b0", 1), conv, get_parser("qwen3_coder"), execute,
                                        SamplingParams(128), 4, tok)

    res = arun(main())
    assert seen == [{"command": "insert", "insert_line": 0, "dry": True}] and res.final_text == "Done."
