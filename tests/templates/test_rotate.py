"""The rotation kernels -- C on the CPU (``kvcompile.templates.cpu_rotate``, the template ``cpu_rotate.c``), Triton
on CUDA (``kvcompile.templates.rotate``; here in Triton's interpreter) -- equal the rotation's specification
(``kvcompile.store.rotate_reference``) bit for bit, and the specification is the Hadamard rotation: ``x @ H``
rounded once wherever float64 holds the sums exactly.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import ops
from kvcompile import quant as Q
from kvcompile.errors import ArgumentError
from kvcompile.store import _rotate, _signs_cpu, hadamard, rotate_reference, rotation_block
from kvcompile.templates import cpu, cpu_rotate
from kvcompile.templates import rotate as triton_rotate
import profiles

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cc = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEAD_SIZES = [8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 256, 512]


INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(a, b) -> bool:
    """Equal bits (a zero's sign too), NaN where NaN."""
    def bits(t):
        return t.view(INT[t.element_size()]).masked_fill(t.isnan(), 0)
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            and torch.equal(bits(a), bits(b)))


def rows_of(data, n: int, D: int, dtype) -> torch.Tensor:
    """``n x D`` values: normal ones at a drawn spread of magnitudes, with drawn specials mixed in."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    spread = data.draw(st.sampled_from([0.0, 1.0, 8.0, 30.0]), label="log-magnitude spread")
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * torch.exp(torch.randn(n, D, generator=g,
                                                                                     dtype=torch.float64) * spread)
    specials = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, D - 1),
                                            st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"),
                                                             3e38, -3e38, 65504.0, 1e-40, 6e-8])),
                                  max_size=6), label="specials")
    for r, c, v in specials:
        x[r, c] = v
    if data.draw(st.booleans(), label="a row of one repeated value"):
        x[0] = data.draw(st.sampled_from([0.0, -0.0, 1.5, 3e38]))
    return x.to(dtype)


@needs_cc
@profiles.CHEAP
@given(D=st.sampled_from(HEAD_SIZES), dtype=st.sampled_from(DTYPES), n=st.sampled_from([1, 2, 7, 33, 1030]),
       data=st.data())
def test_the_c_kernel_is_the_reference_bit_for_bit(D, dtype, n, data):
    """Every head size, input dtype, row count (past the threaded size too), magnitude spread and special value
    (NaN, infinities, signed zeros, values beyond fp16/bf16's range, subnormals)."""
    x = rows_of(data, n, D, dtype)
    got = cpu_rotate.rotate(x)
    assert same(got, rotate_reference(x))
    assert got.dtype == dtype and got.shape == x.shape


@profiles.KERNEL
@given(D=st.sampled_from(HEAD_SIZES), dtype=st.sampled_from(DTYPES), n=st.sampled_from([1, 3, 17, 40]),
       data=st.data())
def test_the_triton_kernel_is_the_reference_bit_for_bit(D, dtype, n, data):
    """The same, for the Triton kernel: head sizes that are not powers of two run in a padded tile, row counts
    that are not a multiple of a program's rows leave a partial one."""
    x = rows_of(data, n, D, dtype).to(DEV)
    got = triton_rotate.rotate(x)
    assert same(got.cpu(), rotate_reference(x.cpu()))
    assert got.dtype == dtype and got.shape == x.shape and got.device == x.device


@profiles.CHEAP
@given(D=st.sampled_from(HEAD_SIZES), dtype=st.sampled_from(DTYPES[:3]), n=st.integers(1, 40), data=st.data())
def test_the_reference_is_x_at_h_rounded_once_where_the_sums_are_exact(D, dtype, n, data):
    """For model-dtype rows of a modest spread of magnitudes float64 holds every sum exactly, so the
    transform's result is the matrix product's, whatever the order: ``(x @ S) / sqrt(block)`` in float64,
    saturated to the dtype. (This is what pins the transform's signs and order to ``hadamard``.)"""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = (torch.randn(n, D, generator=g) * torch.exp(torch.randn(n, D, generator=g) * 2)).to(dtype)
    want = Q.saturate((x.double() @ _signs_cpu(D)) * (1 / math.sqrt(rotation_block(D))), dtype)
    assert same(rotate_reference(x), want)
    assert (rotate_reference(x.double()) - x.double() @ hadamard(D, dtype=torch.float64)).abs().max() <= \
        1e-12 * max(1.0, float(x.double().abs().max()))


@needs_cc
def test_a_row_rotates_the_same_alone_and_in_any_batch_on_any_view():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, 3, 64, generator=g) * torch.exp(torch.randn(5, 9, 3, 64, generator=g) * 10)
    whole = cpu_rotate.rotate(x)
    assert same(cpu_rotate.rotate(x[2:3, 4:5, 1:2]), whole[2:3, 4:5, 1:2])
    t = x.transpose(1, 2)  # a strided view: rotated as its values
    assert same(cpu_rotate.rotate(t), whole.transpose(1, 2))
    assert same(cpu_rotate.rotate(x[:0]), whole[:0])


