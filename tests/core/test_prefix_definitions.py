"""The `prefixes` table: learned prefix definitions kept across restarts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.cache.definitions import (
    KEEP_PER_MODEL,
    DefinitionStore,
    PrefixDefinition,
    definition_id,
)
from core.telemetry import Telemetry

TOKENS = tuple(range(100, 400))


def definition(tokens: tuple[int, ...] = TOKENS, **changes: Any) -> PrefixDefinition:
    fields: dict[str, Any] = {
        "model": "model-a",
        "template": "tmpl-1",
        "tokens": tokens,
        "client": "opencode",
        "source": "profile:opencode",
        "shape_key": "shape",
        "first_seen": 1000.0,
        "last_used": 1000.0,
        "rendered_tokens": 350,
        "head_n": 280,
    }
    fields.update(changes)
    return PrefixDefinition(**fields)


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def book(clock: Clock | None = None, **kw: Any) -> DefinitionStore:
    return DefinitionStore(Telemetry(":memory:").db, monotonic=clock or Clock(), **kw)


def test_round_trip_keeps_every_field_and_filters_by_model_and_template() -> None:
    store = book()
    d = definition()
    store.save(d, fingerprint="f" * 64)
    store.save(definition(template="tmpl-2", last_used=2000.0))
    store.save(definition(model="model-b", last_used=3000.0))
    assert store.load("model-a", "tmpl-1") == [d]
    row = store.table.get(d.id)
    assert row["fingerprint"] == "f" * 64 and row["n_tokens"] == len(TOKENS)
    assert d.id == definition_id("model-a", "tmpl-1", TOKENS)
    # Saving the same prefix again (learned again after a restart) keeps its first
    # sighting and its latest use.
    store.save(definition(first_seen=5000.0, last_used=5000.0))
    (again,) = store.load("model-a", "tmpl-1")
    assert (again.first_seen, again.last_used) == (1000.0, 5000.0)
    assert store.load("model-a", "nope") == [] and store.load("nope", "tmpl-1") == []


def test_load_is_most_recent_first_and_limited() -> None:
    store = book()
    for i in range(5):
        store.save(definition(tokens=(*TOKENS, i), last_used=100.0 + i))
    got = store.load("model-a", "tmpl-1", limit=3)
    assert [d.tokens[-1] for d in got] == [4, 3, 2]


def test_the_table_keeps_the_most_recent_per_model() -> None:
    store = book()
    for i in range(KEEP_PER_MODEL + 5):
        store.save(definition(tokens=(*TOKENS, i), last_used=100.0 + i))
    store.save(definition(model="model-b", last_used=1.0))  # oldest of all, other model
    assert store.count("model-a") == KEEP_PER_MODEL
    assert store.count("model-b") == 1
    kept = {d.tokens[-1] for d in store.load("model-a", "tmpl-1")}
    assert kept == set(range(5, KEEP_PER_MODEL + 5))  # the five least recent went


def test_uses_are_written_in_batches_and_on_flush() -> None:
    clock = Clock()
    store = book(clock, flush_s=60.0)
    d = definition()
    store.save(d)
    store.touch(d.id, 2000.0)
    store.touch(d.id, 1500.0)  # out of order: the latest use wins
    assert store.table.get(d.id)["last_used"] == 1000.0  # not written on every use
    clock.now += 61.0
    store.touch(d.id, 2500.0)
    assert store.table.get(d.id)["last_used"] == 2500.0  # due: everything noted is written
    store.touch(d.id, 3000.0)
    assert store.flush() == 1
    assert store.table.get(d.id)["last_used"] == 3000.0
    assert store.flush() == 0


def _raw(store: DefinitionStore, **changes: Any) -> str:
    """Insert a row as a damaged database might hold it; returns its id."""
    row = definition(tokens=(*TOKENS, len(changes))).to_row()
    row.update(changes)
    row["id"] = f"bad-{store.count()}"
    store.table.insert(row)
    return str(row["id"])


def test_damaged_rows_are_ignored_and_deleted() -> None:
    store = book()
    good = definition()
    store.save(good)
    bad = [
        _raw(store, tokens="[1, 2,"),  # not JSON
        _raw(store, tokens=json.dumps([1, -5] + [3] * 40)),  # not token ids
        _raw(store, tokens=json.dumps(["a"] * 40)),
        _raw(store, tokens=json.dumps([1, 2, 3])),  # too short to be a prefix
        _raw(store, tokens=json.dumps({"a": 1})),
        _raw(store, n_tokens=7),  # count does not match the tokens
        _raw(store, last_used="yesterday"),
        _raw(store, meta="{nope"),
    ]
    # Right shape, but the id does not match the content (changed after it was written).
    tampered = definition(tokens=(*TOKENS, 9)).to_row()
    tampered["tokens"] = json.dumps([*TOKENS, 10])
    store.table.insert(tampered)
    bad.append(tampered["id"])
    assert store.load("model-a", "tmpl-1") == [good]
    assert store.ignored == len(bad)
    assert store.count() == 1  # the damaged rows are gone
    assert store.load("model-a", "tmpl-1") == [good] and store.ignored == 0


@pytest.mark.parametrize(
    "changes",
    [
        {"tokens": (1, 2, 3)},  # fewer than a prefix has
        {"tokens": (*TOKENS, True)},  # a bool is not a token id
        {"tokens": (*TOKENS, 1 << 40)},
        {"tokens": [*TOKENS]},  # must be a tuple (immutable)
        {"model": ""},
        {"template": "x" * 1000},
        {"client": None},
        {"last_used": float("nan")},
        {"first_seen": -1.0},
        {"head_n": -3},
    ],
)
def test_invalid_definitions_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        definition(**changes)
