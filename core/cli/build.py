"""``warmslot build`` and ``warmslot build list``: build llama-server from source.

`register` adds the subcommands to the main CLI's subparsers (``core/cli/main.py`` calls it);
the parent parser defines ``--dev-dir``. Handlers return the process exit code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from core.build import (
    BACKENDS,
    DEFAULT_SOURCE,
    BuildRecord,
    BuildRequest,
    build_sync,
    list_builds,
)
from core.build.run import BuildStopped
from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths

__all__ = ["ProgressBar", "register"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CANCELLED = 130  # the shell's convention for "ended by Ctrl-C"
_EXIT_SIGNAL_BASE = 128  # and 128 + n for "ended by signal n" (143 for SIGTERM)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``build`` (with its ``list`` subcommand) to the main CLI."""
    p = subparsers.add_parser(
        "build",
        help="build llama-server from source (cached by inputs)",
        description="Build llama-server from llama.cpp source with Warmslot's patches. "
        "The same inputs return the cached build at once.",
    )
    p.add_argument(
        "--source",
        default=DEFAULT_SOURCE,
        help="llama.cpp checkout dir, source archive (.tar.gz/.zip), archive URL, git URL, "
        f"or pypi:NAME==VERSION (default {DEFAULT_SOURCE})",
    )
    p.add_argument("--ref", help="git ref (branch, tag, commit) for a git URL or checkout")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *BACKENDS),
        help="GPU backend; auto detects CUDA, HIP, Vulkan or Metal, else CPU (default auto)",
    )
    p.add_argument(
        "--no-patches",
        dest="patches",
        action="store_false",
        help="build upstream llama.cpp without Warmslot's patches",
    )
    p.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="optimise for this CPU (GGML_NATIVE; default on)",
    )
    p.add_argument("--jobs", "-j", type=int, help="parallel compile jobs (default: all cores)")
    p.add_argument(
        "--cmake-arg",
        dest="cmake_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra cmake configure argument, e.g. -DGGML_CUDA_F16=ON (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the resulting build as JSON")
    p.set_defaults(func=_cmd_build)
    sub = p.add_subparsers(dest="build_command", metavar="{list}")
    lp = sub.add_parser("list", help="list cached builds, newest first")
    lp.add_argument("--json", action="store_true", help="print JSON")
    lp.set_defaults(func=_cmd_list)


class ProgressBar:
    """A one-line progress bar on a terminal; plain lines (every 10 %) elsewhere."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last_decile = -1
        self._last_step = ""
        self._drawn = False

    def __call__(self, ev: BuildProgress) -> None:
        if self.tty:
            self._draw(ev)
        else:
            self._plain(ev)

    def _draw(self, ev: BuildProgress) -> None:
        width = shutil.get_terminal_size((80, 24)).columns
        bar_w = 24
        filled = int(bar_w * ev.percent / 100)
        head = f"[{'#' * filled}{'-' * (bar_w - filled)}] {ev.percent:5.1f}% "
        step = ev.step[: max(0, width - len(head) - 1)]
        self.stream.write("\r" + head + step.ljust(width - len(head) - 1))
        self._drawn = True
        if ev.done:
            self.stream.write("\n")
            self._drawn = False
        self.stream.flush()

    def _plain(self, ev: BuildProgress) -> None:
        decile = int(ev.percent // 10)
        # Before compiling starts (percent 0) every step is a phase worth a line.
        if (
            ev.done
            or decile != self._last_decile
            or (ev.percent == 0 and ev.step != self._last_step)
        ):
            self.stream.write(f"{ev.percent:5.1f}% {ev.step}\n")
            self.stream.flush()
            self._last_decile = decile
            self._last_step = ev.step

    def finish(self) -> None:
        """End a half-drawn bar line (after an error or Ctrl-C)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _record_json(rec: BuildRecord) -> dict[str, object]:
    return {
        "build_id": rec.build_id,
        "binary": str(rec.binary),
        "path": str(rec.path),
        "created": rec.created,
        "duration_s": rec.duration_s,
        "backend": rec.backend,
        "native": rec.native,
        "source": rec.source,
        "source_identity": rec.source_identity,
        "llama_cpp_version": rec.llama_cpp_version,
        "build_number": rec.build_number,
        "patches": list(rec.patches),
        "cmake_args": list(rec.cmake_args),
        "cached": rec.cached,
    }


def doctor_lines(paths: Paths, binary: Path | None) -> list[str]:
    """What `warmslot doctor` says about backends: the chosen binary's (when it is one of
    Warmslot's builds) and why, and what a new build on this machine would use."""
    from core.build.toolchain import detect_backend

    lines: list[str] = []
    rec = next((r for r in list_builds(paths) if binary is not None and r.binary == binary), None)
    if rec is not None:
        why = f" ({rec.backend_reason})" if rec.backend_reason else ""
        lines.append(f"backend:     {rec.backend} build {rec.build_id}{why}")
    elif binary is not None:
        lines.append("backend:     not one of Warmslot's builds: see its --list-devices")
    choice = detect_backend()
    lines.append(f"  a new build here: {choice.backend} ({choice.reason})")
    return lines


def _cmd_build(args: argparse.Namespace) -> int:
    paths = Paths.default(getattr(args, "dev_dir", None))
    request = BuildRequest(
        source=args.source,
        ref=args.ref,
        backend=args.backend,
        native=args.native,
        patches=args.patches,
        extra_cmake_args=tuple(args.cmake_args),
        jobs=args.jobs,
    )
    bar = ProgressBar()
    started = time.monotonic()
    try:
        rec = build_sync(request, paths, on_progress=bar)
    except KeyboardInterrupt:
        bar.finish()
        print("Build cancelled; nothing was left in the build cache.", file=sys.stderr)
        return EXIT_CANCELLED
    except BuildStopped as e:
        bar.finish()
        print(f"{e}; nothing was left in the build cache.", file=sys.stderr)
        return _EXIT_SIGNAL_BASE + e.signum
    except BuildError as e:
        bar.finish()
        print(f"error: {e.user_message()}", file=sys.stderr)
        return EXIT_FAILED
    bar.finish()
    if args.json:
        print(json.dumps(_record_json(rec), indent=2))
        return EXIT_OK
    took = time.monotonic() - started
    how = "cached build" if rec.cached else f"built in {took:.0f} s"
    print(
        f"llama-server {rec.llama_cpp_version} ({rec.backend}, {how}, id {rec.build_id})",
        file=sys.stderr,
    )
    print(rec.binary)
    return EXIT_OK


def _cmd_list(args: argparse.Namespace) -> int:
    paths = Paths.default(getattr(args, "dev_dir", None))
    builds = list_builds(paths)
    if args.json:
        print(json.dumps([_record_json(r) for r in builds], indent=2))
        return EXIT_OK
    if not builds:
        print(f"No builds in {paths.builds_dir}. Run `warmslot build`.", file=sys.stderr)
        return EXIT_OK
    print(
        f"{'ID':16}  {'CREATED':16}  {'BACKEND':7}  {'NATIVE':6}  {'PATCHES':7}  VERSION / SOURCE"
    )
    for r in builds:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        print(
            f"{r.build_id:16}  {created:16}  {r.backend:7}  {'yes' if r.native else 'no':6}  "
            f"{len(r.patches):7}  {r.llama_cpp_version} / {r.source}"
        )
    return EXIT_OK
