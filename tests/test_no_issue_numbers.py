"""No project issue numbers in what a reader reads: the README, the docs and the package's code.

A tracker's number ("issue 26", "Issues 30", "issue #12") tells a reader of the code or the docs nothing; the text
says what the thing is or why instead. Fast and offline: it reads README.md, docs/**/*.md (the design notes in
docs/design/ included) and raydp/**/*.py as text. The dated campaign history in experiments/ may keep its numbers,
and so may the tests. ERRATA entries (E7, docs/errata.md#e7) are not issue numbers and are not matched.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+")


def _scanned_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "raydp").rglob("*.py"))]


def issue_numbers(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of ``text`` that cites an issue number."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if ISSUE_NUMBER.search(line)]


def test_the_pattern_finds_issue_numbers_and_nothing_else():
    cited = "a\n(issue 26)\nIssue 29's pair\nissues 30/31\nissue #12\nERRATA E7, docs/errata.md#e7, an issued id\n"
    assert [number for number, _ in issue_numbers(cited)] == [2, 3, 4, 5]
    assert issue_numbers("tissue 3 and reissue 4; the issue asks; self.issued = 0; E11-E15") == []


def test_no_issue_numbers_in_the_readme_the_docs_or_the_code():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line}"
                 for path in _scanned_files() if path.is_file()
                 for number, line in issue_numbers(path.read_text(encoding="utf-8"))]
    assert not offenders, ("say what the thing is or why instead of citing an issue number:\n"
                           + "\n".join(offenders))
