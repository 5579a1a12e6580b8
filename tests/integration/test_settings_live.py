"""Settings that say they apply at once do (every setting declares when: `Applies`).

Each live setting is flipped on a running core — a real llama-server with the tiny
model — through `Core.update_settings`, and its effect is observed where it shows:
a request answered differently, the core's status, its pressure level, the state of
its llama-server. `test_every_live_setting_is_probed` keeps the list whole: a new
live setting must come with its probe here.

Found frozen before: the upstream timeout and the body limit (read once into the
proxy), the reserved side-call slot (read only when the slot count changed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.cache.manager import CacheManager, policy_factory
from core.config import SCHEMA, Applies, ModelProfile, SettingsUpdate
from core.engine import Core
from core.events import Event, ServerStateChanged
from core.machine.devices import GpuInfo
from core.machine.pressure import Reading
from core.models.catalog import for_settings
from core.server.tinymodel import make_tiny_model
from tests.helpers import free_port, make_fake_binary, post_chat, wait_until

pytestmark = pytest.mark.integration

LIVE = {name for name, spec in SCHEMA.items() if spec.applies is Applies.LIVE}
PROBED: dict[str, str] = {}  # setting → the test that flips it


def probes(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a test as the one that flips `names` on a running core."""

    def mark(fn: Callable[..., None]) -> Callable[..., None]:
        for name in names:
            assert name in LIVE, f"{name} is not a live setting"
            PROBED[name] = fn.__name__
        return fn

    return mark


def flip(core: Core, **changes: Any) -> SettingsUpdate:
    """Change settings given as ``section__key=value`` on the running core."""
    named = {k.replace("__", "."): v for k, v in changes.items()}
    update = core.update_settings(named, persist=False).result(30)
    assert update.applied and update.waiting == ()  # live: nothing waits for a restart
    return update


def base(core: Core, host: str = "127.0.0.1") -> str:
    assert core.proxy is not None
    return f"http://{host}:{core.proxy.port}"


def chat(
    core: Core,
    text: str = "hello",
    *,
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    timeout: float = 120,
    **extra: Any,
) -> httpx.Response:
    """A two-token greedy chat of session live-1 to the proxy at `host`; any status."""
    body = {"model": "m", "max_tokens": 2, "temperature": 0, **extra}
    body.setdefault("messages", [{"role": "user", "content": text}])
    headers = {"x-session-id": "live-1", **(headers or {})}
    return post_chat(base(core, host), body, headers=headers, timeout=timeout, expect=None)


def status(core: Core) -> Any:
    return core.status().result(30)


@pytest.fixture
def live(make_core: Any) -> Iterator[Core]:
    """A running core with the cache manager, two slots, calm pressure thresholds."""
    calm = {f"pressure__{k}_pct": 0.0 for k in ("ram_low", "ram_critical", "disk_low")}
    calm |= {f"pressure__{k}_pct": 0.0 for k in ("disk_critical", "vram_low", "vram_critical")}
    core = make_core(policy_factory=policy_factory, **calm)
    core.start(wait_ready=True, timeout=180)
    yield core


# ------------------------------------------------------------------ the proxy
# aiohttp warns that a body over 1 MiB is sent as raw bytes (the proxy forwards the
# client's bytes as they came); the body limit needs such a body to be shown.
@pytest.mark.filterwarnings("ignore:Sending a large body directly:ResourceWarning")
@probes(
    "proxy.api_key",
    "proxy.max_body_mb",
    "proxy.allowed_origins",
    "proxy.strip_billing_header",
    "proxy.host",
    "proxy.port",
)
def test_proxy_settings_apply_to_the_next_request(live: Core) -> None:
    core = live
    # The API key.
    assert chat(core).status_code == 200
    flip(core, proxy__api_key="k3y")
    assert chat(core).status_code == 401
    assert chat(core, headers={"Authorization": "Bearer k3y"}).status_code == 200
    flip(core, proxy__api_key="")
    # The body limit, counted by the proxy before anything is parsed.
    padded = {"padding": "x" * (3 << 20)}  # 3 MiB that llama-server ignores
    assert chat(core, **padded).status_code == 200
    flip(core, proxy__max_body_mb=2)
    too_big = chat(core, **padded)
    assert too_big.status_code == 413 and "the limit is 2 MiB" in too_big.text
    flip(core, proxy__max_body_mb=8)
    assert chat(core, **padded).status_code == 200
    # Browser origins.
    origin = {"Origin": "http://ui.example"}
    assert chat(core, headers=origin).status_code == 403
    flip(core, proxy__allowed_origins=["http://ui.example"])
    assert chat(core, headers=origin).status_code == 200
    # Claude Code's attribution line in a Messages body.
    body = {
        "model": "m",
        "max_tokens": 2,
        "system": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli;\nBe brief.",
        "messages": [{"role": "user", "content": "hi"}],
    }
    url = f"{base(core)}/v1/messages"
    stripped = httpx.post(url, json=body, timeout=120)
    assert stripped.status_code == 200 and "billing-header" in stripped.headers["X-Warmslot-Edited"]
    flip(core, proxy__strip_billing_header=False)
    kept = httpx.post(url, json=body, timeout=120)
    assert kept.status_code == 200 and "X-Warmslot-Edited" not in kept.headers
    assert kept.json()["usage"]["input_tokens"] > stripped.json()["usage"]["input_tokens"]
    # The address moves at once.
    old, new = core.proxy.port if core.proxy else 0, free_port()
    flip(core, proxy__port=new)
    assert core.proxy is not None and core.proxy.port == new
    assert chat(core).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{old}/health", timeout=5)
    flip(core, proxy__host="127.0.0.2")
    assert chat(core, host="127.0.0.2").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{new}/health", timeout=5)


