"""Saving a stable prefix from what a slot already holds: a disk write, never a prefill.

After a request, the slot that served it holds the stable prefix followed by the
conversation. The prefix's state goes to disk from there:

1. On a server with Warmslot's patch 0004 (``prefix-save-v1`` in ``GET /props``),
   ``POST /slots/N?action=save`` with ``"n_tokens": N`` writes only the first N tokens'
   KV cells. The saved file's token list must equal the prefix (the slot may have
   moved on); then its probe reference is taken after restoring that very file into
   an idle scratch slot, as for every saved state (docs/cache.md#verification), so the
   live slot keeps its conversation. The server refuses (501) a prefix of a
   sliding-window model without ``--swa-full``, of a recurrent/hybrid model, or of a
   slot with context checkpoints: then, and on a server without the patch,
2. the whole conversation the slot holds is saved (core.cache.conversations), and a
   request that extends the prefix restores it (the server keeps the common part).
3. Only where neither can cover the prefix (the slot holds little beyond it, or the
   conversation is too large for the disk cap) is the prefix built again in a scratch
   slot (`PrefixSaver.persist`): the last resort.

A save that would have to wait — the slot is busy again, or no longer holds the prefix —
is left to the next response; no client waits for one and nothing is prefilled for it.
Every save keeps the disk cap (core.cache.retention, `Retention.make_room`): room is made
before it is written, or it is not made (and not built instead); once written, a file
that does not fit after all is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.cache import prefix as pfx
from core.cache.conversation_pick import read_tokens
from core.cache.fingerprint import state_filename
from core.cache.probe import REFERENCE_TRIES, probe_reference, probe_request
from core.cache.saving import save_problem
from core.cache.store import StateRecord, file_sha256
from core.errors import UpstreamError
from core.events import CacheEventKind
from core.status import PrefixSaveStatus

if TYPE_CHECKING:
    from core.cache.conversations import Conversations
    from core.cache.retention import Retention
    from core.cache.slot_ops import SlotOps
    from core.cache.state import CacheState
    from core.server.client import LlamaClient

log = logging.getLogger("warmslot.cache")

PATCH_PREFIX_SAVE = "prefix-save-v1"  # GET /props → warmslot_patches (patches/0004)
SCRATCH_WAIT_S = 30.0  # longest a saved prefix waits for an idle slot to be verified in
BUILD_WAIT_S = 120.0  # longest a prefix to build waits for the scratch slot to be idle


class PrefixSaver:
    """Writes prefix states from live slots for one cache manager."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        retention: Retention,
        conversations: Conversations,
    ) -> None:
        self.state = state
        self.ops = ops
        self.retention = retention
        self.conversations = conversations
        # Why this server cannot save part of a slot ("" while it may): learned from its
        # patch list, or from its first 501, and kept until the server restarts.
        self.refused = ""
        self.counts: dict[str, int] = {"live": 0, "conversation": 0, "deferred": 0, "built": 0}

    def server_gone(self) -> None:
        """A new server may answer differently."""
        self.refused = ""

    def can_save_prefix(self) -> bool:
        """Whether the running server can save the first N tokens of a slot."""
        ident = self.state.identity
        return ident is not None and PATCH_PREFIX_SAVE in ident.patches and not self.refused

    async def save(self, info: pfx.PrefixInfo, slot: int) -> bool:
        """Put `info` on disk from `slot`, which just served a request with it.

        True when that is done or left for later without a prefill (saved from the slot,
        covered by the conversation's saved state, or the slot busy now); False when only
        building the prefix in a scratch slot can do it.
        """
        if self.can_save_prefix():
            done = await self._save_prefix(info, slot)
            if done is not None:
                return done
        return await self._cover_with_conversation(info, slot)

    async def persist(self, info: pfx.PrefixInfo, live: int | None = None) -> None:
        """Get the prefix state onto disk: from the `live` slot that holds it (no prefill),
        or as the last resort built in a scratch slot; saved, then its probe answer
        recorded. A failure is recorded (core.cache.retention), never raised."""
        m = self.state
        try:
            if not m.pressure.allows_persist():
                why = m.pressure.paused().get("persist", "")
                m.emit(CacheEventKind.PERSIST_SKIPPED, why, fp=info.fingerprint)
                return
            if live is not None and await self.save(info, live):
                return  # saved, covered by the conversation's state, or left for later
            if not self._room(info):
                return  # not built for a save that would not fit under the disk cap
            slot = self.ops.scratch_slot()
            deadline = time.monotonic() + BUILD_WAIT_S
            while slot is None and time.monotonic() < deadline:
                # The scratch slot is busy (a side call): wait for it rather than give up.
                await asyncio.sleep(0.25)
                slot = self.ops.scratch_slot()
            client = m.client
            if slot is None or client is None or m.identity is None:
                m.emit(
                    CacheEventKind.PERSIST_SKIPPED,
                    f"no idle scratch slot within {BUILD_WAIT_S:.0f} s;"
                    " the next request with this prefix tries again",
                    fp=info.fingerprint,
                )
                return
            async with self.ops.lock(slot):
                await self._build(info, slot, client)
        except (UpstreamError, OSError) as e:
            # After an answer (an HTTP error) the server no longer writes: its partial file
            # goes now. After a timeout it may still write: the retention sweep deletes it.
            answered = not isinstance(e, UpstreamError) or e.status != 0
            name = state_filename(info.fingerprint)
            self.retention.save_failed(
                info.fingerprint, str(e), filename=name, server_answered=answered
            )

    async def _build(self, info: pfx.PrefixInfo, slot: int, client: LlamaClient) -> None:
        """3. The last resort: read the prefix into the idle `slot`, save and index it."""
        m = self.state
        await self.ops.prewarm(info, slot, reason="building the state to save")
        name = state_filename(info.fingerprint)
        self.retention.journal.begin(m.launch_id, name)  # a save that never ends is swept
        saved = await client.slot_action(slot, "save", name)
        path = m.store.dir_for(m.launch_id) / name
        problem = save_problem(saved, info.n_tokens, path)
        if problem is None:
            problem = self._fits(info, path)
        if problem is not None:
            self.retention.save_failed(info.fingerprint, problem, filename=name, slot=slot)
            return
        await self._record(info, slot, name, saved, how="built in a scratch slot")

    def _room(self, info: pfx.PrefixInfo) -> bool:
        """Before a save: room under the disk cap for its estimated size (what must go
        for it, by the retention rules, goes now); False, recorded, when it cannot fit."""
        estimate = self.retention.estimate_bytes(info.n_tokens)
        full = self.retention.make_room(estimate, f"the {info.n_tokens}-token prefix")
        if full is not None:
            name = state_filename(info.fingerprint)
            self.retention.save_failed(info.fingerprint, full, filename=name)
        return full is None

    def _fits(self, info: pfx.PrefixInfo, path: Path) -> str | None:
        """Once written: its real size, with the other saves under way, under the cap
        (None), or why not (the caller deletes the file: `save_failed`)."""
        what = f"the {info.n_tokens}-token prefix"
        size = path.stat().st_size + self.retention.record_bytes(info.n_tokens)
        return self.retention.make_room(size, what, written=path.name)

    async def _record(
        self, info: pfx.PrefixInfo, slot: int, name: str, saved: dict[str, Any], *, how: str
    ) -> None:
        """Index the just-saved prefix file `name` with its probe reference, taken in
        `slot` (idle, under its lock) after restoring that very file."""
        m = self.state
        client = m.client
        assert client is not None and m.probe_suffix is not None
        path = m.store.dir_for(m.launch_id) / name
        await self.ops.wait_idle(exclude=slot)
        # The reference comes from the file as a restore lays it out, so that a later
        # restore reproduces it bit for bit, sliding-window ring included
        # (docs/cache.md#verification).
        # A reference taken while another slot works shares its batches and moves in the
        # last bits, and every later bit-exact check of this correct state would fail (seen
        # with prefixes saved from a live slot while the session's next request started, and
        # beside a conversation's own reference): it must come from a probe that ran alone
        # (core.cache.probe.ProbeGate); a state without such a reference is not indexed.
        answer, _ = await self.ops.probe_gate.reference(
            client,
            probe_request(info.tokens, m.probe_suffix, slot),
            slot,
            lambda: client.slot_action(slot, "restore", name),
        )
        if answer is None:
            problem = f"no probe reference ran alone in {REFERENCE_TRIES} tries (a busy server)"
            self.retention.save_failed(info.fingerprint, problem, filename=name, slot=slot)
            return
        now = m.clock.time()
        rec = StateRecord(
            filename=name,
            identity=m.launch_id,
            fingerprint=info.fingerprint,
            client=info.client,
            source=info.source,
            prefix_n=info.n_tokens,
            n_tokens=int(saved["n_saved"]),
            bytes=path.stat().st_size,
            sha256=file_sha256(path),
            ttl_class=m.settings.cache.prefix_class,
            pinned=False,
            created=now,
            last_used=now,
            verified_at=now,
            verify_result="reference",
            probe={"prefix": info.tokens, "suffix": m.probe_suffix, **probe_reference(answer)},
            owner=m.prefix_owners.get(info.fingerprint, ""),
        )
        m.store.add(rec)
        self.retention.journal.end(name)
        self.retention.save_succeeded(info.fingerprint)
        st = m.slots.slots[slot]  # it holds the prefix (and the probe's suffix) now
        st.prefix_fp, st.tokens_hint = info.fingerprint, info.n_tokens
        m.emit(
            CacheEventKind.SAVE,
            f"saved the {info.n_tokens}-token prefix ({how})",
            fp=info.fingerprint,
            slot=slot,
            tokens=info.n_tokens,
            nbytes=rec.bytes,
            save_ms=(saved.get("timings") or {}).get("save_ms"),
            how=how,
        )

    # ------------------------------------------------------------ 1. part of the slot
    async def _save_prefix(self, info: pfx.PrefixInfo, slot: int) -> bool | None:
        """True: saved and indexed, or left for later; None: the server cannot (501)."""
        m = self.state
        client = m.client
        assert client is not None
        probe_slot = self.ops.scratch_slot(exclude=slot)
        if probe_slot is None and m.slots.n_slots < 2:
            return None  # nowhere to verify it but the live slot: save the conversation
        name = state_filename(info.fingerprint)
        path = m.store.dir_for(m.launch_id) / name
        async with self.ops.lock(slot):
            st = m.slots.slots[slot]
            if st.inflight or st.prefix_fp != info.fingerprint or st.tokens_hint < info.n_tokens:
                self.counts["deferred"] += 1
                return True  # it moved on: the next response with this prefix tries again
            if not self._room(info):
                return True  # over the disk cap: recorded, backed off, never built instead
            self.retention.journal.begin(m.launch_id, name)  # a save that never ends is swept
            t0 = time.perf_counter()
            try:
                saved = await client.slot_action(slot, "save", name, n_tokens=info.n_tokens)
            except UpstreamError as e:
                if e.status == 400:  # it holds fewer tokens than the prefix now
                    self.retention.discard_partial(name)
                    self.counts["deferred"] += 1
                    return True
                if e.status != 501:
                    raise  # the manager records the failure and backs off
                self.retention.discard_partial(name)  # the server wrote nothing
                self.refused = f"llama-server refused a prefix save ({e.status}): {e}"
                log.info("prefix saves from live slots are off for this server: %s", e)
                m.emit(
                    CacheEventKind.PERSIST_SKIPPED,
                    f"{self.refused}; saving whole conversations instead",
                    fp=info.fingerprint,
                    slot=slot,
                )
                return None
            save_ms = (time.perf_counter() - t0) * 1000
            problem = save_problem(saved, info.n_tokens, path)
            if problem is None:
                try:
                    held = await asyncio.to_thread(read_tokens, path)
                except (OSError, ValueError) as e:
                    problem = f"cannot read the saved prefix: {e}"
                else:
                    if held != info.tokens:
                        # Not a failure: the slot's content moved on (our hint was stale).
                        self.retention.discard_partial(name)
                        where = pfx.common_prefix_len(held, info.tokens)
                        log.info(
                            "slot %d no longer held prefix %s (differs at token %d)",
                            slot,
                            info.fingerprint[:16],
                            where,
                        )
                        self.counts["deferred"] += 1
                        return True
                    problem = self._fits(info, path)
            if problem is not None:
                self.retention.save_failed(info.fingerprint, problem, filename=name, slot=slot)
                return True
        # The reference is taken after restoring this very file, in an idle slot, so the
        # live slot keeps its conversation (docs/cache.md#verification).
        deadline = time.monotonic() + SCRATCH_WAIT_S
        while probe_slot is None and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            probe_slot = self.ops.scratch_slot(exclude=slot)
        if probe_slot is None:
            why = f"no idle slot to verify it in within {SCRATCH_WAIT_S:.0f} s"
            self.retention.save_failed(info.fingerprint, why, filename=name, slot=slot)
            return True
        async with self.ops.lock(probe_slot):
            await self._record(
                info,
                probe_slot,
                name,
                saved,
                how=f"from live slot {slot}, {save_ms:.0f} ms, no prefill",
            )
        self.counts["live"] += 1
        return True

    # ------------------------------------------------------------ 2. the whole slot
    async def _cover_with_conversation(self, info: pfx.PrefixInfo, slot: int) -> bool:
        """Save the conversation `slot` holds; True when it covers the prefix now or a
        later response will try again, False when it cannot (build the prefix)."""
        if self.conversations.unsaved(slot) <= 0 and self.conversations.covering(info) is None:
            return False  # the slot holds (little more than) the prefix: nothing to save
        out = await self.conversations.save(slot, "its stable prefix is not on disk", wait=False)
        if self.conversations.covering(info) is not None:
            self.counts["conversation"] += 1
            return True
        if out.startswith("not saved now"):
            self.counts["deferred"] += 1
            return True  # busy: the next response, the idle release or the shutdown saves it
        log.info("prefix %s: conversation not saved (%s); building it", info.fingerprint[:16], out)
        self.counts["built"] += 1
        return False

    def status(self) -> PrefixSaveStatus:
        """How prefixes reached the disk since start (for `warmslot status`)."""
        c = self.counts
        return {
            "live_prefix_save": self.can_save_prefix(),
            "refused": self.refused,
            "live": c["live"],
            "conversation": c["conversation"],
            "deferred": c["deferred"],
            "built": c["built"],
        }
