"""The documentation holds together: a short README whose links resolve, and an errata page for every E-number.

Fast and offline: no Ray, no model, no raydp import; it reads README.md, docs/*.md, experiments/**/README.md,
raydp/**/*.py and .ci/run.

* README.md is a front door: at most README_MAX_LINES lines;
* every relative Markdown link in README.md, docs/*.md and the campaigns' READMEs points at a file or folder that
  exists, and a link with a ``#fragment`` into a Markdown file points at an anchor that exists there (an explicit
  ``<a id="...">`` or a heading's GitHub slug);
* every E-number the code and the docs cite ("ERRATA E3", "(E15)", "E3/E12", ranges "E11-E15") has its anchor
  ``eN`` in docs/errata.md, so "ERRATA En" always means docs/errata.md#en;
* the README's first section carries the test command that .ci/run runs, verbatim.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ERRATA = DOCS / "errata.md"
README_MAX_LINES = 260

# [text](target) and ![alt](target); a target ends at whitespace or ')', an optional "title" after it
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
ANCHOR_TAG = re.compile(r"""<a\s+(?:[^>]*\s)?(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
# an E-number as the code cites it: E1..E99 not inside a word or a hex literal (0x49444E54), and ranges E11-E15
E_TOKEN = re.compile(r"(?<![0-9A-Za-z_])E(\d{1,2})(?:\s*[-\u2013]\s*E?(\d{1,2}))?(?![0-9A-Za-z_])")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "experiments").rglob("README.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _strip_code_spans(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "").replace("~", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: explicit <a id> tags and heading slugs (with GitHub's -1, -2 suffixes)."""
    text = path.read_text(encoding="utf-8")
    found = set(ANCHOR_TAG.findall(text))
    seen: dict[str, int] = {}
    for _, line in _prose_lines(text):
        match = HEADING.match(line)
        if match:
            slug = _slug(match.group(2))
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link in a Markdown file's prose (not in code)."""
    links = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(_strip_code_spans(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            links.append((number, target))
    return links


def cited_e_numbers(text: str) -> set[int]:
    """The E-numbers a text cites, ranges expanded ("E11-E15" -> 11..15)."""
    numbers: set[int] = set()
    for low, high in E_TOKEN.findall(text):
        a = int(low)
        b = int(high) if high else a
        numbers.update(range(min(a, b), max(a, b) + 1))
    return numbers


def _code_citations() -> dict[int, list[str]]:
    """E-number -> files citing it, from raydp/**/*.py and docs/*.md (benchmark.md included)."""
    cited: dict[int, list[str]] = {}
    sources = sorted((ROOT / "raydp").rglob("*.py")) + sorted(DOCS.glob("*.md")) + [README]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            # only where the code cites errata: "ERRATA E3", "(E15)", "E3/E12", "E1-E5", ", E12)"...
            numbers = set()
            for line in text.splitlines():
                if "ERRATA" in line or re.search(r"[(/,;]\s*E\d{1,2}\b|\bE\d{1,2}\s*[),/;:-]", line):
                    numbers |= cited_e_numbers(line)
        else:
            numbers = cited_e_numbers(text)
        for n in numbers:
            cited.setdefault(n, []).append(str(path.relative_to(ROOT)))
    return cited


def first_section(text: str) -> str:
    """From the top of the README to its second level-2 heading (the title's lead and the set-up section)."""
    lines, seen = [], 0
    for line in text.splitlines():
        if line.startswith("## "):
            seen += 1
            if seen == 2:
                break
        lines.append(line)
    return "\n".join(lines)


def ci_test_command() -> str:
    """The command line .ci/run runs: its last non-comment line that invokes pytest."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in lines if line and not line.startswith("#") and "pytest" in line]
    assert commands, ".ci/run runs no pytest command"
    return commands[-1]


# -- the tests -----------------------------------------------------------------------------------------------


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for number, target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        destination = path if not file_part else (path.parent / file_part).resolve()
        if not destination.exists():
            broken.append(f"{path.name}:{number}: {target} (no such file)")
            continue
        if fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{path.name}:{number}: {target} (no anchor #{fragment} in {destination.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_document():
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in relative_links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_errata_has_an_anchor_per_item():
    found = anchors(ERRATA)
    headings = [int(n) for n in re.findall(r"^## E(\d+)\.", ERRATA.read_text(encoding="utf-8"), re.MULTILINE)]
    assert headings == sorted(headings) and len(headings) == len(set(headings)), headings
    missing = [n for n in headings if f"e{n}" not in found]
    assert not missing, f"errata headings without an <a id=\"eN\"> anchor: {missing}"


def test_every_cited_e_number_is_in_the_errata():
    found = anchors(ERRATA)
    cited = _code_citations()
    assert cited, "no E-number cited anywhere: the citation pattern is broken"
    missing = {f"E{n}": files[:5] for n, files in sorted(cited.items()) if f"e{n}" not in found}
    assert not missing, f"E-numbers cited but not in docs/errata.md: {missing}"


def test_the_citation_parser_reads_ranges_and_skips_hex():
    assert cited_e_numbers("ERRATA E11-E15, and E3/E12") == {3, 11, 12, 13, 14, 15}
    assert cited_e_numbers("(E1-E5)") == {1, 2, 3, 4, 5}
    assert cited_e_numbers('IDENTIFIER_STREAM = 0x49444E54  # "IDNT"') == set()
    assert cited_e_numbers("Eq. 10, EW-FT, E2E") == set()


def test_the_readme_first_section_has_the_ci_test_command():
    command = ci_test_command()
    assert command in first_section(README.read_text(encoding="utf-8")), (
        f"README.md's first section lacks .ci/run's command: {command}")
