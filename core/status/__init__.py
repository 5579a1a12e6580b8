"""The shapes of `Core.status()`: one typed description shared by the core that builds
it, `/warmslot/status` that sends it as JSON, `warmslot status` that reads that JSON
back and the tray that shows it.

They are TypedDicts rather than dataclasses on purpose: the value *is* the JSON that
`/warmslot/status` has always sent (keys kept, so scripts reading it keep working), and
the CLI reads it back from HTTP without a parser of its own. mypy checks every key a
producer writes and a reader uses. Keys marked `NotRequired` are absent in some states
(say which in their comment); everything else is always there.

llama-server's shapes (the supervisor's snapshot, the fit plan, RPC workers, a build)
are `core.status.server`'s. This package imports nothing from the rest of the core, so
every producer can use it.
"""

from __future__ import annotations

import json
from typing import NotRequired, TypedDict, cast

from core.status.boot import BootRewarmStatus as BootRewarmStatus
from core.status.server import BuildStatus, ServerRow, ServerStatus, WorkersStatus


class WarmslotInfo(TypedDict):
    """The Warmslot process itself."""

    pid: int
    started: float  # epoch seconds
    proxy: str  # the proxy's URL, http://host:port
    config: str  # the config file's path


# ------------------------------------------------------------------ telemetry


class ColdRate(TypedDict):
    """The measured cold prefill rate (core.telemetry)."""

    ms_per_token: float | None  # None: no cold prefill measured yet
    requests: int
    tokens: int


class ModelSaving(TypedDict):
    """One model's share of `Totals.seconds_saved`, priced at its own cold rate."""

    model: str  # the model's file name ("" for requests recorded before models were)
    cached_tokens: int
    cold_rate: ColdRate
    seconds_saved: float


class Totals(TypedDict):
    """Request totals over a window (all time or the last hour)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    prompt_ms: float
    errors: int
    hit_ratio: float | None
    cold_rate: ColdRate  # over every model's requests (what one rate would say)
    seconds_saved: float  # the sum of `by_model`: each model at its own rate
    dropped_rows: int
    by_model: NotRequired[list[ModelSaving]]


class ClientRow(TypedDict):
    """Requests per client."""

    client: str
    requests: int
    cached: int
    new: int
    hit_ratio: float | None


class UserRow(TypedDict):
    """Requests per API key name ("" without keys), busiest first."""

    user: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    last_used: float
    hit_ratio: float | None


class SessionRow(TypedDict):
    """One (client, session) in a window, most recent first."""

    client: str
    session: str
    requests: int
    cached: int
    new: int
    prefill_ms: float
    first_seen: float
    last_seen: float
    slot: int | None
    kinds: str | None  # comma-separated request kinds
    hit_ratio: float | None


class RequestRow(TypedDict):
    """A row of the requests table (core.telemetry), one per proxied request."""

    id: int
    ts: float
    request_id: str
    client: str
    session: str | None
    endpoint: str
    stream: int  # 0 or 1
    has_tools: int | None  # 0 or 1
    kind: str | None  # agent | side | plain
    status: int
    slot: int | None
    prompt_n: int | None  # None: llama-server reported no timings
    cache_n: int | None
    prompt_ms: float | None
    predicted_n: int | None
    ttfb_ms: float | None
    total_ms: float | None
    error: str | None
    user: NotRequired[str]  # the API key's name (docs/security.md); "" without keys
    model: NotRequired[str]  # the model that served it, by file name ("" before recorded)


# ------------------------------------------------------------------ backends


class BackendsStatus(TypedDict):
    """`Status.backends` (only with [[backends]])."""

    backends: list[ServerRow]  # main first
    sessions: int
    moved: int


# ------------------------------------------------------------------ models


class ModelListEntry(TypedDict):
    """One model in `GET /v1/models` (OpenAI's shape, with Warmslot's own part)."""

    id: str
    object: str  # "model"
    owned_by: str
    warmslot: dict[str, str | bool]  # role, loaded


class ModelList(TypedDict):
    """`GET /v1/models`: every configured model, loaded or not."""

    object: str  # "list"
    data: list[ModelListEntry]


class PoolDecision(TypedDict):
    """One of the model pool's last decisions (load, unload, refusal …)."""

    ts: float
    kind: str
    model: str
    reason: str


class ModelCalls(TypedDict):
    """Calls routed per model (with a model pool)."""

    routed_to_side: int
    by_model: dict[str, dict[str, int]]


# ------------------------------------------------------------------ the cache


class DiskTier(TypedDict):
    usable: bool
    reason: str


class SlotRow(TypedDict):
    """One llama-server slot as the cache manager sees it."""

    id: int
    session: str
    prefix: str  # its prefix's fingerprint (16 hex digits), "" when none
    tokens: int
    inflight: int
    kind: str
    ttl_class: NotRequired[str]  # the keys below: when it holds a session
    idle_s: NotRequired[float]
    expires_in_s: NotRequired[float | None]


