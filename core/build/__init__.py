"""Building llama-server from source: source → patches → cmake → cached binary.

The package, by responsibility:

* `core.build.source`: where the llama.cpp source comes from and what identifies it;
  its helpers: `core.build.source_tree` (the tree on disk: root, hash, copy, unpack),
  `core.build.source_git` (git checkouts and exports), `core.build.source_download`;
* `core.build.patches`: loading ``patches/*.patch`` and applying them with ``git apply``;
* `core.build.toolchain`: backend detection, cmake flags, the build's PATH, compilers;
* `core.build.records`: the build id, ``build.json`` records and the cache listing;
* `core.build.plan`: what to build (`BuildRequest`) and the resolved inputs of one build;
* `core.build.log`: the build log, progress parsing and running one step;
* `core.build.run`: the orchestration (`build`, `build_sync`);
* `core.build.compile`: one build's compile in its temp dir, into the cache.

Callers import from here; the names below are the public API.
"""

from core.build.log import BuildCancelled
from core.build.patches import Patch, PatchFailed, apply_patches, default_patches_dir, load_patches
from core.build.plan import BuildRequest, default_jobs, low_priority_prefix
from core.build.records import (
    BuildRecord,
    compute_build_id,
    find_cached_build,
    latest_build,
    list_builds,
)
from core.build.run import BuildFailed, build, build_sync
from core.build.source import DEFAULT_SOURCE
from core.build.toolchain import (
    BACKENDS,
    BackendChoice,
    check_toolchain,
    cmake_args,
    compiler_hint,
    detect_backend,
    tool_path,
    toolchain_versions,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_SOURCE",
    "BackendChoice",
    "BuildCancelled",
    "BuildFailed",
    "BuildRecord",
    "BuildRequest",
    "Patch",
    "PatchFailed",
    "apply_patches",
    "build",
    "build_sync",
    "check_toolchain",
    "cmake_args",
    "compiler_hint",
    "compute_build_id",
    "default_jobs",
    "default_patches_dir",
    "detect_backend",
    "find_cached_build",
    "latest_build",
    "list_builds",
    "load_patches",
    "low_priority_prefix",
    "tool_path",
    "toolchain_versions",
]
