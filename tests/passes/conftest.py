import pytest

from kvcompile import ops


@pytest.fixture(autouse=True)
def _reference_cpu_kernels():
    """These tests check the pass's rewriting, so the ops run the reference on the CPU. The default CPU
    attention (the template compiled by Inductor once per store layout) costs a compile per random layout
    drawn here; it has its own tests (tests/templates/test_inductor_attention.py) and runs in the demo,
    example and benchmark tests."""
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")
