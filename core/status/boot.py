"""The boot re-warm's shapes in `CacheStatus.boot_rewarm` (core.cache.boot): its progress,
the steps that failed and how each warmed slot was filled."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class BootRewarmStatus(TypedDict):
    """The re-warm of recently used prefixes after a server start."""

    state: str  # idle | running | done
    done: int
    total: int
    warmed: int
    skipped: int
    failed: int
    current_slot: int | None
    started_at: float | None
    finished_at: float | None
    # The steps that failed and why, in words (what the tray says when it is not warm).
    failures: NotRequired[list[BootFailure]]
    # How each warmed slot was filled: which saved state, or a prefill (core.cache.warmup).
    sources: NotRequired[list[BootSource]]


class BootSource(TypedDict):
    """How the boot re-warm filled one slot."""

    slot: int
    fingerprint: str  # the first 16 hex digits
    tokens: int  # the prefix's
    source: str  # "prefix state", "conversation state" or "prefill"
    restored: int  # tokens restored from a verified state on disk
    prefilled: int  # tokens prefilled
    text: str  # in words


class BootFailure(TypedDict):
    """A prefix the boot re-warm could not bring back."""

    fingerprint: str  # the first 16 hex digits
    slot: int
    reason: str
