"""What a llama-server configuration costs in memory, buffer by buffer, as llama.cpp sizes it.

The arithmetic behind the fit planner (`core.server.fit`), checked against the server's
own log (docs/llama-server-facts.md#kv-cache-sizing): KV cells per stream, K+V bytes
per cell of a layer, the compute buffer, checkpoints, and per device what one
configuration with ``-ngl k`` places there (`Sizer.evaluate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.machine.devices import GpuInfo, HostInfo
from core.server.gguf_facts import ModelFacts

__all__ = [
    "CACHE_TYPES",
    "GIB",
    "MIB",
    "SERVER_DEFAULT_CACHE_RAM_MIB",
    "SERVER_DEFAULT_CHECKPOINTS",
    "SERVER_DEFAULT_MIN_STEP",
    "SERVER_DEFAULT_UBATCH",
    "Breakdown",
    "Config",
    "DeviceUse",
    "Limits",
    "Sizer",
    "compute_bytes",
    "kv_cells",
    "kv_layer_bytes",
    "saved_state_bytes",
]

MIB = 1 << 20
GIB = 1 << 30
# (block size, bytes per block) of the KV cache types llama-server accepts.
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}  # fmt: skip
SERVER_DEFAULT_CHECKPOINTS = 32
SERVER_DEFAULT_MIN_STEP = 8192
SERVER_DEFAULT_CACHE_RAM_MIB = 8192
SERVER_DEFAULT_UBATCH = 512


def _pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def _row(cache_type: str, n: int) -> int:
    block, size = CACHE_TYPES[cache_type]
    return (n + block - 1) // block * size


@dataclass(frozen=True)
class DeviceUse:
    """Planned memory on one device (a GPU, or host RAM), in bytes."""

    name: str
    kind: str  # "gpu" | "host"
    layers: int
    weights_bytes: int
    kv_bytes: int  # KV cache plus recurrent state of its layers
    compute_bytes: int
    other_bytes: int  # host: logits buffer, checkpoints, RAM prompt cache
    budget_bytes: int  # free minus margin (GPU) or available minus floor (host)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.other_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes


@dataclass(frozen=True)
class Breakdown:
    """Where the bytes go, for the plan's configuration."""

    weights_gpu_bytes: int
    weights_host_bytes: int
    kv_bytes_per_token: int  # full-attention layers, K+V, one sequence
    kv_swa_bytes_per_token: int  # sliding-window layers, one sequence
    kv_cells_full: int  # per slot
    kv_cells_swa: int  # per slot
    kv_bytes_per_slot: int
    kv_bytes_total: int
    recurrent_bytes_per_slot: int
    compute_bytes_gpu: int
    compute_bytes_host: int
    logits_bytes: int
    checkpoint_bytes: int  # one checkpoint
    checkpoints_bytes_max: int  # every slot's list full
    cache_ram_bytes: int
    disk_per_prefix_bytes: int  # one full slot saved to disk, its checkpoint list full
    disk_per_1k_tokens_bytes: int  # the part of a saved state that grows with its tokens
    # The fixed parts of a saved state (`saved_state_bytes`): the sliding-window layers'
    # cells of one sequence, and each context checkpoint in the file (a server with
    # Warmslot's checkpoint patch writes them; 0 for a model that has none).
    disk_window_bytes: int = 0
    disk_checkpoint_bytes: int = 0


def kv_cells(
    facts: ModelFacts,
    ctx_per_slot: int,
    slots: int,
    *,
    n_ubatch: int = SERVER_DEFAULT_UBATCH,
    unified: bool = False,
    swa_full: bool = False,
) -> tuple[int, int, int]:
    """(full cells, SWA cells, streams) of the KV cache; cells are per stream."""
    if unified:
        base, streams = _pad(ctx_per_slot * slots), 1
    else:
        base, streams = _pad(ctx_per_slot), slots
    swa = base
    if facts.is_swa and not swa_full:
        swa = min(base, _pad(facts.n_swa * (slots if unified else 1) + n_ubatch))
    return base, swa, streams


def kv_layer_bytes(facts: ModelFacts, layer: int, cache_type_k: str, cache_type_v: str) -> int:
    """K+V bytes one cell of `layer` takes (0 for layers without a KV cache)."""
    heads = facts.n_head_kv[layer]
    if heads == 0:
        return 0
    swa = facts.is_swa and facts.swa_layers[layer]
    dk = facts.head_dim_k_swa if swa else facts.head_dim_k
    dv = facts.head_dim_v_swa if swa else facts.head_dim_v
    return _row(cache_type_k, dk * heads) + (_row(cache_type_v, dv * heads) if dv else 0)


