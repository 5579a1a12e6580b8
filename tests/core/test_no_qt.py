"""The headless core never loads Qt: checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO

PROBE = """
import importlib, json, pkgutil, sys
import core
import core.engine, core.cli.main, core.proxy.app
core.cli.main.build_parser()  # also imports the optional commands (fit, build, bench)
for info in pkgutil.walk_packages(core.__path__, "core."):
    importlib.import_module(info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("PySide6", "shiboken6", "app"))
print(json.dumps({"bad": bad, "core": sorted(m for m in sys.modules if m.startswith("core."))}))
"""


def test_importing_core_loads_no_pyside6() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bad"] == []
    # The probe really imported the modules it should have.
    assert {"core.engine", "core.cli.main", "core.proxy.app", "core.server.supervisor"} <= set(
        result["core"]
    )


def test_pyside6_is_installed_so_the_check_means_something() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import PySide6; print(PySide6.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
