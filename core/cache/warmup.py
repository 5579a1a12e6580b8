"""What happens when a server becomes ready: learn its identity, decide whether its
slot files can be valid (disk tier), reload the learned prefix definitions and
the index of saved prefixes, and bring the most recently used ones back —
restored and verified, or prewarmed from their tokens (the boot re-warm,
`core.cache.boot`).

Each works on the explicit `CacheState` of the server (core.cache.state) and, where it
fills slots, its `SlotOps` (core.cache.slot_ops); `read_server` only reads, and the
manager hands its answer to `CacheState.server_ready`.
"""

from __future__ import annotations

import logging
import sqlite3
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final

from core.cache import prefix as pfx
from core.cache import sources
from core.cache.boot import BootStep, Warmed
from core.cache.definitions import PrefixDefinition
from core.cache.deps import DiskTier as DiskTier
from core.cache.fingerprint import ServerIdentity, fingerprint, template_hash
from core.cache.probe import PROBE_SUFFIX, SWA_LOGPROB_TOLERANCE
from core.cache.state import ServerFacts
from core.cache.store import StateRecord
from core.errors import VerificationFailed
from core.events import CacheEventKind
from core.server.argv import kv_relevant
from core.server.client import Props

if TYPE_CHECKING:
    from core.cache.boot import BootRewarm
    from core.cache.conversations import Conversations
    from core.cache.learner import PrefixLearner
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState


log = logging.getLogger("warmslot.cache")

RESTORE_AT_START = 3  # most recently used prefixes restored after a (re)start
LOAD_AT_START = 10  # most recently used prefix definitions known again after a start
# The boot re-warm fills a slot this many tokens per request (the default ubatch), so a
# client request that stops it waits for at most one such prefill (core.cache.boot).
BOOT_CHUNK_TOKENS = 512
PATCH_FIELD: Final = "warmslot_patches"
# Patch levels a patched server lists in GET /props (docs/patches.md); exact strings.
PATCH_CHECKPOINTS = "slot-checkpoints-v1"  # SWA/hybrid slot files restore their checkpoints
PATCH_SWA_FULL = "swa-full-state-v1"  # with --swa-full, files keep every SWA cell


def disk_tier_for(
    *, swa: bool, recurrent: bool, swa_full: bool, patches: tuple[str, ...]
) -> DiskTier:
    """Whether saved slot files can be valid for this model on this server."""
    if swa and swa_full and PATCH_SWA_FULL not in patches:
        return DiskTier(
            False,
            "sliding-window model with --swa-full on a server without "
            f"Warmslot's {PATCH_SWA_FULL} patch: a restore would silently change "
            "the output (docs/llama-server-facts.md#swa-full-restores-wrong-state); "
            "using RAM cache and re-warming",
            rewinds=True,
        )
    if (swa or recurrent) and PATCH_CHECKPOINTS not in patches:
        kind = "sliding-window" if swa else "recurrent/hybrid"
        return DiskTier(
            False,
            f"{kind} model on a server without Warmslot's checkpoint "
            "patch: slot files restore no reuse or wrong state "
            "(docs/llama-server-facts.md#swa-slot-files-reuse-nothing); "
            "using RAM cache and re-warming",
            rewinds=True,
        )
    if swa or recurrent:
        if swa and not swa_full:
            return DiskTier(
                True,
                "patched server persists checkpoints (the sliding-window ring restores "
                "bit-exact: docs/cache.md#verification)",
                SWA_LOGPROB_TOLERANCE,
                rewinds=True,
            )
        return DiskTier(True, "patched server persists checkpoints", rewinds=True)
    return DiskTier(True, "dense model")


