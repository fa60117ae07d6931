"""rolloutd's LLM side, token-in/token-out.

* :mod:`rolloutd.llm.client`: ``LLMClient`` for vLLM (``/v1/completions``) and SGLang (``/generate``),
  ``SamplingParams``, ``Generation``, the error types;
* :mod:`rolloutd.llm.conversation`: ``Conversation``, the exact token trajectory of a rollout;
* :mod:`rolloutd.llm.toolparse`: tool-call parsers (``hermes``, ``fenced_bash``), and
  :mod:`rolloutd.llm.parsers` the model families' own (qwen3, qwen3_coder, llama3_json, mistral,
  harmony, deepseek_v31); :mod:`rolloutd.llm.families` maps a family to its parser, chat template
  and reasoning handling;
* :mod:`rolloutd.llm.http_transport`: the HTTP/1.1 keep-alive transport ``LLMClient`` speaks through;
* :mod:`rolloutd.llm.openai_endpoint` (:mod:`rolloutd.llm.openai_wire`): the per-job
  OpenAI-compatible endpoint that records an unmodified agent's tokens (docs/HARNESS.md);
* :mod:`rolloutd.llm.agent_loop`: ``run_agent_loop``, the multi-turn loop;
* :mod:`rolloutd.llm.scripted`: scripted vLLM/SGLang stand-in backend, :mod:`rolloutd.llm.policies` its policies;
* :mod:`rolloutd.llm.serve_hf`: a small vLLM-compatible server around a transformers model (needs torch);
* :mod:`rolloutd.llm.tiny_model`: a tiny random Qwen2 model + ChatML tokenizer built offline.

Importing ``llm`` (or any module above except when *using* ``serve_hf``/``tiny_model``'s model
builder) does not import torch. See docs/LLM.md.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLMClient": "rolloutd.llm.client",
    "SamplingParams": "rolloutd.llm.client",
    "Generation": "rolloutd.llm.client",
    "BackendError": "rolloutd.llm.errors",
    "LLMTimeout": "rolloutd.llm.errors",
    "ContextOverflow": "rolloutd.llm.errors",
    "RequestError": "rolloutd.llm.errors",
    "LLMError": "rolloutd.llm.errors",
    "Conversation": "rolloutd.llm.conversation",
    "get_parser": "rolloutd.llm.toolparse",
    "ToolCall": "rolloutd.llm.toolparse",
    "ParseResult": "rolloutd.llm.toolparse",
    "run_agent_loop": "rolloutd.llm.agent_loop",
    "LoopResult": "rolloutd.llm.agent_loop",
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
