"""The quiet_sampler test handler, registered through a throwaway entry-point dist (the daemons
inherit PYTHONPATH, so they load it too)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def quiet_sampler_entry_point():
    from rolloutd.handlers import registry

    d = Path(tempfile.mkdtemp(prefix="rd-quiet-"))
    shutil.copy(Path(__file__).with_name("quiet_sampler.py"), d / "rd_quiet_sampler.py")
    info = d / "rd_quiet_sampler-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rd-quiet-sampler\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[rolloutd.handlers]\nquiet_sampler = rd_quiet_sampler:QuietSampler\n")
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
