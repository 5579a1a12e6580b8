"""Every directory Warmslot uses, from one object.

Defaults come from platformdirs. `--dev-dir DIR` or the environment variable
``WARMSLOT_HOME`` put everything under one folder (tests and development).

Everything Warmslot writes is its user's alone: the databases, the slot files (prompts'
token ids), the logs (prompts and paths), keys, config and state. `Paths.ensure`, which
every entry point (``warmslot serve``, the tray, the `Core`) calls before it writes
anything, makes each folder ``0700`` and sets the process umask to `PRIVATE_UMASK`, so
every file made from then on — by Warmslot, SQLite's ``-wal``/``-shm`` files, rotated
logs, and llama-server, which inherits the umask and writes the slot files itself — is
``0600`` (folders ``0700``). One place, not a mode at each of the many creators
(docs/security.md#file-modes).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import platformdirs

APP_NAME = "warmslot"
HOME_ENV = "WARMSLOT_HOME"
# The umask of a Warmslot process (POSIX): no access for the group and others.
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700


@dataclass(frozen=True)
class Paths:
    """The directories of one Warmslot installation."""

    config_dir: Path
    data_dir: Path
    cache_dir: Path
    state_dir: Path
    log_dir: Path

    @classmethod
    def default(cls, dev_dir: str | os.PathLike[str] | None = None) -> Paths:
        """Paths from `dev_dir`, else ``$WARMSLOT_HOME``, else the OS's per-user dirs."""
        base = dev_dir if dev_dir is not None else os.environ.get(HOME_ENV) or None
        if base is not None:
            return cls.under(Path(base))
        return cls(
            config_dir=Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
            data_dir=Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)),
            cache_dir=Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)),
            state_dir=Path(platformdirs.user_state_dir(APP_NAME, appauthor=False)),
            log_dir=Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)),
        )

    @classmethod
    def under(cls, base: Path) -> Paths:
        """All directories below one folder."""
        base = base.expanduser().resolve()
        return cls(
            config_dir=base / "config",
            data_dir=base / "data",
            cache_dir=base / "cache",
            state_dir=base / "state",
            log_dir=base / "logs",
        )

    def scratch(self, base: Path) -> Paths:
        """The folders of a throwaway run under `base` (a benchmark) that share this
        installation's cache: its llama-server builds and assembled models, so the run
        neither builds again what is built nor throws away a build it needed."""
        return replace(Paths.under(base), cache_dir=self.cache_dir)

    # Files and folders derived from the directories: named once, here.
    @property
    def config_file(self) -> Path:
        return self.config_dir / "warmslot.toml"

    @property
    def telemetry_db(self) -> Path:
        """The history (requests, events, charts): losing it loses no cache state."""
        return self.state_dir / "telemetry.sqlite3"

    @property
    def cache_index_db(self) -> Path:
        """The cache index (`core.cache.index`): what the slot files under `slot_dir` are.

        In the state folder beside them, not the data folder: it describes files that
        live there and is worth nothing without them (and they nothing without it), and
        state is what the platform keeps across restarts but not in backups of a user's
        documents (XDG_STATE_HOME; the data folder on macOS and Windows anyway)."""
        return self.state_dir / "cache-index.sqlite3"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def slot_dir(self) -> Path:
        """Where llama-server writes slot files (`--slot-save-path`)."""
        return self.state_dir / "slots"

    @property
    def builds_dir(self) -> Path:
        return self.cache_dir / "builds"

    @property
    def server_log(self) -> Path:
        return self.log_dir / "llama-server.log"

    @property
    def core_log(self) -> Path:
        return self.log_dir / "warmslot.log"

    @property
    def runtime_file(self) -> Path:
        """JSON with the running instance's ports and pid (for `warmslot status`)."""
        return self.state_dir / "runtime.json"

    def ensure(self) -> None:
        """Create every directory, owner-only, and make what this process creates from now
        on owner-only too (the module docstring says why). Idempotent; a folder an older
        version made with the default mode is tightened to ``0700``."""
        private_umask()
        for d in (
            self.config_dir,
            self.data_dir,
            self.cache_dir,
            self.state_dir,
            self.log_dir,
            self.slot_dir,
        ):
            d.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
            if os.name == "posix":
                with contextlib.suppress(OSError):  # not ours to change: used as it is
                    d.chmod(PRIVATE_DIR_MODE)


def private_umask() -> None:
    """Set the process umask to `PRIVATE_UMASK` (POSIX; Windows has none: its folders under
    the user's profile are the user's)."""
    if os.name == "posix":
        os.umask(PRIVATE_UMASK)


def resources_dir() -> Path:
    """The `resources/` folder, found the same way from a checkout and a bundle."""
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        return Path(bundle) / "resources"
    return Path(__file__).resolve().parent.parent / "resources"
