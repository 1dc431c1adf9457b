"""Reference quantization: round-trip bounds derived from each format, code ranges, packing, edge inputs,
saturation up to each input dtype's largest value, and non-finite inputs."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import profiles
from kvcompile import Quant
from kvcompile import quant as Q

INT_FORMATS = ["int8", "int4", "int3", "int2"]
FP8_FORMATS = ["fp8_e4m3", "fp8_e5m2"]
FORMATS_SYM = [(f, s) for f in INT_FORMATS for s in (False, True)] + [(f, True) for f in FP8_FORMATS]  # fp8: symmetric only
# fp8: mantissa bits and the spacing of its subnormals (absolute error floor, in units of the scale)
FP8_MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2}
FP8_SUBNORMAL = {"fp8_e4m3": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}
EPS32 = 2.0 ** -22  # a few fp32 roundings (subtract, divide, multiply, add), relative
SCALE_DTYPES = ["float16", "float32", "fp8_e4m3"]


@st.composite
def quant_and_tensor(draw, formats=INT_FORMATS + FP8_FORMATS):
    fmt = draw(st.sampled_from(formats))
    axis = draw(st.sampled_from(["token", "channel"]))
    D = draw(st.sampled_from([8, 16, 64]))
    group = draw(st.sampled_from([None, 8, D] if axis == "token" else [1, 4, 8, 32]))
    sym = True if fmt.startswith("fp8") else draw(st.booleans())
    sdt = draw(st.sampled_from(SCALE_DTYPES))
    q = Quant(fmt, axis, group, sym, sdt)
    T = (group or 1) * draw(st.integers(1, 3)) if axis == "channel" else draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(seed)
    mag = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = (torch.randn(2, T, D, generator=g) * mag).to(dtype)
    if draw(st.booleans()):  # a key-like outlier channel, as in real keys
        x[..., draw(st.integers(0, D - 1))] += 20 * mag
    return q, x


def _expand(s, q, T, D):
    """Per-element value of a per-group tensor [.., *scale_shape] -> [.., T, D]."""
    if q.axis == "token":
        return s.float().repeat_interleave(q.group_for(D), dim=-1)
    return s.float().repeat_interleave(q.group, dim=-2)


def _bound(x, codes, scale, zero, q):
    """The largest round-trip error each element may have, from the format alone."""
    T, D = x.shape[-2:]
    s = _expand(scale, q, T, D)
    xa = x.float().abs()
    if q.is_fp8:
        m = FP8_MANTISSA[q.format]
        return 2.0 ** -(m + 1) * xa * (1 + 1e-6) + FP8_SUBNORMAL[q.format] / 2 * s + EPS32 * xa
    qmax = 2 ** q.bits
    qmax = 2 ** q.bits
    z = _expand(zero, q, T, D).abs() if zero is not None else 0
    if q.scale_dtype == "fp8_e4m3":  # an int8 zero point counts steps
        z = z * s
    # half a step of the stored scale, plus fp32 rounding of (x - z) / s and code * s + z
    return s / 2 + EPS32 * (qmax * s + z + xa)


@given(quant_and_tensor())
def test_round_trip_within_half_a_step(case):
    q, x = case
    codes, scale, zero = Q.quantize(x, q)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == Q.SCALE_TORCH_DTYPE[q.scale_dtype]
    assert (zero is not None) == q.has_zero
    xh = Q.dequantize(codes, scale, zero, q)
    assert torch.isfinite(xh).all()
    err = (xh - x.float()).abs()
    bound = _bound(x, codes, scale, zero, q)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()} for {q}"


@given(quant_and_tensor(INT_FORMATS))
def test_integer_codes_in_range(case):
    q, x = case
    codes, _, _ = Q.quantize(x, q)
    if q.symmetric:
        mid, qmax = 2 ** (q.bits - 1), 2 ** (q.bits - 1) - 1
        assert codes.min() >= mid - qmax and codes.max() <= mid + qmax
    else:
        assert codes.max() <= 2 ** q.bits - 1


@given(quant_and_tensor(FP8_FORMATS))
def test_fp8_codes_are_finite_and_match_torch(case):
    q, x = case
    codes, scale, _ = Q.quantize(x, q)
    f = codes.view(Q.FP8_DTYPES[q.format]).float()
    assert torch.isfinite(f).all()
    assert f.abs().max() <= Q.FP8_MAX[q.format]


def test_rounding_is_half_to_even():
    q = Quant("int8", "token", None, symmetric=True, scale_dtype="float32")
    # absmax 127 -> scale exactly 1.0, so x / scale lands on exact halves
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -1.5, 127.0, 3.5, -2.5]]])
    codes, scale, _ = Q.quantize(x, q)
    assert scale.item() == 1.0
    assert (codes.float() - 128).tolist() == [[[0, 2, 2, 0, -2, 127, 4, -2]]]


@pytest.mark.parametrize("fmt,sym", FORMATS_SYM)
@pytest.mark.parametrize("axis,group", [("token", None), ("token", 8), ("channel", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sdt", ["float16", "fp8_e4m3"])
def test_zero_and_constant_groups(fmt, sym, axis, group, dtype, sdt):
    """Zeros come back exactly in every format; constants exactly with a zero point (asymmetric integers with
    fp16 scales), and within the format's bound otherwise (a symmetric grid has no point exactly at an arbitrary
    c, and an fp8 scale's int8 zero point counts whole steps)."""
    q = Quant(fmt, axis, group, sym, sdt)
    for const in (0.0, 3.25, -0.75, 1e4 if sdt == "float16" else 300.0):  # an fp8 scale holds up to 448 steps
        x = torch.full((1, 8, 16), const, dtype=dtype)
        codes, scale, zero = Q.quantize(x, q)
        xh = Q.dequantize(codes, scale, zero, q)
        assert torch.isfinite(xh).all()
        if const == 0.0 or (q.has_zero and sdt == "float16"):
            assert torch.equal(xh, x.float()), (fmt, const)
        else:
            assert ((xh - x.float()).abs() <= _bound(x, codes, scale, zero, q)).all()


