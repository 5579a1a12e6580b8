"""The shape of core/, read from its source with `ast` (docs/architecture.md).

- No import circle between core/'s modules — counting imports under
  ``if TYPE_CHECKING:`` and imports inside functions, since each is a dependency
  the reader has to follow just the same.
- No module reaches into another object's ``_private`` members: only ``self`` and
  ``cls`` are followed by a single-underscore attribute. Private members of other
  libraries are listed in `ALLOWED`, each with why it cannot be avoided.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"

# (file under the repository root, the expression as `ast.unparse` writes it): why.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "core/cli/main.py",
        "current._actions",
    ): "argparse lists a parser's actions (its subcommands) nowhere public",
    (
        "core/cli/main.py",
        "argparse._SubParsersAction",
    ): "argparse's class of `add_subparsers()`; it has no public name",
    (
        "core/cli/fit.py",
        "argparse._SubParsersAction",
    ): "the type of the subparsers `register` adds to; argparse has no public name for it",
    (
        "core/cli/build.py",
        "argparse._SubParsersAction",
    ): "the type of the subparsers `register` adds to; argparse has no public name for it",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def _imported(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    """The core/ modules an import statement names (a package's own module for
    ``from pkg import name`` when `name` is a module, else the package)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            package = module.split(".")
            if path.name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            names.append(candidate if candidate in known else base)
    out: set[str] = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and name != "core":
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the core/ modules it imports anywhere in its source."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):  # every import: top level, TYPE_CHECKING, in functions
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(name, path, node, known)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    out = []
    for group in groups:  # a shortest way back to the group's first module
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        found: list[str] | None = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w == start:
                        found = [*paths[v], start]
                        break
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        out.append(found or sorted(group))
    return out


def test_core_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in core/ (TYPE_CHECKING and function-local count):\n" + (
        "\n".join(" → ".join(c) for c in found)
    )


def test_the_cache_manager_and_the_pool_do_not_import_the_engine() -> None:
    graph = import_graph()
    for module in ("core.cache.manager", "core.models.pool"):
        assert "core.engine" not in graph[module], module
    for module in graph:
        if module.startswith("core.cache.") and module != "core.cache.manager":
            assert "core.cache.manager" not in graph[module], module


def private_accesses() -> list[tuple[str, int, str]]:
    """(file, line, expression) of each `x._name` in core/ where x is not self or cls."""
    out = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append((rel, node.lineno, ast.unparse(node)))
    return out


def test_no_module_reaches_into_private_members() -> None:
    found = [(f, n, e) for f, n, e in private_accesses() if (f, e) not in ALLOWED]
    assert not found, "private members used from outside their object:\n" + "\n".join(
        f"{f}:{n}: {e}" for f, n, e in found
    )


def test_every_allowed_private_access_is_still_there_and_says_why() -> None:
    seen = {(f, e) for f, _, e in private_accesses()}
    for key, why in ALLOWED.items():
        assert key in seen, f"{key} is allowed but no longer used: drop it from ALLOWED"
        assert why.strip(), key


def test_the_checks_see_what_they_look_for() -> None:
    """The graph has the edges a reader can see (so an empty cycle list means something)."""
    graph = import_graph()
    assert "core.cache.deps" in graph["core.cache.manager"]
    assert "core.cache.manager" in graph["core.models.servers"]  # imported inside a function
    assert "core.cache.manager" in graph["core.engine"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def _package(module: str) -> str:
    """core.cache.manager → core.cache; a module at core/'s root is its own package."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Package → the other core/ packages its modules import (docs/architecture.md)."""
    graph: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        edges = graph.setdefault(_package(module), set())
        edges |= {_package(d) for d in deps} - {_package(module)}
    return graph


def test_core_has_no_package_cycle() -> None:
    """The packages are layers (docs/architecture.md#layers): chat and routing below the
    proxy, the proxy below the cache that implements its `CachePolicy`, the server sets
    (models) above both; a module-level check alone let cache ↔ proxy ↔ routing and
    build → machine → server → build through."""
    found = cycles(package_graph())
    assert not found, "import cycles between core/ packages:\n" + (
        "\n".join(" → ".join(c) for c in found)
    )


def test_the_tray_does_not_import_the_command_line() -> None:
    """app/ uses the core's API and shared helpers, never a CLI module (core/cli/)."""
    offenders = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "core.cli" or n.startswith("core.cli.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


# Modules over the size limit, each to be split (docs/architecture.md#one-job-per-module):
# the list may only shrink.
OVERSIZE: set[str] = set()
MAX_LINES = 600
MAX_ROOT_MODULES = 12


def test_modules_stay_small_and_the_root_stays_short() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for folder in (CORE, ROOT / "app")
        for p in folder.rglob("*.py")
    }
    over = {path for path, n in sizes.items() if n > MAX_LINES}
    assert over <= OVERSIZE, f"new modules over {MAX_LINES} lines: {sorted(over - OVERSIZE)}"
    assert over >= OVERSIZE, f"now within {MAX_LINES} lines, drop from OVERSIZE: {OVERSIZE - over}"
    root = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, root
