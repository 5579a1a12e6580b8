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

The binary is linked statically against llama/ggml (``-DBUILD_SHARED_LIBS=OFF``): the result
is one relocatable file that can be renamed into the cache and run from there without an
rpath pointing into a build tree that no longer exists.

Progress goes to an ``on_progress`` callback as `BuildProgress` events (on the event-loop
thread), cancellation through an `asyncio.Event` (or cancelling the task): cmake runs in
its own session and the whole session is killed (`core.server.process`), the temp dir
removed. `build_sync` (the CLI) turns SIGINT, SIGTERM and SIGHUP into that cancellation:
without it a signal ended Python at once and left cmake and ninja compiling, orphaned,
in a temp dir that only the next build would sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import platform
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from core.build.log import BuildCancelled, BuildLog, ProgressTracker, estimate_eta, run_step
from core.build.patches import apply_patches
from core.build.plan import BuildRequest, Plan, default_jobs, low_priority_prefix, make_plan
from core.build.records import LOG_NAME, MANIFEST, SCHEMA, BuildRecord, latest_build
from core.build.toolchain import tool_path
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

_TMP_PREFIX = ".tmp-"
_EXE = "llama-server.exe" if os.name == "nt" else "llama-server"
# The RPC worker built beside the server (cmake target; the binary lands next to llama-server).
RPC_SERVER = "ggml-rpc-server"
_VERSION_TIMEOUT_S = 60.0

ProgressCallback = Callable[[BuildProgress], None]
RecordHook = Callable[[dict[str, Any]], None]
_T = TypeVar("_T")


class BuildFailed(BuildError):
    """cmake or the compiler failed. Carries the saved log and its last lines."""

    def __init__(
        self, message: str, *, hint: str = "", log_path: Path | None = None, tail: str = ""
    ) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.tail = tail


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


