"""What happens when a server becomes ready: learn its identity, decide whether its
slot files can be valid (disk tier), reload the index of saved prefixes, and
bring the most recently used ones back — restored and verified, or prewarmed.

Functions of the `CacheManager` they serve (split out of `core.cache.manager`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.cache import prefix as pfx
from core.cache.fingerprint import ServerIdentity, fingerprint, template_hash
from core.cache.probe import LOGPROB_TOLERANCE, PROBE_SUFFIX, SWA_LOGPROB_TOLERANCE
from core.cache.slots import SlotMap
from core.cache.store import StateRecord
from core.errors import VerificationFailed
from core.server.argv import kv_relevant

if TYPE_CHECKING:
    from core.cache.manager import CacheManager

log = logging.getLogger("warmslot.cache")

RESTORE_AT_START = 3  # most recently used prefixes restored after a (re)start
PATCH_FIELD = "warmslot_patches"
# Patch levels a patched server lists in GET /props (docs/patches.md); exact strings.
PATCH_CHECKPOINTS = "slot-checkpoints-v1"  # SWA/hybrid slot files restore their checkpoints
PATCH_SWA_FULL = "swa-full-state-v1"  # with --swa-full, files keep every SWA cell


@dataclass
class DiskTier:
    usable: bool
    reason: str
    # How far a restored state's probe log-probs may move. Dense models and full SWA
    # state reproduce them exactly; a sliding-window ring buffer restored in another
    # cell order sums in another order (measured up to ~0.15, greedy tokens equal —
    # reference §5), so only the tokens are held exact there.
    logprob_tolerance: float = LOGPROB_TOLERANCE


def disk_tier_for(
    *, swa: bool, recurrent: bool, swa_full: bool, patches: tuple[str, ...]
) -> DiskTier:
    """Whether saved slot files can be valid for this model on this server."""
    if swa and swa_full and PATCH_SWA_FULL not in patches:
        return DiskTier(
            False,
            "sliding-window model with --swa-full on a server without "
            f"Warmslot's {PATCH_SWA_FULL} patch: a restore would silently change "
            "the output (reference §0.2); using RAM cache and re-warming",
        )
    if (swa or recurrent) and PATCH_CHECKPOINTS not in patches:
        kind = "sliding-window" if swa else "recurrent/hybrid"
        return DiskTier(
            False,
            f"{kind} model on a server without Warmslot's checkpoint "
            "patch: slot files restore no reuse or wrong state "
            "(reference §0.1–0.2); using RAM cache and re-warming",
        )
    if swa or recurrent:
        if swa and not swa_full:
            return DiskTier(
                True,
                "patched server persists checkpoints (sliding-window ring: "
                f"probe log-probs within {SWA_LOGPROB_TOLERANCE})",
                SWA_LOGPROB_TOLERANCE,
            )
        return DiskTier(True, "patched server persists checkpoints")
    return DiskTier(True, "dense model")


async def learn_identity(mgr: CacheManager) -> None:
    """Read the running server's identity, disk-tier validity and saved prefixes."""
    client = mgr.client
    sup = mgr.server
    assert client is not None and sup is not None and sup.resolved is not None
    props = await client.props()
    patches = tuple(str(p) for p in props.get(PATCH_FIELD, []) or [])
    mgr.identity = ServerIdentity(
        model=sup.resolved.model.identity,
        binary=sup.resolved.binary.identity,
        kv_flags=kv_relevant(sup.argv),
        chat_template=template_hash(str(props.get("chat_template", ""))),
        patches=patches,
    )
    n = int(props.get("total_slots", mgr.core.settings.server.slots))
    if n != mgr.slots.n_slots:
        mgr.slots = SlotMap(
            n, reserve_aux=mgr.core.settings.cache.aux_slot, clock=mgr.clock.monotonic
        )
    mgr.disk = disk_tier(mgr, sup.resolved.model.path, patches)
    mgr._probe_suffix = await client.tokenize(PROBE_SUFFIX)
    # Prefixes learned under an older identity are re-fingerprinted for this one.
    for info in list(mgr.prefixes.values()):
        info.fingerprint = fingerprint(mgr.identity, info.tokens)
    mgr.by_fp = {i.fingerprint: i for i in mgr.prefixes.values()}
    load_saved(mgr)
    mgr._emit(
        "server_identity",
        "server ready",
        identity=mgr.identity.short,
        disk_tier=mgr.disk.usable,
        disk_reason=mgr.disk.reason,
        patches=list(patches),
    )


