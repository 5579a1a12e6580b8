"""Finding GGUF model files where other tools keep them, without executing or changing anything.

`model_roots(home, env)` names the folders (per OS, from the environment variables each
tool honours); `scan(roots)` walks them. Files are only listed, stat'ed and, later, their
GGUF header read (`core.models.catalog`).

Layouts:

- **LM Studio** (``~/.lmstudio/models``, older ``~/.cache/lm-studio/models``, the
  data folder ``~/.lmstudio-home-pointer`` names, and the "Models Directory" its
  ``settings.json`` keeps as ``downloadsFolder``): ``publisher/repo/file.gguf``.
- **llama.cpp** (``$LLAMA_CACHE``, else the OS cache folder's ``llama.cpp``): the
  files ``llama-server -hf`` downloaded, flat or in folders.
- **Hugging Face** (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``):
  ``models--org--name/snapshots/<revision>/file.gguf``, symlinks into ``blobs/``;
  a file in several revisions counts once.
- **Ollama** (``$OLLAMA_MODELS``, ``~/.ollama/models``, the Linux service's
  ``/usr/share/ollama/.ollama/models``): ``manifests/<registry>/<namespace>/<model>/<tag>``
  is JSON whose layer of media type ``application/vnd.ollama.image.model`` names
  ``blobs/sha256-<hex>``, a GGUF file. Named ``model:tag`` like ``ollama list``.
- Warmslot's own ``data/models`` folder, the configured ``server.model`` and any
  folder the user adds (``server.model_dirs``): plain folders.

A split model (``name-00001-of-00003.gguf``) counts once, by its first part, with
the size of all parts. Vision projectors (``mmproj*.gguf``) are not models.

Scanning is bounded: folders at most `MAX_DEPTH` deep, at most `MAX_ENTRIES`
directory entries and `TIME_BUDGET_S` seconds in all (the result says when it
stopped early), and a folder reached twice through symlinks is walked once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "TIME_BUDGET_S",
    "Found",
    "Root",
    "model_roots",
    "one_file",
    "scan",
]

MAX_DEPTH = 6
MAX_ENTRIES = 50_000
TIME_BUDGET_S = 10.0
MAX_MANIFEST_BYTES = 1 << 20
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"

_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)


@dataclass(frozen=True)
class Root:
    """A folder to look in, and how it is laid out ("tree", "hf" or "ollama")."""

    source: str
    path: Path
    layout: str = "tree"


@dataclass(frozen=True)
class Found:
    """A GGUF model file found by `scan` (the first part of a split model)."""

    path: Path
    name: str
    source: str
    size: int  # all parts
    parts: int = 1
    aliases: tuple[str, ...] = ()  # other names for the same file (Ollama tags)
    error: str = ""


# ------------------------------------------------------------------ where to look
def _cache_home(home: Path, env: Mapping[str, str], platform: str) -> Path:
    if platform == "darwin":
        return home / "Library" / "Caches"
    if platform == "win32":
        local = env.get("LOCALAPPDATA")
        return Path(local) if local else home / "AppData" / "Local"
    xdg = env.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else home / ".cache"


def _small_text(path: Path, limit: int = MAX_MANIFEST_BYTES) -> str:
    """A small text file's contents; "" when missing, unreadable or too big."""
    try:
        if path.stat().st_size > limit:
            return ""
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _lmstudio_model_dirs(home: Path) -> list[Path]:
    """LM Studio's model folders: ``<data dir>/models`` and the folder its settings name.

    The data dir is ``~/.lmstudio`` (older: ``~/.cache/lm-studio``) unless
    ``~/.lmstudio-home-pointer`` names another; "Models Directory" in LM Studio's
    settings is ``downloadsFolder`` in the data dir's ``settings.json``.
    """
    data_dirs = [home / ".lmstudio", home / ".cache" / "lm-studio"]
    pointer = _small_text(home / ".lmstudio-home-pointer").strip()
    if pointer:
        data_dirs.insert(0, Path(pointer).expanduser())
    out: list[Path] = []
    for d in data_dirs:
        out.append(d / "models")
        try:
            chosen = json.loads(_small_text(d / "settings.json") or "{}").get("downloadsFolder")
        except (ValueError, AttributeError):
            chosen = None
        if isinstance(chosen, str) and chosen.strip():
            out.append(Path(chosen).expanduser())
    return out


