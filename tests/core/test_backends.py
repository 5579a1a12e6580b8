"""The choice rule of several backends (core.routing.choice), the router's use of it,
and the ``[[backends]]`` settings (docs/scale.md#several-backends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import config
from core.clock import RealClock
from core.errors import ConfigError
from core.events import ServerStateChanged
from core.models.backends import BackendSet, backend_lines, server_settings
from core.models.pool import ModelPool
from core.models.servers import ServerSet, server_lines
from core.proxy.metrics import Counters, Metrics
from core.routing.choice import Affinity, BackendView, affinity_key
from core.routing.router import Decision, Kind, Router, Target
from core.server.supervisor import ServerState
from core.server.upstream import Upstream
from core.status.server import ServerRow
from tests.fixtures.status_shapes import shape_errors

TOOLS_A = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
TOOLS_B = [*TOOLS_A, {"type": "function", "function": {"name": "jira", "parameters": {}}}]


def _body(tools: list[dict[str, object]], cwd: str, user: str = "hi") -> dict[str, object]:
    system = f"You are opencode.\n<env>\n  Working directory: {cwd}\n</env>\nskills"
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": tools,
    }


def _views(*ready: bool) -> list[BackendView]:
    return [BackendView(f"b{i}", r) for i, r in enumerate(ready)]


# ------------------------------------------------------------------ affinity key


def test_the_affinity_key_is_the_stable_prefix_text() -> None:
    a1 = affinity_key("opencode", _body(TOOLS_A, "/p/a", "first"))
    a2 = affinity_key("opencode", _body(TOOLS_A, "/p/a2", "second"))
    b = affinity_key("opencode", _body(TOOLS_B, "/p/a"))
    # The volatile tail (from opencode's <env> marker) and the user text do not count;
    # the tools do.
    assert a1 == a2 and len(a1) == 16
    assert b != a1
    # An unknown client: no profile marker but the generic ones (<env> is one).
    assert affinity_key("curl", _body(TOOLS_A, "/x")) == a1
    # Head text that differs before the marker: another prefix.
    other = _body(TOOLS_A, "/p/a")
    other["messages"][0]["content"] = "You are another agent.\n<env>x</env>"  # type: ignore[index]
    assert affinity_key("opencode", other) != a1
    assert affinity_key("opencode", {"messages": [{"role": "user", "content": "x"}]}) == ""
    assert affinity_key("opencode", {"messages": ["not a message"], "tools": TOOLS_A}) == ""


# ------------------------------------------------------------------ the rule


def test_new_sessions_go_where_their_prefix_is_else_the_least_loaded() -> None:
    aff = Affinity()
    views = _views(True, True)
    a1 = aff.choose(views, session="a1", side=False, key="A", now=0)
    b1 = aff.choose(views, session="b1", side=False, key="B", now=1)
    a2 = aff.choose(views, session="a2", side=False, key="A", now=2)
    b2 = aff.choose(views, session="b2", side=False, key="B", now=3)
    assert (a1.backend, b1.backend, a2.backend, b2.backend) == ("b0", "b1", "b0", "b1")
    assert "least loaded" in b1.why and "0 active sessions" in b1.why
    assert "holds its stable prefix (A)" in a2.why
    # Sessions stick, whatever the load says.
    busy = [BackendView("b0", True, inflight=5), BackendView("b1", True)]
    again = aff.choose(busy, session="a1", side=False, key="A", now=4)
    assert again.backend == "b0" and "sticks" in again.why
    assert aff.active(4) == {"b0": 2, "b1": 2}


def test_least_loaded_counts_requests_in_flight_first() -> None:
    aff = Affinity()
    aff.choose(_views(True, True), session="s1", side=False, key="", now=0)  # → b0
    views = [BackendView("b0", True, inflight=0), BackendView("b1", True, inflight=2)]
    assert aff.choose(views, session="s2", side=False, key="", now=1).backend == "b0"


def test_a_holder_with_too_many_sessions_yields_to_the_least_loaded() -> None:
    aff = Affinity(max_spread=2)
    views = _views(True, True)
    picks = [
        aff.choose(views, session=f"s{i}", side=False, key="A", now=i).backend for i in range(5)
    ]
    # s0 → b0 (least loaded), s1 and s2 → b0 (holder, spread ≤ 2), s3: spread 3 → b1,
    # s4: b1 now holds it too and has fewer sessions.
    assert picks == ["b0", "b0", "b0", "b1", "b1"]


def test_inactive_sessions_do_not_count_as_load() -> None:
    aff = Affinity(active_s=10)
    views = _views(True, True)
    aff.choose(views, session="old", side=False, key="", now=0)  # → b0
    assert aff.active(100) == {}
    assert aff.choose(views, session="new", side=False, key="", now=100).backend == "b0"


def test_a_session_moves_when_its_backend_is_not_ready() -> None:
    aff = Affinity()
    aff.choose(_views(True, True), session="a1", side=False, key="A", now=0)  # → b0
    aff.choose(_views(True, True), session="b1", side=False, key="B", now=1)  # → b1
    pick = aff.choose(_views(False, True), session="a1", side=False, key="A", now=2)
    assert pick.backend == "b1" and pick.moved_from == "b0"
    assert "moved from backend 'b0' (failed)" in pick.why
    assert aff.moved == 1
    # It stays where it moved when b0 comes back (its conversation is on b1 now).
    back = aff.choose(_views(True, True), session="a1", side=False, key="A", now=3)
    assert back.backend == "b1" and not back.moved_from
    # A new session of project A: b1 is now the most recent holder of A.
    assert aff.choose(_views(True, True), session="a2", side=False, key="A", now=4).backend == "b1"


def test_a_failed_backend_that_came_back_gets_no_new_placement_while_it_cools_down() -> None:
    aff = Affinity(cooldown_s=60)
    views = _views(True, True)
    aff.choose(views, session="a1", side=False, key="A", now=0)  # → b0
    aff.choose(views, session="b1", side=False, key="B", now=1)  # → b1
    aff.choose(views, session="b2", side=False, key="B", now=2)  # → b1 (holder)
    # b1 crashed and restarted between two requests: told, not seen.
    aff.backend_down("b1", now=3)
    assert aff.backend_of("b1") == "" and aff.orphans == {"b1": "b1", "b2": "b1"}
    first = aff.choose(views, session="b1", side=False, key="B", now=4)
    assert first.backend == "b0" and first.moved_from == "b1"
    assert aff.choose(views, session="b2", side=False, key="B", now=5).backend == "b0"
    assert aff.moved == 2
    # A brand-new session while b1 cools down: b0, though b1 has fewer sessions.
    assert aff.choose(views, session="n1", side=False, key="", now=6).backend == "b0"
    # After the cool-down b1 takes new sessions again (least loaded).
    assert aff.choose(views, session="n2", side=False, key="", now=70).backend == "b1"
    # With nothing else ready, a cooling backend still serves.
    alone = [BackendView("b0", False), BackendView("b1", True)]
    aff.backend_down("b1", now=80)
    assert aff.choose(alone, session="n3", side=False, key="", now=81).backend == "b1"


def test_with_no_backend_ready_a_session_stays_to_wait_for_its_own() -> None:
    aff = Affinity()
    aff.choose(_views(True, True), session="s", side=False, key="", now=0)  # → b0
    pick = aff.choose(_views(False, False), session="s", side=False, key="", now=1)
    assert pick.backend == "b0" and not pick.moved_from


def test_side_calls_go_to_a_free_side_slot_and_pin_nothing() -> None:
    aff = Affinity()
    aff.choose(_views(True, True), session="s", side=False, key="A", now=0)  # → b0
    home = aff.choose(_views(True, True), session="s", side=True, key="", now=1)
    assert home.backend == "b0" and "its session's backend 'b0' has a free side slot" in home.why
    busy = [BackendView("b0", True, side_busy=True), BackendView("b1", True)]
    away = aff.choose(busy, session="s", side=True, key="", now=2)
    assert away.backend == "b1" and "has a free side slot" in away.why
    all_busy = [BackendView("b0", True, side_busy=True), BackendView("b1", True, side_busy=True)]
    assert aff.choose(all_busy, session="s", side=True, key="", now=3).backend == "b0"
    # A side call of an unknown session is not pinned.
    aff.choose(busy, session="title-only", side=True, key="", now=4)
    assert aff.backend_of("title-only") == "" and aff.backend_of("s") == "b0"


# ------------------------------------------------------------------ the router


def test_the_router_puts_the_backend_in_the_decision() -> None:
    aff = Affinity()
    ups = {"b0": Upstream(lambda: "http://127.0.0.1:1", name="b0"), "b1": Upstream(lambda: None)}
    asked: list[tuple[str, bool, str]] = []

    def chooser(session: str, side: bool, key: str) -> tuple[object, Upstream | None]:
        asked.append((session, side, key))
        pick = aff.choose(_views(True, True), session=session, side=side, key=key, now=0)
        return pick, ups[pick.backend]

    router = Router(lambda: (Target("", None, primary=True),), backend=chooser)  # type: ignore[arg-type]
    headers = {"user-agent": "opencode/1.18", "x-session-id": "ses_1"}
    d = router.decide("chat", headers, _body(TOOLS_A, "/p/a"))
    assert not isinstance(d, type(None)) and hasattr(d, "backend")
    assert d.backend == "b0" and d.upstream is ups["b0"] and d.kind is Kind.AGENT  # type: ignore[union-attr]
    assert asked == [("ses_1", False, affinity_key("opencode", _body(TOOLS_A, "/p/a")))]
    # A plain request carries no key; the default router names no backend.
    router.decide("completion", {}, {"prompt": "x"})
    assert asked[-1] == ("", False, "")
    plain = Router.single(None).decide("chat", headers, _body(TOOLS_A, "/p/a"))
    assert plain.backend == "" and plain.backend_why == ""  # type: ignore[union-attr]


# ------------------------------------------------------------------ settings


def test_backend_settings_validate_and_round_trip(tmp_path: Path) -> None:
    doc = {
        "backends": [
            {"name": "gpu1", "threads": 4, "extra_args": ["--device", "CUDA1"]},
            {"name": "box", "url": "http://10.0.0.3:8080", "api_key": "k"},
        ]
    }
    s = config.settings_from_dict(doc)
    assert [b.name for b in s.backends] == ["gpu1", "box"]
    path = tmp_path / "settings.toml"
    config.save_changes(path, {"backends": s.backends})
    assert config.load(path).backends == s.backends
    launched = server_settings(s.server, s.backends[0])
    assert launched.threads == 4 and launched.port == 0
    assert launched.extra_args[-2:] == ["--device", "CUDA1"]


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ([{"name": "main"}], "backends[0].name"),
        ([{"name": "a"}, {"name": "a"}], "duplicate backend name"),
        ([{"url": "http://x:1"}], "backends[0].name': missing value"),
        ([{"name": "a", "url": "ftp://x"}], "backends[0].url"),
        ([{"name": "a", "url": "http://x:1/v1"}], "without a path"),
        ([{"name": "a", "url": "http://x:1", "threads": 2}], "launch options on a remote"),
        ([{"name": "a", "port": 1}], "backends[0].port': unknown setting"),
    ],
)
def test_invalid_backend_tables_are_refused(tables: list[dict[str, object]], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        config.settings_from_dict({"backends": tables})


def test_backends_combine_with_workers_and_models_in_the_settings_file(tmp_path: Path) -> None:
    """The RPC workers extend the primary server ('main'); every other backend is
    launched here without them, or is a remote Warmslot (docs/scale.md#several-backends)."""
    path = tmp_path / "config.toml"
    path.write_text(
        '[[backends]]\nname = "b1"\n\n'
        '[[backends]]\nname = "far"\nurl = "http://10.0.0.3:8089"\n\n'
        '[[workers]]\naddress = "10.0.0.2"\nport = 50052\n\n'
        '[[models]]\nname = "m"\nrole = "text"\n'
    )
    s = config.load(path)
    assert [b.name for b in s.backends] == ["b1", "far"] and [m.name for m in s.models] == ["m"]
    assert [(w.address, w.port) for w in s.workers] == [("10.0.0.2", 50052)]
    assert config.read_file(path).problems == ()
    # The running core takes the same change (the tray's settings dialog writes it so).
    again = s.with_changes({"workers": [], "backends": s.backends})
    assert again.workers == [] and again.backends == s.backends


# ------------------------------------------------------------------ the backend set


class _Server:
    """The primary's supervisor as the backend set reads it (state, pid, port)."""

    def __init__(self) -> None:
        self.state = ServerState.READY
        self.state_reason = ""
        self.pid: int | None = 4242
        self.port: int | None = 1234
        self.name = ""


class _Host:
    """The engine as the backend set uses it, with no server launched."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.supervisor = _Server()
        self.upstream = Upstream(lambda: "http://127.0.0.1:9")
        self.policy = None
        self.clock = RealClock()
        self.stopping = False
        self.events: list[object] = []
        self.subscribers: list[object] = []

    def subscribe(self, callback: object, types: object = None) -> object:
        self.subscribers.append(callback)
        return lambda: None

    def emit(self, event: object) -> None:
        self.events.append(event)
        for cb in self.subscribers:
            cb(event)  # type: ignore[operator]


def _set() -> tuple[_Host, BackendSet]:
    settings = config.settings_from_dict(
        {"backends": [{"name": "far", "url": "http://127.0.0.1:9"}]}
    )
    host = _Host(settings)
    servers = ServerSet(host)  # type: ignore[arg-type]
    return host, BackendSet(servers, lambda: settings.server)


def _decision(backends: BackendSet, session: str, key: str = "K") -> Decision:
    pick, upstream = backends.choose(session, False, key)
    return Decision(
        "", upstream, Kind.AGENT, "test", session, "opencode", False, pick.backend, pick.why
    )


def test_the_primary_leaving_ready_moves_its_sessions() -> None:
    host, backends = _set()
    backends.backends["far"].remote_ok = True
    assert _decision(backends, "s1").backend == "main"
    assert _decision(backends, "s2", "other project").backend == "far"
    host.emit(ServerStateChanged(state="starting", previous="ready", model=""))
    assert backends.affinity.orphans == {"s1": "main"}
    host.supervisor.state = ServerState.READY  # back at once: s1 still moves (cool-down)
    moved = _decision(backends, "s1")
    assert moved.backend == "far" and "moved from backend 'main'" in moved.backend_why
    assert backends.backends["far"].moved_in == 1


async def test_admission_counts_and_refuses_a_backend_that_is_not_ready() -> None:
    _, backends = _set()
    d = _decision(backends, "s1")  # main: the remote is not checked yet
    route = await backends.servers.route(d)
    assert route.error == "" and route.upstream is backends.backends["main"].upstream
    assert backends.backends["main"].inflight == 1
    assert route.release is not None
    route.release()
    assert backends.backends["main"].inflight == 0
    far = Decision("", None, Kind.AGENT, "test", "s9", "x", False, "far")
    refused = await backends.servers.route(far)
    assert refused.status == 503 and "backend 'far' is not ready" in refused.error
    rows = {r["name"]: r for r in backends.status()["backends"]}
    assert rows["main"]["calls"] == {"agent": 1, "aux": 0} and not rows["far"]["ready"]
    metrics = Metrics(
        Counters(), server_ready=lambda: True, backends=lambda: backends.status()["backends"]
    )
    text = metrics.exposition().decode()
    assert 'warmslot_backend_ready{backend="far"} 0.0' in text
    assert 'warmslot_backend_requests_total{backend="main",kind="agent"} 1.0' in text


async def test_the_models_and_the_backends_list_their_servers_in_one_row_type() -> None:
    """`Status.models` and `Status.backends` are rows of one type (`ServerRow`), from one
    place (`ServerSet.row`): the primary, listed in both, is the same server there."""
    settings = config.settings_from_dict(
        {
            "backends": [{"name": "far", "url": "http://127.0.0.1:9"}],
            "models": [
                {"name": "coder", "role": "text"},
                {"name": "side", "role": "side", "model": "/m/side.gguf"},
            ],
        }
    )
    host = _Host(settings)
    servers = ServerSet(host)  # type: ignore[arg-type]
    backends = BackendSet(servers, lambda: settings.server)
    pool = ModelPool(servers, backend=backends.choose)
    route = await servers.route(_decision(backends, "s1"))
    assert route.release is not None
    route.release()
    models = {r["name"]: r for r in pool.status()}
    rows = {r["name"]: r for r in backends.status()["backends"]}
    for row in [*models.values(), *rows.values()]:
        assert shape_errors(row, ServerRow, row["name"]) == []
    main, coder = rows["main"], models["coder"]
    assert (main["model"], main["backend"], coder["model"], coder["backend"]) == (
        "coder",
        "main",
        "coder",
        "main",
    )
    same = ("ready", "state", "port", "pid", "calls", "prompt_tokens", "where")
    assert {k: main[k] for k in same} == {k: coder[k] for k in same}
    assert main["calls"] == {"agent": 1, "aux": 0} and main["port"] == 1234
    # Each list adds its own: the backends' sessions, the models' profile and loads.
    assert "active_sessions" in main and "role" not in main
    assert coder["role"] == "text" and "moved_in" not in coder
    # A server that is not up says its state and why apart (the tray and CLI join them).
    far, side = rows["far"], models["side"]
    assert (far["ready"], far["state"], far["reason"]) == (False, "unreachable", "not checked yet")
    assert (side["state"], side["port"], side["where"]) == ("unloaded", None, "launched here")
    text = backend_lines(backends.status())
    assert "unreachable — not checked yet" in text[2] and text[2].split()[0] == "far"
    lines = server_lines("models:", pool.status())
    assert [line.split()[:2] for line in lines[1:]] == [["coder", "ready"], ["side", "unloaded"]]
    assert "0 loads, 0 unloads" in lines[2]


def test_a_failing_choice_fails_open_to_the_first_ready_backend() -> None:
    host, backends = _set()

    def broken(*_a: object, **_k: object) -> object:
        raise RuntimeError("bug")

    backends.affinity.choose = broken  # type: ignore[method-assign]
    pick, upstream = backends.choose("s1", False, "K")
    assert pick.backend == "main" and upstream is backends.backends["main"].upstream
    assert "backend choice failed" in pick.why
    assert any("choosing a backend failed" in getattr(e, "text", "") for e in host.events)
