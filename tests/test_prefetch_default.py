"""A phase daemon's default prefetch: pool/8, at least 2 (docs/ARCHITECTURE.md, credit)."""
from __future__ import annotations

import time

from rolloutd.bus.events import Subscriber
from rolloutd.daemons.phase import default_prefetch

from tests.conftest import synthetic


def test_the_default_is_an_eighth_of_the_pool_and_never_below_two():
    assert [default_prefetch(p) for p in (1, 2, 8, 16, 17, 32, 512)] == [2, 2, 2, 2, 2, 4, 64]


def test_a_one_slot_run_daemon_holds_one_running_and_two_waiting(up_factory):
    """Unset, ``run.prefetch`` lets a one-slot run daemon take two jobs beyond its slot (the
    buffer a finishing init slot hands off into) and no more: the other jobs stay upstream."""
    up = up_factory("run.pool=1", "daemon.heartbeat_s=0.2")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 5.0}) for i in range(6)])
        held = []
        with Subscriber(up.events, ["daemon.heartbeat"]) as sub:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ev = sub.next(0.5)
                if ev is None or ev[1].get("daemon") != "run":
                    continue
                held.append(len(ev[1].get("jobs", ())))
                if held.count(3) >= 5:  # a second of heartbeats at three
                    break
        c.cancel(ids)
    assert held.count(3) >= 5, held
    assert max(held) == 3, held
