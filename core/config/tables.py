"""The lists of tables in the settings file: ``[[models]]`` (`ModelProfile`),
``[[workers]]`` (`WorkerSettings`) and ``[[backends]]`` (`BackendSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config.checks import (
    Applies,
    in_range,
    meta,
    valid_backend_name,
    valid_backend_url,
    valid_profile_name,
    valid_ttl,
    valid_worker_address,
    valid_worker_name,
)

ROLES = ("text", "side", "embedding")


@dataclass
class ModelProfile:
    """One model of the pool (a ``[[models]]`` table); 0 means "the default" throughout."""

    name: str = field(
        default="",
        metadata=meta(
            "Name clients send as `model`.", valid_profile_name, applies=Applies.WARMSLOT
        ),
    )
    model: str = field(
        default="",
        metadata=meta(
            "Path to its GGUF. Empty (only for the first 'text' profile): server.model.",
            applies=Applies.WARMSLOT,
        ),
    )
    role: str = field(
        default="text",
        metadata=meta(
            "'text': agent turns (the first one is the primary server); 'side': auxiliary "
            "calls (titles, summaries) when pool.side_calls is on; 'embedding'.",
            choices=ROLES,
            applies=Applies.WARMSLOT,
        ),
    )
    ttl_s: int = field(
        default=0,
        metadata=meta(
            "Unload after this many idle seconds; -1 never; 0 the role's default (primary: "
            "never, side: 600, embedding: 300, other text: 1800).",
            valid_ttl,
            applies=Applies.WARMSLOT,
        ),
    )
    priority: int = field(
        default=0,
        metadata=meta(
            "Eviction priority, higher stays longer; 0 the role's default (primary 100, "
            "text 80, embedding 50, side 20).",
            in_range(0, 1000),
            applies=Applies.WARMSLOT,
        ),
    )
    slots: int = field(
        default=0,
        metadata=meta("Slots (-np); 0 = server.slots.", in_range(0, 64), applies=Applies.WARMSLOT),
    )
    ctx_per_slot: int = field(
        default=0,
        metadata=meta(
            "Context per slot; 0 = server.ctx_per_slot.",
            in_range(0, 1 << 21),
            applies=Applies.WARMSLOT,
        ),
    )
    cache_ram_mib: int = field(
        default=-1,
        metadata=meta(
            "Its --cache-ram in MiB; -1 = server.cache_ram_mib.",
            in_range(-1, 1 << 20),
            applies=Applies.WARMSLOT,
        ),
    )
    chat_template_file: str = field(
        default="",
        metadata=meta("Its chat template file; empty: the model's.", applies=Applies.WARMSLOT),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=meta("More llama-server arguments for this model only.", applies=Applies.WARMSLOT),
    )
    footprint_mib: int = field(
        default=0,
        metadata=meta(
            "Memory it needs in MiB, overriding the fit planner's estimate; 0 = estimate.",
            in_range(0, 1 << 24),
            applies=Applies.WARMSLOT,
        ),
    )


@dataclass
class WorkerSettings:
    """One llama.cpp RPC worker (a ``[[workers]]`` table): a machine running
    ``ggml-rpc-server`` (`warmslot worker`) whose devices the primary server ('main')
    may use."""

    address: str = field(
        default="",
        metadata=meta(
            "Host name or IPv4 address of the worker. llama.cpp's RPC protocol has no "
            "authentication: only on a network you trust (docs/scale.md).",
            valid_worker_address,
            applies=Applies.SERVER,
        ),
    )
    port: int = field(
        default=50052,
        metadata=meta(
            "Port its ggml-rpc-server listens on (`warmslot worker --port`).",
            in_range(1, 65535),
            applies=Applies.SERVER,
        ),
    )
    name: str = field(
        default="",
        metadata=meta(
            "Name shown in status and errors; empty: address:port.",
            valid_worker_name,
            applies=Applies.SERVER,
        ),
    )
    layers: int = field(
        default=0,
        metadata=meta(
            "Model layers this worker holds; 0: the fit plan decides from its free memory "
            "(a model that fits on the main host then stays there).",
            in_range(0, 1 << 16),
            applies=Applies.SERVER,
        ),
    )

    @property
    def endpoint(self) -> str:
        """``address:port``, as llama-server's ``--rpc`` takes it."""
        return f"{self.address}:{self.port}"

    @property
    def label(self) -> str:
        """How status and errors name it."""
        return f"{self.name} ({self.endpoint})" if self.name else self.endpoint


@dataclass
class BackendSettings:
    """One more backend behind the proxy (a ``[[backends]]`` table): a llama-server
    Warmslot launches for the primary model, or a remote Warmslot instance by URL. The
    primary server (``server.*``) is always the first backend, named 'main'; with
    ``[[workers]]`` it alone uses them, and a backend launched here runs on this machine
    (docs/scale.md#several-backends)."""

    name: str = field(
        default="",
        metadata=meta(
            "Name shown in status, metrics and the X-Warmslot-Backend header.",
            valid_backend_name,
            applies=Applies.WARMSLOT,
        ),
    )
    url: str = field(
        default="",
        metadata=meta(
            "Base URL of a remote Warmslot (or any OpenAI-compatible server) serving the same "
            "model; empty: Warmslot launches a llama-server here with the server.* settings.",
            valid_backend_url,
            applies=Applies.WARMSLOT,
        ),
    )
    api_key: str = field(
        default="",
        metadata=meta(
            "The remote's API key (sent as Authorization: Bearer); never shown in status.",
            applies=Applies.WARMSLOT,
        ),
    )
    threads: int = field(
        default=0,
        metadata=meta(
            "CPU threads of a launched backend (-t); 0: server.threads.",
            in_range(0, 1024),
            applies=Applies.WARMSLOT,
        ),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=meta(
            "More llama-server arguments for a launched backend, after server.extra_args "
            '(e.g. ["--device", "CUDA1"] for one backend per GPU).',
            applies=Applies.WARMSLOT,
        ),
    )
