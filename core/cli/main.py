"""`warmslot`: the headless command line.

serve · status · doctor · config path|show|set — plus `fit`, `build`, `models`,
`explain`, `clients` and `bench` registered by their own modules.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from core import config as config_mod
from core import fmt
from core.cache.crowding import crowding
from core.errors import ConfigError, WarmslotError
from core.local_api import STOPPING_WAIT_S, local_request, running_instance, wait_for_exit
from core.logs import setup_logging
from core.paths import Paths
from core.status import Status, cache_of
from core.status import from_json as status_from_json

__version__ = "0.1.0"
# Subcommands that live in their own modules; each has `register(subparsers)`.
_COMMAND_MODULES = (
    "core.cli.fit",
    "core.cli.build",
    "core.cli.models",
    "core.cli.worker",
    "core.cli.explain",
    "core.cli.keys",
    "core.bench.cli",
)


def _paths(args: argparse.Namespace) -> Paths:
    return Paths.default(getattr(args, "dev_dir", None))


# ------------------------------------------------------------------ serve
def cmd_serve(args: argparse.Namespace) -> int:
    from core.engine import Core
    from core.events import BuildProgress, Notice, ServerStateChanged

    paths = _paths(args)
    paths.ensure()
    setup_logging(paths, args.verbose)
    try:
        _wait_for_stopping_instance(paths)
    except KeyboardInterrupt:
        print("warmslot: not started", file=sys.stderr)
        return 130
    config_mod.ensure_file(paths.config_file)
    settings = config_mod.load(paths.config_file)
    if args.port is not None:
        settings = settings.replace("proxy.port", args.port)
    core = Core(paths, settings, policy_factory=_policy_factory())
    done = threading.Event()

    def on_state(event: Any) -> None:
        if isinstance(event, ServerStateChanged) and event.state == "ready":
            print(
                f"warmslot: ready — point your client at http://{settings.proxy.host}:"
                f"{core.proxy.port if core.proxy else settings.proxy.port}/v1",
                file=sys.stderr,
                flush=True,
            )

    core.subscribe(on_state, (ServerStateChanged,))
    core.subscribe(_BuildPrinter(), (BuildProgress,))
    core.subscribe(_print_notice, (Notice,))
    core.start(start_server=False)
    prev = {
        sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    fut = core.start_server()
    outcome: dict[str, int] = {}

    def on_start(f: Any) -> None:
        if _report_start(f):
            # Nothing will fix itself (no binary, no compiler, a model that does not
            # load): answering 503 for ever would hide that. Say so and exit.
            outcome["code"] = 1
            done.set()

    fut.add_done_callback(on_start)
    try:
        done.wait()
    finally:
        print("warmslot: shutting down…", file=sys.stderr, flush=True)
        core.stop()
        for sig, handler in prev.items():
            signal.signal(sig, handler)
    return outcome.get("code", 0)


def _wait_for_stopping_instance(paths: Paths) -> None:
    """A Warmslot still stopping on these folders (the tray or a `serve` that was just
    told to quit) holds the proxy port until its sessions are saved: wait for it to
    exit, then start, instead of failing on the port."""
    other = running_instance(paths)
    if other is None or not other.stopping:
        return
    print(
        f"warmslot: the Warmslot that ran here (pid {other.pid}) is still stopping; "
        "starting once it has exited",
        file=sys.stderr,
        flush=True,
    )
    if not wait_for_exit(other, STOPPING_WAIT_S):
        print(
            f"warmslot: pid {other.pid} still runs after {STOPPING_WAIT_S:.0f} s; starting anyway",
            file=sys.stderr,
            flush=True,
        )


def _print_notice(ev: Any) -> None:
    """What the core wants a user to know (a build starting, a switch-over …)."""
    if ev.level in ("warning", "info"):  # errors arrive through the start future
        hint = f" ({ev.hint})" if ev.hint else ""
        print(f"warmslot: {ev.text}{hint}", file=sys.stderr, flush=True)


class _BuildPrinter:
    """Prints a build's progress on stderr: a line per 5 % or per minute, and the end."""

    def __init__(self) -> None:
        self._shown = -100.0
        self._at = 0.0

    def __call__(self, ev: Any) -> None:
        if ev.done:
            print(
                f"warmslot: build {'finished' if ev.ok else 'stopped'}: {ev.step}", file=sys.stderr
            )
        elif ev.percent >= self._shown + 5 or ev.elapsed_s >= self._at + 60:
            self._shown, self._at = ev.percent, ev.elapsed_s
            print(f"warmslot: {ev.describe()}", file=sys.stderr, flush=True)


