"""Quantize-on-write: append a chunk of new keys/values to one layer's packed store.

Reference: ``kvcompile.store.store_reference`` (where each position goes) and ``kvcompile.quant.quantize`` /
``pack`` (how a group becomes codes, scale and zero point). The kernels here must reproduce them bit for bit:
codes, scales, zero points, sinks, lengths and the live ring slots.

An append of ``n`` tokens to a sequence holding ``L`` runs three launches plus one torch op:

1. ``_flush_kernel`` (keys), 2. ``_flush_kernel`` (values): quantize positions ``[Q(L), Q(L+n))`` -- read from
   the residual ring (``p < L``) or the chunk (``p >= L``) -- into packed codes and scales, in the blocks the
   sequence's block table names (packed index ``j = p - S``: block ``table[b, j // BS]``, row ``j % BS``);
3. ``_copy_kernel``: write the chunk's sinks (``p < S``) and the newcomers that stay in full precision into
   the ring at ``p % W``;
4. ``lengths += n`` (a device op: no host synchronisation).

A token whose block is not reserved is never written: the flush kernels raise a device flag instead, which
the launcher checks (``launch.store``).

The flush must finish before the ring is overwritten -- a long chunk's newcomers land on the ring slots the
flush reads -- which launch order on one stream guarantees. Grids come from static shapes only (the most
tokens an ``n``-token append can flush is ``ceil(n/F)*F``); each program reads ``lengths`` on the device and
exits early when it has nothing to do, so a decode step is CUDA-graph capturable.

Numerics, step for step as ``quant.quantize`` (all fp32, IEEE-exact on GPU and in the interpreter; saturating
at ``quant.limits``; a group holding NaN or inf poisoned: NaN scale, codes 0 -- or, with one fixed scale that is
not stored (fp8, axis="tensor": ``common.scale_code`` 3), every code of its token-head 0x7F, fp8's NaN):
division by ``tl.math.div_rn`` (correctly rounded; plain ``/`` is approximate on NVIDIA GPUs); round half to
even by adding and subtracting 1.5 * 2**23; fp16 directed rounding by correcting the round-to-nearest result one
step through its int16 bit pattern; fp8 codes by integer arithmetic that replicates c10's
``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value`` (the interpreter's fp8 cast is wrong near binade
boundaries).
"""
# No `from __future__ import annotations`: Triton reads `tl.constexpr` annotations as objects, not strings.
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.policy import Quant
from kvcompile.store import KVState, LayerSpec

from .common import run, scale_code

# 1.5 * 2**23: adding it to |y| < 2**22 leaves round_half_even(y) in the low bits (fp32 has 23 mantissa bits).
_RNE_MAGIC = tl.constexpr(12582912.0)


