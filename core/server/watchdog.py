"""The slot watchdog: a request whose llama-server slot makes no progress is cancelled.

A slot can stop moving with its task still on it (seen in a soak: a streamed request
stuck at 3,045 of 5,518 prompt tokens for 300 s); every later request pinned to that
slot then waits behind it. The proxy puts each generation request it forwards under
the `SlotWatchdog` of its server (`watch`), tells it of every byte of the answer that
arrives (`Watch.moved`) and ends the watch when the exchange ends. A request whose slot
shows no progress for `proxy.stall_timeout_s` is *fired*: the proxy closes its upstream
request — which makes llama-server drop the task and free the slot
(docs/llama-server-facts.md#abandoned-requests-under-traffic) — and answers the client
with an error that names the slot (docs/cache.md#stalled-slots).

Progress is what the server shows, read cheaply:

- the answer's own bytes (free: the proxy reads them anyway);
- else ``GET /slots``: a slot's task id, the tokens it holds, the prompt tokens read and
  the tokens generated (`SlotInfo.progress`). One poll serves every slot of the server,
  and it is made only while some request has had no byte for a quarter of the limit
  (`POLL_AFTER_SHARE`), at most every `POLL_MIN_S`: a request that streams, or ends
  sooner, never costs a poll (docs/benchmarks.md#request-budget).

A slot that `/slots` shows idle, or whose counters moved, made progress; one whose poll
goes unanswered (the server's loop is stuck) made none. Of the requests pinned to one
slot only the oldest is fired — it is the one the slot runs; the others wait behind it —
and the next one gets a whole limit of its own. A request whose slot llama-server picks
itself (no ``id_slot``) is fired only when no slot of the server moved at all. A server
that refuses ``/slots`` (``--no-slots``) is never judged.

The prompt's progress shows once per batch (2,048 tokens read at once), so the limit is
at least `BATCH_MARGIN` batches at the model's measured prefill rate: a long prompt on a
slow CPU is not taken for a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.errors import UpstreamError
from core.server.client import LlamaClient, SlotInfo

__all__ = [
    "BATCH_MARGIN",
    "N_BATCH",
    "POLL_AFTER_SHARE",
    "POLL_MIN_S",
    "SlotWatchdog",
    "Stall",
    "Watch",
]

log = logging.getLogger("warmslot.proxy")

# Never more than one poll in this many seconds: a stock server polled more than once a
# second keeps running a request whose client hung up
# (docs/llama-server-facts.md#abandoned-requests-under-traffic).
POLL_MIN_S = 2.0
POLL_MAX_S = 15.0
POLL_AFTER_SHARE = 0.25  # polls start once a request had no byte for this share of the limit
N_BATCH = 2048  # llama-server's logical batch (its default; Warmslot does not set -b)
BATCH_MARGIN = 2.0  # the limit is at least this many batches at the measured prefill rate

Key = int | None  # a slot id, or None: a request whose slot llama-server chooses


@dataclass(frozen=True)
class Stall:
    """Why a request was fired: its slot, how long nothing moved, and what was seen."""

    slot: int | None
    seconds: float
    limit_s: float
    seen: str  # what the server last showed ("prompt 3045 tokens read, 0 generated" …)

    def text(self) -> str:
        """The sentence the client and the event get."""
        where = f"slot {self.slot}" if self.slot is not None else "every slot"
        return (
            f"llama-server's {where} made no progress for {self.seconds:.0f} s "
            f"(no prompt token read, no token generated; {self.seen}); Warmslot cancelled "
            f"the request and freed the slot (limit {self.limit_s:.0f} s: proxy.stall_timeout_s)"
        )


class Watch:
    """One request under the watchdog: its slot, when it last moved, and its stall."""

    def __init__(self, slot: int | None, clock: Callable[[], float]) -> None:
        self.slot = slot
        self._clock = clock
        self.started = clock()
        self.last_moved = self.started  # the last byte of its answer (or its start)
        self.stall: Stall | None = None
        self._fired = asyncio.Event()

    def moved(self) -> None:
        """A byte of the answer arrived."""
        self.last_moved = self._clock()

    async def fired(self) -> Stall:
        """Wait until the watchdog fires this request (never, if it ends first)."""
        await self._fired.wait()
        assert self.stall is not None
        return self.stall

    def fire(self, stall: Stall) -> None:
        self.stall = stall
        self._fired.set()


@dataclass
class _Seen:
    key: tuple[int, ...]  # the slot's (or, for None, every slot's) progress counters
    since: float  # when they were first seen so, or the slot was seen idle
    what: str  # in words, for the stall's text


def _describe(s: SlotInfo) -> str:
    return (
        f"task {s.id_task}: {s.n_prompt_tokens_processed} prompt tokens read, "
        f"{s.n_decoded} generated"
    )


class SlotWatchdog:
    """The watches of one llama-server, and the one ``/slots`` poll that serves them.

    `client` gives the server's `LlamaClient` (None while it is not running); `limit_s`
    the setting (0: off), read on every tick; `floor_s` the least limit that the model's
    measured prefill rate allows (`BATCH_MARGIN` batches). The tick runs only while a
    request is watched.
    """

    def __init__(
        self,
        client: Callable[[], LlamaClient | None],
        limit_s: Callable[[], float],
        *,
        floor_s: Callable[[], float] = lambda: 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._limit_s = limit_s
        self._floor_s = floor_s
        self._clock = clock
        self._watches: list[Watch] = []  # in the order they began
        self._task: asyncio.Task[None] | None = None
        self._poll: asyncio.Task[None] | None = None
        self._baseline: float | None = None  # when this run of polls began
        self._seen: dict[Key, _Seen] = {}
        self._fired_at: dict[Key, float] = {}
        self._blind = ""  # the address of a server that refuses /slots
        self.polls = 0  # /slots calls made (tests, docs/benchmarks.md)

    # ------------------------------------------------------------ the proxy's side
    def limit(self) -> float:
        """Seconds without progress that fire a request (0: the watchdog is off)."""
        limit = self._limit_s()
        return max(limit, self._floor_s()) if limit > 0 else 0.0

    def watch(self, slot: int | None) -> Watch:
        """Put a request pinned to `slot` (None: the server picks) under the watchdog."""
        w = Watch(slot, self._clock)
        self._watches.append(w)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return w

    def end(self, watch: Watch) -> None:
        """The request's exchange ended (answered, failed, fired or abandoned)."""
        with contextlib.suppress(ValueError):
            self._watches.remove(watch)
        if not self._watches:  # nothing left to watch: no tick, no poll
            self._reset()
            for task in (self._task, self._poll):
                if task is not None:
                    task.cancel()
            self._task = self._poll = None

    # ------------------------------------------------------------ the tick
    @staticmethod
    def tick_s(limit: float) -> float:
        return min(POLL_MAX_S, max(POLL_MIN_S, limit / 8))

    async def _run(self) -> None:
        while self._watches:
            limit = self.limit()
            await asyncio.sleep(self.tick_s(limit) if limit > 0 else POLL_MAX_S)
            try:
                self.tick()
            except Exception:  # the watchdog must never break a request
                log.exception("slot watchdog tick failed")

    def _reset(self) -> None:
        self._baseline = None
        self._seen.clear()

    def tick(self) -> None:
        """Poll when a request needs it, and fire what has stalled (one step; the loop in
        `_run` calls it every `tick_s`)."""
        limit = self.limit()
        now = self._clock()
        client = self._client()
        quiet_for = limit * POLL_AFTER_SHARE
        due = [w for w in self._watches if w.stall is None and now - w.last_moved >= quiet_for]
        if limit <= 0 or client is None or not due or self._blind == client.base_url:
            self._reset()
            return
        if self._baseline is None:
            self._baseline = now
        if self._poll is None or self._poll.done():
            self._poll = asyncio.ensure_future(self._read(client, limit))
        self._judge(now, limit)

    async def _read(self, client: LlamaClient, limit: float) -> None:
        self.polls += 1
        try:
            async with asyncio.timeout(limit):
                slots = await client.slots()
        except UpstreamError as e:
            if e.status in (404, 501):  # no /slots (--no-slots): nothing to judge by
                log.info("slot watchdog off for %s: GET /slots → %s", client.base_url, e)
                self._blind = client.base_url
                self._reset()
            return  # no answer: nothing moved that we could see
        except (TimeoutError, ValueError, KeyError, TypeError):
            return
        self._saw(slots, self._clock())

    def _saw(self, slots: Sequence[SlotInfo], now: float) -> None:
        """Note one answer of ``/slots``: a slot idle or whose counters changed moved."""
        views: list[tuple[Key, tuple[int, ...], bool, str]] = [
            (s.id, s.progress, s.is_processing, _describe(s)) for s in slots
        ]
        busy = [s for s in slots if s.is_processing]
        every = tuple(n for s in busy for n in (s.id, *s.progress))
        views.append((None, every, bool(busy), "; ".join(_describe(s) for s in busy)))
        for key, counters, processing, what in views:
            old = self._seen.get(key)
            if not processing or old is None or old.key != counters:
                self._seen[key] = _Seen(counters, now, what)
            if not processing:
                self._seen[key].what = "idle"

    def _judge(self, now: float, limit: float) -> None:
        assert self._baseline is not None
        for key in {w.slot for w in self._watches}:
            oldest = next((w for w in self._watches if w.slot == key and w.stall is None), None)
            if oldest is None:
                continue
            seen = self._seen.get(key)
            since = max(
                oldest.started,
                oldest.last_moved,
                self._baseline,
                seen.since if seen is not None else self._baseline,
                self._fired_at.get(key, self._baseline),
            )
            if now - since < limit:
                continue
            what = seen.what if seen is not None else "GET /slots did not answer"
            stall = Stall(key, now - since, limit, what)
            log.warning("%s", stall.text())
            self._fired_at[key] = now
            oldest.fire(stall)
