"""Reaching the running `warmslot serve` from the CLI (`warmslot status`, `explain`).

Its runtime file names the proxy's address; a wildcard bind is asked on loopback, and
the request carries the key the CLI may use (core.keys: the per-start local key or
proxy.api_key) so a Warmslot that requires keys still answers its own user.
"""

from __future__ import annotations

import json
import urllib.request

from core import config as config_mod
from core.keys import client_key
from core.paths import Paths


def local_request(paths: Paths, path: str) -> urllib.request.Request | None:
    """A GET of `path` (e.g. ``/warmslot/status``) on the running instance, or None when
    none runs (no readable runtime file)."""
    try:
        runtime = json.loads(paths.runtime_file.read_text())
        port = int(runtime["proxy_port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    host = str(runtime.get("proxy_host", "127.0.0.1"))
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    req = urllib.request.Request(f"http://{host}:{port}{path}")
    settings = config_mod.load(paths.config_file)
    if key := client_key(paths.state_dir, settings.proxy.api_key):
        req.add_header("Authorization", f"Bearer {key}")
    return req