async def read_server(state: CacheState) -> ServerFacts:
    """Read the running server's identity, slot count, disk-tier validity and the
    known-answer probe's tokens."""
    client = state.client
    sup = state.server
    assert client is not None and sup is not None and sup.resolved is not None
    props = await client.props()
    patches = tuple(str(p) for p in props.get(PATCH_FIELD, []) or [])
    identity = ServerIdentity(
        model=sup.resolved.model.identity,
        binary=sup.resolved.binary.identity,
        kv_flags=kv_relevant(sup.argv),
        chat_template=template_hash(str(props.get("chat_template", ""))),
        patches=patches,
    )
    return ServerFacts(
        identity=identity,
        n_slots=int(props.get("total_slots", state.settings.server.launch_slots)),
        disk=disk_tier(state, sup.resolved.model.path, patches),
        probe_suffix=await client.tokenize(PROBE_SUFFIX),
        n_ctx=slot_context(props),
    )


def know_prefixes(state: CacheState, learner: PrefixLearner, facts: ServerFacts) -> None:
    """After `CacheState.server_ready`: know the prefixes and saved states that fit the
    server, and say it is ready (a ``server_identity`` event)."""
    ident = facts.identity
    # Prefixes learned under an older identity of the same model and template are
    # re-fingerprinted for this one; another model's are forgotten (`PrefixLearner.adopt`):
    # its definitions and saved states stay on disk for when it runs again.
    learner.adopt(ident)
    for info in list(learner.prefixes.values()):
        info.fingerprint = fingerprint(ident, info.tokens)
    state.by_fp = {i.fingerprint: i for i in learner.prefixes.values()}
    try:
        loaded = load_definitions(state, learner.prefixes, facts.n_ctx)
    except sqlite3.Error:  # the index is damaged: serve on, cold, and say so in the log
        log.exception("could not read the stored prefix definitions")
        loaded = 0
    load_saved(state)
    state.emit(
        CacheEventKind.SERVER_IDENTITY,
        "server ready",
        identity=ident.short,
        disk_tier=state.disk.usable,
        disk_reason=state.disk.reason,
        patches=list(ident.patches),
        definitions_loaded=loaded,
    )


