"""Learned prefix definitions, kept across restarts.

A prefix Warmslot learned — the tokens of a client's stable prefix, as the
server rendered and tokenized them — is only worth something while a slot
holds it. Slot files keep the *state* where the disk tier is valid; this table
(``prefixes``, created by `core.cache.store`'s migrations in the cache index,
`core.cache.index`) keeps the *definition*, what to prewarm, everywhere. After Warmslot
itself restarts, the most recently used definitions are loaded and warmed
again from their tokens (see `core.cache.boot`); with the disk tier on, they
are the fallback for a saved state that fails verification.

A definition is valid for one model file and one chat template: its tokens are
that template's rendering through that model's tokenizer. The rest of the
server identity (build, launch flags, patches) does not change which tokens to
send, so the fingerprint is recomputed for whatever server runs.

Writes are cheap: one upsert when a prefix is learned; a use only marks the
row dirty, and dirty rows are written together at most every `TOUCH_FLUSH_S`
seconds and on close (a crash loses at most that much recency). Each model
keeps its `KEEP_PER_MODEL` most recently used definitions. A row that does not
parse, or whose id does not match its content, is ignored and deleted.

Use from the thread that owns the database (the core thread).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import sqlite_utils
from sqlite_utils.db import NotFoundError, Table

from core.cache.prefix import MIN_PREFIX_TOKENS
from core.cache.store import migrations

__all__ = [
    "KEEP_PER_MODEL",
    "TOUCH_FLUSH_S",
    "DefinitionStore",
    "PrefixDefinition",
    "definition_id",
]

log = logging.getLogger("warmslot.cache")

KEEP_PER_MODEL = 50  # definitions kept per model file (most recently used)
TOUCH_FLUSH_S = 60.0  # how often uses are written (seconds), besides on close
MAX_TOKENS = 1 << 20  # longer than any context a slot can have
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TEXT = 256  # longest client / source / key / identity string accepted


def definition_id(model: str, template: str, tokens: Sequence[int]) -> str:
    """The row id: the model, the template and the exact tokens, hashed."""
    h = hashlib.sha256(model.encode() + b"\0" + template.encode() + b"\0")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.hexdigest()[:32]


def _check_text(name: str, value: object, *, required: bool = False) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or (required and not value):
        raise ValueError(f"{name} must be a string of 1..{MAX_TEXT} characters")
    return value


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite time ≥ 0")
    return float(value)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be a count of tokens")
    return value


@dataclass(frozen=True)
class PrefixDefinition:
    """What to prewarm for one learned prefix, and what it is valid for.

    Construction validates every field (raises ValueError), so a definition
    that exists is one that can be sent to a server.
    """

    model: str  # model file identity (`ServerIdentity.model`)
    template: str  # chat template hash (`ServerIdentity.chat_template`)
    tokens: tuple[int, ...]
    client: str
    source: str  # profile:<name> | learned | generic
    shape_key: str = ""  # the request shape it was learned from ("" when unknown)
    first_seen: float = 0.0
    last_used: float = 0.0
    rendered_tokens: int = 0  # length of the whole rendered prompt it was cut from
    head_n: int = 0  # tokens of the profile's head within it

    def __post_init__(self) -> None:
        _check_text("model", self.model, required=True)
        _check_text("template", self.template, required=True)
        _check_text("client", self.client)
        _check_text("source", self.source)
        _check_text("shape_key", self.shape_key)
        _check_time("first_seen", self.first_seen)
        _check_time("last_used", self.last_used)
        _check_count("rendered_tokens", self.rendered_tokens)
        _check_count("head_n", self.head_n)
        if not isinstance(self.tokens, tuple):
            raise ValueError("tokens must be a tuple of token ids")
        if not MIN_PREFIX_TOKENS <= len(self.tokens) <= MAX_TOKENS:
            raise ValueError(f"a prefix has {MIN_PREFIX_TOKENS}..{MAX_TOKENS} tokens")
        for t in self.tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"not a token id: {t!r}")

    @property
    def id(self) -> str:
        return definition_id(self.model, self.template, self.tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def to_row(self, fingerprint: str = "") -> dict[str, str | int | float]:
        """Its row of the ``prefixes`` table (tokens and meta as JSON text)."""
        return {
            "id": self.id,
            "model": self.model,
            "template": self.template,
            "shape_key": self.shape_key,
            "client": self.client,
            "source": self.source,
            "tokens": json.dumps(list(self.tokens), separators=(",", ":")),
            "n_tokens": self.n_tokens,
            "fingerprint": fingerprint,
            "first_seen": self.first_seen,
            "last_used": self.last_used,
            "meta": json.dumps({"rendered_tokens": self.rendered_tokens, "head_n": self.head_n}),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> PrefixDefinition:
        """Parse and check a stored row; ValueError when it is damaged in any way."""
        try:
            tokens = json.loads(row["tokens"])
            meta = json.loads(row.get("meta") or "{}")
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable row: {e}") from e
        if not isinstance(tokens, list) or not isinstance(meta, dict):
            raise ValueError("tokens must be a list and meta an object")
        d = cls(
            model=row.get("model"),  # type: ignore[arg-type]  # checked in __post_init__
            template=row.get("template"),  # type: ignore[arg-type]
            tokens=tuple(tokens),
            client=row.get("client") or "",
            source=row.get("source") or "",
            shape_key=row.get("shape_key") or "",
            first_seen=row.get("first_seen") or 0.0,
            last_used=row.get("last_used") or 0.0,
            rendered_tokens=meta.get("rendered_tokens", 0),
            head_n=meta.get("head_n", 0),
        )
        if row.get("n_tokens") != d.n_tokens:
            raise ValueError(f"n_tokens {row.get('n_tokens')!r} ≠ {d.n_tokens} tokens stored")
        if row.get("id") != d.id:
            raise ValueError("id does not match the content (changed or corrupted)")
        return d


class DefinitionStore:
    """The ``prefixes`` table: save on learn, batched uses, load per model and template."""

    def __init__(
        self,
        db: sqlite_utils.Database,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        keep: int = KEEP_PER_MODEL,
        flush_s: float = TOUCH_FLUSH_S,
    ) -> None:
        self.db = db
        self.keep = keep
        self.flush_s = flush_s
        self._monotonic = monotonic
        self._dirty: dict[str, float] = {}  # id → last use not written yet
        self._last_flush = monotonic()
        self.ignored = 0  # damaged rows deleted by the last `load`
        migrations.apply(db)

    @property
    def table(self) -> Table:
        return cast(Table, self.db["prefixes"])

    def save(self, d: PrefixDefinition, fingerprint: str = "") -> None:
        """Upsert a definition (once per learned prefix), keeping its first sighting,
        then drop the model's least recently used rows beyond `keep`."""
        row = d.to_row(fingerprint)
        try:
            old = self.table.get(d.id)
            row["first_seen"] = min(float(old["first_seen"] or d.first_seen), d.first_seen)
            row["last_used"] = max(float(old["last_used"] or 0.0), d.last_used)
        except NotFoundError:
            pass
        with self.db.atomic():
            self.table.upsert(row, pk="id")
            self._cap(d.model)
        self._dirty.pop(d.id, None)

    def touch(self, def_id: str, last_used: float) -> None:
        """Note a use; written with the others at most every `flush_s` seconds."""
        self._dirty[def_id] = max(last_used, self._dirty.get(def_id, 0.0))
        if self._monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> int:
        """Write the noted uses in one transaction; returns how many rows."""
        dirty, self._dirty = self._dirty, {}
        self._last_flush = self._monotonic()
        if not dirty:
            return 0
        with self.db.atomic():
            for def_id, ts in dirty.items():
                self.db.execute(
                    "UPDATE prefixes SET last_used = MAX(last_used, ?) WHERE id = ?", [ts, def_id]
                )
        return len(dirty)

    def load(
        self, model: str, template: str, limit: int = KEEP_PER_MODEL
    ) -> list[PrefixDefinition]:
        """The `limit` most recently used valid definitions for a model and template.

        Damaged rows met on the way are deleted (their count is in `ignored`).
        """
        self.flush()
        good: list[PrefixDefinition] = []
        bad: list[str] = []
        rows = self.table.rows_where(
            "model = ? AND template = ?", [model, template], order_by="last_used desc"
        )
        for row in rows:
            try:
                good.append(PrefixDefinition.from_row(row))
            except ValueError as e:
                log.warning("ignoring a damaged prefix definition %r: %s", row.get("id"), e)
                bad.append(str(row.get("id")))
            if len(good) >= limit:
                break
        if bad:
            with self.db.atomic():
                for def_id in bad:
                    self.table.delete_where("id = ?", [def_id])
        self.ignored = len(bad)
        return good

    def count(self, model: str | None = None) -> int:
        if model is None:
            return int(self.table.count)
        row = self.db.execute("SELECT COUNT(*) FROM prefixes WHERE model = ?", [model]).fetchone()
        return int(row[0])

    def _cap(self, model: str) -> None:
        self.db.execute(
            "DELETE FROM prefixes WHERE model = ? AND id NOT IN "
            "(SELECT id FROM prefixes WHERE model = ? ORDER BY last_used DESC LIMIT ?)",
            [model, model, self.keep],
        )
