"""Restore-or-prefill decisions priced from what this machine measured (core.cache.costs)."""

from __future__ import annotations

from typing import Any

import pytest

from core.cache.conversation_pick import choose
from core.cache.costs import PRIOR_PREFILL_MS_PER_TOKEN, Costs
from core.cache.store import PENDING, StateRecord


def _rec(tokens: list[int], nbytes: int, session: str = "s", **probe: Any) -> StateRecord:
    return StateRecord(
        filename="ws-" + "a" * 32 + ".bin",
        identity="0123456789abcdef",
        fingerprint="f" * 64,
        client="",
        source="conversation",
        prefix_n=len(tokens),
        n_tokens=len(tokens),
        bytes=nbytes,
        sha256="0" * 64,
        ttl_class="long",
        pinned=False,
        created=0.0,
        last_used=0.0,
        verified_at=None,
        verify_result=PENDING,
        probe={"prefix": tokens, "suffix": [1], **probe},  # type: ignore[typeddict-item]
        kind="conversation",
        session=session,
        stat="known",
    )


def test_the_restore_is_priced_from_measured_bandwidth_and_probe_time() -> None:
    costs = Costs()
    costs.note_restore(100_000_000, 200.0)  # 500 kB/ms
    costs.note_restore(100_000_000, 100.0)  # 1 MB/ms
    costs.note_restore(100_000_000, 400.0)
    costs.note_probe(900.0)
    costs.note_probe(300.0)  # the quickest counts: the others shared the CPU
    rec = _rec(list(range(9000)), 50_000_000)
    e = costs.estimate(rec, 820, rate=22.0)
    assert e.restore_ms == pytest.approx(50_000_000 / 500_000)  # the median bandwidth
    assert e.verify_ms == 300.0
    assert e.hash_ms == 0.0  # its stat vouches for the file: no hash before the restore
    assert e.prefill_ms == pytest.approx(820 * 22.0)
    assert e.pays
    assert e.inputs["restore_from"] == "measured restores"
    assert "820 tokens" in e.words() and "22 ms/token" in e.words()


def test_without_measurements_a_state_uses_its_own_and_then_priors_that_err_against_it() -> None:
    costs = Costs()
    own = _rec(list(range(100)), 10_000_000, restore_ms=20.0, verify_ms=50.0)
    e = costs.estimate(own, 500, rate=None)
    assert (e.restore_ms, e.verify_ms) == (pytest.approx(20.0), 50.0)
    assert e.inputs["prefill_from"].startswith("a prior")
    assert e.prefill_ms == pytest.approx(500 * PRIOR_PREFILL_MS_PER_TOKEN)
    assert not e.pays  # an unmeasured prefill is taken for a fast GPU's
    saved_rate = _rec(list(range(100)), 10_000_000, prefill_ms_per_token=10.0)
    assert costs.estimate(saved_rate, 500, rate=None).inputs["prefill_from"] == (
        "measured when it was saved"
    )
    unhashed = _rec(list(range(100)), 10_000_000)
    unhashed.stat = ""
    costs.note_hash(10_000_000, 25.0)
    assert costs.estimate(unhashed, 500, rate=1.0).hash_ms == pytest.approx(25.0)


def test_the_resume_after_a_restart_restores_the_conversation_when_that_is_cheaper() -> None:
    # The field case: a 9,000-token conversation state (71 MB) whose session comes back
    # with 820 new tokens, its stable prefix (7,449 tokens) on disk anyway; prefill 22 ms
    # per token, restores at ~0.5 GB/s, a probe of ~0.4 s.
    costs = Costs()
    costs.note_restore(71_000_000, 150.0)
    costs.note_probe(400.0)
    prompt = list(range(9820))
    rec = _rec(prompt[:9000], 71_000_000, session="ses")
    choice, skipped = choose(
        [rec], prompt, "ses", 7449, lambda r, gain: costs.estimate(r, gain, rate=22.0)
    )
    assert skipped is None and choice is not None
    assert choice.match == 9000 and choice.by == "session"
    assert choice.estimate.gain == 9000 - 7449
    # The same state on a machine whose prefill is faster than its restore: skipped,
    # with what the decision was made of.
    slow_disk = Costs()
    slow_disk.note_restore(71_000_000, 20_000.0)
    slow_disk.note_probe(400.0)
    choice, skipped = choose(
        [rec], prompt, "ses", 7449, lambda r, gain: slow_disk.estimate(r, gain, rate=1.0)
    )
    assert choice is None and skipped is not None
    assert "measured restores" in skipped.reason and "1 ms/token" in skipped.reason
    assert skipped.estimate.details()["predicted_ms"] > skipped.estimate.details()["prefill_ms"]
