import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from kvcompile import ops
from kvcompile.passes import counters


@pytest.fixture(autouse=True)
def _reference_cpu_kernels():
    """These tests check the pass's rewriting, so the ops run the reference on the CPU. The default CPU
    kernels (C, compiled per store layout) cost a build per random layout drawn here; they have their own
    tests (tests/templates/test_cpu_kernels.py, test_cpu_store.py) and run in the demo, example and
    benchmark tests."""
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with no compiled code and zeroed counters (the tests assert the counts)."""
    torch._dynamo.reset()
    counters.clear()
    dynamo_utils.counters.clear()
    yield
