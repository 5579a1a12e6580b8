"""A small scheduler for the background sweeps, on the core's loop.

Each sweep is a coroutine function run every `interval` seconds (read from the
settings before every wait, so edits apply at the next run; clamped to the
sweep's minimum). Every run is recorded — start, duration, actions taken,
error — as a `SweepRun` event (the telemetry stores it in the ``sweeps`` table)
and in memory for status, so a stuck or failing sweep is visible. A sweep that
raises is logged and retried at its next interval; it never takes the core down.
Time comes from an injectable `Clock`, so tests drive whole hours of sweeps
with a `FakeClock`. Old uneventful runs (no actions, no error) are thinned to
one per sweep per 10 minutes by `thin_runs`; runs that did something or failed
are kept for the telemetry retention period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from core.clock import Clock
from core.events import Event, SweepRun
from core.status import SweepStatus

__all__ = ["Outcome", "Sweep", "Sweeps", "clamp_interval", "thin_runs"]

log = logging.getLogger("warmslot.sweeps")


@dataclass
class Outcome:
    """What one sweep run did: the number of actions and anything worth keeping."""

    actions: int = 0
    details: dict[str, object] = field(default_factory=dict)


SweepFn = Callable[[], Awaitable[Outcome | int | None]]


def clamp_interval(value: float, minimum: float) -> float:
    """The interval a sweep really uses: never below its minimum."""
    return max(float(minimum), float(value))


@dataclass
class Sweep:
    name: str
    fn: SweepFn
    interval: Callable[[], float]
    minimum: float = 1.0
    first_delay: float | None = None  # None: one interval after start
    runs: int = 0
    failures: int = 0
    last: SweepRun | None = None
    last_error: SweepRun | None = None
    running_since: float | None = None
    next_due: float | None = None

    @property
    def effective_interval(self) -> float:
        return clamp_interval(self.interval(), self.minimum)

    def snapshot(self, now: float) -> SweepStatus:
        last = self.last
        return {
            "name": self.name,
            "interval_s": self.effective_interval,
            "configured_s": self.interval(),
            "runs": self.runs,
            "failures": self.failures,
            "running_for_s": None if self.running_since is None else now - self.running_since,
            "next_in_s": None if self.next_due is None else max(0.0, self.next_due - now),
            "last_start": last.started if last else None,
            "last_duration_s": last.duration_s if last else None,
            "last_actions": last.actions if last else None,
            "last_error": last.error if last else None,
            "last_details": dict(last.details) if last else {},
        }


class Sweeps:
    """Runs registered sweeps forever on the current loop; see the module docstring."""

    def __init__(self, clock: Clock, emit: Callable[[Event], None]) -> None:
        self.clock = clock
        self._emit = emit
        self.sweeps: dict[str, Sweep] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add(
        self,
        name: str,
        fn: SweepFn,
        interval: Callable[[], float],
        *,
        minimum: float = 1.0,
        first_delay: float | None = None,
    ) -> Sweep:
        if name in self.sweeps:
            raise ValueError(f"sweep {name!r} already registered")
        sweep = Sweep(name, fn, interval, minimum, first_delay)
        self.sweeps[name] = sweep
        return sweep

    async def run_once(self, name: str) -> SweepRun:
        """Run one sweep now and record it (also what the scheduler does each interval)."""
        sweep = self.sweeps[name]
        started = self.clock.time()
        t0 = self.clock.monotonic()
        sweep.running_since = started
        error = ""
        outcome = Outcome()
        try:
            result = await sweep.fn()
            if isinstance(result, Outcome):
                outcome = result
            elif isinstance(result, int):
                outcome = Outcome(result)
        except asyncio.CancelledError:
            sweep.running_since = None
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.exception("sweep %s failed; retrying at its next interval", name)
        finally:
            sweep.running_since = None
        run = SweepRun(
            name=name,
            started=started,
            duration_s=round(self.clock.monotonic() - t0, 6),
            actions=outcome.actions,
            error=error,
            details=outcome.details,
            ts=self.clock.time(),
        )
        sweep.runs += 1
        sweep.last = run
        if error:
            sweep.failures += 1
            sweep.last_error = run
        self._emit(run)
        return run

    async def _loop(self, sweep: Sweep) -> None:
        delay = sweep.effective_interval if sweep.first_delay is None else sweep.first_delay
        while True:
            sweep.next_due = self.clock.time() + delay
            await self.clock.sleep(delay)
            sweep.next_due = None
            try:
                await self.run_once(sweep.name)
            except asyncio.CancelledError:
                raise
            except Exception:  # recording itself failed: never end the loop
                log.exception("sweep %s could not be recorded", sweep.name)
            delay = sweep.effective_interval

    def start(self) -> None:
        """Start one task per sweep on the running loop (idempotent)."""
        if self._tasks:
            return
        for sweep in self.sweeps.values():
            self._tasks.append(asyncio.ensure_future(self._loop(sweep)))

    async def run_forever(self) -> None:
        """Start the sweeps and wait until cancelled; cancelling stops every sweep."""
        self.start()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.stop()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def status(self) -> list[SweepStatus]:
        """Every sweep's schedule and last run."""
        now = self.clock.time()
        return [s.snapshot(now) for s in self.sweeps.values()]


def thin_runs(tel: Any, now: float, *, older_than: float = 3600.0, bucket: float = 600.0) -> int:
    """Thin uneventful sweep runs older than `older_than` to one per sweep per `bucket` s.

    Runs that took actions or failed are always kept. `tel` is a
    `core.telemetry.Telemetry`; returns the number of rows deleted.
    """
    tel.flush()
    cutoff = now - older_than
    cur = tel.db.execute(
        """DELETE FROM sweeps WHERE ts < ? AND actions = 0 AND error = '' AND id NOT IN (
               SELECT MIN(id) FROM sweeps WHERE ts < ? AND actions = 0 AND error = ''
               GROUP BY name, CAST(ts / ? AS INTEGER))""",
        [cutoff, cutoff, bucket],
    )
    return int(cur.rowcount)