@needs_cc
def test_rotate_runs_the_kernels_of_the_family_and_the_reference_when_asked(monkeypatch):
    """``store._rotate`` (what every store, page and tensor-parallel path calls) runs the C kernel under the CPU
    kernels, the Triton kernel under "triton", the specification under "reference" -- the same bits -- and,
    while Dynamo traces, the kernel as the operator ``kvcompile::rotate``."""
    calls = []
    for mod in (cpu_rotate, triton_rotate):
        real = mod.rotate
        monkeypatch.setattr(mod, "rotate", lambda x, real=real, mod=mod: calls.append(mod) or real(x))
    x = torch.randn(4, 3, 17, 64).bfloat16()
    monkeypatch.setattr(ops, "_KERNELS", "cpu")
    fast = _rotate(x)
    assert calls == [cpu_rotate]
    monkeypatch.setattr(ops, "_KERNELS", "triton")
    assert same(_rotate(x.to(DEV)).cpu(), fast) and calls == [cpu_rotate, triton_rotate]
    monkeypatch.setattr(ops, "_KERNELS", "reference")
    assert same(_rotate(x), fast) and len(calls) == 2
    monkeypatch.setattr(ops, "_KERNELS", "auto")
    graphs = []

    def backend(gm, inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm
    traced = torch.compile(_rotate, backend=backend, fullgraph=True)(x)
    assert graphs == [[torch.ops.kvcompile.rotate]]
    assert calls == [cpu_rotate, triton_rotate, cpu_rotate] and same(traced, fast)


@needs_cc
@pytest.mark.parametrize("D", [80, 96])
def test_inductor_compiles_a_graph_that_rotates(D):
    """The "inductor" family's attention rotates its chunk inside the graph Inductor compiles: the operator
    compiles at head sizes whose rotation blocks are not the whole head (the specification's own torch
    operations, traced, made Inductor emit C++ that did not compile at head_dim 96) and keeps the bits."""
    x = (torch.randn(2, 3, 7, D) * torch.exp(torch.randn(2, 3, 7, D) * 12)).bfloat16()
    got = torch.compile(lambda t: _rotate(t) * 1, fullgraph=True)(x)
    assert same(got, rotate_reference(x))


@needs_cc
def test_bad_input_is_refused_with_what_was_expected():
    for mod in (cpu_rotate, triton_rotate):
        with pytest.raises(ArgumentError, match="float32, float64, bfloat16 or float16.*int32"):
            mod.rotate(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="at most 1024 channels; head_dim 2048.*reference"):
        cpu_rotate.rotate(torch.ones(2, 2048))
    if torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="CPU tensors"):
            cpu_rotate.rotate(torch.ones(2, 64, device="cuda"))
