"""Smoke starts of llama-server candidates: verdicts in words, what is cached, ranking.

Fake binaries (tests/fakes) die by the signals and exit codes a real binary shows on the
wrong machine; the real prebuilt and built servers are covered by test_discover_real.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest

from core.paths import Paths
from core.server import discover, validate
from core.server.discover import ServerBinary, rank
from tests.helpers import make_fake_binary

AVX2_ONLY = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE = """\
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    validate.forget_verdicts()
    return Paths.under(tmp_path / "home")


def cpu_from(text: str, tmp_path: Path) -> validate.CpuInfo:
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    return validate.cpu_info(f)


def test_cpu_summary_names_what_the_processor_has_and_lacks(tmp_path: Path) -> None:
    amd = cpu_from(AVX2_ONLY, tmp_path)
    assert amd.summary() == "AMD EPYC 7B13 — AVX2, no AVX-512, no AMX"
    intel = cpu_from(SAPPHIRE, tmp_path)
    assert intel.summary() == (
        "Intel(R) Xeon(R) Platinum 8481C — AVX2, AVX-512, AVX-512 VNNI, AVX-512 BF16, AMX"
    )
    assert amd.key != intel.key


def test_failures_are_described_in_words(tmp_path: Path) -> None:
    cpu = cpu_from(AVX2_ONLY, tmp_path)
    ill = validate.describe_failure(code=-signal.SIGILL, last_line="x", cpu=cpu)
    assert "uses CPU instructions this processor lacks" in ill
    assert "AVX2, no AVX-512" in ill and "warmslot build" in ill
    segv = validate.describe_failure(code=-signal.SIGSEGV, last_line="repack", cpu=cpu)
    assert segv.startswith("it crashed (segmentation fault") and "repack" in segv
    lib = validate.describe_failure(
        code=127, last_line="error while loading shared libraries: libvulkan.so.1", cpu=cpu
    )
    assert lib.startswith("a shared library it needs is missing")
    assert validate.describe_failure(code=3, last_line="", cpu=cpu) == "it exited with code 3"
    slow = validate.describe_failure(code=None, last_line="", cpu=cpu, timed_out=True)
    assert slow.startswith("it did not answer within")


