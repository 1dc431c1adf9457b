"""Test-wide setup.

Triton kernels run on the CPU through Triton's interpreter, which must be switched on before any kernel is
defined, so it is set here, before the tests import kvcompile. On a machine with a GPU the real kernels run.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# Numerics tests draw shapes at random; each example can take seconds in the interpreter, so no deadline.
settings.register_profile("kvcompile", deadline=None, max_examples=25, derandomize=False)
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "kvcompile")
