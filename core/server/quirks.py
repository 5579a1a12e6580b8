"""What Warmslot remembers about a llama-server binary: today, that it needs ``--no-repack``.

A crash during warm-up on a build that repacks weights for AMX is retried once with
``--no-repack``, and the binary's identity is written down here so that its next start
uses the flag at once (docs/llama-server-facts.md#amx-repack-crash).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.server.discover import ServerBinary

__all__ = ["BinaryQuirks"]


class BinaryQuirks:
    """``binary-quirks.json`` in the state folder: one entry per binary identity."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "binary-quirks.json"

    def want_no_repack(self, mode: str, binary: ServerBinary) -> bool:
        """Whether to launch `binary` with ``--no-repack`` (`mode`: ``server.no_repack``)."""
        if mode == "on":
            return True
        if mode == "off":
            return False
        if binary.no_repack:  # its smoke start passed only with the flag
            return True
        entry = self._read().get(binary.identity)
        return bool(isinstance(entry, dict) and entry.get("no_repack"))

    def remember_no_repack(self, identity: str, reason: str) -> None:
        quirks = self._read()
        quirks[identity] = {"no_repack": True, "reason": reason, "ts": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(quirks, indent=1))
        tmp.replace(self.path)

    def _read(self) -> dict[str, object]:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}