def test_fp8_scales_keep_a_channel_offset_inside_int8():
    """A group far from 0 against its range (a key channel's offset): one e4m3 byte of scale and an int8 zero
    point, the scale raised to |min| / 127 so that the zero point stays in int8 and nothing clips. By hand, for
    [100, 101] at int4: max(1 / 15, 100 / 127 = 0.787) rounds up to the e4m3 value 0.8125, zero =
    round(-100 / 0.8125) = -123, codes round(x / 0.8125) - 123 = 0 and 1, so x^ = 123 * 0.8125 and 124 * 0.8125."""
    q = Quant("int4", "channel", 2, scale_dtype="fp8_e4m3")
    codes, scale, zero = Q.quantize(torch.tensor([[[100.0], [101.0]]]), q)
    assert scale.dtype == torch.float8_e4m3fn and zero.dtype == torch.int8
    assert scale.float().item() == 0.8125 and zero.item() == -123 and codes.flatten().tolist() == [0, 1]
    assert Q.dequantize(codes, scale, zero, q).flatten().tolist() == [123 * 0.8125, 124 * 0.8125]
    x = 100.0 + torch.rand(2, 64, 8, generator=torch.Generator().manual_seed(0))
    q = Quant("int4", "channel", 32, scale_dtype="fp8_e4m3")
    codes, scale, zero = Q.quantize(x, q)
    assert not Q.clipped(x, q).any() and zero.min() >= -128
    err = (Q.dequantize(codes, scale, zero, q) - x).abs()
    assert (err <= _expand(scale, q, 64, 8) / 2 * (1 + EPS32)).all()


def test_fp8_scales_halve_a_blocks_scale_bytes():
    """Per group, one byte of scale and one of zero point instead of two each."""
    from kvcompile.store import LayerSpec
    from kvcompile import Policy
    f16, f8 = (LayerSpec(Policy.kivi(2, scale_dtype=sd), 3, 64).block_nbytes() for sd in ("float16", "fp8_e4m3"))
    codes = 2 * 3 * 64 * 64 * 2 // 8  # keys and values, 3 heads, 64 tokens, 64 channels, 2 bits
    scales = 3 * (64 // 32) * 64 + 3 * 64 * (64 // 32)  # key groups per channel, value groups per token
    assert f16 == codes + 2 * scales * 2 and f8 == codes + 2 * scales


def test_constants_not_representable_in_fp16_are_exact_with_fp32_scales():
    x = torch.full((1, 4, 8), 0.1, dtype=torch.float32)
    for q in (Quant("int4", scale_dtype="float32"), Quant("int4", symmetric=True, scale_dtype="float32")):
        codes, scale, zero = Q.quantize(x, q)
        assert torch.equal(Q.dequantize(codes, scale, zero, q), x)


@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS)
def test_denormals_and_tiny_values_stay_finite(fmt):
    x = torch.tensor([1e-40, -3e-39, 0.0, 1e-45] * 4, dtype=torch.float32).view(1, 1, 16)
    q = Quant(fmt)
    codes, scale, zero = Q.quantize(x, q)
    xh = Q.dequantize(codes, scale, zero, q)
    assert torch.isfinite(xh).all() and (xh - x).abs().max() <= 6e-8  # one fp16 subnormal step


