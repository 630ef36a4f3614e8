"""The user-facing pages stay short and every relative link in them resolves.

Pages: README.md, BENCHMARKS.md and docs/*.md. A link or image `[text](target)` outside
code is checked when its target is relative (no URL scheme): the file or folder must
exist, relative to the page, and an anchor (`page.md#anchor`, or `#anchor` on the page
itself) must name one of the target page's headings, slugged as GitHub slugs them
(lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` ... for repeats).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 150
BENCHMARKS_MAX_LINES = 400

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The page without fenced code blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def link_targets(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, repeats numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, does not resolve; None when it does."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{target}: no such file {shown(dest)}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading #{anchor} in {shown(dest)}"
    return None


def relative_targets(page: Path) -> list[str]:
    return [t for t in link_targets(page) if not SCHEME.match(t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [why for t in relative_targets(page) if (why := broken(page, t))]
    assert not problems, "\n".join(problems)


def test_the_pages_exist_and_have_links() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "BENCHMARKS.md", "docs/architecture.md", "docs/api.md"} <= names
    assert relative_targets(ROOT / "README.md") and relative_targets(ROOT / "BENCHMARKS.md")


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < README_MAX_LINES


def test_benchmarks_is_short() -> None:
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) < BENCHMARKS_MAX_LINES


def test_the_checker_finds_broken_links_and_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A `code` title, with punctuation!\n\n## Repeat\n\n## Repeat\n\n"
        "```\n## not a heading\n[not a link](missing.md)\n```\n\n"
        "[ok](#a-code-title-with-punctuation) [ok](#repeat-1) `[skipped](nowhere.md)`\n"
        "[bad](#repeat-2) [bad](gone.md) [multi\nline](page.md#repeat) ![img](page.md)\n"
    )
    targets = relative_targets(page)
    assert targets == [
        "#a-code-title-with-punctuation",
        "#repeat-1",
        "#repeat-2",
        "gone.md",
        "page.md#repeat",
        "page.md",
    ]
    assert [t for t in targets if broken(page, t)] == ["#repeat-2", "gone.md"]