# --------------------------------------------------------------------------- numerics helpers
@triton.jit
def _rne(y):
    """round_half_even(y) for |y| < 2**22, exact, as torch.round."""
    return (y + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _round_scale(x, UP: tl.constexpr, F16: tl.constexpr):
    """fp32 ``x`` -> the scale dtype, rounded towards +inf (UP) or -inf; ``quant.round_to_dtype``.

    Returns fp16 when ``F16`` else fp32 unchanged.
    """
    if F16:
        y = x.to(tl.float16, fp_downcast_rounding="rtne")
        yf = y.to(tl.float32)
        bits = y.to(tl.int16, bitcast=True).to(tl.int32)
        neg = bits < 0  # sign bit set (negative or -0): its magnitude grows as the int16 pattern grows
        if UP:
            bad = yf < x
            step = tl.where(neg, -1, 1)
        else:
            bad = yf > x
            step = tl.where(neg, 1, -1)
        bits = tl.where(bad, bits + step, bits)
        return bits.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return x


@triton.jit
def _shr_rne(m, s):
    """round_half_even(m / 2**s) for non-negative int32 ``m`` and 1 <= s <= 30."""
    q = m >> s
    rem = m - (q << s)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _fp8_encode(y, E4M3: tl.constexpr):
    """The fp8 bit pattern (int32 in [0, 256)) of fp32 ``y`` rounded half to even, as torch's cast.

    e4m3fn: |y| >= 480 -> NaN (0x7F), |y| < 2**-6 -> subnormal; e5m2: |y| >= 65536 -> inf (NaN stays NaN),
    |y| < 2**-14 -> subnormal. Integer-only, so it is exact wherever it runs.
    """
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if E4M3:
        M: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        SAT_BITS: tl.constexpr = 0x43F00000  # 480.0
    else:
        M: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        SAT_BITS: tl.constexpr = 0x47800000  # 65536.0
    SHIFT: tl.constexpr = 23 - M
    MIN_NORMAL_BITS: tl.constexpr = (127 + 1 - BIAS) << 23
    # normal: drop 23-M mantissa bits with RNE, then rebias the exponent (a mantissa carry bumps it)
    normal = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1) - ((127 - BIAS) << 23)) >> SHIFT
    # subnormal: |y| / smallest_subnormal rounded half to even; that is m * 2**(e - 150 + BIAS - 1 + M)
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    s = tl.minimum((150 - (BIAS - 1 + M)) - tl.maximum(e, 1), 25)  # m < 2**24: a shift of 25 gives 0
    sub = _shr_rne(m, s)
    if E4M3:
        sat = tl.full(a.shape, 0x7F, tl.int32)
    else:
        sat = tl.where(a > 0x7F800000, 0x7F, 0x7C)
    code = tl.where(a >= SAT_BITS, sat, tl.where(a < MIN_NORMAL_BITS, sub, normal))
    return code | sign


