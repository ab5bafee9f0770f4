"""Every relative link in the README, CONTRIBUTING.md and docs/ leads somewhere: the file exists, and an
`#anchor` names a heading of that file as GitHub renders it. And the README stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

FENCED = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, …


def prose(markdown: str) -> str:
    """The text a reader sees as prose: fenced blocks dropped, inline code kept as its bare text.

    Example: "a `[x](y)` b\\n```\\n[c](d)\\n```\\n" -> "a [x] (y) b\\n\\n" (links in code are not links, but
    a link's text may be code: "[`auto`](#auto)" stays a link)
    """
    text = FENCED.sub("", markdown)
    return INLINE_CODE.sub(lambda m: m.group(2).replace("](", "] ("), text)


def links(markdown: str) -> list[str]:
    """The link and image targets of a document's prose.

    Example: "See [the app](docs/app.md#sharing) and ![shot](assets/a.png)." -> ["docs/app.md#sharing", "assets/a.png"]
    """
    return LINK.findall(prose(markdown))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: markup dropped, lower case, punctuation gone, spaces to hyphens.

    Example: "Does `auto` pay? (`benchmarks/auto_vs_fixed.py`)" -> "does-auto-pay-benchmarksauto_vs_fixedpy"
             "Break-even α*(k) on an H100" -> "break-even-αk-on-an-h100"
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for _, title in HEADING.findall(FENCED.sub("", markdown)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(document: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of `document`, one line each, with paths relative to `root`."""
    problems = []
    for target in links(document.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        if not destination.exists():
            problems.append(f"{target}: no such file {destination.relative_to(root)}")
        elif anchor and destination.suffix == ".md":
            if anchor not in anchors(destination.read_text(encoding="utf-8")):
                problems.append(f"{target}: no heading #{anchor} in {destination.relative_to(root)}")
    return problems


def test_slugs_links_and_anchors_follow_github():
    assert slug("Does `auto` pay? (`benchmarks/auto_vs_fixed.py`)") == "does-auto-pay-benchmarksauto_vs_fixedpy"
    assert slug("Break-even α*(k) on an H100") == "break-even-αk-on-an-h100"
    assert slug("The [coder pair](docs/coder-pair.md)") == "the-coder-pair"
    assert slug("What changed (2026-11-24)") == "what-changed-2026-11-24"
    text = "# A\n## Tests\n```sh\n# not a heading\n[x](nowhere.md)\n```\n## Tests\nSee [`auto`](#a) `[y](z)`.\n"
    assert anchors(text) == {"a", "tests", "tests-1"}
    assert links(text) == ["#a"]
    assert links('![shot (left)](assets/a.png "title") [t](<b.md>)') == ["assets/a.png", "b.md"]


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "b.md").write_text("# Here\n", encoding="utf-8")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#here) [web](https://example.com/x) [gone](c.md) [bad](b.md#there) [self](#nope)\n")
    assert broken_links(doc, root=tmp_path) == [
        "c.md: no such file c.md",
        "b.md#there: no heading #there in b.md",
        "#nope: no heading #nope in a.md",
    ]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(document):
    assert document.is_file(), f"{document.relative_to(REPO)} is missing"
    problems = broken_links(document)
    assert not problems, f"{document.relative_to(REPO)}:\n" + "\n".join(problems)


def test_the_readme_is_read_in_five_minutes():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
