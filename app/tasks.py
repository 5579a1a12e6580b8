"""Futures → GUI thread: how the GUI waits for the core without blocking.

Every core command returns a `concurrent.futures.Future` that completes on the
core thread. `Tasks.watch(future, on_result, on_error)` delivers the outcome on
the GUI thread through a queued Qt signal (the pattern of Anki's
``aqt/taskman.py``): the GUI thread never calls ``result()`` on a future that is
not done. Blocking work that is not the core's (starting or joining the core
thread, writing a file) runs on a small worker pool with `Tasks.run`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from app.qt import QObject, Qt, Signal, is_alive

log = logging.getLogger("warmslot.gui")

ResultCb = Callable[[Any], None]
ErrorCb = Callable[[BaseException], None]


def failed_future(exc: BaseException) -> concurrent.futures.Future[Any]:
    """A future that already holds `exc` (for commands that cannot even be submitted)."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_exception(exc)
    return fut


def done_future(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


def gather(
    futures: Mapping[str, concurrent.futures.Future[Any]],
) -> concurrent.futures.Future[dict[str, Any]]:
    """One future for many: resolves to ``{key: result or exception}`` when all are done.

    It never fails as a whole; a failed member shows up as its exception, so a view
    can draw what it got and say what it did not.
    """
    out: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
    results: dict[str, Any] = {}
    lock = threading.Lock()
    remaining = [len(futures)]
    if not futures:
        out.set_result({})
        return out

    def one_done(key: str, fut: concurrent.futures.Future[Any]) -> None:
        if fut.cancelled():
            value: Any = concurrent.futures.CancelledError()
        else:
            exc = fut.exception()
            value = exc if exc is not None else fut.result()
        with lock:
            results[key] = value
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(dict(results))

    for key, fut in futures.items():
        fut.add_done_callback(partial(one_done, key))
    return out


class Tasks(QObject):
    """Delivers future outcomes on the GUI thread; runs blocking helpers off it."""

    _done = Signal(int, object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pending: dict[int, tuple[ResultCb | None, ErrorCb | None, QObject | None]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="warmslot-gui-worker"
        )
        # Always queued: a future that is already done is still delivered later, from
        # the event loop, never inside `watch` itself.
        self._done.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def watch(
        self,
        fut: concurrent.futures.Future[Any],
        on_result: ResultCb | None = None,
        on_error: ErrorCb | None = None,
        *,
        owner: QObject | None = None,
    ) -> None:
        """Call `on_result(value)` or `on_error(exc)` on the GUI thread when `fut` is done.

        With `owner`, nothing is called once that Qt object has been deleted.
        """
        token = next(self._ids)
        with self._lock:
            self._pending[token] = (on_result, on_error, owner)
        fut.add_done_callback(lambda f: self._emit(token, f))

    def run(
        self,
        fn: Callable[[], Any],
        on_result: ResultCb | None = None,
        on_error: ErrorCb | None = None,
        *,
        owner: QObject | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Run blocking `fn` on a worker thread; deliver its outcome like `watch`."""
        fut = self._pool.submit(fn)
        self.watch(fut, on_result, on_error, owner=owner)
        return fut

    def _emit(self, token: int, fut: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the Tasks object is gone (app quitting)
            self._done.emit(token, fut)

    def _deliver(self, token: int, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            entry = self._pending.pop(token, None)
        if entry is None:
            return
        on_result, on_error, owner = entry
        if owner is not None and not is_alive(owner):
            return
        if fut.cancelled():
            exc: BaseException | None = concurrent.futures.CancelledError()
        else:
            exc = fut.exception()  # done: does not block
        try:
            if exc is not None:
                if on_error is not None:
                    on_error(exc)
                else:
                    log.warning("background task failed: %r", exc)
            elif on_result is not None:
                on_result(fut.result())
        except Exception:
            log.exception("handling a finished task failed")
            raise

    def shutdown(self) -> None:
        """Forget pending callbacks and stop the worker pool (does not wait)."""
        with self._lock:
            self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
