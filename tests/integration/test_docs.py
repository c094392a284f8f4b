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


PLACE = re.compile(r"`(python/[\w/]+\.py):(\d+)`\s*\|\s*`(class|def) (\w+)`")


def test_the_reading_path_points_at_the_classes_and_functions_it_names():
    """docs/READING.md: at least ten stops, each a repository-relative `path:line` whose line starts the `class` or
    `def` the row names (so a moved line shows here, not in a reader's afternoon)."""
    stops = PLACE.findall((REPO / "docs" / "READING.md").read_text())
    assert len(stops) >= 10, f"docs/READING.md names {len(stops)} places (at least ten)"
    wrong = []
    for path, line, kind, name in stops:
        lines = (REPO / path).read_text().splitlines()
        found = lines[int(line) - 1].strip() if 0 < int(line) <= len(lines) else ""
        if not re.match(rf"{kind} {name}\b", found):
            starts = [n for n, text in enumerate(lines, 1) if re.match(rf"\s*{kind} {name}\b", text)]
            wrong.append(f"{path}:{line} is {found!r}, not `{kind} {name}` (it starts at line {starts})")
    assert not wrong, "docs/READING.md:\n  " + "\n  ".join(wrong)


def test_the_pages_say_what_the_code_has():
    # memory.md said float32 was the only dtype; experiment.md counted 15 ablation rows (there are 19 of one
    # process), named only dp of the rows under mpiexec, and left timeline out of the subcommands.
    import sys

    sys.path[:0] = [str(REPO / "python"), str(REPO / "apps")]
    from experiment.ablations import ABLATIONS
    from needle.backend_ndarray.ndarray import DTYPES

    memory = (REPO / "docs" / "memory.md").read_text().split("\n\n")[1]  # the page's opening paragraph
    assert all(name in memory for name in DTYPES), memory
    experiment = (REPO / "docs" / "experiment.md").read_text()
    one_process = [name for name, (_, flags) in ABLATIONS.items() if not flags.get("parallel")]
    assert f"all {len(one_process)} rows of one process" in experiment
    table = experiment.split("## gc.py ablate")[1].split("<!-- figure")[0]
    assert all(f"`{name}`" in table for name in ABLATIONS), [name for name in ABLATIONS if f"`{name}`" not in table]
    from experiment.parser import SUBCOMMANDS

    assert "0 on `cpu()`, where copies are synchronous" not in experiment  # cpu() has a copy thread
    listed = experiment.split("Subcommands:")[1].split(";")[0]
    assert all(f"`{name}" in listed for name in SUBCOMMANDS), listed


def test_capture_md_lists_the_program_the_two_layer_mlp_records():
    import needle as ndl
    from conftest import captured_mlp_listing

    if not ndl.cpu().enabled():
        pytest.skip("needs the C++ CPU backend")  # (the listing names its kernels)
    page = (REPO / "docs" / "capture.md").read_text()
    shown = page.split("<!-- listing: two-layer MLP -->\n```\n")[1].split("```\n<!-- /listing -->")[0]
    assert shown.splitlines() == captured_mlp_listing()
