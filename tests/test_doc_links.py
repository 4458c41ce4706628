"""Every relative link in README.md and docs/ resolves: the file exists and a
`#anchor` names a heading of it (GitHub's slugs), so moving a section cannot
leave a dangling pointer behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])

# `[text](target)` or `[text](target "title")`; images (`![alt](target)`) are links too.
_LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks, code spans blanked."""
    lines = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, _CODE_SPAN.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, markup and punctuation
    dropped (hyphens and underscores kept), spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, a repeated one numbered as GitHub does."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(document: Path, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for number, line in prose_lines(document.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            linked = (document.parent / path_part).resolve() if path_part else document
            where = f"{document.relative_to(root)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(document):
    assert broken_links(document) == []


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The `serve` flags (`--x`)\n")
    document = tmp_path / "README.md"
    document.write_text(
        "[ok](other.md#the-serve-flags---x) [ok](#top) [web](https://example.com)\n"
        "```\n[in a fence](missing.md)\n```\n`[in code](missing.md)`\n"
        "[gone](missing.md) [no anchor](other.md#nowhere)\n\n# Top\n"
    )
    assert broken_links(document, tmp_path) == [
        "README.md:6: missing.md: no such file",
        "README.md:6: other.md#nowhere: no heading with the anchor #nowhere",
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("`kvcellar serve` flags", "kvcellar-serve-flags"),
        ("The Responses API (`/v1/responses`)", "the-responses-api-v1responses"),
        ("SSD write wear: admission, write budget, statistics", "ssd-write-wear-admission-write-budget-statistics"),
        ("Shared cold tier (S3)", "shared-cold-tier-s3"),
    ],
)
def test_slugs_are_githubs(heading, anchor):
    assert slug(heading) == anchor
