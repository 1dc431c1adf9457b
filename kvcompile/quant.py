"""Reference numerics: quantize, dequantize and bit packing, in pure torch.

This module is the specification. Every Triton kernel in ``kvcompile.templates`` must produce the same
codes, scales and zero points bit for bit, so each step below is written as the exact fp32 operation a
kernel performs:

Integer, asymmetric (``b`` bits, ``Q = 2**b - 1``), per group of elements::

    zero  = fp16_round_down(min(x))                     # stored zero point (the group's minimum)
    scale = fp16_round_up((max(x) - zero) / Q)          # stored step; 0 for a constant group
    code  = clamp(round_half_even((x - zero) / scale'), 0, Q)    with scale' = scale or 1
    x^    = code * scale + zero

Integer, symmetric (``q = 2**(b-1) - 1``)::

    scale = fp16_round_up(absmax(x) / q)
    code  = clamp(round_half_even(x / scale'), -q, q) + 2**(b-1)   # stored unsigned
    x^    = (code - 2**(b-1)) * scale

fp8 (``F`` = 448 for e4m3, 57344 for e5m2; always symmetric)::

    scale = fp16_round_up(absmax(x) / F)
    code  = bits of fp8_round_half_even(x / scale')       # |x / scale| <= F by construction
    x^    = float(code) * scale

fp8 with one fixed scale (``axis="tensor"``: vLLM's fp8 cache without checkpoint scales; no scale is stored)::

    code  = bits of fp8_round_half_even(clamp(x, -F, F))
    x^    = float(code)

**fp8 scales** (``scale_dtype="fp8_e4m3"``: one byte per scale, an int8 zero point; ``E = 448``, the largest
e4m3 value). The scale is rounded up to fp8 e4m3 and the zero point is an integer, so that a group costs 16 bits
(8 for symmetric and fp8 formats) instead of 32::

    asymmetric:  scale = e4m3_round_up(clamp(max((max(x) - min(x)) / Q, |min(x)| / 127), 0, E))
                 zero  = clamp(round_half_even(-min(x) / scale'), -128, 127)             # int8
                 code  = clamp(round_half_even(x / scale') + zero, 0, Q)
                 x^    = (code - zero) * scale
    symmetric:   scale = e4m3_round_up(clamp(absmax(x) / q, 0, E))          (codes as above)
    fp8:         scale = e4m3_round_up(clamp(absmax(x) / F, 0, E))          (codes as above)

The ``|min| / 127`` term keeps the zero point inside int8 (a group far from 0 relative to its range, such as a
key channel's offset, gets a coarser step rather than clipping), so every element of a group that fits comes
back within half a step, as below; ``(code - zero) * scale`` is exact in fp32 (a 9-bit integer times a 4-bit
significand), so every kernel form of it gives the same bits. A constant group comes back within half a step,
not exactly; an all-zero group exactly. A group *fits* when its scale needs no clamp (``<= E``: e.g. int4 any
group of range at most 15 * 448 and minimum within +-127 * 448); beyond, it saturates and clips as below.

Rounding the zero point down and the scale up (to the scale dtype) guarantees ``x`` lies inside the
representable range whenever the group fits the scale dtype (below), so codes never clip and every element
comes back within half a step of the stored scale (fp8: within the format's relative error). All-zero groups
come back exactly in every format, never NaN or Inf (a zero scale divides by 1). Constant groups come back
exactly with a zero point (asymmetric integers store scale 0 and zero = c), when ``c`` is representable in
the scale dtype: every fp16 value, every bf16 value of normal fp16 magnitude; ``scale_dtype="float32"``
makes every fp32 constant up to 2**127 exact. A symmetric grid has no point exactly at an arbitrary ``c``, so
there a constant is within the format's bound.

**Saturation (finite in, finite out).** Zero points and scales are clamped before they are rounded::

    zero  = round_down(clamp(min(x), -ZMAX, ZMAX))
    scale = round_up(clamp((max(x) - zero) / Q, 0, SMAX))      (symmetric / fp8: clamp(absmax(x) / q, 0, SMAX))
    fp8:  code = bits of fp8_round_half_even(clamp(x / scale', -F, F))

with ``limits(q) = (ZMAX, SMAX)``: 65504 and 65504 for fp16 scales (the largest fp16); for fp32 scales
``ZMAX = 2**127`` and ``SMAX = 2**(127 - k)``, ``k`` = the integer bits, 9 for e4m3 (448 < 2**9), 16 for e5m2
(57344 < 2**16), so that ``code * scale + zero`` can never overflow fp32. A group *fits* when the clamps
change nothing: ``|min| <= ZMAX`` and ``(max - min) / Q <= SMAX`` (asymmetric), ``absmax / q <= SMAX``
(symmetric), ``absmax / F <= SMAX`` (fp8) -- with fp16 scales e.g. int8 asymmetric holds any group whose
minimum is within +-65504 and range at most 255 * 65504, int4 symmetric any with ``absmax <= 7 * 65504``, fp8
e4m3 any with ``absmax <= 448 * 65504``; with fp32 scales every group within +-2**125 (4.2e37) fits. A group that fits
gets exactly the codes it got before saturation existed (ordinary inputs do not move). Beyond, the group's
grid is the widest the scale dtype holds and elements outside it clip to its nearest end: every finite element
``x`` comes back within half a step (fp8: the format's relative error) of ``clip(x, lo, hi)``, where
``[lo, hi]`` is ``[zero, zero + Q*scale]`` (asymmetric; with fp8 scales ``[-zero*scale, (Q-zero)*scale]``),
``[-q*scale, q*scale]`` (symmetric) or ``[-F*scale, F*scale]`` (fp8) -- e.g. an int8 asymmetric group with
fp16 scales and minimum -1e6 stores zero = -65504 and clips its elements below that to -65504.
``clipped(x, q)`` says which elements clip. Every stored scale, zero point and dequantized value of a finite
input is finite; ``dequantize`` to a narrower dtype saturates the same way (``saturate``: a finite value beyond
the dtype's range becomes its largest finite value, never inf).

**Non-finite input (NaN, +-inf).** It is never hidden, and it spreads to its group and no further: a group
holding any NaN or +-inf is *poisoned* -- its scale (and zero point) is NaN and all its codes are 0, so
every element of the group dequantizes to NaN, in every format. Per token (axis="token") that is the
token's ``group`` channels (the whole head for ``group=None``); per channel (axis="channel", KIVI keys) one
channel of ``group`` consecutive tokens. Every other group is exactly what it would be without it. (fp8
could mark the element alone with its NaN code, but e4m3fn's NaN code needs a select in every kernel's
decode -- 7% of the CPU decode kernel's time -- where a NaN scale costs nothing.) With one fixed scale
(axis="tensor") there is no scale to mark: a token-head holding NaN or +-inf stores the NaN code (0x7F, in both
fp8 formats) as every one of its codes, and the kernels of that format decode it to NaN. A finite input never
produces a NaN scale or zero point.

Packing: the codes of one row (one token of one head) form a little-endian bit stream: code ``i`` occupies
bits ``[i*b, (i+1)*b)``. So int8 is one code per byte, int4 two per byte (low nibble first), int2 four per
byte, and int3 packs eight codes into three bytes -- 3 bits per element, no padding.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .policy import Quant
from .errors import ArgumentError

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_NAN = 0x7F  # a NaN code in both fp8 formats: a poisoned token-head's codes with a fixed scale (axis="tensor")
SCALE_TORCH_DTYPE = {"float16": torch.float16, "float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
E4M3_MAX = 448.0
INT_ZERO = (-128, 127)  # the zero point's range with fp8 scales (int8)
F16_MAX = 65504.0


def zero_dtype(q: Quant) -> torch.dtype:
    """The stored zero point's dtype: the scale's, or int8 with fp8 scales."""
    return torch.int8 if q.zero_counts_steps else SCALE_TORCH_DTYPE[q.scale_dtype]


def limits(q: Quant) -> tuple[float, float]:
    """``(ZMAX, SMAX)``: the largest zero point magnitude and the largest scale ``quantize`` stores (see the
    module docstring). fp16 scales: the largest fp16 for both. fp32 scales: powers of two such that ``|code *
    scale + zero| < 2**128`` for every code, so dequantization never overflows fp32."""
    if q.scale_dtype == "float16":
        return F16_MAX, F16_MAX
    if q.scale_dtype == "fp8_e4m3":  # the zero point is an int8 (``INT_ZERO``); no ZMAX applies
        return float(-INT_ZERO[0]), E4M3_MAX
    k = {"fp8_e4m3": 9, "fp8_e5m2": 16}.get(q.format, q.bits)
    return 2.0 ** 127, 2.0 ** (127 - k)


def saturate(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, with finite values beyond ``dtype``'s range clamped to its largest finite value (a plain
    cast rounds them to inf); NaN and +-inf pass through unchanged."""
    if x.dtype == dtype or not dtype.is_floating_point:
        return x.to(dtype)
    hi = torch.finfo(dtype).max
    if x.dtype.is_floating_point and torch.finfo(x.dtype).max <= hi:
        return x.to(dtype)
    return torch.where(torch.isfinite(x), x.clamp(-hi, hi), x).to(dtype)


