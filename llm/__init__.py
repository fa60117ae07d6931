"""rolloutd's LLM side, token-in/token-out.

* :mod:`rolloutd.llm.client`: ``LLMClient`` for vLLM (``/v1/completions``) and SGLang (``/generate``),
  ``SamplingParams``, ``Generation``, the error types;
* :mod:`rolloutd.llm.conversation`: ``Conversation``, the exact token trajectory of a rollout;
* :mod:`rolloutd.llm.toolparse`: tool-call parsers (``hermes``, ``fenced_bash``), and
  :mod:`rolloutd.llm.parsers` the model families' own (qwen3, qwen3_coder, llama3_json, mistral,
  harmony, deepseek_v31); :mod:`rolloutd.llm.families` maps a family to its parser, chat template
  and reasoning handling;
* :mod:`rolloutd.llm.http_transport`: the HTTP/1.1 keep-alive transport ``LLMClient`` speaks through;
* :mod:`rolloutd.llm.agent_loop`: ``run_agent_loop``, the multi-turn loop;
* :mod:`rolloutd.llm.tokenizer_utils` (and :mod:`rolloutd.llm.encode_worker`, the bounded worker
  processes long texts are tokenized in): tokenizer loading and fast encoding.

The agent-facing endpoint is :mod:`rolloutd.endpoint`, the stand-in backends (scripted, serve-hf,
the tiny model, the vLLM CPU launcher) are :mod:`rolloutd.backends`; both import this package,
never the reverse (docs/ARCHITECTURE.md).

Importing ``llm`` (or any module above) does not import torch. See docs/LLM.md.
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
