"""`warmslot bench …`: benchmarks, registered into the main CLI by `core.cli.main`.

- ``warmslot bench overhead [--requests N] [--json] [--model PATH]``: the latency
  the proxy adds (see `core.bench.overhead`).
- ``warmslot bench trace``: an opencode-shaped trace, bare llama-server vs
  Warmslot (see `core.bench.tracebench`).
- ``warmslot bench swap``: two models under one budget, plain reload vs swap-aware
  save/restore (see `core.bench.swap`).
- ``warmslot bench restore``: cold prefill vs a verified restore at 8k / 32k / 64k
  tokens, with the disk's bandwidth (see `core.bench.restore`).
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands to the ``warmslot`` parser."""
    bench = subparsers.add_parser("bench", help="measure Warmslot (proxy overhead, traces)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "overhead",
        help="latency the proxy adds: identical requests direct vs through the proxy",
    )
    p.add_argument(
        "--requests", type=int, default=200, help="rounds per case (each side, default 200)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", help="GGUF to serve (default: the configured or demo model)")
    p.add_argument("--threads", type=int, help="llama-server threads (default: the setting)")
    p.add_argument(
        "--with-cache",
        action="store_true",
        help="attach the prefix-cache manager to the proxy (default: the plain proxy)",
    )
    p.set_defaults(func=_cmd_overhead)
    from core.bench import restore, swap, tracebench

    tracebench.add_parser(sub)
    swap.add_parser(sub)
    restore.add_parser(sub)


def _cmd_overhead(args: argparse.Namespace) -> int:
    from core import config as config_mod
    from core.bench.overhead import main_overhead
    from core.errors import ConfigError
    from core.paths import Paths
    from core.server import model as model_mod

    if args.requests < 1:
        raise ConfigError("--requests must be at least 1", key="--requests", got=args.requests)
    paths = Paths.default(getattr(args, "dev_dir", None))
    settings = config_mod.load(paths.config_file)
    # Resolve against the user's folders, so the demo model is assembled once, there.
    resolved = model_mod.resolve(paths, args.model or settings.server.model)
    threads = settings.server.threads if args.threads is None else args.threads
    return main_overhead(
        str(resolved.path),
        args.requests,
        args.json,
        binary=settings.server.binary,
        threads=threads,
        with_cache=args.with_cache,
        user=paths,
    )
