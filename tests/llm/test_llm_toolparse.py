from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutd.llm.toolparse import FencedBashParser, HermesParser, ToolCall, available_parsers, get_parser


def test_hermes_well_formed():
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    res = get_parser("hermes").parse(text)
    assert res.errors == []
    assert len(res.calls) == 1
    c = res.calls[0]
    assert isinstance(c, ToolCall)
    assert c.name == "bash" and c.arguments == {"command": "ls -la"}
    assert c.raw.startswith("<tool_call>") and c.raw.endswith("</tool_call>")


def test_hermes_multiple_calls_keep_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    res = get_parser("hermes").parse(text)
    assert [c.name for c in res.calls] == ["a", "b", "c"]
    assert res.calls[1].arguments == {"y": 2}  # arguments given as a JSON string
    assert res.calls[2].arguments == {}
    assert [k for k, _ in res.items] == ["call", "call", "call"]


def test_hermes_no_call():
    res = get_parser("hermes").parse("The answer is 42.")
    assert not res.has_actions and res.calls == [] and res.errors == []


def test_hermes_malformed_json_is_an_error_observation():
    text = '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>'
    res = get_parser("hermes").parse(text)
    assert res.calls == []
    assert len(res.errors) == 1
    assert "invalid JSON" in res.errors[0] and "Expected format" in res.errors[0]


@pytest.mark.parametrize(
    "body,needle",
    [
        ('{"arguments": {"command": "ls"}}', 'missing or empty "name"'),
        ('{"name": "", "arguments": {}}', 'missing or empty "name"'),
        ('{"name": 3, "arguments": {}}', 'missing or empty "name"'),
        ('["bash"]', "expected a JSON object"),
        ('{"name": "bash", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
        ('{"name": "bash", "arguments": "{not json"}', "not valid JSON"),
    ],
)
def test_hermes_semantic_errors(body, needle):
    res = get_parser("hermes").parse(f"<tool_call>{body}</tool_call>")
    assert res.calls == [] and len(res.errors) == 1
    assert needle in res.errors[0]


def test_hermes_mixed_good_and_bad_in_text_order():
    text = (
        '<tool_call>{"name": "ok1", "arguments": {}}</tool_call>'
        "<tool_call>{broken}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "ok2", "arguments": {}}</tool_call>'
    )
    res = get_parser("hermes").parse(text)
    assert [c.name for c in res.calls] == ["ok1", "ok2"]
    assert len(res.errors) == 2
    assert [k for k, _ in res.items] == ["call", "error", "error", "call"]


def test_hermes_reads_calls_as_vllm_does():
    """A call runs from <tool_call> to the next </tool_call> (vLLM's hermes parser): an open tag
    inside a JSON string is part of the argument; a call without its close tag counts when its
    JSON is whole, else it is unterminated."""
    p = get_parser("hermes")
    res = p.parse('<tool_call>{"name": "bash", "arguments": {"command": "echo <tool_call>"}}</tool_call>')
    assert res.errors == [] and res.calls[0].arguments == {"command": "echo <tool_call>"}
    res = p.parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}')
    assert res.errors == [] and res.calls[0].arguments == {"command": "ls"}
    res = p.parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}')
    assert res.calls == [] and len(res.errors) == 1 and "unterminated" in res.errors[0]
    # an unterminated call before a good one: one region up to the first close tag, not JSON
    res = p.parse('<tool_call>{"name": "x"\n<tool_call>{"name": "y", "arguments": {}}</tool_call>')
    assert res.calls == [] and len(res.errors) == 1 and "invalid JSON" in res.errors[0]


def test_hermes_fenced_json_inside_tags():
    res = HermesParser().parse('<tool_call>\n```json\n{"name": "f", "arguments": {"a": 1}}\n```\n</tool_call>')
    assert res.errors == [] and res.calls[0].arguments == {"a": 1}


