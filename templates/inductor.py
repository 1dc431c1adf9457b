"""Attention over the packed store written as plain torch ops with static shapes, for Inductor to fuse.

On the CPU there are no Triton kernels (Triton's CPU path here is an interpreter), so the fast CPU path is
Inductor's generated C++: this function has the exact semantics of ``store.attention_reference`` but every
shape is static (the packed region spans the block table's reach, ``MB * BS`` tokens, not the current
lengths) and every step is an elementwise op, an indexing op (constant indices, or the block table's), or a
reduction. Packed rows are gathered through the block table (row ``r`` of sequence ``b``: block
``table[b, r // BS]``, row ``r % BS``), an indirect load Inductor folds into the loads that read it. Traced
inside a compiled graph, Inductor fuses the gather, the bit unpacking, the dequantization and the region
selection (sink / packed / residual ring) into the loads of the score and output reductions, so a decode
step materializes no full-precision copy of the cache, nor a gathered copy of its codes. With more
than ``UNROLL_ROWS`` query rows per KV head (prefill chunks) the planes are dequantized once per layer,
transiently, and multiplied as matrices: enough queries share them that this is the faster form.

Called eagerly it is a (slow) second reference; tests check it equals ``attention_reference``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.store import KVState, LayerSpec, Rope, apply_rope, hadamard, stored_chunk


def _planes(codes: Tensor, bits: int, D: int) -> list[Tensor]:
    """uint8 [..., D*bits/8] -> ``per`` int32 planes [..., D/per]; plane ``i`` holds the codes of channels
    ``d = j*per + i``. Each plane is a constant shift of contiguous bytes, so Inductor vectorizes it; an
    interleaved [..., D] unpack would need a per-element shift and stays scalar (5-10x slower here)."""
    if bits == 8:
        return [codes.to(torch.int32)]
    per = 8 if bits == 3 else 8 // bits
    nb = per * bits // 8
    u = codes.to(torch.int32).unflatten(-1, (D // per, nb))
    word = u[..., 0]
    for j in range(1, nb):
        word = word | (u[..., j] << (8 * j))
    return [(word >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]


def _paged(t: Tensor, table: Tensor, BS: int, per: int = 1) -> Tensor:
    """Pool tensor ``t [NB, H, BS / per, Y]`` (one row per ``per`` tokens) -> the row of each of a
    sequence's packed tokens, in order, through the block table ``[B, MB]``: ``[B, H, MB * BS, Y]``. Token
    ``r`` reads row ``(r % BS) // per`` of block ``table[b, r // BS]``; unreserved entries (-1) read block 0,
    at positions the caller masks out (past every ``Q(L)``). Per token even for per-channel scales (``per`` =
    the group): one indirect load Inductor folds into its consumer, where a per-group gather then expanded
    to tokens would be materialized."""
    B, MB = table.shape
    H = t.shape[1]
    r = torch.arange(MB * BS, device=t.device)
    blk = table.long().clamp(min=0)[:, r // BS]  # [B, MB*BS]
    return t[blk.view(B, 1, -1), torch.arange(H, device=t.device).view(1, H, 1), ((r % BS) // per).view(1, 1, -1)]


def _plane_params(t: Tensor, q, D: int, per: int) -> list[Tensor]:
    """Per-token scale/zero rows [B, H, Cq, D/g] (axis token) or [B, H, Cq, D] (axis channel: each token's
    group's row, ``_paged``) -> per plane, broadcastable to [B, H, Cq, D/per]."""
    t = t.float()
    if q.axis == "channel":  # channel j*per+i of plane i
        return [t[..., i::per] for i in range(per)]
    g = q.group_for(D)  # [B, H, Cq, D/g]; channel j*per+i lies in group (j*per+i)//g
    idx = [(torch.arange(D // per) * per + i) // g for i in range(per)]
    return [t[..., ix.to(t.device)] for ix in idx]


def _dequantized_planes(codes, scale, zero, q, D: int) -> tuple[list[Tensor], int]:
    """Packed region -> (``per`` fp32 planes [B, H, Cq, D/per], per). fp8 with one fixed scale (axis="tensor"):
    the codes' values, no scale (``scale`` is unused); a poisoned token-head's NaN codes read NaN, as torch's fp8
    conversion reads them."""
    if not q.quantized:
        return [codes.float()], 1
    planes = _planes(codes, q.bits, D)
    per = len(planes)
    if not q.stores_scale:
        return [c.to(torch.uint8).view(Q.FP8_DTYPES[q.format]).float() for c in planes], per
    s = _plane_params(scale, q, D, per)
    if q.is_fp8:
        return [c.to(torch.uint8).view(Q.FP8_DTYPES[q.format]).float() * si for c, si in zip(planes, s)], per
    if q.symmetric:
        return [(c - 2 ** (q.bits - 1)).float() * si for c, si in zip(planes, s)], per
    z = _plane_params(zero, q, D, per)
    if q.zero_counts_steps:  # an int8 zero point counts steps: (code - zero) * scale
        return [(c.float() - zi) * si for c, si, zi in zip(planes, s, z)], per
    return [c.float() * si + zi for c, si, zi in zip(planes, s, z)], per


UNROLL_ROWS = 16  # up to this many query rows per KV head, one fused reduction each (decode under GQA)


def attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None, scale: float | None,
              k_new: Tensor | None = None, v_new: Tensor | None = None, rope: Rope | None = None) -> Tensor:
    """Same contract as ``kvcompile.store.attention_reference`` (q: [B, Hq, n, D] -> [B, Hq, n, D]).

    ``rope``: pre-RoPE keys, rotated by their positions (``apply_rope``) as each region's keys are read.

    Scores are computed per region (sink, packed, residual ring, and the queries' own chunk where it is
    already packed), each with the absolute position of its entries, then one softmax runs over all of them;
    the regions are never copied into one sequence.
    """
    B, Hq, n, D = q.shape
    H, S, W, BS = spec.heads, spec.sink, spec.ring, spec.block
    Cq = state.table.shape[1] * BS if state.k_codes.shape[0] else 0  # the packed positions the table reaches
    G = Hq // H
    pol = spec.policy
    dev = q.device
    L = state.lengths.to(torch.int64).view(B, 1)
    qb = S + torch.div(torch.clamp(L - S - pol.residual, min=0), spec.flush, rounding_mode="floor") * spec.flush
    qf = q.float()
    if pol.rotates_keys:
        qf = qf @ hadamard(D, dev)
    qg = qf.reshape(B, H, G * n, D)
    sc_scale = scale if scale is not None else 1.0 / math.sqrt(D)

    regions = []  # (key planes, value planes, positions [B, R], valid [B, R]); planes: ([B,H,R,D/per]..., per)
    Sa, Wa = state.k_sink.shape[2], state.k_res.shape[2]  # the rows as far as they have grown (a KVStore's grow)
    if Sa:
        p = torch.arange(Sa, device=dev).view(1, Sa).expand(B, Sa)
        regions.append((([state.k_sink.float()], 1), ([state.v_sink.float()], 1), p, p < L))
    chunk = stored_chunk(spec, k_new, v_new, n) if Cq else None
    if Cq:
        p = (torch.arange(Cq, device=dev) + S).view(1, Cq).expand(B, Cq)
        held = (p < qb) & (p < L - n) if chunk is not None else p < qb
        planes = []
        for codes, scale, zero, qz in ((state.k_codes, state.k_scale, state.k_zero, pol.key),
                                       (state.v_codes, state.v_scale, state.v_zero, pol.value)):
            per_row = qz.group if qz.quantized and qz.axis == "channel" else 1  # tokens per scale row
            codes = _paged(codes, state.table, BS)
            if qz.stores_scale:  # (axis="tensor": none stored, the scale is 1.0)
                scale = _paged(scale, state.table, BS, per_row)
                zero = _paged(zero, state.table, BS, per_row) if qz.has_zero else zero
            planes.append(_dequantized_planes(codes, scale, zero, qz, D))
        regions.append((planes[0], planes[1], p, held))
    if chunk is not None:  # the chunk's packed positions, as stored (sinks and ring hold it already)
        p = L - n + torch.arange(n, device=dev).view(1, n)
        regions.append((([chunk[0]], 1), ([chunk[1]], 1), p, (p >= S) & (p < qb)))
    if Wa:
        w = torch.arange(Wa, device=dev).view(1, Wa)
        p = w + W * torch.div(L - 1 - w, W, rounding_mode="floor")  # the newest position in slot w
        regions.append((([state.k_res.float()], 1), ([state.v_res.float()], 1), p, (p >= qb) & (p >= S) & (p >= 0)))

    scores, values, row_nan = [], [], []
    for k, v, p, valid in regions:
        kp, per = k
        if rope is not None:  # natural order (re-interleave the planes: channel j*per + i), rotated per position
            kn = kp[0] if per == 1 else torch.stack(kp, dim=-1).flatten(-2)
            kp, per = [apply_rope(kn, rope, p)], 1
        # mul + sum per plane (not a matmul) so the unpacking, dequantizing loads fuse into the reduction
        # One reduction per query row sharing a KV head (G*n of them), each a mul + sum over the planes: the
        # same loop nest computes them all, so each packed key is unpacked and dequantized once, not G times.
        # With many query rows (prefill) the dequantized planes are shared by enough queries that a matmul
        # (which materializes them once per layer, transiently) wins, and unrolled rows would swamp Inductor.
        if qg.shape[2] <= UNROLL_ROWS:
            rows = [sum((qg[:, :, r, i::per].unsqueeze(-2) * kp[i]).sum(-1) for i in range(per))
                    for r in range(qg.shape[2])]
            sc = torch.stack(rows, dim=2) * sc_scale
        else:
            sc = sum(qg[..., i::per] @ kp[i].transpose(-1, -2) for i in range(per)) * sc_scale
        sc = sc.view(B, Hq, n, -1)
        vis = valid.view(B, 1, 1, -1)
        if mask is None:
            qpos = L.view(B, 1, 1, 1) - n + torch.arange(n, device=dev).view(1, 1, n, 1)
            vis = vis & (p.view(B, 1, 1, -1) <= qpos)
        else:
            vis = vis & (p < mask.shape[-1]).view(p.shape[0], 1, 1, -1)  # past the mask's width: invisible
            mk = mask.expand(mask.shape[0], mask.shape[1], n, mask.shape[-1])
            idx = p.clamp(0, mask.shape[-1] - 1).view(p.shape[0], 1, 1, -1)
            idx = idx.expand(mk.shape[0] if mk.shape[0] == B else B, mk.shape[1], n, idx.shape[-1])
            mk = mk.expand(B, mk.shape[1], n, mk.shape[-1]).gather(-1, idx)
            if mk.dtype == torch.bool:
                vis = vis & mk
            else:
                mk = mk.float()
                vis = vis & (mk != float("-inf"))  # -inf hides a position (attention_reference)
                sc = sc + mk
        # non-finite values (attention_reference): a visible non-finite score makes the row NaN and takes no
        # part in the softmax; a visible non-finite value makes its channel NaN; hidden positions are never read
        ok = torch.isfinite(sc)
        row_nan.append((vis & ~ok).any(-1, keepdim=True))
        scores.append(sc.masked_fill(~(vis & ok), float("-inf")))
        values.append(v)
    sc = torch.cat(scores, dim=-1)
    m = sc.amax(-1, keepdim=True)
    e = torch.exp(sc - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    den = e.sum(-1, keepdim=True)
    prob = e / torch.where(den > 0, den, torch.ones_like(den))  # a query that sees nothing gets zeros
    # a position takes part in the values when its masked score is > -inf: it is visible and its score finite
    # (a visible position with a non-finite score has made the row NaN already). Reading the scores, not the
    # visibility again, keeps the unpacking loads fused into the value reduction.
    live = sc > float("-inf")
    out, at = 0, 0
    for vp, per in values:
        R = vp[0].shape[2]
        pr = prob[..., at:at + R].reshape(B, H, G * n, R).unsqueeze(-1)
        lv = live[..., at:at + R].reshape(B, H, G * n, R).unsqueeze(-1)
        if pr.shape[2] <= UNROLL_ROWS:  # per query row, sharing the value loads; hidden positions dropped
            planes = [torch.stack([torch.where(lv[:, :, r], pr[:, :, r] * v, 0.0).sum(-2)
                                   for r in range(pr.shape[2])], dim=2) for v in vp]
        else:  # [B, H, G*n, D/per] each; a visible NaN/inf value makes its channel NaN
            planes = [(pr.squeeze(-1) @ torch.where(torch.isfinite(v), v, 0.0)).masked_fill(
                (lv.squeeze(-1).float() @ (~torch.isfinite(v)).float()) > 0, float("nan")) for v in vp]
        out = out + torch.stack(planes, dim=-1).flatten(-2)  # re-interleave: channel j*per + i
        at += R
    out = out.view(B, Hq, n, D).masked_fill(torch.stack(row_nan).any(0), float("nan"))
    if pol.rotate:
        out = out @ hadamard(D, dev)
    return Q.saturate(torch.where(torch.isfinite(out), out, float("nan")), q.dtype)  # inf -> NaN
