"""The sandbox_hog test handler, registered through a throwaway entry-point dist (the daemons
inherit PYTHONPATH, so they load it too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import handler_entry_point


@pytest.fixture(scope="module")
def sandbox_hog_entry_point():
    with handler_entry_point(Path(__file__).with_name("sandbox_hog.py"), "sandbox_hog", "SandboxHog") as d:
        yield d
