"""Getting a llama-server that works here: build one when none does, the patched one
for sliding-window models (before the start, or in the background with a switch-over).

Real builds of the small stand-in tree (tests/fixtures/fake_llama_src, compiled in a
few seconds) whose llama-server runs the fake server script, so it passes a real smoke
start; the "prebuilt" that dies by SIGILL is a fake binary too. The real llama.cpp build
is tests/integration/test_build_real.py's (opt-in) and the test session's own.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from core.build import BuildRequest
from core.config import ServerSettings
from core.engine import Core
from core.errors import BinaryNotFound, BuildError
from core.events import BuildProgress, Event, Notice, ServerStateChanged
from core.paths import Paths
from core.server import discover, validate
from core.server.provision import NO_BINARY_PURPOSE, PATCHED_PURPOSE, Provisioner
from tests.conftest import settings_for
from tests.helpers import FAKE_SERVER, EventLog, make_fake_binary, wait_until

FAKE_SRC = Path(__file__).resolve().parent.parent / "fixtures" / "fake_llama_src"

needs_toolchain = pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("cc")), reason="needs cmake and a C compiler"
)


def fake_request(*, patched: bool) -> BuildRequest:
    """Builds of the stand-in tree whose llama-server serves like the fake server."""
    extra = [f"-DFAKE_PYTHON={sys.executable}", f"-DFAKE_SCRIPT={FAKE_SERVER}"]
    if patched:
        extra += ["-DFAKE_PATCHED=ON", "-DLLAMA_BUILD_NUMBER=5"]
    return BuildRequest(
        source=str(FAKE_SRC),
        backend="cpu",
        native=False,
        patches=False,
        extra_cmake_args=tuple(extra),
    )


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    validate.forget_verdicts()
    return Paths.under(tmp_path / "home")


@pytest.fixture
def no_server_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """PATH keeps the build tools but no llama-server (the session put one there)."""
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "llama-server").exists()
    ]
    monkeypatch.setenv("PATH", os.pathsep.join(keep))


@pytest.fixture
def sigill_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The prebuilt package, as on a CPU it was not built for: it dies by SIGILL."""
    fake = make_fake_binary(tmp_path / "pkg", "--fake-mode", "die")
    monkeypatch.setattr(discover, "_package_candidate", lambda: (fake, {}))
    return fake


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


@needs_toolchain
def test_no_working_binary_builds_one_for_this_cpu_then_reuses_it(
    paths: Paths, no_server_on_path: None, sigill_package: Path, tmp_path: Path
) -> None:
    events: list[Event] = []
    prov = Provisioner(paths, events.append, request=fake_request(patched=False))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    found = run(prov.binary_for(ServerSettings(), model))
    assert isinstance(found, discover.ServerBinary) and found.source == "build-cache"
    (notice,) = [e for e in events if isinstance(e, Notice)]
    assert notice.level == "warning" and "No llama-server works on this machine" in notice.text
    assert "lacks" in notice.text  # the SIGILL verdict on the package, in words
    progress = [e for e in events if isinstance(e, BuildProgress)]
    assert progress[-1].done and progress[-1].ok
    assert {p.purpose for p in progress} == {NO_BINARY_PURPOSE}
    assert not any(p.background for p in progress)
    assert any(p.steps_total > 0 for p in progress)  # Ninja's [done/total], when present
    assert prov.status() is None  # nothing running any more
    # The next start finds it: no build, no notice.
    events.clear()
    again = run(prov.binary_for(ServerSettings(), model))
    assert isinstance(again, discover.ServerBinary) and again.path == found.path
    assert events == []


def test_build_off_says_what_was_tried_and_what_to_do(
    paths: Paths, no_server_on_path: None, sigill_package: Path, tmp_path: Path
) -> None:
    prov = Provisioner(paths, lambda e: None, request=fake_request(patched=False))
    with pytest.raises(BinaryNotFound) as e:
        run(prov.binary_for(ServerSettings(build="off"), tmp_path / "m.gguf"))
    assert "lacks" in str(e.value) and "package" in str(e.value)
    assert 'server.build = "auto"' in e.value.hint and "server.binary" in e.value.hint


