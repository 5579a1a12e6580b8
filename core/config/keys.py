"""API keys for serving a team: named keys, checked by the proxy, managed by `warmslot keys`.

A key file (``keys.toml`` beside the settings file, owner-only) lists one table per user::

    [[keys]]
    name = "alice"
    sha256 = "…"          # of the key; the key itself was shown once by `warmslot keys add`
    created = 1764556800.0

Only a key's SHA-256 is kept: the keys are 256 random bits, so a plain hash cannot be
reversed or guessed, and a copy of the file (a backup, a screen share) opens nothing.
``proxy.api_key`` from the settings keeps working as the key named ``default``. A running
proxy reads the file again when it changes, so `warmslot keys remove` revokes at once.

Each running instance also makes a *local* key (new per start, in an owner-only file
``state/proxy-local.key``) that `warmslot status` and `warmslot explain` on the same machine,
as the same OS user, send; it is accounted as the user ``local``.

With any key configured every request must carry one (docs/security.md#serving-a-team).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import tomlkit

__all__ = [
    "DEFAULT_USER",
    "LOCAL_USER",
    "ApiKey",
    "KeyFileError",
    "KeyRing",
    "add_key",
    "client_key",
    "digest",
    "keys_file",
    "load_keys",
    "local_key_file",
    "presented_key",
    "remove_key",
    "write_local_key",
]

log = logging.getLogger("warmslot.keys")

DEFAULT_USER = "default"  # the name `proxy.api_key` is accounted under
LOCAL_USER = "local"  # this machine's own CLI (the per-start local key)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RESERVED = (DEFAULT_USER, LOCAL_USER)
KEY_PREFIX = "wsk-"  # so a leaked key is recognisable as Warmslot's (secret scanners)


class KeyFileError(ValueError):
    """A key operation that cannot be done (a bad or taken name, an unreadable file)."""


@dataclass(frozen=True)
class ApiKey:
    """One named key as the key file holds it: never the key itself."""

    name: str
    sha256: str
    created: float


def keys_file(config_file: Path) -> Path:
    """The key file beside the settings file."""
    return config_file.with_name("keys.toml")


def key_required(config_file: Path, api_key: str) -> bool:
    """Whether clients must send a key: named keys beside `config_file` or `api_key`
    (proxy.api_key) — what client setup snippets follow."""
    return KeyRing(keys_file(config_file), lambda: api_key).required()


def local_key_file(state_dir: Path) -> Path:
    """Where a running instance keeps its local key (an owner-only file; not in
    ``state/run/``, which holds llama-server's key only while it starts)."""
    return state_dir / "proxy-local.key"


def digest(key: str) -> str:
    """The SHA-256 (hex) the key file keeps of a key."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def presented_key(headers: Mapping[str, str]) -> str:
    """The key a request carries: ``Authorization: Bearer KEY`` (OpenAI clients), else
    ``X-Api-Key`` (Anthropic clients such as Claude Code with ANTHROPIC_API_KEY)."""
    auth = headers.get("Authorization", headers.get("authorization", "")).strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("X-Api-Key", headers.get("x-api-key", "")).strip()


def load_keys(path: Path) -> list[ApiKey]:
    """The keys in `path` ([] when there is no file); raises KeyFileError for a bad file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise KeyFileError(f"{path}: cannot be read ({e.strerror})") from e
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KeyFileError(f"{path}: not valid TOML ({e})") from e
    out: list[ApiKey] = []
    tables = doc.get("keys", [])
    if not isinstance(tables, list):
        raise KeyFileError(f"{path}: 'keys' must be a list of tables ([[keys]])")
    for i, t in enumerate(tables):
        name = t.get("name") if isinstance(t, dict) else None
        sha = t.get("sha256") if isinstance(t, dict) else None
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in _RESERVED:
            raise KeyFileError(f"{path}: keys[{i}].name must be a name such as 'alice'")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise KeyFileError(f"{path}: keys[{i}].sha256 must be 64 hex digits")
        if any(k.name == name for k in out):
            raise KeyFileError(f"{path}: the name {name!r} is used twice")
        created = t.get("created", 0.0)
        out.append(ApiKey(name, sha, float(created) if isinstance(created, int | float) else 0.0))
    return out


def _write(path: Path, keys: list[ApiKey]) -> None:
    doc = tomlkit.document()
    doc.add(tomlkit.comment("Warmslot API keys: manage them with `warmslot keys`."))
    doc.add(tomlkit.comment("Only each key's SHA-256 is kept; the key was shown once."))
    aot = tomlkit.aot()
    for k in keys:
        table = tomlkit.table()
        table.add("name", k.name)
        table.add("sha256", k.sha256)
        table.add("created", k.created)
        aot.append(table)
    doc.add("keys", aot)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tomlkit.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_key(path: Path, name: str, *, clock: Callable[[], float] = time.time) -> str:
    """Make a new key named `name`, keep its hash in `path`, return the key (only here)."""
    if not _NAME_RE.match(name):
        raise KeyFileError(
            f"{name!r} is not a key name: letters, digits, '_', '.', '-' (at most 64)"
        )
    if name in _RESERVED:
        raise KeyFileError(
            f"{name!r} is reserved ({DEFAULT_USER}: proxy.api_key; {LOCAL_USER}: this "
            "machine's own CLI)"
        )
    keys = load_keys(path)
    if any(k.name == name for k in keys):
        raise KeyFileError(f"a key named {name!r} exists; remove it first to replace it")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    _write(path, [*keys, ApiKey(name, digest(key), round(clock(), 3))])
    return key


def remove_key(path: Path, name: str) -> bool:
    """Remove the key named `name`; False when there was none."""
    keys = load_keys(path)
    left = [k for k in keys if k.name != name]
    if len(left) == len(keys):
        return False
    _write(path, left)
    return True


def write_local_key(state_dir: Path) -> str:
    """Make this start's local key and write it owner-only; returns it."""
    path = local_key_file(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key)
    os.replace(tmp, path)
    return key


def client_key(state_dir: Path, api_key: str) -> str:
    """The key this machine's CLI sends to its running proxy: ``proxy.api_key`` when
    set, else the running instance's local key ("" when there is none)."""
    if api_key:
        return api_key
    try:
        return local_key_file(state_dir).read_text(encoding="utf-8").strip()
    except OSError:
        return ""


class KeyRing:
    """The keys the proxy accepts: the key file's (re-read when it changes), the
    settings' ``proxy.api_key`` (as ``default``) and this start's local key.

    `user_for` compares the presented key's SHA-256 with every known one in constant
    time (`hmac.compare_digest`, no early exit), so timing tells nothing of which key
    or how much of one matched."""

    def __init__(
        self,
        path: Path | None = None,
        default: Callable[[], str] = lambda: "",
        *,
        local: str = "",
    ) -> None:
        self.path = path
        self._default = default
        self._local = digest(local) if local else ""
        self._stamp: tuple[int, int, int] | None = None
        self._keys: list[ApiKey] = []
        self.problem = ""  # why the key file could not be read ("" when it could)

    def _named(self) -> list[ApiKey]:
        if self.path is None:
            return []
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        except OSError as e:
            stamp = (-1, -1, -1)
            self.problem = f"{self.path}: {e.strerror}"
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._keys = load_keys(self.path)
                self.problem = ""
            except KeyFileError as e:
                # Fail closed: a key file that cannot be read accepts none of its keys,
                # and still makes keys required (below).
                self._keys = []
                self.problem = str(e)
                log.error("API keys not loaded: %s; only proxy.api_key is accepted", e)
        return self._keys

    def required(self) -> bool:
        """Whether requests must carry a key: any key is configured (or the key file
        exists but cannot be read)."""
        return bool(self._default() or self._named() or self.problem)

    def names(self) -> list[str]:
        """The users that may call (never their keys)."""
        out = [DEFAULT_USER] if self._default() else []
        return out + [k.name for k in self._named()]

    def user_for(self, given: str) -> str | None:
        """The name of the key `given` is, or None when it is none of them."""
        if not given:
            return None
        mine = digest(given).encode()
        found: str | None = None
        candidates: list[tuple[str, str]] = [(k.name, k.sha256) for k in self._named()]
        if default := self._default():
            candidates.append((DEFAULT_USER, digest(default)))
        if self._local:
            candidates.append((LOCAL_USER, self._local))
        for name, sha in candidates:
            if hmac.compare_digest(mine, sha.encode()) and found is None:
                found = name
        return found
