"""The CPU store kernel (``kvcompile.templates.cpu_store``, the C template ``cpu_store.c``) equals the reference
store bit for bit: codes, scales, zero points, sinks, live ring slots and lengths, for every format, axis,
group, scale dtype, model dtype, chunk length and ragged batch; and it fails like the reference.

One caveat is not tested because it is not a property of the reference: when a group's minimum (or maximum)
is a zero that occurs with both signs, which sign torch's vectorized reduction returns depends on its
reduction tree, so the sign bit of that zero point may differ (the codes and every dequantized value do not).
The inputs here (randn, exact +0.0 rows, constants) never hold -0.0.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import CapacityError, LayerSpec, store_reference
from kvcompile.templates import cpu, cpu_store
from store_checks import around, assert_same_store, quants, tie_rows, with_history


pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")


# --------------------------------------------------------------------------- the store


@st.composite
def store_cases(draw):
    D = draw(st.sampled_from([16, 32, 48, 64, 128]))  # 48: a head that is not a power of two
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 1, 5, 16, 128])),
                    sink=draw(st.sampled_from([0, 0, 3])), rotate=D != 48 and draw(st.booleans()))
    B, H = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    history = [draw(st.integers(0, 40)) for _ in range(B)]  # ragged prefix, appended by the reference
    chunks = draw(st.lists(st.sampled_from([1, 1, 1, 2, 7, 16, 33, 70]), min_size=1, max_size=4))
    ragged = draw(st.booleans())  # appends of per-row lengths (n_new)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    in_model_dtype = draw(st.booleans())  # k, v given in the model dtype, or fp32 (converted on the way in)
    threads = draw(st.sampled_from([1, 2]))
    return policy, B, H, D, dtype, history, chunks, ragged, in_model_dtype, threads, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=20)
@given(store_cases())
def test_cpu_store_equals_reference(case):
    policy, B, H, D, dtype, history, chunks, ragged, in_model_dtype, threads, seed = case
    spec, ref, got, g, scale = with_history(policy, B, H, D, dtype, history, chunks, seed)
    in_dt = spec.torch_dtype if in_model_dtype else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: long appends are shared among OpenMP threads
    try:
        for n in chunks:
            k = torch.randn(B, H, n, D, generator=g) * scale
            v = torch.randn(B, H, n, D, generator=g) + torch.randn(B, H, 1, D, generator=g) * 4  # offset: asym zeros
            if n > 2:
                v[:, :, 1] = 3.25  # a constant token: scale 0, codes exact
                k[:, :, 2] = 0.0   # all-zero token
            k, v = k.to(in_dt), v.to(in_dt)
            n_new = torch.randint(0, n + 1, (B,), generator=g, dtype=torch.int32) if ragged else None
            store_reference(ref, spec, k, v, n_new)
            cpu_store.store(got, spec, k, v, n_new)
            assert_same_store(ref, got, spec)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("policy", [Policy.kivi(2, group=4, residual=3, sink=2), Policy.fp8(residual=0),
                                    Policy(Quant("int3", "channel", 8, True, "float32"), Quant("none"), residual=2)])
def test_cpu_store_decode_steps_cross_every_boundary(policy):
    """Token by token through sinks, the residual, several flushes and the ring's wrap-around."""
    B, H, D, C = 2, 2, 16, 40
    spec = LayerSpec(policy, B, H, C, D)
    ref, got = spec.allocate(), spec.allocate()
    g = torch.Generator().manual_seed(0)
    for _ in range(C):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        store_reference(ref, spec, k, v)
        cpu_store.store(got, spec, k, v)
        assert_same_store(ref, got, spec)


