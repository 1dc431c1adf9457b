"""The fast tier: ``pytest -m "not slow"`` runs a few minutes, the full suite (no ``-m``) runs everything.

A test is ``slow`` when it loads the real SmolLM2, starts a server of its own, compiles for long, or is one more
case of a grid whose first cases already run in the fast tier. Grids keep their first cases fast:

    @pytest.mark.parametrize("family", slow_after(1, FAMILIES))
"""
from __future__ import annotations

from collections.abc import Iterable

import pytest


def slow_after(n: int, params: Iterable, *, several: bool = True) -> list:
    """``params`` for ``pytest.mark.parametrize``, the ones after the first ``n`` marked ``slow``. A tuple is the
    values of several argument names, as parametrize reads it (``several=False``: one argument whose values are
    tuples); a ``pytest.param`` keeps its id and marks."""
    out = []
    for i, p in enumerate(params):
        if i < n:
            out.append(p)
        elif hasattr(p, "marks") and hasattr(p, "values"):  # already a pytest.param
            out.append(pytest.param(*p.values, marks=(*p.marks, pytest.mark.slow), id=p.id))
        else:
            out.append(pytest.param(*(p if several and isinstance(p, tuple) else (p,)), marks=pytest.mark.slow))
    return out