@triton.jit
def _e4m3_value(bits):
    """The fp32 value of e4m3 bit patterns ``bits`` (int32, positive, not NaN), by integer arithmetic."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9


@triton.jit
def _scale_up(x, SFMT: tl.constexpr):
    """fp32 ``x >= 0`` rounded up to the scale dtype (``quant.round_to_dtype``): (what is stored, its fp32
    value). SFMT 0 fp16, 1 fp32, 2 fp8 e4m3 (stored as its int32 bit pattern, ``x <= 448``): RNE, then the
    next code up where that went down."""
    if SFMT == 2:
        bits = _fp8_encode(x, True)
        bits = tl.where(_e4m3_value(bits) < x, bits + 1, bits)
        return bits, _e4m3_value(bits)
    elif SFMT == 0:
        y = _round_scale(x, True, True)
        return y, y.to(tl.float32)
    else:
        return x, x


@triton.jit
def _nan_scale(like, SFMT: tl.constexpr):
    """torch's NaN (``float('nan')``) in the scale dtype, shaped like ``like``: fixed bits (0x7E00 as fp16,
    0x7FC00000 as fp32, 0x7F as e4m3), not whatever NaN a conversion on the device would produce."""
    if SFMT == 0:
        return tl.full(like.shape, 0x7E00, tl.int16).to(tl.float16, bitcast=True)
    elif SFMT == 2:
        return tl.full(like.shape, 0x7F, tl.int32)
    else:
        return tl.full(like.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, valid, AXIS: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr,
              SFMT: tl.constexpr, ZMAX: tl.constexpr, SMAX: tl.constexpr):
    """Quantize fp32 ``x`` in groups reduced over ``AXIS``; ``quant.quantize`` for one tile.

    KIND: 0 asymmetric integer, 1 symmetric integer, 2 fp8. ``valid`` masks padding out of the reductions.
    ZMAX, SMAX: ``quant.limits`` (the zero point and the scale saturate there). Statistics are taken over the
    finite elements only (min/max never see a NaN); a group holding a NaN or +-inf is poisoned (NaN scale and
    zero point, codes 0). Clamps are written as selects that keep -0.0, as torch.clamp does.
    SFMT: the scale dtype, 0 fp16, 1 fp32, 2 fp8 e4m3 (scales returned as int32 bit patterns, zero points as
    int32 counts of steps, each stored through a byte pointer), 3 none (fp8 only, KIND 2: one fixed scale, 1.0,
    not stored -- ``x`` clamped to the format's largest and encoded; a poisoned group's codes are all 0x7F,
    ``quant.FP8_NAN``; the scale returned is 1.0, for the caller not to store).
    Returns (codes int32 like ``x``, scale [reduced] in the scale dtype, zero [reduced] or the scale again).
    """
    fin = tl.abs(x) < float("inf")  # False for NaN
    xs = tl.where(fin, x, 0.0)
    if KIND == 0:
        QMAX: tl.constexpr = (1 << BITS) - 1
        bad = tl.max(tl.where(valid & ~fin, 1, 0), axis=AXIS) > 0
        mn = tl.min(tl.where(valid, xs, float("inf")), axis=AXIS)
        mx = tl.max(tl.where(valid, xs, float("-inf")), axis=AXIS)
        mn = tl.where(mn == float("inf"), 0.0, mn)  # a group that is all padding
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        if SFMT == 2:  # an fp8 scale that also keeps -min / scale in int8, and that int8 zero point
            r = tl.math.div_rn(mx - mn, float(QMAX))
            a = tl.math.div_rn(tl.abs(mn), 127.0)
            r = tl.where(a > r, a, r)
            r = tl.where(r > SMAX, SMAX, r)
            scale, sf = _scale_up(r, SFMT)
            sf = tl.where(sf == 0.0, 1.0, sf)
            z = _rne(tl.math.div_rn(-mn, sf))
            z = tl.minimum(tl.maximum(z, -128.0), 127.0)
            y = _rne(tl.math.div_rn(x, tl.expand_dims(sf, AXIS))) + tl.expand_dims(z, AXIS)
            y = tl.minimum(tl.maximum(y, 0.0), float(QMAX))
            y = tl.where(tl.expand_dims(bad, AXIS), 0.0, y)  # a poisoned group's codes are 0
            return y.to(tl.int32), tl.where(bad, _nan_scale(scale, SFMT), scale), tl.where(bad, 0, z.to(tl.int32))
        else:  # (an else, not the code after the return: Triton compiles both and refuses unequal return types)
            mn = tl.where(mn < -ZMAX, -ZMAX, mn)
            mn = tl.where(mn > ZMAX, ZMAX, mn)
            zero = _round_scale(mn, False, SFMT == 0)
            zf = zero.to(tl.float32)
            r = tl.math.div_rn(mx - zf, float(QMAX))
            r = tl.where(r < 0.0, 0.0, r)
            r = tl.where(r > SMAX, SMAX, r)
            scale, sf = _scale_up(r, SFMT)
            sf = tl.where(sf == 0.0, 1.0, sf)
            y = _rne(tl.math.div_rn(x - tl.expand_dims(zf, AXIS), tl.expand_dims(sf, AXIS)))
            y = tl.minimum(tl.maximum(y, 0.0), float(QMAX))
            y = tl.where(tl.expand_dims(bad, AXIS), 0.0, y)  # a poisoned group's codes are 0
            nan = _nan_scale(scale, SFMT)
            return y.to(tl.int32), tl.where(bad, nan, scale), tl.where(bad, nan, zero)
    elif KIND == 1:
        QS: tl.constexpr = (1 << (BITS - 1)) - 1
        bad = tl.max(tl.where(valid & ~fin, 1, 0), axis=AXIS) > 0
        amax = tl.max(tl.where(valid, tl.abs(xs), 0.0), axis=AXIS)
        r = tl.math.div_rn(amax, float(QS))
        r = tl.where(r > SMAX, SMAX, r)
        scale, sf = _scale_up(r, SFMT)
        sf = tl.where(sf == 0.0, 1.0, sf)
        y = _rne(tl.math.div_rn(x, tl.expand_dims(sf, AXIS)))
        y = tl.minimum(tl.maximum(y, float(-QS)), float(QS)) + (1 << (BITS - 1))
        y = tl.where(tl.expand_dims(bad, AXIS), 0.0, y)  # a poisoned group's codes are 0
        scale = tl.where(bad, _nan_scale(scale, SFMT), scale)
        return y.to(tl.int32), scale, scale
    elif SFMT == 3:  # fp8 with one fixed scale, 1.0, not stored (axis="tensor"): the nearest value, saturating
        if E4M3:
            FMAX: tl.constexpr = 448.0
        else:
            FMAX: tl.constexpr = 57344.0
        bad = tl.max(tl.where(valid & ~fin, 1, 0), axis=AXIS) > 0
        y = tl.where(xs < -FMAX, -FMAX, xs)
        y = tl.where(y > FMAX, FMAX, y)
        codes = tl.where(tl.expand_dims(bad, AXIS), 0x7F, _fp8_encode(y, E4M3))  # a poisoned group: NaN codes
        one = tl.where(bad, 1.0, 1.0)  # the fixed scale (returned for the signature; never stored)
        return codes, one, one
    else:
        if E4M3:
            FMAX: tl.constexpr = 448.0
        else:
            FMAX: tl.constexpr = 57344.0
        bad = tl.max(tl.where(valid & ~fin, 1, 0), axis=AXIS) > 0
        amax = tl.max(tl.where(valid, tl.abs(xs), 0.0), axis=AXIS)
        r = tl.math.div_rn(amax, FMAX)
        r = tl.where(r > SMAX, SMAX, r)
        scale, sf = _scale_up(r, SFMT)
        sf = tl.where(sf == 0.0, 1.0, sf)
        y = tl.math.div_rn(xs, tl.expand_dims(sf, AXIS))
        y = tl.where(y < -FMAX, -FMAX, y)
        y = tl.where(y > FMAX, FMAX, y)
        y = tl.where(tl.expand_dims(bad, AXIS), 0.0, y)  # a poisoned group's codes are 0
        scale = tl.where(bad, _nan_scale(scale, SFMT), scale)
        return _fp8_encode(y, E4M3), scale, scale


@triton.jit
def _store_packed(row_ptr, codes, unit_ok, BITS: tl.constexpr, DB: tl.constexpr, ROWS: tl.constexpr):
    """Pack int32 codes ``[ROWS, DB]`` as ``quant.pack`` and store them; ``row_ptr [ROWS, 1]`` is each row's
    first byte, ``unit_ok [ROWS, DB/PER]`` masks the whole-byte units to write."""
    if BITS == 8:
        PER: tl.constexpr = 1
        NB: tl.constexpr = 1
    elif BITS == 3:
        PER: tl.constexpr = 8
        NB: tl.constexpr = 3
    else:
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = 1
    U: tl.constexpr = DB // PER
    units = tl.arange(0, U)[None, :]
    if PER == 1:
        word = codes
    else:
        shifts = (tl.arange(0, PER) * BITS)[None, None, :]
        word = tl.sum(tl.reshape(codes, (ROWS, U, PER)) << shifts, axis=2)  # disjoint bits: sum == or
    for j in tl.static_range(NB):
        tl.store(row_ptr + units * NB + j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=unit_ok)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _boundary(L, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr):
    """Q(L) = S + floor(max(0, L - S - R) / F) * F (``LayerSpec.boundary``)."""
    return S + (tl.maximum(L - S - R, 0) // F) * F


@triton.jit
def _flush_kernel(
    x_ptr, res_ptr, codes_ptr, scale_ptr, zero_ptr, len_ptr, nnew_ptr, tbl_ptr, err_ptr,
    sx_b, sx_h, sx_t,  # chunk [B, H, n, D] (unit stride along D)
    sr_b, sr_h, sr_t,  # ring [B, H, W, D]
    sc_nb, sc_h, sc_t,  # codes [NB, H, BS, PB] (or [NB, H, BS, D] for "none")
    ss_nb, ss_h, ss_t,  # scale / zero [NB, H, BS, D/g] (token) or [NB, H, BS/g, D] (channel); none for SFMT 3
    st_b, MB, NB,  # block table [B, MB]; blocks in the pool
    H,
    D: tl.constexpr, DB: tl.constexpr, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr, W: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr, SFMT: tl.constexpr, HAS_ZERO: tl.constexpr,
    CHANNEL: tl.constexpr, G: tl.constexpr, GB: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr,
    ZMAX: tl.constexpr, SMAX: tl.constexpr,
):
    """Quantize positions [Q(L), Q(L+n)) of one (sequence, head) into packed storage.

    Program (b*H + h, tile) handles flush tokens [tile*BLOCK_T, (tile+1)*BLOCK_T) counted from Q(L); for
    axis="channel" BLOCK_T == G, one token group (never split across two blocks: BS is a multiple of G). KIND
    3 is format "none": the tokens are copied. Packed index j = p - S goes to block ``table[b, j // BS]``, row
    ``j % BS``; a token whose block is not reserved (-1, past the table, or outside the pool) is not written
    and sets ``err_ptr[0] = 1`` (the launcher turns that into an error).
    """
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(len_ptr + b)
    L2 = L + tl.load(nnew_ptr + b)
    q0 = _boundary(L, S, R, F)
    q1 = _boundary(L2, S, R, F)
    if q0 + tile * BLOCK_T >= q1:
        return
    t = tl.arange(0, BLOCK_T)
    p = q0 + tile * BLOCK_T + t  # absolute positions
    c = tl.arange(0, DB)
    tok_ok = p < q1
    ok = tok_ok[:, None] & (c < D)[None, :]
    from_ring = p < L
    xb = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    rb = res_ptr + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
    WS: tl.constexpr = W if W > 0 else 1
    x_new = tl.load(xb + (p - L)[:, None] * sx_t + c[None, :], mask=ok & ~from_ring[:, None], other=0.0)
    x_old = tl.load(rb + (p % WS)[:, None] * sr_t + c[None, :], mask=ok & from_ring[:, None], other=0.0)
    x = tl.where(from_ring[:, None], x_old, x_new)  # both already in the model dtype
    # paging: each token's block from the table (a tile may cross a block boundary; a channel group cannot)
    j = p - S
    jb = j // BS
    blk = tl.load(tbl_ptr + b.to(tl.int64) * st_b + jb, mask=tok_ok & (jb < MB), other=-1)
    blk = tl.where(blk < NB, blk, -1)  # a table entry outside the pool is as good as none
    unreserved = tok_ok & (blk < 0)
    if tl.max(unreserved.to(tl.int32), 0) > 0:
        tl.store(err_ptr, 1)
    tok_ok = tok_ok & (blk >= 0)
    ok = ok & (blk >= 0)[:, None]
    jr = j % BS  # row in the block
    cb = codes_ptr + blk.to(tl.int64)[:, None] * sc_nb + h.to(tl.int64) * sc_h + jr[:, None].to(tl.int64) * sc_t
    if KIND == 3:
        tl.store(cb + c[None, :], x, mask=ok)
    else:
        xf = x.to(tl.float32)
        if BITS == 3:
            PER: tl.constexpr = 8
        else:
            PER: tl.constexpr = 8 // BITS
        unit_ok = tok_ok[:, None] & (tl.arange(0, DB // PER) * PER < D)[None, :]
        if CHANNEL:
            codes, scale, zero = _quantize(xf, ok, 0, KIND, BITS, E4M3, SFMT, ZMAX, SMAX)
            # the group's block (the whole group is in one) and its row of scales there
            jg = q0 - S + tile * G
            gblk = tl.load(tbl_ptr + b.to(tl.int64) * st_b + jg // BS, mask=jg // BS < MB, other=-1)
            gblk = tl.where(gblk < NB, gblk, -1)
            if gblk >= 0:
                s_off = gblk.to(tl.int64) * ss_nb + h.to(tl.int64) * ss_h + ((jg % BS) // G) * ss_t
                tl.store(scale_ptr + s_off + c, scale, mask=c < D)
                if HAS_ZERO:
                    tl.store(zero_ptr + s_off + c, zero, mask=c < D)
        else:
            NG: tl.constexpr = DB // GB
            x3 = tl.reshape(xf, (BLOCK_T, NG, GB))
            ok3 = tl.reshape(ok, (BLOCK_T, NG, GB))
            codes3, scale, zero = _quantize(x3, ok3, 2, KIND, BITS, E4M3, SFMT, ZMAX, SMAX)
            codes = tl.reshape(codes3, (BLOCK_T, DB))
            gi = tl.arange(0, NG)
            s_ok = tok_ok[:, None] & (gi * G < D)[None, :]
            if SFMT != 3:  # (SFMT 3: the scale is fixed, and the pool holds none)
                s_off = blk.to(tl.int64)[:, None] * ss_nb + h.to(tl.int64) * ss_h + jr[:, None] * ss_t + gi[None, :]
                tl.store(scale_ptr + s_off, scale, mask=s_ok)
                if HAS_ZERO:
                    tl.store(zero_ptr + s_off, zero, mask=s_ok)
        _store_packed(cb, codes, unit_ok, BITS, DB, BLOCK_T)


@triton.jit
def _copy_kernel(
    k_ptr, v_ptr, k_res, v_res, k_sink, v_sink, len_ptr, nnew_ptr,
    sx_b, sx_h, sx_t, sr_b, sr_h, sr_t, ss_b, ss_h, ss_t,
    H,
    D: tl.constexpr, DB: tl.constexpr, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr, W: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Chunk tokens that stay in full precision: sinks (p < S) and the ring (p >= max(S, Q(L+n)))."""
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(len_ptr + b)
    nb = tl.load(nnew_ptr + b)
    q1 = _boundary(L + nb, S, R, F)
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    p = L + t
    c = tl.arange(0, DB)[None, :]
    ok = (t < nb)[:, None] & (c < D)
    xo = b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + t[:, None] * sx_t + c
    k = tl.load(k_ptr + xo, mask=ok)
    v = tl.load(v_ptr + xo, mask=ok)
    if S > 0:
        so = b.to(tl.int64) * ss_b + h.to(tl.int64) * ss_h + p[:, None] * ss_t + c
        sink_ok = ok & (p < S)[:, None]
        tl.store(k_sink + so, k, mask=sink_ok)
        tl.store(v_sink + so, v, mask=sink_ok)
    if W > 0:
        ro = b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h + (p % W)[:, None] * sr_t + c
        ring_ok = ok & (p >= tl.maximum(q1, S))[:, None]
        tl.store(k_res + ro, k, mask=ring_ok)
        tl.store(v_res + ro, v, mask=ring_ok)


# --------------------------------------------------------------------------- launcher
_KIND = {"asym": 0, "sym": 1, "fp8": 2, "none": 3}


def as_bytes(t: Tensor) -> Tensor:
    """fp8 scales as their bytes: the kernels read and write the bit patterns (the fp8 cast of Triton's CPU
    interpreter is wrong near binade edges, ``_fp8_encode``); int8 zero points stay int8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _kind(q) -> int:
    if not q.quantized:
        return _KIND["none"]
    if q.is_fp8:
        return _KIND["fp8"]
    return _KIND["sym"] if q.symmetric else _KIND["asym"]


@functools.lru_cache(maxsize=None)
def flush_config(q: Quant, head_dim: int, sink: int, residual: int, flush: int, ring: int) -> tuple[str, dict]:
    """The specialization of ``_flush_kernel`` for one tensor's format in one layout, and its key.

    Memoised: a policy's kernel configuration is worked out once; Triton compiles one binary per distinct
    set of constexprs, which this key spells out.
    """
    D = head_dim
    DB = triton.next_power_of_2(D)
    g = q.group_for(D) if q.quantized else 1
    channel = q.quantized and q.axis == "channel"  # (axis="tensor" is per token-head: group D, no scale stored)
    kw = dict(D=D, DB=DB, S=sink, R=residual, F=flush, W=ring, KIND=_kind(q), BITS=q.bits,
              E4M3=q.format == "fp8_e4m3", SFMT=scale_code(q), HAS_ZERO=q.has_zero,
              CHANNEL=channel, G=g, GB=triton.next_power_of_2(g) if not channel else g,
              ZMAX=Q.limits(q)[0] if q.quantized else 0.0, SMAX=Q.limits(q)[1] if q.quantized else 0.0)
    key = f"store.flush[{q.key()};D={D};S={sink};R={residual};F={flush};W={ring}]"
    return key, kw


_PLACEHOLDERS: dict = {}


def nonempty(t: Tensor) -> Tensor:
    """``t``, or a one-element tensor of its dtype and device when ``t`` is empty (a layout without a ring,
    sinks or zero points): a kernel never touches it, but a null pointer may not be passed on CUDA."""
    if t.numel():
        return t
    key = (t.dtype, t.device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=t.dtype, device=t.device)
    return _PLACEHOLDERS[key]


def launch_store(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor) -> Tensor:
    """Append ``k, v [B, H, n, D]`` (already rotated and in the model dtype, unit stride along D) to
    ``state``; row ``b`` appends its first ``n_new[b]`` tokens (int32 [B], on the state's device).

    Packed tokens go where ``state.table`` says. Returns an int32 [1] device flag, 1 where a token's block
    was not reserved (that token was not written): checked by the caller without a host sync.
    """
    B, H, n, D = k.shape
    S, R, F, W, BS = spec.sink, spec.policy.residual, spec.flush, spec.ring, spec.block
    err = torch.zeros(1, dtype=torch.int32, device=k.device)
    t_max = -(-n // F) * F  # the most positions an n-token append can flush
    table = state.table
    if t_max > 0:
        for x, res, codes, scale, zero, q in (
            (k, state.k_res, state.k_codes, state.k_scale, state.k_zero, spec.policy.key),
            (v, state.v_res, state.v_codes, state.v_scale, state.v_zero, spec.policy.value),
        ):
            _, kw = flush_config(q, D, S, R, F, W)
            block_t = kw["G"] if kw["CHANNEL"] else min(16, triton.next_power_of_2(t_max))
            grid = (B * H, triton.cdiv(t_max, block_t))
            sstr = scale.stride() if scale.dim() == 4 and scale.numel() else (0, 0, 0)
            rstr = res.stride() if res.numel() else (0, 0, 0)
            cstr = codes.stride() if codes.numel() else (0, 0, 0)
            run(_flush_kernel, grid, dict(
                x_ptr=x, res_ptr=nonempty(res), codes_ptr=nonempty(codes), scale_ptr=nonempty(as_bytes(scale)),
                zero_ptr=nonempty(zero), len_ptr=state.lengths, nnew_ptr=n_new, tbl_ptr=nonempty(table),
                err_ptr=err,
                sx_b=x.stride(0), sx_h=x.stride(1), sx_t=x.stride(2), sr_b=rstr[0], sr_h=rstr[1], sr_t=rstr[2],
                sc_nb=cstr[0], sc_h=cstr[1], sc_t=cstr[2], ss_nb=sstr[0], ss_h=sstr[1], ss_t=sstr[2],
                st_b=table.stride(0), MB=table.shape[1], NB=codes.shape[0], H=H, BLOCK_T=block_t, BS=BS, **kw,
            ), num_warps=8 if block_t * kw["DB"] >= 8192 else 4)
    if S > 0 or W > 0:
        block_t = min(16, triton.next_power_of_2(n))
        rstr = state.k_res.stride() if W > 0 else (0, 0, 0)
        sstr = state.k_sink.stride() if S > 0 else (0, 0, 0)
        run(_copy_kernel, (B * H, triton.cdiv(n, block_t)), dict(
            k_ptr=k, v_ptr=v, k_res=nonempty(state.k_res), v_res=nonempty(state.v_res),
            k_sink=nonempty(state.k_sink), v_sink=nonempty(state.v_sink), len_ptr=state.lengths, nnew_ptr=n_new,
            sx_b=k.stride(0), sx_h=k.stride(1), sx_t=k.stride(2), sr_b=rstr[0], sr_h=rstr[1], sr_t=rstr[2],
            ss_b=sstr[0], ss_h=sstr[1], ss_t=sstr[2], H=H, D=D, DB=triton.next_power_of_2(D), S=S, R=R, F=F, W=W,
            BLOCK_T=block_t,
        ))
    state.lengths.add_(n_new)
    return err