def test_fenced_bash():
    p = get_parser("fenced_bash")
    res = p.parse("I'll list files.\n```bash\nls -la /tmp\n```\n")
    assert res.errors == [] and len(res.calls) == 1
    assert res.calls[0].name == "bash" and res.calls[0].arguments == {"command": "ls -la /tmp"}
    assert not p.parse("No action, just text with `inline` code.").has_actions
    # python fences are not actions
    assert not p.parse("```python\nprint(1)\n```").has_actions


def test_fenced_bash_multiple_and_malformed():
    p = FencedBashParser(max_calls=1)
    res = p.parse("```bash\necho 1\n```\nthen\n```sh\necho 2\n```")
    assert [c.arguments["command"] for c in res.calls] == ["echo 1"]
    assert len(res.errors) == 1 and "only 1" in res.errors[0]
    res = FencedBashParser(max_calls=5).parse("```bash\necho 1\n```\n```bash\necho 2\n```")
    assert [c.arguments["command"] for c in res.calls] == ["echo 1", "echo 2"]
    res = p.parse("```bash\nls -la")
    assert res.calls == [] and "unterminated" in res.errors[0]
    res = p.parse("```bash\n\n```")
    assert res.calls == [] and "empty" in res.errors[0]


def test_registry():
    assert {"hermes", "fenced_bash"} <= set(available_parsers())
    with pytest.raises(KeyError):
        get_parser("no-such-parser")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"x"', "```bash\n", "```", "\n", "ls", ",", "[", "]"]
        )
        | st.text(max_size=8),
        max_size=30,
    )
)
def test_parsers_never_raise(pieces):
    text = "".join(pieces)
    for name in ("hermes", "fenced_bash"):
        res = get_parser(name).parse(text)
        assert len(res.items) == len(res.calls) + len(res.errors)


# -- model-family parsers -------------------------------------------------------------------
import json as _json

from rolloutd.llm.toolparse import ParseResult


def _names(res: ParseResult) -> list[str]:
    return [c.name for c in res.calls]


def test_family_parsers_are_registered():
    names = available_parsers()
    for n in ("qwen3", "qwen3_coder", "llama3_json", "mistral", "harmony", "gpt_oss", "deepseek_v31", "deepseek_v3"):
        assert n in names
        assert get_parser(n).skip_special_tokens is False


def test_qwen3_reasoning_then_two_calls():
    text = (
        "<think>\nI should list, then read.\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a"}}\n</tool_call><|im_end|>'
    )
    res = get_parser("qwen3").parse(text)
    assert res.reasoning == "I should list, then read."
    assert res.content == "Let me look."
    assert [c.arguments["command"] for c in res.calls] == ["ls", "cat a"]
    msg = res.to_openai_message()
    assert msg["reasoning_content"] == "I should list, then read." and msg["content"] == "Let me look."
    assert [tc["function"]["name"] for tc in msg["tool_calls"]] == ["bash", "bash"]
    assert _json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"command": "cat a"}
    assert msg["tool_calls"][0]["id"] != msg["tool_calls"][1]["id"]


def test_qwen3_open_tag_in_prompt_and_no_reasoning():
    # thinking models whose generation prompt already holds "<think>\n"
    res = get_parser("qwen3").parse("plan\n</think>\n\nThe answer is 4.")
    assert res.reasoning == "plan" and res.content == "The answer is 4." and not res.has_actions
    res = get_parser("qwen3").parse("The answer is 4.")
    assert res.reasoning is None and res.content == "The answer is 4."


def test_qwen3_call_inside_unclosed_reasoning_is_not_run():
    res = get_parser("qwen3").parse('<think>\nmaybe <tool_call>{"name": "bash", "arguments": {}}</tool_call>')
    assert not res.has_actions and res.reasoning.startswith("maybe")


def test_qwen3_malformed_call_is_an_error():
    res = get_parser("qwen3").parse('<think>x</think><tool_call>{"name": "bash", "arguments": {"command": </tool_call>')
    assert res.calls == [] and len(res.errors) == 1 and "invalid JSON" in res.errors[0]


