"""The fit planner: which llama-server flags make model + context + caches fit.

`plan(facts, gpus, host, request)` is a pure function. It sizes every buffer the
way llama.cpp does, checked against the server's own log (see
docs/llama-server-facts.md#kv-cache-sizing, docs/llama-server-facts.md#ram-prompt-cache
and docs/llama-server-facts.md#slot-file-contents):

- **KV cache**: per layer, cells × (row(K) + row(V)); a row is head_dim × KV
  heads in the cache type. Full-attention layers get the per-slot context
  (padded to 256) per stream; sliding-window layers get
  ``pad256(min(n_ctx, n_swa × (unified ? slots : 1) + n_ubatch))`` cells unless
  ``--swa-full``. With explicit ``-np`` the cache is not unified: one stream per
  slot.
- **Weights**: ``-ngl k`` puts the last k repeating layers (and the output head
  once k > n_layer) on the GPUs; token embeddings stay on the host.
- **Compute buffer**: n_ubatch × 4 B × (6·n_embd + 3·n_ff) plus the f16 masks
  (n_ubatch × cells); without flash attention also the n_head × n_ubatch ×
  n_kv f32 scores. Calibrated on llama-server's CPU backend within ~10 %.
- **Checkpoints** (SWA and recurrent models only) hold the window (or the
  recurrent state) of one sequence and live in host RAM, as does the RAM prompt
  cache (``--cache-ram``).
- **Disk per saved state** (docs/llama-server-facts.md#slot-file-contents,
  `sizing.saved_state_bytes`): (full-attention bytes + 16 B) × N + SWA bytes ×
  min(N, n_swa + n_ubatch) + recurrent state + each context checkpoint the file holds
  (a server with Warmslot's checkpoint patch saves them: 2 per request read into the
  slot, up to ``--ctx-checkpoints``).

Unless pinned, the planner aims for every slot holding the model's trained
context (at most `MAX_AUTO_CTX`): an agent that declares 32k and gets 8k has its
third turn truncated (a real agent's was, at 8,191 tokens). It aims for
`FitRequest.agent_slots` agent slots plus one for side calls, so agents that
alternate each keep their own slot instead of re-reading their conversation every
turn. When that does not fit, it steps
down a ladder — fewer slots at the trained context, a q8_0 KV cache, a shorter
context (never below 32k before fewer agent slots and q8_0 were tried), a
partial GPU offload — and says in `gave_up` what it reduced; values the user
pinned are never changed.

The bytes of each buffer are `core.server.sizing`'s; the plan's table for people and
its check against llama-server's log are `core.server.fit_report`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.errors import ConfigError
from core.machine.devices import GpuInfo, HostInfo
from core.server.gguf_facts import ModelFacts
from core.server.placement import Placement
from core.server.sizing import (
    CACHE_TYPES,
    GIB,
    MIB,
    SERVER_DEFAULT_CACHE_RAM_MIB,
    SERVER_DEFAULT_CHECKPOINTS,
    SERVER_DEFAULT_MIN_STEP,
    SERVER_DEFAULT_UBATCH,
    Breakdown,
    Config,
    DeviceUse,
    Limits,
    Sizer,
)

__all__ = ["FitPlan", "FitRequest", "as_mib", "plan", "plan_argv"]

# The most context per slot the planner chooses by itself: beyond it a slot costs more
# memory than CPU prefill can use (128k tokens take hours to read on a CPU).
MAX_AUTO_CTX = 131072
# Below this an agent's conversation is truncated after a few turns: the ladder keeps
# it as long as fewer agent slots or a q8_0 cache can pay for it.
AGENT_CTX = 32768


@dataclass(frozen=True)
class FitRequest:
    """What the user pinned (None = let the planner choose) and the safety margins.

    As in the settings, ``slots = 0``, ``ctx_per_slot = 0`` and a negative
    ``cache_ram_mib`` mean "let the planner choose" too.
    """

    slots: int | None = None
    ctx_per_slot: int | None = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    n_gpu_layers: int | None = None
    swa_full: bool | None = None
    cache_ram_mib: int | None = None
    ctx_checkpoints: int | None = None
    checkpoint_min_step: int | None = None
    n_ubatch: int = SERVER_DEFAULT_UBATCH
    kv_unified: bool = False
    flash_attn: bool = True
    vram_margin_mib: int = 1024  # per GPU, like llama-server's --fit-target
    ram_floor_mib: int = 2048  # host RAM left for the OS and everything else
    preferred_ctx: int = 0  # the context per slot aimed for; 0: trained (≤ MAX_AUTO_CTX)
    agent_slots: int = 3  # slots aimed for besides the side-call slot
    side_slot: bool = True  # one more slot, reserved for side calls (cache.aux_slot)
    # Layers per device, pinned (RPC workers with `layers` set, core.server.rpc_fit): the
    # devices get exactly these, in order, instead of filling each in turn.
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for key in ("slots", "ctx_per_slot"):
            if getattr(self, key) == 0:
                object.__setattr__(self, key, None)
        if self.cache_ram_mib is not None and self.cache_ram_mib < 0:
            object.__setattr__(self, "cache_ram_mib", None)

    @property
    def preferred_slots(self) -> int:
        """The slot count aimed for: the agent slots and the side-call slot."""
        return max(1, self.agent_slots) + (1 if self.side_slot else 0)

    def validate(self) -> None:
        """Raise `ConfigError` for values llama-server would reject."""
        for key in ("cache_type_k", "cache_type_v"):
            value = getattr(self, key)
            if value is not None and value not in CACHE_TYPES:
                raise ConfigError(
                    "unknown KV cache type", key=key, expected=" | ".join(CACHE_TYPES), got=value
                )
        lows = {"slots": 1, "ctx_per_slot": 256, "n_gpu_layers": 0, "cache_ram_mib": 0,
                "ctx_checkpoints": 0, "checkpoint_min_step": 0, "n_ubatch": 1}  # fmt: skip
        for key, low in lows.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ConfigError("value too small", key=key, expected=f"≥ {low}", got=value)


@dataclass(frozen=True)
class FitPlan:
    """The chosen flags, what they cost, and why."""

    model: str
    n_gpu_layers: int
    slots: int
    ctx_per_slot: int
    cache_type_k: str
    cache_type_v: str
    cache_ram_mib: int
    ctx_checkpoints: int
    checkpoint_min_step: int
    swa_full: bool
    n_ubatch: int
    kv_unified: bool
    flash_attn: bool
    tensor_split: tuple[int, ...]  # layers per GPU; () when at most one GPU is used
    breakdown: Breakdown
    devices: tuple[DeviceUse, ...]
    fits: bool
    reasons: dict[str, str] = field(default_factory=dict)
    gave_up: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    placement: Placement | None = None
    """llama.cpp's placement of layers and tensors (`core.server.placement`): when set,
    the launch uses it instead of this plan's ``n_gpu_layers``/``tensor_split``, which
    are then Warmslot's estimate only."""

    def to_dict(self) -> dict[str, object]:
        """JSON-able form, with each device's total and verdict, and the argv."""
        out = dataclasses.asdict(self)
        out["devices"] = [
            {**dataclasses.asdict(d), "total_bytes": d.total_bytes, "fits": d.fits}
            for d in self.devices
        ]
        out["placement"] = None if self.placement is None else self.placement.to_dict()
        out["argv"] = plan_argv(self)
        return out


