"""Build llama-server from source: source → patches → cmake → cached binary.

One call, `build`, does everything and is cheap when nothing changed:

1. resolve the source (`core.build.source`) to an identity (git commit, archive sha256
   or tree hash);
2. pick the backend (`detect_backend`, or the request's override) and the cmake flags;
3. hash source identity, patch names and bytes, cmake flags, compiler versions, backend and
   GGML_NATIVE into the **build id**; if ``<builds_dir>/<id>/`` holds a valid build, return it
   at once (no subprocess runs: compiler versions are cached by the compiler file's
   size and mtime);
4. otherwise export a fresh copy of the tree into a temp dir under the builds dir, apply
   ``patches/*.patch`` in name order with ``git apply``, configure with cmake, build only
   the ``llama-server`` target with all cores, check that the binary answers ``--version``,
   write ``build.json`` and rename the result into place. A failed or cancelled build
   leaves nothing in the cache (its log goes to ``<log_dir>/builds/``).
   (That compile is `core.build.compile`.)

The binary is linked statically against llama/ggml (``-DBUILD_SHARED_LIBS=OFF``): the result
is one relocatable file that can be renamed into the cache and run from there without an
rpath pointing into a build tree that no longer exists.

Progress goes to an ``on_progress`` callback as `BuildProgress` events (on the event-loop
thread), cancellation through an `asyncio.Event` (or cancelling the task): cmake runs in
its own session and the whole session is killed (`core.machine.process`), the temp dir
removed. `build_sync` (the CLI) turns SIGINT, SIGTERM and SIGHUP into that cancellation:
without it a signal ended Python at once and left cmake and ninja compiling, orphaned,
in a temp dir that only the next build would sweep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

from core.build.compile import (
    BuildFailed,
    ProgressCallback,
    check_cancel,
    compile_build,
    failed_log_path,
    in_thread,
)
from core.build.lock import build_lock
from core.build.log import BuildCancelled, BuildLog, estimate_eta
from core.build.plan import BuildRequest, Plan, default_jobs, make_plan
from core.build.records import BuildRecord, latest_build
from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths

__all__ = [
    "BuildFailed",
    "BuildStopped",
    "ProgressCallback",
    "RecordHook",
    "build",
    "build_sync",
]

log = logging.getLogger("warmslot.build")

RecordHook = Callable[[dict[str, object]], None]  # gets one build's telemetry row


class _Progress(TypedDict):
    build_id: str  # "" until the plan names it
    percent: float  # the last progress reported


class BuildStopped(BuildCancelled):
    """`build_sync` was stopped by a signal other than SIGINT (SIGTERM, SIGHUP); the build
    was cancelled cleanly. `signum` is the signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"Build stopped by {name}", hint="nothing was left in the build cache")


# Signals that cancel a `build_sync` cleanly (by name: Windows has no SIGHUP).
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


