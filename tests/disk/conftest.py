"""Fixtures of the disk tests: the diskhog test handler, registered through a throwaway
entry-point dist (the daemons inherit PYTHONPATH, so they load it too)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def diskhog_entry_point():
    from rolloutd.handlers import registry

    d = Path(tempfile.mkdtemp(prefix="rd-diskhog-"))
    shutil.copy(Path(__file__).with_name("diskhog_handler.py"), d / "rd_diskhog_handler.py")
    info = d / "rd_diskhog-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rd-diskhog\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[rolloutd.handlers]\ndiskhog = rd_diskhog_handler:DiskHogHandler\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(d) + (os.pathsep + old if old else "")
    sys.path.insert(0, str(d))
    registry._entry_points.cache_clear()
    yield str(d)
    sys.path.remove(str(d))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
    registry._entry_points.cache_clear()
    shutil.rmtree(d, ignore_errors=True)
