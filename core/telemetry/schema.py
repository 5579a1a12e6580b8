"""The telemetry database's tables, created and evolved by sqlite-utils `Migrations`
(applied in order when `core.telemetry.Telemetry` opens the file)."""

from __future__ import annotations

from typing import cast

import sqlite_utils
from sqlite_utils import Migrations
from sqlite_utils.db import Table


def db_table(db: sqlite_utils.Database, name: str) -> Table:
    """The table `name` of `db`, typed (sqlite-utils' ``db[name]`` may be a view)."""
    return cast(Table, db[name])


migrations = Migrations("warmslot.telemetry")


@migrations()
def m001_initial(db: sqlite_utils.Database) -> None:
    db_table(db, "requests").create(
        {
            "id": int,
            "ts": float,
            "request_id": str,
            "client": str,
            "session": str,
            "endpoint": str,
            "stream": int,
            "has_tools": int,
            "kind": str,
            "status": int,
            "slot": int,
            "prompt_n": int,
            "cache_n": int,
            "prompt_ms": float,
            "predicted_n": int,
            "ttfb_ms": float,
            "total_ms": float,
            "error": str,
        },
        pk="id",
    )
    db_table(db, "requests").create_index(["ts"])
    db_table(db, "server_runs").create(
        {
            "run_id": str,
            "started": float,
            "ended": float,
            "pid": int,
            "port": int,
            "argv": str,
            "binary": str,
            "binary_version": str,
            "model": str,
            "attempt": str,
            "outcome": str,
            "returncode": int,
            "signal": int,
            "requested_by": str,
            "last_lines": str,
        },
        pk="run_id",
    )
    db_table(db, "server_runs").create_index(["started"])
    db_table(db, "events").create(
        {
            "id": int,
            "ts": float,
            "category": str,
            "kind": str,
            "reason": str,
            "fingerprint": str,
            "slot": int,
            "tokens": int,
            "bytes": int,
            "details": str,
        },
        pk="id",
    )
    db_table(db, "events").create_index(["ts"])
    db_table(db, "events").create_index(["category", "ts"])
    db_table(db, "pressure").create(
        {
            "id": int,
            "ts": float,
            "level": str,
            "ram_available_pct": float,
            "swap_used_pct": float,
            "server_rss": int,
            "disk_free_pct": float,
            "gpus": str,
        },
        pk="id",
    )
    db_table(db, "pressure").create_index(["ts"])
    db_table(db, "builds").create(
        {
            "build_id": str,
            "ts": float,
            "inputs": str,
            "duration_s": float,
            "outcome": str,
            "log_path": str,
        },
        pk="build_id",
    )


@migrations()
def m002_sweeps(db: sqlite_utils.Database) -> None:
    """One row per run of a background sweep (see core.sweeps)."""
    db_table(db, "sweeps").create(
        {
            "id": int,
            "ts": float,
            "name": str,
            "started": float,
            "duration_s": float,
            "actions": int,
            "error": str,
            "details": str,
        },
        pk="id",
    )
    db_table(db, "sweeps").create_index(["name", "ts"])


@migrations()
def m003_explanations(db: sqlite_utils.Database) -> None:
    """Why each managed request reused what it did (core.cache.explain): its prompt's
    sections and the first token where it left its slot's previous prompt."""
    db_table(db, "explanations").create(
        {
            "id": int,
            "ts": float,
            "request_id": str,
            "client": str,
            "session": str,
            "slot": int,
            "n_tokens": int,
            "cache_n": int,
            "prompt_n": int,
            "previous_tokens": int,
            "div_token": int,
            "div_section": str,
            "lost_tokens": int,
            "cost_s": float,
            "summary": str,
            "sections": str,
            "divergence": str,
            "compute_ms": float,
        },
        pk="id",
    )
    db_table(db, "explanations").create_index(["ts"])
    db_table(db, "explanations").create_index(["request_id"])


@migrations()
def m004_request_users(db: sqlite_utils.Database) -> None:
    """Who sent each request: the name of its API key (docs/security.md#serving-a-team)."""
    db_table(db, "requests").add_column("user", str, not_null_default="")


@migrations()
def m005_totals(db: sqlite_utils.Database) -> None:
    """What pruned rows added up to (core.telemetry.totals), so lifetime counters outlive
    the rows: one value per counter name and label (a user's name, or "")."""
    db_table(db, "totals").create({"name": str, "label": str, "value": float}, pk=("name", "label"))


@migrations()
def m006_request_models(db: sqlite_utils.Database) -> None:
    """Which model served each request (its file name), so that each model's saving is
    priced at its own prefill rate (core.telemetry.queries.Queries.totals)."""
    db_table(db, "requests").add_column("model", str, not_null_default="")
