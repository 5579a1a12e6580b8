"""`warmslot explain [REQUEST_ID]`: why a request reused what it did.

Asks the running `warmslot serve` (its local API, ``GET /warmslot/explain``, as
`warmslot status` does) for a request's explanation (core.cache.explain): its prompt in
sections with token counts, and where it left its slot's previous prompt. Without an
id: the latest request. When no Warmslot runs, the telemetry database answers for the
requests it recorded.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, cast

from core.cache.explain import format_explanation, from_row
from core.local_api import local_request
from core.paths import Paths
from core.status import Explanation
from core.telemetry.rows import ExplanationRow


class NotFound(Exception):
    """The running Warmslot has no explanation for the request asked for."""


def fetch_explanation(
    paths: Paths, request_id: str | None, timeout: float = 10.0
) -> Explanation | None:
    """The running instance's explanation of `request_id` (the latest when None); None
    when no instance runs; raises NotFound (its message) when it has none."""
    query = f"?{urllib.parse.urlencode({'id': request_id})}" if request_id else ""
    req = local_request(paths, f"/warmslot/explain{query}")
    if req is None:
        return None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            # Our own endpoint's JSON, built from the same type (core.status).
            data: Explanation = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as e:
        if e.code == 404:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = "no such request"
            raise NotFound(str(message)) from None
        return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def from_database(paths: Paths, request_id: str | None) -> Explanation | None:
    """The explanation as the telemetry database recorded it (read-only), or None."""
    db = paths.telemetry_db
    if not db.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        conn.row_factory = sqlite3.Row
        where, params = ("WHERE request_id = ?", [request_id]) if request_id else ("", [])
        row = conn.execute(
            f"SELECT * FROM explanations {where} ORDER BY id DESC LIMIT 1", params
        ).fetchone()
    except sqlite3.Error:  # an old database without the table
        return None
    finally:
        conn.close()
    # Every column of the explanations table (core.telemetry.rows.ExplanationRow).
    return from_row(cast(ExplanationRow, dict(row))) if row is not None else None


def cmd_explain(args: argparse.Namespace) -> int:
    paths = Paths.default(getattr(args, "dev_dir", None))
    rid = args.request_id
    what = f"request {rid}" if rid else "any request"
    try:
        rec = fetch_explanation(paths, rid)
    except NotFound as e:
        rec = from_database(paths, rid)  # older than what the running instance keeps
        if rec is None:
            print(f"warmslot: {e}", flush=True)
            return 1
    else:
        if rec is None:
            rec = from_database(paths, rid)
            if rec is None:
                print(
                    f"warmslot: no explanation for {what}: Warmslot is not running and its "
                    "database has none (start it with `warmslot serve`)"
                )
                return 3
    if args.json:
        print(json.dumps(rec, indent=2, default=str))
    else:
        print(format_explanation(rec))
    return 0


def register(subparsers: Any) -> None:
    """Add the `explain` subcommand to the main CLI."""
    p = subparsers.add_parser(
        "explain",
        help="why a request reused what it did: its prompt's sections and where it "
        "diverged from its slot's previous prompt",
    )
    p.add_argument("request_id", nargs="?", help="the request's id (default: the latest)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)
