"""The known-answer probe that decides whether a restored KV state can be trusted.

At save time Warmslot sends the exact prefix plus a fixed suffix, greedy, and
records the tokens and log-probabilities that come back. After a restore the same
request must reuse the prefix and give the same tokens with log-probs within
`LOGPROB_TOLERANCE`. (A restore can reuse 1,500 tokens and still change the
output — reference §5 — so reuse alone proves nothing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROBE_SUFFIX = "\n\nWarmslot verification probe. The capital of France is"
PROBE_TOKENS = 4
LOGPROB_TOLERANCE = 1e-3  # measured: restored dense states reproduce log-probs exactly
REUSE_SLACK = 1  # the server re-evaluates the last cached token when nothing is new


def probe_request(prefix: Sequence[int], suffix: Sequence[int], slot: int) -> dict[str, Any]:
    """The `/completion` body of a probe: greedy, a few tokens, their log-probs."""
    return {
        "prompt": [*prefix, *suffix],
        "n_predict": PROBE_TOKENS,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "n_probs": 1,
        "id_slot": slot,
        "cache_prompt": True,
        "seed": 0,
        "response_fields": ["completion_probabilities", "timings", "tokens_cached"],
    }


def probe_answer(resp: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The greedy tokens and their log-probs from a probe's response."""
    probs = resp.get("completion_probabilities") or []
    return [int(p["id"]) for p in probs], [float(p["logprob"]) for p in probs]


def check_answer(
    resp: dict[str, Any], cache_n: int | None, prefix_n: int, reference: dict[str, Any]
) -> str | None:
    """Why a probe after restore fails against the recorded reference, or None."""
    if cache_n is None or cache_n < prefix_n - REUSE_SLACK:
        return f"reuse probe: cache_n {cache_n}, expected ≥ {prefix_n - REUSE_SLACK}"
    tokens, logprobs = probe_answer(resp)
    if tokens != reference["tokens"]:
        return f"probe answer changed: tokens {tokens} ≠ {reference['tokens']}"
    worst = max(
        (abs(a - b) for a, b in zip(logprobs, reference["logprobs"], strict=False)), default=0.0
    )
    if worst > LOGPROB_TOLERANCE:
        return f"probe log-probs moved by {worst:.4g} (> {LOGPROB_TOLERANCE})"
    return None
