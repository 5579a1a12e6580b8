"""The one prefill-rate estimator: milliseconds per token of cold prefills, per model.

What reading the cached tokens again would have cost. The response headers' estimate,
the explanations' cost, the cache's restore-or-prefill decisions (through
`PrefillRates`) and the dashboard's history query (`core.telemetry.queries`, with
`COLD_MIN_TOKENS`) use this one rule.
"""

from __future__ import annotations

__all__ = ["COLD_MIN_TOKENS", "PrefillRate", "PrefillRates"]

# A cold prefill at least this long (and reusing under a tenth of it) calibrates the
# prefill rate, in memory here and in the history's query alike.
COLD_MIN_TOKENS = 256


class PrefillRate:
    """Milliseconds per token of cold prefills seen so far (one model's): what reading the
    cached tokens again would have cost. None until one cold prefill was measured.

    The one rule for a prefill rate: the response headers' estimate, the explanations'
    cost, the cache's restore-or-prefill decisions (all through `PrefillRates`) and the
    dashboard's history query (`core.telemetry.queries`, same constants) use it."""

    def __init__(self) -> None:
        self.tokens = 0
        self.ms = 0.0

    def seed(self, tokens: int, ms: float) -> None:
        """Count cold prefills measured before (the history's: `Queries.cold_prefill_rates`)."""
        self.tokens += tokens
        self.ms += ms

    def feed(self, cached: int, prefilled: int, prompt_ms: float | None) -> None:
        """Count a finished request's prefill when it was a cold one."""
        if prompt_ms and prefilled >= COLD_MIN_TOKENS and cached * 10 <= prefilled:
            self.tokens += prefilled
            self.ms += prompt_ms

    @property
    def ms_per_token(self) -> float | None:
        return self.ms / self.tokens if self.tokens else None


class PrefillRates:
    """Each model's `PrefillRate`, by model profile name ("" for the primary server):
    fed by the proxy with every completed request, read wherever a prefill is priced."""

    def __init__(self) -> None:
        self._by_model: dict[str, PrefillRate] = {}

    def feed(self, model: str, cached: int, prefilled: int, prompt_ms: float | None) -> None:
        """Count one finished request of `model` (see `PrefillRate.feed`)."""
        self._by_model.setdefault(model, PrefillRate()).feed(cached, prefilled, prompt_ms)

    def seed(self, model: str, tokens: int, ms: float) -> None:
        """Start `model`'s rate from cold prefills measured before (the history's)."""
        self._by_model.setdefault(model, PrefillRate()).seed(tokens, ms)

    def ms_per_token(self, model: str) -> float | None:
        """`model`'s measured cold prefill rate; None until one was measured."""
        rate = self._by_model.get(model)
        return rate.ms_per_token if rate is not None else None