def slot_context(props: Props) -> int | None:
    """Tokens one slot holds, as the server reports it (None when it does not say)."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None


def load_definitions(
    state: CacheState, prefixes: dict[str, pfx.PrefixInfo], n_ctx: int | None
) -> int:
    """Know again the prefixes learned before (by an earlier run of Warmslot too).

    Only definitions for this model file and chat template are loaded, the most
    recently used first, and only those that fit a slot. Each gets the fingerprint
    of the running server; prefixes already known (same tokens) are kept as they
    are. Per request shape the longest prefix answers, as when it was learned.
    `prefixes` are the learner's, by request shape. Returns how many became known.
    """
    book = state.definitions
    ident = state.identity
    if book is None or ident is None:
        return 0
    defs = book.load(ident.model, ident.chat_template, LOAD_AT_START)
    if book.ignored:
        state.emit(
            CacheEventKind.DEFINITIONS_IGNORED,
            f"{book.ignored} stored prefix definitions were damaged; deleted",
        )
    loaded = 0
    for d in defs:
        if n_ctx is not None and d.n_tokens >= n_ctx:
            continue  # longer than a slot of this server; kept for a server that fits it
        info = info_for(d, fingerprint(ident, d.tokens))
        if info.fingerprint in state.by_fp:
            continue
        state.by_fp[info.fingerprint] = info
        loaded += 1
        known = prefixes.get(d.shape_key) if d.shape_key else None
        if d.shape_key and (known is None or known.n_tokens < info.n_tokens):
            prefixes[d.shape_key] = info
    return loaded


def info_for(d: PrefixDefinition, fp: str) -> pfx.PrefixInfo:
    """The in-memory prefix for a stored definition, fingerprinted as `fp`."""
    return pfx.PrefixInfo(
        key=d.shape_key,
        tokens=list(d.tokens),
        text="",
        source=d.source,
        client=d.client,
        fingerprint=fp,
        first_seen=d.first_seen,
        last_used=d.last_used,
        meta=_meta(d),
    )


def _meta(d: PrefixDefinition) -> pfx.PrefixMeta:
    # A count the definition does not know (0) is left out: its readers take an absent
    # key as unknown, as they took the None it used to hold.
    meta = pfx.PrefixMeta(definition=d.id)
    if d.rendered_tokens:
        meta["rendered_tokens"] = d.rendered_tokens
    if d.head_n:
        meta["head_n"] = d.head_n
    return meta


def load_saved(state: CacheState) -> None:
    """Know the prefixes saved for this server; drop those its identity invalidates."""
    assert state.identity is not None
    for rec in state.store.all(state.launch_id):
        tokens = rec.probe.get("prefix")
        if not isinstance(tokens, list):
            tokens = []
        fp = fingerprint(state.identity, tokens) if tokens else ""
        if fp != rec.fingerprint:
            try:
                freed = state.store.delete(rec)
            except OSError as e:  # undeletable: forget its row (never offered again), say so
                state.store.table.delete_where("filename = ?", [rec.filename])
                state.emit(
                    CacheEventKind.UNDELETABLE,
                    f"could not delete {rec.filename} ({e}); it is never used again",
                    fp=rec.fingerprint,
                    file=rec.filename,
                    error=str(e),
                )
                freed = 0
            state.emit(
                CacheEventKind.INVALIDATED,
                "saved for a different server identity (chat "
                "template, build or flags changed); it will be rebuilt once",
                fp=rec.fingerprint,
                tokens=rec.n_tokens,
                nbytes=freed,
            )
            continue
        if rec.kind != "prefix":
            continue  # a conversation state (core.cache.conversations), not a prefix
        if fp not in state.by_fp:
            info = pfx.PrefixInfo(
                key="",
                tokens=tokens,
                text="",
                source=rec.source,
                client=rec.client,
                fingerprint=fp,
                first_seen=rec.created,
            )
            state.by_fp[fp] = info
            # A state saved before definitions were kept: keep its definition too, so
            # it can still be prewarmed when its file is gone or fails verification.
            state.remember(info)


def disk_tier(state: CacheState, model_path: Path, patches: tuple[str, ...]) -> DiskTier:
    """Whether slot files can be valid for this model on the running server."""
    if not state.settings.cache.persist:
        return DiskTier(False, "persistence is off (cache.persist)")
    try:
        from core.server.gguf_facts import read_facts

        facts = read_facts(model_path)
    except Exception as e:  # unknown metadata: trust only the verification
        log.warning("could not read model metadata (%r); relying on verification", e)
        return DiskTier(True, "model type unknown; every restore is verified")
    swa_full = state.server is not None and "--swa-full" in state.server.argv
    return disk_tier_for(
        swa=any(facts.swa_layers) and facts.n_swa > 0,
        recurrent=any(facts.recurrent_layers),
        swa_full=swa_full,
        patches=patches,
    )


def boot_steps(state: CacheState, conversations: Conversations) -> list[BootStep]:
    """Which prefix goes into which slot after a start: pinned first, then the most
    recently used (by request, or by its saved state), one per primary slot. A prefix
    with no state of its own is restored from a saved conversation that starts with it
    (core.cache.prefix_save), where there is one."""
    targets = [s.id for s in state.slots.primary_slots][:RESTORE_AT_START]
    saved = {r.fingerprint: r for r in state.store.all(state.launch_id)}
    infos = sorted(
        state.by_fp.values(),
        key=lambda i: (
            not getattr(saved.get(i.fingerprint), "pinned", False),
            -max(i.last_used, getattr(saved.get(i.fingerprint), "last_used", 0)),
        ),
    )[: len(targets)]
    covering = conversations.covering if state.disk.usable else (lambda _: None)
    return [
        BootStep(slot, info, saved.get(info.fingerprint) or covering(info))
        for slot, info in zip(targets, infos, strict=False)
    ]


async def warm_known(
    state: CacheState, ops: SlotOps, boot: BootRewarm, conversations: Conversations
) -> None:
    """After a (re)start: bring back the most recently used prefixes (the boot re-warm).

    Restored from disk and verified where the disk tier is valid (the longest saved state
    each prefix starts with, `warm_step`), else (and for sliding-window models on a stock
    server, or prefixes never saved) prewarmed from their tokens. Client requests go first
    (`core.cache.boot`).
    """
    assert state.identity is not None
    await boot.run(boot_steps(state, conversations), partial(warm_step, state, ops, conversations))


async def warm_step(
    state: CacheState, ops: SlotOps, conversations: Conversations, step: BootStep
) -> Warmed | None:
    """Warm one boot step under its slot's lock from the cheapest source: the longest
    verified state on disk that the prefix starts with (its own prefix state, a saved
    conversation, or a shorter prefix state, the rest then prefilled: core.cache.sources),
    else a prefill from its tokens. How it was warmed; None when skipped (busy, pressure)."""
    if state.slots.slots[step.slot].inflight:
        return None  # a request runs there already
    info, slot = step.info, step.slot
    async with ops.lock(slot):
        source = sources.find(state, conversations, info)
        pinned = source.rec.pinned if source is not None else False
        if not state.pressure.allows_prewarm(pinned):
            why = state.pressure.paused().get("prewarm", "")
            state.emit(CacheEventKind.PREWARM_SKIPPED, why, fp=info.fingerprint, slot=slot)
            return None
        restored, rejected = 0, ""
        if source is not None:
            try:
                await sources.restore(ops, conversations, source, slot)
                restored = source.tokens
            except VerificationFailed as e:
                rejected = f" (its {source.kind} was rejected: {e})"  # recorded, deleted
        if restored >= info.n_tokens:
            assert source is not None
            return Warmed(source.kind, restored, 0, f"restored {source.describe(info)}")
        reason = "after server start"
        if restored:
            reason += f": the rest after the restored {restored}-token state"
        # Chunked only into an empty slot (`SlotOps.prewarm`): the rest after a restore
        # is one request.
        t = await ops.prewarm(info, slot, reason=reason, chunk=BOOT_CHUNK_TOKENS)
        prefilled = t.prompt_n if t is not None else 0
        if restored and source is not None:
            # The next request should reuse the restored state, and says it was restored.
            st = state.slots.slots[slot]
            st.promised = (restored, f"restored {source.kind} and prefilled the rest")
            text = (
                f"restored the {restored}-token {source.kind} and prefilled the other "
                f"{prefilled} of the prefix's {info.n_tokens} tokens"
            )
            return Warmed(source.kind, restored, prefilled, text)
        text = f"prefilled {prefilled} of {info.n_tokens} tokens: no verified state on disk"
        if rejected:
            text = f"prefilled {prefilled} of {info.n_tokens} tokens{rejected}"
        elif not state.disk.usable:
            text = f"prefilled {prefilled} of {info.n_tokens} tokens: {state.disk.reason}"
        return Warmed("prefill", 0, prefilled, text)


async def restore_or_prewarm(
    state: CacheState,
    ops: SlotOps,
    conversations: Conversations,
    rec: StateRecord,
    slot: int,
    *,
    chunk: int = 0,
    info: pfx.PrefixInfo | None = None,
) -> bool:
    """Restore (verified) a saved prefix into `slot`, else prewarm it from its tokens
    (`chunk` tokens per request into an empty slot, see `SlotOps.prewarm`).
    `rec` may be a saved conversation that starts with the prefix `info`.

    Returns whether the slot now holds the prefix.
    """
    if not state.pressure.allows_prewarm(rec.pinned):
        why = state.pressure.paused().get("prewarm", "")
        state.emit(CacheEventKind.PREWARM_SKIPPED, why, fp=rec.fingerprint, slot=slot)
        return False
    info = info or state.by_fp.get(rec.fingerprint)
    if state.disk.usable:
        try:
            if rec.kind == "conversation" and info is not None:
                await conversations.restore_prefix(rec, info, slot)
            else:
                await ops.restore(rec, slot)
            return True
        except VerificationFailed:
            pass  # recorded; fall through to a cold prewarm when we know the tokens
    if info is not None:
        await ops.prewarm(info, slot, reason="after server start", chunk=chunk)
        return True
    return False
