"""One build's compile, in a temp dir under the builds dir: a fresh copy of the source,
the patches, cmake configure and build (llama-server, then the optional RPC worker),
the outputs staged, ``--version`` checked, ``build.json`` written and the result renamed
into the cache. `core.build.run.build` decides whether it is needed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import platform
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from core.build.log import BuildCancelled, BuildLog, ProgressTracker, run_step
from core.build.patches import apply_patches
from core.build.plan import Plan, default_jobs, low_priority_prefix
from core.build.records import LOG_NAME, MANIFEST, SCHEMA, BuildRecord
from core.build.toolchain import (
    VULKAN_COMPAT_HEADER,
    VULKAN_COMPAT_VAR,
    tool_path,
    vulkan_compat_source,
)
from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths

_TMP_PREFIX = ".tmp-"
_EXE = "llama-server.exe" if os.name == "nt" else "llama-server"
# The RPC worker built beside the server (cmake target; the binary lands next to llama-server).
RPC_SERVER = "ggml-rpc-server"
# llama.cpp's tool that prints the placement --fit would choose (lands next to llama-server).
FIT_PARAMS = "llama-fit-params"
_VERSION_TIMEOUT_S = 60.0

ProgressCallback = Callable[[BuildProgress], None]
_T = TypeVar("_T")


class BuildFailed(BuildError):
    """cmake or the compiler failed. Carries the saved log and its last lines."""

    def __init__(
        self, message: str, *, hint: str = "", log_path: Path | None = None, tail: str = ""
    ) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.tail = tail


async def in_thread(fn: Callable[[], _T]) -> _T:
    """Run blocking work in a thread; on cancellation wait for it before re-raising, so the
    caller can clean up files the thread was still writing."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


def check_cancel(cancel: asyncio.Event | None) -> None:
    """Raise BuildCancelled once `cancel` is set."""
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


def generator_args() -> list[str]:
    """cmake's generator arguments: Ninja when it is on the build's PATH, else the default."""
    # Ninja when present: its "[done/total]" status gives an exact, smooth progress bar.
    return ["-G", "Ninja"] if shutil.which("ninja", path=tool_path()) else []


def failed_log_path(paths: Paths, build_id: str) -> Path:
    """Where the log of a failed build is kept (the temp dir it was written in goes)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return paths.log_dir / "builds" / f"{stamp}-{build_id or 'unknown'}-failed.log"


async def compile_build(
    plan: Plan,
    paths: Paths,
    blog: BuildLog,
    progress: ProgressCallback,
    cancel: asyncio.Event | None,
    started: float,
) -> BuildRecord:
    """Compile `plan` into the builds dir and return its record (see the module's
    docstring); a failure keeps its log at `failed_log_path`, a cancel leaves nothing."""
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
        await in_thread(functools.partial(plan.resolved.export, src))
        check_cancel(cancel)
        if plan.patches:
            step(0.0, f"Applying {len(plan.patches)} patch(es)")
            await apply_patches(src, plan.patches, blog.note)
            check_cancel(cancel)

        generator = generator_args()
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
        configure_args = list(plan.cmake_args)
        if any(a.startswith(f"-D{VULKAN_COMPAT_VAR}=") for a in plan.cmake_args):
            # The plan names the header without a folder (the build id must not depend on
            # this temp dir); the compiler gets its path here (cmake's test compiles run
            # in other folders).
            bdir.mkdir(parents=True, exist_ok=True)
            header = bdir / VULKAN_COMPAT_HEADER
            shutil.copyfile(vulkan_compat_source(), header)
            configure_args = [a.replace(f"-include {VULKAN_COMPAT_HEADER}", f"-include {header}")
                              for a in configure_args]  # fmt: skip
            blog.note(f"Vulkan headers older than 1.3.261: pre-including {VULKAN_COMPAT_HEADER}")
        step(0.0, "Configuring (cmake)")
        rc = await run_step(
            ["cmake", "-S", str(src), "-B", str(bdir), *generator, *configure_args],
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
        check_cancel(cancel)

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

        def build_target(target: str) -> list[str]:
            return [*prefix, "cmake", "--build", str(bdir), "--target", target,
                    "--config", "Release", "-j", str(jobs)]  # fmt: skip

        rc = await run_step(
            build_target("llama-server"),
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
        check_cancel(cancel)
        built = _find_built_binary(bdir)
        if built is None:
            raise BuildFailed("The build finished but produced no llama-server binary")
        # The RPC worker is a second, optional target: only `warmslot worker` needs it, and a
        # source without it (an older llama.cpp, where it was `rpc-server`) still gives a
        # working llama-server. Its failure is logged and recorded, never fatal.
        step(99.0, f"Building the RPC worker ({RPC_SERVER})")
        rpc_rc = await run_step(
            build_target(RPC_SERVER),
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
        )
        check_cancel(cancel)
        if rpc_rc != 0:
            blog.note(f"{RPC_SERVER} was not built (exit {rpc_rc}); RPC workers need it")
        # llama-fit-params prints the placement llama-server's --fit would choose, without
        # loading the weights: `warmslot fit` shows it. Optional like the RPC worker (a
        # source before llama.cpp's fit tooling has no such target).
        step(99.0, f"Building the placement tool ({FIT_PARAMS})")
        fit_rc = await run_step(
            build_target(FIT_PARAMS),
            cwd=tmp,
            env=env,
            blog=blog,
            cancel=cancel,
        )
        check_cancel(cancel)
        if fit_rc != 0:
            blog.note(
                f"{FIT_PARAMS} was not built (exit {fit_rc}); warmslot fit parses --fit's log"
            )
        binary = await in_thread(functools.partial(_stage_outputs, built, out))
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
            "fit_params_built": fit_rc == 0,
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
        blog.keep_at(failed_log_path(paths, build_id))
        raise
    finally:
        blog.close()
        # Shielded from cancellation: a half-deleted temp dir would be swept later anyway,
        # but we want "cancel leaves nothing" to hold when the call returns.
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, tmp, True))
