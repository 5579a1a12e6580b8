"""A real llama-server built for another CPU is rejected, by any machine's tests.

The session's llama-server (the prebuilt package or the one built for this CPU) is run
under user-mode emulation of an older CPU without AVX (QEMU's "Nehalem" model): exactly
what a stranger's machine does to a binary built for a newer one. It answers
``--version`` — which is all discovery used to ask — and dies with SIGILL at start-up;
the smoke start must say so in words.
"""

from __future__ import annotations

import platform
import shutil
import stat
from pathlib import Path

import pytest

from core.paths import Paths
from core.server import discover, validate

QEMU = shutil.which("qemu-x86_64")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        platform.machine() != "x86_64" or QEMU is None,
        reason="needs qemu-x86_64 (Debian: qemu-user; scripts/test installs it) on x86_64",
    ),
]

OLD_CPU = validate.CpuInfo(model="QEMU Nehalem", flags=frozenset({"sse4_2", "popcnt"}))


def test_a_binary_for_a_newer_cpu_answers_version_but_fails_its_smoke_start(
    tmp_path: Path, server_binary: Path
) -> None:
    real = server_binary
    wrapper = tmp_path / "old-cpu" / "llama-server"
    wrapper.parent.mkdir()
    env_line = ""
    if real.parent.name == "bin" and any(real.parent.glob("*.so*")):  # the package's libs
        env_line = (
            f'export LD_LIBRARY_PATH="{real.parent}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\n'
        )
    wrapper.write_text(f'#!/bin/sh\n{env_line}exec "{QEMU}" -cpu Nehalem "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)

    answered = discover.probe(wrapper, "configured")  # --version alone is fooled
    assert answered.version and answered.identity

    paths = Paths.under(tmp_path / "home")
    verdict = validate.check_binary(paths, wrapper, answered.identity, cpu=OLD_CPU)
    assert not verdict.ok
    assert verdict.signal == 4  # SIGILL
    assert verdict.reason.startswith("this llama-server uses CPU instructions this processor lacks")
    assert "QEMU Nehalem — no AVX2, no AVX-512, no AMX" in verdict.reason

    # Discovery skips it for a binary that works, and says why.
    result = discover.discover(paths, str(wrapper))
    assert result.found is not None and result.found.path != wrapper
    (pinned,) = [c for c in result.candidates if c.source == "configured"]
    assert not pinned.ok and "lacks" in pinned.reason
