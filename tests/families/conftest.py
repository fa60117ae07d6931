"""Model-family fixtures: tokenizers built from the reference packages' vocabularies.

A family whose reference package is not installed is skipped with the pip command
that installs it (the `families` extra of pyproject.toml has them all).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
from rolloutd.llm.families import family_tokenizer_dir
from rolloutd.llm.tokenizer_utils import load_tokenizer

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a command in a bash shell.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}


@dataclass
class Gen:
    """A sampled generation as the backend client returns it (what Conversation.add_generation reads)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    latency_s: float = 0.0


def _missing(msg: str):
    # CI installs the families extra: there a missing reference package is a failure
    if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
        pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
    pytest.skip(msg)


def need(module: str, pip_name: str):
    """Import a reference package, or skip (fail under ROLLOUTD_TEST_STRICT=1) naming its pip install."""
    try:
        return __import__(module)
    except ImportError:
        _missing(f"{pip_name} is not installed (pip install 'rolloutd[families]')")


def family_dir_or_skip(name: str):
    """The family's tokenizer directory, built in the session's cache (or, for repeated local
    runs, under $ROLLOUTD_TEST_FAMILY_CACHE, which the session keeps)."""
    try:
        return family_tokenizer_dir(name, root=os.environ.get("ROLLOUTD_TEST_FAMILY_CACHE"))
    except ImportError as e:
        _missing(f"{name}: {e}")


@functools.cache
def _load(path: str):
    return load_tokenizer(path)


def family_or_skip(name: str):
    return _load(str(family_dir_or_skip(name)))
