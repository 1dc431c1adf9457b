"""How many examples each hypothesis property draws: the profile's count for what one of its examples costs.

The profile is ``KVCOMPILE_HYPOTHESIS`` (``fast`` or ``thorough``); unset, ``thorough`` where ``CI`` is set
(.ci/run sets it) and ``fast`` elsewhere. tests/conftest.py loads it before any test module is imported. A
property that draws more (or fewer) examples than a kernel test says what one of its examples costs:

    @profiles.CHEAP         # milliseconds an example (pure Python: the knapsack, a grammar)
    @given(...)

and one that says nothing draws ``KERNEL``'s count (a store, a kernel, Triton's interpreter: up to a second).
"""
from __future__ import annotations

import os

from hypothesis import settings

# Examples per property, by profile and by what one example costs. "thorough" is what CI ran before the
# profiles (the counts the properties had: 15-60 for kernels, 8 for compiled models, 100-600 for pure Python);
# "fast" runs every property a few times, for the fast tier (README: pytest -m "not slow").
COUNTS = {
    "fast": {"cheap": 30, "kernel": 4, "model": 2},
    "thorough": {"cheap": 300, "kernel": 25, "model": 8},
}
NAME = os.environ.get("KVCOMPILE_HYPOTHESIS") or ("thorough" if os.environ.get("CI") else "fast")
if NAME not in COUNTS:
    raise ValueError(f"KVCOMPILE_HYPOTHESIS={NAME!r}: expected one of {sorted(COUNTS)}")

# Numerics properties draw shapes at random; an example can take seconds in the interpreter, so no deadline.
# CI's runs are reproducible (derandomize) and print how to replay a failure.
settings.register_profile("fast", deadline=None, max_examples=COUNTS["fast"]["kernel"])
settings.register_profile("thorough", deadline=None, max_examples=COUNTS["thorough"]["kernel"], derandomize=True,
                          print_blob=True)
settings.load_profile(NAME)

CHEAP = settings(settings.get_profile(NAME), max_examples=COUNTS[NAME]["cheap"])
KERNEL = settings(settings.get_profile(NAME), max_examples=COUNTS[NAME]["kernel"])
MODEL = settings(settings.get_profile(NAME), max_examples=COUNTS[NAME]["model"])
