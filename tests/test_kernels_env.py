"""KVCOMPILE_KERNELS is read when kvcompile.ops is imported: a value that names no kernel family must stop the
import with a message naming the variable, the value and the allowed values (it used to run the slow pure-torch
reference silently). Each case imports kvcompile in a fresh interpreter, so the import-time path really runs."""
import os
import subprocess
import sys

import pytest
from tiers import slow_after

ALLOWED = "auto, triton, cpu, inductor, reference"


def _import_with(value: str, code: str = "import kvcompile"):
    env = dict(os.environ, KVCOMPILE_KERNELS=value)
    env.pop("TRITON_INTERPRET", None)  # conftest sets it for this process; the 'triton' case must not inherit it
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", slow_after(1, ["cpuu", "CPU", " cpu"]))
def test_unknown_kernels_value_fails_at_import(value):
    r = _import_with(value)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcompile.errors.ArgumentError: the environment variable KVCOMPILE_KERNELS=")
    assert repr(value) in last and ALLOWED in last and "unset it" in last


def test_triton_kernels_without_a_gpu_or_interpreter_fail_at_import():
    import torch
    if torch.cuda.is_available():
        pytest.skip("with a GPU, KVCOMPILE_KERNELS=triton is valid")
    r = _import_with("triton")
    assert r.returncode != 0
    assert "KVCOMPILE_KERNELS='triton' needs CUDA, or TRITON_INTERPRET=1" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_empty_kernels_value_means_auto():
    # an empty variable (KVCOMPILE_KERNELS= in a shell) is unset, not a family named '' that ran the reference
    r = _import_with("", "import kvcompile, torch; print(kvcompile.ops.kernels(torch.device('cpu')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu"]


def test_set_kernels_names_itself_and_the_allowed_values():
    from kvcompile import ops
    with pytest.raises(ValueError, match=r"set_kernels\(name\)='cpuu' is not valid: expected one of " + ALLOWED):
        ops.set_kernels("cpuu")