async def _in_thread(fn: Callable[[], _T]) -> _T:
    """Run blocking work in a thread; on cancellation wait for it before re-raising, so the
    caller can clean up files the thread was still writing."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


def _check_cancel(cancel: asyncio.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise BuildCancelled("Build cancelled")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours (EPERM), or Windows quirks: leave it alone
        return True
    return True


def _sweep_stale_temps(builds_dir: Path) -> None:
    """Remove temp dirs of builds whose process died (kill -9, power loss)."""
    with contextlib.suppress(OSError):
        for d in builds_dir.iterdir():
            m = re.match(re.escape(_TMP_PREFIX) + r"[0-9a-f]+-(\d+)-", d.name)
            if m and d.is_dir() and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)


def _find_built_binary(build_dir: Path) -> Path | None:
    for cand in (build_dir / "bin" / _EXE, build_dir / "bin" / "Release" / _EXE):
        if cand.is_file():
            return cand
    return None


def _stage_outputs(binary: Path, out: Path) -> Path:
    """Copy the built bin/ folder (the binary plus any shared libraries) into `out`/bin."""
    dest = out / "bin"
    dest.mkdir(parents=True, exist_ok=True)
    for f in binary.parent.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    return dest / binary.name


async def _probe_version(binary: Path, blog: BuildLog) -> str:
    """Run ``llama-server --version``: proves the binary starts, and gives its version."""
    blog.note(f"$ {binary} --version")
    try:
        proc = await asyncio.create_subprocess_exec(
            str(binary),
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), _VERSION_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        raise BuildFailed(f"The built llama-server does not run: {e}") from e
    text = out.decode("utf-8", "replace")
    for line in text.splitlines():
        blog.write(line)
    if proc.returncode != 0:
        raise BuildFailed(
            f"The built llama-server exited with {proc.returncode} on --version",
            tail=text[-2000:],
        )
    m = re.search(r"^version:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else text.strip().splitlines()[0] if text.strip() else ""


def _generator_args() -> list[str]:
    # Ninja when present: its "[done/total]" status gives an exact, smooth progress bar.
    return ["-G", "Ninja"] if shutil.which("ninja", path=tool_path()) else []


def _failed_log_path(paths: Paths, build_id: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return paths.log_dir / "builds" / f"{stamp}-{build_id or 'unknown'}-failed.log"


async def _compile(
    plan: Plan,
    paths: Paths,
    blog: BuildLog,
    progress: ProgressCallback,
    cancel: asyncio.Event | None,
    started: float,
) -> BuildRecord:
    builds_dir = paths.builds_dir
    build_id = plan.build_id
    req = plan.request
    _sweep_stale_temps(builds_dir)
    tmp = builds_dir / f"{_TMP_PREFIX}{build_id}-{os.getpid()}-{secrets.token_hex(3)}"
    out = tmp / "out"
    src = tmp / "src"
    bdir = tmp / "build"

    def step(percent: float, text: str) -> None:
        blog.note(text)
        progress(BuildProgress(build_id=build_id, percent=percent, step=text))

    try:
        out.mkdir(parents=True)
        blog.open(out / LOG_NAME)
        step(0.0, "Preparing a fresh copy of the source")
        await _in_thread(functools.partial(plan.resolved.export, src))
        _check_cancel(cancel)
        if plan.patches:
            step(0.0, f"Applying {len(plan.patches)} patch(es)")
            await apply_patches(src, plan.patches, blog.note)
            _check_cancel(cancel)

        generator = _generator_args()
        env = dict(plan.env)
        env["PATH"] = tool_path(env)
        # Ninja's progress format is what the parser reads; a user's NINJA_STATUS would hide it.
        env["NINJA_STATUS"] = "[%f/%t] "
        # llama.cpp's cmake asks git for the commit and count of the source dir; our copy has
        # no .git, and git must not climb into a repo that happens to contain the builds dir.
        env["GIT_CEILING_DIRECTORIES"] = str(tmp)
        # ggml uses ccache when it is installed; each build works in a fresh temp dir, so
        # paths are made relative to it, or a rebuild (one patch changed) would miss.
        env.setdefault("CCACHE_BASEDIR", str(tmp))
        env.setdefault("CCACHE_NOHASHDIR", "1")
        step(0.0, "Configuring (cmake)")
        rc = await run_step(
            ["cmake", "-S", str(src), "-B", str(bdir), *generator, *plan.cmake_args],
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
        )
        if rc != 0:
            raise BuildFailed(
                f"cmake configure failed (exit {rc})",
                hint="See the log; a missing toolkit or library is the usual cause.",
            )
        _check_cancel(cancel)

        jobs = req.jobs or default_jobs(req.background)
        prefix = low_priority_prefix() if req.background else []
        tracker = ProgressTracker()
        step(0.0, f"Building llama-server ({jobs} jobs)")

        def on_line(line: str) -> None:
            moved = tracker.feed(line)
            if moved is not None:
                # The last percent is kept for "linking / checking" after the compile.
                progress(
                    BuildProgress(
                        build_id=build_id,
                        percent=min(moved.percent, 99.0),
                        step=moved.step,
                        steps_done=moved.done,
                        steps_total=moved.total,
                    )
                )

        rc = await run_step(
            [
                *prefix,
                "cmake",
                "--build",
                str(bdir),
                "--target",
                "llama-server",
                "--config",
                "Release",
                "-j",
                str(jobs),
            ],
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
            on_line=on_line,
        )
        if rc != 0:
            raise BuildFailed(
                f"Compiling llama-server failed (exit {rc})",
                hint="See the log; if a patch is involved try --no-patches.",
            )
        _check_cancel(cancel)
        built = _find_built_binary(bdir)
        if built is None:
            raise BuildFailed("The build finished but produced no llama-server binary")
        # The RPC worker is a second, optional target: only `warmslot worker` needs it, and a
        # source without it (an older llama.cpp, where it was `rpc-server`) still gives a
        # working llama-server. Its failure is logged and recorded, never fatal.
        step(99.0, f"Building the RPC worker ({RPC_SERVER})")
        rpc_rc = await run_step(
            [*prefix, "cmake", "--build", str(bdir), "--target", RPC_SERVER,
             "--config", "Release", "-j", str(jobs)],
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
        )
        _check_cancel(cancel)
        if rpc_rc != 0:
            blog.note(f"{RPC_SERVER} was not built (exit {rpc_rc}); RPC workers need it")
        binary = await _in_thread(functools.partial(_stage_outputs, built, out))
        step(99.0, "Checking the binary (--version)")
        version = await _probe_version(binary, blog)
        duration = time.monotonic() - started
        created = time.time()
        manifest = {
            "schema": SCHEMA,
            "build_id": build_id,
            "build_hash": plan.build_hash,
            "created": created,
            "created_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(created)),
            "duration_s": round(duration, 3),
            "binary": binary.relative_to(out).as_posix(),
            "rpc_server_built": rpc_rc == 0,
            "log": LOG_NAME,
            "llama_cpp_version": version,
            "build_number": plan.resolved.build_number,
            "commit": plan.resolved.commit,
            "source": {
                "spec": str(plan.resolved.source),
                "kind": plan.resolved.source.kind,
                "identity": plan.resolved.identity,
                "description": plan.resolved.description,
            },
            "backend": plan.backend.backend,
            "backend_reason": plan.backend.reason,
            "native": req.native,
            "patches_enabled": req.patches,
            "patches": [{"name": p.name, "sha256": p.sha256} for p in plan.patches],
            "cmake_args": plan.cmake_args,
            "generator": generator[1] if generator else "default",
            "jobs": jobs,
            "cpu_count": os.cpu_count(),
            "background": req.background,
            "toolchain": plan.toolchain,
            "platform": f"{platform.system()} {platform.machine()}",
        }
        blog.note(f"Build {build_id} done in {duration:.1f} s: {version}")
        blog.close()
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
        final = builds_dir / build_id
        try:
            os.rename(out, final)
        except OSError:
            # Another process finished the same build first: its result is identical.
            if BuildRecord.load(final) is None:
                raise
        rec = BuildRecord.load(final)
        if rec is None:
            raise BuildFailed(f"Build {build_id} finished but its cache entry is unreadable")
        return rec
    except BuildCancelled:
        raise
    except BuildError:
        # Save the log before the temp dir (where it lives) goes.
        blog.keep_at(_failed_log_path(paths, build_id))
        raise
    finally:
        blog.close()
        # Shielded from cancellation: a half-deleted temp dir would be swept later anyway,
        # but we want "cancel leaves nothing" to hold when the call returns.
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, tmp, True))


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
    state: dict[str, Any] = {"build_id": "", "percent": 0.0}
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
        plan = await _in_thread(lambda: make_plan(request, paths, emit_from_thread))
        state["build_id"] = plan.build_id
        cached = BuildRecord.load(paths.builds_dir / plan.build_id)
        if cached is not None:
            outcome = "cached"
            result = replace(cached, cached=True)
        else:
            _check_cancel(cancel)
            result = await _compile(plan, paths, blog, progress, cancel, started)
            outcome = "built"
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
        log_path = blog.keep_at(failed or _failed_log_path(paths, state["build_id"]))
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
    payload: dict[str, Any] = {
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
