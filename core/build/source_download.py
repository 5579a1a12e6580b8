"""Downloads for build sources: an HTTP GET with Warmslot's errors, and an atomic,
checksum-verified download into the cache."""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.build.source_tree import READ_CHUNK
from core.errors import BuildError

_HTTP_TIMEOUT = 60.0

Logger = Callable[[str], None]


def http_get(url: str, accept: str | None = None) -> Any:
    """Open `url` (the response, a context manager); BuildError when it fails."""
    headers = {"User-Agent": "warmslot (llama.cpp builder)"}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(url, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT)
    except urllib.error.HTTPError as e:
        raise BuildError(
            f"GET {url} failed: HTTP {e.code} {e.reason}",
            hint="Check the package name and version.",
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BuildError(
            f"Cannot reach {urllib.parse.urlparse(url).netloc}: {reason}",
            hint="Check your network connection, or build from a local checkout or archive "
            "(--source PATH).",
        ) from e


def download(url: str, dest: Path, expect_sha256: str | None, emit: Logger) -> str:
    """Download `url` to `dest` atomically; verify the sha256 when one is expected."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + f".part-{os.getpid()}")
    h = hashlib.sha256()
    emit(f"Downloading {url}")
    try:
        with http_get(url) as resp, part.open("wb") as out:
            while chunk := resp.read(READ_CHUNK):
                h.update(chunk)
                out.write(chunk)
        digest = h.hexdigest()
        if expect_sha256 and digest != expect_sha256.lower():
            raise BuildError(
                f"Checksum mismatch for {dest.name}: index says {expect_sha256}, got {digest}",
                hint="The download was corrupted or tampered with; try again.",
            )
        part.replace(dest)
        return digest
    except OSError as e:
        raise BuildError(f"Download of {url} failed: {e}") from e
    finally:
        part.unlink(missing_ok=True)
