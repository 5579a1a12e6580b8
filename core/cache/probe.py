"""The known-answer probe that decides whether a restored KV state can be trusted.

At save time Warmslot sends the exact prefix plus a fixed suffix, greedy, and
records what comes back: at each generated position the greedy token and the
log-probs of the `PROBE_TOP_K` most likely tokens (reference format
`PROBE_VERSION`). After a restore the same request must reuse the prefix and
reproduce, position by position, the whole top-k vector within the tolerance —
not just the greedy token. (A restore can reuse 1,500 tokens and still change
the output — docs/llama-server-facts.md#swa-full-restores-wrong-state — so reuse
alone proves nothing.)

Why whole vectors: on a model whose next-token distribution is flat (every margin
below `TIE_MARGIN`, as on a random-weight model) the greedy tokens say nothing, and
one log-prob within 1e-3 let 64 flipped bytes and another model's file through
(docs/cache.md#verification). Sixteen log-probs at each of several positions
each move when the state moves, and a correct restore reproduces them bit for bit
(dense models, and a sliding-window ring once the reference too is taken from a
restore), so the tolerance is 0. The one benign difference measured is a batch
shared with another slot's request: `second_look` says when a failed check gets
one more restore and probe, alone. A state whose probe sees NaN or inf is
rejected outright, and `scrub_request` overwrites the cells it poisoned.

A reference recorded in an older format (before `PROBE_VERSION` 2) cannot be
checked this strictly: it is reported as unverifiable, so the state is deleted
and rebuilt once, never accepted on the old, weaker grounds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from core.chat import JsonObject
from core.errors import UpstreamError
from core.server.client import CompletionAnswer, CompletionProbability, LlamaClient

log = logging.getLogger("warmslot.cache")

PROBE_VERSION = 2  # 2: top-k log-prob vectors per position ("top"); 1 had only tokens
# Each row the server computes for the probe attends over the whole restored context, so
# the probe costs about one row per token it sends or generates (~15 rows on Gemma 3: 2.3–
# 3.4 s of a 32k restore on a loaded CPU, docs/benchmarks.md#restore). A one-token suffix
# and 2 tokens (3 rows) took 0.5–1.1 s there, but let an 8-byte flip that changed the
# answer through on Gemma 3 (docs/cache.md#verification): not used. A reference keeps its
# own suffix and token count (`probe_request_for`).
PROBE_SUFFIX = "\n\nWarmslot verification probe. The capital of France is"
PROBE_TOKENS = 4
LEGACY_PROBE_TOKENS = 2  # what references taken with the older 2-token probe generated
PROBE_TOP_K = 16  # log-probs compared per position (docs/cache.md#verification)
# Measured: a dense model's restored state reproduces every log-prob bit for bit (same
# binary, same threads, docs/cache.md#verification), so any difference is a wrong state.
# 1e-3 (before) let a flat model's corrupted states through.
LOGPROB_TOLERANCE = 0.0
# Sliding-window models without --swa-full: a state built by prompt processing and one
# restored from a file differ by up to ~0.15 (the ring's cell order,
# docs/llama-server-facts.md#swa-log-prob-noise), but the reference is taken from a restore
# too, and restores reproduce it bit for bit (measured on Gemma 3 270M,
# docs/llama-server-facts.md#restores-are-bit-exact). The 0.25 allowed before let a state
# with 8 flipped bytes through that changed the answer.
SWA_LOGPROB_TOLERANCE = 0.0
REUSE_SLACK = 1  # the server re-evaluates the last cached token when nothing is new
TIE_MARGIN = 1e-2  # a best token leading by less than this is a coin toss between layouts
QUIET_WAIT_S = 10.0  # longest a probe waits for the other slots to finish their work
REFERENCE_TRIES = 3  # probes tried for a reference that ran alone


class ProbeRecord(TypedDict, total=False):
    """A state's recorded probe (`StateRecord.probe`): the prefix and suffix it sent and
    the reference `probe_reference` took, plus the timings a conversation save measured.

    Every key is optional: it is JSON read back from the state index, written by older
    versions too, so readers check what is there (`check_answer` rejects what is not)."""

    prefix: list[int]
    suffix: list[int]
    version: int  # `PROBE_VERSION` of the reference; absent: 1
    tokens: list[int]  # the greedy tokens
    logprobs: list[float]  # their log-probs
    margins: list[float]  # each step's lead over the runner-up (1e9: none)
    top: list[list[list[float]]]  # per step, the top-k as [token id, log-prob] pairs
    # What a conversation save measured (core.cache.conversations), in milliseconds.
    hash_ms: float
    restore_ms: float
    verify_ms: float
    verify_ms_measured: float
    prefill_ms_per_token: float | None  # None: not measured yet


def probe_request(
    prefix: Sequence[int], suffix: Sequence[int], slot: int, n_predict: int = PROBE_TOKENS
) -> JsonObject:
    """The `/completion` body of a probe: greedy, a few tokens, their top-k log-probs."""
    return {
        "prompt": [*prefix, *suffix],
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "n_probs": PROBE_TOP_K,
        "id_slot": slot,
        "cache_prompt": True,
        "seed": 0,
        "response_fields": ["completion_probabilities", "timings", "tokens_cached"],
    }


def probe_request_for(reference: ProbeRecord, slot: int) -> JsonObject:
    """The probe that checks a recorded `reference` in `slot`: its own prefix, suffix and
    number of tokens, so that a reference taken with another probe (the short one main
    used briefly: a 1-token suffix and 2 tokens) still verifies instead of being rebuilt."""
    n = len(reference.get("tokens") or []) or PROBE_TOKENS
    return probe_request(reference["prefix"], reference["suffix"], slot, n)


def _num(value: object) -> float:
    """A log-prob as a float; NaN where the server sent null or nothing (a broken state
    gives non-finite logits, which JSON carries as null)."""
    if not isinstance(value, int | float | str):
        return math.nan
    try:
        return float(value)
    except ValueError:
        return math.nan


def _steps(resp: CompletionAnswer) -> list[CompletionProbability]:
    """The answer's ``completion_probabilities``: one object per generated token."""
    probs = resp.get("completion_probabilities")
    # Checked, as every field below: the types say what the server should send, and a
    # broken state or server may send anything.
    return [p for p in probs if isinstance(p, dict)] if isinstance(probs, list) else []