async def build(
    request: BuildRequest,
    paths: Paths,
    on_progress: ProgressCallback | None = None,
    cancel: asyncio.Event | None = None,
    record: RecordHook | None = None,
) -> BuildRecord:
    """Build llama-server for `request`, or return the cached build with the same inputs.

    `on_progress` gets `BuildProgress` events on the calling loop's thread (the last has
    ``done=True``). Setting `cancel` (or cancelling the task) kills cmake's process group
    and removes the temp dir; `BuildCancelled` is raised (or CancelledError re-raised).
    `record` (telemetry) is called once with inputs, outcome (``built``, ``cached``,
    ``failed``, ``cancelled``), duration and log path.

    Raises BuildError subclasses: `PatchFailed`, `BuildFailed` (with ``log_path`` and
    ``tail``), `BuildCancelled`; plain BuildError for source and toolchain problems.
    """
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    blog = BuildLog()
    state = _Progress(build_id="", percent=0.0)
    last = latest_build(paths.builds_dir)
    previous_s = last.duration_s if last is not None else None

    def progress(ev: BuildProgress) -> None:
        state["percent"] = ev.percent
        if on_progress is None:
            return
        elapsed = time.monotonic() - started
        ev = replace(
            ev,
            elapsed_s=round(elapsed, 1),
            eta_s=None if ev.done else estimate_eta(elapsed, ev.percent, previous_s),
            purpose=request.purpose,
            background=request.background,
        )
        try:
            on_progress(ev)
        except Exception:  # a broken subscriber must not break the build
            log.exception("build progress callback failed")

    def emit_from_thread(msg: str) -> None:
        blog.note(msg)
        loop.call_soon_threadsafe(
            progress, BuildProgress(build_id=state["build_id"], percent=0.0, step=msg)
        )

    blog.note(f"warmslot build: {request}")
    plan: Plan | None = None
    outcome = "failed"
    error = ""
    log_path: Path | None = None
    result: BuildRecord | None = None
    try:
        paths.builds_dir.mkdir(parents=True, exist_ok=True)
        plan = await in_thread(lambda: make_plan(request, paths, emit_from_thread))
        state["build_id"] = plan.build_id
        cached = BuildRecord.load(paths.builds_dir / plan.build_id)
        if cached is None:  # one build of these inputs at a time, across processes
            async with build_lock(paths.builds_dir, plan.build_id, emit_from_thread):
                cached = BuildRecord.load(paths.builds_dir / plan.build_id)
                if cached is None:
                    check_cancel(cancel)
                    result = await compile_build(plan, paths, blog, progress, cancel, started)
                    outcome = "built"
        if cached is not None:
            outcome = "cached"
            result = replace(cached, cached=True)
        assert result is not None
        log_path = result.log_path
        progress(
            BuildProgress(
                build_id=result.build_id,
                percent=100.0,
                step="Cached build" if result.cached else "Build complete",
                done=True,
                ok=True,
            )
        )
        return result
    except (BuildCancelled, asyncio.CancelledError, KeyboardInterrupt):
        outcome = "cancelled"
        progress(
            BuildProgress(
                build_id=state["build_id"],
                percent=state["percent"],
                step="Cancelled",
                done=True,
                ok=False,
            )
        )
        raise
    except BuildError as e:
        error = str(e)
        blog.note(f"FAILED: {e}")
        failed = blog.path if blog.path and blog.path.parent == paths.log_dir / "builds" else None
        log_path = blog.keep_at(failed or failed_log_path(paths, state["build_id"]))
        if isinstance(e, BuildFailed):
            e.log_path = log_path
            e.tail = e.tail or blog.tail.text(25)
            first = blog.tail.first_error
            extra = f"\n  first error: {first}" if first else ""
            e.args = (
                f"{e.args[0]}{extra}\n--- last lines of the log ---\n{e.tail}"
                f"\n--- full log: {log_path} ---",
            )
        progress(
            BuildProgress(
                build_id=state["build_id"],
                percent=state["percent"],
                step=f"Failed: {error.splitlines()[0]}",
                done=True,
                ok=False,
            )
        )
        raise
    finally:
        blog.close()
        if record is not None:
            _call_record(
                record, request, plan, outcome, time.monotonic() - started, log_path, error, result
            )


def _call_record(
    hook: RecordHook,
    request: BuildRequest,
    plan: Plan | None,
    outcome: str,
    duration: float,
    log_path: Path | None,
    error: str,
    result: BuildRecord | None,
) -> None:
    payload: dict[str, object] = {
        "build_id": plan.build_id if plan else None,
        "outcome": outcome,
        "duration_s": round(duration, 3),
        "log_path": str(log_path) if log_path else None,
        "error": error,
        "source": request.source,
        "ref": request.ref,
        "requested_backend": request.backend,
        "native": request.native,
        "patches_enabled": request.patches,
        "purpose": request.purpose,
        "background": request.background,
        "jobs": request.jobs or default_jobs(request.background),
        "cpu_count": os.cpu_count(),
    }
    if plan is not None:
        payload.update(
            source_identity=plan.resolved.identity,
            backend=plan.backend.backend,
            patches=[p.name for p in plan.patches],
            cmake_args=list(plan.cmake_args),
            toolchain=dict(plan.toolchain),
        )
    if result is not None:
        payload.update(binary=str(result.binary), llama_cpp_version=result.llama_cpp_version)
    try:
        hook(payload)
    except Exception:
        log.exception("build telemetry hook failed")


def build_sync(
    request: BuildRequest,
    paths: Paths,
    on_progress: ProgressCallback | None = None,
    record: RecordHook | None = None,
) -> BuildRecord:
    """`build` for synchronous callers (the CLI). Ctrl-C cancels the build cleanly and
    surfaces as KeyboardInterrupt; SIGTERM and SIGHUP cancel it the same way and raise
    `BuildStopped`. Either way cmake's whole session is killed and the temp dir removed
    before this returns. Only the first signal counts: a second one must not cut that
    cleanup short."""
    stopped_by: list[int] = []

    async def main() -> BuildRecord:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None

        def on_signal(signum: int) -> None:
            if not stopped_by:
                stopped_by.append(signum)
                task.cancel()

        installed = []
        for sig in _STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # Windows' loops have no signal handlers, nor does a non-main thread
            installed.append(sig)
        try:
            return await build(request, paths, on_progress, None, record)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)  # SIGINT back to KeyboardInterrupt

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        if stopped_by[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise BuildStopped(stopped_by[0]) from None
