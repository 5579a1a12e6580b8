"""Model profiles: the configured ``[[models]]`` with their role defaults applied.

With no profiles configured there is one implicit primary profile, today's
`server.model`, and Warmslot behaves exactly as a single-model proxy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import ModelProfile, ServerSettings, Settings
from core.machine.devices import GpuInfo, HostInfo
from core.server import fit
from core.server.gguf_facts import read_facts

MIB = 1024 * 1024
PRIMARY_NAME = "default"  # the implicit primary's name when no profiles are configured

# Defaults by role: the primary outranks everything and is never unloaded when idle.
ROLE_PRIORITY = {"primary": 100, "text": 80, "embedding": 50, "side": 20}
ROLE_TTL_S = {"primary": -1, "text": 1800, "embedding": 300, "side": 600}


@dataclass(frozen=True)
class Profile:
    """One model of the pool with every default resolved."""

    name: str
    role: str
    primary: bool
    priority: int
    ttl_s: int  # -1: never unloaded for being idle
    source: ModelProfile

    @property
    def role_key(self) -> str:
        return "primary" if self.primary else self.role


def resolve(p: ModelProfile, *, primary: bool) -> Profile:
    key = "primary" if primary else p.role
    return Profile(
        name=p.name,
        role=p.role,
        primary=primary,
        priority=p.priority or ROLE_PRIORITY[key],
        ttl_s=p.ttl_s or ROLE_TTL_S[key],
        source=p,
    )


def profiles(settings: Settings) -> list[Profile]:
    """The pool's profiles, primary first. Without ``[[models]]``: the implicit primary."""
    if not settings.models:
        return [resolve(ModelProfile(name=PRIMARY_NAME), primary=True)]
    first = next(i for i, p in enumerate(settings.models) if p.role == "text")
    out = [resolve(settings.models[first], primary=True)]
    out += [resolve(p, primary=False) for i, p in enumerate(settings.models) if i != first]
    return out


def primary(settings: Settings) -> Profile:
    return profiles(settings)[0]


def side(settings: Settings) -> Profile | None:
    return next((p for p in profiles(settings) if p.role == "side"), None)


def server_settings(settings: Settings, prof: Profile) -> ServerSettings:
    """The server settings a profile launches with: `server.*` with its overrides.

    The primary keeps `server.port`; every other model takes a free port.
    """
    s, p = settings.server, prof.source
    return dataclasses.replace(
        s,
        model=p.model or s.model,
        port=s.port if prof.primary else 0,
        slots=p.slots or s.slots,
        ctx_per_slot=p.ctx_per_slot or s.ctx_per_slot,
        cache_ram_mib=s.cache_ram_mib if p.cache_ram_mib < 0 else p.cache_ram_mib,
        chat_template_file=p.chat_template_file or s.chat_template_file,
        extra_args=[*s.extra_args, *p.extra_args],
    )


def primary_server_settings(settings: Settings) -> ServerSettings:
    """The primary server's settings: `server.*`, with the primary profile's overrides
    when ``[[models]]`` profiles are configured."""
    if not settings.models:
        return settings.server
    return server_settings(settings, primary(settings))


@dataclass(frozen=True)
class Footprint:
    """Memory a loaded model needs: bytes per GPU (by index) and host bytes."""

    vram: tuple[int, ...]
    ram: int
    source: str  # "fit planner" | "configured" | why it is a guess

    def as_dict(self) -> dict[str, object]:
        return {
            "vram_mib": [round(b / MIB, 1) for b in self.vram],
            "ram_mib": round(self.ram / MIB, 1),
            "source": self.source,
        }


def footprint(
    prof: Profile,
    server: ServerSettings,
    model_path: Path,
    gpus: Sequence[GpuInfo],
    host: HostInfo,
) -> Footprint:
    """The fit planner's breakdown (weights, KV, compute, RAM cache) for this profile."""
    if prof.source.footprint_mib:
        return Footprint((), prof.source.footprint_mib * MIB, "configured (footprint_mib)")
    facts = read_facts(model_path)
    request = fit.FitRequest(
        slots=server.slots,
        ctx_per_slot=server.ctx_per_slot,
        cache_ram_mib=server.cache_ram_mib,
        n_gpu_layers=None if gpus else 0,
        ram_floor_mib=0,  # the arbiter keeps the floor once, for all models together
    )
    plan = fit.plan(facts, gpus, host, request)
    vram = tuple(d.total_bytes for d in plan.devices if d.kind == "gpu")
    ram = sum(d.total_bytes for d in plan.devices if d.kind == "host")
    return Footprint(vram, ram, "fit planner")
