"""The known-answer probe that decides whether a restored KV state can be trusted.

At save time Warmslot sends the exact prefix plus a fixed suffix, greedy, and
records the tokens and log-probabilities that come back. After a restore the same
request must reuse the prefix and give the same tokens with log-probs within
`LOGPROB_TOLERANCE`. (A restore can reuse 1,500 tokens and still change the
output — docs/llama-server-facts.md#swa-full-restores-wrong-state — so reuse alone
proves nothing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROBE_SUFFIX = "\n\nWarmslot verification probe. The capital of France is"
PROBE_TOKENS = 4
LOGPROB_TOLERANCE = 1e-3  # measured: restored dense states reproduce log-probs exactly
# Sliding-window models without --swa-full: cached vs cold log-probs differ by up to
# ~0.15 from the ring buffer's summation order (docs/llama-server-facts.md#swa-log-prob-noise);
# measured 0.10 after a patched restore of Gemma 3 270M. Greedy tokens still must match.
SWA_LOGPROB_TOLERANCE = 0.25
REUSE_SLACK = 1  # the server re-evaluates the last cached token when nothing is new
TIE_MARGIN = 1e-2  # a best token leading by less than this is a coin toss between layouts


def probe_request(prefix: Sequence[int], suffix: Sequence[int], slot: int) -> dict[str, Any]:
    """The `/completion` body of a probe: greedy, a few tokens, their log-probs."""
    return {
        "prompt": [*prefix, *suffix],
        "n_predict": PROBE_TOKENS,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "n_probs": 2,
        "id_slot": slot,
        "cache_prompt": True,
        "seed": 0,
        "response_fields": ["completion_probabilities", "timings", "tokens_cached"],
    }


def probe_answer(resp: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    """The greedy tokens, their log-probs, and each step's margin over the runner-up."""
    probs = resp.get("completion_probabilities") or []
    tokens = [int(p["id"]) for p in probs]
    logprobs = [float(p["logprob"]) for p in probs]
    margins = []
    for p in probs:
        top = sorted((float(t["logprob"]) for t in p.get("top_logprobs") or []), reverse=True)
        margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return tokens, logprobs, margins


def check_answer(
    resp: dict[str, Any],
    cache_n: int | None,
    prefix_n: int,
    reference: dict[str, Any],
    *,
    tolerance: float = LOGPROB_TOLERANCE,
) -> str | None:
    """Why a probe after restore fails against the recorded reference, or None.

    Where the reference's best token led its runner-up by less than `TIE_MARGIN`,
    the arithmetic noise of a different batch or cell layout may pick either: the
    check accepts either and stops there, since the continuation legitimately
    differs after a tie. Everything before it must match exactly.
    """
    if cache_n is None or cache_n < prefix_n - REUSE_SLACK:
        return f"reuse probe: cache_n {cache_n}, expected ≥ {prefix_n - REUSE_SLACK}"
    tokens, logprobs, _ = probe_answer(resp)
    ref_tokens, ref_lps = reference["tokens"], reference["logprobs"]
    margins = reference.get("margins") or [float("inf")] * len(ref_tokens)
    if len(tokens) != len(ref_tokens):
        return f"probe answer changed: {len(tokens)} tokens, expected {len(ref_tokens)}"
    for i, (got, want) in enumerate(zip(tokens, ref_tokens, strict=True)):
        tie = margins[i] < TIE_MARGIN
        if got != want and not tie:
            return f"probe answer changed at token {i}: {tokens} ≠ {ref_tokens}"
        if got == want and abs(logprobs[i] - ref_lps[i]) > tolerance:
            return (
                f"probe log-probs moved by {abs(logprobs[i] - ref_lps[i]):.4g} "
                f"(> {tolerance}) at token {i}"
            )
        if tie:
            break  # after a near-tie the continuation may differ
    return None