CODER_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "dry": {"type": "boolean"},
    "opts": {"type": "object"}, "text": {"type": "string"}}}}}]


def test_qwen3_coder_two_calls_with_typed_parameters():
    text = (
        "I will edit.\n<tool_call>\n<function=edit>\n<parameter=path>\n/a.py\n</parameter>\n"
        "<parameter=line>\n12\n</parameter>\n<parameter=dry>\ntrue\n</parameter>\n"
        '<parameter=opts>\n{"x": [1]}\n</parameter>\n<parameter=text>\n  two\nlines \n</parameter>\n'
        "</function>\n</tool_call>\n<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>"
    )
    res = get_parser("qwen3_coder", tools=CODER_TOOLS).parse(text)
    assert res.errors == [] and _names(res) == ["edit", "bash"]
    assert res.calls[0].arguments == {"path": "/a.py", "line": 12, "dry": True, "opts": {"x": [1]}, "text": "  two\nlines "}
    assert res.calls[1].arguments == {"command": "ls"}
    assert res.content == "I will edit."
    # without schemas every value is text
    assert get_parser("qwen3_coder").parse(text).calls[0].arguments["line"] == "12"


@pytest.mark.parametrize(
    "body,needle",
    [
        ("<parameter=a>\n1\n</parameter>\n</function>", "no <function=NAME>"),
        ("<function=>\n</function>", "empty function name"),
        ("<function=edit>\n<parameter=path>\n/a\n</parameter>\n", "not closed with </function>"),
        ("<function=edit>\n<parameter=path>\n/a\n</function>", "is not closed with </parameter>"),
        ("<function=edit>\n<parameter=line>\ntwelve\n</parameter>\n</function>", "must be of type integer"),
        ("<function=edit>\ngarbage\n</function>", "not a <parameter"),
    ],
)
def test_qwen3_coder_malformed(body, needle):
    res = get_parser("qwen3_coder", tools=CODER_TOOLS).parse(f"<tool_call>\n{body}\n</tool_call>")
    assert res.calls == [] and len(res.errors) == 1 and needle in res.errors[0], res.errors
    res = get_parser("qwen3_coder").parse(f"<tool_call>\n<function=edit>\n")
    assert res.calls == [] and "unterminated" in res.errors[0]


def test_llama3_json_calls_and_content():
    p = get_parser("llama3_json")
    res = p.parse('{"name": "bash", "parameters": {"command": "ls"}}; {"name": "bash", "parameters": {"command": "pwd"}}<|eot_id|>')
    assert [c.arguments for c in res.calls] == [{"command": "ls"}, {"command": "pwd"}] and res.errors == []
    res = p.parse('<|python_tag|>{"name": "f", "arguments": {"x": 1}}<|eom_id|>')
    assert _names(res) == ["f"] and res.calls[0].arguments == {"x": 1}
    res = p.parse("The answer is {not a call}.")
    assert not res.has_actions and res.content == "The answer is {not a call}."


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"name": "bash", "parameters": {"command": "ls"}', "invalid JSON"),
        ('{"parameters": {}}', 'missing or empty "name"'),
        ('{"name": "f", "parameters": [1]}', "must be a JSON object"),
        ('{"name": "f", "parameters": {}} and more', "separated by ';'"),
        ("<|python_tag|>print(1)", "not followed by a JSON object"),
    ],
)
def test_llama3_json_malformed(text, needle):
    res = get_parser("llama3_json").parse(text)
    assert len(res.errors) == 1 and needle in res.errors[0], res.errors


