"""The one exception tree of Warmslot's core.

::

    WarmslotError                     base of everything raised on purpose
    ├── ConfigError                   a setting is wrong (names file, key, expected, got)
    ├── EnvironmentProblem            the machine is not as needed; `hint` says what to do
    │   ├── BinaryNotFound            no usable llama-server binary
    │   ├── ModelNotFound             no usable GGUF model
    │   ├── PortInUse                 a port we must bind is taken
    │   └── BuildError                building llama-server failed (issue: build)
    ├── ServerError                   llama-server misbehaved
    │   ├── ServerStartFailed         it exited or never became healthy while starting
    │   ├── ServerNotReady            a request needed it while it was not ready
    │   └── UpstreamError             an HTTP call to it failed (status + message)
    ├── CacheError                    a cache operation failed (never reaches a client request)
    │   └── VerificationFailed        a restored state did not prove itself
    └── CoreStopped                   a command was submitted to a core that is not running

Errors caused by the environment carry a `hint` shown to the user; bugs are not
wrapped and are logged with their context.
"""

from __future__ import annotations


class WarmslotError(Exception):
    """Base class for errors Warmslot raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        if hint:
            self.hint = hint

    def user_message(self) -> str:
        """The message plus the hint, as shown in the CLI and the tray."""
        text = str(self)
        return f"{text}\n  → {self.hint}" if self.hint else text


class ConfigError(WarmslotError):
    """A settings file or value is invalid."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        key: str | None = None,
        expected: str | None = None,
        got: object = None,
        hint: str = "",
    ) -> None:
        parts = []
        if file:
            parts.append(str(file))
        if key:
            parts.append(f"key '{key}'")
        where = ": ".join(parts)
        detail = message
        if expected is not None:
            detail += f" (expected {expected}, got {got!r})"
        super().__init__(f"{where}: {detail}" if where else detail, hint=hint)
        self.file = file
        self.key = key
        self.expected = expected
        self.got = got


class EnvironmentProblem(WarmslotError):
    """The machine lacks something Warmslot needs; the hint says what to do."""


class BinaryNotFound(EnvironmentProblem):
    """No usable llama-server binary was found."""


class ModelNotFound(EnvironmentProblem):
    """No usable GGUF model was found."""


class PortInUse(EnvironmentProblem):
    """A port Warmslot must bind is already taken."""


class BuildError(EnvironmentProblem):
    """Building llama-server from source failed."""


class ServerError(WarmslotError):
    """llama-server misbehaved."""


class ServerStartFailed(ServerError):
    """llama-server exited or never became healthy while starting."""


class ServerNotReady(ServerError):
    """A request needed llama-server while it was not ready."""


class UpstreamError(ServerError):
    """An HTTP call to llama-server failed."""

    def __init__(self, message: str, *, status: int = 0, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class CacheError(WarmslotError):
    """A cache operation failed. Never propagates into a client's request."""


class VerificationFailed(CacheError):
    """A restored KV state did not pass verification."""


class CoreStopped(WarmslotError):
    """A command was submitted to a core that is not running."""
