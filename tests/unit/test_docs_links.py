"""The documentation holds together: every relative link and anchor in the Markdown files resolves,
every ``docs/<page>.md#<anchor>`` a file cites exists, no file cites a document the repository lacks,
and the README stays short enough to be read first."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 16_000

# Directories that are not the project's own text: tool caches, virtualenvs, build output.
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "__pycache__",
    "node_modules",
    "build",
    "dist",
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yml", ".yaml", ".json"}
# Documents that live outside the repository; spelled in pieces so that this file does not cite them.
FOREIGN_DOCUMENTS = ("DESIGN" + ".md", "SECURITY-CASES" + ".md", "BEYOND" + ".md", "shared" + "/docs")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CITATION = re.compile(r"\bdocs/([\w.-]+\.md)#([\w-]+)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def project_files() -> Iterator[Path]:
    for directory, subdirectories, files in os.walk(REPO):
        # Any virtual environment, whatever it is called (CI makes `.venv-ci`), holds other projects' text.
        subdirectories[:] = sorted(
            name
            for name in subdirectories
            if name not in SKIPPED_DIRS
            and not name.endswith(".egg-info")
            and not (Path(directory) / name / "pyvenv.cfg").exists()
        )
        for name in sorted(files):
            yield Path(directory) / name


def markdown_files() -> list[Path]:
    return [path for path in project_files() if path.suffix == ".md"]


def text_files() -> list[Path]:
    return [
        path
        for path in project_files()
        if path.suffix in TEXT_SUFFIXES or path.name == "Dockerfile" or path.relative_to(REPO).parts[0] == ".ci"
    ]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    """Relative link targets of a Markdown file, with their line numbers (code is not prose)."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not EXTERNAL.match(target):
                yield number, target


def broken_link(source: Path, target: str) -> str | None:
    """Why ``target``, linked from ``source``, does not resolve; None when it does."""
    file_part, _, anchor = target.partition("#")
    destination = (source.parent / file_part).resolve() if file_part else source
    if not destination.is_relative_to(REPO):
        return "leads outside the repository"
    if not destination.exists():
        return "no such file"
    if anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
        return f"no heading with anchor #{anchor}"
    return None


def where(path: Path, number: int) -> str:
    return f"{path.relative_to(REPO)}:{number}"


def test_every_relative_link_in_the_markdown_files_resolves_to_a_file_and_heading() -> None:
    checked = 0
    broken = []
    for path in markdown_files():
        for number, target in links(path):
            checked += 1
            reason = broken_link(path, target)
            if reason:
                broken.append(f"{where(path, number)}: {target}: {reason}")
    assert broken == []
    assert checked > 100  # the README and docs/ link to each other and to the tests


def test_every_cited_docs_anchor_exists() -> None:
    broken = []
    for path in text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            for page, anchor in CITATION.findall(line):
                reason = broken_link(REPO / "docs" / "README.md", f"{page}#{anchor}")
                if reason:
                    broken.append(f"{where(path, number)}: docs/{page}#{anchor}: {reason}")
    assert broken == []


def test_no_file_cites_a_document_the_repository_lacks() -> None:
    citing = []
    for path in text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        citing += [f"{path.relative_to(REPO)}: {name}" for name in FOREIGN_DOCUMENTS if name in text]
    assert citing == []


def test_the_readme_stays_short() -> None:
    assert (REPO / "README.md").stat().st_size <= README_MAX_BYTES


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Fork bombs", "fork-bombs"),
        ("Packages (`pip install` without a network)", "packages-pip-install-without-a-network"),
        ("Scale-out (`--scale`)", "scale-out---scale"),
        ("Desktop hosts (Claude Desktop)", "desktop-hosts-claude-desktop"),
        ("Processes, memory and time", "processes-memory-and-time"),
    ],
)
def test_anchors_are_made_as_github_makes_them(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"notes", "notes-1"}
