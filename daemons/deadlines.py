"""Phase time limits: one timer per event loop for every job's limit.

``asyncio.timeout`` arms a TimerHandle per phase and cancels it on exit (a heap push, a lazy
removal, the loop's sweeps of cancelled handles): ~5 us per phase in a micro-run, and the
pipeline benchmark's CPU per job fell ~4% without it (docs/BENCHMARKS.md, "Phase limits on one
timer"). Here a phase adds an entry to one heap and marks it done on exit (~1 us); one
TimerHandle stands for the earliest live deadline. The semantics are asyncio.timeout's: the
task is cancelled when its deadline passes, and the cancel counts as the timeout's only when
no other cancel was asked of the task meanwhile (3.11's ``Task.uncancel``; on 3.10, which
cannot tell, a deadline that fired is always the timeout).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import weakref

_ARMED, _FIRED, _DONE = 0, 1, 2


class Deadline:
    __slots__ = ("keeper", "when", "task", "state", "base")

    def __init__(self, keeper: Deadlines, when: float, task: asyncio.Task, base: int):
        self.keeper = keeper
        self.when = when
        self.task = task
        self.state = _ARMED
        self.base = base  # the task's pending cancels when armed

    def expired(self) -> bool:
        """Disarm; True when the deadline had passed and cancelled the task, and that cancel was
        the only one asked meanwhile (the task then carries no pending cancel of it)."""
        state, self.state = self.state, _DONE
        task, self.task = self.task, None  # a done entry waiting in the heap holds no task (nor its loop)
        if state == _ARMED:
            self.keeper._armed -= 1
        if state != _FIRED:
            return False
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
        return uncancel is None or uncancel() <= self.base


class Deadlines:
    """Found by its loop in a weak map, so it holds the loop (and its timer, which holds the
    loop) only weakly: the loop's own schedule keeps the timer while it is pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)
        self._heap: list = []
        self._armed = 0
        self._seq = itertools.count()  # ties never compare Deadline objects
        self._timer = _no_timer

    def arm(self, limit: float) -> Deadline:
        """A deadline ``limit`` seconds from now for the running task; call ``expired()`` on
        it once the guarded code has ended, however it ended."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline needs a running task")
        cancelling = getattr(task, "cancelling", None)
        loop = self._loop()
        d = Deadline(self, loop.time() + limit, task, cancelling() if cancelling else 0)
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._armed:  # mostly finished entries: drop them
            heap[:] = [e for e in heap if e[2].state == _ARMED]
            heapq.heapify(heap)
        heapq.heappush(heap, (d.when, next(self._seq), d))
        self._armed += 1
        timer = self._timer()
        if timer is None or d.when < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = weakref.ref(loop.call_at(d.when, self._fire))
        return d

    def _fire(self) -> None:
        self._timer = _no_timer
        loop = self._loop()
        heap = self._heap
        now = loop.time()
        while heap:
            when, _, d = heap[0]
            if d.state != _ARMED:
                heapq.heappop(heap)
                continue
            if when > now:
                self._timer = weakref.ref(loop.call_at(when, self._fire))
                return
            heapq.heappop(heap)
            self._armed -= 1
            if not d.task.done():
                d.state = _FIRED
                d.task.cancel()


def _no_timer() -> None:
    return None


_PER_LOOP: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines]" = weakref.WeakKeyDictionary()


def deadlines() -> Deadlines:
    """The running loop's keeper."""
    loop = asyncio.get_running_loop()
    keeper = _PER_LOOP.get(loop)
    if keeper is None:
        keeper = _PER_LOOP[loop] = Deadlines(loop)
    return keeper
