"""The boot re-warm: after a server (re)start, put the most recently used prefixes
back into slots while client requests are already being served.

`core.cache.warmup.warm_known` plans the steps (which prefix into which slot)
and says how to warm one (restore and verify a saved state, else prewarm from
the prefix's tokens); `BootRewarm` runs them one after another and keeps the
progress that `CacheManager.status()` shows as ``boot_rewarm``.

A client request never waits for the re-warm of a *different* prefix. The
request path calls `claim(slot, fingerprint)` before it waits for the slot:

- the slot's re-warm has not started yet → it is skipped (the request uses
  the slot, and warms its own prefix there if it has one);
- the slot's re-warm is running for another prefix (or the request has none)
  → it is cancelled: the HTTP request to llama-server is closed, which stops
  the prefill (the server notices within about a second);
- the slot's re-warm is running for the very prefix the request needs → the
  request waits for it: nothing gets it a warm slot sooner.

Events (none when nothing is known yet): ``boot_rewarm_started``, per step the warm-up's own events
(``prewarm_hit``/``prewarm_cold``, ``restore_ok``/``restore_rejected``,
``prewarm_skipped`` under memory pressure), ``boot_rewarm_skipped`` (a client
request took the slot), ``boot_rewarm_failed`` (the server refused), and
``boot_rewarm_done`` with the counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.cache import prefix as pfx
from core.cache.store import StateRecord
from core.errors import UpstreamError
from core.events import CacheEventKind
from core.status.boot import BootFailure, BootRewarmStatus, BootSource

__all__ = ["BootRewarm", "BootStep", "Emit", "Warmed"]

log = logging.getLogger("warmslot.cache")


class Emit(Protocol):
    """The cache manager's `emit`: one cache event of a known kind (fingerprint shortened)."""

    def __call__(
        self,
        kind: CacheEventKind,
        reason: str = "",
        *,
        fp: str = "",
        slot: int | None = None,
        tokens: int | None = None,
        nbytes: int | None = None,
        **details: Any,
    ) -> None: ...


@dataclass(frozen=True)
class Warmed:
    """How one boot step filled its slot: from which source, in tokens."""

    source: str  # "prefix state", "conversation state" or "prefill" (no usable state)
    restored: int  # tokens restored from a verified state on disk
    prefilled: int  # tokens llama-server read for it
    text: str  # in words, for the event, the status and the log

    def row(self, step: BootStep) -> BootSource:
        """The status row of `step` warmed this way."""
        return {
            "slot": step.slot,
            "fingerprint": step.info.fingerprint[:16],
            "tokens": step.info.n_tokens,
            "source": self.source,
            "restored": self.restored,
            "prefilled": self.prefilled,
            "text": self.text,
        }


@dataclass(frozen=True)
class BootStep:
    """One prefix to bring back into one slot."""

    slot: int
    info: pfx.PrefixInfo
    saved: StateRecord | None = None  # its saved state, where the disk tier has one


@dataclass
class _Running:
    step: BootStep
    task: asyncio.Task[Warmed | None]
    preempted: bool = False


