"""``[[backends]]`` beside ``[[workers]]`` (docs/scale.md#several-backends): the RPC
workers extend the primary server, 'main', alone.

One real `warmslot worker` (a ``ggml-rpc-server`` on CPU) holds two of the tiny 4-layer
model's layers for main (forced through the worker's ``layers`` setting, as in
test_rpc_workers.py); a second backend, 'b1', is launched here with the same settings
and planned on this machine alone. Requests for two projects reach both backends.
(The settings file's side: tests/core/test_backends.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from httpx import Headers

from core.config import BackendSettings, WorkerSettings
from core.engine import Core
from tests.conftest import MakeCore
from tests.helpers import free_port, post_chat, session_headers, wait_until
from tests.integration.test_rpc_workers import Worker, rpc_server, tiny4

pytestmark = pytest.mark.integration
__all__ = ["rpc_server", "tiny4"]  # the fixtures this module uses from test_rpc_workers

HEAD = "You are a careful assistant for project {}. " + "Follow the house rules. " * 20


def _ask(core: Core, session: str, project: str) -> Headers:
    body = {
        "messages": [
            {"role": "system", "content": HEAD.format(project)},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    return post_chat(core, body, headers=session_headers(session), timeout=180).headers


def test_the_workers_extend_main_and_a_launched_backend_runs_here(
    make_core: MakeCore, tiny4: Path, rpc_server: Path, tmp_path: Path
) -> None:
    worker = Worker(rpc_server, free_port(), tmp_path / "worker.log")
    try:
        core = make_core(server__model=str(tiny4), server__slots=1, cache__enabled=False)
        core.settings.workers = [
            WorkerSettings(address="127.0.0.1", port=worker.port, name="w0", layers=2)
        ]
        core.settings.backends = [BackendSettings(name="b1")]
        core.start(wait_ready=True, timeout=180)
        assert core.backends is not None and core.supervisor is not None
        b1 = core.backends.backends["b1"].server
        assert b1 is not None
        wait_until(lambda: b1.base_url is not None, 180, message="b1 never got ready")

        main_argv, b1_argv = core.supervisor.argv, b1.argv
        assert main_argv[main_argv.index("--rpc") + 1] == f"127.0.0.1:{worker.port}", main_argv
        assert "--rpc" not in b1_argv, b1_argv  # planned on this machine alone
        # Another layout is another server identity: their slot files stay apart.
        assert core.supervisor.resolved is not None and b1.resolved is not None
        assert core.supervisor.resolved.slot_dir != b1.resolved.slot_dir
        # The fit plan in the status is main's, with the worker's layers.
        assert core.fit_plan is not None
        assert [d.layers for d in core.fit_plan.devices if d.kind == "rpc"] == [2]

        one, two = _ask(core, "s-one", "one"), _ask(core, "s-two", "two")
        assert {one["X-Warmslot-Backend"], two["X-Warmslot-Backend"]} == {"main", "b1"}
        st = core.status().result(30)
        rows = {r["name"]: r for r in st["backends"]["backends"]}
        assert rows["main"]["calls"]["agent"] == rows["b1"]["calls"]["agent"] == 1, rows
        assert st["workers"] is not None
        assert [w["state"] for w in st["workers"]["workers"]] == ["in use"]
    finally:
        worker.kill()
