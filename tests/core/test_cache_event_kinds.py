"""Cache event kinds are `CacheEventKind` members, never free strings.

Read from the source with `ast`:

- in core/, no cache event is emitted with a string (a literal, an f-string, or a
  literal in a conditional) as its kind, and every member is emitted somewhere;
- app/ matches no kind as a string literal (it compares to the members).

And at run time: a `CacheEvent` holds a member (a known string becomes one, an
unknown one is refused), and a recorded event round-trips through telemetry as the
same plain string, which matches the member it came from.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.events import CacheEvent, CacheEventKind
from core.telemetry import Telemetry

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
APP = ROOT / "app"
KINDS = {k.value for k in CacheEventKind}

# Calls that take a cache event kind, by the name called: the argument that is the kind.
# `_emit(state, kind, …)` in core/cache/background.py takes the cache state first.
EMITTERS = ("emit", "_emit", "rewarm_in", "restore_or_rewarm")
# Words that are cache event kinds and also something else in app/: the status key
# of a saved state ("pinned"), the Core command ("rewarm") and a request explanation's
# field ("divergence", core/cache/explain.py). They may appear, but never where a kind
# is compared or queried.
APP_OTHER_MEANINGS = {"pinned", "rewarm", "divergence"}


def _files(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _imports_cache_events(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == "core.events"
        and any(a.name in ("CacheEvent", "CacheEventKind") for a in n.names)
        for n in ast.walk(tree)
    )


def _stringly(node: ast.expr) -> bool:
    """A string literal, an f-string, or a conditional with one in a branch."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.IfExp):
        return _stringly(node.body) or _stringly(node.orelse)
    return False


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _kind_args(node: ast.Call) -> list[ast.expr]:
    """The expressions a call passes as a cache event's kind."""
    name = _called(node)
    out = [k.value for k in node.keywords if k.arg == "kind"]
    if name == "CacheEvent" and node.args:
        out.append(node.args[0])
    elif name in ("emit", "_emit") and node.args:
        first = node.args[0]
        if isinstance(first, ast.Name) and first.id == "state" and len(node.args) > 1:
            out.append(node.args[1])  # background._emit(state, kind, …)
        else:
            out.append(first)
    return out


def _cache_modules() -> list[tuple[str, ast.Module]]:
    """core/cache/ and every other core module that makes cache events."""
    return [
        (rel, tree)
        for rel, tree in _files(CORE)
        if rel.startswith("core/cache/") or _imports_cache_events(tree)
    ]


def test_core_emits_no_kind_as_a_string() -> None:
    bad = []
    for rel, tree in _cache_modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _called(node)
            if name != "CacheEvent" and name not in EMITTERS:
                continue
            for arg in _kind_args(node):
                if _stringly(arg):
                    bad.append(f"{rel}:{arg.lineno}: {name}({ast.unparse(arg)}, …)")
    assert not bad, "cache event kinds given as strings; use CacheEventKind:\n" + "\n".join(bad)


def test_the_scan_finds_string_kinds() -> None:
    """The check above would catch each way a string kind can be written."""
    src = (
        'mgr.state.emit("save", "x")\n'
        'self._emit(f"{kind}_failed", "x")\n'
        '_emit(state, "pinned" if p else CacheEventKind.UNPINNED, "x")\n'
        'CacheEvent(kind="bypass")\n'
        'ka.rewarm_in(info, 1, reason="r", kind="rewarm")\n'
    )
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)]
    found = [a for c in calls if _called(c) in (*EMITTERS, "CacheEvent") for a in _kind_args(c)]
    assert len(found) == 5 and all(_stringly(a) for a in found)
    ok = ast.parse("mgr.state.emit(CacheEventKind.SAVE, 'saved')").body[0]
    assert isinstance(ok, ast.Expr) and isinstance(ok.value, ast.Call)
    assert not any(_stringly(a) for a in _kind_args(ok.value))


def test_every_kind_is_emitted_somewhere_in_core() -> None:
    used = set()
    for _rel, tree in _cache_modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "CacheEventKind"
            ):
                used.add(node.attr)
    unused = {k.name for k in CacheEventKind} - used
    assert not unused, f"CacheEventKind members no core module emits: {sorted(unused)}"


def test_no_core_module_compares_to_a_kind_string() -> None:
    bad = []
    for rel, tree in _files(CORE):
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and _mentions_kind(node):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and side.value in KINDS:
                        bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "compare kinds to CacheEventKind members:\n" + "\n".join(bad)


def _mentions_kind(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and "kind" in n.attr.lower():
            return True
        if isinstance(n, ast.Name) and "kind" in n.id.lower():
            return True
        if isinstance(n, ast.Constant) and n.value == "kind":  # row["kind"]
            return True
    return False


def test_app_has_no_kind_string_literals() -> None:
    bad = []
    for rel, tree in _files(APP):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in KINDS - APP_OTHER_MEANINGS:
                bad.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.Compare) and _mentions_kind(node):
                for side in (node.left, *node.comparators):
                    for n in ast.walk(side):
                        if isinstance(n, ast.Constant) and n.value in KINDS:
                            bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "kind"
                        and isinstance(value, ast.Constant)
                        and value.value in KINDS
                    ):
                        bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "app/ matches cache event kinds as text; use CacheEventKind:\n" + "\n".join(bad)


def test_an_event_holds_a_member() -> None:
    assert CacheEvent(kind=CacheEventKind.SAVE).kind is CacheEventKind.SAVE
    ev = CacheEvent(kind="restore_ok")  # type: ignore[arg-type]  # a string read back
    assert ev.kind is CacheEventKind.RESTORE_OK
    with pytest.raises(ValueError):
        CacheEvent(kind="no_such_kind")  # type: ignore[arg-type]


def test_kinds_are_their_strings() -> None:
    assert len(KINDS) == len(CacheEventKind)  # no two members share a string
    for k in CacheEventKind:
        assert k == k.value and str(k) == k.value and f"{k}" == k.value
        assert k.value == k.name.lower()
        assert json.dumps({"kind": k}) == json.dumps({"kind": k.value})
        assert k.value in {k} and k in {k.value}  # sets and dict keys match both ways


def test_a_recorded_event_round_trips_through_telemetry(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path / "telemetry.db", clock=lambda: 1_800_000_000.0)
    try:
        for i, kind in enumerate(CacheEventKind):
            tel.record(CacheEvent(ts=1_800_000_000.0 + i, kind=kind, reason=f"r{i}", slot=i))
        tel.flush()
        rows = tel.recent_events(category="cache", limit=1000)
        assert {r["kind"] for r in rows} == KINDS
        for r in rows:
            assert type(r["kind"]) is str
            kind = CacheEventKind(r["kind"])
            assert r["kind"] == kind and r["reason"] == f"r{r['slot']}"
            assert list(CacheEventKind)[r["slot"]] is kind
        (one,) = tel.recent_events(category="cache", kind=CacheEventKind.RESTORE_REJECTED)
        assert one["kind"] == "restore_rejected"
        (same,) = tel.recent_events(category="cache", kind="restore_rejected")
        assert same == one
    finally:
        tel.close()
