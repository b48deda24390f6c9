"""Every relative link in README.md and docs/**/*.md points to a file that exists, and its #anchor to a heading.

The README is short and sends the reader into docs/; a page moved or a heading renamed would otherwise leave
links that go nowhere. Links inside code (fenced blocks, `inline code`) are not links and are skipped; links
with a scheme (https:, mailto:) are not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# [text](target) and ![alt](target), with an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str, blank_inline_code: bool = True) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code blanked out unless asked to keep it.

    Inline code may run over a line break (not over a blank line), so it is blanked paragraph by paragraph.
    """
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    if not blank_inline_code:
        return lines
    paragraphs = "\n".join(lines).split("\n\n")
    return [line for paragraph in paragraphs for line in INLINE_CODE.sub("", paragraph).splitlines()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

    Example: "Cost curves (`python -m bench --sweep`)" -> "cost-curves-python--m-bench---sweep".
    """
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (inline code in a heading is part of its anchor), repeated
    headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    lines = prose_lines(page.read_text(encoding="utf-8"), blank_inline_code=False) if page.suffix == ".md" else []
    for line in lines:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's links, code left out (a link's text may run over a line break)."""
    return LINK.findall("\n".join(prose_lines(page.read_text(encoding="utf-8"))))


def test_there_are_pages_with_links():
    assert len(PAGES) > 1 and any(links(page) for page in PAGES)


def test_slug_follows_github():
    assert slug("What a run writes to `output_dir`") == "what-a-run-writes-to-output_dir"
    assert slug("Against LLaMA-Factory 0.9.5") == "against-llama-factory-095"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.is_file() and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