def load_saved(mgr: CacheManager) -> None:
    """Know the prefixes saved for this server; drop those its identity invalidates."""
    assert mgr.identity is not None
    for rec in mgr.store.all(mgr.launch_id):
        tokens = rec.probe.get("prefix")
        if not isinstance(tokens, list):
            tokens = []
        fp = fingerprint(mgr.identity, tokens) if tokens else ""
        if fp != rec.fingerprint:
            freed = mgr.store.delete(rec)
            mgr._emit(
                "invalidated",
                "saved for a different server identity (chat "
                "template, build or flags changed); it will be rebuilt once",
                fp=rec.fingerprint,
                tokens=rec.n_tokens,
                nbytes=freed,
            )
            continue
        if fp not in mgr.by_fp:
            mgr.by_fp[fp] = pfx.PrefixInfo(
                key="",
                tokens=tokens,
                text="",
                source=rec.source,
                client=rec.client,
                fingerprint=fp,
                first_seen=rec.created,
            )


def disk_tier(mgr: CacheManager, model_path: Path, patches: tuple[str, ...]) -> DiskTier:
    """Whether slot files can be valid for this model on the running server."""
    if not mgr.core.settings.cache.persist:
        return DiskTier(False, "persistence is off (cache.persist)")
    try:
        from core.server.gguf_facts import read_facts

        facts = read_facts(model_path)
    except Exception as e:  # unknown metadata: trust only the verification
        log.warning("could not read model metadata (%r); relying on verification", e)
        return DiskTier(True, "model type unknown; every restore is verified")
    swa_full = mgr.server is not None and "--swa-full" in mgr.server.argv
    return disk_tier_for(
        swa=any(facts.swa_layers) and facts.n_swa > 0,
        recurrent=any(facts.recurrent_layers),
        swa_full=swa_full,
        patches=patches,
    )


async def warm_known(mgr: CacheManager) -> None:
    """After a (re)start: bring back the most recently used prefixes.

    Restored from disk and verified where the disk tier is valid, else (and for
    sliding-window models on a stock server) prewarmed from their tokens.
    """
    assert mgr.identity is not None
    targets = [s.id for s in mgr.slots.primary_slots][:RESTORE_AT_START]
    saved = {r.fingerprint: r for r in mgr.store.all(mgr.launch_id)}
    infos = sorted(
        mgr.by_fp.values(),
        key=lambda i: (
            not getattr(saved.get(i.fingerprint), "pinned", False),
            -max(i.last_used, getattr(saved.get(i.fingerprint), "last_used", 0)),
        ),
    )[: len(targets)]
    for slot, info in zip(targets, infos, strict=False):
        if mgr.slots.slots[slot].inflight:
            continue
        async with mgr._lock(slot):
            rec = saved.get(info.fingerprint)
            if rec is not None:
                await restore_or_prewarm(mgr, rec, slot)
            else:
                await mgr._prewarm(info, slot, reason="after server start")


async def restore_or_prewarm(mgr: CacheManager, rec: StateRecord, slot: int) -> None:
    """Restore (verified) a saved prefix into `slot`, else prewarm it from its tokens."""
    if not mgr.pressure.allows_prewarm(rec.pinned):
        why = mgr.pressure.paused().get("prewarm", "")
        mgr._emit("prewarm_skipped", why, fp=rec.fingerprint, slot=slot)
        return
    info = mgr.by_fp.get(rec.fingerprint)
    if mgr.disk.usable:
        try:
            await mgr._restore(rec, slot)
            return
        except VerificationFailed:
            pass  # recorded; fall through to a cold prewarm when we know the tokens
    if info is not None:
        await mgr._prewarm(info, slot, reason="after server start")