def compute_bytes(
    facts: ModelFacts,
    cells: Sequence[int],
    *,
    n_ubatch: int = SERVER_DEFAULT_UBATCH,
    flash_attn: bool = True,
) -> int:
    """Estimated compute buffer of one device; `cells` = KV cells per attention kind."""
    total = n_ubatch * 4 * (6 * facts.n_embd + 3 * facts.n_ff)
    total += sum(n_ubatch * c * 2 for c in cells)  # f16 KQ masks
    if not flash_attn and cells:
        total += facts.n_head * n_ubatch * max(cells) * 4  # materialized KQ scores
    return total


@dataclass(frozen=True)
class Limits:
    """What of a `core.server.fit.FitRequest` the sizing reads: the margins and the
    server's fixed choices."""

    vram_margin_mib: int
    ram_floor_mib: int
    n_ubatch: int
    kv_unified: bool
    flash_attn: bool
    layer_split: tuple[int, ...] | None


@dataclass(frozen=True)
class Config:
    """One configuration the planner tries."""

    slots: int
    ctx: int
    type_k: str
    type_v: str
    swa_full: bool
    cache_ram_mib: int
    checkpoints: int


def saved_state_bytes(
    facts: ModelFacts, cfg: Config, n_tokens: int, n_checkpoints: int, n_ubatch: int
) -> int:
    """The size of a slot file holding `n_tokens` and `n_checkpoints` context checkpoints
    (docs/llama-server-facts.md#slot-file-contents): the full-attention layers' cells
    and 16 B per token, the sliding-window layers' cells of one sequence (its window and
    a batch: all of them with ``--swa-full`` on a server with Warmslot's patch 0003), the
    recurrent state, and each checkpoint (the window again, or the recurrent state).
    Measured on the pinned server within 2 % (Gemma 3 270M, 1k–9k tokens, 2–8
    checkpoints) and exactly for a dense model: tests/integration/test_fit_disk.py."""
    f = facts
    full = swa = 0
    for i in range(f.n_layer):
        row = kv_layer_bytes(f, i, cfg.type_k, cfg.type_v)
        if f.is_swa and f.swa_layers[i]:
            swa += row
        else:
            full += row
    window = n_tokens if cfg.swa_full else min(n_tokens, f.n_swa + n_ubatch)
    recurrent = f.recurrent_state_bytes_per_layer * sum(f.recurrent_layers)
    checkpoint = recurrent
    if f.is_swa and not cfg.swa_full:
        checkpoint += f.n_swa * (swa + 16)
    return (full + 16) * n_tokens + swa * window + recurrent + n_checkpoints * checkpoint


