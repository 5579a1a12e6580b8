"""Fingerprints: everything that makes a saved KV state valid, hashed.

A state is only reusable by a server with the same model file, the same server
build and the same KV-relevant launch flags and chat template, for the same
tools and stable head. Nothing here is for a user to bump by hand: change any
input and the fingerprint changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerIdentity:
    """What a running server contributes to every fingerprint."""

    model: str  # model file identity
    binary: str  # server build identity
    kv_flags: tuple[str, ...]  # KV-relevant launch flags
    chat_template: str  # sha256 of the template the server uses
    patches: tuple[str, ...] = ()  # Warmslot patch level the server advertises

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (
            self.model,
            self.binary,
            json.dumps(list(self.kv_flags)),
            self.chat_template,
            json.dumps(list(self.patches)),
        ):
            h.update(part.encode() + b"\0")
        return h.hexdigest()

    @property
    def short(self) -> str:
        return self.digest[:16]


def template_hash(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def fingerprint(server: ServerIdentity, tokens: Sequence[int]) -> str:
    """Fingerprint of a prefix: the server identity plus the exact prefix tokens.

    The tokens are the rendered tools and stable head as the server tokenizes them,
    so they cover "the tools verbatim and the stable head" without a second source.
    """
    h = hashlib.sha256(server.digest.encode() + b"\0")
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.hexdigest()


def state_filename(fp: str) -> str:
    """The slot file name for a fingerprint (valid under llama-server's name rules)."""
    if len(fp) < 32 or any(c not in "0123456789abcdef" for c in fp):
        raise ValueError(f"not a fingerprint: {fp!r}")
    return f"ws-{fp[:32]}.bin"