class BootRewarm:
    """Runs and reports the re-warm after one server start."""

    def __init__(self, emit: Emit, clock: Callable[[], float] = time.time) -> None:
        self._emit = emit
        self._clock = clock
        self.state = "idle"  # idle | running | done
        self.total = 0
        self.warmed = 0
        self.skipped = 0
        self.failed = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.failures: list[BootFailure] = []
        self.sources: list[BootSource] = []  # how each warmed slot was filled
        self._pending: dict[int, BootStep] = {}  # slot → step not started yet
        self._running: _Running | None = None

    @property
    def done(self) -> int:
        """Steps finished, whatever their outcome."""
        return self.warmed + self.skipped + self.failed

    def snapshot(self) -> BootRewarmStatus:
        """The progress for `status()`."""
        run = self._running
        return {
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "warmed": self.warmed,
            "skipped": self.skipped,
            "failed": self.failed,
            "current_slot": run.step.slot if run is not None else None,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "failures": list(self.failures),
            "sources": list(self.sources),
        }

    def forget(self) -> None:
        """The server stopped: back to idle, unless a re-warm still runs (it ends by
        itself, its requests failing, or is cancelled by the next start)."""
        if self.state != "running":
            self.state = "idle"
            self.total = self.warmed = self.skipped = self.failed = 0
            self.started_at = self.finished_at = None
            self.failures = []
            self.sources = []

    def claim(self, slot: int, fingerprint: str) -> None:
        """A client request needs `slot` for the prefix `fingerprint` ("" for none)."""
        step = self._pending.pop(slot, None)
        if step is not None:
            self.skipped += 1
            self._emit(
                CacheEventKind.BOOT_REWARM_SKIPPED,
                f"a client request needed slot {slot} before its re-warm began",
                fp=step.info.fingerprint,
                slot=slot,
                tokens=step.info.n_tokens,
            )
        run = self._running
        if run is not None and run.step.slot == slot and run.step.info.fingerprint != fingerprint:
            run.preempted = True
            run.task.cancel()

    async def run(
        self, steps: list[BootStep], warm: Callable[[BootStep], Awaitable[Warmed | None]]
    ) -> None:
        """Warm each step in turn with `warm` (how it was warmed; None: skipped, e.g.
        under pressure)."""
        self._start(steps)
        try:
            for step in steps:
                if self._pending.pop(step.slot, None) is None:
                    continue  # a request claimed the slot (counted there)
                await self._one(step, warm)
        except asyncio.CancelledError:
            # Superseded by another server start, or the manager closes: not "done".
            self._pending.clear()
            self.state = "idle"
            raise
        self.state = "done"
        self.finished_at = self._clock()
        if not steps:
            return  # nothing known yet (a first start): no events to clutter the log
        how = "; ".join(f"slot {s['slot']}: {s['text']}" for s in self.sources)
        self._emit(
            CacheEventKind.BOOT_REWARM_DONE,
            f"{self.warmed} of {self.total} prefixes re-warmed after the server start"
            + (f", {self.skipped} skipped" if self.skipped else "")
            + (f", {self.failed} failed" if self.failed else "")
            + (f" ({how})" if how else ""),
            sources=list(self.sources),
            warmed=self.warmed,
            skipped=self.skipped,
            failed=self.failed,
            total=self.total,
            seconds=round(self.finished_at - (self.started_at or self.finished_at), 2),
        )

    def _start(self, steps: list[BootStep]) -> None:
        self.state = "running"
        self.total = len(steps)
        self.warmed = self.skipped = self.failed = 0
        self.failures = []
        self.sources = []
        self.started_at, self.finished_at = self._clock(), None
        self._pending = {s.slot: s for s in steps}
        self._running = None
        if not steps:
            return
        self._emit(
            CacheEventKind.BOOT_REWARM_STARTED,
            f"re-warming {len(steps)} recently used prefixes after the server start",
            total=len(steps),
            slots=[s.slot for s in steps],
        )

    async def _one(
        self, step: BootStep, warm: Callable[[BootStep], Awaitable[Warmed | None]]
    ) -> None:
        task: asyncio.Task[Warmed | None] = asyncio.ensure_future(warm(step))
        run = self._running = _Running(step, task)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise
        finally:
            self._running = None
        if task.cancelled():
            self.skipped += 1
            why = "a client request for another prefix needed the slot: the re-warm was stopped"
            if not run.preempted:
                why = "the re-warm was cancelled"
            self._emit(
                CacheEventKind.BOOT_REWARM_SKIPPED,
                why,
                fp=step.info.fingerprint,
                slot=step.slot,
                tokens=step.info.n_tokens,
            )
            return
        error = task.exception()
        if error is None:
            warmed = task.result()
            if warmed is None:
                self.skipped += 1
                return
            self.warmed += 1
            self.sources.append(warmed.row(step))
            log.info("boot re-warm of slot %d: %s", step.slot, warmed.text)
            return
        self.failed += 1
        self.failures.append(
            {"fingerprint": step.info.fingerprint[:16], "slot": step.slot, "reason": str(error)}
        )
        if not isinstance(error, UpstreamError):
            log.error("boot re-warm of slot %d failed", step.slot, exc_info=error)
        self._emit(
            CacheEventKind.BOOT_REWARM_FAILED,
            f"could not re-warm slot {step.slot}: {error}",
            fp=step.info.fingerprint,
            slot=step.slot,
            tokens=step.info.n_tokens,
        )