def _report_start(fut: Any) -> bool:
    """Print why llama-server did not start; True when it failed (not cancelled)."""
    if fut.cancelled():
        return False
    exc = fut.exception()
    if exc is None:
        return False
    text = exc.user_message() if isinstance(exc, WarmslotError) else repr(exc)
    print(f"warmslot: llama-server did not start: {text}", file=sys.stderr, flush=True)
    print("warmslot: `warmslot doctor` shows what was tried.", file=sys.stderr, flush=True)
    return True


def _policy_factory() -> Any:
    """The prefix-cache manager (imported here: `serve` is the only command needing it)."""
    from core.cache.manager import policy_factory

    return policy_factory


# ------------------------------------------------------------------ status
def fetch_status(paths: Paths, timeout: float = 5.0) -> Status | None:
    """The running instance's /warmslot/status, or None when none is running."""
    req = local_request(paths, "/warmslot/status")
    if req is None:
        return None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return status_from_json(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.1f} %"


def format_status(st: Status) -> str:
    """`warmslot status` in words."""
    srv = st["server"]
    lines = [
        f"Warmslot  proxy {st['warmslot']['proxy']}  (pid {st['warmslot']['pid']})",
        f"llama-server: {srv['state']}" + (f" — {srv['reason']}" if srv["reason"] else ""),
    ]
    if (build := st["build"]) is not None:
        lines.append(f"  build   {build.get('text') or build['purpose'] or 'starting'}")
    if (b := srv["binary"]) is not None:
        lines.append(
            f"  binary  {b['path']} ({b['source']}, {b['version']}, commit {b['commit'] or '?'})"
        )
    if (m := srv["model"]) is not None:
        lines.append(f"  model   {m['path']}")
    if srv["port"]:
        lines.append(
            f"  port    {srv['port']}  pid {srv['pid']}  restarts {srv['restarts']}"
            + ("  --no-repack" if srv["no_repack"] else "")
        )
    if (workers := st["workers"]) is not None:
        from core.server.rpc import worker_lines

        lines += worker_lines(workers)
    if (backends := st.get("backends")) is not None:
        from core.models.backends import backend_lines

        lines += backend_lines(backends)
    if "model_calls" in st:  # with [[models]] profiles: a line per model's server
        from core.models.servers import server_lines

        lines += server_lines("models:", st["models"])
    for label, t in (("all time", st["totals"]), ("last hour", st["last_hour"])):
        if t is not None:
            priced = [m for m in t.get("by_model", []) if m["cold_rate"]["ms_per_token"]]
            rates = ", ".join(
                f"{m['model'] or 'earlier requests'} {m['cold_rate']['ms_per_token']:.1f}"
                for m in priced
            )
            lines.append(
                f"{label:>9}: {t['requests']} requests, {t['cached_tokens']} cached / "
                f"{t['prompt_tokens']} new prompt tokens, hit {_pct(t['hit_ratio'])}, "
                f"~{t['seconds_saved']:.1f} s of prefill saved"
                + (
                    f" (each model at its cold rate, ms/token: {rates})"
                    if priced
                    else " (no cold prefill measured yet)"
                )
            )
    if st["clients"]:
        lines.append("clients:")
        for c in st["clients"]:
            lines.append(f"  {c['client']:<16} {c['requests']:>6} req  hit {_pct(c['hit_ratio'])}")
    users = st.get("users") or []
    if any(u["user"] for u in users):  # API keys per user
        lines.append("users (all time):")
        for u in users:
            lines.append(
                f"  {u['user'] or '(no key)':<16} {u['requests']:>6} req  "
                f"{u['cached_tokens']} cached / {u['prompt_tokens']} new tokens  "
                f"hit {_pct(u['hit_ratio'])}  prefill {u['prefill_s']:.1f} s"
            )
    cache = cache_of(st)
    if warning := crowding(st["sessions"], cache, time.time()):
        lines.append(f"warning: {warning}")
    if st["sessions"]:
        lines.append("sessions (last hour):")
        for r in st["sessions"][:10]:
            lines.append(
                f"  {r['client']:<16} {(r['session'] or '(none)')[:28]:<28} {r['requests']:>5} req"
                f"  hit {_pct(r['hit_ratio'])}  slot {r['slot']}  {r['kinds'] or ''}"
            )
    if cache is not None and cache["text"]:
        lines.append(cache["text"])
    if st["recent_requests"]:
        lines.append("recent requests:")
        for q in st["recent_requests"][:5]:
            lines.append(
                f"  {q['endpoint']:<11} {q['status']} slot {q['slot']} cache_n "
                f"{q['cache_n']} prompt_n {q['prompt_n']} "
                f"{(q['total_ms'] or 0):.0f} ms {q['client']}"
            )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    st = fetch_status(_paths(args))
    if st is None:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print("Warmslot is not running (start it with `warmslot serve` or the tray).")
        return 3
    if args.json:
        print(json.dumps({"running": True, **st}, indent=2, default=str))
    else:
        print(format_status(st))
    return 0


