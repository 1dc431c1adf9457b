"""The quantize-on-write Triton kernels equal the reference store bit for bit.

Runs through Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), on CUDA if present.
"""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import CapacityError, LayerSpec, store_reference
from kvcompile.templates import launch
from kvcompile.templates import store as kstore
from store_checks import around, assert_same_store, bits, quants, tie_rows, with_history

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def store_cases(draw):
    D = draw(st.sampled_from([16, 32, 48, 64]))  # 48: a head that is not a power of two
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 1, 5, 16])),
                    sink=draw(st.sampled_from([0, 0, 3])), rotate=D != 48 and draw(st.booleans()))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    history = [draw(st.integers(0, 40)) for _ in range(B)]  # ragged prefix, appended by the reference
    chunks = draw(st.lists(st.sampled_from([1, 1, 2, 7, 16, 33]), min_size=1, max_size=3))
    ragged = draw(st.booleans())  # kernel appends of per-row lengths (n_new)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    return policy, B, H, D, dtype, history, chunks, ragged, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=30)
@given(store_cases())
def test_store_kernel_equals_reference(case):
    policy, B, H, D, dtype, history, chunks, ragged, seed = case
    spec, ref, got, g, scale = with_history(policy, B, H, D, dtype, history, chunks, seed, DEV)
    for n in chunks:
        k = torch.randn(B, H, n, D, generator=g) * scale
        v = torch.randn(B, H, n, D, generator=g) + torch.randn(B, H, 1, D, generator=g) * 4  # offset: asym zeros
        if n > 2:
            v[:, :, 1] = 3.25  # a constant token: scale 0, codes exact
            k[:, :, 2] = 0.0   # all-zero token
        n_new = torch.randint(0, n + 1, (B,), generator=g, dtype=torch.int32) if ragged else None
        store_reference(ref, spec, k, v, n_new)
        launch.store(got, spec, k.to(DEV), v.to(DEV), None if n_new is None else n_new.to(DEV))
        assert_same_store(ref, got, spec)


@pytest.mark.parametrize("policy", [Policy.kivi(2, group=4, residual=3, sink=2), Policy.fp8(residual=0)])
def test_store_kernel_decode_steps_cross_every_boundary(policy):
    """Token by token through sinks, the residual, several flushes and the ring's wrap-around."""
    B, H, D, C = 2, 1, 16, 40
    spec = LayerSpec(policy, B, H, C, D)
    ref, got = spec.allocate(), spec.allocate(DEV)
    g = torch.Generator().manual_seed(0)
    for _ in range(C):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        store_reference(ref, spec, k, v)
        launch.store(got, spec, k.to(DEV), v.to(DEV))
        assert_same_store(ref, got, spec)


@pytest.mark.parametrize("fmt,sym", [("int8", False), ("int4", False), ("int3", True), ("int2", False),
                                     ("int2", True), ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_store_kernel_rounds_ties_to_even(fmt, sym):
    """Every row and every column of x holds the group's extremes (scale 1) and ties: per-token keys and
    per-channel values both round half to even, as torch.round and torch's fp8 cast do."""
    D = 16
    row = tie_rows(fmt, sym, D)
    x = torch.stack([row.roll(t) for t in range(D)])[None, None]  # [1, 1, 16 tokens, 16 channels]
    policy = Policy(Quant(fmt, "token", None, sym), Quant(fmt, "channel", D, sym), residual=0)
    spec = LayerSpec(policy, 1, 1, D, D)
    ref, got = spec.allocate(), spec.allocate(DEV)
    store_reference(ref, spec, x, x)
    launch.store(got, spec, x.to(DEV), x.to(DEV))
    assert_same_store(ref, got, spec)


def test_store_kernel_overflow_raises_like_the_reference():
    spec = LayerSpec(Policy.kivi(4, group=4, residual=2), 1, 1, 8, 16)
    state = spec.allocate()
    launch.store(state, spec, torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16))
    with pytest.raises(CapacityError, match="holds 6 tokens and appends 3"):
        launch.store(state, spec, torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16))


def test_unsupported_head_dim_names_the_policy():
    spec = LayerSpec(Policy.kivi(4), 1, 1, 64, 512)
    with pytest.raises(NotImplementedError, match=r"head_dim <= 256.*k=int4\.channel\.32"):
        launch.store(spec.allocate(), spec, torch.zeros(1, 1, 1, 512), torch.zeros(1, 1, 1, 512))


def test_specialization_keys_spell_out_the_format():
    key, kw = kstore.flush_config(Quant("int3", "channel", 16), 128, 4, 128, 16, 143)
    assert key == "store.flush[int3.channel.16.asym.f16;D=128;S=4;R=128;F=16;W=143]"
    assert kw["BITS"] == 3 and kw["CHANNEL"] and kw["G"] == 16 and kw["HAS_ZERO"]
    assert kstore.flush_config(Quant("int3", "channel", 16), 128, 4, 128, 16, 143)[1] is kw  # built once


# --------------------------------------------------------------------------- the numeric helpers, exhaustively
@triton.jit
def _fp8_kernel(x_ptr, o_ptr, N: tl.constexpr, E4M3: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, kstore._fp8_encode(tl.load(x_ptr + i), E4M3).to(tl.uint8))


@triton.jit
def _round_kernel(x_ptr, up_ptr, down_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(up_ptr + i, kstore._round_scale(x, True, True))
    tl.store(down_ptr + i, kstore._round_scale(x, False, True))


def _run_padded(kernel, x, outs, **kw):
    N = triton.next_power_of_2(x.numel())
    xp = torch.zeros(N, dtype=x.dtype)
    xp[: x.numel()] = x
    bufs = [torch.zeros(N, dtype=o) for o in outs]
    args = [t.to(DEV) for t in [xp, *bufs]]
    kernel[(1,)](*args, N=N, **kw)
    return [a.cpu()[: x.numel()] for a in args[1:]]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encode_equals_torch_cast_at_every_rounding_boundary(fmt):
    """Every fp8 value, every midpoint (ties to even), one ulp either side, subnormals, up to the format's max:
    the reachable inputs (quantization divides by absmax / max, so |x / scale| <= max)."""
    dt = Q.FP8_DTYPES[fmt]
    every = torch.arange(256, dtype=torch.uint8).view(dt).float()
    every = every[every.isfinite() & (every.abs() <= Q.FP8_MAX[fmt])]
    x = around(every)
    x = x[x.abs() <= Q.FP8_MAX[fmt]]
    x = torch.cat([x, torch.randn(4000) * 100, torch.rand(2000) * 2.0 ** -8, torch.tensor([0.0, -0.0])])
    (got,) = _run_padded(_fp8_kernel, x, [torch.uint8], E4M3=fmt == "fp8_e4m3")
    want = x.to(dt).view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:8]


def test_fp16_directed_rounding_equals_reference():
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[halves.isfinite()]
    x = torch.cat([around(halves[::7]), torch.randn(3000) * 1e-6, torch.randn(3000) * 3e4,
                   torch.tensor([65504.0, 65519.0, 65520.0, 70000.0, 2.0 ** -25, -2.0 ** -25, 0.0])])
    up, down = _run_padded(_round_kernel, x, [torch.float16, torch.float16])
    assert torch.equal(bits(up), bits(Q.round_to_dtype(x, torch.float16, "up")))
    assert torch.equal(bits(down), bits(Q.round_to_dtype(x, torch.float16, "down")))