@probes("proxy.repair_tool_arguments")
def test_the_tool_argument_repair_applies_to_the_next_request(live: Core) -> None:
    """A history tool call cut mid-JSON: closed (200, named in X-Warmslot-Edited), or with
    the repair off the 400 that names it (llama-server's own answer is a 500)."""
    core = live
    call = {"name": "bash", "arguments": '{"command": "ls -l'}
    cut = [
        {"role": "user", "content": "list the files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "invalid arguments"},
        {"role": "user", "content": "again"},
    ]
    repaired = chat(core, messages=cut)
    assert repaired.status_code == 200 and "tool-arguments" in repaired.headers["X-Warmslot-Edited"]
    flip(core, proxy__repair_tool_arguments=False)
    refused = chat(core, messages=cut)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    flip(core, proxy__repair_tool_arguments=True)
    assert chat(core, messages=cut).status_code == 200


@probes("proxy.upstream_timeout_s")
def test_the_upstream_timeout_applies_to_the_next_request(live: Core) -> None:
    """llama-server held still (SIGSTOP) answers nothing: with a 1 s timeout the proxy
    gives up after about a second; raised to 60 s, a request waits it out and is answered
    once the server goes on. No speed assumption: the server is stopped, not slow."""
    core = live
    assert core.supervisor is not None and core.supervisor.pid is not None
    pid = core.supervisor.pid
    assert chat(core).status_code == 200
    flip(core, proxy__upstream_timeout_s=1)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        gave_up = chat(core, timeout=60)
        took = time.monotonic() - t0
        assert gave_up.status_code in (502, 504), gave_up.text
        assert took < 30  # the default (600 s) would still be waiting
        flip(core, proxy__upstream_timeout_s=60)
        answered: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answered.append(chat(core, timeout=120)))
        waiter.start()
        # Held for longer than the old 1 s limit before the server goes on.
        threading.Event().wait(3)
    finally:
        os.kill(pid, signal.SIGCONT)
    waiter.join(120)
    assert answered and answered[0].status_code == 200


@probes("proxy.stall_timeout_s")
def test_the_stall_timeout_applies_to_the_request_under_way(live: Core) -> None:
    """llama-server held still (SIGSTOP): no slot moves. With the watchdog off (0) a
    request waits; set to 3 s while it waits, that very request is cancelled with a 504
    that names its slot (docs/cache.md#stalled-slots)."""
    core = live
    assert core.supervisor is not None and core.supervisor.pid is not None
    pid = core.supervisor.pid
    assert chat(core).status_code == 200
    flip(core, proxy__stall_timeout_s=0)
    answered: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: answered.append(chat(core, timeout=120)))
    os.kill(pid, signal.SIGSTOP)
    try:
        waiter.start()
        waiter.join(9)  # three times the limit to come: off, nothing cancels it
        assert not answered
        flip(core, proxy__stall_timeout_s=3)
        waiter.join(60)
    finally:
        os.kill(pid, signal.SIGCONT)
        flip(core, proxy__stall_timeout_s=120)
    assert answered and answered[0].status_code == 504, answered
    assert "made no progress" in answered[0].json()["error"]["message"]
    assert chat(core).status_code == 200


# ------------------------------------------------------------------ the cache
@probes("cache.enabled", "cache.aux_slot")
def test_cache_switches_apply_to_the_next_request(live: Core) -> None:
    core = live
    side = {"x-warmslot-aux": "1"}
    reserved = chat(core, "a title please", headers=side)
    assert reserved.headers["X-Warmslot-Slot"] == "1"  # the last of two slots
    flip(core, cache__aux_slot=False)
    assert chat(core, "a title please", headers=side).headers["X-Warmslot-Slot"] == "0"
    flip(core, cache__aux_slot=True)
    assert chat(core, "a title please", headers=side).headers["X-Warmslot-Slot"] == "1"
    assert chat(core).headers["X-Warmslot-Cache"] != "off"
    flip(core, cache__enabled=False)
    off = chat(core)
    assert off.status_code == 200 and "X-Warmslot-Slot" not in off.headers
    assert status(core)["cache"]["enabled"] is False