def _top(step: CompletionProbability) -> list[tuple[int, float]]:
    """A step's ``top_logprobs`` as (token id, log-prob) pairs."""
    out = []
    tops = step.get("top_logprobs")
    for t in tops if isinstance(tops, list) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int):
            out.append((int(t["id"]), _num(t.get("logprob"))))
    return out


def _token(step: CompletionProbability) -> int:
    """A step's greedy token id (-1 where the server sent none)."""
    tok = step.get("id", -1)
    if not isinstance(tok, int | float | str):
        raise TypeError(f"token id {tok!r}")  # what int() raised: a malformed answer
    return int(tok)


def probe_answer(resp: CompletionAnswer) -> tuple[list[int], list[float], list[float]]:
    """The greedy tokens, their log-probs, and each step's margin over the runner-up."""
    steps = _steps(resp)
    tokens = [_token(p) for p in steps]
    logprobs = [_num(p.get("logprob")) for p in steps]
    margins = []
    for p in steps:
        top = sorted((lp for _, lp in _top(p)), reverse=True)
        margins.append(top[0] - top[1] if len(top) > 1 else math.inf)
    return tokens, logprobs, margins


def probe_reference(resp: CompletionAnswer) -> ProbeRecord:
    """What to record at save time: tokens, log-probs, margins and the top-k vectors.

    The caller adds the prefix and suffix. A reference holding non-finite values is
    returned as is; `check_answer` never accepts against it.
    """
    tokens, logprobs, margins = probe_answer(resp)
    return {
        "version": PROBE_VERSION,
        "tokens": tokens,
        "logprobs": logprobs,
        "margins": [m if math.isfinite(m) else 1e9 for m in margins],  # JSON has no inf
        "top": [[[i, lp] for i, lp in _top(p)] for p in _steps(resp)],
    }


def _vector_problem(
    got: list[tuple[int, float]], want: list[tuple[int, float]], tolerance: float
) -> tuple[float, str | None]:
    """The largest log-prob difference between two top-k lists, and why they disagree.

    Each token in both lists must agree within `tolerance`. A token in only one list
    is allowed only where it sits at the other list's cut-off (within `tolerance` of its
    last value): noise may move a token just in or out of the top k.
    """
    if not want or not got:
        return math.inf, "no top-k log-probs"
    values = [lp for _, lp in got] + [lp for _, lp in want]
    if not all(math.isfinite(v) for v in values):
        return math.inf, "non-finite log-probs"
    g, w = dict(got), dict(want)
    worst = 0.0
    for tok, lp in w.items():
        if tok in g:
            worst = max(worst, abs(g[tok] - lp))
        elif lp > min(g.values()) + tolerance:
            return math.inf, f"token {tok} (log-prob {lp:.6g}) left the top {len(g)}"
    for tok, lp in g.items():
        if tok not in w and lp > min(w.values()) + tolerance:
            return math.inf, f"token {tok} (log-prob {lp:.6g}) entered the top {len(w)}"
    if worst > tolerance:
        return worst, f"log-probs moved by {worst:.4g} (> {tolerance})"
    return worst, None