class Sizer:
    """Evaluates configurations for one model, device set and the request's margins."""

    def __init__(
        self,
        facts: ModelFacts,
        gpus: Sequence[GpuInfo],
        host: HostInfo,
        limits: Limits,
    ) -> None:
        self.f, self.gpus, self.host, self.req = facts, list(gpus), host, limits
        self.margin = limits.vram_margin_mib * MIB
        self.host_budget = host.ram_available - limits.ram_floor_mib * MIB

    def checkpoint_bytes(self, cfg: Config) -> int:
        """One checkpoint: the window of the SWA layers and/or the recurrent state.

        Dense models (and SWA models with --swa-full) get none: the server can
        roll their cache back to any cell.
        """
        f = self.f
        size = f.recurrent_state_bytes_per_layer * sum(f.recurrent_layers)
        if f.is_swa and not cfg.swa_full:
            size += f.n_swa * (self.per_token(cfg, swa=True) + 16)
        return size

    def per_token(self, cfg: Config, *, swa: bool) -> int:
        """KV bytes per token of one sequence over the full (or the SWA) layers."""
        f = self.f
        return sum(
            kv_layer_bytes(f, i, cfg.type_k, cfg.type_v)
            for i in range(f.n_layer)
            if (f.is_swa and f.swa_layers[i]) == swa
        )

    def evaluate(self, cfg: Config, ngl: int) -> tuple[tuple[DeviceUse, ...], Breakdown]:
        """Per-device use and the breakdown of `cfg` with `ngl` units offloaded."""
        f, req = self.f, self.req
        full, swa, streams = kv_cells(
            f,
            cfg.ctx,
            cfg.slots,
            n_ubatch=req.n_ubatch,
            unified=req.kv_unified,
            swa_full=cfg.swa_full,
        )
        recurrent_layer = f.recurrent_state_bytes_per_layer * cfg.slots
        layer_kv = [
            (swa if f.is_swa and f.swa_layers[i] else full)
            * streams
            * kv_layer_bytes(f, i, cfg.type_k, cfg.type_v)
            + (recurrent_layer if f.recurrent_layers[i] else 0)
            for i in range(f.n_layer)
        ]
        mask_cells = [c for c, n in ((full, f.n_full_layers), (swa, f.n_swa_layers)) if n]
        comp = compute_bytes(f, mask_cells, n_ubatch=req.n_ubatch, flash_attn=req.flash_attn)

        # Units in llama.cpp's offload order: the repeating layers, then the output
        # head; -ngl k offloads the last k, spread over the GPUs in index order.
        units = [(f.layer_bytes[i], layer_kv[i]) for i in range(f.n_layer)]
        units.append((f.output_bytes, 0))
        ngl = min(ngl, len(units)) if self.gpus else 0
        first_gpu = len(units) - ngl
        devices: list[DeviceUse] = []
        pos = first_gpu
        for d, gpu in enumerate(self.gpus):
            budget = gpu.free_bytes - self.margin
            end, cost = pos, comp
            pinned = req.layer_split[d] if req.layer_split and d < len(req.layer_split) else None
            while end < len(units):
                w, kv = units[end]
                if pinned is not None and d < len(self.gpus) - 1:
                    if end - pos >= pinned:
                        break
                elif d < len(self.gpus) - 1 and cost + w + kv > budget:
                    break  # the rest goes to the next GPU
                cost += w + kv
                end += 1
            span = units[pos:end]
            devices.append(
                DeviceUse(
                    f"GPU{gpu.index} {gpu.name}",
                    "gpu",
                    len(span),
                    sum(u[0] for u in span),
                    sum(u[1] for u in span),
                    comp if span else 0,
                    0,
                    budget,
                )
            )
            pos = end

        gpu_weights = sum(d.weights_bytes for d in devices)
        host_layers = min(first_gpu, f.n_layer)
        ckpt = self.checkpoint_bytes(cfg)
        ckpt_max = ckpt * cfg.checkpoints * cfg.slots
        logits = f.n_vocab * 4 * cfg.slots
        cache_ram = cfg.cache_ram_mib * MIB
        devices.append(
            DeviceUse(
                "host RAM",
                "host",
                host_layers,
                f.weights_bytes - gpu_weights,
                sum(layer_kv[:host_layers]),
                comp if first_gpu > 0 else 0,
                logits + ckpt_max + cache_ram,
                self.host_budget,
            )
        )

        per_tok_full = self.per_token(cfg, swa=False)
        per_tok_swa = self.per_token(cfg, swa=True)
        recurrent = f.recurrent_state_bytes_per_layer * sum(f.recurrent_layers)
        kv_total = sum(layer_kv)
        per_slot = kv_total // cfg.slots
        n_ub = self.req.n_ubatch
        window = saved_state_bytes(f, cfg, 0, 0, n_ub)
        one_ckpt = saved_state_bytes(f, cfg, 0, 1, n_ub) - window
        if not cfg.swa_full:  # the window's cells, once a state holds that many tokens
            window += per_tok_swa * min(cfg.ctx, f.n_swa + n_ub)
        bd = Breakdown(
            weights_gpu_bytes=gpu_weights,
            weights_host_bytes=f.weights_bytes - gpu_weights,
            kv_bytes_per_token=per_tok_full,
            kv_swa_bytes_per_token=per_tok_swa,
            kv_cells_full=full,
            kv_cells_swa=swa,
            kv_bytes_per_slot=per_slot,
            kv_bytes_total=kv_total,
            recurrent_bytes_per_slot=recurrent,
            compute_bytes_gpu=sum(d.compute_bytes for d in devices if d.kind == "gpu"),
            compute_bytes_host=devices[-1].compute_bytes,
            logits_bytes=logits,
            checkpoint_bytes=ckpt,
            checkpoints_bytes_max=ckpt_max,
            cache_ram_bytes=cache_ram,
            disk_per_prefix_bytes=saved_state_bytes(f, cfg, cfg.ctx, cfg.checkpoints, n_ub),
            disk_per_1k_tokens_bytes=(per_tok_full + 16 + (per_tok_swa if cfg.swa_full else 0))
            * 1000,
            disk_window_bytes=window,
            disk_checkpoint_bytes=one_ckpt,
        )
        return tuple(devices), bd

    def fits(self, cfg: Config, ngl: int) -> bool:
        devices, _ = self.evaluate(cfg, ngl)
        return all(d.fits for d in devices)

    def best_ngl(self, cfg: Config) -> int:
        """The most units whose GPUs all stay within budget (0 without GPUs)."""
        if not self.gpus:
            return 0
        for ngl in range(self.f.n_layer + 1, 0, -1):
            devices, _ = self.evaluate(cfg, ngl)
            if all(d.fits for d in devices if d.kind == "gpu"):
                return ngl
        return 0
