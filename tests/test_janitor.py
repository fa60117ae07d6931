"""The init daemon's janitor reaps sandboxes nobody holds (after a crash, say)."""
from __future__ import annotations

import time

import pytest


def test_orphan_sandbox_is_reaped(up_factory):
    from rolloutd.sandbox import bwrap_works, get_runtime

    ok, why = bwrap_works()
    runtime = "bwrap" if ok else "local"
    up = up_factory(f"sandbox.runtime={runtime}", "sandbox.janitor_interval_s=0.5", "sandbox.janitor_grace_s=1")
    from rolloutd.daemons.supervisor import config_from_args

    rt = get_runtime(runtime, root_dir=config_from_args(None, str(up.runtime_dir), []).sandbox_root())
    orphan = rt.create("424242.1")  # as if its job's daemon had died with it
    assert [h.job_id for h in rt.list()] == ["424242.1"]
    deadline = time.monotonic() + 20
    while rt.list():
        assert time.monotonic() < deadline, "the orphan was not reaped\n" + up.log()[-2000:]
        time.sleep(0.2)
    # The line follows the reap it reports (logged once the whole sweep is done): wait for it.
    from tests.conftest import wait_for

    wait_for(lambda: up.logged("orphan_sandboxes_reaped"), 20, "the janitor's orphan_sandboxes_reaped line")
    for pid in orphan.pids:
        from tests.conftest import alive

        assert not alive(pid)
