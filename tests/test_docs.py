"""The README stays a front door, and every link in it and in docs/ leads somewhere that exists.

Relative links (markdown `[text](target)`, reference definitions `[name]: target`) must name a file of the
repository, and a `#anchor` must match a heading of the markdown file it points into, slugged as GitHub does.
Every docs/*.md page must be reachable from the README's documentation map.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 250
MAP_HEADING = "Documentation"

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks: a `#` or `[x](y)` inside a code block is not markdown."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading renders as its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated heading gets -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = heading_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def link_targets(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a markdown file, code excluded."""
    targets = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("code", line)
        targets += [(number, target) for target in INLINE_LINK.findall(line)]
        definition = REFERENCE_DEF.match(line)
        if definition:
            targets.append((number, definition.group(1)))
    return targets


def broken_links(path: Path) -> list[str]:
    """One line per relative link of `path` whose file or heading anchor does not exist."""
    problems = []
    for number, target in link_targets(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: {target}"
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{where}: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where}: no heading #{anchor} in {linked.name}")
    return problems


def map_links() -> set[Path]:
    """The files linked from the README's documentation map (its `## Documentation` section)."""
    text = README.read_text(encoding="utf-8")
    section = re.search(rf"^## {MAP_HEADING}\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert section, f"README.md has no '## {MAP_HEADING}' section (the map of docs/)"
    return {(REPO / target.partition("#")[0]).resolve()
            for target in INLINE_LINK.findall(CODE_SPAN.sub("code", section.group(1)))
            if not EXTERNAL.match(target)}


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES} (move detail to docs/)"


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_in_the_readme_map():
    missing = [str(page.relative_to(REPO)) for page in doc_pages() if page.resolve() not in map_links()]
    assert missing == [], f"docs pages missing from the README's '## {MAP_HEADING}' map: {missing}"


def test_slugs_follow_github():
    assert heading_slug("3.7 Encoder–decoders (T5)") == "37-encoderdecoders-t5"
    assert heading_slug("Every script in `benchmarks/`") == "every-script-in-benchmarks"
    assert heading_slug("FeatCal — post-merging feature calibration") == "featcal--post-merging-feature-calibration"
    assert heading_slug("Beyond the paper: λ without labels") == "beyond-the-paper-λ-without-labels"
    assert heading_slug("The [pool](x.md) runner's cost") == "the-pool-runners-cost"


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#a-section) [fine too](#page) [external](https://example.org/x.md)\n"
        "[gone](missing.md) [bad anchor](other.md#not-a-heading) `[in code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n"
        "[ref]: other.md#no-such-section\n"
    )
    problems = broken_links(page)
    assert [problem.split(": ", 1)[1] for problem in problems] == [
        "missing.md: no file missing.md",
        "other.md#not-a-heading: no heading #not-a-heading in other.md",
        "other.md#no-such-section: no heading #no-such-section in other.md",
    ]
