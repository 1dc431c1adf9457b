"""The results record, docs/results.md: one dated entry per measurement, newest first.

``record(title, body)`` puts ``## <today>: <title>`` and ``body`` above the newest entry (the first ``## ``
heading), as the record's introduction says new measurements go; ``benchmarks/gpu_kernels.py --record`` and
``benchmarks/cpu_decode.py --record`` call it.
"""
from __future__ import annotations

import datetime
from pathlib import Path

RECORD = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def record(title: str, body: str, path: Path = RECORD, date: datetime.date | None = None) -> str:
    """Insert the entry into ``path`` above its newest one; returns the entry's text."""
    entry = f"## {(date or datetime.date.today()).isoformat()}: {title}\n\n{body.strip()}\n\n"
    text = path.read_text()
    at = text.find("\n## ")
    if at < 0:
        raise ValueError(f"{path} holds no dated entry (a '## ' heading) to put this one above")
    path.write_text(text[:at + 1] + entry + text[at + 1:])
    return entry