def test_mistral_v3_list_and_v11_forms():
    p = get_parser("mistral")
    res = p.parse('Sure.[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}, "id": "abc123DEF"}, '
                  '{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}]</s>')
    assert res.content == "Sure." and [c.arguments["command"] for c in res.calls] == ["ls", "pwd"]
    assert res.calls[0].id == "abc123DEF"
    gen = res.calls[1].id
    assert len(gen) == 9 and gen.isalnum() and gen == p.parse(
        'Sure.[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}, "id": "abc123DEF"}, '
        '{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}]</s>').calls[1].id  # deterministic
    res = p.parse('[TOOL_CALLS]bash[ARGS]{"command": "ls"}[TOOL_CALLS]bash[CALL_ID]xyz789GHI[ARGS]{"command": "pwd"}</s>')
    assert [c.arguments["command"] for c in res.calls] == ["ls", "pwd"] and res.calls[1].id == "xyz789GHI"


@pytest.mark.parametrize(
    "text,needle",
    [
        ('[TOOL_CALLS][{"name": "bash", "arguments": {', "invalid JSON"),
        ('[TOOL_CALLS][{"arguments": {}}]', 'missing or empty "name"'),
        ('[TOOL_CALLS][["bash"]]', "must be a JSON object"),
        ("[TOOL_CALLS]just words", "expected [{...}] or NAME[ARGS]"),
        ('[TOOL_CALLS]bash[ARGS]{"command": ', "invalid JSON arguments"),
    ],
)
def test_mistral_malformed(text, needle):
    res = get_parser("mistral").parse(text)
    assert res.calls == [] and len(res.errors) == 1 and needle in res.errors[0], res.errors


def test_harmony_analysis_calls_and_final():
    p = get_parser("harmony")
    text = (
        "<|channel|>analysis<|message|>Need to list.<|end|>"
        '<|start|>assistant to=functions.bash<|channel|>commentary <|constrain|>json<|message|>{"command": "ls"}<|call|>'
    )
    res = p.parse(text)
    assert res.reasoning == "Need to list." and _names(res) == ["bash"] and res.calls[0].arguments == {"command": "ls"}
    # recipient after the channel, two calls, a preamble
    text = (
        "<|channel|>commentary<|message|>Checking two things.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.bash json<|message|>{"command": "ls"}<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "pwd"}'
    )
    res = p.parse(text)
    assert [c.arguments["command"] for c in res.calls] == ["ls", "pwd"] and res.content == "Checking two things."
    res = p.parse("<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>")
    assert res.reasoning == "easy" and res.content == "4" and not res.has_actions


@pytest.mark.parametrize(
    "text,needle",
    [
        ("<|channel|>commentary to=functions.bash", "without <|message|>"),
        ("<|channel|>commentary to=functions.bash<|message|>{bad<|call|>", "invalid JSON arguments"),
        ("<|channel|>commentary to=functions.bash<|message|>[1]<|call|>", "must be a JSON object"),
        ("<|channel|>commentary to=functions.<|message|>{}<|call|>", "empty tool name"),
    ],
)
def test_harmony_malformed(text, needle):
    res = get_parser("harmony").parse(text)
    assert res.calls == [] and len(res.errors) == 1 and needle in res.errors[0], res.errors


DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def test_deepseek_v31_and_v3_forms():
    p = get_parser("deepseek_v31")
    text = (f'Thinking hard.</think>Let me check.{DS_B}{DS_CB}bash{DS_SEP}{{"command": "ls"}}{DS_CE}'
            f'{DS_CB}bash{DS_SEP}{{"command": "pwd"}}{DS_CE}{DS_E}<｜end▁of▁sentence｜>')
    res = p.parse(text)
    assert res.reasoning == "Thinking hard." and res.content == "Let me check."
    assert [c.arguments["command"] for c in res.calls] == ["ls", "pwd"]
    v3 = f'{DS_B}{DS_CB}function{DS_SEP}bash\n```json\n{{"command": "ls"}}\n```{DS_CE}{DS_E}'
    res = get_parser("deepseek_v3").parse(v3)
    assert _names(res) == ["bash"] and res.calls[0].arguments == {"command": "ls"} and res.reasoning is None