def launches(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_binary_that_dies_by_sigill_is_rejected_and_remembered(
    paths: Paths, tmp_path: Path
) -> None:
    log = tmp_path / "launches"
    fake = make_fake_binary(tmp_path / "ill", "--fake-mode", "die", "--fake-launch-log", str(log))
    cpu = cpu_from(AVX2_ONLY, tmp_path)
    v = validate.check_binary(paths, fake, "id-ill", cpu=cpu)
    assert not v.ok and v.signal == signal.SIGILL and not v.cached
    assert "lacks" in v.reason and "AMD EPYC 7B13" in v.reason
    # Tried once more with --no-repack (native AMX builds crash in repacking), in vain.
    assert [ln.split()[1] for ln in launches(log)] == ["no_repack=0", "no_repack=1"]
    # Deterministic: cached on disk, so a new process does not start it again.
    validate.forget_verdicts()
    again = validate.check_binary(paths, fake, "id-ill", cpu=cpu)
    assert again.cached and not again.ok and again.reason == v.reason
    assert len(launches(log)) == 2
    # Another CPU is another question.
    other = validate.check_binary(paths, fake, "id-ill", cpu=cpu_from(SAPPHIRE, tmp_path))
    assert not other.cached and len(launches(log)) == 4


def test_a_warmup_crash_that_no_repack_avoids_passes_with_the_flag(
    paths: Paths, tmp_path: Path
) -> None:
    fake = make_fake_binary(tmp_path / "amx", "--fake-mode", "crash-warmup")
    v = validate.check_binary(paths, fake, "id-amx")
    assert v.ok and v.no_repack and "--no-repack" in v.reason


def test_exit_codes_and_timeouts_are_not_cached(paths: Paths, tmp_path: Path) -> None:
    log = tmp_path / "launches"
    fake = make_fake_binary(
        tmp_path / "exit",
        "--fake-mode",
        "exit",
        "--fake-exit",
        "3",
        "--fake-launch-log",
        str(log),
    )
    v = validate.check_binary(paths, fake, "id-exit")
    assert not v.ok and v.exit_code == 3 and v.signal is None
    assert v.reason == "it exited with code 3 (last line: 0.00.000 E srv  fake: giving up)" or (
        v.reason.startswith("it exited with code 3") and "giving up" in v.reason
    )
    validate.check_binary(paths, fake, "id-exit")
    assert len(launches(log)) == 2  # checked again: a missing library can be installed
    slow = make_fake_binary(tmp_path / "slow", "--fake-mode", "slow-start")
    t = validate.smoke_start(slow, validate.smoke_model(paths), timeout=1.5)
    assert not t.ok and not t.deterministic and "did not answer" in t.reason


def test_a_working_server_passes(paths: Paths, tmp_path: Path) -> None:
    fake = make_fake_binary(tmp_path / "good")
    v = validate.check_binary(paths, fake, "id-good")
    assert v.ok and not v.no_repack and v.reason.startswith("smoke start passed")


def binary(source: str, build: int | None, patched: bool, name: str = "") -> ServerBinary:
    return ServerBinary(
        path=Path(f"/x/{name or source}"),
        source=source,
        version=str(build),
        commit="",
        identity=name or source,
        build_number=build,
        patches=("slot-api-v1", "slot-checkpoints-v1") if patched else (),
    )


def test_a_patched_build_outranks_unpatched_binaries_of_its_revision_or_older() -> None:
    path = binary("path", 11434, False)
    package = binary("package", 10434, False)
    built = binary("build-cache", 11434, True)
    assert [b.source for b in rank([path, package, built])] == ["build-cache", "path", "package"]
    newer = binary("path", 12000, False)
    assert [b.source for b in rank([newer, package, built])] == ["path", "build-cache", "package"]
    pinned = binary("configured", 9000, False)
    assert rank([pinned, path, built])[0] is pinned
    # A patched binary already first stays first.
    first = binary("path", 11434, True, "patched-path")
    assert rank([first, package])[0] is first


def test_a_higher_slot_api_level_outranks_an_older_patched_build() -> None:
    """slot-api-v2 answers a truncated slot file with a 400 where v1 aborted, so a
    v2 build goes first even when a v1 build of the same revision is newer on disk."""
    old = binary("build-cache", 11434, True, "v1-build")  # newest first: old build listed first
    new = replace(
        old,
        path=Path("/x/v2-build"),
        identity="v2-build",
        patches=("slot-api-v2", "slot-checkpoints-v1", "swa-full-state-v1"),
    )
    unpatched = binary("path", 11434, False)
    assert (old.slot_api, new.slot_api, unpatched.slot_api) == (1, 2, 0)
    assert [b.identity for b in rank([old, unpatched, new])] == ["v2-build", "v1-build", "path"]


def test_discovery_uses_the_first_candidate_that_passes(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The configured binary dies by SIGILL: the next one that works is chosen."""
    bad = make_fake_binary(tmp_path / "bad", "--fake-mode", "die")
    good = make_fake_binary(tmp_path / "good")
    monkeypatch.setenv("PATH", str(good.parent))
    monkeypatch.setattr(discover, "_package_candidate", lambda: None)
    result = discover.discover(paths, str(bad))
    assert result.found is not None and result.found.path == good
    by = {c.source: c for c in result.candidates}
    assert not by["configured"].ok and "lacks" in by["configured"].reason
    assert by["path"].ok and by["path"].checked
    with pytest.raises(Exception, match="no usable llama-server") as e:
        monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
        discover.require(paths, str(bad))
    assert "server.build" in getattr(e.value, "hint", "")
