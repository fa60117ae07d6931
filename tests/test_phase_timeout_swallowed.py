"""A phase's time limit holds even when the handler's code swallows the cancellation that
enforces it. Python 3.11's ``asyncio.wait_for`` does exactly that when its inner future is done
at the moment the outer task is cancelled (it returns the result): a math job whose tool calls
finish instantly then ran on past ``phase_timeouts.run`` and came back ``ok`` (seen once in a full
run). The phase runner now reports the timeout whenever its limit expired."""
from __future__ import annotations

import asyncio
import types

import pytest

from rolloutd.daemons.phase import PhaseDaemon
from rolloutd.handlers.base import PhaseTimeout


class SwallowingHandler:
    """A run phase that catches the cancellation once and carries on, as wait_for can."""

    async def run(self, ctx):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.05)


def test_a_swallowed_cancellation_still_ends_the_phase_as_a_timeout():
    me = types.SimpleNamespace(phase="run")
    with pytest.raises(PhaseTimeout):
        asyncio.run(PhaseDaemon._run_phase(me, SwallowingHandler(), None, 0.2))


def test_a_phase_within_its_limit_is_not_a_timeout():
    class Quick:
        finished = False

        async def run(self, ctx):
            await asyncio.sleep(0.01)
            self.finished = True

    quick = Quick()
    # No PhaseTimeout raised (pytest fails the test on one), and the phase ran to its end.
    assert asyncio.run(PhaseDaemon._run_phase(types.SimpleNamespace(phase="run"), quick, None, 5.0)) is None
    assert quick.finished