@pytest.mark.parametrize(
    "body,needle",
    [
        (f"{DS_CB}bash{DS_SEP}{{bad{DS_CE}", "invalid JSON arguments"),
        (f"{DS_CB}bash{{}}{DS_CE}", "no <｜tool▁sep｜>"),
        (f"{DS_CB}{DS_SEP}{{}}{DS_CE}", "empty function name"),
        (f"{DS_CB}bash{DS_SEP}[1]{DS_CE}", "must be a JSON object"),
        (f"{DS_CB}bash{DS_SEP}{{}}", "unterminated"),
        (f"{DS_CB}function{DS_SEP}bash\n{{}}{DS_CE}", "without a ```json block"),
    ],
)
def test_deepseek_malformed(body, needle):
    res = get_parser("deepseek_v31").parse(f"{DS_B}{body}{DS_E}")
    assert res.calls == [] and len(res.errors) == 1 and needle in res.errors[0], res.errors


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("{}[]\":,; \nabc") + [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>", "</function>",
    "[TOOL_CALLS]", "[ARGS]", "<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>", " to=functions.",
    DS_B, DS_CB, DS_SEP, DS_CE, "<|python_tag|>"]), max_size=40))
def test_family_parsers_never_raise(pieces):
    text = "".join(pieces)
    for name in ("qwen3", "qwen3_coder", "llama3_json", "mistral", "harmony", "deepseek_v31"):
        res = get_parser(name).parse(text)
        assert len(res.items) == len(res.calls) + len(res.errors)
        res.to_openai_message()


def test_mistral_v11_errors_name_the_v11_format():
    p = get_parser("mistral")
    (err,) = p.parse("[TOOL_CALLS]bash[ARGS]{bad").errors
    assert "[TOOL_CALLS]<function-name>[ARGS]" in err and '[{"name"' not in err
    (err,) = p.parse('[TOOL_CALLS][{"name": "bash", "arguments": 3}]').errors
    assert '[TOOL_CALLS][{"name"' in err


def test_trie_pattern_matches_like_the_flat_alternation():
    import re

    from rolloutd.llm.tokenizer_utils import trie_pattern

    words = ["<|a|>", "<|ab|>", "<|a", "[X]", "[X][Y]", "x"]
    flat = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    text = "<|ab|> <|a|> <|a [X][Y] [X] x <| [Y"
    assert [m.group(0) for m in trie_pattern(words).finditer(text)] == [m.group(0) for m in flat.finditer(text)]


def test_call_ids_map_the_agents_ids_back_and_name_tool_messages():
    from rolloutd.llm.toolparse import CallIds, ToolCall

    ids = CallIds(samples=True)  # Mistral: the model writes the ids
    first = ids.assign([ToolCall("bash", {"command": "ls"}, id="abc123DEF")])
    again = ids.assign([ToolCall("bash", {"command": "pwd"}, id="abc123DEF")])  # the model reused its id
    assert [c["id"] for c in first] == ["abc123DEF"] and [c["id"] for c in again] == ["call_1_0"]
    history = [{"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1_0", "type": "function", "function": {"name": "bash", "arguments": {}}}]},
               {"role": "tool", "tool_call_id": "call_1_0", "content": "x"},
               {"role": "tool", "tool_call_id": "abc123DEF", "content": "y"},
               {"role": "tool", "tool_call_id": "unknown", "content": "z"}]
    out = ids.prepare(history)
    assert out[0]["tool_calls"][0]["id"] == "abc123DEF"  # what the model wrote, so its template renders it
    assert out[1] == {"role": "tool", "tool_call_id": "abc123DEF", "name": "bash", "content": "x"}
    assert out[2]["name"] == "bash" and out[3] == history[3]
    assert history[1] == {"role": "tool", "tool_call_id": "call_1_0", "content": "x"}  # the request is not mutated
    other = CallIds(samples=False)  # other families: the endpoint's ids; names still resolved
    (c,) = other.assign([ToolCall("weather", {}, id="call_0")])
    assert c["id"] == "call_0_0"
    assert other.prepare([{"role": "tool", "tool_call_id": "call_0_0", "content": "x"}])[0]["name"] == "weather"