def test_outlier_channel_is_isolated_by_per_channel_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, 64, generator=g)
    x[..., 7] += 50.0
    per_token = Quant("int4", "token")
    per_channel = Quant("int4", "channel", 32)
    e_tok = (Q.dequantize(*Q.quantize(x, per_token), per_token) - x).abs()
    e_ch = (Q.dequantize(*Q.quantize(x, per_channel), per_channel) - x).abs()
    normal = torch.ones(64, dtype=torch.bool)
    normal[7] = False
    # per token, the outlier stretches every token's step ~10x; per channel only channel 7 pays
    assert e_ch[..., normal].mean() * 5 < e_tok[..., normal].mean()


@given(st.sampled_from([2, 3, 4, 8]), st.integers(1, 4), st.integers(0, 2 ** 31 - 1))
def test_pack_unpack_is_a_bijection(bits, rows, seed):
    g = torch.Generator().manual_seed(seed)
    D = 8 * rows * 2
    codes = torch.randint(0, 2 ** bits, (3, D), generator=g, dtype=torch.uint8)
    packed = Q.pack(codes, bits)
    assert packed.shape == (3, D * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(Q.unpack(packed, bits, D), codes)
    raw = torch.randint(0, 256, (3, D * bits // 8), generator=g, dtype=torch.uint8)
    assert torch.equal(Q.pack(Q.unpack(raw, bits, D), bits), raw)


def test_packing_layout_is_a_little_endian_bit_stream():
    c = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    assert Q.pack(c, 4).tolist() == [0x21, 0x43, 0x65, 0x07]
    assert Q.pack(c[:4] % 4, 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6]
    word = sum(int(v) << (3 * i) for i, v in enumerate(c))
    assert Q.pack(c, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


def test_directed_rounding_to_fp16():
    x = torch.tensor([0.1, -0.1, 1.0, 0.0, 1e-9, -1e-9])
    up = Q.round_to_dtype(x, torch.float16, "up").float()
    down = Q.round_to_dtype(x, torch.float16, "down").float()
    assert (up >= x).all() and (down <= x).all()
    assert up[2] == 1.0 and down[2] == 1.0 and up[3] == 0 and down[3] == 0


# --------------------------------------------------------------------------- saturation and non-finite input
MAX = {torch.float32: torch.finfo(torch.float32).max, torch.bfloat16: torch.finfo(torch.bfloat16).max,
       torch.float16: 65504.0}


@st.composite
def huge_cases(draw):
    """Any format, axis, group, scale dtype and input dtype, at magnitudes up to the input dtype's largest
    value: a random group-structured scale per row, outliers and exact +-max elements."""
    q, x = draw(quant_and_tensor())
    dtype = x.dtype
    top = math.log10(MAX[dtype])
    e = draw(st.floats(0.0, top))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    y = torch.randn(x.shape, generator=g, dtype=torch.float64) * 10.0 ** e
    y = y * 10.0 ** (torch.rand(x.shape[:-1] + (1,), generator=g, dtype=torch.float64) * -4)  # rows differ
    flat = y.view(-1)
    for _ in range(draw(st.integers(0, 3))):
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([1.0, -1.0])) * MAX[dtype]
    if draw(st.booleans()):  # an offset: asymmetric zero points far from 0
        y = y + draw(st.sampled_from([1.0, -1.0])) * 10.0 ** draw(st.floats(0.0, top))
    return q, y.clamp(-MAX[dtype], MAX[dtype]).to(dtype)


def _grid(x, scale, zero, q):
    """Each element's representable interval [lo, hi] (module docstring, "Saturation"), fp64, [.., T, D]."""
    T, D = x.shape[-2:]
    s = _expand(scale, q, T, D).double()
    if q.is_fp8:
        return -Q.FP8_MAX[q.format] * s, Q.FP8_MAX[q.format] * s
    if q.symmetric:
        qs = 2 ** (q.bits - 1) - 1
        return -qs * s, qs * s
    z = _expand(zero, q, T, D).double()
    if q.scale_dtype == "fp8_e4m3":  # x^ = (code - zero) * scale, zero an int8
        return -z * s, (2 ** q.bits - 1 - z) * s
    return z, z + (2 ** q.bits - 1) * s


@profiles.KERNEL
@given(huge_cases())
def test_finite_in_finite_out_up_to_the_dtype_max(case):
    """fp16 scales (and fp32 ones near 3e38) overflowed to inf and the group came back NaN or 0.
    Now scales and zero points saturate (quant.limits): everything stored and dequantized is finite, in fp32
    and in the input dtype, and each element comes back within half a step (fp8: its relative error) of its
    value clipped to the group's grid; elements inside the grid are exactly those ``clipped`` does not flag."""
    q, x = case
    codes, scale, zero = Q.quantize(x, q)
    assert torch.isfinite(scale.float()).all() and (zero is None or torch.isfinite(zero.float()).all())
    zmax, smax = Q.limits(q)
    assert scale.float().max() <= smax and (zero is None or zero.float().abs().max() <= zmax)
    xh = Q.dequantize(codes, scale, zero, q)
    assert torch.isfinite(xh).all()
    assert torch.isfinite(Q.dequantize(codes, scale, zero, q, x.dtype)).all()
    lo, hi = _grid(x, scale, zero, q)
    xd = x.double()
    target = torch.minimum(torch.maximum(xd, lo), hi)
    err = (xh.double() - target).abs()
    T, D = x.shape[-2:]
    s = _expand(scale, q, T, D).double()
    if q.is_fp8:
        m = FP8_MANTISSA[q.format]
        bound = 2.0 ** -(m + 1) * target.abs() + FP8_SUBNORMAL[q.format] / 2 * s
    else:
        bound = s / 2
    bound = bound + EPS32 * (hi.abs() + lo.abs() + target.abs())  # fp32 rounding of the code and of x^
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()} for {q}"
    clipped = Q.clipped(x, q)
    half = {"fp8_e4m3": 16.0, "fp8_e5m2": 4096.0}.get(q.format, 0.5) * s  # half the grid's last step
    outside = (xd < lo - half * (1 + 1e-6)) | (xd > hi + half * (1 + 1e-6))
    assert not (outside & ~clipped).any()  # every element saturation moved is counted


@given(quant_and_tensor())
def test_groups_that_fit_are_never_clipped(case):
    """Ordinary magnitudes: saturation changes nothing (no element clipped, the same grid as before)."""
    q, x = case
    assert not Q.clipped(x, q).any()


@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS)
@pytest.mark.parametrize("sdt", SCALE_DTYPES)
def test_clipped_counts_the_saturated_elements(fmt, sdt):
    """A key of 1e10 (beyond every fp16-scaled grid) or 3e38 (beyond every fp32-scaled one) does not fit: its
    group saturates, its reconstruction is finite, ``clipped`` counts what moved, and the next group (which
    fits) is untouched."""
    q = Quant(fmt, "token", 8, True if fmt.startswith("fp8") else False, sdt)
    big = 3e38 if sdt == "float32" else 1e10
    x = torch.zeros(1, 2, 8)
    x[0, 0, :4] = torch.tensor([-big, big, 1.0, 2.0])
    x[0, 1] = torch.linspace(-1, 1, 8)
    xh = Q.dequantize(*Q.quantize(x, q), q)
    assert torch.isfinite(xh).all()
    n = Q.clipped(x, q)
    assert n[0, 1].sum() == 0 and n[0, 0].sum() >= 1


@pytest.mark.parametrize("fmt,sym", FORMATS_SYM)
@pytest.mark.parametrize("axis,group", [("token", None), ("token", 4), ("channel", 4)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("sdt", ["float16", "fp8_e4m3"])
def test_non_finite_poisons_exactly_its_group(fmt, sym, axis, group, bad, sdt):
    """A group holding NaN or +-inf stores NaN scale (and zero point) and codes 0, so the whole
    group -- and nothing else -- dequantizes to NaN; every other group is exactly what it is without it.
    Placed at a group's first and last element and inside. (Before, fp8's amax over a NaN made the scale NaN
    or ignored it depending on the kernel, and an inf made int scales inf.)"""
    q = Quant(fmt, axis, group, sym, sdt)
    T, D = 8, 16
    for t, d in ((0, 0), (T - 1, D - 1), (3, 4)):
        x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(t))
        x[0, t, d] = bad
        codes, scale, zero = Q.quantize(x, q)
        xh = Q.dequantize(codes, scale, zero, q)
        grp = torch.zeros(1, T, D, dtype=torch.bool)
        if axis == "token":
            g = q.group_for(D)
            grp[0, t, (d // g) * g:(d // g + 1) * g] = True
        else:
            grp[0, (t // group) * group:(t // group + 1) * group, d] = True
        assert torch.equal(xh.isnan(), grp)
        assert (codes[grp] == 0).all() and scale.isnan().sum() == 1
        if zero is not None and sdt == "fp8_e4m3":  # an int8 zero point: 0, the NaN scale marks the group
            assert (zero[scale.isnan()] == 0).all()
        else:
            assert zero is None or zero.isnan().sum() == 1
        clean = x.clone()
        clean[grp] = 0.0  # the other groups are exactly what they are without the bad one
        c2, s2, z2 = Q.quantize(clean, q)
        assert torch.equal(xh[~grp], Q.dequantize(c2, s2, z2, q)[~grp])


def test_saturate_clamps_finite_values_only():
    x = torch.tensor([1e6, -1e6, 65520.0, 1.5, float("inf"), -float("inf"), float("nan")])
    y = Q.saturate(x, torch.float16)
    assert y[:4].tolist() == [65504.0, -65504.0, 65504.0, 1.5]
    assert y[4] == float("inf") and y[5] == -float("inf") and y[6].isnan()


# --------------------------------------------------------------------------- fp8 with one fixed scale
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fixed_scale_fp8_is_vllms_fp8_cast(fmt, dtype):
    """axis="tensor": each element is the format's nearest value, saturating, with no scale stored -- what vLLM's
    fp8 cache stores without checkpoint scales (``x / 1.0`` clamped and cast), written here as vLLM writes it,
    over values from the subnormal range to beyond the format's largest."""
    q = Quant(fmt, "tensor")
    F = Q.FP8_MAX[fmt]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 64, generator=g) * torch.logspace(-12, 6, 17, base=2.0)[:, None]
    big = min(F * 3, torch.finfo(dtype).max)  # beyond the format's largest, within the model dtype's
    x[0, 0, :4] = torch.tensor([big, -big, F, -0.0])
    x = x.to(dtype)
    codes, scale, zero = Q.quantize(x, q)
    vllm = x.float().clamp(-F, F).to(Q.FP8_DTYPES[fmt]).view(torch.uint8)
    assert torch.equal(codes, vllm) and zero is None
    assert scale.shape == (3, 17, 1) and (scale == 1).all()  # quantize's scale; a store keeps none
    xh = Q.dequantize(codes, scale, zero, q)
    assert torch.equal(xh, vllm.view(Q.FP8_DTYPES[fmt]).float())
    assert torch.equal(Q.clipped(x, q), x.float().abs() > F + {"fp8_e4m3": 16.0, "fp8_e5m2": 4096.0}[fmt])


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fixed_scale_fp8_poisons_exactly_its_token_head(fmt, bad):
    """With no scale to mark, a token-head holding NaN or +-inf stores the NaN code in every channel and reads NaN
    there, and nowhere else; finite values never encode to that code (they saturate)."""
    q = Quant(fmt, "tensor")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)) * 1e6
    x[1, 3, 7] = bad
    codes, scale, zero = Q.quantize(x, q)
    xh = Q.dequantize(codes, scale, zero, q)
    head = torch.zeros_like(xh, dtype=torch.bool)
    head[1, 3] = True
    assert torch.equal(xh.isnan(), head) and (codes[head] == Q.FP8_NAN).all()
    assert not (codes[~head] & 0x7F == 0x7F).any()


def test_fixed_scale_is_refused_where_it_cannot_mean_anything():
    from kvcompile.errors import PolicyError
    for kw, said in [(dict(format="int8"), "fp8 formats only"), (dict(group=16), "leave group None"),
                     (dict(scale_dtype="fp8_e4m3"), "stores no scale"), (dict(symmetric=False), "symmetric")]:
        with pytest.raises(PolicyError, match=said):
            Quant(**{"format": "fp8_e4m3", "axis": "tensor", **kw})
    assert Quant("fp8_e4m3", "tensor").key() == "fp8_e4m3.tensor" and not Quant("fp8_e5m2", "tensor").stores_scale
