"""The harness instance's ``tokenizer`` names a tokenizer the handler's config allows; a request
never gives a host path (issue 28 item 5: it took any path, against docs/HARNESS.md)."""
from __future__ import annotations

import pytest

from rolloutd.handlers.harness import HarnessHandler, HarnessInstanceError, validate

BASE = {"command": ["agent"], "task": "x", "task_via": "stdin", "eval": {"command": ["true"]}}


def test_a_request_names_a_configured_tokenizer_never_a_path(tmp_path):
    config = {"tokenizer": "/models/default", "tokenizers": {"qwen3": "/models/Qwen3-8B"}}
    assert validate(dict(BASE, tokenizer="qwen3"), config)["tokenizer"] == "/models/Qwen3-8B"
    assert validate(BASE, config)["tokenizer"] is None  # the handler's own tokenizer then
    for bad in ("/etc", str(tmp_path), "../models/Qwen3-8B", "Qwen3-8B"):
        with pytest.raises(HarnessInstanceError, match="must name one of .*'qwen3'.* a request never gives a host path"):
            validate(dict(BASE, tokenizer=bad), config)
    with pytest.raises(HarnessInstanceError, match="none configured"):
        validate(dict(BASE, tokenizer="qwen3"), {"tokenizer": "/models/default"})


def test_the_named_tokenizer_is_what_the_job_loads():
    from rolloutd.bus.messages import Job
    from rolloutd.handlers.base import JobContext

    h = HarnessHandler({"tokenizer": "/models/default", "tokenizers": {"small": "/models/small"}})
    ctx = JobContext(Job(job_id=1, attempt=1, handler="harness", instance=dict(BASE, tokenizer="small")))
    assert h.tokenizer_path(ctx) == "/models/small"
    ctx = JobContext(Job(job_id=2, attempt=1, handler="harness", instance=dict(BASE)))
    assert h.tokenizer_path(ctx) == "/models/default"
