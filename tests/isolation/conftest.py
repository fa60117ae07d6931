"""The test handlers of this directory (sandbox_hog, tool_queue), registered through throwaway
entry-point dists (the daemons inherit PYTHONPATH, so they load them too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import handler_entry_point


@pytest.fixture(scope="module")
def sandbox_hog_entry_point():
    with handler_entry_point(Path(__file__).with_name("sandbox_hog.py"), "sandbox_hog", "SandboxHog") as d:
        yield d


@pytest.fixture(scope="module")
def tool_queue_entry_point():
    with handler_entry_point(Path(__file__).with_name("tool_queue.py"), "tool_queue", "ToolQueue") as d:
        yield d