def check_answer(
    resp: CompletionAnswer,
    cache_n: int | None,
    prefix_n: int,
    reference: ProbeRecord,
    *,
    tolerance: float = LOGPROB_TOLERANCE,
) -> str | None:
    """Why a probe after restore fails against the recorded reference, or None.

    Position by position, the top-k log-prob vector must match the reference's within
    `tolerance` (see `_vector_problem`), and so must the greedy token. Where the two
    greedy tokens differ and the reference's best token led its runner-up by less than
    `TIE_MARGIN` (or twice the tolerance), the arithmetic noise of another cell layout
    may legitimately pick either: the check stops there, since the continuation
    differs after it — but only once that position's vector has matched.
    """
    steps = _steps(resp)
    if not all(
        math.isfinite(lp)
        for p in steps
        for lp in [_num(p.get("logprob"))] + [v for _, v in _top(p)]
    ):
        return "probe non-finite log-probs: the state holds NaN or inf"
    if cache_n is None or cache_n < prefix_n - REUSE_SLACK:
        return f"reuse probe: cache_n {cache_n}, expected ≥ {prefix_n - REUSE_SLACK}"
    if reference.get("version") != PROBE_VERSION or not reference.get("top"):
        return (
            f"probe reference of an older format (version {reference.get('version', 1)}, "
            f"need {PROBE_VERSION}) cannot verify this state: rebuilt instead"
        )
    ref_tokens, ref_top = reference["tokens"], reference["top"]
    margins = reference.get("margins") or [math.inf] * len(ref_tokens)
    if len(steps) != len(ref_tokens):
        return f"probe answer changed: {len(steps)} tokens, expected {len(ref_tokens)}"
    ref_lps = reference.get("logprobs") or []
    for i, step in enumerate(steps):
        want = [(int(t), _num(lp)) for t, lp in ref_top[i]]
        _, problem = _vector_problem(_top(step), want, tolerance)
        if problem is not None:
            return f"probe {problem} at token {i}"
        got_tok = _token(step)
        if got_tok == ref_tokens[i] and i < len(ref_lps):
            moved = abs(_num(step.get("logprob")) - _num(ref_lps[i]))
            if not moved <= tolerance:  # NaN never passes
                return f"probe log-probs moved by {moved:.4g} (> {tolerance}) at token {i}"
        if got_tok != ref_tokens[i]:
            if margins[i] < max(TIE_MARGIN, 2 * tolerance):
                break  # a near-tie went the other way: the rest may differ
            return f"probe answer changed at token {i}: {got_tok} ≠ {ref_tokens[i]}"
    return None


def probe_deviation(resp: CompletionAnswer, reference: ProbeRecord) -> float:
    """The largest log-prob difference from the reference over the compared positions
    (inf where a vector is missing or non-finite): what the tolerance is measured against."""
    steps, ref_top = _steps(resp), reference.get("top") or []
    worst = 0.0
    for step, want, ref_tok in zip(steps, ref_top, reference.get("tokens") or [], strict=False):
        dev, _ = _vector_problem(_top(step), [(int(t), _num(lp)) for t, lp in want], math.inf)
        worst = max(worst, dev)
        if _token(step) != ref_tok:
            break
    return worst


def non_finite(problem: str | None) -> bool:
    """Whether a `check_answer` verdict saw non-finite log-probs (NaN/inf in the state)."""
    return problem is not None and "non-finite" in problem


def scrub_request(prefix: Sequence[int], suffix: Sequence[int], slot: int) -> JsonObject:
    """A cold prompt over every cell a failed probe wrote, to overwrite what it left.

    Measured: after a probe on a state holding NaN/inf, erasing the slot is not enough —
    the next cold request in that slot's KV stream still came out wrong (NaN keys and
    values stay in the freed cells past its prompt, and attention reads them), while a
    prompt covering those cells restored the cold answer (docs/cache.md#verification).
    """
    # As many as the longest probe generates (references of the older probe took 4).
    filler = [suffix[-1] if suffix else (prefix[-1] if prefix else 0)] * (
        max(PROBE_TOKENS, LEGACY_PROBE_TOKENS) + 1
    )
    return {
        "prompt": [*prefix, *suffix, *filler],
        "n_predict": 0,
        "id_slot": slot,
        "cache_prompt": False,
    }


