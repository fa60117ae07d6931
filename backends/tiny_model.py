"""A tiny Qwen2-architecture model + ChatML tokenizer, built offline in seconds.

``rolloutd make-tiny-model DIR`` / :func:`make_tiny_model` writes a directory that
``AutoTokenizer.from_pretrained(DIR)`` and ``AutoModelForCausalLM.from_pretrained(DIR)``
load: a ``Qwen2ForCausalLM`` with random weights (hidden 64, 2 layers, GQA 4/2 heads)
and a byte-level BPE trained locally (``tokenizers``) on a small built-in corpus, with
Qwen2's pre-tokenization regex, the ChatML special tokens (``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``), ``<tool_call>``/``</tool_call>`` as added tokens, and
the Qwen2.5 ChatML chat template (tools and the tool role supported).

Two variants, one tokenizer (the same ids, template and special tokens): ``default`` (hidden 64,
4 query / 2 KV heads: head_dim 16, ~130k parameters; what serve-hf, the trainer examples and their
recorded figures use) and ``vllm`` (hidden 128, 2 query / 1 KV head: head_dim 64, the smallest
shape vLLM's CPU attention serves; it refuses head_dim 16). ``--variant vllm`` / ``variant="vllm"``.

The tokenizer alone (:func:`build_tiny_tokenizer`, ``--tokenizer-only``) needs no torch.
The model is useless as a language model; it exists so that serving, batching,
logprob and token-bookkeeping code can be tested end to end without downloading weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
import structlog

from ..llm.tokenizer_utils import QWEN2_PATTERN, chatml_template

log = structlog.get_logger("rolloutd.llm")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>"]

_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A rollout is a sequence of turns between a policy and an environment.
Reinforcement learning from verifiable rewards needs exact token ids and their log probabilities.
You are a helpful assistant. Please answer the question and show your reasoning step by step.
The answer is 42. The result of the command was printed to standard output.
Let me list the files in the current directory first, then read the README.
I will run the tests to check that the fix works. All tests passed. Two tests failed.
def add(a, b):
    return a + b

class Solution:
    def solve(self, nums: list[int]) -> int:
        total = 0
        for x in nums:
            total += x
        return total

import os
import sys
print("hello world")
if __name__ == "__main__":
    main()
$ ls -la /tmp
total 12
drwxrwxrwt  3 root root 4096 Jan  1 00:00 .
$ cat README.md
# Project
$ python -m pytest -q
3 passed in 0.12s
$ grep -rn "TODO" src/
src/main.py:12: # TODO: handle errors
{"name": "bash", "arguments": {"command": "ls -la"}}
{"name": "python", "arguments": {"code": "print(1 + 1)"}}
{"name": "read_file", "arguments": {"path": "/etc/hostname"}}
{"name": "search", "arguments": {"query": "capital of France"}}
{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
<tool_response>
hello
</tool_response>
# Tools

You may call one or more functions to assist with the user query.
You are provided with function signatures within <tools></tools> XML tags:
For each function call, return a json object with function name and arguments within XML tags:
system user assistant tool
What is 12 times 7? 12 times 7 is 84. What is the capital of France? Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14159 -1 2024
Punctuation: ( ) [ ] { } < > = + - * / % ! ? . , ; : ' " ` ~ @ # $ ^ & | \ _
Bonjour le monde. Hallo Welt. Hola mundo. Привет мир. 你好，世界。こんにちは世界。 안녕하세요 세계
Emoji: 🙂 🚀 ✅ ❌
"""


def _corpus_lines() -> list[str]:
    lines = [ln for ln in _CORPUS.splitlines()]
    # repeat so that the BPE trainer sees frequent pairs; cheap and deterministic
    return lines * 8


def build_tiny_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on the built-in corpus."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=chatml_template(),
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


# The architecture of each variant (every other setting is shared). vLLM's CPU attention accepts
# only some head sizes (64 and up here); the default keeps its shape because the trainer examples'
# recorded figures (examples/train_tiny_grpo.py, docs/TRAINERS.md) are of that model.
VARIANTS: dict[str, dict[str, int]] = {
    "default": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
    "vllm": {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256},
}


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    variant: str = "default",
    vocab_size: int = 1024,
    hidden_size: int | None = None,
    num_layers: int = 2,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.2,
    tokenizer_only: bool = False,
) -> Path:
    """Write tokenizer (+ model unless ``tokenizer_only``) to ``out_dir``; returns the path.
    ``variant`` picks the shape (:data:`VARIANTS`); an explicit size overrides it."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; known: {', '.join(VARIANTS)}")
    shape = VARIANTS[variant]
    hidden_size = shape["hidden_size"] if hidden_size is None else hidden_size
    num_heads = shape["num_heads"] if num_heads is None else num_heads
    num_kv_heads = shape["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    intermediate_size = shape["intermediate_size"] if intermediate_size is None else intermediate_size
    if not tokenizer_only:
        import importlib

        importlib.import_module("torch")  # fail before writing anything if torch is missing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.save_pretrained(str(out))
    if tokenizer_only:
        log.info("tiny_tokenizer_written", path=str(out), vocab=len(tokenizer))
        return out

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    model.save_pretrained(str(out))
    (out / "rolloutd_tiny.json").write_text(json.dumps({"seed": seed, "kind": "rolloutd tiny qwen2", "variant": variant}) + "\n")
    log.info("tiny_model_written", path=str(out), vocab=len(tokenizer), params=sum(p.numel() for p in model.parameters()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rolloutd make-tiny-model",
        description="Build a tiny random Qwen2-architecture model + ChatML BPE tokenizer, offline.",
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="default",
                   help="model shape: default (head_dim 16) or vllm (head_dim 64, what vLLM's CPU build serves)")
    p.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer (no torch needed)")
    args = p.parse_args(argv)
    out = make_tiny_model(args.dir, seed=args.seed, variant=args.variant, vocab_size=args.vocab_size,
                          tokenizer_only=args.tokenizer_only)
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

