"""What Warmslot itself does to a slot: `SlotOps`.

Prewarm a prefix into a slot, restore a saved state and verify it with its
known-answer probe (and clear the slot when the probe fails or cannot run), read a
stable prefix alone before its request (for a checkpoint there), save a prefix in
the background, and the per-slot locks that keep client requests out while one of
these runs. Each works on an explicit `CacheState` (core.cache.state); what decides
*when* to do them — the request path's policy — stays in `core.cache.manager`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, cast

from core.cache import prefix as pfx
from core.cache.costs import Costs
from core.cache.probe import (
    QUIET_WAIT_S,
    REFERENCE_TRIES,
    REUSE_SLACK,
    ProbeGate,
    ProbeRecord,
    ProbeRun,
    check_answer,
    non_finite,
    probe_reference,
    probe_request,
    probe_request_for,
    scrub_request,
    second_look,
)
from core.cache.state import CacheState
from core.cache.store import PENDING, StateRecord
from core.chat import JsonObject
from core.errors import UpstreamError, VerificationFailed
from core.events import CacheEventKind
from core.server.client import CompletionAnswer, LlamaClient, Timings

log = logging.getLogger("warmslot.cache")

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


def prewarm_body(tokens: list[int], slot: int) -> JsonObject:
    """The ``/completion`` body that (re-)warms `slot` with exactly `tokens`.

    ``n_predict`` 0 keeps only the prompt in the slot's KV (no generated token after
    it), ``cache_prompt`` reuses what the slot already holds, and only the timings
    and cached-token count come back. Every prewarm and keep-alive sends this.
    """
    return {
        "prompt": tokens,
        "n_predict": 0,
        "id_slot": slot,
        "cache_prompt": True,
        "response_fields": ["timings", "tokens_cached"],
    }


class SlotOps:
    """Slot operations on one `CacheState`.

    Saving is the prefix saver's (core.cache.prefix_save) and discarding a rejected
    state retention's (core.cache.retention): both are handed in as callables, so
    this module needs neither, and `spawn` runs background work as the manager's job.
    """

    def __init__(
        self,
        state: CacheState,
        *,
        save: Callable[[pfx.PrefixInfo, int | None], Awaitable[None]],
        may_save: Callable[[str], bool],
        discard: Callable[[StateRecord, str], int],
        spawn: Spawn,
    ) -> None:
        self.state = state
        self._save = save  # get one prefix state onto disk (PrefixSaver.persist)
        self._may_save = may_save  # False while a fingerprint's saves back off
        self._discard = discard  # delete (or quarantine) a rejected state; bytes freed
        self._spawn = spawn
        # Held while Warmslot itself uses a slot (restore + verify, build + save + probe):
        # a request for that slot waits, so nothing slips in between our steps.
        self._locks: dict[int, asyncio.Lock] = {}
        self.probe_gate = ProbeGate()  # one probe at a time, each knowing if it ran alone
        self.costs = Costs()  # this server's measured restore, hash and probe costs
        self._persisting: set[str] = set()

    # ------------------------------------------------------------ locks
    def lock(self, slot: int) -> asyncio.Lock:
        """Held while Warmslot itself uses `slot` (restore + verify, build + save + probe):
        a request for that slot waits, so nothing slips in between our steps."""
        return self._locks.setdefault(slot, asyncio.Lock())

    def busy(self) -> bool:
        """Whether Warmslot holds any slot's lock now."""
        return any(lk.locked() for lk in self._locks.values())

    # ------------------------------------------------------------ saves
    @property
    def persisting(self) -> frozenset[str]:
        """Fingerprints of the prefixes being saved in the background now."""
        return frozenset(self._persisting)

    def persist_soon(self, info: pfx.PrefixInfo, slot: int | None = None) -> bool:
        """Save the prefix in the background unless a save of it is under way; from
        `slot`, which just served it, where that can be done without a prefill
        (core.cache.prefix_save)."""
        if info.fingerprint in self._persisting:
            return False
        if not self._may_save(info.fingerprint):
            return False  # its last save failed: wait out the backoff (core.cache.retention)
        self._persisting.add(info.fingerprint)
        self._spawn(self._persist(info, slot))
        return True

    async def persist_now(self, info: pfx.PrefixInfo, slot: int | None = None) -> None:
        """Save the prefix now (from `slot` where it can), counted among the saves under way."""
        self._persisting.add(info.fingerprint)
        await self._persist(info, slot)

    async def _persist(self, info: pfx.PrefixInfo, live: int | None = None) -> None:
        """Get the prefix state onto disk; a later request may start another save of it
        once this one ended."""
        try:
            await self._save(info, live)
        finally:
            self._persisting.discard(info.fingerprint)

    # ------------------------------------------------------------ prewarm
    async def prewarm(
        self, info: pfx.PrefixInfo, slot: int, *, reason: str, chunk: int = 0
    ) -> Timings | None:
        """Fill `slot` with exactly the prefix (n_predict 0 keeps only the prompt in KV).

        With `chunk`, a slot known to be empty is filled `chunk` tokens at a time, each
        request extending the one before (the server reuses it, sliding-window models
        included). llama-server notices a cancelled request only between batches
        (2,048 tokens by default; measured ~8 s for Gemma 3 270M on 2 cores), so this
        bounds how long a client request that stops the boot re-warm waits for the slot.
        """
        state = self.state
        client = state.client
        if client is None:
            return None
        st = state.slots.slots[slot]
        ends = [info.n_tokens]
        if chunk > 0 and not st.tokens_hint:  # a shorter prompt would cut a slot's content
            ends = [*range(chunk, info.n_tokens, chunk), info.n_tokens]
        first: Timings | None = None
        prompt_n, prompt_ms = 0, 0.0
        for end in ends:
            resp = await client.completion(prewarm_body(info.tokens[:end], slot))
            t = Timings.parse(resp.get("timings"))
            first = first or t
            prompt_n += t.prompt_n if t else 0
            prompt_ms += t.prompt_ms if t else 0.0
        # What was reused is what the first request found; the cost is every request's.
        total = first
        if first is not None and len(ends) > 1:
            total = Timings(first.cache_n, prompt_n, round(prompt_ms, 3), 0, 0.0)
        st.prefix_fp = info.fingerprint
        st.tokens_hint = info.n_tokens
        st.promised = (info.n_tokens, "re-warmed prefix")
        hit = total is not None and total.cache_n >= info.n_tokens - REUSE_SLACK - 4
        state.emit(
            CacheEventKind.PREWARM_HIT if hit else CacheEventKind.PREWARM_COLD,
            reason,
            fp=info.fingerprint,
            slot=slot,
            tokens=info.n_tokens,
            cache_n=total.cache_n if total else None,
            prompt_n=total.prompt_n if total else None,
            prompt_ms=total.prompt_ms if total else None,
            requests=len(ends),
        )
        return total

    async def read_prefix_alone(
        self,
        info: pfx.PrefixInfo,
        slot: int,
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> Timings | None:
        """Read the stable prefix alone into `slot` just before its request, so that the
        server takes a checkpoint at its end (core.cache.boundary); the timings of that
        read, None when it failed (the request then goes on as it came) or when the
        client hung up first (`gone` returned): closing the read stops the server's
        prefill, as the request's own would have (the proxy then answers 499)."""
        client = self.state.client
        if client is None:
            return None
        async with self.lock(slot):
            read = asyncio.ensure_future(client.completion(prewarm_body(info.tokens, slot)))
            watch = asyncio.ensure_future(gone()) if gone is not None else None
            waits: set[asyncio.Future[Any]] = {read} if watch is None else {read, watch}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if watch is not None:
                    watch.cancel()
                if not read.done():
                    read.cancel()
            try:
                resp = await read
            except asyncio.CancelledError:
                if read.cancelled():  # the client left: no need to read anything for it
                    log.info("slot %d: the client left while its prefix was read", slot)
                    return None
                raise
            except (UpstreamError, OSError) as e:  # fail open: the request reads it itself
                log.warning("could not read the prefix alone into slot %d: %s", slot, e)
                return None
        log.debug("slot %d: read the %d-token prefix alone first", slot, info.n_tokens)
        return Timings.parse(resp.get("timings"))

    # ------------------------------------------------------------ idle slots
    async def wait_idle(self, exclude: int, timeout: float = 30.0) -> None:
        """Wait until no other slot is busy: a probe's log-probs depend on the batch it
        shares with other requests, so reference and check must both run alone."""
        if not await self.state.slots.wait_quiet(timeout, exclude=exclude):
            log.warning("probing while other requests run: verification may be noisy")

    def scratch_slot(self, exclude: int | None = None) -> int | None:
        """An idle slot no session holds (the side-call slot first), other than `exclude`."""
        slots = self.state.slots
        aux = slots.aux_slot
        if aux is not None and aux != exclude and slots.slots[aux].inflight == 0:
            return aux
        idle = [
            s for s in slots.primary_slots if s.inflight == 0 and not s.session and s.id != exclude
        ]
        return idle[0].id if idle else None

    # ------------------------------------------------------------ references
    async def reference(
        self, name: str, tokens: list[int], slot: int, *, tries: int = REFERENCE_TRIES
    ) -> tuple[CompletionAnswer | None, list[float], float]:
        """Restore the file `name` (holding `tokens`) into `slot`, probe it until a probe
        ran alone, and erase the slot: the reference answer (None when no probe ran
        alone), every probe's time and the first restore's (ms). The caller holds the
        slot's lock."""
        client, suffix = self.state.client, self.state.probe_suffix
        assert client is not None and suffix is not None
        # The reference comes from the file as a restore lays it out, from a probe that had
        # the server to itself (core.cache.probe.ProbeGate, docs/cache.md#verification).
        restores: list[float] = []

        async def restore() -> None:
            t = time.perf_counter()
            await client.slot_action(slot, "restore", name)
            restores.append((time.perf_counter() - t) * 1000)

        try:
            # One short wait for the server per try: a request's own probe may queue
            # behind this one at the gate (`restore`'s deadline does not cover that).
            answer, times = await self.probe_gate.reference(
                client, probe_request(tokens, suffix, slot), slot, restore, tries=tries, quiet_s=1.0
            )
        finally:
            await self.unload(slot, client)  # nobody's content: not left with the probe's
        return answer, times, restores[0] if restores else 0.0

    def reference_fields(
        self, answer: CompletionAnswer, times: list[float], restore_ms: float
    ) -> dict[str, object]:
        """A state record's probe fields for the reference `answer` and its timings."""
        for ms in times:
            self.costs.note_probe(ms)
        quickest = self.costs.quickest_probe_ms()
        return {
            **probe_reference(answer),
            "restore_ms": round(restore_ms, 2),
            # What a probe costs when it has the CPU: the quickest one measured so far.
            "verify_ms": round(quickest if quickest is not None else min(times), 2),
            "verify_ms_measured": round(min(times), 2),
        }

    def record_reference(
        self, rec: StateRecord, answer: CompletionAnswer, times: list[float], restore_ms: float
    ) -> None:
        """Store the reference taken for the pending state `rec` (in the background, or by
        its first restore)."""
        state = self.state
        rec.probe = cast(
            ProbeRecord, {**rec.probe, **self.reference_fields(answer, times, restore_ms)}
        )
        rec.verify_result = "reference"
        rec.verified_at = state.clock.time()
        state.store.add(rec)
        state.emit(
            CacheEventKind.REFERENCE,
            f"took the known-answer reference of the saved {rec.n_tokens}-token {rec.kind} "
            f"state {rec.filename}",
            fp=rec.fingerprint,
            tokens=rec.n_tokens,
            state=rec.kind,
            file=rec.filename,
            session=rec.session,
            reference=True,
            restore_ms=round(restore_ms, 1),
            verify_ms=round(min(times), 1),
        )

    async def _first_reference(
        self,
        rec: StateRecord,
        slot: int,
        client: LlamaClient,
        restore_ms: float,
        deadline: float | None,
    ) -> str | None:
        """The first restore of a pending state (just restored into `slot`): its probe, if
        it ran alone, becomes its reference and the state is served — its bytes matched
        the sha256 taken when the server wrote them, which is all a reference taken right
        after the save knew more. Why it is wrong (non-finite, not reused), or None; raise
        VerificationFailed when the probe shared the server (the file is kept for later)."""
        suffix, tokens = rec.probe.get("suffix"), rec.probe.get("prefix")
        if not suffix or not tokens:
            return "no probe suffix recorded"
        body = probe_request(tokens, suffix, slot)
        run = await self._probe_run(body, slot, client, deadline)
        if run is None:
            await self.unload(slot, client)
            raise VerificationFailed(f"{rec.filename}: other slots kept working; kept")
        t = Timings.parse(run.answer.get("timings"))
        problem = check_answer(
            run.answer, t.cache_n if t else None, rec.prefix_n, probe_reference(run.answer)
        )
        if problem is None and run.alone:
            self.record_reference(rec, run.answer, [run.ms], restore_ms)
            return None
        if problem is not None:
            return problem
        await self.unload(slot, client)
        raise VerificationFailed(f"{rec.filename}: its first probe shared the server; kept")

    # ------------------------------------------------------------ restore + verify
    async def restore(
        self,
        rec: StateRecord,
        slot: int,
        *,
        wait_s: float | None = None,
        details: Mapping[str, object] | None = None,
    ) -> None:
        """Restore `rec` into an expendable slot and verify it; raise VerificationFailed.

        Its probe's log-probs are bit-exact only alone, so it waits for the other slots to
        be quiet first: background work as long as it takes (`wait_s` None: up to 30 s),
        a restore a request waits for at most `wait_s` seconds — what the restore saves
        over prefilling, so that waiting never costs more than not restoring. When its
        probe then shared the server and disagrees, nothing is known: the slot is erased,
        the file kept and VerificationFailed raised (the request goes on from its
        prefix). `details` (why it was restored: a cost decision's inputs) go into its
        event."""
        state = self.state
        client = state.client
        assert client is not None
        t0 = time.perf_counter()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        problem = state.store.check_file(rec)
        resp: dict[str, Any] = {}
        restore_ms = 0.0
        if problem is None:
            try:
                t_restore = time.perf_counter()
                resp = await client.slot_action(slot, "restore", rec.filename)
                restore_ms = (time.perf_counter() - t_restore) * 1000
                self.costs.note_restore(rec.bytes, restore_ms)
                if int(resp.get("n_restored", -1)) != rec.n_tokens:
                    problem = f"restored {resp.get('n_restored')} tokens, expected {rec.n_tokens}"
            except UpstreamError as e:
                problem = f"server refused the file: {e}"
        if problem is None:
            try:
                if rec.verify_result == PENDING:
                    problem = await self._first_reference(rec, slot, client, restore_ms, deadline)
                else:
                    problem = await self._verify(rec, slot, client, deadline)
            except VerificationFailed:
                raise  # its probe shared the server: nothing known; cleared, the file kept
            except BaseException as e:
                # The probe could not run (the server went away, a time-out, a bug): the
                # restored state is unverified, so it must not stay in the slot, where
                # llama-server's own slot choice could reuse it. The file may be fine: kept.
                await self.unload(slot, client)
                state.emit(
                    CacheEventKind.RESTORE_REJECTED,
                    f"could not verify ({e!r}); the slot was cleared, the file kept",
                    fp=rec.fingerprint,
                    slot=slot,
                    tokens=rec.n_tokens,
                )
                if isinstance(e, Exception):
                    raise VerificationFailed(f"could not verify: {e!r}") from e
                raise
        ms = (time.perf_counter() - t0) * 1000
        if problem is None:
            st = state.slots.slots[slot]
            st.prefix_fp = rec.fingerprint
            st.tokens_hint = rec.n_tokens
            st.promised = (rec.n_tokens, f"restored {rec.kind} state")
            state.store.mark_verified(rec.filename, "ok")
            state.store.touch(rec.filename)
            state.emit(
                CacheEventKind.RESTORE_OK,
                "restored and verified",
                fp=rec.fingerprint,
                slot=slot,
                tokens=rec.n_tokens,
                nbytes=rec.bytes,
                ms=round(ms, 1),
                restore_ms=(resp.get("timings") or {}).get("restore_ms"),
                **(details or {}),
            )
            return
        # NaN/inf cells outlive an erase: overwrite them first. On a sliding-window (or
        # recurrent) model a wrong state can hold such cells where the probe does not look
        # (outside its window): a 4,096-byte flip rejected on a finite difference left Gemma
        # 3's next cold answer wrong (docs/cache.md#verification), so every rejection there.
        if non_finite(problem) or state.disk.rewinds:
            with contextlib.suppress(UpstreamError):
                await client.completion(
                    scrub_request(rec.probe["prefix"], rec.probe["suffix"], slot)
                )
        await self.unload(slot, client)
        freed = self._discard(rec, problem)  # an undeletable file is quarantined
        state.emit(
            CacheEventKind.RESTORE_REJECTED,
            problem,
            fp=rec.fingerprint,
            slot=slot,
            tokens=rec.n_tokens,
            nbytes=freed,
            ms=round(ms, 1),
        )
        info = state.by_fp.get(rec.fingerprint)
        if info is not None and state.disk.usable:
            self.persist_soon(info)
        raise VerificationFailed(problem)

    async def unload(self, slot: int, client: LlamaClient) -> None:
        """Erase `slot` (best effort, even while cancelled) and forget what it held."""
        with contextlib.suppress(UpstreamError, OSError, asyncio.CancelledError):
            await asyncio.shield(client.slot_action(slot, "erase"))
        st = self.state.slots.slots[slot]
        st.prefix_fp, st.tokens_hint = "", 0

    async def _verify(
        self, rec: StateRecord, slot: int, client: LlamaClient, deadline: float | None
    ) -> str | None:
        probe = rec.probe
        suffix, prefix_tokens = probe.get("suffix"), probe.get("prefix")
        if not suffix or not prefix_tokens or "tokens" not in probe:
            return "no known-answer probe recorded"
        problem, alone = await self._probe(rec, slot, client, deadline)
        if problem is None or not second_look(problem):
            return problem
        if not alone and deadline is not None and time.monotonic() >= deadline:
            await self._not_now(rec, slot, client, problem)
        # A request of another slot in the same batch changes the matrix shapes and so the
        # last bits of the probe's log-probs (docs/cache.md#verification): restore once more
        # and probe alone. A wrong state fails again, bit for bit.
        try:
            await client.slot_action(slot, "erase")
            again = await client.slot_action(slot, "restore", rec.filename)
        except UpstreamError:
            return problem
        if int(again.get("n_restored", -1)) != rec.n_tokens:
            return problem
        second, alone = await self._probe(rec, slot, client, deadline)
        if second is not None and not alone and deadline is not None:
            await self._not_now(rec, slot, client, second)
        if second is None:
            log.info("%s verified on a second probe (first: %s)", rec.filename, problem)
        return second

    async def _not_now(
        self, rec: StateRecord, slot: int, client: LlamaClient, problem: str
    ) -> None:
        """A request waits and its probe could not run alone in the time the restore
        saves: nothing is known of the state now. Erase the slot, keep the file, say so
        (`prewarm_skipped`) and raise VerificationFailed."""
        await self.unload(slot, client)
        why = (
            f"{rec.filename} not used now: its probe could not run alone within what "
            f"restoring it saves over prefilling ({problem}); the file is kept"
        )
        self.state.emit(
            CacheEventKind.PREWARM_SKIPPED, why, fp=rec.fingerprint, slot=slot, tokens=rec.n_tokens
        )
        raise VerificationFailed(why)

    async def _probe_run(
        self, body: JsonObject, slot: int, client: LlamaClient, deadline: float | None
    ) -> ProbeRun | None:
        """Probe `slot` once the other slots are quiet, waiting until `deadline` (None:
        as long as background work may, 30 s for the requests and `QUIET_WAIT_S` for the
        server's own work); None when requests still run in other slots at the deadline
        (a probe beside them proves nothing and, sharing their batches, takes seconds)."""
        if deadline is None:
            await self.wait_idle(exclude=slot)
        elif not await self.state.slots.wait_quiet(
            max(0.0, deadline - time.monotonic()), exclude=slot
        ):
            return None
        quiet_s = QUIET_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
        # Under the gate: never beside another of our probes (docs/cache.md#verification).
        run = await self.probe_gate.probe(client, body, slot, quiet_s=min(QUIET_WAIT_S, quiet_s))
        self.costs.note_probe(run.ms)
        return run

    async def _probe(
        self, rec: StateRecord, slot: int, client: LlamaClient, deadline: float | None
    ) -> tuple[str | None, bool]:
        """Why the probe disagrees (None: it agrees), and whether it ran alone."""
        probe = rec.probe
        run = await self._probe_run(probe_request_for(probe, slot), slot, client, deadline)
        if run is None:
            return "not probed: requests kept running in other slots", False
        t = Timings.parse(run.answer.get("timings"))
        problem = check_answer(
            run.answer,
            t.cache_n if t else None,
            rec.prefix_n,
            probe,
            tolerance=self.state.disk.logprob_tolerance,
        )
        return problem, run.alone