def second_look(problem: str | None) -> bool:
    """Whether a failed check deserves one more probe, alone: only a log-prob or token
    difference, which a batch shared with another slot's request can also cause. Missing
    reuse, non-finite values and an old reference fail the same way every time."""
    return (
        problem is not None
        and not non_finite(problem)
        and "reuse probe" not in problem
        and ("older format" not in problem)
    )


# ------------------------------------------------------------------ probing alone
_Snapshot = dict[int, tuple[int, bool]]  # other slot → (its current or last task, processing)


async def _others(client: LlamaClient, slot: int) -> _Snapshot | None:
    """What the slots other than `slot` are doing (None: the server has no `/slots`)."""
    try:
        return {s.id: (s.id_task, s.is_processing) for s in await client.slots() if s.id != slot}
    except UpstreamError:
        return None


async def wait_quiet(client: LlamaClient, slot: int, timeout: float = QUIET_WAIT_S) -> bool:
    """Whether the server reports no slot but `slot` processing (waiting up to `timeout`).

    `GET /slots` sees every request, ours in the background included, which the cache
    manager's own in-flight counts do not. True when the server has no `/slots`."""
    deadline = time.monotonic() + timeout
    while True:
        now = await _others(client, slot)
        busy = [] if now is None else [i for i, (_, processing) in now.items() if processing]
        if not busy:
            return True
        if time.monotonic() >= deadline:
            log.info("slots %s process while slot %d is probed", busy, slot)
            return False
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class ProbeRun:
    """One probe: the server's answer, whether it ran alone, and how long it took (ms)."""

    answer: CompletionAnswer
    alone: bool
    ms: float


class ProbeGate:
    """One known-answer probe at a time on a server, and whether it ran alone.

    A probe's log-probs are bit-exact only when no other slot's tokens share its batches:
    another slot's work changes the matrix shapes and moves the last bits (5e-4 measured,
    docs/cache.md#verification). Two of Warmslot's own probes in different slots did
    exactly that to each other — a conversation's reference taken while a prefix's was
    taken in the side slot — and two probes agreeing proved nothing, since both had shared
    their batches (correct states were rejected so in
    tests/integration/test_alternating_sessions.py).
    So probes queue here, and each reports whether the other slots did any work while it
    ran: idle, on the same task, before and after (a task that started and ended in between
    changes its slot's task id).
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def probe(
        self,
        client: LlamaClient,
        body: Mapping[str, object],
        slot: int,
        *,
        before: Callable[[], Awaitable[object]] | None = None,
        quiet_s: float = QUIET_WAIT_S,
    ) -> ProbeRun:
        """Run the probe `body` in `slot`, after `before` (e.g. a restore) in the same turn;
        alone is False where it cannot be known (no `/slots`)."""
        async with self._lock:
            await wait_quiet(client, slot, quiet_s)
            if before is not None:
                await before()
            first = await _others(client, slot)
            t0 = time.perf_counter()
            answer = await client.completion(body)
            ms = (time.perf_counter() - t0) * 1000
            then = await _others(client, slot)
        alone = first is not None and first == then and not any(p for _, p in first.values())
        return ProbeRun(answer, alone, ms)

    async def reference(
        self,
        client: LlamaClient,
        body: Mapping[str, object],
        slot: int,
        restore: Callable[[], Awaitable[object]],
        *,
        tries: int = REFERENCE_TRIES,
        quiet_s: float = QUIET_WAIT_S,
    ) -> tuple[CompletionAnswer | None, list[float]]:
        """A reference answer for a just-saved state — `restore` it into `slot` and probe,
        until a probe ran alone (at most `tries`) — and every probe's time (ms). None when
        none did: a reference that shared its batches would reject the correct state on
        every later check, so the caller keeps no state instead.

        Without `/slots` (alone unknown) two probes of the same restore that agree bit for
        bit are taken instead, the best that can be known there."""
        times: list[float] = []
        previous: CompletionAnswer | None = None
        for _ in range(tries):
            run = await self.probe(client, body, slot, before=restore, quiet_s=quiet_s)
            times.append(run.ms)
            if run.alone:
                return run.answer, times
            if await _others(client, slot) is None:  # no /slots: agreement is all there is
                if previous is not None and probe_reference(previous) == probe_reference(
                    run.answer
                ):
                    return run.answer, times
                previous = run.answer
            else:
                log.info("a probe reference in slot %d shared the server with other slots", slot)
        return None, times
