"""Core commands the tray relies on: cheap server status, the fit plan in status,
the plan's flags in the launch, build cancel without a build."""

from __future__ import annotations

import pytest

from core.cache.manager import policy_factory
from tests.conftest import MakeCore
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def test_server_status_carries_the_fit_plan_and_the_launch_uses_it(make_core: MakeCore) -> None:
    core = make_core(policy_factory=policy_factory)
    core.start(wait_ready=True, timeout=120)
    st = core.server_status().result(10)
    fit = st["server"]["fit"]
    assert fit is not None and fit["plan"]["fits"] is True
    assert "Fit plan for" in fit["text"]
    argv = st["server"]["argv"]
    # The planner's flags joined the launch, and replaced (not repeated) the defaults.
    assert "--checkpoint-min-step" in argv
    # No GPU that NVML can see: the layer count is left to llama-server (a Mac or an AMD
    # card would otherwise be forced onto the CPU by a plan that cannot see its GPU).
    assert "-ngl" not in argv
    assert argv.count("-np") == 1 and argv.count("--cache-ram") == 1
    assert st["totals"] is None and st["clients"] == []  # no telemetry history: cheap to poll
    wait_until(
        lambda: core.server_status().result(10)["cache"]["warming"] is False,
        60,
        message="warm-up after start",
    )
    assert core.cancel_build().result(10) is False  # nothing to cancel
