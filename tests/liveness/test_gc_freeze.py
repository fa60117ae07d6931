"""Head daemons freeze what survives a full collection (bus/daemon.py, docs/SCALING.md section 8):
a full pass over the gateway's 648,000 job records stalled its loop 180-270 ms."""
from __future__ import annotations

import gc

from rolloutd.bus.daemon import Daemon
from rolloutd.daemons.router import Router
from rolloutd.gateway.daemon import Gateway


def test_the_head_daemons_freeze_survivors_and_the_phase_daemons_do_not():
    from rolloutd.daemons.phase import PhaseDaemon

    assert Gateway.freeze_after_full_gc and Router.freeze_after_full_gc
    assert not Daemon.freeze_after_full_gc and not PhaseDaemon.freeze_after_full_gc  # their tasks hold cycles


class Rec:
    __slots__ = ("job",)

    def __init__(self, job):
        self.job = job


def test_survivors_of_a_full_collection_are_frozen_once():
    class Head:
        _freeze_survivors = Daemon._freeze_survivors

    d = Head()
    d._full_gcs = gc.get_stats()[2]["collections"]
    gc.unfreeze()
    try:
        table = [Rec(i) for i in range(1000)]  # long-lived records, tracked by the collector
        d._freeze_survivors()
        assert gc.get_freeze_count() == 0  # no full collection since: nothing frozen
        gc.collect()
        d._freeze_survivors()
        frozen = gc.get_freeze_count()
        assert frozen >= len(table)
        young_or_old = {id(x) for g in (0, 1, 2) for x in gc.get_objects(g)}
        assert not any(id(r) in young_or_old for r in table)  # a full pass no longer walks them
        d._freeze_survivors()
        assert gc.get_freeze_count() == frozen  # the same collection is not acted on twice
    finally:
        gc.unfreeze()
