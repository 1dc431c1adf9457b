"""The README and the docs link to files that exist (images and pages, relative to the page that links them),
and to headings that exist (``page.md#anchor``, GitHub's anchors); the results record is newest first."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to hyphens (code spans and
    fenced blocks are not headings)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    missing, dangling = [], []
    for target, anchor in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        dest = (page.parent / target) if target else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dangling.append(f"{target}#{anchor}")
    assert not missing, f"{page.relative_to(ROOT)} links to {missing}, which are not there (relative to the page)"
    assert not dangling, f"{page.relative_to(ROOT)} links to headings that do not exist: {dangling}"


def test_the_results_record_is_dated_newest_first():
    dates = re.findall(r"^## (\d{4}-\d\d-\d\d): ", (ROOT / "docs" / "results.md").read_text(), re.M)
    assert len(dates) >= 20 and dates == sorted(dates, reverse=True)
    assert not (ROOT / "benchmarks" / "RESULTS.md").exists()  # one record


def test_record_puts_a_new_entry_on_top(tmp_path):
    import datetime

    from benchmarks.record import record
    page = tmp_path / "results.md"
    page.write_text("# Measurements\n\nintro\n\n## 2026-12-01: older\n\nold body\n")
    record("newer", "new body\n", page, datetime.date(2026, 12, 5))
    assert page.read_text() == ("# Measurements\n\nintro\n\n## 2026-12-05: newer\n\nnew body\n\n"
                                "## 2026-12-01: older\n\nold body\n")