@probes(
    "cache.ttl_short_s",
    "cache.ttl_long_s",
    "cache.ttl_extended_s",
    "cache.prefix_class",
    "cache.conversation_class",
    "cache.aux_class",
    "cache.keepalive_interval_s",
    "cache.retention_interval_s",
    "pressure.sample_interval_s",
    "cache.disk_cap_mb",
)
def test_ttls_sweep_intervals_and_the_disk_cap_in_use(live: Core) -> None:
    """What retention and the scheduler use, as the core reports it."""
    core = live
    flip(
        core,
        cache__ttl_short_s=120,
        cache__ttl_long_s=7200,
        cache__ttl_extended_s=172_800,
        cache__prefix_class="long",
        cache__conversation_class="short",
        cache__aux_class="extended",
        cache__keepalive_interval_s=45,
        cache__retention_interval_s=90,
        pressure__sample_interval_s=7.0,
        cache__disk_cap_mb=321,
    )
    cache = status(core)["cache"]
    assert cache["ttl"] == {"short": 120, "long": 7200, "extended": 172_800} | {
        k: v for k, v in cache["ttl"].items() if k not in ("short", "long", "extended")
    }
    assert cache["ttl_classes"] == {"prefix": "long", "conversation": "short", "aux": "extended"}
    sweeps = {s["name"]: s["configured_s"] for s in cache["sweeps"]}
    assert (sweeps["keepalive"], sweeps["retention"], sweeps["pressure"]) == (45, 90, 7.0)
    assert cache["disk"]["cap_bytes"] == 321 << 20


@probes(
    "cache.keep_recent",
    "cache.conversations_per_session",
    "cache.conversation_save_tokens",
)
def test_retention_and_conversation_saves_read_the_running_settings(live: Core) -> None:
    """Read where they are used, at each retention sweep and each completed request: the
    cache manager's own view of its settings is the core's, not a copy made at start."""
    core = live
    mgr = core.policy
    assert isinstance(mgr, CacheManager)
    flip(core, cache__keep_recent=7, cache__conversations_per_session=5)
    flip(core, cache__conversation_save_tokens=512)
    assert mgr.state.settings.cache.keep_recent == 7
    assert mgr.state.settings.cache.conversations_per_session == 5
    assert mgr.state.settings.cache.conversation_save_tokens == 512


# ------------------------------------------------------------------ pressure
@probes(
    "pressure.ram_low_pct",
    "pressure.ram_critical_pct",
    "pressure.disk_low_pct",
    "pressure.disk_critical_pct",
    "pressure.vram_low_pct",
    "pressure.vram_critical_pct",
)
def test_pressure_thresholds_judge_the_next_sample(live: Core) -> None:
    """A reading with half of RAM, disk and one GPU's memory free (this machine may
    have no GPU) goes to the running core's monitor after each change."""
    core = live
    assert core.pressure is not None
    monitor = core.pressure
    gib = 1 << 30
    half = Reading(
        ram_total=16 * gib,
        ram_available=8 * gib,
        swap_total=0,
        swap_used=0,
        server_rss=None,
        disk_total=100 * gib,
        disk_free=50 * gib,
        gpus=(GpuInfo(0, "test GPU", 24 * gib, 12 * gib),),
    )

    def level() -> tuple[str, set[str]]:
        monitor_level = core.call(lambda: monitor.update(half).level).result(10)
        return monitor_level, {c.label for c in monitor.causes}

    assert level() == ("nominal", set())
    for resource, key in (("RAM", "ram"), ("disk", "disk"), ("GPU 0 VRAM", "vram")):
        flip(core, **{f"pressure__{key}_low_pct": 60.0})
        assert level() == ("low", {f"{resource} low"})
        flip(core, **{f"pressure__{key}_critical_pct": 60.0})
        assert level() == ("critical", {f"{resource} critical"})
        flip(core, **{f"pressure__{key}_low_pct": 0.0, f"pressure__{key}_critical_pct": 0.0})
        assert level() == ("nominal", set())


# ------------------------------------------------------------------ llama-server
@probes("server.start_on_request")
def test_start_on_request(live: Core) -> None:
    core = live
    core.stop_server().result(60)
    flip(core, server__start_on_request=False)
    assert chat(core).status_code == 503
    flip(core, server__start_on_request=True)
    assert chat(core).status_code == 200  # started for the request, then answered