@pytest.mark.parametrize("fmt,sym", [("int8", False), ("int4", False), ("int3", True), ("int2", False),
                                     ("int2", True), ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_cpu_store_rounds_ties_to_even(fmt, sym):
    """Rows and columns that hold the group's extremes (scale 1) and ties: per-token keys and per-channel values
    both round half to even, as torch.round and torch's fp8 cast do."""
    D = 16
    row = tie_rows(fmt, sym, D)
    x = torch.stack([row.roll(t) for t in range(D)])[None, None]  # [1, 1, 16 tokens, 16 channels]
    policy = Policy(Quant(fmt, "token", None, sym), Quant(fmt, "channel", D, sym), residual=0)
    spec = LayerSpec(policy, 1, 1, D, D)
    ref, got = spec.allocate(), spec.allocate()
    store_reference(ref, spec, x, x)
    cpu_store.store(got, spec, x, x)
    assert_same_store(ref, got, spec)


def test_cpu_store_takes_strided_chunks():
    """k, v as the model hands them (a transposed [B, n, H, D] view): no copy needed, same bytes."""
    spec = LayerSpec(Policy.kivi(4, group=8, residual=4), 2, 3, 64, 32)
    ref, got = spec.allocate(), spec.allocate()
    g = torch.Generator().manual_seed(1)
    for n in (20, 1, 9):
        k = torch.randn(2, n, 3, 32, generator=g).transpose(1, 2)
        v = torch.randn(2, n, 3, 32, generator=g).transpose(1, 2)
        store_reference(ref, spec, k, v)
        cpu_store.store(got, spec, k, v)
        assert_same_store(ref, got, spec)


def test_cpu_store_overflow_raises_like_the_reference_and_writes_nothing():
    spec = LayerSpec(Policy.kivi(4, group=4, residual=2), 2, 1, 8, 16)
    state = spec.allocate()
    cpu_store.store(state, spec, torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16), torch.tensor([6, 4]))
    before = [t.clone() for t in state]
    ref = spec.allocate()
    for a, b in zip(ref, state):
        a.copy_(b)
    k, v = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    with pytest.raises(CapacityError) as want:
        store_reference(ref, spec, k, v, torch.tensor([1, 5]))
    with pytest.raises(CapacityError) as got:
        cpu_store.store(state, spec, k, v, torch.tensor([1, 5]))
    assert str(got.value) == str(want.value) and "sequence 1 holds 4 tokens and appends 5" in str(got.value)
    assert all(torch.equal(a, b) for a, b in zip(before, state))
    with pytest.raises(ValueError, match=r"n_new\[0\]=6 is outside \[0, 5\]"):
        cpu_store.store(state, spec, k, v, torch.tensor([6, 0]))
    with pytest.raises(ValueError, match=r"store expects k, v of shape \[2, 1, n, 16\]"):
        cpu_store.store(state, spec, k[:1], v[:1])


def test_the_store_op_runs_the_cpu_kernel(monkeypatch):
    """``torch.ops.kvcompile.store`` on the CPU (kernels "cpu", the default there) calls this kernel."""
    from kvcompile import ops
    spec = LayerSpec(Policy.int8(), 1, 1, 8, 16)
    name = spec.register()
    calls = []
    real = cpu_store.store
    monkeypatch.setattr(cpu_store, "store", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "_KERNELS", "cpu")
    state, ref = spec.allocate(), spec.allocate()
    k, v = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    torch.ops.kvcompile.store(list(state), k, v, torch.arange(3), name)
    store_reference(ref, spec, k, v)
    assert calls == [1]
    assert_same_store(ref, state, spec)


# --------------------------------------------------------------------------- the numeric helpers, exhaustively
def _helpers():
    return cpu_store.build(LayerSpec(Policy.int8(), 1, 1, 8, 16)).lib


def test_fp16_directed_rounding_matches_the_reference():
    f16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = around(f16[f16.isfinite()])
    x = torch.cat([x, torch.tensor([1e6, -1e6, 65504.5, -65504.5, 1e-10, -1e-10, 0.0, -0.0, float("inf"),
                                    float("-inf")])]).contiguous()
    lib = _helpers()
    for up, direction in ((1, "up"), (0, "down")):
        out = torch.empty(x.numel(), dtype=torch.int16)
        lib.kvc_round_f16(x.data_ptr(), out.data_ptr(), x.numel(), up)
        want = Q.round_to_dtype(x, torch.float16, direction).view(torch.int16)
        assert torch.equal(out, want), (direction, x[out != want][:8])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encoding_matches_torch(fmt):
    vals = torch.arange(256, dtype=torch.uint8).view(Q.FP8_DTYPES[fmt]).float()
    x = around(vals[vals.isfinite()])
    edge = 464.0 if fmt == "fp8_e4m3" else 61440.0  # halfway above the largest value (e4m3fn: 448; e5m2: even = inf)
    x = torch.cat([x, torch.tensor([edge, -edge, 1e-30])]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _helpers().kvc_fp8_encode(x.data_ptr(), out.data_ptr(), x.numel(), int(fmt == "fp8_e4m3"))
    want = x.to(Q.FP8_DTYPES[fmt]).view(torch.uint8)
    assert torch.equal(out, want), x[out != want][:8]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encoding_beyond_the_range(fmt):
    """What cpu_store.c's header specifies for values the store never encodes (|x / scale| <= the maximum by
    construction; only inf or NaN inputs get here): e4m3fn saturates to +-448 from 464 up, infinities
    included, e5m2 goes to +-inf from 61440 up (round half to even), NaN stays NaN. Written out rather than taken from torch, whose
    cast beyond e4m3fn's range changed between releases (2.13 saturates, 2.11 gives NaN)."""
    x = torch.tensor([1e9, -1e9, 480.0, 65536.0, float("inf"), -float("inf"), float("nan")])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _helpers().kvc_fp8_encode(x.data_ptr(), out.data_ptr(), x.numel(), int(fmt == "fp8_e4m3"))
    top = 0x7E if fmt == "fp8_e4m3" else 0x7C  # 448, or inf
    big = 0x7E if fmt == "fp8_e4m3" else 0x60  # 480 is representable in e5m2
    assert out.tolist() == [top, top | 0x80, big, top, top, top | 0x80, 0x7F]