# ------------------------------------------------------------------ doctor
def cmd_doctor(args: argparse.Namespace) -> int:
    from core.server import discover, model

    paths = _paths(args)
    problems = 0
    print(
        f"config file: {paths.config_file} "
        f"({'exists' if paths.config_file.exists() else 'not yet written: defaults'})"
    )
    try:
        settings = config_mod.load(paths.config_file)
        print("settings:    valid")
    except WarmslotError as e:
        print(f"settings:    INVALID — {e.user_message()}")
        return 1
    from core.build import check_toolchain
    from core.server.validate import cpu_info

    print(f"cpu:         {cpu_info().summary()}")
    print("llama-server candidates (each smoke-started once per binary and CPU):")
    found = discover.discover(paths, settings.server.binary, check_all=True)
    for c in found.candidates:
        mark = "✔" if c.ok else "✘"
        chosen = found.found is not None and c.path == found.found.path and c.ok
        print(f"  {'→' if chosen else ' '}{mark} {c.source:<12} {c.path or '-'}")
        print(f"      {c.reason}")
    from core.cli.build import doctor_lines as backend_lines

    for line in backend_lines(paths, found.found.path if found.found else None):
        print(line)
    tools = check_toolchain()
    print(
        "build tools: "
        + ("✔ compiler and cmake found" if tools.ok else f"✘ {', '.join(tools.problems)}")
    )
    if found.found is None:
        print("  → no llama-server works here.", end=" ")
        if settings.server.build == "off":
            problems += 1
            print('server.build is "off": run `warmslot build` or set server.binary.')
        elif tools.ok:
            print("`warmslot serve` builds one for this CPU first (cached afterwards).")
        else:
            problems += 1
            print(f"Building one needs: {tools.hint}")
    elif found.found.source != "configured" and not found.found.patched:
        print(
            "  → the chosen binary lacks Warmslot's patches: sliding-window/hybrid models get "
            'no disk tier until the patched build (server.build = "auto") is done'
        )
    elif found.found.missing_patches:
        print(
            "  → the chosen build predates Warmslot's current patches (missing: "
            f"{', '.join(found.found.missing_patches)}; docs/patches.md): `warmslot build` "
            "makes one that has them"
        )
    try:
        m = model.resolve(paths, settings.server.model)
        print(f"model:       ✔ {m.path} ({m.source}, {fmt.size(m.size)})")
        from core.cli.fit import doctor_lines as fit_lines

        for line in fit_lines(settings, m.path, paths):  # slots and context, and why
            print(line)
    except WarmslotError as e:
        problems += 1
        print(f"model:       ✘ {e.user_message()}")
    from core.machine.syslibs import check_tray_libraries

    if settings.workers:
        problems += _doctor_workers(settings, found.found.path if found.found else None)
    libs = check_tray_libraries()
    if libs.checked:  # informational: `serve` runs without them, only the tray needs them
        print(f"tray (X11):  {'✔' if libs.ok else '✘'} {libs.message()}")
    st = fetch_status(paths)
    print(f"running:     {'yes, ' + st['server']['state'] if st else 'no'}")
    from core.cache.inventory import doctor_lines

    for line in doctor_lines(st):
        print(line)
    return 1 if problems else 0


