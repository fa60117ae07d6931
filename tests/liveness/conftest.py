"""The loop_staller test handler, registered through a throwaway entry-point dist (the daemons
inherit PYTHONPATH, so they load it too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import handler_entry_point


@pytest.fixture(scope="module")
def loop_staller_entry_point():
    with handler_entry_point(Path(__file__).with_name("loop_staller.py"), "loop_staller", "LoopStaller") as d:
        yield d