# --------------------------------------------------------------------------- directed rounding
def round_to_dtype(x: Tensor, dtype: torch.dtype, direction: str) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` towards -inf ("down") or +inf ("up"); fp32 passes through. fp8 e4m3: up
    only, for ``0 <= x <= 448`` (a scale)."""
    if dtype == torch.float32:
        return x
    if dtype == torch.float8_e4m3fn:
        assert direction == "up"
        y = x.to(dtype)
        bits = y.view(torch.uint8)
        return torch.where(y.float() < x, bits + 1, bits).view(dtype)  # next e4m3 up: the next code
    y = x.to(dtype)
    yf = y.float()
    if direction == "down":
        bad = yf > x
        return torch.where(bad, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)
    bad = yf < x
    return torch.where(bad, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


# --------------------------------------------------------------------------- grouping
def _to_groups(x: Tensor, q: Quant) -> tuple[Tensor, int]:
    """View ``x [..., T, D]`` as ``[..., n_groups..., elems]`` with the reduction over the last dim.

    axis="token":   [..., T, D/g, g]        -> scale [..., T, D/g]
    axis="channel": [..., T/g, D, g]        -> scale [..., T/g, D]   (T must be a multiple of g)
    """
    *lead, T, D = x.shape
    if q.axis != "channel":  # token, or tensor (a fixed scale: groups of the whole head, for poisoning)
        g = q.group_for(D)
        return x.reshape(*lead, T, D // g, g), g
    g = q.group
    if T % g:
        raise ArgumentError(f"per-channel quantization needs whole token groups: got {T} tokens, group {g}")
    return x.reshape(*lead, T // g, g, D).transpose(-1, -2), g


def _from_groups(y: Tensor, q: Quant, T: int, D: int) -> Tensor:
    if q.axis != "channel":
        return y.reshape(*y.shape[:-2], D)
    return y.transpose(-1, -2).flatten(-3, -2)


def scale_shape(q: Quant, T: int, D: int) -> tuple[int, int]:
    """Shape of the scale (and zero point) tensor for ``T`` tokens of ``D`` channels, trailing dims (axis="tensor":
    ``quantize``'s scale of ones, one a token-head, which the store does not keep)."""
    if q.axis != "channel":
        return (T, D // q.group_for(D))
    return (T // q.group, D)


# --------------------------------------------------------------------------- quantize / dequantize
def quantize(x: Tensor, q: Quant) -> tuple[Tensor, Tensor, Tensor | None]:
    """Quantize ``x [..., T, D]`` (any float dtype) to ``(codes, scale, zero)``.

    codes: uint8 [..., T, D] (one unpacked code per element; ``pack`` makes the stored layout)
    scale: q.scale_dtype [..., *scale_shape] (axis="tensor": float32 ones, the fixed scale, not stored)
    zero:  ``zero_dtype(q)`` [..., *scale_shape] for asymmetric integers, else None
    Saturating, and poisoning groups that hold NaN or +-inf: module docstring.
    """
    if not q.quantized:
        raise ArgumentError("quantize() called with format 'none'")
    T, D = x.shape[-2:]
    xg, _ = _to_groups(x.float(), q)
    sdt = SCALE_TORCH_DTYPE[q.scale_dtype]
    zmax, smax = limits(q)
    poisoned = ~torch.isfinite(xg).all(-1)  # groups holding NaN or +-inf
    nan = torch.full((), float("nan"), dtype=sdt)
    if q.axis == "tensor":  # one fixed scale, 1.0: the nearest fp8 value, saturating; a poisoned head all NaN codes
        fmax = FP8_MAX[q.format]
        codes = xg.clamp(-fmax, fmax).to(FP8_DTYPES[q.format]).view(torch.uint8)
        codes = codes.masked_fill(poisoned.unsqueeze(-1), FP8_NAN)
        return _from_groups(codes, q, T, D), torch.ones(xg.shape[:-1], dtype=torch.float32, device=x.device), None
    if q.is_fp8:
        fmax = FP8_MAX[q.format]
        scale = round_to_dtype((xg.abs().amax(-1) / fmax).clamp(max=smax), sdt, "up")
        s = scale.float().unsqueeze(-1)
        y = (xg / torch.where(s == 0, torch.ones_like(s), s)).clamp(-fmax, fmax)
        y = torch.where(poisoned.unsqueeze(-1), 0.0, y)  # a poisoned group's codes are 0
        codes = y.to(FP8_DTYPES[q.format]).view(torch.uint8)
        return _from_groups(codes, q, T, D), torch.where(poisoned, nan, scale), None
    if q.symmetric:
        qmax = 2 ** (q.bits - 1) - 1
        scale = round_to_dtype((xg.abs().amax(-1) / qmax).clamp(max=smax), sdt, "up")
        s = scale.float().unsqueeze(-1)
        y = torch.round(xg / torch.where(s == 0, torch.ones_like(s), s)).clamp(-qmax, qmax) + 2 ** (q.bits - 1)
        zero = None
    elif q.zero_counts_steps:
        Q = 2 ** q.bits - 1
        lo = xg.amin(-1)
        need = torch.maximum((xg.amax(-1) - lo) / Q, lo.abs() / INT_ZERO[1])
        scale = round_to_dtype(need.clamp(0, smax), sdt, "up")
        s = scale.float().unsqueeze(-1)
        s1 = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.round(-lo.unsqueeze(-1) / s1).clamp(*INT_ZERO)
        y = (torch.round(xg / s1) + z).clamp(0, Q)
        zero = torch.where(poisoned, 0, z.squeeze(-1)).to(torch.int8)  # the NaN scale alone marks the group
    else:
        Q = 2 ** q.bits - 1
        zero = round_to_dtype(xg.amin(-1).clamp(-zmax, zmax), sdt, "down")
        z = zero.float().unsqueeze(-1)
        scale = round_to_dtype(((xg.amax(-1) - zero.float()) / Q).clamp(0, smax), sdt, "up")
        s = scale.float().unsqueeze(-1)
        y = torch.round((xg - z) / torch.where(s == 0, torch.ones_like(s), s)).clamp(0, Q)
        zero = torch.where(poisoned, nan, zero)
    codes = torch.where(poisoned.unsqueeze(-1), 0.0, y).to(torch.uint8)
    scale = torch.where(poisoned, nan, scale)
    return _from_groups(codes, q, T, D), scale, zero


def clipped(x: Tensor, q: Quant) -> Tensor:
    """bool [..., T, D]: the finite elements ``quantize`` clips -- those outside their group's grid because
    the group does not fit the scale dtype (module docstring, "Saturation"). All False for a group that
    fits; this is how many inputs saturation changed, for diagnostics (``int(clipped(x, q).sum())``)."""
    T, D = x.shape[-2:]
    _, scale, zero = quantize(x, q)
    xg, _ = _to_groups(x.float(), q)
    s = scale.float().unsqueeze(-1)
    s1 = torch.where(s == 0, torch.ones_like(s), s)
    if q.is_fp8:  # beyond F plus half the top spacing (16 for e4m3, 4096 for e5m2): F would not be nearest
        out = (xg / s1).abs() > FP8_MAX[q.format] + {"fp8_e4m3": 16.0, "fp8_e5m2": 4096.0}[q.format]
    elif q.symmetric:
        qmax = 2 ** (q.bits - 1) - 1
        out = torch.round(xg / s1).abs() > qmax
    elif q.zero_counts_steps:
        y = torch.round(xg / s1) + zero.float().unsqueeze(-1)
        out = (y < 0) | (y > 2 ** q.bits - 1)
    else:
        y = torch.round((xg - zero.float().unsqueeze(-1)) / s1)
        out = (y < 0) | (y > 2 ** q.bits - 1)
    out = out & torch.isfinite(xg) & torch.isfinite(s)
    return _from_groups(out, q, T, D)


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor | None, q: Quant, dtype=torch.float32) -> Tensor:
    """Inverse of ``quantize``: unpacked ``codes [..., T, D]`` -> ``x^ [..., T, D]`` in ``dtype``."""
    T, D = codes.shape[-2:]
    cg, _ = _to_groups(codes, q)
    s = scale.float().unsqueeze(-1)
    if q.is_fp8:
        y = cg.contiguous().view(FP8_DTYPES[q.format]).float() * s
    elif q.symmetric:
        y = (cg.float() - 2 ** (q.bits - 1)) * s
    elif q.zero_counts_steps:
        y = (cg.float() - zero.float().unsqueeze(-1)) * s
    else:
        y = cg.float() * s + zero.float().unsqueeze(-1)
    return saturate(_from_groups(y, q, T, D), dtype)


def step_size(scale: Tensor, q: Quant) -> Tensor:
    """Largest round-trip error allowed per group: half a step for integers; fp8 is relative (see tests)."""
    return scale.float() / 2


# --------------------------------------------------------------------------- packing
def packed_bytes(D: int, bits: int) -> int:
    """Bytes one row of ``D`` codes takes when packed."""
    assert (D * bits) % 8 == 0, (D, bits)
    return D * bits // 8


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) -> packed uint8 ``[..., D*bits/8]``, little-endian bit stream."""
    if bits == 8:
        return codes.contiguous()
    D = codes.shape[-1]
    per = 8 if bits == 3 else 8 // bits  # codes per whole-byte unit
    nbytes = per * bits // 8
    c = codes.reshape(*codes.shape[:-1], D // per, per).to(torch.int32)
    word = torch.zeros(c.shape[:-1], dtype=torch.int32, device=codes.device)
    for i in range(per):
        word |= c[..., i] << (bits * i)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], dim=-1)
    return out.reshape(*codes.shape[:-1], D * bits // 8).to(torch.uint8)


def unpack(packed: Tensor, bits: int, D: int) -> Tensor:
    """Inverse of ``pack``: packed uint8 ``[..., D*bits/8]`` -> codes uint8 ``[..., D]``."""
    if bits == 8:
        return packed.contiguous()
    per = 8 if bits == 3 else 8 // bits
    nbytes = per * bits // 8
    p = packed.reshape(*packed.shape[:-1], D // per, nbytes).to(torch.int32)
    word = torch.zeros(p.shape[:-1], dtype=torch.int32, device=packed.device)
    for j in range(nbytes):
        word |= p[..., j] << (8 * j)
    mask = (1 << bits) - 1
    out = torch.stack([(word >> (bits * i)) & mask for i in range(per)], dim=-1)
    return out.reshape(*packed.shape[:-1], D).to(torch.uint8)