@probes("server.max_restarts", "server.backoff_max_s", "server.degraded_clear_s")
def test_crash_restart_settings_apply_to_the_next_crash(live: Core) -> None:
    """Killed llama-server: the waits between restarts are capped at the new
    backoff_max_s, the restarts stop at the new max_restarts, and the crash stops
    counting as recent as soon as degraded_clear_s says."""
    core = live
    sup = core.supervisor
    assert sup is not None
    reasons: list[str] = []

    def seen(ev: Event) -> None:
        if isinstance(ev, ServerStateChanged):
            reasons.append(ev.reason)

    core.subscribe(seen, (ServerStateChanged,))

    def kill_and_wait(state: str) -> None:
        pid = sup.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # A new run, once it is in `state` (the old pid is cleared before the state moves).
        gone = (None, pid) if state == "ready" else (pid,)
        wait_until(
            lambda: sup.pid not in gone and sup.state.value == state, 120, message=str(reasons)
        )

    kill_and_wait("ready")
    assert sup.snapshot()["recent_restarts"] == 1  # 120 s by default: still recent
    flip(core, server__degraded_clear_s=0.0)
    assert sup.snapshot()["recent_restarts"] == 0 and sup.restarts == 1
    flip(core, server__backoff_max_s=0.5)  # the second wait would be 1.0 s
    kill_and_wait("ready")
    assert any("restart 2 in 0.5 s" in r for r in reasons), reasons
    flip(core, server__max_restarts=2)
    kill_and_wait("failed")
    assert "gave up after 2 restarts" in sup.state_reason


@probes("server.start_timeout_s")
def test_the_start_timeout_applies_to_the_next_start(make_core: Any, tmp_path: Path) -> None:
    """A server that never binds (a fault the real one cannot show on demand): the
    start gives up after the new start_timeout_s, not the 180 s it started with."""
    fake = make_fake_binary(tmp_path / "slow", "--fake-mode", "slow-start")
    core = make_core(binary_check=None, server__binary=str(fake), server__build="off")
    core.start(start_server=False)
    flip(core, server__start_timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="not healthy after 5 s"):
        core.start_server().result(120)
    assert time.monotonic() - t0 < 60


@probes("server.model_dirs", "server.switch_idle_s", "telemetry.retention_days")
def test_settings_read_when_used_come_from_the_running_core(live: Core, tmp_path: Path) -> None:
    """The model chooser scans the running core's model folders; the switch to a new
    build waits for the running core's idle time; the hourly prune keeps the running
    core's days. Each is read from `Core.settings` when used (a prune or a switch-over
    cannot be provoked here), so a change is what the next use reads."""
    core = live
    library = tmp_path / "library"
    make_tiny_model(library / "extra.gguf", seed=3)

    def listed() -> set[str]:
        return {e.path for e in for_settings(core.paths, core.settings, fit=False).entries}

    assert str(library / "extra.gguf") not in listed()
    flip(core, server__model_dirs=[str(library)])
    assert str(library / "extra.gguf") in listed()
    flip(core, server__switch_idle_s=5.0, telemetry__retention_days=3)
    assert core.settings.server.switch_idle_s == 5.0
    assert core.settings.telemetry.retention_days == 3


# ------------------------------------------------------------------ the model pool
@probes(
    "pool.strict_models",
    "pool.side_calls",
    "pool.idle_check_s",
    "pool.load_timeout_s",
    "pool.save_before_unload",
)
def test_pool_settings_apply_to_the_next_request(
    make_core: Any, tiny_model: Path, tmp_path: Path
) -> None:
    side_model = make_tiny_model(tmp_path / "side.gguf", seed=5)
    core = make_core()
    core.settings.models = [
        ModelProfile(name="main", role="text"),
        ModelProfile(name="titles", model=str(side_model), role="side", slots=1),
    ]
    core.start(wait_ready=True, timeout=180)
    assert core.pool is not None
    assert chat(core, model="nope").status_code == 200  # the primary serves it
    flip(core, pool__strict_models=True)
    assert chat(core, model="nope").status_code == 404
    side = {"x-warmslot-aux": "1"}
    chat(core, "a title", headers=side, model="main")
    assert core.pool.routed_side == 0
    flip(core, pool__side_calls=True, pool__load_timeout_s=90.0)
    assert chat(core, "a title", headers=side, model="main").status_code == 200
    assert core.pool.routed_side == 1
    flip(core, pool__idle_check_s=33.0, pool__save_before_unload=False)
    assert core.sweeps is not None
    sweeps = {s["name"]: s for s in core.call(core.sweeps.status).result(10)}
    assert sweeps["models"]["configured_s"] == 33.0
    # Read per load and per unload from the running core's settings.
    assert core.settings.pool.load_timeout_s == 90.0
    assert core.settings.pool.save_before_unload is False


def test_every_live_setting_is_probed() -> None:
    assert set(PROBED) == LIVE, sorted(LIVE - set(PROBED))