_LADDER: tuple[tuple[int | None, bool, bool, int | None], ...] = (
    # (context cap, quantize the KV cache, allow a partial offload, slots cap; a slots
    # cap of -1 means two agent slots and the side slot, 0 one agent slot and the side
    # slot). The trained context is tried with every slot count before the KV cache is
    # quantized; a context below AGENT_CTX (a truncated agent, a hard failure) comes
    # only after one agent slot (slower turns when agents alternate: the RAM cache
    # and saved conversations bring them back) was tried. A shorter context is worth
    # it to keep every layer on the GPU; once layers must run on the CPU anyway, the
    # agent context comes back first.
    (None, False, False, None),
    (None, False, False, -1),
    (MAX_AUTO_CTX // 2, False, False, None),
    (MAX_AUTO_CTX // 2, False, False, -1),
    (AGENT_CTX, False, False, None),
    (AGENT_CTX, False, False, -1),
    (AGENT_CTX, True, False, None),
    (AGENT_CTX, True, False, -1),
    (AGENT_CTX, True, False, 0),
    (16384, True, False, -1),
    (16384, True, False, 0),
    (AGENT_CTX, True, True, -1),
    (AGENT_CTX, True, True, 0),
    (16384, True, True, 0),
    (8192, True, True, 0),
    (4096, True, True, 0),
    (4096, True, True, 1),
)


_PINNABLE = ("slots", "ctx_per_slot", "cache_type_k", "cache_type_v", "n_gpu_layers",
             "swa_full", "cache_ram_mib")  # fmt: skip
_PIN_KEYS = {  # reason key → the request fields that pin it
    "n_gpu_layers": ("n_gpu_layers",), "slots": ("slots",), "ctx_per_slot": ("ctx_per_slot",),
    "cache_types": ("cache_type_k", "cache_type_v"), "cache_ram_mib": ("cache_ram_mib",),
    "ctx_checkpoints": ("ctx_checkpoints",), "checkpoint_min_step": ("checkpoint_min_step",),
}  # fmt: skip


def _ctx_reason(ctx: int, pref: int, trained: int, slots: int) -> str:
    """Why each slot gets `ctx` tokens (`pref`: what was aimed for)."""
    head = f"{ctx} tokens per slot (-c {ctx * slots})"
    if ctx < pref:
        return (
            f"{head}: {pref} per slot (the model's trained context, or the most chosen "
            f"automatically) does not fit with {slots} slots in the memory there is"
        )
    if pref >= trained:
        return f"{head}: the model's trained context — a conversation can grow to it"
    return (
        f"{head}: the most chosen automatically (the model was trained for {trained}; "
        "server.ctx_per_slot sets more)"
    )


def as_mib(n: int) -> str:
    """A byte count as text: GiB from 1 GiB up, else MiB, one decimal."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def plan(
    facts: ModelFacts, gpus: Sequence[GpuInfo], host: HostInfo, request: FitRequest | None = None
) -> FitPlan:
    """Choose llama-server flags so the model, its KV cache and caches fit.

    Pinned values in `request` are kept as they are; the rest are chosen, stepping
    down `_LADDER` until every device stays within its budget. `FitPlan.fits` is
    False when even the last step does not fit; `gave_up` then says by how much.
    """
    req = request or FitRequest()
    req.validate()
    p = Sizer(
        facts,
        gpus,
        host,
        Limits(
            req.vram_margin_mib,
            req.ram_floor_mib,
            req.n_ubatch,
            req.kv_unified,
            req.flash_attn,
            req.layer_split,
        ),
    )
    f = facts
    n_units = f.n_layer + 1
    notes = list(f.notes)
    aim = req.preferred_ctx or MAX_AUTO_CTX
    trained = f.n_ctx_train or min(aim, AGENT_CTX)
    pref_ctx = req.ctx_per_slot or max(256, min(aim, trained) // 256 * 256)
    pref_slots = req.slots or req.preferred_slots
    side = 1 if req.side_slot else 0
    swa_full = bool(req.swa_full) and f.is_swa
    has_ckpt = f.is_recurrent or (f.is_swa and not swa_full)
    min_ckpt = req.ctx_checkpoints if req.ctx_checkpoints is not None else (4 if has_ckpt else 0)
    ram_mib = req.cache_ram_mib if req.cache_ram_mib is not None else 0

    def config(step: tuple[int | None, bool, bool, int | None]) -> tuple[Config, int]:
        ctx_cap, quant, partial, slots_cap = step
        ctx = pref_ctx if req.ctx_per_slot or ctx_cap is None else min(ctx_cap, pref_ctx)
        if req.slots or slots_cap is None:
            slots = pref_slots
        else:
            cap = {-1: 2 + side, 0: 1 + side}.get(slots_cap, slots_cap)
            slots = min(cap, pref_slots)
        tk = req.cache_type_k or ("q8_0" if quant else "f16")
        # A quantized V cache needs flash attention in llama.cpp.
        tv = req.cache_type_v or ("q8_0" if quant and req.flash_attn else "f16")
        cfg = Config(slots, ctx, tk, tv, swa_full, ram_mib, min_ckpt)
        if not gpus:
            ngl = 0
        elif req.n_gpu_layers is not None:
            ngl = min(req.n_gpu_layers, n_units)
        else:
            ngl = p.best_ngl(cfg) if partial else n_units
        return cfg, ngl

    tried: list[tuple[Config, int]] = []
    chosen: tuple[Config, int] | None = None
    for step in _LADDER:
        cand = config(step)
        if cand in tried:
            continue
        tried.append(cand)
        if p.fits(*cand):
            chosen = cand
            break
    fits = chosen is not None
    cfg, ngl = chosen or tried[-1]

    # Share what host RAM is left between checkpoints and the RAM prompt cache.
    devices, _ = p.evaluate(cfg, ngl)
    spare = max(devices[-1].budget_bytes - devices[-1].total_bytes, 0)
    ckpt_bytes = p.checkpoint_bytes(cfg)
    n_ckpt = cfg.checkpoints
    if req.ctx_checkpoints is None:
        if has_ckpt and ckpt_bytes:
            extra = int(spare * 0.25) // (cfg.slots * ckpt_bytes)
            n_ckpt = min(SERVER_DEFAULT_CHECKPOINTS, cfg.checkpoints + extra)
            spare -= (n_ckpt - cfg.checkpoints) * cfg.slots * ckpt_bytes
        elif not has_ckpt:
            n_ckpt = SERVER_DEFAULT_CHECKPOINTS
    cache_ram = cfg.cache_ram_mib
    if req.cache_ram_mib is None and not swa_full:
        cache_ram = min(SERVER_DEFAULT_CACHE_RAM_MIB, spare // 2 // MIB // 256 * 256)
    cfg = dataclasses.replace(cfg, checkpoints=n_ckpt, cache_ram_mib=cache_ram)
    devices, bd = p.evaluate(cfg, ngl)
    fits = fits and all(d.fits for d in devices)
    if req.checkpoint_min_step is not None:
        min_step = req.checkpoint_min_step
    elif has_ckpt:
        min_step = min(SERVER_DEFAULT_MIN_STEP, max(1024, cfg.ctx // 4 // 256 * 256))
    else:
        min_step = SERVER_DEFAULT_MIN_STEP
    gpu_layers = [d.layers for d in devices if d.kind == "gpu"]
    split = tuple(gpu_layers) if sum(1 for n in gpu_layers if n) > 1 else ()

    # Reasons, one line per choice.
    pinned = "pinned in the settings"
    r: dict[str, str] = {}
    gpu_names = ", ".join(d.name for d in devices if d.kind == "gpu" and d.layers)
    if not gpus:
        r["n_gpu_layers"] = "no GPU found: the model runs on the CPU from host RAM"
        if req.n_gpu_layers:
            notes.append(f"n_gpu_layers {req.n_gpu_layers} is pinned, but there is no GPU")
    elif req.n_gpu_layers is not None:
        r["n_gpu_layers"] = f"{pinned} ({ngl} of {n_units} layers incl. the output head)"
    elif ngl == n_units:
        r["n_gpu_layers"] = f"all {f.n_layer} layers and the output head fit on {gpu_names}"
    else:
        r["n_gpu_layers"] = (
            f"{ngl} of {n_units} layers fit in VRAM with the "
            f"{req.vram_margin_mib} MiB margin; the rest run on the CPU"
        )
    agents = cfg.slots - side if cfg.slots > side else cfg.slots
    r["slots"] = (
        f"{agents} agent slot{'s' if agents != 1 else ''} (each agent session keeps its "
        "conversation in its own)" + (" and one reserved for side calls" if side else "")
    )
    if cfg.slots < 2:
        r["slots"] = "a single slot: side calls share it with the conversation"
    if cfg.slots < pref_slots:
        r["slots"] += f"; {pref_slots} slots do not fit with this context"
    r["ctx_per_slot"] = _ctx_reason(cfg.ctx, pref_ctx, trained, cfg.slots)
    if req.ctx_per_slot and f.n_ctx_train and cfg.ctx > f.n_ctx_train:
        notes.append(f"context {cfg.ctx} exceeds the trained {f.n_ctx_train}: quality drops")
    r["cache_types"] = "full precision, as the server's default"
    if cfg.type_k != "f16":
        r["cache_types"] = "q8_0 halves the KV cache at a small quality cost"
    if not f.is_swa:
        r["swa_full"] = "off: the model has no sliding-window layers"
    elif swa_full:
        r["swa_full"] = (
            f"{pinned}: SWA layers get {bd.kv_cells_swa} cells; restored or "
            "RAM-cached states then silently miss SWA keys "
            "(docs/llama-server-facts.md#swa-full-restores-wrong-state)"
        )
    else:
        r["swa_full"] = (
            f"off: SWA layers keep {bd.kv_cells_swa} cells, not {bd.kv_cells_full};"
            " keeps restore and the RAM cache correct"
            " (docs/llama-server-facts.md#swa-full-restores-wrong-state)"
        )
    if swa_full:
        r["cache_ram_mib"] = "0: with --swa-full a RAM-cache reload reuses incomplete SWA state"
    elif cache_ram:
        r["cache_ram_mib"] = f"{cache_ram} MiB: half of the host RAM left after everything else"
    else:
        r["cache_ram_mib"] = "0: no host RAM to spare for the prompt cache"
    if has_ckpt:
        r["ctx_checkpoints"] = (
            f"{n_ckpt} per slot of {as_mib(ckpt_bytes)} each: they let "
            "an edited or shortened prompt reuse its cache"
        )
    else:
        r["ctx_checkpoints"] = "server default; a dense model needs no checkpoints"
    r["checkpoint_min_step"] = "server default; unused by a dense model"
    if has_ckpt:
        r["checkpoint_min_step"] = f"user-turn checkpoints ≥ {min_step} tokens apart (¼ slot)"
    for key, fields in _PIN_KEYS.items():
        if any(getattr(req, k) is not None for k in fields):
            r[key] = "pinned in the settings"
    if req.ctx_per_slot:
        r["ctx_per_slot"] = (
            f"pinned in the settings: {cfg.ctx} tokens per slot (-c {cfg.ctx * cfg.slots}); "
            f"the model was trained for {trained}"
        )
    if cfg.ctx < min(AGENT_CTX, trained):
        notes.append(
            f"{cfg.ctx} tokens per slot: a coding agent's conversation outgrows it within "
            'a few turns; llama-server then refuses the request ("exceeds the available '
            'context size") or cuts the answer short — Warmslot says so in the '
            "X-Warmslot-Warning header, an event and `warmslot status`"
        )
    if split:
        r["tensor_split"] = "layers per GPU: " + ",".join(map(str, split))

    # What was reduced or abandoned.
    gave: list[str] = []
    if cfg.ctx < pref_ctx:
        gave.append(f"context per slot {pref_ctx} → {cfg.ctx} tokens")
    if (cfg.type_k, cfg.type_v) != (req.cache_type_k or "f16", req.cache_type_v or "f16"):
        gave.append(f"KV cache f16 → {cfg.type_k}/{cfg.type_v}")
    if gpus and ngl < n_units and req.n_gpu_layers is None:
        gave.append(
            f"GPU offload {ngl} of {n_units} layers: {n_units - ngl} run on the CPU, much slower"
        )
    if cfg.slots < pref_slots:
        if cfg.slots > side:
            gave.append(
                f"agent slots {pref_slots - side} → {cfg.slots - side}: more agent sessions "
                "than that take turns (the RAM cache and saved conversations bring them back)"
            )
        else:
            gave.append(f"slots {pref_slots} → {cfg.slots}: no reserved slot for side calls")
    if has_ckpt and req.ctx_checkpoints is None and n_ckpt < SERVER_DEFAULT_CHECKPOINTS:
        gave.append(
            f"context checkpoints {SERVER_DEFAULT_CHECKPOINTS} → {n_ckpt} per slot (host RAM)"
        )
    if req.cache_ram_mib is None and not swa_full and cache_ram < SERVER_DEFAULT_CACHE_RAM_MIB:
        gave.append(f"RAM prompt cache {SERVER_DEFAULT_CACHE_RAM_MIB} → {cache_ram} MiB (host RAM)")
    if not fits:
        for d in devices:
            if not d.fits:
                kept = (
                    f"keeping {req.ram_floor_mib} MiB free"
                    if d.kind == "host"
                    else f"the {req.vram_margin_mib} MiB margin"
                )
                gave.append(
                    f"does not fit: {d.name} needs {as_mib(d.total_bytes)} but has "
                    f"{as_mib(d.budget_bytes)} after {kept}"
                )
        pins = [k for k in _PINNABLE if getattr(req, k) is not None]
        if pins:
            gave.append("pinned values kept as they are: " + ", ".join(pins))
    if host.disk_free_state < 10 * bd.disk_per_prefix_bytes:
        notes.append(
            f"little disk space for saved prefixes ({as_mib(host.disk_free_state)} free, "
            f"{as_mib(bd.disk_per_prefix_bytes)} per full slot)"
        )
    if (f.is_swa and not swa_full) or f.is_recurrent:
        kind = "sliding-window" if f.is_swa else "recurrent/hybrid"
        notes.append(
            f"{kind} model: a saved state holds {as_mib(bd.disk_window_bytes)} of window "
            f"and {as_mib(bd.disk_checkpoint_bytes)} per context checkpoint (2 per request "
            f"read into the slot, up to {n_ckpt}) besides "
            f"{as_mib(bd.disk_per_1k_tokens_bytes)} per 1k tokens; saved only on a server "
            "with Warmslot's checkpoint patch (a stock server's files restore no prefix: "
            "docs/llama-server-facts.md#swa-slot-files-reuse-nothing), and as whole "
            "conversations: llama-server refuses to save a prefix alone of such a model"
        )

    return FitPlan(
        model=f.name,
        n_gpu_layers=ngl,
        slots=cfg.slots,
        ctx_per_slot=cfg.ctx,
        cache_type_k=cfg.type_k,
        cache_type_v=cfg.type_v,
        cache_ram_mib=cache_ram,
        ctx_checkpoints=n_ckpt,
        checkpoint_min_step=min_step,
        swa_full=swa_full,
        n_ubatch=req.n_ubatch,
        kv_unified=req.kv_unified,
        flash_attn=req.flash_attn,
        tensor_split=split,
        breakdown=bd,
        devices=devices,
        fits=fits,
        reasons=r,
        gave_up=tuple(gave),
        notes=tuple(notes),
    )


def plan_argv(plan: FitPlan) -> list[str]:
    """The llama-server flags the plan implies (-c is the total: per slot × slots).

    Layers and tensors are placed by llama.cpp when the plan carries its `placement`
    (its flags replace ``-ngl``/``-ts``); otherwise by this plan's estimate."""
    place = plan.placement
    argv = [] if place is not None else ["-ngl", str(plan.n_gpu_layers)]
    argv += [
        "-np",
        str(plan.slots),
        "-c",
        str(plan.ctx_per_slot * plan.slots),
        "-ctk",
        plan.cache_type_k,
        "-ctv",
        plan.cache_type_v,
        "--cache-ram",
        str(plan.cache_ram_mib),
        "--ctx-checkpoints",
        str(plan.ctx_checkpoints),
        "--checkpoint-min-step",
        str(plan.checkpoint_min_step),
    ]
    if plan.swa_full:
        argv.append("--swa-full")
    if plan.kv_unified:
        argv.append("-kvu")
    if plan.n_ubatch != SERVER_DEFAULT_UBATCH:
        argv += ["-ub", str(plan.n_ubatch)]
    if not plan.flash_attn:
        argv += ["-fa", "off"]
    if place is not None:
        argv += place.argv()
    elif plan.tensor_split:
        argv += ["-ts", ",".join(map(str, plan.tensor_split))]
    return argv
