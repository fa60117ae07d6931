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


def test_hermes_unterminated():
    res = get_parser("hermes").parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}')
    assert res.calls == [] and len(res.errors) == 1 and "unterminated" in res.errors[0]
    # an unterminated call followed by a good one
    res = get_parser("hermes").parse('<tool_call>{"name": "x"\n<tool_call>{"name": "y", "arguments": {}}</tool_call>')
    assert [c.name for c in res.calls] == ["y"] and len(res.errors) == 1


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
