"""The model catalog over a fake home tree in every layout other tools use.

The tree holds real GGUF files: tiny llama models from `make_tiny_model` (which
llama-server serves) and header-faithful sliding-window/hybrid files written
with the gguf package, placed as LM Studio, llama.cpp, Hugging Face (snapshot
symlinks into blobs) and Ollama (manifest + blob) keep them, plus a split model,
a broken file, a projector and a symlink loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.config import ModelProfile, Settings
from core.machine.devices import GpuInfo, HostInfo
from core.models.catalog import ModelEntry, describe, find_models, profile_note
from core.models.scan import Found, Root, model_roots, scan
from core.server.fit import FitRequest
from core.server.tinymodel import make_tiny_model
from tests.core.test_gguf_facts import BASE, qwen3next_meta, write_gguf

GIB = 1 << 30
BIG_HOST = HostInfo(
    ram_total=64 * GIB, ram_available=48 * GIB, swap_total=0, swap_free=0,
    disk_free_state=100 * GIB,
)  # fmt: skip
TINY_HOST = HostInfo(
    ram_total=GIB, ram_available=GIB, swap_total=0, swap_free=0, disk_free_state=GIB
)


@dataclass
class Tree:
    home: Path
    env: dict[str, str]
    extra: Path
    models_dir: Path
    paths: dict[str, Path]  # label → the file the catalog should list


def _tiny(cache: Path, seed: int) -> Path:
    """A tiny llama model (generated once per test session folder, then copied)."""
    return make_tiny_model(cache / f"tiny-{seed}.gguf", seed=seed)


def _ollama_blob(models: Path, src: Path) -> Path:
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, blob)
    return blob


def _manifest(models: Path, rel: str, digest: str) -> None:
    path = models / "manifests" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 10},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64,
             "size": 10},
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 1},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(doc))


def build_tree(base: Path) -> Tree:
    """Every layout the catalog knows, with the files it should list."""
    gen = base / "gen"
    home = base / "home"
    paths: dict[str, Path] = {}

    # LM Studio: publisher/repo/file.gguf — a sliding-window model, a broken file,
    # a vision projector (not a model) and a symlink loop.
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "gemma-3-GGUF"
    lms.mkdir(parents=True)
    meta = {**BASE, "{arch}.attention.sliding_window": 512, "{arch}.context_length": 32768}
    paths["swa"] = write_gguf(lms / "gemma-3-mini-Q4_K_M.gguf", "gemma3", meta, n_layer=12)
    (lms / "mmproj-gemma-3-F16.gguf").write_bytes(_tiny(gen, 5).read_bytes())
    broken = lms.parent / "broken-GGUF"
    broken.mkdir()
    paths["broken"] = broken / "broken.gguf"
    paths["broken"].write_bytes(_tiny(gen, 6).read_bytes()[:2000])  # cut mid-header
    (lms.parent / "loop").symlink_to(lms.parent, target_is_directory=True)

    # llama.cpp's cache (LLAMA_CACHE), flat like `llama-server -hf` writes it.
    llama_cache = base / "llama-cache"
    llama_cache.mkdir()
    paths["llamacpp"] = llama_cache / "ggml-org_tiny-GGUF_tiny-q8.gguf"
    shutil.copyfile(_tiny(gen, 1), paths["llamacpp"])

    # Hugging Face (HF_HOME/hub): two revisions link to one blob → listed once.
    repo = base / "hf-home" / "hub" / "models--someorg--Tiny-Coder-GGUF"
    blob = repo / "blobs" / "0123abcd"
    blob.parent.mkdir(parents=True)
    shutil.copyfile(_tiny(gen, 2), blob)
    for rev in ("aaaa1111", "bbbb2222"):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "tiny-coder-Q8_0.gguf").symlink_to(Path("../../blobs/0123abcd"))
    # refs/main names the older-looking revision: the catalog lists its path.
    paths["hf"] = repo / "snapshots" / "aaaa1111" / "tiny-coder-Q8_0.gguf"
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaaa1111")
    os.utime(repo / "snapshots" / "aaaa1111", (1_600_000_000, 1_600_000_000))

    # Ollama: two tags of one model share a blob; a third names a blob that is gone.
    ollama = home / ".ollama" / "models"
    ob = _ollama_blob(ollama, _tiny(gen, 3))
    digest = "sha256:" + ob.name.removeprefix("sha256-")
    _manifest(ollama, "registry.ollama.ai/library/tinyllama/latest", digest)
    _manifest(ollama, "registry.ollama.ai/library/tinyllama/2m", digest)
    _manifest(ollama, "registry.ollama.ai/library/gone/latest", "sha256:" + "f" * 64)
    paths["ollama"] = ob
    paths["gone"] = ollama / "blobs" / ("sha256-" + "f" * 64)  # listed, with its error

    # A folder the user added: a split model (2 parts) and a hybrid model.
    extra = base / "my-models"
    extra.mkdir()
    first = extra / "big-00001-of-00002.gguf"
    write_gguf(first, "llama", {**BASE, "split.count": 2}, n_layer=2)
    write_gguf(extra / "big-00002-of-00002.gguf", "llama", {**BASE, "split.count": 2}, n_layer=2)
    paths["split"] = first
    paths["hybrid"] = write_gguf(extra / "qwen3next-mini.gguf", "qwen3next", qwen3next_meta(),
                                 n_layer=8)  # fmt: skip

    models_dir = base / "warmslot-data" / "models"
    models_dir.mkdir(parents=True)
    paths["own"] = models_dir / "own.gguf"
    shutil.copyfile(_tiny(gen, 4), paths["own"])
    env = {"LLAMA_CACHE": str(llama_cache), "HF_HOME": str(base / "hf-home")}
    return Tree(home, env, extra, models_dir, paths)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return build_tree(tmp_path_factory.mktemp("catalog"))


def _by_path(entries: tuple[ModelEntry, ...]) -> dict[str, ModelEntry]:
    out: dict[str, ModelEntry] = {}
    for e in entries:
        assert e.path not in out, f"{e.path} listed twice"
        out[e.path] = e
    return out


def test_every_layout_is_found_once_with_its_name_source_and_facts(tree: Tree) -> None:
    cat = find_models(
        home=tree.home, env=tree.env, platform="linux", models_dir=tree.models_dir,
        extra_dirs=[tree.extra], system=False, host=BIG_HOST, gpus=[],
        request=FitRequest(slots=2, ctx_per_slot=4096),
    )  # fmt: skip
    rows = _by_path(cat.entries)
    p = tree.paths
    assert set(rows) == {str(v) for v in p.values()}, sorted(rows)
    # Every file once: the HF file in two revisions, the Ollama blob under two tags.
    assert len(cat.entries) == len(p)

    swa = rows[str(p["swa"])]
    assert (swa.source, swa.name) == (
        "lmstudio",
        "lmstudio-community/gemma-3-GGUF/gemma-3-mini-Q4_K_M",
    )
    assert (swa.architecture, swa.n_ctx_train, swa.kind) == ("gemma3", 32768, "sliding-window")
    assert swa.needs_patched_server and "patched server" in swa.kind_text

    hf = rows[str(p["hf"])]
    assert (hf.source, hf.name) == ("huggingface", "someorg/Tiny-Coder-GGUF/tiny-coder-Q8_0")
    assert (hf.architecture, hf.n_ctx_train, hf.kind) == ("llama", 4096, "dense")
    assert not hf.needs_patched_server and hf.kind_text == "dense"
    assert hf.size == p["hf"].stat().st_size

    ol = rows[str(p["ollama"])]
    assert (ol.source, ol.name, ol.aliases) == ("ollama", "tinyllama:2m", ("tinyllama:latest",))
    assert ol.architecture == "llama" and not ol.error

    lc = rows[str(p["llamacpp"])]
    assert (lc.source, lc.name) == ("llama.cpp", "ggml-org_tiny-GGUF_tiny-q8")

    split = rows[str(p["split"])]
    assert (split.source, split.name, split.parts) == ("folder", "big-00001-of-00002", 2)
    assert (
        split.size
        == p["split"].stat().st_size + (tree.extra / "big-00002-of-00002.gguf").stat().st_size
    )
    assert split.architecture == "llama" and not split.error

    hyb = rows[str(p["hybrid"])]
    assert (hyb.kind, hyb.needs_patched_server) == ("hybrid", True)

    gone = rows[str(p["gone"])]
    assert (gone.name, gone.source) == ("gone:latest", "ollama")
    assert "blob that is missing" in gone.error

    own = rows[str(p["own"])]
    assert (own.source, own.name) == ("warmslot", "own")

    broken = rows[str(p["broken"])]
    assert broken.source == "lmstudio" and "not a readable GGUF" in broken.error
    assert broken.architecture == "" and broken.fits is None

    # The fit plan ran for every readable model: tiny models fit in 48 GiB.
    for e in cat.entries:
        if not e.error:
            assert e.fits is True, e
            assert e.fit.startswith("fits: 2 slots × 4,096 tokens, CPU"), e.fit
    assert not cat.notes
    doc = cat.to_dict()
    assert json.loads(json.dumps(doc))["models"][0]["source_label"]


def test_nothing_is_found_twice_through_the_loop(tree: Tree) -> None:
    roots = model_roots(tree.home, tree.env, platform="linux", system=False)
    found, notes = scan(roots)
    assert sum(f.name.endswith("gemma-3-mini-Q4_K_M") for f in found) == 1
    assert len({os.path.realpath(f.path) for f in found}) == len(found)
    assert not any("mmproj" in f.name for f in found)
    assert not notes


def test_a_model_too_big_says_it_does_not_fit(tree: Tree) -> None:
    item = Found(tree.paths["hf"], "x", "huggingface", 1)
    e = describe(item, gpus=[], host=TINY_HOST, request=FitRequest(slots=4, ctx_per_slot=4096))
    assert e.fits is False and e.fit.startswith("does not fit with 4 slots"), e.fit
    assert describe(item).fits is None  # no host given: facts only
    # With a GPU (as NVML would report one) the line says where the layers go.
    gpu = GpuInfo(index=0, name="H200", total_bytes=140 * GIB, free_bytes=139 * GIB)
    e = describe(item, gpus=[gpu], host=BIG_HOST, request=FitRequest(slots=2, ctx_per_slot=4096))
    assert e.fits is True and e.fit == "fits: 2 slots × 4,096 tokens, all on GPU", e.fit


def test_configured_model_is_current_and_a_missing_one_is_listed_with_its_error(
    tree: Tree, tmp_path: Path
) -> None:
    kw = dict(home=tree.home, env=tree.env, platform="linux", system=False, facts=False)
    cat = find_models(configured=str(tree.paths["hf"]), **kw)  # type: ignore[arg-type]
    current = [e for e in cat.entries if e.current]
    assert [e.path for e in current] == [str(tree.paths["hf"])]
    assert current[0].architecture == ""  # facts=False reads no header

    elsewhere = make_tiny_model(tmp_path / "elsewhere" / "mine.gguf")
    (tmp_path / "elsewhere" / "neighbour.gguf").write_bytes(elsewhere.read_bytes())
    cat = find_models(configured=str(elsewhere), **kw)  # type: ignore[arg-type]
    mine = [e for e in cat.entries if e.source == "configured"]
    assert [(e.name, e.current) for e in mine] == [("mine", True)]  # not its neighbours

    cat = find_models(configured=str(tmp_path / "nope.gguf"), **kw)  # type: ignore[arg-type]
    (missing,) = [e for e in cat.entries if e.current]
    assert missing.source == "configured" and "does not exist" in missing.error


def test_roots_follow_each_tools_environment_per_os(tmp_path: Path) -> None:
    home = tmp_path
    env = {"HF_HUB_CACHE": "/hub", "OLLAMA_MODELS": "/om", "XDG_CACHE_HOME": "/xdg"}
    linux = {(r.source, str(r.path)) for r in model_roots(home, env, platform="linux")}
    assert ("huggingface", "/hub") in linux and ("ollama", "/om") in linux
    assert ("llama.cpp", "/xdg/llama.cpp") in linux
    assert ("ollama", "/usr/share/ollama/.ollama/models") in linux
    assert ("lmstudio", str(home / ".lmstudio" / "models")) in linux
    mac = {(r.source, str(r.path)) for r in model_roots(home, {}, platform="darwin")}
    assert ("llama.cpp", str(home / "Library" / "Caches" / "llama.cpp")) in mac
    assert ("huggingface", str(home / ".cache" / "huggingface" / "hub")) in mac
    win = {(r.source, str(r.path)) for r in model_roots(home, {"LOCALAPPDATA": "C:/L"},
                                                        platform="win32")}  # fmt: skip
    assert ("llama.cpp", str(Path("C:/L") / "llama.cpp")) in win
    assert not any("/usr/share" in p for _, p in win)


def test_lm_studio_moved_data_folder_and_models_directory(tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "lmstudio-data"
    (tmp_path / ".lmstudio-home-pointer").write_text(f"{moved}\n")
    moved.mkdir(parents=True)
    custom = tmp_path / "big-disk" / "ggufs"
    (moved / "settings.json").write_text(json.dumps({"downloadsFolder": str(custom)}))
    model = make_tiny_model(custom / "pub" / "repo" / "m.gguf")
    lms = [r.path for r in model_roots(tmp_path, {}, platform="linux") if r.source == "lmstudio"]
    assert lms[:2] == [moved / "models", custom]
    found, _ = scan(model_roots(tmp_path, {}, platform="linux", system=False))
    assert [(f.path, f.name, f.source) for f in found] == [(model, "pub/repo/m", "lmstudio")]


def test_scan_is_bounded_by_entries_and_time(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"d{i}").mkdir()
    found, notes = scan([Root("folder", tmp_path)], max_entries=10)
    assert found == [] and notes and "too many files" in notes[0]
    ticks = iter(range(1000))
    found, notes = scan([Root("folder", tmp_path)], time_budget_s=5, clock=lambda: next(ticks))
    assert notes and "too long" in notes[0]


def test_profile_note_when_the_primary_profile_names_its_own_model() -> None:
    s = Settings()
    assert profile_note(s) == ""
    s.models = [ModelProfile(name="coder")]  # uses server.model
    assert profile_note(s) == ""
    s.models = [ModelProfile(name="coder", model="/m/own.gguf")]
    assert "'coder'" in profile_note(s) and "/m/own.gguf" in profile_note(s)
