"""Comments and docs cite only the repository's own documents.

The llama-server facts the code relies on live in ``docs/llama-server-facts.md``; a
comment links to one of its sections by anchor. This checks that nothing cites the old
notes kept outside the repository any more, and that every link into the facts page
names a heading that exists there (anchors computed as GitHub computes them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

FACTS = REPO / "docs" / "llama-server-facts.md"
SCANNED_DIRS = ("core", "app", "tests", "docs", "scripts", "installers")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".jinja", ".json", ".cfg", ".ini"}
SKIPPED_PARTS = {"__pycache__", ".venv", "node_modules", ".mypy_cache", ".ruff_cache"}

# Spelled in pieces so that this file does not match itself.
SECTION = "\u00a7"
FORBIDDEN = ("reference " + SECTION, "shared/" + "reference", "reference " + "notes")
# A bare section sign and number in code cites the same outside document.
BARE_SECTION = re.compile(SECTION + r"\s?\d")
LINK = re.compile(r"llama-server-facts\.md#([\w-]*)")


def _files() -> Iterator[Path]:
    for name in SCANNED_FILES:
        path = REPO / name
        if path.is_file():
            yield path
    for top in SCANNED_DIRS:
        root = REPO / top
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            if (
                path.is_file()
                and path.suffix in TEXT_SUFFIXES
                and not SKIPPED_PARTS.intersection(path.relative_to(REPO).parts)
            ):
                yield path


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading's text."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
            continue
        match = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        base = github_anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def test_github_anchor() -> None:
    assert github_anchor("Slot auto mode") == "slot-auto-mode"
    assert github_anchor("SWA log-prob noise") == "swa-log-prob-noise"
    assert github_anchor("0001 — safe slot API") == "0001--safe-slot-api"
    assert github_anchor("`--swa-full` (`-np 1`)") == "--swa-full--np-1"
    assert heading_anchors("# A\n## A\n```\n# B\n```\n") == {"a", "a-1"}


def test_nothing_cites_the_outside_reference() -> None:
    offenders = []
    for path in _files():
        rel = path.relative_to(REPO).as_posix()
        for n, line in enumerate(_text(path).splitlines(), 1):
            if any(f in line for f in FORBIDDEN) or (
                path.suffix == ".py" and BARE_SECTION.search(line)
            ):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "link a section of docs/llama-server-facts.md instead:\n" + "\n".join(
        offenders
    )


def test_every_facts_link_names_a_heading() -> None:
    anchors = heading_anchors(_text(FACTS))
    assert "slot-auto-mode" in anchors
    links = 0
    broken = []
    for path in _files():
        rel = path.relative_to(REPO).as_posix()
        for n, line in enumerate(_text(path).splitlines(), 1):
            for match in LINK.finditer(line):
                links += 1
                if match.group(1) not in anchors:
                    broken.append(f"{rel}:{n}: #{match.group(1)}")
    assert broken == [], f"no such heading in {FACTS.name}:\n" + "\n".join(broken)
    assert links > 0  # the comments do link here


def test_facts_page_links_to_its_own_sections() -> None:
    text = _text(FACTS)
    anchors = heading_anchors(text)
    internal = re.findall(r"\]\(#([^)]+)\)", text)
    assert internal, "the page links between its sections"
    assert sorted(set(internal) - anchors) == []


def test_the_docs_index_lists_every_page() -> None:
    """docs/README.md is where a newcomer finds a page: none may be missing from it."""
    docs = REPO / "docs"
    index = (docs / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in docs.glob("*.md") if p.name != "README.md")
    missing = [name for name in pages if f"]({name})" not in index]
    assert not missing, missing
