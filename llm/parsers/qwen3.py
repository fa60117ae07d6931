"""Qwen3: ``<think>...</think>`` reasoning, then Hermes ``<tool_call>{json}</tool_call>`` calls.

The reasoning stays in the trajectory exactly as sampled (the parser only reads the
text); it is exposed as ``ParseResult.reasoning``. Calls inside an unclosed reasoning
block are not executed: the model was still thinking (vLLM's qwen3 reasoning parser
does the same).
"""

from __future__ import annotations

from ..toolparse import HermesParser, ParseResult, split_reasoning, strip_suffixes

END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class Qwen3Parser(HermesParser):
    name = "qwen3"
    skip_special_tokens = False  # <|im_end|> may be kept; <think> is never special

    def parse(self, text: str) -> ParseResult:
        text = strip_suffixes(text, END_TOKENS)
        reasoning, rest, closed = split_reasoning(text, "<think>", "</think>")
        res = super().parse(rest) if closed else ParseResult()
        res.reasoning = reasoning
        return res
