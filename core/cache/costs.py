"""What bringing a saved state back costs on this server, measured here: `Costs`.

A restore pays for itself when reading the file, checking it and verifying it cost less
than prefilling the tokens it gives. Each part is priced from this machine's own
measurements, per server (one `Costs` per cache manager, so per model):

- the **restore** from the restore bandwidth measured on this server's restores (bytes
  per ms, the median of the recent ones) — a state's own restore time, measured at its
  reference, before any restore was measured;
- the **verification** from the quickest known-answer probe measured lately (a probe
  timed while other slots worked says more about them than about the probe);
- the **hash**, only when the file's stat no longer vouches for it (the store's check
  hashes only then), from the hashing bandwidth measured at saves;
- the **prefill** from the model's measured cold prefill rate (core.telemetry.rates,
  continued from the history at start), else the rate measured when the state was saved.

Where nothing was measured yet the priors below err against restoring. Every decision
keeps its inputs (`Estimate.inputs`), which the event and the response header carry
(docs/cache.md#restore-on-return).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from core.cache.store import StateRecord

__all__ = ["Costs", "Estimate"]

SAMPLES = 20  # recent measurements kept of each kind
# Priors until measured: a fast GPU's prefill (errs against restoring) and slow disks.
PRIOR_PREFILL_MS_PER_TOKEN = 0.05
PRIOR_BYTES_PER_MS = 100_000.0  # 100 MB/s
PRIOR_VERIFY_MS = 1_000.0


@dataclass(frozen=True)
class Estimate:
    """A restore's predicted cost against the prefill it saves, and what it was made of."""

    restore_ms: float
    verify_ms: float
    hash_ms: float
    prefill_ms: float  # the prefill of `gain` tokens the restore saves
    gain: int
    inputs: dict[str, float | int | str | None]

    @property
    def cost_ms(self) -> float:
        """Predicted: restore + verify + hash."""
        return self.restore_ms + self.verify_ms + self.hash_ms

    @property
    def pays(self) -> bool:
        """Whether the restore costs less than the prefill it saves."""
        return self.cost_ms < self.prefill_ms

    @property
    def slack_s(self) -> float:
        """What the restore saves over prefilling (s): the most that the request it is
        for may wait for a quiet moment to verify it."""
        return max(0.0, self.prefill_ms - self.cost_ms) / 1000

    def details(self) -> dict[str, Any]:
        """Its numbers and inputs, for an event's details."""
        return {
            "predicted_ms": round(self.cost_ms, 1),
            "prefill_ms": round(self.prefill_ms, 1),
            "gain_tokens": self.gain,
            **self.inputs,
        }

    def words(self) -> str:
        """The comparison in words, with its measured inputs."""
        i = self.inputs
        hashing = f" + hash ≈ {self.hash_ms:.0f} ms" if self.hash_ms else ""
        return (
            f"restore ≈ {self.restore_ms:.0f} ms ({i['bytes']} bytes at "
            f"{i['bytes_per_ms']:.0f} B/ms, {i['restore_from']}) + verify ≈ "
            f"{self.verify_ms:.0f} ms ({i['verify_from']}){hashing} against a prefill of "
            f"{self.gain} tokens ≈ {self.prefill_ms:.0f} ms ({i['prefill_ms_per_token']:.3g} "
            f"ms/token, {i['prefill_from']})"
        )


class Costs:
    """One server's measured restore, hash and probe costs (fed by `SlotOps`)."""

    def __init__(self) -> None:
        self._restore: deque[float] = deque(maxlen=SAMPLES)  # bytes per ms
        self._hash: deque[float] = deque(maxlen=SAMPLES)  # bytes per ms
        self._probe: deque[float] = deque(maxlen=SAMPLES)  # ms

    def note_restore(self, nbytes: int, ms: float) -> None:
        """A restore of `nbytes` took `ms` (the server's answer to the restore action)."""
        if nbytes > 0 and ms > 0:
            self._restore.append(nbytes / ms)

    def note_hash(self, nbytes: int, ms: float) -> None:
        """Hashing `nbytes` took `ms`."""
        if nbytes > 0 and ms > 0:
            self._hash.append(nbytes / ms)

    def note_probe(self, ms: float) -> None:
        """A known-answer probe took `ms`."""
        if ms > 0:
            self._probe.append(ms)

    def quickest_probe_ms(self) -> float | None:
        """The quickest probe measured lately (ms), or None."""
        return min(self._probe) if self._probe else None

    def estimate(self, rec: StateRecord, gain: int, *, rate: float | None) -> Estimate:
        """What restoring `rec` costs here against prefilling the `gain` tokens it saves,
        at the model's measured cold prefill `rate` (ms per token; None: not measured)."""
        probe = rec.probe
        own_restore = float(probe.get("restore_ms") or 0)
        if self._restore:
            bw, restore_from = statistics.median(self._restore), "measured restores"
        elif own_restore > 0:
            bw, restore_from = rec.bytes / own_restore, "its own reference restore"
        else:
            bw, restore_from = PRIOR_BYTES_PER_MS, "a prior: nothing measured yet"
        quickest, own_verify = self.quickest_probe_ms(), float(probe.get("verify_ms") or 0)
        if quickest is not None:
            verify, verify_from = quickest, "quickest recent probe"
        elif own_verify > 0:
            verify, verify_from = own_verify, "its own reference probe"
        else:
            verify, verify_from = PRIOR_VERIFY_MS, "a prior: nothing measured yet"
        hash_ms = 0.0
        if not rec.stat:  # the store hashes the file before the restore
            hash_bw = statistics.median(self._hash) if self._hash else PRIOR_BYTES_PER_MS
            hash_ms = rec.bytes / hash_bw
        prefill_from = "this model's cold prefills"
        if rate is None:
            saved_rate = probe.get("prefill_ms_per_token")
            if isinstance(saved_rate, int | float) and saved_rate > 0:
                rate, prefill_from = float(saved_rate), "measured when it was saved"
            else:
                rate, prefill_from = PRIOR_PREFILL_MS_PER_TOKEN, "a prior: nothing measured yet"
        return Estimate(
            restore_ms=rec.bytes / bw,
            verify_ms=verify,
            hash_ms=hash_ms,
            prefill_ms=gain * rate,
            gain=gain,
            inputs={
                "bytes": rec.bytes,
                "bytes_per_ms": round(bw, 1),
                "restore_from": restore_from,
                "verify_from": verify_from,
                "prefill_ms_per_token": round(rate, 4),
                "prefill_from": prefill_from,
            },
        )
