"""handlers/precise_sleep.py: one timerfd per loop wakes every sleeper at or after its own
deadline, in deadline order; a cancelled sleeper leaves nothing behind; the fd goes with the loop."""
from __future__ import annotations

import asyncio
import gc
import os
import random
import time

import pytest

from rolloutd.handlers import precise_sleep as ps


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_every_sleeper_wakes_after_its_deadline_in_deadline_order(monkeypatch):
    assert ps._LIBC is not None, "timerfd through libc is the Linux path these tests are about"
    order: list[int] = []
    starts: dict = {}  # task -> the clock reading precise_sleep took its deadline from

    # Records, per task, the reading its deadline was built on: a loaded machine may start the
    # 200 sleepers ms apart, so their delays alone neither order them nor date their deadlines.
    class _Clock:
        @staticmethod
        def monotonic() -> float:
            now = time.monotonic()
            task = asyncio.current_task()
            if task is not None and task not in starts:
                starts[task] = now
            return now

    monkeypatch.setattr(ps, "time", _Clock)

    async def one(i: int, delay: float) -> tuple[float, float]:
        await ps.precise_sleep(delay)
        order.append(i)
        deadline = starts[asyncio.current_task()] + delay
        return time.monotonic() - deadline, deadline

    async def main():
        rng = random.Random(3)
        delays = [rng.uniform(0.001, 0.05) for _ in range(200)]
        got = await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
        timer = ps._timers[asyncio.get_running_loop()]
        return got, timer

    got, timer = asyncio.run(main())
    late, deadlines = zip(*got)
    assert min(late) >= 0, "a sleeper woke before its deadline"
    # Woken in heap order within one wake-up, and a later wake-up only takes later deadlines.
    woke = [deadlines[i] for i in order]
    assert woke == sorted(woke), [(i, deadlines[i]) for i in order]
    assert timer.heap == [] and timer.armed is None  # disarmed once nobody waits


def test_a_cancelled_sleeper_is_dropped_and_the_next_still_wakes():
    async def main():
        long = asyncio.ensure_future(ps.precise_sleep(30))
        await asyncio.sleep(0)
        short = asyncio.ensure_future(ps.precise_sleep(0.01))
        await asyncio.sleep(0)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        await asyncio.wait_for(short, 5)
        timer = ps._timers[asyncio.get_running_loop()]
        assert timer.heap == [] and timer.armed is None, (timer.heap, timer.armed)

    asyncio.run(main())


def test_the_timerfd_is_closed_with_its_loop():
    before = _fds()

    async def main():
        await ps.precise_sleep(0.001)
        return ps._timers[asyncio.get_running_loop()].fd

    for _ in range(20):
        fd = asyncio.run(main())
    gc.collect()
    assert str(fd) not in _fds() - before
    assert len(_fds() - before) == 0, _fds() - before


def test_zero_and_negative_delays_only_yield():
    async def main():
        t0 = time.monotonic()
        await ps.precise_sleep(0)
        await ps.precise_sleep(-1)
        return time.monotonic() - t0, asyncio.get_running_loop() in ps._timers

    _, made_a_timer = asyncio.run(main())
    assert not made_a_timer
