"""Fused dequantize-attention over one layer's store: split-K flash-decoding and chunked prefill.

Reference: ``kvcompile.store.attention_reference`` (semantics: queries are the last ``n`` tokens, causal
without a mask, a bool or additive mask over absolute key positions otherwise, a query that sees nothing
returns zeros) over ``kvcompile.store.dequantize_reference`` (what each position holds).

One kernel serves both shapes of the problem, specialised by its constexprs:

- **decode** (``n == 1``): a program owns one (sequence, KV head) and one slice of the sequence (split-K).
  Its query rows are the ``G = Hq / H`` query heads that share the KV head (grouped-query attention), so each
  KV tile is loaded and dequantized once for all of them. ``nsplit`` programs per (sequence, head) each
  cover ``ceil((L - S) / nsplit)`` positions past the sinks (the first also takes the sinks) -- split by the
  sequence's length on the device, so a batch of one at 128K context still fills the GPU without a host sync
  -- and ``_merge_kernel`` combines their partial (max, sum, accumulator) triples with the online-softmax
  rule. The host picks only how many splits, from the batch and the positions the call can score (the mask's
  width, or the block table's reach: ``position_bound``), never from a capacity.
- **chunked prefill** (``n > 1``): rows are ``BLOCK_Q`` query tokens x ``G`` heads; the key range stops at
  the block's last query (causal), and the same split-K applies when the grid is small.

A tile of keys/values comes from one of three regions, walked in order by three loops: sinks (``p < S``,
full precision), packed codes (``S <= p < Q(L)``, dequantized in registers: unpack the little-endian bit
stream, gather the scale/zero of each element's group), and the residual ring (``Q(L) <= p < L``, slot
``p % W``). Packed codes are paged: position ``p`` is row ``(p - S) % BS`` of block
``table[b, (p - S) // BS]``. Packed tiles start at multiples of ``BLOCK_N`` past the sinks and ``BLOCK_N``
divides ``BS`` (the launcher cuts a longer tile to the block), so a tile lies in one block: one table entry
per tile, and its rows are contiguous there, as they were without pages. With ``CHUNK`` a fourth loop reads
the packed positions of the queries' own chunk (``[L - n, L)``, given in full precision) from the chunk
instead of the codes: a prefill attends to itself unquantized, and the codes it has just written are not read
back. Scores and softmax are fp32 (online softmax); the two matrix products accumulate in fp32 with operands
in fp32 (``DOT="ieee"``) or rounded to tf32 on the tensor cores (``DOT="tf32"``).

Pre-RoPE keys (``Policy.pre_rope``; ``ROPE``): each key tile, once formed in any of the four loops, is rotated
by its positions as ``kvcompile.store.apply_rope`` states it (``_rope_tile``: the partner channels gathered
within the tile, the cos/sin rows of the clamped rotary positions loaded), so the scores see exactly the
reference's rotated fp32 keys.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompile.store import KVState, LayerSpec, Rope, apply_rope, check_rope_tables

from .common import INTERPRET, run, scale_code
from .store import _boundary, _e4m3_value, _kind, as_bytes, nonempty
from kvcompile.errors import ArgumentError


# --------------------------------------------------------------------------- tiles
_INTERP = tl.constexpr(INTERPRET)


@triton.jit
def _bf16(x):
    """fp32 -> bf16 rounded to nearest even, as the GPU converts. Triton's interpreter truncates instead, so
    there the rounding is done on the bits (NaN stays NaN)."""
    if _INTERP:
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), r)
    return x.to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc):
    """``tl.dot`` of bf16 tiles with fp32 accumulation. Triton's interpreter multiplies bf16 bit patterns
    (triton-lang/triton#11584, still so in 3.9), so there the same exact products run on fp32 copies."""
    if _INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _fp8_decode(code, E4M3: tl.constexpr):
    """fp32 value of fp8 bit patterns (int32 in [0, 256)) through an fp16 conversion; for e4m3 the value
    over 2**8, a factor the caller folds into the scale.

    An e5m2 byte is the high byte of the fp16 of the same value. e4m3's sign, exponent and mantissa moved
    into an fp16's places (exponent bias 15 against 7) make an fp16 of the value times 2**-8, subnormals
    included. Both are exact; three integer operations and one conversion per code. (Only finite codes are
    stored where there is a scale: a group holding NaN or inf has a NaN scale instead. With one fixed scale,
    axis="tensor", it holds the NaN code, 0x7F: e5m2's is an fp16 NaN here, e4m3's the caller selects.)"""
    if E4M3:
        h = ((code << 7) & 0x3F80) | ((code << 8) & 0x8000)
    else:
        h = code << 8
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _packed_tile(codes_ptr, scale_ptr, zero_ptr, idx, tok_ok, sc_t, ss_t,
                 D: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr,
                 BITS: tl.constexpr, E4M3: tl.constexpr, CHANNEL: tl.constexpr, G: tl.constexpr,
                 SFMT: tl.constexpr):
    """Dequantized fp32 ``[BLOCK_N, DB]`` tile of rows ``idx`` of one block; as
    ``quant.dequantize(quant.unpack(...))``. ``codes_ptr``/``scale_ptr``/``zero_ptr`` point at (block, h), so
    offsets within it fit 32 bits (the launcher keeps blocks small enough). SFMT 2: fp8 e4m3 scales read as
    their bytes (0x7F: NaN, a poisoned group) and int8 zero points, ``x^ = (code - zero) * scale``. SFMT 3
    (fp8, axis="tensor"): no scale is read, ``x^`` is the code's value, and the NaN code (a poisoned
    token-head's) is NaN."""
    c = tl.arange(0, DB)
    ok = tok_ok[:, None] & (c < D)[None, :]
    row = idx[:, None] * sc_t  # within one block: int32
    if KIND == 3:
        x = tl.load(codes_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        if BITS == 8:
            code = tl.load(codes_ptr + row + c[None, :], mask=ok, other=0).to(tl.int32)
        else:
            if BITS == 3:
                PER: tl.constexpr = 8
                NB: tl.constexpr = 3
            else:
                PER: tl.constexpr = 8 // BITS
                NB: tl.constexpr = 1
            U: tl.constexpr = DB // PER
            units = tl.arange(0, U)
            uok = tok_ok[:, None] & (units * PER < D)[None, :]
            base = codes_ptr + row + units[None, :] * NB
            word = tl.load(base, mask=uok, other=0).to(tl.int32)
            for j in tl.static_range(1, NB):
                word = word | (tl.load(base + j, mask=uok, other=0).to(tl.int32) << (8 * j))
            shifts = (tl.arange(0, PER) * BITS)[None, None, :]
            code = tl.reshape((word[:, :, None] >> shifts) & ((1 << BITS) - 1), (BLOCK_N, DB))
        if CHANNEL:
            s_off = (idx // G)[:, None] * ss_t + c[None, :]
            s_ok = ok
        elif G == D:  # one scale per token-head: load a column and broadcast it (saves registers)
            s_off = idx[:, None] * ss_t
            s_ok = tok_ok[:, None]
        else:
            s_off = idx[:, None] * ss_t + (c // G)[None, :]
            s_ok = ok
        if SFMT == 2:
            sb = tl.load(scale_ptr + s_off, mask=s_ok, other=0).to(tl.int32)
            s = tl.where(sb == 0x7F, float("nan"), _e4m3_value(sb))
        elif SFMT != 3:  # (SFMT 3: one fixed scale, 1.0, not stored; scale_ptr is a placeholder, never read)
            s = tl.load(scale_ptr + s_off, mask=s_ok, other=0.0).to(tl.float32)
        if SFMT == 3 and E4M3:  # the NaN code (0x7F, 0xFF: a poisoned token-head's) as NaN, not 480
            x = tl.where((code & 0x7F) == 0x7F, float("nan"), _fp8_decode(code, E4M3) * 256.0)
        elif SFMT == 3:  # e5m2's NaN codes are fp16 NaNs already
            x = _fp8_decode(code, E4M3)
        elif KIND == 0 and SFMT == 2:
            z = tl.load(zero_ptr + s_off, mask=s_ok, other=0).to(tl.float32)
            x = (code.to(tl.float32) - z) * s
        elif KIND == 0:
            z = tl.load(zero_ptr + s_off, mask=s_ok, other=0.0).to(tl.float32)
            x = code.to(tl.float32) * s + z
        elif KIND == 1:
            x = (code.to(tl.float32) - (1 << (BITS - 1))) * s
        elif E4M3:
            x = _fp8_decode(code, E4M3) * (s * 256.0)  # the decode's 2**-8, undone exactly on the scale
        else:
            x = _fp8_decode(code, E4M3) * s
    return x


@triton.jit
def _full_tile(ptr, pos, tok_ok, s_t, D: tl.constexpr, DB: tl.constexpr):
    """fp32 ``[BLOCK_N, DB]`` tile of full-precision rows ``pos`` (sinks or ring slots) at ``ptr`` (b, h)."""
    c = tl.arange(0, DB)
    ok = tok_ok[:, None] & (c < D)[None, :]
    return tl.load(ptr + pos.to(tl.int64)[:, None] * s_t + c[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _rope_perm(rperm, D: tl.constexpr, DB: tl.constexpr):
    """Each channel's partner ``[DB]`` from ``perm [D]``; padded channels (``>= D``) are their own."""
    c = tl.arange(0, DB)
    return tl.where(c < D, tl.load(rperm + c, mask=c < D, other=0), c)


@triton.jit
def _rope_tile(k, p, off_b, cos_ptr, sin_ptr, perm, T, D: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pre-RoPE keys ``k [BLOCK_N, DB]`` at positions ``p`` rotated as ``kvcompile.store.apply_rope``:
    ``k * cos[r] + k[:, perm] * sin[r]``, ``r = clamp(p + off_b, 0, T - 1)``, in fp32, those two products and
    that sum in that order (contraction off: each rounds as torch's does). ``perm [DB]``: each channel's
    partner, padded channels (``>= D``) their own; the partners are gathered within the tile, in registers."""
    c = tl.arange(0, DB)
    kp = tl.gather(k, tl.broadcast_to(perm[None, :], (BLOCK_N, DB)), 1)
    r = tl.minimum(tl.maximum(p + off_b, 0), T - 1).to(tl.int64)
    ok = (c < D)[None, :]
    cs = tl.load(cos_ptr + r[:, None] * D + c[None, :], mask=ok, other=1.0)
    sn = tl.load(sin_ptr + r[:, None] * D + c[None, :], mask=ok, other=0.0)
    return k * cs + kp * sn


@triton.jit
def _online_step(acc, m_i, l_i, q, k, v, p, kv_ok, qpos, row_ok, mask_rows, sm_c, sm_scale,
                 MASK_KIND: tl.constexpr, DOT: tl.constexpr):
    """One tile of online softmax: scores ``q k^T * scale`` (+ mask), running max ``m_i``, running sum
    ``l_i`` and unnormalised output ``acc``, all fp32.

    Non-finite values, as ``attention_reference``: an additive mask's -inf hides a position; a visible score
    that is not finite makes its row's ``l_i`` NaN (nothing undoes it) and takes no part in the softmax; a
    visible non-finite value makes its channel of ``acc`` NaN; hidden positions never reach ``acc`` (their
    values are zeroed before the product, as 0 * NaN would poison the row)."""
    if DOT == "bf16":  # operands rounded to bf16, fp32 accumulation (the tensor cores' fast path)
        s = _dot(_bf16(q), tl.trans(_bf16(k)), None) * sm_scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * sm_scale
    vis = row_ok[:, None] & kv_ok[None, :]
    if MASK_KIND == 0:
        vis = vis & (p[None, :] <= qpos[:, None])
    elif MASK_KIND == 1:
        mv = tl.load(mask_rows + p.to(tl.int64)[None, :] * sm_c, mask=vis, other=0)
        vis = vis & (mv != 0)
    else:
        mv = tl.load(mask_rows + p.to(tl.int64)[None, :] * sm_c, mask=vis, other=0.0).to(tl.float32)
        vis = vis & (mv != float("-inf"))
        s = s + mv
    fin = tl.abs(s) < float("inf")
    bad = tl.max(tl.where(vis & ~fin, 1, 0), 1) > 0  # a visible NaN or inf score: the row is NaN
    s = tl.where(vis & fin, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp() away from NaN
    alpha = tl.exp(m_i - m_use)
    pr = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    l_i = tl.where(bad, float("nan"), l_i)
    vfin = tl.abs(v) < float("inf")
    if tl.max(tl.max(tl.where(vfin, 0, 1), 1), 0) > 0:  # a NaN or inf value in the tile (rare)
        # visible ones, per channel (0/1 operands and counts up to BLOCK_N: exact on bf16 tensor cores)
        hit = _dot(vis.to(tl.float32).to(tl.bfloat16), tl.where(vfin, 0.0, 1.0).to(tl.bfloat16), None)
        acc = acc * alpha[:, None] + _pv(pr, tl.where(vfin, v, 0.0), DOT)
        acc = tl.where(hit > 0, float("nan"), acc)
    else:
        acc = acc * alpha[:, None] + _pv(pr, v, DOT)
    return acc, m_new, l_i


@triton.jit
def _pv(p, v, DOT: tl.constexpr):
    if DOT == "bf16":
        return _dot(_bf16(p), _bf16(v), None)
    return tl.dot(p, v, input_precision=DOT)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _attn_kernel(
    q_ptr, out_ptr, ws_acc, ws_ml,
    kc, ks, kz, vc, vs, vz, kr, vr, ksk, vsk, len_ptr, tbl_ptr, mask_ptr, kn, vn,
    rcos, rsin, rperm, roff, T,  # pre-RoPE keys (ROPE): cos, sin fp32 [T, D], perm int32 [D], offset int32 [B]
    sq_b, sq_h, sq_t,  # q [B, Hq, n, D] fp32, unit stride along D
    skc_nb, skc_h, skc_t, sks_nb, sks_h, sks_t,  # key codes, key scale/zero: per block [NB, H, ...]
    svc_nb, svc_h, svc_t, svs_nb, svs_h, svs_t,  # value codes, value scale/zero
    sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t,  # rings, sinks (keys and values share strides)
    st_b,  # block table [B, MB]
    sm_b, sm_h, sm_t, sm_c, P,  # mask, broadcast to [B, Hq, n, P]
    # kn, vn: the chunk [B, H, n, D] fp32, contiguous (used with CHUNK)
    H, Hq, n, sm_scale, nsplit,
    D: tl.constexpr, DB: tl.constexpr, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr, W: tl.constexpr,
    BS: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_E4M3: tl.constexpr, K_CHANNEL: tl.constexpr, K_G: tl.constexpr,
    K_SFMT: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_E4M3: tl.constexpr, V_CHANNEL: tl.constexpr, V_G: tl.constexpr,
    V_SFMT: tl.constexpr,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr, CHUNK: tl.constexpr, ROPE: tl.constexpr,
    PDOT: tl.constexpr,
):
    """Program (b*H + h, query block, split): rows = BLOCK_Q queries x G heads sharing KV head h.

    Without SPLIT (nsplit == 1) it writes the normalised output ``out [B, Hq, n, DB]``; with SPLIT the partial
    results go to ``ws_acc [B, Hq, n, nsplit, DB]`` and ``ws_ml [B, Hq, n, nsplit, 2]`` (running max, sum).
    ``nsplit`` is a runtime argument, so batch sizes and contexts that split differently share one binary.
    With ROPE the store holds pre-RoPE keys: every key tile (sinks, codes, chunk, ring) is rotated by its
    positions once formed (``_rope_tile``), before the scores.

    Paging: split boundaries fall at ``S + k * per`` (``per`` whole tiles), so every packed tile starts at a
    multiple of BLOCK_N counted from S; with BLOCK_N dividing BS it lies in one block, read through one table
    entry, ``table[b, (p - S) // BS]``.
    """
    tl.static_assert(BLOCK_N <= BS, "a packed tile must not straddle two blocks")
    tl.static_assert(BS <= 1 << 22, "offsets within a block (BS rows of at most 256 elements) must fit int32")
    bh = tl.program_id(0)
    qblk = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // H
    h = bh % H
    L = tl.load(len_ptr + b)
    c = tl.arange(0, DB)
    m = tl.arange(0, BLOCK_M)
    gq = m % GP
    qi = qblk * BLOCK_Q + m // GP
    row_ok = (gq < G) & (m // GP < BLOCK_Q) & (qi < n)
    hq = h * G + gq
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + hq.to(tl.int64)[:, None] * sq_h + qi[:, None] * sq_t + c[None, :],
                mask=row_ok[:, None] & (c < D)[None, :], other=0.0)
    qpos = L - n + qi  # each query's own absolute position
    mask_rows = mask_ptr + b.to(tl.int64) * sm_b + hq.to(tl.int64)[:, None] * sm_h + qi[:, None] * sm_t
    # the positions this block may see, split evenly (in whole tiles, counted from S) across nsplit programs;
    # split 0 also takes the sinks
    if MASK_KIND == 0:
        end = tl.maximum(L - n + tl.minimum(qblk * BLOCK_Q + BLOCK_Q, n), 0)
    else:
        end = tl.minimum(L, P)  # positions past the mask's width are invisible
    per = tl.cdiv(tl.cdiv(tl.maximum(end - S, 0), nsplit), BLOCK_N) * BLOCK_N
    lo = tl.where(split == 0, 0, S + split * per)
    hi = tl.minimum(S + (split + 1) * per, end)
    QL = _boundary(L, S, R, F)
    if ROPE:
        off_b = tl.load(roff + b)
        perm = _rope_perm(rperm, D, DB)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DB], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    if S > 0:
        sk = ksk + b.to(tl.int64) * ssk_b + h.to(tl.int64) * ssk_h
        sv = vsk + b.to(tl.int64) * ssk_b + h.to(tl.int64) * ssk_h
        stop = tl.minimum(hi, S)
        for start in range(lo, stop, BLOCK_N):
            p = start + offs
            kv_ok = p < stop
            k = _full_tile(sk, p, kv_ok, ssk_t, D, DB)
            if ROPE:
                k = _rope_tile(k, p, off_b, rcos, rsin, perm, T, D, DB, BLOCK_N)
            v = _full_tile(sv, p, kv_ok, ssk_t, D, DB)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, p, kv_ok, qpos, row_ok, mask_rows, sm_c,
                                         sm_scale, MASK_KIND, DOT)
    tbl = tbl_ptr + b.to(tl.int64) * st_b
    kch = kc + h.to(tl.int64) * skc_h
    ksh = h.to(tl.int64) * sks_h
    vch = vc + h.to(tl.int64) * svc_h
    vsh = h.to(tl.int64) * svs_h
    stop = tl.minimum(hi, QL)
    if CHUNK:  # packed positions of the queries' own chunk come from the chunk (full precision), below
        stop_codes = tl.minimum(stop, tl.maximum(L - n, S))
    else:
        stop_codes = stop
    for start in range(tl.maximum(lo, S), stop_codes, BLOCK_N):
        p = start + offs
        kv_ok = p < stop_codes
        # j = p - S is a multiple of BLOCK_N: the tile is rows j % BS .. + BLOCK_N of block table[b, j // BS]
        j = start - S
        blk = tl.load(tbl + j // BS).to(tl.int64)
        idx = j % BS + offs
        ks0 = blk * sks_nb + ksh
        vs0 = blk * svs_nb + vsh
        k = _packed_tile(kch + blk * skc_nb, ks + ks0, kz + ks0, idx, kv_ok, skc_t, sks_t,
                         D, DB, BLOCK_N, K_KIND, K_BITS, K_E4M3, K_CHANNEL, K_G, K_SFMT)
        if ROPE:
            k = _rope_tile(k, p, off_b, rcos, rsin, perm, T, D, DB, BLOCK_N)
        v = _packed_tile(vch + blk * svc_nb, vs + vs0, vz + vs0, idx, kv_ok, svc_t, svs_t,
                         D, DB, BLOCK_N, V_KIND, V_BITS, V_E4M3, V_CHANNEL, V_G, V_SFMT)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, p, kv_ok, qpos, row_ok, mask_rows, sm_c,
                                     sm_scale, MASK_KIND, PDOT)
    if CHUNK:
        kcn = kn + (b.to(tl.int64) * H + h) * n * D
        vcn = vn + (b.to(tl.int64) * H + h) * n * D
        for start in range(tl.maximum(lo, stop_codes), stop, BLOCK_N):
            p = start + offs
            kv_ok = p < stop
            k = _full_tile(kcn, p - (L - n), kv_ok, D, D, DB)
            if ROPE:
                k = _rope_tile(k, p, off_b, rcos, rsin, perm, T, D, DB, BLOCK_N)
            v = _full_tile(vcn, p - (L - n), kv_ok, D, D, DB)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, p, kv_ok, qpos, row_ok, mask_rows, sm_c,
                                         sm_scale, MASK_KIND, DOT)
    if W > 0:
        rk = kr + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
        rv = vr + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
        for start in range(tl.maximum(lo, QL), hi, BLOCK_N):
            p = start + offs
            kv_ok = p < hi
            k = _full_tile(rk, p % W, kv_ok, sr_t, D, DB)
            if ROPE:
                k = _rope_tile(k, p, off_b, rcos, rsin, perm, T, D, DB, BLOCK_N)
            v = _full_tile(rv, p % W, kv_ok, sr_t, D, DB)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, p, kv_ok, qpos, row_ok, mask_rows, sm_c,
                                         sm_scale, MASK_KIND, DOT)

    r = (b.to(tl.int64) * Hq + hq) * n + qi  # [BLOCK_M] row of [B, Hq, n]
    if not SPLIT:
        empty = l_i == 0.0  # a query that sees nothing returns zeros; a NaN sum gives a NaN row
        out = tl.math.div_rn(acc, tl.where(empty, 1.0, l_i)[:, None])
        out = tl.where(empty[:, None], 0.0, out)
        out = tl.where(tl.abs(out) < float("inf"), out, float("nan"))  # any non-finite output is NaN
        tl.store(out_ptr + r[:, None] * DB + c[None, :], out, mask=row_ok[:, None])
    else:
        w = r * nsplit + split
        tl.store(ws_acc + w[:, None] * DB + c[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_ml + w * 2, m_i, mask=row_ok)
        tl.store(ws_ml + w * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(out_ptr, ws_acc, ws_ml, nsplit, NSPLIT_B: tl.constexpr, DB: tl.constexpr,
                  IN_ORDER: tl.constexpr):
    """out[r] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the splits of row r (zeros if empty;
    NaN where a split's sum or accumulator is, and wherever the result is not finite). IN_ORDER: the sums run
    split by split, in order, so an empty split (m = -inf, l = 0, acc = 0) adds exact zeros and a row's result does
    not depend on how many splits the launch has (``decode_tiles``' row-invariant splits); else as a tree."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, NSPLIT_B)
    c = tl.arange(0, DB)
    ok = sp < nsplit
    w = r * nsplit + sp
    m = tl.load(ws_ml + w * 2, mask=ok, other=float("-inf"))
    M = tl.max(m, 0)
    M0 = tl.where(M == float("-inf"), 0.0, M)
    if IN_ORDER:
        lsum = tl.zeros([1], tl.float32)
        acc = tl.zeros([DB], tl.float32)
        for s in range(0, nsplit):
            ws = r * nsplit + s
            one = tl.exp(tl.load(ws_ml + ws * 2 + tl.zeros([1], tl.int64)) - M0)
            lsum += one * tl.load(ws_ml + ws * 2 + 1 + tl.zeros([1], tl.int64))
            acc += one * tl.load(ws_acc + ws * DB + c)
        lsum = tl.sum(lsum, 0)
    else:
        l = tl.load(ws_ml + w * 2 + 1, mask=ok, other=0.0)
        scale = tl.exp(m - M0)
        lsum = tl.sum(scale * l, 0)  # NaN when a split's sum is (a NaN row), whatever its weight
        acc = tl.sum(scale[:, None] * tl.load(ws_acc + w[:, None] * DB + c[None, :], mask=ok[:, None], other=0.0),
                     0)
    out = tl.math.div_rn(acc, tl.where(lsum == 0.0, 1.0, lsum))
    out = tl.where(lsum == 0.0, 0.0, out)
    tl.store(out_ptr + r * DB + c, tl.where(tl.abs(out) < float("inf"), out, float("nan")))


# --------------------------------------------------------------------------- launcher
def layout_constexprs(policy, head_dim: int, sink: int, flush: int, ring: int, block: int) -> dict:
    """The store layout as the constexprs of a kernel that reads it (``_attn_kernel``, ``past._past_kernel``):
    D, DB (the padded head), S, R, F, W, BS, and for keys (K_) and values (V_) the format's KIND, BITS, E4M3,
    CHANNEL, G (group) and SFMT (``scale_code``)."""
    D = head_dim
    kw = dict(D=D, DB=max(16, triton.next_power_of_2(D)), S=sink, R=policy.residual, F=flush, W=ring, BS=block)
    for pre, q in (("K_", policy.key), ("V_", policy.value)):
        kw.update({pre + "KIND": _kind(q), pre + "BITS": q.bits, pre + "E4M3": q.format == "fp8_e4m3",
                   pre + "CHANNEL": q.quantized and q.axis == "channel",
                   pre + "G": q.group_for(D) if q.quantized else 1, pre + "SFMT": scale_code(q)})
    return kw


def state_args(state: KVState) -> dict:
    """The store's tensors and strides as the kernels reading it take them: codes, scales, zero points, rings,
    sinks (``kc`` .. ``vsk``; empty ones a placeholder), ``len_ptr``, ``tbl_ptr``, and per block ``skc_*`` ..
    ``svs_*``, the rings' ``sr_*``, the sinks' ``ssk_*``, the table's ``st_b``."""
    def strides(t):
        return t.stride()[:3] if t.numel() else (0, 0, 0)

    skc, sks, svc, svs = strides(state.k_codes), strides(state.k_scale), strides(state.v_codes), strides(state.v_scale)
    sr, ssk = strides(state.k_res), strides(state.k_sink)
    return dict(
        kc=nonempty(state.k_codes), ks=nonempty(as_bytes(state.k_scale)), kz=nonempty(state.k_zero),
        vc=nonempty(state.v_codes), vs=nonempty(as_bytes(state.v_scale)), vz=nonempty(state.v_zero),
        kr=nonempty(state.k_res), vr=nonempty(state.v_res), ksk=nonempty(state.k_sink), vsk=nonempty(state.v_sink),
        len_ptr=state.lengths, tbl_ptr=nonempty(state.table),
        skc_nb=skc[0], skc_h=skc[1], skc_t=skc[2], sks_nb=sks[0], sks_h=sks[1], sks_t=sks[2],
        svc_nb=svc[0], svc_h=svc[1], svc_t=svc[2], svs_nb=svs[0], svs_h=svs[1], svs_t=svs[2],
        sr_b=sr[0], sr_h=sr[1], sr_t=sr[2], ssk_b=ssk[0], ssk_h=ssk[1], ssk_t=ssk[2], st_b=state.table.stride(0))


@functools.lru_cache(maxsize=None)
def attention_config(policy, head_dim: int, sink: int, flush: int, ring: int, block: int, gqa: int, block_q: int,
                     block_n: int, split: bool, mask_kind: int, dot: str, chunk: bool = False,
                     rope: bool = False, pdot: str | None = None) -> tuple[str, dict]:
    """The constexprs of one ``_attn_kernel`` specialization, and the key that spells it out (memoised).
    ``block``: packed tokens per block (``LayerSpec.block``), a multiple of ``block_n``. ``rope``: the keys are
    pre-RoPE, rotated by their positions in the kernel. ``dot``: operand precision of the full-precision
    positions' products; ``pdot`` (default ``dot``): of the packed positions' ("bf16": rounded to bf16, fp32
    accumulation), except where both keys and values are stored in full precision (format "none")."""
    if pdot is None or not (policy.key.quantized or policy.value.quantized):
        pdot = dot
    if block % block_n:
        raise ArgumentError(f"attention tile of {block_n} tokens does not divide the store's blocks of {block}")
    D = head_dim
    kw = layout_constexprs(policy, D, sink, flush, ring, block)
    gp = triton.next_power_of_2(gqa)
    kw.update(G=gqa, GP=gp, BLOCK_Q=block_q, BLOCK_M=max(16, gp * block_q), BLOCK_N=block_n, SPLIT=split,
              MASK_KIND=mask_kind, DOT=dot, CHUNK=chunk, ROPE=rope, PDOT=pdot)
    key = (f"attention[k={policy.key.key()};v={policy.value.key()};S={sink};R={policy.residual};F={flush};"
           f"W={ring};BS={block};D={D};gqa={gqa};bq={block_q};bn={block_n};split={int(split)};mask={mask_kind};"
           f"dot={dot};chunk={int(chunk)}{';rope=1' if rope else ''}"
           f"{'' if pdot == dot else ';pdot=' + pdot}]")  # keys without ROPE or PDOT read as before
    return key, kw


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def position_bound(state: KVState, spec: LayerSpec, mask: Tensor | None) -> int:
    """The most positions an attention call can score, from host-known shapes only (no device read): the
    mask's width, or without a mask the reach of the block table (sinks, every table entry's block, a full
    ring), which bounds every row's length. It sizes the number of splits; each split's range comes from the
    row's own length on the device."""
    if mask is not None:
        return mask.shape[-1]
    return spec.sink + state.table.shape[1] * spec.block + spec.ring


def default_tiles(spec: LayerSpec, n: int, gqa: int, device: torch.device, batch: int,
                  positions: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_N, NSPLIT) from host-known sizes only: ``batch`` sequences, at most ``positions``
    positions scored (``position_bound``). BLOCK_N never exceeds the store's block (a packed tile lies in one
    block). The interpreter gets small tiles (each op costs Python time; small tiles also make short test
    sequences cross tile and split boundaries)."""
    gp = triton.next_power_of_2(gqa)
    rows = 16 if INTERPRET else (32 if spec.head_dim > 64 else 64)
    block_q = 1 if n == 1 else min(triton.next_power_of_2(n), max(1, rows // gp))
    # GPU: 32 x 128 tiles with 8 warps compile without register spills on sm_90 (ptxas -v: 80-165 registers
    # for fp8/int8/int4/int2); 64 x 128 with 4 warps spilled 36 B - 2.3 KB per thread.
    block_n = min(16 if INTERPRET else (64 if spec.head_dim <= 64 else 32), spec.block)
    programs = batch * spec.heads * triton.cdiv(n, block_q)
    if INTERPRET:
        nsplit = 3 if n == 1 else 1
    else:  # about two programs per SM, but never slices shorter than 4 tiles of the positions
        nsplit = max(1, min(triton.cdiv(2 * _sm_count(device), programs), triton.cdiv(positions, 4 * block_n)))
    return block_q, block_n, nsplit


def num_warps(block_m: int, block_n: int, db: int) -> int:
    return 8 if db >= 128 or block_m >= 64 or block_n * db >= 64 * 128 else 4


def rope_tensors(rope: Rope | None, B: int, D: int, device: torch.device) -> tuple[Tensor, ...] | None:
    """The kernel's pre-RoPE tables from ``rope`` (``kvcompile.store.Rope``), checked: cos, sin fp32 [T, D],
    perm [D] and offset [B] int32, contiguous, on ``device``."""
    if rope is None:
        return None
    cos, sin = (t.to(device=device, dtype=torch.float32).contiguous() for t in (rope.cos, rope.sin))
    perm, off = (t.to(device=device, dtype=torch.int32).contiguous() for t in (rope.perm, rope.offset))
    check_rope_tables(cos, sin, perm, off, B, D, partners=perm.device.type == "cpu")  # no host sync on CUDA
    return cos, sin, perm, off


def launch_attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None, scale: float,
                     dot: str, tiles: tuple[int, int, int] | None = None,
                     chunk: tuple[Tensor, Tensor] | None = None, rope: Rope | None = None,
                     pdot: str | None = None) -> Tensor:
    """Attention of ``q [B, Hq, n, D]`` (fp32, already rotated) over ``state``; returns fp32 [B, Hq, n, D].

    ``chunk``: the queries' own keys and values, fp32 [B, H, n, D] contiguous, as stored (rotated, rounded to
    the model dtype), read instead of the packed codes at positions ``[L - n, L)``.

    ``mask``: None, or bool / float already broadcast (``expand``) to ``[B, Hq, n, P]``; positions ``>= P``
    are invisible.

    ``tiles`` = (BLOCK_Q, BLOCK_N, NSPLIT); a BLOCK_N longer than the store's block is cut to the block (a
    packed tile lies in one block, read through one table entry).

    ``rope`` (``kvcompile.store.Rope``): the store holds pre-RoPE keys; the kernel rotates every key it reads
    (the chunk's too) by its position, as ``apply_rope`` (checked by ``rope_tensors``).
    """
    B, Hq, n, D = q.shape
    H = spec.heads
    G = Hq // H
    block_q, block_n, nsplit = tiles or default_tiles(spec, n, G, q.device, B, position_bound(state, spec, mask))
    block_n = min(block_n, spec.block)
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    _, kw = attention_config(spec.policy, D, spec.sink, spec.flush, spec.ring, spec.block, G, block_q, block_n,
                             nsplit > 1, mask_kind, dot, chunk is not None, rope is not None, pdot)
    DB = kw["DB"]
    q = q.contiguous()
    dev = q.device
    rt = rope_tensors(rope, B, D, dev)
    out = torch.empty(B, Hq, n, DB, dtype=torch.float32, device=dev)
    if nsplit > 1:
        ws_acc = torch.empty(B, Hq, n, nsplit, DB, dtype=torch.float32, device=dev)
        ws_ml = torch.empty(B, Hq, n, nsplit, 2, dtype=torch.float32, device=dev)
    else:
        ws_acc = ws_ml = out
    if mask is None:
        mask_t, mstr, P = state.lengths, (0, 0, 0, 0), 0
    else:
        mask_t = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mstr, P = mask_t.stride(), mask_t.shape[-1]

    args = dict(
        q_ptr=q, out_ptr=out, ws_acc=ws_acc, ws_ml=ws_ml, **state_args(state), mask_ptr=nonempty(mask_t),
        kn=state.lengths if chunk is None else chunk[0], vn=state.lengths if chunk is None else chunk[1],
        rcos=state.lengths if rt is None else rt[0], rsin=state.lengths if rt is None else rt[1],
        rperm=state.lengths if rt is None else rt[2], roff=state.lengths if rt is None else rt[3],
        T=1 if rt is None else rt[0].shape[0],
        sq_b=q.stride(0), sq_h=q.stride(1), sq_t=q.stride(2),
        sm_b=mstr[0], sm_h=mstr[1], sm_t=mstr[2], sm_c=mstr[3], P=P,
        H=H, Hq=Hq, n=n, sm_scale=float(scale), nsplit=nsplit, **kw,
    )
    run(_attn_kernel, (B * H, triton.cdiv(n, block_q), nsplit), args,
        num_warps=num_warps(kw["BLOCK_M"], block_n, DB))
    if nsplit > 1:
        run(_merge_kernel, (B * Hq * n,), dict(out_ptr=out, ws_acc=ws_acc, ws_ml=ws_ml, nsplit=nsplit,
                                               NSPLIT_B=max(16, triton.next_power_of_2(nsplit)), DB=DB,
                                               IN_ORDER=False))
    return out[..., :D]


# --------------------------------------------------------------------------- what the kernel must equal
UNIT_ROUNDOFF = {"ieee": 0.0, "tf32": 2.0 ** -11, "bf16": 2.0 ** -8}  # of a dot's operands, per precision
def reference_and_bound(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
                        scale: float | None = None, *, nsplit: int, dot: str = "ieee",
                        k_new: Tensor | None = None, v_new: Tensor | None = None,
                        rope: Rope | None = None, decode: bool = False,
                        pdot: str | None = None, operands: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """float64 attention over the reference's dequantized store (``attention_reference`` in float64), and an
    elementwise bound on ``|launch.attention(...) - it|`` derived from the kernel's fp32 arithmetic.

    Returns (expected [B, Hq, n, D] float64, bound [B, Hq, n, D] float64). The derivation, with u = 2**-24,
    gamma_k = k u / (1 - k u), u_op = 2**-11 for tf32 operands (0 for "ieee"), N = keys a query sees:

    1. The kernel reads exactly the reference's fp32 dequantized keys/values (same fp32 operations,
       contraction off; the chunk, when given, exactly as stored; pre-RoPE keys, with ``rope``, rotated in fp32
       exactly as ``apply_rope``) and exactly its query (with rotation: ``q.float() @ H`` in fp32, the reference's own
       step; the float64 attention starts from that query). Each score q.k_j * scale (+ mask) is within
       scale (gamma_D + 2 u_op) sum_i |q_i k_ji| + 2u|s_j| of the exact one; exp(s_j - m) adds 2u(|s_j| + |m|) through the subtraction and log2(e)
       scaling and 2**-22 relative (ex2.approx), i.e. 2**-21 on the exponent. So every weight's exponent is
       off by at most E = max_j [...] + 6u max_j |s_j| + 2**-21.
    2. Exponents off by at most E change the normalised weights by a factor in [e^-2E, e^2E]: the output moves
       by at most (e^2E - 1) sum_j w_j |v_jd|.
    3. The running sum l and accumulator acc are sums of non-negative weights (times v) through one
       BLOCK_N-long dot, one rescale-and-add per tile and one per split: relative error gamma_(3N + 2 NSPLIT + 4)
       each (the rescale factors themselves multiply acc and l alike and cancel in acc / l); plus u for the
       division and 2 u_op for tf32 operands of p v. Cross terms are covered by the factor (1 + 2**-10).
    4. Rotation back (fp32 ``out @ H``, H block-diagonal in blocks of b = ``rotation_block(D)`` channels, b = D
       for a power of two): over each output's block, sum_i e_i / sqrt(b) + gamma_b sum_i (|o_i| + e_i) / sqrt(b).
    5. Rounding to q's dtype: + u_t (|o| + e) with u_t = 2**-8 (bf16) or 2**-11 (fp16), plus half the
       subnormal spacing (2**-25 for fp16) where the output is subnormal.
    ``operands`` (bf16 or fp16): ``templates.prefill``'s path with that operand precision ran (SDPA's fused
    kernels over the dequantized store) instead of a Triton kernel; steps 1-3 become (``_operands_error``), with
    ``q'``, ``k'``, ``v'`` and an additive mask's ``m'`` the operands rounded to that dtype (finite values
    saturated) and u_t its unit roundoff:

    - each score ``s' = q'.k'`` in fp32 off by ``|q - q'||k| + |q'||k - k'|`` (exactly: the operands are
      computed here as the path computes them) plus the tensor cores' sums, gamma_4D ``|q'||k'|``; times the
      scale, plus ``|m - m'|``; the exponential as in step 1 (8u max |s|, 2**-21);
    - the weights rounded to the operands' dtype before the product with ``v'``: u_t relative, and half the
      subnormal spacing (plus 2**-126 for a flushed exponential) absolute against a running maximum of 1, i.e.
      at most that times ``max_j w_j sum_j |v'_j|`` on the output (and, through the row sum, times N ``|o|``);
      the row sum counted once more at u_t (whether it adds rounded or unrounded weights);
    - ``w |v - v'|`` for the values' rounding, and the fp32 sums over N keys and up to 128 splits of the keys
      (gamma_(6N + 528));
    - the output rounded to the operands' dtype where it is rotated back (step 4) or returned in another dtype.

    A query that sees no key must return exactly 0. Where ``attention_reference``'s rule for non-finite values
    makes an output NaN, both the expected value and the bound are NaN (callers compare that pattern).

    ``decode=True``: the kernel that ran is ``templates.decode``'s (``nsplit`` counts its programs per sequence,
    the full-precision one included). Its full-precision positions are as above; at its packed positions,
    with ``x = a c + b`` each element (``decode.affine_terms``; ``OFF`` = 128 where integer codes narrower than a
    byte entered the dots as ``128 + c``) and u_b = 2**-8 (bf16's unit roundoff), steps 1 and 3 become, per
    element (``_decode_error``):

    - mode TILE keys: the query's rounding to bf16 (computed exactly) times ``|a c|`` (``b sum(q)`` uses the
      fp32 query), and the tensor cores' fp32 sums of ``|q|(|c| + OFF)``, the ``OFF`` and ``b`` row sums alike
      (gamma_(4D+16): a margin for accumulation that need not round to nearest);
    - mode CHAN keys: ``q' = bf16(fl(q a))`` per group of tokens ((u_b + 3u) ``|q a c|``, the query unrounded but
      saturated at ``decode.CHAN_QMAX``: its saturation times ``|a c| + |b|``), and the sums of ``|q' c|`` and
      ``|q b|`` (gamma_(4D+16), ``|q'|`` at most 1.01 ``|q a|``; the codes enter exactly, no ``OFF``);
    - mode ELEM keys: each element rounded to bf16 after ``fl(fl(a c) + b)`` (u_b |k| + 2u (|a c| + |k|)), the
      query's rounding times that element, and the same accumulation term;
    - values, TILE, GROUPS and ROWS: ``p a`` rounded to bf16 (u_b + 2u, times ``|a c|``), the accumulations of
      ``p' (c + OFF)``, of ``p'`` and of ``p b`` over the N keys (gamma_(4N + 8 NSPLIT + 16) times
      ``|a|(|c| + 2 OFF) + |b|``; GROUPS and ROWS: the codes enter exactly, no ``OFF``); GROUPS sums ``p b`` per
      tile in one tf32 product, ``p`` and ``b`` each rounded to tf32 (2 u_tf32 = 2**-10, times ``|b|``);
      ELEM: the values and the weights rounded to bf16 (2 u_b + u_b**2 of ``|v|``) and the same accumulation
      term over ``|a c| + |b| + |v|``. The weights' error of step 2 multiplies ``|v|`` in both (one weight per
      key multiplies all of a key's terms).
    """
    from kvcompile.store import dequantize_reference, hadamard, positions, rotation_block, with_chunk

    B, Hq, n, D = q.shape
    H, C = spec.heads, positions(state, mask)
    u, uop = 2.0 ** -24, UNIT_ROUNDOFF[dot]

    def gamma(k):
        return k * u / (1 - k * u)

    scale = 1.0 / D ** 0.5 if scale is None else float(scale)
    k, v = dequantize_reference(state, spec, torch.float64, rotated=True, end=C)
    if k_new is not None:  # the chunk exactly as the kernels read it (rotated in fp32, model dtype)
        k, v = with_chunk(k, v, state, spec, k_new, v_new)
    if rope is not None:  # the fp32 keys are exact in float64: rotate them in fp32 as apply_rope (and the kernel)
        k = apply_rope(k.float(), rope, torch.arange(C, device=k.device)).double()
    k = k.repeat_interleave(Hq // H, dim=1).to(q.device)
    v = v.repeat_interleave(Hq // H, dim=1).to(q.device)
    q64 = q.float().double()
    Hm = hadamard(D, q.device).double()
    # the query in the store's space exactly as the reference (and the launcher) compute it, in fp32
    qr = (q.float() @ hadamard(D, q.device)).double() if spec.policy.rotates_keys else q64
    sc = (qr @ k.transpose(-1, -2)) * scale
    dm = 0.0  # an additive mask's rounding to ``operands``
    pos = torch.arange(C, device=q.device)
    L = state.lengths.to(q.device).long().view(B, 1, 1, 1)
    vis = pos.view(1, 1, 1, C) < L
    if mask is None:
        vis = vis & (pos.view(1, 1, 1, C) <= L - n + torch.arange(n, device=q.device).view(1, 1, n, 1))
    elif mask.dtype == torch.bool:
        vis = vis & mask[..., :C].to(q.device)
    else:
        m = mask[..., :C].to(q.device).double()
        vis = vis & (m != float("-inf"))
        sc = sc + m
        if operands is not None:  # the path adds the mask rounded to its operands' dtype
            from kvcompile.quant import saturate
            dm = (m - saturate(mask[..., :C].to(q.device).float(), operands).double()).abs()
            dm = torch.where(torch.isfinite(dm), dm, 0.0)
    # attention_reference's rule for non-finite values: NaN rows (a visible non-finite score) and NaN
    # channels (a visible non-finite value); the rest is bounded as usual over the finite values
    seen = vis.expand(B, Hq, n, C)
    row_nan = (seen & ~torch.isfinite(sc)).any(-1, keepdim=True)
    vfin = torch.isfinite(v)
    nan_at = row_nan | ((seen.double() @ (~vfin).double()) > 0)
    v = torch.where(vfin, v, 0.0)
    vis = vis & torch.isfinite(sc)
    sc = sc.masked_fill(~vis, float("-inf"))
    w = torch.softmax(sc, dim=-1).nan_to_num(0.0)
    N = vis.sum(-1).double()
    if operands is not None and operands != torch.float32:
        o, e = _operands_error(qr, k, v, w, vis, sc, dm, scale, operands,
                               spec.policy.rotate or q.dtype != operands)
    elif not decode and pdot not in (None, dot) and (spec.policy.key.quantized or spec.policy.value.quantized):
        # the general kernel with its packed positions' operands in ``pdot``: per position, u_op and the sums
        # (tensor cores: gamma_4D) of step 1, and 2 u_op of the p v operands in step 3
        from .decode import packed_positions
        from kvcompile.store import chunk_needed
        pk = packed_positions(state, spec, C, n if k_new is not None and chunk_needed(spec, n) else 0)
        pk = pk.view(B, 1, C, 1).to(q.device)
        uo = torch.where(pk, UNIT_ROUNDOFF[pdot], uop)
        kg = torch.where(pk, gamma(4 * D), gamma(4 * D) if uop else gamma(D))
        term = scale * (qr.abs() @ (k.abs() * (kg + 2 * uo)).transpose(-1, -2))
        E = (torch.where(vis, term, 0).amax(-1) + 6 * u * torch.where(vis, sc.abs(), 0).amax(-1) + 2.0 ** -21)
        N = vis.sum(-1).double()
        o = w @ v
        e = ((torch.expm1(2 * E) + gamma(6 * N + 4 * nsplit + 9)).unsqueeze(-1) * (w @ v.abs())
             + w @ (2 * uo * v.abs())) * (1 + 2.0 ** -10)
    elif not decode:
        term = scale * (gamma(D) + 2 * uop) * (qr.abs() @ k.abs().transpose(-1, -2))
        E = (torch.where(vis, term, 0).amax(-1) + 6 * u * torch.where(vis, sc.abs(), 0).amax(-1) + 2.0 ** -21)
        N = vis.sum(-1).double()
        rel = (torch.expm1(2 * E) + gamma(6 * N + 4 * nsplit + 9) + 2 * uop) * (1 + 2.0 ** -10)
        o = w @ v
        e = rel.unsqueeze(-1) * (w @ v.abs())
    else:
        from kvcompile.store import chunk_needed  # the kernel reads the query's own token from the chunk
        o, e = _decode_error(qr, k, v, w, vis, sc, state, spec, C, nsplit, scale, uop,
                             int(k_new is not None and chunk_needed(spec, n)))
    if spec.policy.rotate:
        b = rotation_block(D)
        eb, ob = e.unflatten(-1, (D // b, b)), o.unflatten(-1, (D // b, b))
        e = ((eb.sum(-1, keepdim=True) + gamma(b) * (ob.abs() + eb).sum(-1, keepdim=True)) / b ** 0.5)
        e = e.expand_as(eb).flatten(-2)
        o = o @ Hm
    if q.dtype != torch.float32:
        ut = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[q.dtype]
        fi = torch.finfo(q.dtype)
        # relative below the smallest normal; absolute (half the subnormal spacing) under it
        e = e + ut * (o.abs() + e) + fi.smallest_normal * fi.eps / 2
    empty = (N == 0).unsqueeze(-1)
    if spec.policy.rotate:  # un-rotating spreads a NaN channel over the row
        nan_at = nan_at.any(-1, keepdim=True).expand_as(nan_at)
    return (o.masked_fill(empty, 0.0).masked_fill(nan_at, float("nan")),
            e.masked_fill(empty, 0.0).masked_fill(nan_at, float("nan")))


def _operands_error(qr, k, v, w, vis, sc, dm, scale, operands, rounded):
    """Steps 1-3 of ``reference_and_bound`` for ``templates.prefill``'s path with ``operands`` (bf16 or fp16):
    (output, its error bound) before rotation; ``rounded``: its output is rounded to ``operands`` before
    rotation or the return dtype's rounding (step 5 counts that one)."""
    from kvcompile.quant import saturate

    u = 2.0 ** -24
    D = qr.shape[-1]
    fi = torch.finfo(operands)
    ut = fi.eps / 2

    def gamma(x):
        return x * u / (1 - x * u)

    def fin(x):
        return torch.where(torch.isfinite(x), x, 0.0)

    def rounded_as_path(x):  # the fp32 value (exact in float64 here) rounded as the path rounds it
        return saturate(x.float(), operands).double()

    q1, k1, v1 = rounded_as_path(qr), rounded_as_path(k), rounded_as_path(v)
    qa, ka, k1a = fin(q1).abs(), fin(k).abs(), fin(k1).abs()
    err = (fin(qr - q1).abs() @ ka.transpose(-1, -2) + qa @ fin(k - k1).abs().transpose(-1, -2)
           + gamma(4 * D) * (qa @ k1a.transpose(-1, -2))) * scale + dm
    E = (torch.where(vis, err, 0).amax(-1) + 8 * u * torch.where(vis, sc.abs(), 0).amax(-1) + 2.0 ** -21)
    N = vis.sum(-1).double()
    va, v1a = fin(v).abs(), fin(v1).abs()
    o = w @ v
    wv = w @ v1a
    tiny = fi.smallest_normal * fi.eps / 2 + 2.0 ** -126  # a weight's absolute error under the normals
    wmax = w.amax(-1, keepdim=True)
    e = (torch.expm1(2 * E).unsqueeze(-1) * (w @ va) + w @ fin(v - v1).abs()
         + (2 * ut + gamma(6 * N + 528)).unsqueeze(-1) * wv
         + tiny * wmax * (vis.double() @ v1a + N.unsqueeze(-1) * wv)) * (1 + 2.0 ** -10)
    if rounded:
        e = e + ut * (o.abs() + e) + fi.smallest_normal * fi.eps / 2
    return o, e


def _decode_error(qr, k, v, w, vis, sc, state, spec, C, nslots, scale, uop, own):
    """Steps 1-3 of ``reference_and_bound`` for ``templates.decode``'s kernel: (output, its error bound) before
    rotation and rounding.

    Scores: per key, ``sum_d dq_d XQ_d + |q_d| XK_d`` (times the scale), ``dq`` the query's rounding (to bf16 at
    packed positions: computed exactly; ``u_op |q|`` at full-precision ones), ``XQ`` what it multiplies and
    ``XK`` the element's own rounding and the accumulation. Values: per output channel,
    ``sum_n w_n (rho X1 + gam X2)``, and ``(e^2E - 1) sum_n w_n |v_n|`` for the weights' error: in mode TILE the
    kernel sums ``p' c`` and ``p b`` with one ``p`` per key, so that error multiplies ``|v|`` there too."""
    from .decode import CHAN_QMAX, MODE_CHAN, MODE_ELEM, MODE_GROUPS, MODE_TILE, affine_terms, modes

    u = 2.0 ** -24
    B, Hq, n, D = qr.shape
    H = spec.heads
    N = vis.sum(-1).double()

    def gamma(x):
        return x * u / (1 - x * u)

    def terms(which, x):
        """Per element [B, Hq, C, D]: (packed-position mask, |a c|, |a| (|c| + 2 OFF) + |b|, the mode)."""
        qz = spec.policy.key if which == "k" else spec.policy.value
        c, a, b, packed = affine_terms(state, spec, which, C, own)
        c, a, b = (t.repeat_interleave(Hq // H, dim=1).to(x.device) for t in (c, a, b))  # per query head
        mode = modes(spec.policy, D, Hq // H)[which == "v"]
        off = 128.0 if mode == MODE_TILE and qz.is_int and qz.bits < 8 else 0.0  # CHAN, GROUPS, ROWS: exact codes
        ac, mag, bb = (a * c).abs(), a.abs() * (c.abs() + 2 * off) + b.abs(), b.abs()
        # a poisoned group (NaN scale) is NaN only where attention_reference says; elsewhere it weighs nothing
        ac, mag, bb = (torch.where(torch.isfinite(t), t, 0.0) for t in (ac, mag, bb))
        return packed.view(B, 1, C, 1).to(x.device), ac, mag, bb, mode

    ka = torch.where(torch.isfinite(k), k, 0.0).abs()
    pk, ac, mag, bb, mode = terms("k", k)
    bmax = torch.finfo(torch.bfloat16).max
    qc = qr.clamp(-bmax, bmax)  # the kernel saturates the query at bf16's largest (exact elsewhere) ...
    dq = (qc - qc.to(torch.bfloat16).double()).abs() + (qr - qc).abs()  # ... and rounds it to bf16
    if mode == MODE_CHAN:  # the query saturated lower, not rounded; q' = bf16(fl(q a)) per group: |q a c| (u_b + 3u)
        qc = qr.clamp(-CHAN_QMAX.value, CHAN_QMAX.value)
        dq = (qr - qc).abs()
        xq, xk = ac, (2.0 ** -8 + 3 * u) * ac + gamma(4 * D + 16) * 1.01 * mag  # and the sums of |q' c| + |q b|
    elif mode != MODE_ELEM:  # TILE (the b sum(q) term reads the saturated query: |q - qc| times |b| too)
        xq, xk = ac, gamma(4 * D + 16) * mag
    else:  # the element rounded to bf16 after fl(fl(a c) + b), and the sums of |qb kb|
        xq = ka * (1 + 2.0 ** -7) + 2.1 * u * (ac + ka)
        xk = (2.0 ** -8 + 3 * u) * ka + 2.1 * u * ac + gamma(4 * D + 16) * 1.01 * ka
    kg = gamma(4 * D) if uop else gamma(D)  # full-precision positions: tensor cores (tf32) or IEEE sums
    err_k = (torch.where(pk, 0.0, ka) @ (uop * qr.abs()).transpose(-1, -2)).transpose(-1, -2) \
        + dq @ torch.where(pk, xq, 0.0).transpose(-1, -2) \
        + qr.abs() @ torch.where(pk, xk, (uop + kg) * ka).transpose(-1, -2)
    if mode != MODE_ELEM:
        err_k = err_k + (qr - qc).abs() @ torch.where(pk, bb, 0.0).transpose(-1, -2)
    E = (torch.where(vis, scale * err_k, 0).amax(-1) + 8 * u * torch.where(vis, sc.abs(), 0).amax(-1)
         + 2.0 ** -21)
    pv, ac, mag, bb, mode = terms("v", v)
    va = v.abs()
    if mode != MODE_ELEM:  # TILE, GROUPS, ROWS: p' = bf16(fl(p a)); sums of p' (c + OFF), p' and p b over the N keys
        x1, x2 = (2.0 ** -8 + 2 * u) * ac, mag
        if mode == MODE_GROUPS:  # sum p b as one tf32 product a tile: p and b rounded to tf32
            x1 = x1 + 2 * UNIT_ROUNDOFF["tf32"] * bb
    else:  # p and the element rounded to bf16, and the sums
        x1, x2 = (2.0 ** -7 + 2.0 ** -15) * va + 2.1 * u * ac, ac + mag + va
    o = w @ v
    gp = gamma(4 * N + 8 * nslots + 16).unsqueeze(-1)
    gf = gamma(6 * N + 4 * nslots + 9).unsqueeze(-1)
    e = (torch.expm1(2 * E).unsqueeze(-1) * (w @ va) + w @ torch.where(pv, x1, 2 * uop * va)
         + gp * (w @ torch.where(pv, x2, 0.0)) + gf * (w @ torch.where(pv, 0.0, va))
         + (gamma(3 * N + 2 * nslots + 6) + 2 * u).unsqueeze(-1) * (w @ va)) * (1 + 2.0 ** -10)
    return o, e
