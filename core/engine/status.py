"""The status the core answers (`Core.status`, ``GET /warmslot/status``, the tray):
one `Status` gathered from every part the engine holds (`core.status` has its shape),
and the primary server's state in the words a 503 gives."""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from core.models import profiles
from core.models.backends import BackendSet
from core.models.pool import ModelPool
from core.models.servers import ServerSet
from core.paths import Paths
from core.proxy.app import CacheService, Proxy
from core.server.fit import FitPlan
from core.server.fit_report import format_plan
from core.server.provision import Provisioner
from core.server.rpc import WorkerSet
from core.server.supervisor import ServerState, Supervisor
from core.status import Status
from core.status.server import ServerRow
from core.telemetry import Telemetry

log = logging.getLogger("warmslot.core")


class Parts(Protocol):
    """What the status reads of the engine (`core.engine.Core`)."""

    paths: Paths
    started_at: float
    provision: Provisioner
    workers: WorkerSet
    telemetry: Telemetry | None
    supervisor: Supervisor | None
    proxy: Proxy | None
    fit_plan: FitPlan | None
    servers: ServerSet | None
    pool: ModelPool | None
    backends: BackendSet | None
    policy: CacheService | None


async def collect(core: Parts, *, history: bool = True) -> Status:
    """The whole status; without `history` the telemetry's parts are left out (cheap
    enough to poll every second). A cache whose status fails says why in its place."""
    assert core.supervisor is not None and core.proxy is not None
    tel = core.telemetry if history else None
    hour_ago = time.time() - 3600
    fit = core.fit_plan
    out: Status = {
        "warmslot": {
            "pid": os.getpid(),
            "started": core.started_at,
            "proxy": f"http://{core.proxy.host}:{core.proxy.port}",
            "config": str(core.paths.config_file),
        },
        "build": core.provision.status(),
        "server": {
            **core.supervisor.snapshot(),
            "fit": None if fit is None else {"plan": fit.to_dict(), "text": format_plan(fit)},
        },
        "workers": core.workers.snapshot() if core.workers.configured else None,
        "totals": tel.totals() if tel else None,
        "last_hour": tel.totals(hour_ago) if tel else None,
        "clients": tel.per_client() if tel else [],
        "users": tel.per_user() if tel else [],
        "sessions": tel.sessions(hour_ago, limit=20) if tel else [],
        "recent_requests": tel.recent_requests(10) if tel else [],
        "models": core.pool.status() if core.pool is not None else [_single_model(core)],
    }
    if core.backends is not None:  # only with [[backends]]: the default stays as it was
        out["backends"] = core.backends.status()
    if core.pool is not None:
        out["model_calls"] = {
            "routed_to_side": core.pool.routed_side,
            "by_model": {e["name"]: e["calls"] for e in out["models"]},
        }
    if core.policy is not None:
        try:
            out["cache"] = await core.policy.status()
        except Exception as e:
            log.exception("cache status failed")
            out["cache"] = {"error": repr(e)}
    return out


def _single_model(core: Parts) -> ServerRow:
    """The one model without [[models]] profiles: the primary server's row."""
    assert core.servers is not None
    row = core.servers.row(core.servers.primary, profiles.PRIMARY_NAME)
    row["role"] = "text"
    return row


def server_state_words(sup: Supervisor | None, provision: Provisioner) -> str:
    """The primary server's state for a 503, with what is happening or went wrong."""
    if sup is None:
        return "stopped"
    build = provision.status()
    if build is not None and not build.get("background"):
        return f"{sup.state.value} — {build.get('text') or 'building llama-server'}"
    if sup.state is ServerState.FAILED and sup.state_reason:
        return f"failed — {sup.state_reason}; see `warmslot doctor`"
    return sup.state.value
