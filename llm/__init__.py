"""rolloutd's LLM side, token-in/token-out.

* :mod:`llm.client`: ``LLMClient`` for vLLM (``/v1/completions``) and SGLang (``/generate``),
  ``SamplingParams``, ``Generation``, the error types;
* :mod:`llm.conversation`: ``Conversation``, the exact token trajectory of a rollout;
* :mod:`llm.toolparse`: tool-call parsers (``hermes``, ``fenced_bash``);
* :mod:`llm.agent_loop`: ``run_agent_loop``, the multi-turn loop;
* :mod:`llm.scripted`: scripted vLLM/SGLang stand-in backend, :mod:`llm.policies` its policies;
* :mod:`llm.serve_hf`: a small vLLM-compatible server around a transformers model (needs torch);
* :mod:`llm.tiny_model`: a tiny random Qwen2 model + ChatML tokenizer built offline.

Importing ``llm`` (or any module above except when *using* ``serve_hf``/``tiny_model``'s model
builder) does not import torch. See docs/LLM.md.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLMClient": "llm.client",
    "SamplingParams": "llm.client",
    "Generation": "llm.client",
    "BackendError": "llm.errors",
    "LLMTimeout": "llm.errors",
    "ContextOverflow": "llm.errors",
    "RequestError": "llm.errors",
    "LLMError": "llm.errors",
    "Conversation": "llm.conversation",
    "get_parser": "llm.toolparse",
    "ToolCall": "llm.toolparse",
    "ParseResult": "llm.toolparse",
    "run_agent_loop": "llm.agent_loop",
    "LoopResult": "llm.agent_loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'llm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
