"""daemons/deadlines.py: one timer per loop for every phase's time limit, with asyncio.timeout's
semantics (the phase runner's own behaviour is in test_phase_timeout_swallowed.py and
test_reliability.py)."""
from __future__ import annotations

import asyncio
import time

import pytest

from rolloutd.daemons.deadlines import deadlines


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def guarded(limit: float, body) -> bool:
    """Run ``body()`` under a deadline; True when it expired (the guarded code was cut short)."""
    d = deadlines().arm(limit)
    try:
        await body()
    except asyncio.CancelledError:
        if d.expired():
            return True
        raise
    finally:
        done = d.expired()
    return done


def test_a_deadline_cancels_its_phase_on_time():
    async def main():
        t0 = time.monotonic()
        assert await guarded(0.2, lambda: asyncio.sleep(10))
        return time.monotonic() - t0

    assert 0.18 <= run(main()) < 2.0


def test_an_earlier_deadline_armed_after_a_later_one_fires_first():
    async def main():
        slow = asyncio.create_task(guarded(30, lambda: asyncio.sleep(60)))
        await asyncio.sleep(0.05)  # the timer now stands for the 30 s deadline
        t0 = time.monotonic()
        assert await guarded(0.2, lambda: asyncio.sleep(10))
        took = time.monotonic() - t0
        assert not slow.done()  # the other deadline is not due
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return took

    assert run(main()) < 2.0


def test_a_finished_phase_is_never_cancelled_after_it():
    async def main():
        assert not await guarded(0.1, lambda: asyncio.sleep(0))
        await asyncio.sleep(0.3)  # past the finished phase's deadline: no cancel may land here
        return True

    assert run(main())


def test_a_cancel_asked_meanwhile_stays_a_cancel():
    """A job's cancel and then the deadline hit the phase: the job's cancel wins (asyncio.timeout
    does the same: TimeoutError only when its own cancel was the only one)."""
    async def main():
        async def body():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(10)  # clean-up still running when the deadline passes

        phase = asyncio.create_task(guarded(0.3, body))
        await asyncio.sleep(0.05)
        phase.cancel()  # the job's cancel, before the deadline
        with pytest.raises(asyncio.CancelledError):
            await phase
        return True

    assert run(main())


def test_a_swallowed_deadline_still_reads_as_expired():
    async def main():
        async def body():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(0.05)

        assert await guarded(0.1, body)
        # The swallowed cancel was taken back: the task goes on uncancelled.
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)
        return True

    assert run(main())


def test_many_short_phases_keep_the_heap_small():
    async def main():
        for _ in range(5000):
            await guarded(30, lambda: asyncio.sleep(0))
        return len(deadlines()._heap)

    assert run(main()) <= 130


def test_a_finished_loop_is_not_kept_alive_by_its_keeper():
    """The keeper is found by its loop (a weak map): nothing it holds may keep that loop alive,
    or every loop that ever ran a phase would stay (one per asyncio.run in a test process)."""
    import gc
    import weakref

    seen = []

    async def main():
        seen.append(weakref.ref(asyncio.get_running_loop()))
        assert not await guarded(30, lambda: asyncio.sleep(0))  # a timer still armed at the end
        slow = asyncio.create_task(guarded(0.05, lambda: asyncio.sleep(10)))
        assert await slow

    asyncio.run(main())
    gc.collect()
    assert seen[0]() is None