class PrefixRow(TypedDict):
    """A learned stable prefix."""

    fingerprint: str
    client: str
    tokens: int
    source: str
    share: float | None  # of the rendered prompt; None until a request renders again


class SavedRow(TypedDict):
    """A saved slot state on disk."""

    file: str
    fingerprint: str
    tokens: int
    bytes: int
    ttl_class: str
    pinned: bool
    last_used: float
    verified: str
    current: bool  # saved by the running server's identity
    kind: str  # "prefix" or "conversation"
    session: str
    client: str
    created: float
    expires_in_s: NotRequired[float | None]  # the keys below: with the index database
    age_s: NotRequired[float]


class DivergenceWhere(TypedDict):
    """Where two rendered prompts first differ (core.cache.prefix.divergence)."""

    char_index: int
    before: str  # the text before the difference
    old: str  # what followed in the slot's prompt
    new: str  # what follows in the request's
    token_index: NotRequired[int]  # once tokenized


class Divergence(TypedDict):
    """A request that did not reuse what its slot held."""

    ts: float
    request_id: str
    client: str
    session: str | None
    slot: int | None
    cache_n: int
    prompt_n: int
    reason: str
    where: DivergenceWhere | None


class Shortfall(TypedDict):
    """A restore or re-warm that the next request did not use: said in the headers, the status
    and an event, with the likely cause."""

    ts: float
    request_id: str
    text: str


class ContextHitRow(TypedDict):
    """A request that hit its slot's context."""

    ts: float
    client: str
    session: str
    request_id: str
    tokens: int
    n_ctx: int
    refused: bool
    text: str


class ContextLimitsStatus(TypedDict):
    """Requests that hit the slot's context (core.proxy.context_limit)."""

    n_ctx_slot: int | None
    total: int
    recent: list[ContextHitRow]


class CacheWarmth(TypedDict):
    """The core's one verdict on whether the cache is warm, and why in words: what
    `warmslot status` and the tray's Warm / Cold say (`core.cache.inventory.warmth`)."""

    warm: bool
    why: str


class PressureSnapshot(TypedDict):
    """The machine's memory and disk pressure (core.pressure)."""

    level: str
    causes: list[str]
    paused: dict[str, str]  # behaviour → why it is paused
    sampled_at: float | None
    ram_available_pct: float | None
    swap_used_pct: float | None
    disk_free_pct: float | None
    disk_free_bytes: int | None
    disk_path: str | None
    server_rss_bytes: int | None
    gpus: list[dict[str, object]]


class SweepStatus(TypedDict):
    """One background sweep (core.sweeps)."""

    name: str
    interval_s: float
    configured_s: float
    runs: int
    failures: int
    running_for_s: float | None
    next_in_s: float | None
    last_start: float | None
    last_duration_s: float | None
    last_actions: int | None
    last_error: str | None
    last_details: dict[str, object]


class PrefixSaveStatus(TypedDict):
    """How prefixes reached the disk since start (core.cache.prefix_save)."""

    live_prefix_save: bool  # whether the server can save the first N tokens of a slot
    refused: str  # why it cannot ("" while it may)
    live: int  # saved from a live slot
    conversation: int  # covered by the conversation's saved state
    deferred: int  # left for a later response
    built: int  # left to a build in a scratch slot


class KeepaliveDecision(TypedDict, total=False):
    """What one keep-alive sweep decided for one slot, or for a pinned prefix in no slot
    (core.cache.keepalive): which, what it did and why, and the numbers it went by."""

    slot: int | None  # None: a pinned prefix found no free slot
    prefix: str  # the prefix's fingerprint, first 16 hex digits
    pinned: bool
    action: str  # "none", "rewarmed", "skipped" or "failed"
    why: str
    live_tokens: int  # what `/slots` says the slot holds
    expected: int  # what Warmslot last left there (0: unknown)
    idle_s: float
    cost_tokens: int | None  # tokens a re-warm evaluated


class KeepaliveStatus(TypedDict):
    last: list[KeepaliveDecision]  # the last keep-alive sweep's decisions


class BackoffRow(TypedDict):
    """A prefix whose saves back off after failures."""

    fingerprint: str
    failures: int
    retry_in_s: float
    reason: str


class DiskUsage(TypedDict):
    """The disk tier's use against its cap (core.cache.retention)."""

    used_bytes: int
    cap_bytes: int
    cap_source: str
    unknown_files_left_alone: int
    save_backoff: list[BackoffRow]
    quarantined: dict[str, str]


class ExplainedRequest(TypedDict):
    """The request an explanation is about (core.cache.explain)."""

    request_id: str
    client: str
    session: str | None
    slot: int | None
    kind: NotRequired[str]  # the keys below: kept in memory, not in the database
    endpoint: NotRequired[str]
    edits: NotRequired[list[str]]  # what the proxy changed in the body (core.chat)


class ExplainedSection(TypedDict):
    """A section of a rendered prompt: the system text, a tool, a message."""

    name: str
    start: int  # its first token
    n_tokens: int


