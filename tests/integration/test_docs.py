"""README is the front page and docs/ the reference: README stays short, links every page, and no link is broken.

A link is checked as GitHub renders it: relative to the file that holds it, outside code blocks; a `#fragment`
on a Markdown page must name one of its headings (GitHub's anchor: lower case, punctuation dropped, spaces to -).
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOC_PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _relative_links(path):
    """(line number, target) of every Markdown link in `path` outside fenced code that is not a URL."""
    links, in_code = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files
                links.append((number, target))
    return links


def _anchors(path):
    """GitHub's anchor for each heading of a Markdown page."""
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_readme_is_a_front_page_of_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_every_docs_page_is_linked_from_readme():
    assert DOC_PAGES, "docs/ holds no pages"
    linked = {(REPO / target.split("#")[0]).resolve() for _, target in _relative_links(README)}
    unlinked = [page.name for page in DOC_PAGES if page.resolve() not in linked]
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"


@pytest.mark.parametrize("path", [README] + DOC_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = []
    for number, target in _relative_links(path):
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"line {number}: {target} (no file {resolved})")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(f"line {number}: {target} (no heading #{fragment} in {resolved.name})")
    assert not broken, f"{path.relative_to(REPO)}: broken links: {broken}"
