"""The one ``/metrics``: Warmslot's counters in Prometheus' text format, through
``prometheus_client`` (a custom collector, so every series has its HELP and TYPE).

`Counters` are lifetime totals: seeded once at start from the history
(`core.telemetry.totals.lifetime`, which keeps what pruned rows added up to), then counted in
memory from the same events the history records — so a counter never goes down, not
when the hourly prune deletes old rows and not when Warmslot starts again, and a scrape
runs no query over the history. `Metrics` renders them with the gauges read at scrape
time (is the server ready, each backend's state). docs/security.md#metrics lists the
series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from core.events import CacheEvent, CacheEventKind, Event, RequestCompleted, ServerExited
from core.status.server import ServerRow
from core.telemetry.totals import LifetimeTotals, UserTotals

__all__ = ["CONTENT_TYPE", "COUNTED", "Counters", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The events the counters count (`Counters.record`): subscribe it to these.
COUNTED: tuple[type[Event], ...] = (RequestCompleted, CacheEvent, ServerExited)


class Counters:
    """Lifetime totals of requests (per user), cache bypasses and llama-server crashes.

    The history holds a row for each of these events, so the totals it gives at start
    and the counting here agree: what one run counted, the next one starts from.
    """

    def __init__(self) -> None:
        self.totals = LifetimeTotals()

    def seed(self, history: LifetimeTotals) -> None:
        """Add what the history counted before this start (once, before any event)."""
        self.totals.add(history)

    def record(self, event: Event) -> None:
        """Count one event (a bus subscriber, on the core thread)."""
        if isinstance(event, RequestCompleted):
            t = self.totals.user(event.user)
            t.requests += 1
            t.errors += int(event.status >= 400 or bool(event.error))
            t.prompt_tokens += event.prompt_n or 0
            t.cached_tokens += event.cache_n or 0
            t.prefill_ms += event.prompt_ms or 0.0
        elif isinstance(event, CacheEvent) and event.kind == CacheEventKind.BYPASS:
            self.totals.cache_bypasses += 1
        elif isinstance(event, ServerExited) and event.outcome == "crashed":
            self.totals.server_crashes += 1


class Metrics(Collector):
    """The collector behind ``/metrics``: `counters`, and gauges read when scraped —
    `server_ready` (the primary llama-server answers) and `backends` (the rows of
    ``[[backends]]``, empty without)."""

    def __init__(
        self,
        counters: Counters,
        *,
        server_ready: Callable[[], bool],
        backends: Callable[[], Sequence[ServerRow]] = lambda: (),
    ) -> None:
        self._counters = counters
        self._server_ready = server_ready
        self._backends = backends
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def exposition(self) -> bytes:
        """The text a scrape gets (`CONTENT_TYPE`)."""
        return generate_latest(self._registry)

    def collect(self) -> Iterator[Metric]:
        totals = self._counters.totals
        every = totals.all
        yield _counter("warmslot_requests_total", "Requests handled by the proxy.", every.requests)
        yield _counter(
            "warmslot_request_errors_total",
            "Requests answered with an error status (400 or more) or that failed.",
            every.errors,
        )
        yield _counter(
            "warmslot_prompt_tokens_total",
            "Prompt tokens evaluated (not from cache).",
            every.prompt_tokens,
        )
        yield _counter(
            "warmslot_cached_tokens_total",
            "Prompt tokens reused from the KV cache.",
            every.cached_tokens,
        )
        seen = every.prompt_tokens + every.cached_tokens
        yield GaugeMetricFamily(
            "warmslot_hit_ratio",
            "Share of all prompt tokens that were reused from the KV cache.",
            value=every.cached_tokens / seen if seen else 0.0,
        )
        yield _counter(
            "warmslot_cache_bypass_total",
            "Requests that went on untouched after a cache failure.",
            totals.cache_bypasses,
        )
        yield _counter(
            "warmslot_server_crashes_total",
            "Times a llama-server Warmslot runs exited without being asked to.",
            totals.server_crashes,
        )
        yield GaugeMetricFamily(
            "warmslot_server_ready",
            "1 while the primary llama-server is ready, else 0.",
            value=1 if self._server_ready() else 0,
        )
        yield from _per_user(totals.users)
        yield from _per_backend(self._backends())


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


# Per API key name: (series, help, the totals' field, scale).
_USER_SERIES = (
    ("warmslot_user_requests_total", "Requests per API key name.", "requests", 1.0),
    (
        "warmslot_user_prompt_tokens_total",
        "Prompt tokens evaluated, per API key name.",
        "prompt_tokens",
        1.0,
    ),
    (
        "warmslot_user_cached_tokens_total",
        "Prompt tokens reused from the cache, per API key name.",
        "cached_tokens",
        1.0,
    ),
    (
        "warmslot_user_prefill_seconds_total",
        "Seconds of prompt prefill, per API key name.",
        "prefill_ms",
        0.001,
    ),
)


def _per_user(users: dict[str, UserTotals]) -> Iterator[Metric]:
    """Only for named keys (docs/security.md#serving-a-team): none without."""
    named = sorted((name, t) for name, t in users.items() if name)
    if not named:
        return
    for series, help_text, field, scale in _USER_SERIES:
        family = CounterMetricFamily(series, help_text, labels=["user"])
        for name, t in named:
            family.add_metric([name], getattr(t, field) * scale)
        yield family


def _per_backend(rows: Sequence[ServerRow]) -> Iterator[Metric]:
    """With ``[[backends]]`` only (docs/scale.md#status-and-metrics). Counted since
    Warmslot started: a restart begins them at 0, which Prometheus reads as a reset."""
    if not rows:
        return
    ready = GaugeMetricFamily(
        "warmslot_backend_ready", "1 while the backend answers, else 0.", labels=["backend"]
    )
    inflight = GaugeMetricFamily(
        "warmslot_backend_inflight", "Requests the backend is serving now.", labels=["backend"]
    )
    moved = CounterMetricFamily(
        "warmslot_backend_sessions_moved_in_total",
        "Sessions moved to the backend from another one.",
        labels=["backend"],
    )
    prompt = CounterMetricFamily(
        "warmslot_backend_prompt_tokens_total",
        "Prompt tokens of the requests the backend completed, cached ones included.",
        labels=["backend"],
    )
    cached = CounterMetricFamily(
        "warmslot_backend_cached_tokens_total",
        "Prompt tokens the backend reused from its KV cache.",
        labels=["backend"],
    )
    calls = CounterMetricFamily(
        "warmslot_backend_requests_total",
        "Requests sent to the backend, per request kind.",
        labels=["backend", "kind"],
    )
    for r in rows:
        name = r["name"]
        ready.add_metric([name], 1 if r["ready"] else 0)
        inflight.add_metric([name], r["inflight"])
        moved.add_metric([name], r.get("moved_in", 0))
        prompt.add_metric([name], r["prompt_tokens"])
        cached.add_metric([name], r["cached_tokens"])
        for kind, n in r["calls"].items():
            calls.add_metric([name, kind], n)
    yield from (ready, inflight, moved, prompt, cached, calls)
