"""Every directory Warmslot uses, from one object.

Defaults come from platformdirs. `--dev-dir DIR` or the environment variable
``WARMSLOT_HOME`` put everything under one folder (tests and development).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "warmslot"
HOME_ENV = "WARMSLOT_HOME"


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

    # Files and folders derived from the directories: named once, here.
    @property
    def config_file(self) -> Path:
        return self.config_dir / "warmslot.toml"

    @property
    def telemetry_db(self) -> Path:
        return self.state_dir / "telemetry.sqlite3"

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
        """Create every directory (idempotent)."""
        for d in (
            self.config_dir,
            self.data_dir,
            self.cache_dir,
            self.state_dir,
            self.log_dir,
            self.slot_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)


def resources_dir() -> Path:
    """The `resources/` folder, found the same way from a checkout and a bundle."""
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        return Path(bundle) / "resources"
    return Path(__file__).resolve().parent.parent / "resources"