def model_roots(
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    platform: str = sys.platform,
    models_dir: Path | None = None,
    extra_dirs: Iterable[str | Path] = (),
    system: bool = True,
) -> list[Root]:
    """The folders other tools download models to, for this user and OS.

    `home` and `env` default to the real ones (tests pass a fake home tree);
    `models_dir` is Warmslot's own; `extra_dirs` are folders the user added;
    `system` adds machine-wide folders (the Linux Ollama service's).
    """
    home = Path.home() if home is None else Path(home)
    env = os.environ if env is None else env
    roots: list[Root] = []

    def add(source: str, path: str | Path, layout: str = "tree") -> None:
        p = Path(path).expanduser()
        if all(r.path != p for r in roots):
            roots.append(Root(source, p, layout))

    if models_dir is not None:
        add("warmslot", models_dir)
    for d in extra_dirs:
        if str(d).strip():
            add("folder", d)
    for folder in _lmstudio_model_dirs(home):
        add("lmstudio", folder)
    cache = _cache_home(home, env, platform)
    add("llama.cpp", env.get("LLAMA_CACHE") or cache / "llama.cpp")
    if env.get("HF_HUB_CACHE"):
        add("huggingface", env["HF_HUB_CACHE"], "hf")
    elif env.get("HF_HOME"):
        add("huggingface", Path(env["HF_HOME"]) / "hub", "hf")
    else:
        xdg = env.get("XDG_CACHE_HOME")
        add("huggingface", (Path(xdg) if xdg else home / ".cache") / "huggingface" / "hub", "hf")
    if env.get("OLLAMA_MODELS"):
        add("ollama", env["OLLAMA_MODELS"], "ollama")
    add("ollama", home / ".ollama" / "models", "ollama")
    if system and platform.startswith("linux"):
        add("ollama", "/usr/share/ollama/.ollama/models", "ollama")
    return roots


# ------------------------------------------------------------------ scanning
class _Budget:
    """Entries and seconds left for one scan."""

    def __init__(self, max_entries: int, seconds: float, clock: Callable[[], float]) -> None:
        self.entries_left = max_entries
        self.deadline = clock() + seconds
        self.clock = clock
        self.exhausted = ""

    def spend(self) -> bool:
        """Count one directory entry; False once the scan must stop."""
        if self.exhausted:
            return False
        self.entries_left -= 1
        if self.entries_left < 0:
            self.exhausted = "too many files"
        elif self.clock() > self.deadline:
            self.exhausted = "it took too long"
        return not self.exhausted


def _is_projector(name: str) -> bool:
    return "mmproj" in name.lower()


