"""Fixtures of the harness tests: bwrap sandboxes that are destroyed and checked afterwards
(the sandbox tests' Tracker), and the agent virtual environment built from PyPI."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.sandbox.conftest import Tracker, _make, bwrap_ok


@pytest.fixture
def sandboxes():
    """A bwrap runtime under a short root; every sandbox made through it is destroyed and
    checked for leftovers at the end."""
    if not bwrap_ok()[0]:
        pytest.skip("bubblewrap unusable here: %s" % bwrap_ok()[1])
    d = Path(tempfile.mkdtemp(prefix="rlh", dir="/tmp"))
    os.chmod(d, 0o755)
    t = Tracker(_make("bwrap", d))
    try:
        yield t
    finally:
        try:
            t.cleanup()
        finally:
            shutil.rmtree(d, ignore_errors=True)