def _doctor_workers(settings: config_mod.Settings, binary: Any) -> int:
    """Check each `[[workers]]` entry as a launch would; the number of problems."""
    from core.server.rpc import check_workers

    print("workers (llama.cpp RPC; no authentication: trusted networks only):")
    if binary is None:
        print("  ✘ not checked: no llama-server to run the RPC handshake with")
        return 1
    checks = check_workers(binary, settings.workers)
    for c in checks:
        print(f"  {c.summary()}")
    return sum(1 for c in checks if not c.ok)


# ------------------------------------------------------------------ config
def cmd_config(args: argparse.Namespace) -> int:
    paths = _paths(args)
    if args.action == "path":
        print(paths.config_file)
        return 0
    if args.action == "show":
        settings = config_mod.load(paths.config_file)
        if args.json:
            print(json.dumps(settings.as_dict(), indent=2))
            return 0
        for spec in config_mod.iter_specs():
            value = settings.get(spec.name)
            mark = "" if value == spec.default else "   (changed)"
            print(f"{spec.name} = {json.dumps(value)}{mark}")
            print(f"    {spec.description}")
        return 0
    # set
    if not args.key or args.value is None:
        print("usage: warmslot config set KEY VALUE", file=sys.stderr)
        return 2
    found = config_mod.SCHEMA.get(args.key)
    if found is None:
        raise ConfigError(
            "unknown setting", key=args.key, hint="`warmslot config show` lists every setting"
        )
    value = found.parse_text(args.value)
    after = config_mod.set_value(paths.config_file, args.key, value)
    st = fetch_status(paths)
    if st is None:
        note = ""
    elif found.applies is config_mod.Applies.WARMSLOT:
        note = (
            f"  (a running Warmslot, pid {st['warmslot']['pid']}, has the old value: "
            "it takes effect when Warmslot restarts)"
        )
    else:  # a running instance read the file when it started; its tray applies changes
        note = (
            f"  (a running Warmslot, pid {st['warmslot']['pid']}, has the old value until "
            f"it restarts; changed in the tray's Settings it applies {found.applies.words})"
        )
    print(f"{args.key} = {json.dumps(value)}{note}")
    for problem in after.problems:  # written; what was wrong in the file before still is
        print(f"warmslot: the settings file still has a problem: {problem.error}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="warmslot",
        description=("Keep llama-server's prompt prefix warm for local coding agents."),
    )
    p.add_argument("--version", action="version", version=f"warmslot {__version__}")
    _add_global_options(p, default=None)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run llama-server and the proxy in the foreground")
    s.add_argument("--port", type=int, help="proxy port (overrides proxy.port)")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=cmd_serve)
    s = sub.add_parser("status", help="state of the running instance")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("doctor", help="check binary, model and settings")
    s.set_defaults(func=cmd_doctor)
    s = sub.add_parser("config", help="show or change settings")
    s.add_argument("action", choices=["path", "show", "set"])
    s.add_argument("key", nargs="?")
    s.add_argument("value", nargs="?")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_config)
    for mod_name in _COMMAND_MODULES:
        importlib.import_module(mod_name).register(sub)
    _global_options_after_subcommands(p)
    return p


def _add_global_options(parser: argparse.ArgumentParser, *, default: Any) -> None:
    """The options every command takes, before or after its name."""
    parser.add_argument(
        "--dev-dir",
        default=default,
        help="keep config, data, cache and state under this folder (also: $WARMSLOT_HOME)",
    )


def _global_options_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """Accept the global options after every subcommand too (``warmslot doctor --dev-dir
    X``), at every level, including those other modules register (``build list``,
    ``bench trace``).

    A subcommand's parser writes each of its defaults over what the main parser found,
    so there the options default to `argparse.SUPPRESS` (left out unless given): an
    option given before the subcommand survives, and one given after it wins.
    """
    seen: set[int] = set()
    pending = [parser]
    while pending:
        current = pending.pop()
        for action in current._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for sub in action.choices.values():
                if id(sub) in seen:  # an alias names the same parser again
                    continue
                seen.add(id(sub))
                _add_global_options(sub, default=argparse.SUPPRESS)
                pending.append(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except WarmslotError as e:
        print(f"warmslot: {e.user_message()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `warmslot … | head`: the reader went away; exit quietly like other tools.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces the closed pipe
        return 0


if __name__ == "__main__":
    sys.exit(main())
