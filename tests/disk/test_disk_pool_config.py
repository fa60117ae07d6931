"""`sandbox.disk_pool` reaches the phase daemons' runtime (the operator's switch for the pool of
loop workspaces made ahead, docs/OPERATIONS.md), and a bad value is refused clearly."""
from __future__ import annotations

import os
import types

import pytest

from rolloutd.bus.config import Config
from rolloutd.daemons.phase import PhaseDaemon
from rolloutd.sandbox import SandboxSpecError, bounds


def _runtime(tmp_path, **sandbox):
    cfg = Config({"sandbox": {"runtime": "local", "root_dir": str(tmp_path / "sb"), "disk_quota": "loop", **sandbox}})
    return PhaseDaemon._make_runtime(types.SimpleNamespace(cfg=cfg))


@pytest.mark.skipif(os.geteuid() != 0 or bounds.mkfs_ext4() is None, reason="the loop quota needs root and mkfs.ext4")
def test_disk_pool_setting_reaches_the_runtime(tmp_path):
    assert Config().section("sandbox")["disk_pool"] == 2
    on = _runtime(tmp_path)
    assert on._disk_pool is not None and on._disk_pool.depth == 2
    off = _runtime(tmp_path, disk_pool=0)
    assert off._disk_pool is None
    with pytest.raises(SandboxSpecError, match="disk_pool"):
        _runtime(tmp_path, disk_pool=-1)
