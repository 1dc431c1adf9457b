"""One layer's store read back whole: every position ``[0, P)`` of every sequence dequantized into a dense
``[B, H, P, D]`` tensor in one pass, for ``templates.prefill``'s path on CUDA (SDPA over the dequantized past).

``kvcompile.store.dequantize_reference`` is the specification: ``launch_past`` returns its values rounded to
``dtype`` (finite values saturated, as ``quant.saturate``), bit for bit -- the packed tiles through
``attention._packed_tile`` (the reference's fp32 operations, contraction off), the sinks and the ring as stored,
positions a sequence does not hold zero, and with ``chunk`` the queries' own positions ``[L - n, L)`` from it
(``store.with_chunk``). The reference takes a dozen passes over the past in fp32 and a loop over the sequences;
this one reads each packed byte once and writes the result once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompile.store import KVState, LayerSpec

from kvcompile.errors import ArgumentTypeError

from .attention import _full_tile, _packed_tile, layout_constexprs, state_args
from .common import run
from .store import _boundary

_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _saturate(x, OUT: tl.constexpr):
    """fp32 ``x`` rounded to the output dtype (to nearest, ties to even), finite values beyond its range
    clamped to its largest (``quant.saturate``); NaN and infinities pass. bf16 comes back as its bits (int16),
    rounded in integer arithmetic: Triton's interpreter truncates a bf16 cast, the GPU rounds it."""
    if OUT == 1:
        big: tl.constexpr = 3.3895313892515355e38
        x = tl.where((tl.abs(x) > big) & (tl.abs(x) < float("inf")), tl.where(x > 0, big, -big), x)
        bits = x.to(tl.int32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even (the carry may reach inf)
        return tl.where(x != x, 0x7FC0, up).to(tl.int16)
    elif OUT == 2:
        big: tl.constexpr = 65504.0
        x = tl.where((tl.abs(x) > big) & (tl.abs(x) < float("inf")), tl.where(x > 0, big, -big), x)
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _past_tile(out, codes, scale, zero, ring, sink, own, b, h, t, L, QL, blk, n, P,
               so_b, so_h, so_t, sc_nb, sc_h, sc_t, ss_nb, ss_h, ss_t, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t,
               H, D: tl.constexpr, DB: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BS: tl.constexpr,
               KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr, CHANNEL: tl.constexpr, G: tl.constexpr,
               SFMT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, OUT: tl.constexpr):
    """One tile of keys or values (``_past_kernel``), read and stored."""
    c = tl.arange(0, DB)
    offs = tl.arange(0, BLOCK_N)
    cok = (c < D)[None, :]
    base = out + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + c[None, :]
    chunk = own + (b.to(tl.int64) * H + h) * n * D
    if t == 0:
        if S > 0:
            sk = sink + b.to(tl.int64) * ssk_b + h.to(tl.int64) * ssk_h
            for s0 in range(0, S, BLOCK_N):
                p = s0 + offs
                ok = (p < tl.minimum(S, L)) & (p < P)
                x = _full_tile(sk, p, ok, ssk_t, D, DB)
                if CHUNK:
                    mine = ok & (p >= L - n)
                    x = tl.where(mine[:, None], _full_tile(chunk, p - (L - n), mine, D, D, DB), x)
                x = tl.where(ok[:, None], x, 0.0)  # positions past the row's length: zeros
                tl.store(base + p.to(tl.int64)[:, None] * so_t, _saturate(x, OUT),
                         mask=(p < tl.minimum(S, P))[:, None] & cok)
    else:
        start = S + (t - 1) * BLOCK_N
        p = start + offs
        inside = p < P
        packed = (p < QL) & inside
        x = tl.zeros([BLOCK_N, DB], tl.float32)
        if start < QL:  # the tile lies in one block: rows j % BS .. of block ``blk``
            idx = (start - S) % BS + offs
            s0 = blk * ss_nb + h.to(tl.int64) * ss_h
            xp = _packed_tile(codes + blk * sc_nb + h.to(tl.int64) * sc_h, scale + s0, zero + s0, idx, packed,
                              sc_t, ss_t, D, DB, BLOCK_N, KIND, BITS, E4M3, CHANNEL, G, SFMT)
            x = tl.where(packed[:, None], xp, x)
        if W > 0:
            live = (p >= QL) & (p < L) & inside
            rp = ring + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
            x = tl.where(live[:, None], _full_tile(rp, p % W, live, sr_t, D, DB), x)
        if CHUNK:
            mine = (p >= L - n) & (p < L) & inside
            x = tl.where(mine[:, None], _full_tile(chunk, p - (L - n), mine, D, D, DB), x)
        tl.store(base + p.to(tl.int64)[:, None] * so_t, _saturate(x, OUT), mask=inside[:, None] & cok)


@triton.jit
def _past_kernel(
    k_out, v_out, kc, ks, kz, vc, vs, vz, kr, vr, ksk, vsk, len_ptr, tbl_ptr, kn, vn,
    so_b, so_h, so_t,  # k_out / v_out [B, H, P, D] (unit stride along D)
    skc_nb, skc_h, skc_t, sks_nb, sks_h, sks_t,  # key codes, key scale/zero: per block [NB, H, ...]
    svc_nb, svc_h, svc_t, svs_nb, svs_h, svs_t,  # value codes, value scale/zero
    sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t,  # rings, sinks (keys and values share strides)
    st_b,  # block table [B, MB]
    H, n, P,  # kn, vn: the chunk [B, H, n, D] fp32, contiguous (CHUNK)
    D: tl.constexpr, DB: tl.constexpr, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr, W: tl.constexpr,
    BS: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_E4M3: tl.constexpr, K_CHANNEL: tl.constexpr, K_G: tl.constexpr,
    K_SFMT: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_E4M3: tl.constexpr, V_CHANNEL: tl.constexpr, V_G: tl.constexpr,
    V_SFMT: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, OUT: tl.constexpr,
):
    """Program (b*H + h, tile): tile 0 the sinks ``[0, S)``, tile t > 0 the positions ``S + (t-1) BLOCK_N ..``
    (within one block: BLOCK_N divides BS), each packed, in the ring, in the chunk, or past the row's length
    (zeros); the keys' tile, then the values'."""
    bh = tl.program_id(0)
    t = tl.program_id(1)
    b = bh // H
    h = bh % H
    L = tl.load(len_ptr + b)
    QL = _boundary(L, S, R, F)
    start = S + tl.maximum(t - 1, 0) * BLOCK_N
    # the tile's block (a tile with no packed position reads none: its table entry may not be reserved)
    blk = tl.load(tbl_ptr + b.to(tl.int64) * st_b + (start - S) // BS, mask=(t > 0) & (start < QL), other=0)
    blk = blk.to(tl.int64)
    _past_tile(k_out, kc, ks, kz, kr, ksk, kn, b, h, t, L, QL, blk, n, P, so_b, so_h, so_t,
               skc_nb, skc_h, skc_t, sks_nb, sks_h, sks_t, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t, H,
               D, DB, S, W, BS, K_KIND, K_BITS, K_E4M3, K_CHANNEL, K_G, K_SFMT, BLOCK_N, CHUNK, OUT)
    _past_tile(v_out, vc, vs, vz, vr, vsk, vn, b, h, t, L, QL, blk, n, P, so_b, so_h, so_t,
               svc_nb, svc_h, svc_t, svs_nb, svs_h, svs_t, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t, H,
               D, DB, S, W, BS, V_KIND, V_BITS, V_E4M3, V_CHANNEL, V_G, V_SFMT, BLOCK_N, CHUNK, OUT)


def tile_tokens(spec: LayerSpec) -> int:
    """Positions per program: the largest power of two up to 64 that divides the store's block (a packed
    tile lies in one block)."""
    bn = 64
    while spec.block % bn:
        bn //= 2
    return bn


def launch_past(state: KVState, spec: LayerSpec, P: int, dtype: torch.dtype,
                chunk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(k, v)`` ``[B, H, P, D]`` in ``dtype`` (fp32, bf16 or fp16): ``dequantize_reference(state, spec,
    rotated=True, end=P)`` (with ``chunk``, fp32 ``[B, H, n, D]`` contiguous as ``store.stored_chunk`` gives
    it: ``with_chunk``'s), rounded to ``dtype`` as ``quant.saturate`` rounds."""
    if dtype not in _OUT:
        raise ArgumentTypeError(f"launch_past writes fp32, bf16 or fp16; got {dtype}")
    B, H, D = state.lengths.shape[0], spec.heads, spec.head_dim
    dev = state.lengths.device
    k = torch.empty(B, H, P, D, dtype=dtype, device=dev)
    v = torch.empty(B, H, P, D, dtype=dtype, device=dev)
    if B == 0 or P == 0:
        return k, v
    bn = tile_tokens(spec)
    n = 0 if chunk is None else chunk[0].shape[2]
    bits = dtype == torch.bfloat16  # written as int16 bits (``_saturate``)
    args = dict(
        k_out=k.view(torch.int16) if bits else k, v_out=v.view(torch.int16) if bits else v, **state_args(state),
        kn=state.lengths if chunk is None else chunk[0], vn=state.lengths if chunk is None else chunk[1],
        so_b=k.stride(0), so_h=k.stride(1), so_t=k.stride(2), H=H, n=n, P=P,
        **layout_constexprs(spec.policy, D, spec.sink, spec.flush, spec.ring, spec.block),
        BLOCK_N=bn, CHUNK=chunk is not None, OUT=_OUT[dtype],
    )
    run(_past_kernel, (B * H, 1 + triton.cdiv(max(P - spec.sink, 0), bn)), args, num_warps=8)
    return k, v
