"""The validators a setting's declaration names, and the metadata each field carries.

A check takes the (already type-checked) value and returns None when it is fine, or
what was expected ("a port 0-65535 …") for the error message.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Callable
from enum import StrEnum
from typing import Any

Check = Callable[[Any], str | None]


class Applies(StrEnum):
    """When a changed setting takes effect. Every setting declares one: the tray's
    Settings and `warmslot config set` say it, and `Core.update_settings` reports the
    changed settings that wait for a restart, by kind."""

    LIVE = "live"  # at once: the running Warmslot reads it where it uses it
    SERVER = "server"  # when llama-server restarts (a launch flag, or read at its start)
    WARMSLOT = "warmslot"  # when Warmslot itself restarts (read once when it starts)

    @property
    def words(self) -> str:
        """ "at once", "when llama-server restarts" or "when Warmslot restarts"."""
        return _APPLIES_WORDS[self]


_APPLIES_WORDS = {
    Applies.LIVE: "at once",
    Applies.SERVER: "when llama-server restarts",
    Applies.WARMSLOT: "when Warmslot restarts",
}


def meta(
    description: str,
    check: Check | None = None,
    *,
    applies: Applies,
    choices: tuple[str, ...] | None = None,
) -> dict[str, object]:
    """A settings field's metadata: its description, check, when a change takes effect
    (declared by every field: there is no default) and its choices (read by
    `core.config.schema.section_specs`)."""
    return {"description": description, "check": check, "applies": applies, "choices": choices}


def in_range(lo: float | None = None, hi: float | None = None) -> Check:
    """A check for a number within ``lo..hi`` (either bound may be open)."""

    def check(v: Any) -> str | None:
        if lo is not None and v < lo:
            return f"a number ≥ {lo}"
        if hi is not None and v > hi:
            return f"a number ≤ {hi}"
        return None

    return check


def zero_or_range(lo: float, hi: float) -> Check:
    """A check for 0 (the setting's "choose for me") or a number within ``lo..hi``."""
    inner = in_range(lo, hi)

    def check(v: Any) -> str | None:
        return None if v == 0 else (f"0 or {inner(v)}" if inner(v) else None)

    return check


def valid_port(v: Any) -> str | None:
    """A TCP port, 0 meaning "pick a free one"."""
    return None if 0 <= v <= 65535 else "a port 0-65535 (0 = pick a free one)"


def valid_host(v: Any) -> str | None:
    """An address to bind to: an IP address or ``localhost``."""
    if v == "localhost":
        return None
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return "an IP address such as 127.0.0.1"
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` reaches only this machine: a loopback name or IP address
    ("localhost", 127.0.0.0/8, ::1, also as "[::1]" from a Host header)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def valid_origins(v: Any) -> str | None:
    """Browser origins (scheme://host[:port], no path)."""
    for origin in v:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest.rstrip("/"):
            return "origins such as 'http://127.0.0.1:3000' (scheme://host[:port], no path)"
    return None


def valid_profile_name(v: Any) -> str | None:
    """A model profile's name, as clients send it in `model`."""
    ok = bool(v) and len(v) <= 128 and all(c.isalnum() or c in "._:-/" for c in v)
    return None if ok else "a name of letters, digits and . _ : - / (as clients send `model`)"


def valid_ttl(v: Any) -> str | None:
    """A profile's idle time to live: -1 never, 0 the role's default, else seconds."""
    return None if v >= -1 else "-1 (never), 0 (the role's default) or seconds > 0"


def valid_worker_address(v: Any) -> str | None:
    """An RPC worker's host name or IPv4 address."""
    # llama.cpp splits an --rpc endpoint at its first ':' and the list at ',', so an
    # IPv6 literal cannot be written there at all.
    if ":" in v:
        return "an IPv4 address or a host name (llama.cpp's --rpc cannot take IPv6)"
    try:
        ipaddress.IPv4Address(v)
        return None
    except ValueError:
        pass
    labels = v.split(".")
    ok = (
        bool(v)
        and len(v) <= 253
        and all(
            0 < len(label) <= 63
            and label[0] != "-"
            and label[-1] != "-"
            and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
            for label in labels
        )
    )
    return None if ok else "an IPv4 address or a host name such as gpu-box.lan"


def valid_worker_name(v: Any) -> str | None:
    """An RPC worker's display name (may be empty)."""
    ok = len(v) <= 64 and all(c.isalnum() or c in "._-" for c in v)
    return None if ok else "empty, or up to 64 letters, digits and . _ -"


def valid_backend_name(v: Any) -> str | None:
    """A backend's name; 'main' is the primary server's."""
    ok = 0 < len(v) <= 64 and all(c.isalnum() or c in "._-" for c in v) and v != "main"
    return None if ok else "1 to 64 letters, digits and . _ - (not 'main': the primary server)"


def valid_backend_url(v: Any) -> str | None:
    """A remote backend's base URL (no path), or empty for one launched here."""
    if not v:
        return None
    parsed = urllib.parse.urlsplit(v)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "empty (launched here), or a base URL such as http://10.0.0.3:8080"
    if parsed.path.strip("/") or parsed.query or parsed.fragment:
        return "a base URL without a path (http://host:port)"
    return None
