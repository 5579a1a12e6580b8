"""Who may talk to a llama-server: its port, and the API key only Warmslot knows.

Each launch gets a new random API key, so that nothing else on the machine (another
user's process, a web page that found the port) can use the server behind Warmslot's
back (docs/security.md#llama-servers-port). It travels in an owner-only file (never on
the command line, which ``ps`` shows to everyone) that is deleted as soon as the server
has read it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from core.errors import PortInUse

__all__ = ["CORS_ENV", "KEY_FLAGS", "check_port_free", "free_port", "remove", "write_key_file"]

# Cross-origin reads of llama-server's answers: none. Set through the environment, which
# a build without these options ignores (an unknown flag would stop it starting); a
# ``--cors-*`` flag in the settings' extra args still wins (docs/security.md#llama-servers-port).
CORS_ENV = ("LLAMA_ARG_CORS_ORIGINS", "LLAMA_ARG_CORS_CREDENTIALS")
KEY_FLAGS = ("--api-key", "--api-key-file")


def free_port(host: str) -> int:
    """A port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise `PortInUse` when `host`:`port` cannot be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUse(
                f"{what} port {host}:{port} is already in use ({e.strerror})",
                hint="stop the other program or choose another port in settings",
            ) from e


def write_key_file(state_dir: Path, name: str, run_id: str, key: str) -> Path:
    """`key` in a new owner-only file in an owner-only folder, for ``--api-key-file``;
    `name` is the server's model profile ("" for the primary server)."""
    run_dir = state_dir / "run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.name != "nt":
        run_dir.chmod(0o700)  # it may predate this code, made with the default mode
    stem = "".join(c if c.isalnum() or c in "_-" else "_" for c in name) or "_primary"
    # Left over when Warmslot was killed while a server started: its key is dead.
    for old in run_dir.glob(f"{stem}.*.key"):
        remove(old)
    path = run_dir / f"{stem}.{run_id}.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def remove(path: Path) -> None:
    """Delete `path`; gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
