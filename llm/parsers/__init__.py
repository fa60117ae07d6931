"""Tool-call and reasoning parsers of model families (one module per format).

Look them up by name with :func:`rolloutd.llm.toolparse.get_parser`: ``qwen3``,
``qwen3_coder``, ``llama3_json``, ``mistral``, ``harmony`` (alias ``gpt_oss``),
``deepseek_v31`` (alias ``deepseek_v3``). docs/LLM.md, "Model families", says what
each was checked against.
"""