def test_a_missing_compiler_is_named_before_anything_is_downloaded(
    paths: Paths, no_server_on_path: None, sigill_package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    events: list[Event] = []
    prov = Provisioner(paths, events.append, request=fake_request(patched=False))
    with pytest.raises(BuildError) as e:
        run(prov.build(NO_BINARY_PURPOSE))
    assert "no C++ compiler (/nonexistent/c++)" in str(e.value)
    assert "Install a C/C++ compiler" in e.value.hint and "server.binary" in e.value.hint
    assert not any(isinstance(ev, BuildProgress) for ev in events)
    assert not paths.builds_dir.exists() or not any(paths.builds_dir.iterdir())
    # A start says both what failed and why no build can help, without promising one.
    with pytest.raises(BuildError) as start:
        run(prov.binary_for(ServerSettings(), paths.data_dir / "m.gguf"))
    assert "no llama-server works on this machine" in str(start.value)
    assert "cannot be built here: no C++ compiler" in str(start.value)
    assert not any(isinstance(ev, Notice) for ev in events)


@needs_toolchain
def test_build_now_builds_the_patched_server_before_the_first_start(
    paths: Paths,
    no_server_on_path: None,
    tmp_path: Path,
    gemma_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock = make_fake_binary(tmp_path / "stock")
    monkeypatch.setattr(discover, "_package_candidate", lambda: (stock, {}))
    events: list[Event] = []
    prov = Provisioner(paths, events.append, request=fake_request(patched=True))
    found = run(prov.binary_for(ServerSettings(build="now"), gemma_model))
    assert isinstance(found, discover.ServerBinary)
    assert found.source == "build-cache" and found.patched
    assert {e.purpose for e in events if isinstance(e, BuildProgress)} == {PATCHED_PURPOSE}
    # A dense model needs no patch; a pinned binary is the user's choice.
    assert prov.upgrade_reason(ServerSettings(), discover.probe(stock, "package"), tmp_path) is None
    pinned = ServerSettings(binary=str(stock))
    assert prov.upgrade_reason(pinned, discover.probe(stock, "configured"), gemma_model) is None


@needs_toolchain
def test_auto_builds_the_patched_server_in_the_background_and_switches_when_quiet(
    tmp_path: Path, no_server_on_path: None, gemma_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stock server serves at once; the patched build runs at idle priority; when no
    request ran for server.switch_idle_s the server restarts on the patched binary."""
    validate.forget_verdicts()
    stock = make_fake_binary(tmp_path / "stock")
    monkeypatch.setattr(discover, "_package_candidate", lambda: (stock, {}))
    settings = settings_for(gemma_model, server__switch_idle_s=0.5)
    core = Core(Paths.under(tmp_path / "home"), settings, build_request=fake_request(patched=True))
    log = EventLog()
    core.subscribe(log.append)
    try:
        core.start(wait_ready=True, timeout=60)
        assert core.supervisor is not None and core.supervisor.resolved is not None
        assert core.supervisor.resolved.binary.path == stock
        wait_until(
            lambda: [e for e in log.of(ServerStateChanged) if e.state == "ready"][1:],
            120,
            message=lambda: str(log.states()),
        )
        resolved = core.supervisor.resolved
        assert resolved.binary.source == "build-cache" and resolved.binary.patched
        progress = log.of(BuildProgress)
        assert progress and all(p.background and p.purpose == PATCHED_PURPOSE for p in progress)
        assert progress[-1].done and progress[-1].ok
        texts = [n.text for n in log.of(Notice)]
        assert any("in the background at idle priority" in t for t in texts)
        assert any("Switching to the patched llama-server" in t for t in texts)
        reasons = [e.reason for e in log.of(ServerStateChanged) if e.state == "stopping"]
        assert any("patched llama-server" in r for r in reasons)
        rows = core.query("server_runs").result(10)
        assert len(rows) == 2
    finally:
        core.stop()


@needs_toolchain
def test_two_starts_without_a_binary_share_one_build(
    paths: Paths, no_server_on_path: None, sigill_package: Path, tmp_path: Path
) -> None:
    """Two models of a pool starting at once: the second waits for the first's build."""
    events: list[Event] = []
    prov = Provisioner(paths, events.append, request=fake_request(patched=False))

    async def both() -> list[discover.ServerBinary]:
        return list(
            await asyncio.gather(
                prov.binary_for(ServerSettings(), tmp_path / "a.gguf"),
                prov.binary_for(ServerSettings(), tmp_path / "b.gguf"),
            )
        )

    first, second = asyncio.run(both())
    assert first.path == second.path and first.source == "build-cache"
    finished = [e for e in events if isinstance(e, BuildProgress) and e.done]
    assert len(finished) == 1 and finished[0].ok


def test_a_pinned_binary_that_fails_is_reported_and_a_working_one_used(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned = make_fake_binary(tmp_path / "pinned", "--fake-mode", "die")
    good = make_fake_binary(tmp_path / "good")
    monkeypatch.setenv("PATH", str(good.parent))
    monkeypatch.setattr(discover, "_package_candidate", lambda: None)
    events: list[Event] = []
    prov = Provisioner(paths, events.append)
    found = asyncio.run(prov.binary_for(ServerSettings(binary=str(pinned)), tmp_path / "m"))
    assert found.path == good
    (notice,) = [e for e in events if isinstance(e, Notice)]
    assert notice.level == "warning" and f"server.binary {pinned} is not usable" in notice.text
    assert "lacks" in notice.text