class ExplainedDivergence(TypedDict):
    """Where a prompt left its slot's previous one."""

    token: int
    section: str
    offset: int  # tokens into the section
    old_section: str
    before: str  # the text before it, and what followed in the old and the new prompt
    old: str
    new: str


class Explanation(ExplainedRequest):
    """Why a request reused what it did: `GET /warmslot/explain`, `warmslot explain`,
    `status["cache"]["explained"]` (there without `sections`)."""

    ts: float
    n_tokens: int
    cache_n: int
    prompt_n: int
    previous_tokens: int | None  # the slot's previous prompt; None when none was known
    divergence: ExplainedDivergence | None
    lost_tokens: int  # cached tokens thrown away
    cost_s: float | None  # their prefill at the measured cold rate
    summary: str
    compute_ms: float
    sections: NotRequired[list[ExplainedSection]]
    ms_per_token: NotRequired[float | None]  # kept in memory, not in the database
    note: NotRequired[str]
    where: NotRequired[DivergenceWhere]  # the same point in the rendered text
    id: NotRequired[int]  # the keys below: read back from the database
    div_token: NotRequired[int | None]
    div_section: NotRequired[str]


class CacheStatus(TypedDict):
    """`Status.cache`: the prefix-cache manager's inventory and background work."""

    enabled: bool
    identity: str | None  # None until the server's identity is known
    disk_tier: DiskTier
    aux_slot: int | None
    slots: list[SlotRow]
    prefixes: list[PrefixRow]
    saved: list[SavedRow]
    divergences: list[Divergence]
    restore_shortfalls: list[Shortfall]
    prefix_saves: PrefixSaveStatus
    explained: list[Explanation]  # the latest that found a divergence, without sections
    context_limits: ContextLimitsStatus
    template_warning: str | None
    unmanaged_apis: dict[str, str]  # route → why it is forwarded unmanaged
    warming: bool  # the restore / prewarm after a (re)start still runs
    boot_rewarm: BootRewarmStatus
    warmth: NotRequired[CacheWarmth]  # absent only in a status from before it existed
    pressure: PressureSnapshot
    paused: list[str]
    sweeps: list[SweepStatus]
    keepalive: KeepaliveStatus
    disk: NotRequired[DiskUsage]  # the keys below: with the index database
    ttl: NotRequired[dict[str, float | None]]
    ttl_classes: NotRequired[dict[str, str]]
    text: str  # the inventory in words, as `warmslot status` prints it


class CacheFailure(TypedDict):
    """`Status.cache` when the cache's status itself failed."""

    error: str


# ------------------------------------------------------------------ the whole


class Status(TypedDict):
    """Everything `warmslot status`, `/warmslot/status` and the tray show."""

    warmslot: WarmslotInfo
    build: BuildStatus | None
    server: ServerStatus
    workers: WorkersStatus | None
    totals: Totals | None  # None from `server_status()` (taken without history)
    last_hour: Totals | None
    clients: list[ClientRow]
    users: NotRequired[list[UserRow]]  # per API key name (docs/security.md)
    sessions: list[SessionRow]
    recent_requests: list[RequestRow]
    models: list[ServerRow]  # the primary alone without [[models]]
    backends: NotRequired[BackendsStatus]  # only with [[backends]]
    model_calls: NotRequired[ModelCalls]  # with a model pool
    cache: NotRequired[CacheStatus | CacheFailure]  # with a cache manager attached


def cache_of(status: Status | None) -> CacheStatus | None:
    """The cache inventory, or None without a cache manager or when its status failed."""
    cache = None if status is None else status.get("cache")
    if cache is None or "error" in cache:
        return None
    return cache


def cache_error(status: Status | None) -> str:
    """Why the cache's status failed ("" when it did not, or there is no cache)."""
    cache = None if status is None else status.get("cache")
    if cache is not None and "error" in cache:
        return cast(CacheFailure, cache)["error"]
    return ""


def from_json(text: str | bytes) -> Status:
    """`/warmslot/status`'s body as a `Status`. The body comes from our own endpoint,
    which builds it from these types, so it is taken as it is (no second schema)."""
    data = json.loads(text)
    if not isinstance(data, dict) or "server" not in data or "warmslot" not in data:
        raise ValueError("not a Warmslot status")
    return cast(Status, data)


# ------------------------------------------------------------------ cache commands


class PinResult(TypedDict):
    """`Core.pin`'s answer."""

    file: str
    fingerprint: str
    pinned: bool


class EvictResult(TypedDict):
    """`Core.evict`'s answer."""

    file: str
    bytes: int  # freed


class RewarmResult(TypedDict):
    """`Core.rewarm`'s answer."""

    fingerprint: str
    slot: int
    restored: bool  # restored from disk into a free slot (else re-warmed in its slot)
    cache_n: NotRequired[int]  # the keys below: re-warmed in its slot
    prompt_n: NotRequired[int]
