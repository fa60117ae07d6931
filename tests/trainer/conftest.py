"""Fixtures for the trainer-integration tests (issue 9)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def toy_registered(tmp_path, monkeypatch):
    """Make the ``toy`` handler visible to the daemons of a ``rolloutd up`` started afterwards.

    Once ENTRY_POINTS_TRAINER.txt is in pyproject.toml (and the package reinstalled) this does
    nothing; until then it puts a throw-away ``*.dist-info`` declaring the entry point on the
    daemons' PYTHONPATH (they find handlers only through entry points)."""
    from handlers.registry import handler_names

    if "toy" in handler_names():
        return False
    di = tmp_path / "shim" / "rolloutd_trainer_toy-0.0.0.dist-info"
    di.mkdir(parents=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: rolloutd-trainer-toy\nVersion: 0.0.0\n")
    (di / "entry_points.txt").write_text("[rolloutd.handlers]\ntoy = handlers.toy:ToyHandler\n")
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(di.parent), str(REPO)] + ([old] if old else [])))
    return True


@pytest.fixture(scope="session")
def tiny_tok_dir(tmp_path_factory):
    from llm.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_tok"), tokenizer_only=True)


@pytest.fixture(scope="session")
def tiny_tok(tiny_tok_dir):
    from llm.tokenizer_utils import load_tokenizer

    return load_tokenizer(tiny_tok_dir)