def _walk_ggufs(
    top: Path, budget: _Budget, seen_dirs: set[tuple[int, int]], max_depth: int
) -> list[Path]:
    """Every ``*.gguf`` below `top` (symlinks followed, each folder walked once)."""
    out: list[Path] = []
    stack = [(top, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            st = folder.stat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen_dirs:  # a symlink loop, or a folder reached twice
            continue
        seen_dirs.add(key)
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if not budget.spend():
                return out
            try:
                if entry.is_dir(follow_symlinks=True):
                    if depth < max_depth and not entry.name.startswith("."):
                        stack.append((Path(entry.path), depth + 1))
                elif entry.name.lower().endswith(".gguf") and not _is_projector(entry.name):
                    out.append(Path(entry.path))  # a dangling link too: shown with its error
            except OSError:
                continue
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _group_splits(files: Sequence[Path]) -> list[tuple[Path, int, int, str]]:
    """(first part, parts, total size, error) per model; later parts fold into the first."""
    out: list[tuple[Path, int, int, str]] = []
    present = {str(p) for p in files}
    for p in files:
        m = _SPLIT.fullmatch(p.name)
        if not m:
            err = "" if p.exists() else "the file is missing (a link to nowhere)"
            out.append((p, 1, _size(p), err))
            continue
        if int(m.group(2)) != 1:
            continue
        count = int(m.group(3))
        parts = [
            p.with_name(f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf") for i in range(1, count + 1)
        ]
        missing = [q.name for q in parts if str(q) not in present and not q.exists()]
        err = f"split model: {', '.join(missing)} missing" if missing else ""
        out.append((p, count, sum(_size(q) for q in parts), err))
    return out


def one_file(p: Path, source: str) -> Found:
    """A single named file (not found by scanning), with its split parts counted."""
    if not p.is_file():
        return Found(p, p.stem, source, 0, error=f"{p} does not exist")
    groups = _group_splits([p]) or [(p, 1, _size(p), "")]  # [] for a later part
    _, parts, size, err = groups[0]
    return Found(p, p.stem, source, size, parts, error=err)


def _scan_tree(root: Root, budget: _Budget, seen: set[tuple[int, int]]) -> list[Found]:
    files = _walk_ggufs(root.path, budget, seen, MAX_DEPTH)
    out = []
    for p, parts, size, err in _group_splits(files):
        try:
            rel = p.relative_to(root.path)
        except ValueError:
            rel = Path(p.name)
        name = str(rel.with_suffix("")) if root.source != "llama.cpp" else p.stem
        out.append(Found(p, name.replace(os.sep, "/"), root.source, size, parts, error=err))
    return out


def _scan_hf(root: Root, budget: _Budget, seen: set[tuple[int, int]]) -> list[Found]:
    out: list[Found] = []
    try:
        repos = sorted(d for d in root.path.iterdir() if d.name.startswith("models--"))
    except OSError:
        return out
    for repo in repos:
        if not budget.spend():
            break
        repo_name = repo.name[len("models--") :].replace("--", "/")
        snapshots = repo / "snapshots"
        try:
            # A revision a ref names (refs/main) first, then the newest: its path is
            # listed when a file is in several revisions.
            refs = {_small_text(r, 256).strip() for r in (repo / "refs").glob("*")}
            revs = sorted(
                (d for d in snapshots.iterdir() if d.is_dir()),
                key=lambda d: (d.name in refs, d.stat().st_mtime, d.name),
                reverse=True,
            )
        except OSError:
            continue
        for rev in revs:
            files = _walk_ggufs(rev, budget, seen, MAX_DEPTH)
            for p, parts, size, err in _group_splits(files):
                rel = str(p.relative_to(rev).with_suffix("")).replace(os.sep, "/")
                out.append(Found(p, f"{repo_name}/{rel}", "huggingface", size, parts, error=err))
    return out


def _ollama_name(rel: Sequence[str]) -> str:
    """``registry/namespace/model/tag`` → the name `ollama list` shows."""
    if len(rel) < 2:
        return ":".join(rel)
    *prefix, model, tag = rel
    if prefix and prefix[0] == OLLAMA_REGISTRY:
        prefix = prefix[1:]
        if prefix == ["library"]:
            prefix = []
    return "/".join([*prefix, model]) + f":{tag}"


def _scan_ollama(root: Root, budget: _Budget) -> list[Found]:
    manifests = root.path / "manifests"
    by_blob: dict[str, list[str]] = {}
    stack = [(manifests, 0)]
    seen: set[tuple[int, int]] = set()
    while stack:
        folder, depth = stack.pop()
        try:
            st = folder.stat()
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if not budget.spend():
                break
            path = Path(entry.path)
            try:
                if entry.is_dir(follow_symlinks=True):
                    if depth < MAX_DEPTH:
                        stack.append((path, depth + 1))
                    continue
                if entry.stat().st_size > MAX_MANIFEST_BYTES:
                    continue
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            name = _ollama_name(path.relative_to(manifests).parts)
            layers = doc.get("layers") if isinstance(doc, dict) else None
            digest = next(
                (
                    str(layer.get("digest", ""))
                    for layer in layers or []
                    if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_MEDIA
                ),
                "",
            )
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                continue  # not a model (an embedding-only or cloud manifest), or malformed
            blob = str(root.path / "blobs" / digest.replace(":", "-"))
            by_blob.setdefault(blob, []).append(name)
    out: list[Found] = []
    for blob, names in sorted(by_blob.items(), key=lambda kv: sorted(kv[1])[0]):
        names.sort()
        p = Path(blob)
        err = "" if p.is_file() else "the manifest names a blob that is missing"
        out.append(Found(p, names[0], "ollama", _size(p), 1, tuple(names[1:]), err))
    return out


def scan(
    roots: Sequence[Root],
    *,
    max_entries: int = MAX_ENTRIES,
    time_budget_s: float = TIME_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[Found], list[str]]:
    """Every model under `roots`, each file once; and notes on where the scan stopped early.

    A file reachable from several roots (a symlink, an Ollama tag and its alias)
    keeps the first root's name.
    """
    budget = _Budget(max_entries, time_budget_s, clock)
    seen_dirs: set[tuple[int, int]] = set()
    found: list[Found] = []
    notes: list[str] = []
    by_real: dict[str, int] = {}
    for root in roots:
        if not root.path.is_dir():
            continue
        if root.layout == "hf":
            items = _scan_hf(root, budget, seen_dirs)
        elif root.layout == "ollama":
            items = _scan_ollama(root, budget)
        else:
            items = _scan_tree(root, budget, seen_dirs)
        for item in items:
            real = os.path.realpath(item.path)
            if real in by_real:
                i = by_real[real]
                prev = found[i]
                if item.name != prev.name and item.name not in prev.aliases:
                    found[i] = dataclasses.replace(prev, aliases=(*prev.aliases, item.name))
                continue
            by_real[real] = len(found)
            found.append(item)
        if budget.exhausted:
            notes.append(f"stopped looking in {root.path} and after: {budget.exhausted}")
            break
    return found, notes


# ------------------------------------------------------------------ facts and fit
