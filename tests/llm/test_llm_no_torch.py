"""torch stays optional: everything but serve-hf and the model builder works without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_llm_works_with_torch_blocked(tiny_tokenizer_dir, tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import asyncio
        import rolloutd.llm, rolloutd.llm.client, rolloutd.llm.conversation, rolloutd.llm.toolparse, rolloutd.llm.agent_loop, rolloutd.backends.policies
        import rolloutd.backends.scripted, rolloutd.backends.serve_hf, rolloutd.backends.tiny_model, rolloutd.llm.http_transport, rolloutd.llm.tokenizer_utils
        from rolloutd.llm import Conversation, LLMClient, SamplingParams, get_parser, run_agent_loop
        from rolloutd.backends.scripted import ScriptedBackend
        from rolloutd.llm.tokenizer_utils import load_tokenizer
        from rolloutd.llm.client import simple_generate

        tok = load_tokenizer({str(tiny_tokenizer_dir)!r})
        be = ScriptedBackend(tok, "tool_then_answer")
        be.start()

        async def execute(call):
            return "ok"

        async def main():
            async with LLMClient(be.url, "vllm", timeout=10) as c:
                conv = Conversation(tok, [{{"role": "user", "content": "hi"}}], None, 2048)
                return await run_agent_loop(simple_generate(c), conv, get_parser("hermes"), execute,
                                            SamplingParams(64), 4, tok)

        try:
            res = asyncio.run(asyncio.wait_for(main(), 30))
        finally:
            be.stop()
        assert res.stop_reason == "no_tool_call", res.stop_reason
        try:
            rolloutd.backends.tiny_model.make_tiny_model({str(tmp_path / "model")!r}, tokenizer_only=False)
        except ImportError:
            pass
        else:
            raise AssertionError("the model builder should need torch")
        print("OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "model").exists()
    assert out.stdout.strip().endswith("OK")
