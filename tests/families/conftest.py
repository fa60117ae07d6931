"""Model-family fixtures: tokenizers built from the reference packages' vocabularies.

A family whose reference package is not installed is skipped with the pip command
that installs it (the `families` extra of pyproject.toml has them all).
"""

from __future__ import annotations

import functools
import os

import pytest

from rolloutd.llm.families import FAMILIES, family_tokenizer_dir
from rolloutd.llm.tokenizer_utils import load_tokenizer

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a command in a bash shell.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}


def family_dir_or_skip(name: str):
    """The family's tokenizer directory, built in the session's cache (or, for repeated local
    runs, under $ROLLOUTD_TEST_FAMILY_CACHE, which the session keeps)."""
    try:
        return family_tokenizer_dir(name, root=os.environ.get("ROLLOUTD_TEST_FAMILY_CACHE"))
    except ImportError as e:
        pytest.skip(f"{name}: {e}")


@functools.lru_cache(maxsize=None)
def _load(path: str):
    return load_tokenizer(path)


def family_or_skip(name: str):
    return _load(str(family_dir_or_skip(name)))


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request):
    """(name, tokenizer) for every family."""
    return request.param, family_or_skip(request.param)
