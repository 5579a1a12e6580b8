"""Warmslot's own log: stderr and ``core.log`` in the log folder, rotated by size.

llama-server's output has its own file (`core.server.logfile`). `warmslot serve` and
the tray set this up once, at start.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys

from core.paths import Paths

__all__ = ["setup_logging"]


def setup_logging(paths: Paths, verbose: bool = False) -> None:
    """Log the ``warmslot`` loggers to stderr and ``core.log`` (DEBUG with `verbose`)."""
    root = logging.getLogger("warmslot")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    root.addHandler(console)
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    fileh = logging.handlers.RotatingFileHandler(
        paths.core_log, maxBytes=5 << 20, backupCount=3, encoding="utf-8"
    )
    fileh.setFormatter(fmt)
    root.addHandler(fileh)
