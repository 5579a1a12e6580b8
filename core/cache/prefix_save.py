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
A written file whose reference probe found no quiet moment (another slot worked through
every try) is kept, journaled, and its reference taken once the server is quiet
(`LATER_WAIT_S`), never dropped for a busy moment.

The same save copies a prefix between slots (`PrefixSaver.copy`): a new session whose
prefix only another session's slot holds gets it from there — saved from that slot, the
file restored into the new session's slot and its reference taken there — instead of a
cold prefill (docs/cache.md#the-shared-prefix-wherever-it-is).
Every save keeps the disk cap (core.cache.retention, `Retention.make_room`): room is made
before it is written, or it is not made (and not built instead); once written, a file
that does not fit after all is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
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
# A written prefix whose reference found no quiet moment keeps trying for this long (under
# the retention's grace for unfinished saves: its journal row is refreshed each try),
# pausing between tries from the first to the last pause, doubling.
LATER_WAIT_S = 540.0
LATER_PAUSE_S = 1.0
LATER_PAUSE_MAX_S = 30.0


@dataclass(frozen=True)
class Written:
    """A prefix file the server wrote and whose token list was checked; not indexed yet."""

    name: str
    saved: dict[str, Any]  # the server's answer to the save
    save_ms: float
    how: str  # for the `save` event: where it came from


class PrefixSaver:
    """Writes prefix states from live slots for one cache manager."""

    def __init__(
        self,
        state: CacheState,
        ops: SlotOps,
        retention: Retention,
        conversations: Conversations,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]] | None = None,
    ) -> None:
        self.state = state
        self.ops = ops
        self.retention = retention
        self.conversations = conversations
        # Why this server cannot save part of a slot ("" while it may): learned from its
        # patch list, or from its first 501, and kept until the server restarts.
        self.refused = ""
        self.counts: dict[str, int] = {"live": 0, "conversation": 0, "deferred": 0, "built": 0}
        # Runs the reference of a written prefix later, as the manager's job (None: a
        # reference that found no quiet moment fails the save, as before).
        self._spawn = spawn
        self._later: dict[str, asyncio.Task[Any]] = {}  # fingerprint → its reference later

    def server_gone(self) -> None:
        """A new server may answer differently; references waiting for a quiet moment of
        the old one end (their files are swept: journaled, never indexed)."""
        self.refused = ""
        for task in self._later.values():
            task.cancel()

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
        if info.fingerprint in self._later:
            return  # written; its reference is taken when the server is quiet
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
        written = Written(name, saved, 0.0, "built in a scratch slot")
        if not await self._record(info, slot, name, saved, how=written.how):
            self._reference_later(info, written)

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
    ) -> bool:
        """Index the just-saved prefix file `name` with its probe reference, taken in
        `slot` (idle, under its lock) after restoring that very file; False (nothing
        indexed, the file kept) when no probe ran alone."""
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
            log.info("prefix %s: no probe reference ran alone yet", info.fingerprint[:16])
            await self.ops.unload(slot, client)  # it holds the unverified file: cleared
            return False
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
        return True

    # ------------------------------------------------------------ 1. part of the slot
    async def _save_prefix(self, info: pfx.PrefixInfo, slot: int) -> bool | None:
        """True: saved and indexed, or left for later; None: the server cannot (501)."""
        m = self.state
        probe_slot = self.ops.scratch_slot(exclude=slot)
        if probe_slot is None and m.slots.n_slots < 2:
            return None  # nowhere to verify it but the live slot: save the conversation
        written = await self._write(info, slot, own=True)
        if not isinstance(written, Written):
            return written
        # The reference is taken after restoring this very file, in an idle slot, so the
        # live slot keeps its conversation (docs/cache.md#verification).
        deadline = time.monotonic() + SCRATCH_WAIT_S
        while probe_slot is None and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            probe_slot = self.ops.scratch_slot(exclude=slot)
        if probe_slot is None:
            why = f"no idle slot to verify it in within {SCRATCH_WAIT_S:.0f} s"
            self.retention.save_failed(info.fingerprint, why, filename=written.name, slot=slot)
            return True
        async with self.ops.lock(probe_slot):
            done = await self._record(
                info, probe_slot, written.name, written.saved, how=written.how
            )
        if not done:
            self._reference_later(info, written)
        self.counts["live"] += 1
        return True

    async def copy(self, info: pfx.PrefixInfo, source: int, target: int) -> bool:
        """Copy the prefix `info` from the idle `source` slot (another session's, whose
        content starts with it) into `target`: a prefix save of `source` — its
        conversation stays — restored into `target`, where its probe reference is taken
        (docs/cache.md#the-shared-prefix-wherever-it-is). True when `target` holds the
        prefix, verified from its own file, which stays on disk like any prefix state;
        False when this server cannot save part of a slot, `source` does not hold the
        prefix (any more), or no reference ran alone (the file's reference is then taken
        later; `target` is cleared). Takes both slots' locks; the caller holds neither."""
        if not self.can_save_prefix() or source == target or info.fingerprint in self._later:
            return False
        written = await self._write(info, source, own=False)
        if not isinstance(written, Written):
            return False
        how = f"copied from live slot {source} into slot {target}, {written.save_ms:.0f} ms"
        async with self.ops.lock(target):
            done = await self._record(info, target, written.name, written.saved, how=how)
            if done:
                st = self.state.slots.slots[target]
                st.promised = (info.n_tokens, f"restored prefix state (copied from slot {source})")
                return True
        self._reference_later(info, written)  # `target` was cleared: never served unverified
        return False

    async def _write(self, info: pfx.PrefixInfo, slot: int, *, own: bool) -> Written | bool | None:
        """Write the first `info.n_tokens` tokens of `slot` to the prefix's file and check
        that it holds exactly them: the file (journaled, not indexed yet), or True when
        the save was left for later or failed (recorded), None when the server cannot
        save part of a slot (501). `own`: the slot's prefix is `info` itself (else the
        file's token list alone decides, as when copying another session's slot)."""
        m = self.state
        client = m.client
        assert client is not None
        name = state_filename(info.fingerprint)
        path = m.store.dir_for(m.launch_id) / name
        async with self.ops.lock(slot):
            st = m.slots.slots[slot]
            moved = own and st.prefix_fp != info.fingerprint
            if st.inflight or moved or st.tokens_hint < info.n_tokens:
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
        how = f"from live slot {slot}, {save_ms:.0f} ms, no prefill"
        return Written(name, saved, save_ms, how)

    def _reference_later(self, info: pfx.PrefixInfo, written: Written) -> None:
        """The file is written and its tokens checked, but no probe ran alone to take its
        reference (a busy server): keep it, journaled, and take the reference when the
        server is quiet — never drop a correct state for a busy moment."""
        if self._spawn is None or info.fingerprint in self._later:
            problem = f"no probe reference ran alone in {REFERENCE_TRIES} tries (a busy server)"
            self.retention.save_failed(info.fingerprint, problem, filename=written.name)
            return
        self._later[info.fingerprint] = self._spawn(self._take_reference_later(info, written))

    async def _take_reference_later(self, info: pfx.PrefixInfo, written: Written) -> None:
        m = self.state
        identity, deadline = m.launch_id, time.monotonic() + LATER_WAIT_S
        pause = LATER_PAUSE_S
        tries = 0
        try:
            while time.monotonic() < deadline:
                await m.slots.wait_quiet(max(1.0, deadline - time.monotonic()))
                if m.identity is None or m.launch_id != identity:
                    self.retention.discard_partial(written.name)  # another server: useless
                    return
                slot = self.ops.scratch_slot()
                if slot is not None and not m.slots.busy():
                    # Refreshed, so that the retention sweep does not take the journaled
                    # file for a save that never finished.
                    self.retention.journal.begin(identity, written.name)
                    async with self.ops.lock(slot):
                        tries += 1
                        how = f"{written.how}; its reference taken later, try {tries}"
                        if await self._record(info, slot, written.name, written.saved, how=how):
                            return
                await asyncio.sleep(pause)
                pause = min(pause * 2, LATER_PAUSE_MAX_S)
            problem = (
                f"no probe reference ran alone within {LATER_WAIT_S:.0f} s of a busy server "
                f"({tries} tries)"
            )
            self.retention.save_failed(info.fingerprint, problem, filename=written.name)
        finally:
            self._later.pop(info.fingerprint, None)

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
