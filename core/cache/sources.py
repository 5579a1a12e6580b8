"""Where a prefix can come from when its slot does not hold it: a verified state on disk.

A request's stable prefix may be new (a second session of a client teaches a longer
common prefix, with a fingerprint of its own: core.cache.learner) while a shorter prefix
it starts with — the first session's system text and tools — is saved and verified.
`find` is the one place that looks: the longest saved state whose tokens the prefix
starts with, a prefix state or a saved conversation that starts with such a prefix
(core.cache.conversations, `covering`). Restoring it and prefilling the rest beats a cold
prefill of the whole prefix (docs/cache.md#the-shared-prefix-wherever-it-is); the request
path (core.cache.manager) and the boot re-warm (core.cache.warmup) both use it, and say
which state they used (`Source.describe`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.cache import prefix as pfx
from core.cache.store import StateRecord
from core.errors import VerificationFailed

if TYPE_CHECKING:
    from core.cache.conversations import Conversations
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState

log = logging.getLogger("warmslot.cache")

# Copies prefix `info` from idle slot `source` into slot `target`; True when `target` then
# holds it, verified (core.cache.prefix_save, `PrefixSaver.copy`).
Copy = Callable[[pfx.PrefixInfo, int, int], Awaitable[bool]]


@dataclass(frozen=True)
class Source:
    """A saved state that brings back the first `covers.n_tokens` tokens of a prefix."""

    rec: StateRecord
    covers: pfx.PrefixInfo  # the known prefix it holds: the wanted one or one it starts with

    @property
    def tokens(self) -> int:
        """Tokens of the wanted prefix that restoring it gives."""
        return self.covers.n_tokens

    @property
    def kind(self) -> str:
        """ "prefix state" or "conversation state"."""
        return "conversation state" if self.rec.kind == "conversation" else "prefix state"

    def describe(self, info: pfx.PrefixInfo) -> str:
        """In words, for events, status and the log: what was restored for `info`."""
        what = f"the {self.tokens}-token {self.kind}"
        if self.tokens < info.n_tokens:
            return f"{what} (of the {info.n_tokens}-token prefix; the rest prefilled)"
        return what


def find(state: CacheState, conversations: Conversations, info: pfx.PrefixInfo) -> Source | None:
    """The saved state of this server that gives the most of `info`'s tokens: a prefix
    state whose tokens `info` starts with, or a conversation that starts with such a
    prefix; on a tie the prefix state (smaller, its own). None without a disk tier or
    when nothing of at least `MIN_PREFIX_TOKENS` is saved."""
    if not state.disk.usable or not state.has_db or state.identity is None:
        return None
    best: Source | None = None
    n_max = info.n_tokens
    # Prefix states only: conversation rows carry whole conversations' token lists.
    rows = state.store.table.rows_where(
        "identity = ? AND kind = ?", [state.launch_id, "prefix"], order_by="prefix_n desc"
    )
    for row in rows:
        try:
            rec = StateRecord.from_row(row)
        except ValueError:
            continue  # a damaged row: the store's own reads skip (and report) it
        tokens = rec.probe.get("prefix")
        if not isinstance(tokens, list):
            continue
        n = len(tokens)
        if n < pfx.MIN_PREFIX_TOKENS or n > n_max or (best is not None and n <= best.tokens):
            continue
        if info.tokens[:n] != tokens:
            continue
        covers = info if n == n_max else state.by_fp.get(rec.fingerprint)
        if covers is None or covers.n_tokens != n:
            covers = pfx.PrefixInfo(
                key="",
                tokens=tokens,
                text="",
                source=rec.source,
                client=rec.client,
                fingerprint=rec.fingerprint,
            )
        best = Source(rec, covers)
    # A saved conversation stands for a prefix where no prefix state could be saved
    # (core.cache.prefix_save): one that starts with a known prefix of `info`.
    for known in state.by_fp.values():
        n = known.n_tokens
        if n < pfx.MIN_PREFIX_TOKENS or n > n_max or (best is not None and n <= best.tokens):
            continue
        if known.tokens != info.tokens[:n]:
            continue
        conversation = conversations.covering(known)
        if conversation is not None:
            best = Source(conversation, known)
    return best


def displace(
    state: CacheState,
    conversations: Conversations,
    info: pfx.PrefixInfo,
    session: str,
    holding: Sequence[int],
    can_copy: bool,
    min_tokens: int,
) -> bool:
    """Whether a new `session` may take another session's idle slot among `holding` that
    holds its prefix (core.cache.slots, `SlotMap.pick`): only where the prefix cannot reach
    an empty slot otherwise — it cannot be copied from the holding slot (`can_copy`: the
    server saves part of a slot) and no saved state gives all but `min_tokens` of it — and
    is at least `min_tokens` long, worth moving a session for."""
    if session in state.slots.seen or info.n_tokens < min_tokens:
        return False
    if holding and can_copy:
        return False  # copied into an empty slot instead (`bring`)
    source = find(state, conversations, info)
    return info.n_tokens - (source.tokens if source is not None else 0) >= min_tokens


async def bring(
    state: CacheState,
    ops: SlotOps,
    conversations: Conversations,
    info: pfx.PrefixInfo,
    slot: int,
    holding: Sequence[int],
    copy: Copy | None,
) -> None:
    """Before a request whose `slot` does not hold its prefix `info`: copy the prefix from
    an idle slot among `holding` (whose content starts with it) where `copy` can and no
    saved state gives all of it, else restore the longest saved state that gives part of
    it (verified; the request prefills the rest). Nothing when neither exists: the request
    prefills it, and its response saves it (core.cache.prefix_save)."""
    if slot in holding:
        return  # its own content starts with the prefix: the server reuses it from there
    source = find(state, conversations, info)
    if copy is not None and (source is None or source.tokens < info.n_tokens):
        for other in holding:
            held = state.slots.slots[other]
            if other == slot or held.inflight or held.tokens_hint < info.n_tokens:
                continue
            if await copy(info, other, slot):
                log.info(
                    "slot %d: the %d-token prefix copied from slot %d", slot, info.n_tokens, other
                )
                return
    if source is None:
        return
    # Priced from this machine's measured costs (core.cache.costs), as conversations are.
    estimate = ops.costs.estimate(source.rec, source.tokens, rate=state.prefill_rate())
    if not estimate.pays:
        log.info("slot %d: %s not restored: %s", slot, source.describe(info), estimate.words())
        return
    async with ops.lock(slot):
        with contextlib.suppress(VerificationFailed):  # recorded; the request prefills it
            await restore(ops, conversations, source, slot, wait_s=estimate.slack_s)
            log.info("slot %d: restored %s", slot, source.describe(info))


async def restore(
    ops: SlotOps,
    conversations: Conversations,
    source: Source,
    slot: int,
    *,
    wait_s: float | None = None,
) -> None:
    """Restore `source` into `slot` and verify it (the caller holds the slot's lock);
    raise VerificationFailed (recorded, and the state deleted, by the restore). A request
    waits for one with `wait_s` (`SlotOps.restore`)."""
    if source.rec.kind == "conversation":
        await conversations.restore_prefix(source.rec, source.covers, slot, wait_s=wait_s)
    else:
        await ops.restore(source.rec, slot, wait_s=wait_s)
