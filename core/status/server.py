"""llama-server's part of the status: the supervisor's snapshot (binary, model, exits),
the fit plan, the RPC workers, and a running build of it (`core.status`).

Imports nothing from the rest of the core, so every producer can use it.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = [
    "BinaryInfo",
    "BuildStatus",
    "ExitInfo",
    "FitStatus",
    "ModelFileInfo",
    "RemoteDeviceRow",
    "ServerSnapshot",
    "ServerStatus",
    "WorkerCheckRow",
    "WorkerRow",
    "WorkersStatus",
]


class BuildStatus(TypedDict):
    """A running build of llama-server (None in `Status.build` when none runs)."""

    state: str  # "starting" (before its first progress) or "running"
    purpose: str
    percent: float
    background: NotRequired[bool]  # the keys below: once progress arrived
    step: NotRequired[str]
    steps_done: NotRequired[int]
    steps_total: NotRequired[int]
    elapsed_s: NotRequired[float]
    eta_s: NotRequired[float | None]
    text: NotRequired[str]


# ------------------------------------------------------------------ llama-server


class BinaryInfo(TypedDict):
    """The llama-server binary in use."""

    path: str
    source: str
    version: str
    commit: str
    identity: str


class ModelFileInfo(TypedDict):
    """The model file in use."""

    path: str
    source: str
    size: int
    identity: str
    name: NotRequired[str]  # its short name, what llama-server answers as (`--alias`)


class ExitInfo(TypedDict):
    """One exit of llama-server (the newest last)."""

    ts: float
    outcome: str  # requested | crashed | start_failed
    returncode: int | None
    signal: int | None
    requested_by: str
    last_lines: list[str]


class ServerSnapshot(TypedDict):
    """The supervisor's view of its llama-server."""

    state: str  # a core.server.supervisor.ServerState value
    reason: str
    pid: int | None
    port: int | None
    argv: list[str]
    run_id: str
    restarts: int  # crash restarts in a row (for server.max_restarts)
    recent_restarts: int  # of them, those still recent: 0 once steady (degraded_clear_s)
    no_repack: bool
    api_key_protected: bool  # the key itself is never shown
    binary: BinaryInfo | None  # None before the first resolve
    model: ModelFileInfo | None
    exits: list[ExitInfo]


class FitStatus(TypedDict):
    """The fit plan the launch used."""

    plan: dict[str, object]  # core.server.fit.FitPlan.to_dict()
    text: str


class ServerStatus(ServerSnapshot):
    """`Status.server`: the supervisor's snapshot and the fit plan."""

    fit: FitStatus | None


class RemoteDeviceRow(TypedDict):
    """A device an RPC worker offers."""

    name: str  # as llama-server numbers them (RPC0 …)
    endpoint: str
    worker: str  # the worker's label
    total_bytes: int
    free_bytes: int


class WorkerCheckRow(TypedDict):
    """The last check of an RPC worker (core.server.rpc.WorkerCheck)."""

    name: str
    endpoint: str
    label: str
    ok: bool
    problem: str
    devices: list[RemoteDeviceRow]
    elapsed_ms: float
    checked_at: float


class WorkerRow(TypedDict):
    """One RPC worker in status (core.server.rpc)."""

    label: str
    endpoint: str
    state: str  # in use | waiting | not needed | left out | available | unchecked | unreachable
    note: str
    name: NotRequired[str]  # the keys below (WorkerCheckRow's): once the worker was checked
    ok: NotRequired[bool]
    problem: NotRequired[str]
    devices: NotRequired[list[RemoteDeviceRow]]
    elapsed_ms: NotRequired[float]
    checked_at: NotRequired[float]


class WorkersStatus(TypedDict):
    """`Status.workers` (None there without configured workers)."""

    workers: list[WorkerRow]
    waiting_for: list[str]


class ServerRow(TypedDict):
    """One llama-server of the server set (`core.models.servers`): the primary, another
    backend of the primary model, or a pooled model. `Status.models` lists the model
    servers, `Status.backends` the backends; the primary, in both, is one server."""

    name: str  # its name in the list: the model's in `models`, the backend's in `backends`
    model: str  # the model profile it serves ("" without [[models]])
    backend: str  # its name as a backend of the primary model ("" when it is not one)
    primary: bool
    where: str  # "launched here", or a remote backend's URL
    ready: bool
    state: str  # its server's state (`ServerState`), "unloaded", or a remote one's
    reason: str  # why it is in that state ("" when there is nothing to say)
    port: int | None  # while it runs or starts
    pid: int | None
    inflight: int
    idle_s: float  # since its last request
    calls: dict[str, int]  # per request kind (agent, aux)
    errors: int  # answers of 500 and above
    prompt_tokens: int  # of the requests it completed, cached ones included
    cached_tokens: int
    hit_ratio: float | None
    # In `models`: its role; with [[models]] profiles its profile and the pool's loads too.
    role: NotRequired[str]
    priority: NotRequired[int]
    ttl_s: NotRequired[float | None]
    loading: NotRequired[bool]
    footprint: NotRequired[dict[str, object] | None]
    loads: NotRequired[int]
    unloads: NotRequired[int]
    last_decision: NotRequired[str]
    # A backend's (with [[backends]]): the sessions the router keeps on it.
    active_sessions: NotRequired[int]
    moved_in: NotRequired[int]  # sessions moved here from another backend
