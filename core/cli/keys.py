"""`warmslot keys add|list|remove`: one named API key per user of a shared proxy.

The key file and its rules are `core.config.keys`'s; this module only talks to the user. A
running proxy reads the file again when it changes: a key added or removed here counts
from the next request, without a restart (docs/security.md#serving-a-team).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from typing import Any, TypedDict

from core import config as config_mod
from core.config.keys import DEFAULT_USER, KeyFileError, add_key, keys_file, load_keys, remove_key
from core.errors import ConfigError
from core.paths import Paths


def _paths(args: argparse.Namespace) -> Paths:
    return Paths.default(getattr(args, "dev_dir", None))


def last_used(paths: Paths) -> dict[str, tuple[float, int]]:
    """Per user: (time of the latest request, requests), from the telemetry database
    (read-only; {} when there is none or it predates per-user accounting)."""
    db = paths.telemetry_db
    if not db.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.Error:
        return {}
    try:
        rows = conn.execute("SELECT user, MAX(ts), COUNT(*) FROM requests GROUP BY user")
        return {str(u): (float(ts), int(n)) for u, ts, n in rows.fetchall()}
    except sqlite3.Error:  # no `user` column yet
        return {}
    finally:
        conn.close()


def _when(ts: float | None) -> str:
    if not ts:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def cmd_keys(args: argparse.Namespace) -> int:
    paths = _paths(args)
    path = keys_file(paths.config_file)
    action = getattr(args, "action", None) or "list"
    try:
        if action == "add":
            key = add_key(path, args.name)
            print(f"API key for {args.name!r} (shown once: Warmslot keeps only its SHA-256):")
            print(key)
            print(
                "Clients send it as 'Authorization: Bearer KEY' (OPENAI_API_KEY) or "
                "'x-api-key: KEY' (ANTHROPIC_API_KEY); a running Warmslot accepts it now."
            )
            return 0
        if action == "remove":
            return _remove(paths, args.name)
        return _list(paths, json_out=bool(getattr(args, "json", False)))
    except KeyFileError as e:
        print(f"warmslot: {e}", file=sys.stderr)
        return 1


def _remove(paths: Paths, name: str) -> int:
    path = keys_file(paths.config_file)
    settings = config_mod.load(paths.config_file)
    keys = load_keys(path)
    last = [k.name for k in keys] == [name]
    if last and not settings.proxy.api_key:
        try:  # would the settings still be valid without it?
            config_mod.check_settings(settings)
        except ConfigError:
            print(
                f"warmslot: {name!r} is the last API key and proxy.host = "
                f"{settings.proxy.host} is reachable from the network; set proxy.host to "
                "127.0.0.1 first (`warmslot config set proxy.host 127.0.0.1`)",
                file=sys.stderr,
            )
            return 1
    if not remove_key(path, name):
        print(f"warmslot: no key named {name!r} (`warmslot keys list`)", file=sys.stderr)
        return 1
    print(f"removed the key {name!r}; a running Warmslot refuses it from the next request")
    return 0


class KeyRow(TypedDict):
    """One user in `warmslot keys list` (its --json rows)."""

    name: str
    created: float | None  # None: proxy.api_key, which has no date
    last_used: float | None  # the latest request's time (None: none seen)
    requests: int


def _list(paths: Paths, *, json_out: bool) -> int:
    keys = load_keys(keys_file(paths.config_file))
    settings = config_mod.load(paths.config_file)
    used = last_used(paths)
    rows: list[KeyRow] = [
        {
            "name": k.name,
            "created": k.created,
            "last_used": used.get(k.name, (None, 0))[0],
            "requests": used.get(k.name, (None, 0))[1],
        }
        for k in keys
    ]
    if settings.proxy.api_key:
        u = used.get(DEFAULT_USER, (None, 0))
        rows.insert(0, {"name": DEFAULT_USER, "created": None, "last_used": u[0], "requests": u[1]})
    if json_out:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no API keys: the proxy serves loopback without one (`warmslot keys add NAME`)")
        return 0
    print(f"{'name':<20} {'created':<17} {'last used':<17} requests")
    for r in rows:
        created = "proxy.api_key" if r["name"] == DEFAULT_USER else _when(r["created"])
        print(f"{r['name']:<20} {created:<17} {_when(r['last_used']):<17} {r['requests']}")
    return 0


def register(subparsers: Any) -> None:
    """Add the `keys` subcommand to the main CLI."""
    p = subparsers.add_parser(
        "keys", help="API keys per user for a shared proxy: add (shown once), list, remove"
    )
    p.set_defaults(func=cmd_keys, action=None, json=False)
    sub = p.add_subparsers(dest="action")
    a = sub.add_parser("add", help="make a key for NAME and print it once")
    a.add_argument("name")
    a.set_defaults(func=cmd_keys)
    r = sub.add_parser("remove", help="revoke NAME's key")
    r.add_argument("name")
    r.set_defaults(func=cmd_keys)
    ls = sub.add_parser("list", help="names, created, last used (never the keys)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_keys)
