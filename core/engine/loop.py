"""The core thread: one asyncio loop on a thread of its own (docs/architecture.md#threads).

Everything stateful runs on it; other threads hand it coroutines (`LoopThread.submit`)
and get `concurrent.futures.Future`s back, never blocking on the loop themselves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from core.errors import CoreStopped

log = logging.getLogger("warmslot.core")
T = TypeVar("T")
Stage = Callable[[], Coroutine[Any, Any, None]]


class LoopThread:
    """A daemon thread running one event loop, from a setup stage to a teardown stage."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._loop is not None and self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """True while `stop()` runs."""
        return self._stopping

    def start(self, setup: Stage, teardown: Stage, timeout: float) -> None:
        """Start the thread and run `setup` on its loop; return when it is done. When
        `setup` raises, `teardown` runs there too, the thread ends and the error is raised
        here."""
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started, setup, teardown), name=self.name, daemon=True
        )
        self._thread.start()
        try:
            started.result(timeout)
        except BaseException:
            self._thread.join(10)
            self._thread = None
            self._loop = None
            raise

    def _run(self, started: concurrent.futures.Future[None], setup: Stage, teardown: Stage) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(setup())
        except BaseException as e:
            started.set_exception(e)
            with contextlib.suppress(Exception):
                loop.run_until_complete(teardown())
            loop.close()
            return
        self._loop = loop
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop(self, teardown: Stage, timeout: float) -> None:
        """Run `teardown` on the loop (`timeout` at most), then end the loop and join the
        thread (`timeout` again). Nothing when not running or already stopping."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._stopping:
            return
        self._stopping = True
        try:
            fut = asyncio.run_coroutine_threadsafe(teardown(), loop)
            try:
                fut.result(timeout)
            except Exception:
                log.exception("shutdown did not finish cleanly")
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        finally:
            self._loop = None
            self._thread = None
            self._stopping = False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the loop; its future. Raises CoreStopped when not running."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise CoreStopped("the Warmslot core is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Call `fn(*args)` on the loop, from any thread; nothing when not running."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn, *args)
