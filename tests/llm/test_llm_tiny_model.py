from __future__ import annotations

import pytest

from rolloutd.backends.tiny_model import main as tiny_main
from rolloutd.llm.tokenizer_utils import load_tokenizer


def test_tokenizer_only_cli_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert tiny_main([str(a), "--tokenizer-only"]) == 0
    assert tiny_main([str(b), "--tokenizer-only"]) == 0
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = load_tokenizer(a)
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert tok.convert_tokens_to_ids(t) is not None
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "def f(x):\n    return x  # héllo 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "tool", "content": "out"}],
        tools=[{"type": "function", "function": {"name": "bash"}}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<tools>" in rendered and "<tool_response>\nout\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_tiny_model_loads_with_auto_classes(tiny_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), len(tok))
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
