"""Time, injectable: the real clock, and a fake one that tests drive by hand.

Everything in the background core (sweeps, TTLs, keep-alive, pressure
sampling) asks a `Clock` for the time and sleeps through it, never through
`time` or `asyncio.sleep` directly. In production that is `RealClock`. Tests use
`FakeClock`: its `sleep` parks the caller until the test calls `advance`, which
moves time forward deadline by deadline, wakes each sleeper in order and, after
each wake-up, waits until every task that ever slept on this clock is parked
again (or finished) before going on — so a test that advances an hour sees
every sweep of that hour run, in order, even when a sweep does real I/O against
a real llama-server in between.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Clock", "FakeClock", "RealClock"]


class Clock(Protocol):
    """What the background core needs from time."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch (timestamps, file ages)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (idle times, durations)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...


class RealClock:
    """The system clock."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


@dataclass(order=True)
class _Sleeper:
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    task: asyncio.Task[object] | None = field(compare=False)


class FakeClock:
    """A clock that only moves when told to (`advance`, `set`).

    `time()` starts at `start` (wall-clock seconds) and `monotonic()` at 0; both
    move together. Sleepers must run on one event loop; `advance` must be awaited
    on that loop (from another thread: ``core.submit(clock.advance(60))``).
    """

    def __init__(self, start: float = 1_700_000_000.0, *, settle_timeout: float = 120.0) -> None:
        self._epoch = start
        self._now = start
        self._sleepers: list[_Sleeper] = []
        self._seq = itertools.count()
        self._participants: set[asyncio.Task[object]] = set()  # tasks that sleep on us
        self.settle_timeout = settle_timeout  # real seconds woken tasks may take to park

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now - self._epoch

    @property
    def sleepers(self) -> int:
        """How many callers are parked in `sleep` right now."""
        return sum(1 for s in self._sleepers if not s.future.done())

    def next_deadline(self) -> float | None:
        """When the earliest sleeper wakes (clock time), or None."""
        live = [s.deadline for s in self._sleepers if not s.future.done()]
        return min(live) if live else None

    async def sleep(self, seconds: float) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._participants.add(task)
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        sleeper = _Sleeper(self._now + seconds, next(self._seq), loop.create_future(), task)
        heapq.heappush(self._sleepers, sleeper)
        try:
            await sleeper.future
        finally:
            if not sleeper.future.done():
                sleeper.future.cancel()  # cancelled while parked: forget it

    def _parked(self, task: asyncio.Task[object] | None) -> bool:
        if task is None or task.done():
            return True
        return any(s.task is task and not s.future.done() for s in self._sleepers)

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, waking every sleeper due on the way, in order."""
        await self.set(self._now + seconds)

    async def set(self, target: float) -> None:
        """Move time forward to `target` (wall-clock seconds); see `advance`."""
        if target < self._now:
            raise ValueError("a FakeClock never goes back")
        await self._settle()  # tasks still running from before get to park first
        while True:
            while self._sleepers and self._sleepers[0].future.done():
                heapq.heappop(self._sleepers)  # cancelled sleepers
            if not self._sleepers or self._sleepers[0].deadline > target:
                break
            sleeper = heapq.heappop(self._sleepers)
            self._now = max(self._now, sleeper.deadline)
            sleeper.future.set_result(None)
            await self._settle()
        self._now = target

    def _unsettled(self) -> list[asyncio.Task[object]]:
        me = asyncio.current_task()
        self._participants = {t for t in self._participants if not t.done()}
        return [t for t in self._participants if t is not me and not self._parked(t)]

    async def _settle(self) -> None:
        """Let every task that sleeps on this clock run until it sleeps again or ends."""
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        spins = 0
        while busy := self._unsettled():
            if loop.time() > deadline:
                raise TimeoutError(f"tasks on the fake clock did not settle: {busy!r}")
            spins += 1
            # Pure-asyncio work settles within a few yields; real I/O needs real time.
            await asyncio.sleep(0 if spins < 50 else 0.002)
