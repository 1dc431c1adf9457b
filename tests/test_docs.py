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


@pytest.mark.slow
def test_the_calibrate_call_the_readme_shows_runs_on_the_embedded_model(monkeypatch):
    """The README's and docs/usage.md's ``kvcompile.calibrate(model, budget=3.0)``, on the embedded SmolLM2 with
    the library's defaults: ``budget=3.0`` is the bytes of a uniform 3-bit cache, which the default candidates
    can fill. The measurement itself (an hour on this CPU, ``measure``) is replaced by the one shipped for this
    model and these defaults (``benchmarks/results/calibrate/smollm2_sensitivity.json``, measured by ``measure``
    with the default candidates on the default calibration windows); every other step runs as called: the
    budget's check, the default calibration windows from the model's tokenizer, the allocation. It returns the
    policy docs/results.md evaluated at the bytes of uniform 3-bit (``smollm2_cal3.json``), which ``apply``
    takes."""
    import sys

    import torch

    import kvcompile
    from kvcompile import Policy, models
    import kvcompile.calibrate  # noqa: F401  (the attribute kvcompile.calibrate is the function)

    cal = sys.modules["kvcompile.calibrate"]
    calls = {re.search(r"kvcompile\.calibrate\([^)]*\)", p.read_text()).group(0)
             for p in (ROOT / "README.md", ROOT / "docs" / "usage.md")}
    assert calls == {"kvcompile.calibrate(model, budget=3.0)"}, calls
    shipped = ROOT / "benchmarks" / "results" / "calibrate"
    seen = {}

    def measured(model, windows, candidates=None, *args, **kwargs):
        seen["windows"], seen["candidates"] = tuple(windows.shape), candidates
        return cal.Sensitivity.load(shipped / "smollm2_sensitivity.json")

    monkeypatch.setattr(cal, "measure", measured)
    model, _ = models.load(log=lambda *a: None)
    policy = eval(calls.pop(), {"kvcompile": kvcompile, "model": model})
    assert seen == {"windows": (2, 1024), "candidates": None}  # the defaults: 2,048 tokens, the default candidates
    assert cal.Sensitivity.load(shipped / "smollm2_sensitivity.json").candidates == cal.default_candidates(64)
    assert policy == Policy.load(shipped / "smollm2_cal3.json")
    uniform3 = Policy.kivi(3, sink=4, rotate=True)
    assert kvcompile.cache_bytes(policy, 30, 3, 64, 2048) <= kvcompile.cache_bytes(uniform3, 30, 3, 64, 2048)
    kvcompile.apply(model, policy)
    with torch.no_grad():
        assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


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
