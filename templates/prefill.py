"""Prefill over the quantized past: the layer's store dequantized for positions ``[0, longest length)`` (one
layer at a time, transiently, in the store's rotated space), then PyTorch's fused SDPA over it with the
visibility as a mask, so no ``[n, C]`` score matrix is materialized.

Two operand precisions:

- fp32 (the CPU's path, ``templates.cpu``'s decode kernel beside it): the reference's dequantized values
  exactly, SDPA in fp32;
- the model's dtype, bf16 or fp16 (CUDA's, ``launch.plan``'s "sdpa" kernel for many queries): the query, the
  dequantized keys and values (read back in one Triton pass, ``templates.past``) and an additive mask rounded
  to it (finite values saturated), so SDPA runs the
  tensor cores' kernels the model's own attention runs: FlashAttention where there is no mask other than the
  causal one (aligned to each row's newest position: a chunk over a past), the memory-efficient kernel under
  any other mask. Its error bound: ``templates.attention.reference_and_bound(..., operands=)``.

The causal mask transformers passes is recognised (``_is_causal``) and dropped for SDPA's causal kernels.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.errors import ArgumentError, ArgumentTypeError
from kvcompile.store import (KVState, LayerSpec, Rope, apply_rope, chunk_needed, dequantize_reference, hadamard,
                             stored_chunk, with_chunk)

from .common import inf_to_nan

OPERANDS = (torch.float32, torch.bfloat16, torch.float16)

_MEMO: list = []  # (tensor, its version, what, result): the few most recent masks


def _version(t: Tensor) -> int | None:
    """``t``'s version counter, None for a tensor made under ``torch.inference_mode`` (which has none: it may be
    written in place unseen, so nothing derived from it can be memoised)."""
    return None if t.is_inference() else t._version


def _memo(t: Tensor, what, fn):
    """``fn()``, computed once per mask tensor (and version): every layer of a forward receives the same mask
    object. Entries hold the tensor itself, so a freed mask's address can never be mistaken for a new one. A mask
    made under ``torch.inference_mode`` has no version, so its result is computed afresh at every call."""
    v = _version(t)
    if v is None:
        return fn()
    for e in _MEMO:
        if e[0] is t and e[1] == v and e[2] == what:
            return e[3]
    out = fn()
    _MEMO.insert(0, (t, v, what, out))
    del _MEMO[4:]
    return out


def _is_causal(mask: Tensor, n: int, L: int) -> bool:
    """Whether ``mask[..., :L]`` is exactly the causal mask of ``n`` queries at positions ``[L - n, L)`` (bool,
    or additive 0/-inf), the same for every batch row and head: query ``i`` sees positions ``<= L - n + i``."""
    def check():
        m = mask[..., :L]
        if m.shape[-2:] != (n, L):
            return False
        for r0 in range(0, n, 256):  # in row blocks: no temporary of the mask's full size
            rows = m[..., r0:r0 + 256, :]
            i = torch.arange(L - n + r0, L - n + r0 + rows.shape[-2], device=mask.device).view(-1, 1)
            tri = torch.arange(L, device=mask.device).view(1, -1) <= i
            ok = (rows == tri).all() if rows.dtype == torch.bool else \
                ((rows == 0) == tri).all() & (rows.masked_fill(tri, float("-inf")) == float("-inf")).all()
            if not bool(ok):
                return False
        return True
    return _memo(mask, ("causal", n, L), check)


def _fused_only(on: bool):
    """With ``on`` (CUDA in bf16 / fp16): SDPA's fused kernels only (FlashAttention, memory-efficient), never its
    math fallback, which would materialize every ``[n, C]`` score matrix."""
    if not on:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def dequantized_past(state: KVState, spec: LayerSpec, P: int, operands: torch.dtype, k_new: Tensor | None = None,
                     v_new: Tensor | None = None, n: int = 0, rope: Rope | None = None,
                     kernel: bool = False) -> tuple[Tensor, Tensor]:
    """Positions ``[0, P)`` of the layer as attention reads them, ``[B, H, P, D]`` in ``operands``:
    ``dequantize_reference`` in the store's rotated space, the queries' own chunk (``n`` tokens) in full
    precision where it can be packed, pre-RoPE keys rotated in fp32, then rounded to ``operands`` (finite values
    saturated). ``kernel``: one Triton pass (``templates.past``, the same bits) instead of the reference's
    torch operations."""
    chunk = k_new is not None and chunk_needed(spec, n)
    if kernel:
        from .past import launch_past
        k, v = launch_past(state, spec, P, torch.float32 if rope is not None else operands,
                           stored_chunk(spec, k_new, v_new, n) if chunk else None)
    else:
        k, v = dequantize_reference(state, spec, torch.float32, rotated=True, start=0, end=P)
        if chunk:
            k, v = with_chunk(k, v, state, spec, k_new, v_new)
    if rope is not None:  # pre-RoPE keys: rotated by their positions (this layer, transiently, as the values)
        k = apply_rope(k, rope, torch.arange(P, device=k.device))
    return Q.saturate(k, operands), Q.saturate(v, operands)  # the kernel's: unchanged


def prefill_attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None,
                      scale: float | None, k_new: Tensor | None = None, v_new: Tensor | None = None,
                      rope: Rope | None = None, operands: torch.dtype = torch.float32,
                      kernel: bool = False) -> Tensor:
    """Same contract as ``attention_reference``, for many query rows (prefill and chunked prefill).

    The reference scores ``positions(state, mask)`` positions (the mask's width, or the longest length);
    those past the longest length (or the mask's width) are visible to no query, so the store is dequantized
    for positions ``[0, longest length)`` only, then SDPA attends with a mask over absolute positions: causal
    from each row's length, or the caller's mask. With no mask (or the causal one) and a batch of equal lengths
    it is SDPA's own causal kernel with no mask tensor at all (aligned to the last position: a chunk over a
    past). ``operands``: the precision SDPA computes in (module docstring): fp32, or q's dtype. ``kernel``:
    the past read back by one Triton pass (``dequantized_past``).
    """
    B, Hq, n, D = q.shape
    H = spec.heads
    if Hq % H:
        raise ArgumentError(f"query heads {Hq} are not a multiple of the cache's kv heads {H}")
    if operands not in OPERANDS or operands not in (torch.float32, q.dtype):
        raise ArgumentTypeError(f"prefill attention computes in fp32 or in the query's dtype ({q.dtype}); got "
                                f"operands={operands}")
    lengths = state.lengths.to(torch.int64)
    Lmax = int(lengths.max()) if B else 0
    qf = q.float()
    if spec.policy.rotates_keys:
        qf = qf @ hadamard(D, q.device)
    if Lmax == 0:
        return torch.zeros_like(q)
    k, v = dequantized_past(state, spec, Lmax, operands, k_new, v_new, n, rope, kernel)
    qf = Q.saturate(qf, operands)  # fp32: unchanged
    sm = scale if scale is not None else D ** -0.5
    pos = torch.arange(Lmax, device=q.device).view(1, 1, 1, Lmax)
    Lb = lengths.view(B, 1, 1, 1)
    same = bool((lengths == Lmax).all())
    G = Hq // H
    # non-finite values anywhere (rare): SDPA runs on finite copies, and the reference's NaN rule is applied
    # from where the NaN and inf are (SDPA would spread a masked position's NaN value to rows that do not see
    # it, and a NaN score to the whole row of every kernel block that holds it)
    qfin, kfin, vfin = torch.isfinite(qf).all(-1, keepdim=True), torch.isfinite(k), torch.isfinite(v)
    clean = bool(qfin.all()) and bool(kfin.all()) and bool(vfin.all())
    if mask is not None and same and _is_causal(mask, n, Lmax):
        mask = None  # the model's own causal mask (transformers passes one): SDPA's causal kernel skips half
    tensor_cores = q.device.type == "cuda" and operands != torch.float32
    if mask is None and same and clean:
        if n == Lmax:
            with _fused_only(tensor_cores):
                out = F.scaled_dot_product_attention(qf, k, v, is_causal=True, scale=sm, enable_gqa=G > 1)
        else:  # a chunk over a past: causal from the last position (FlashAttention's own alignment)
            from torch.nn.attention.bias import causal_lower_right
            with _fused_only(tensor_cores):
                out = F.scaled_dot_product_attention(qf, k, v, attn_mask=causal_lower_right(n, Lmax), scale=sm,
                                                     enable_gqa=G > 1)
    else:
        mbad = None
        if mask is None:
            L = Lb[:1] if same else Lb
            vis = visible = pos <= L - n + torch.arange(n, device=q.device).view(1, 1, n, 1)
        else:
            mk = mask[..., :Lmax]
            if mk.shape[-1] < Lmax:  # positions past the mask's width are visible to no query
                mk = F.pad(mk, (0, Lmax - mk.shape[-1]), value=False if mk.dtype == torch.bool else float("-inf"))
            inside = pos < Lb
            if mk.dtype == torch.bool:
                vis = visible = inside & mk
            else:
                mk = Q.saturate(mk.float(), operands)  # SDPA adds a mask in its operands' dtype
                visible = inside & (mk != float("-inf"))  # -inf hides a position (the reference's rule)
                vis = mk.masked_fill(~inside, float("-inf"))
                mbad = _memo(mask, ("nonfinite", Lmax), lambda: bool((mk.isnan() | (mk == float("inf"))).any()))
                mbad = (visible & ~torch.isfinite(mk)) if mbad else None
        if tensor_cores and G > 1:
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # the memory-efficient kernel has no GQA
            kfin, vfin, G = kfin.repeat_interleave(G, 1), vfin.repeat_interleave(G, 1), 1
        if clean and mbad is None:
            with _fused_only(tensor_cores):
                out = F.scaled_dot_product_attention(qf, k, v, attn_mask=vis, scale=sm, enable_gqa=G > 1)
        else:
            if mbad is not None:  # a NaN or +inf mask value makes the score non-finite: its row is NaN below
                vis = vis.masked_fill(mbad, 0.0)
            with _fused_only(tensor_cores):
                out = F.scaled_dot_product_attention(torch.where(torch.isfinite(qf), qf, 0.0),
                                                     torch.where(kfin, k, 0.0), torch.where(vfin, v, 0.0),
                                                     attn_mask=vis, scale=sm, enable_gqa=G > 1)
            seen = visible.expand(B, Hq, n, Lmax).to(operands)
            kbad = (~kfin.all(-1)).repeat_interleave(G, 1).to(operands).unsqueeze(-1)  # [B, Hq, Lmax, 1]
            row = ((seen @ kbad) > 0) | (~qfin & visible.any(-1, keepdim=True))
            if mbad is not None:
                row = row | mbad.any(-1, keepdim=True)
            chan = (seen @ (~vfin).repeat_interleave(G, 1).to(operands)) > 0  # a visible NaN/inf value, per channel
            out = out.masked_fill(row | chan, float("nan"))
        out = out.masked_fill(~visible.any(-1, keepdim=True), 0.0)  # a query row that sees no key gets zeros
    if spec.policy.rotate:
        out = out.float() @ hadamard(D, q.device)
    return Q.saturate(inf_to_nan(out), q.dtype)  # inf -> NaN, as the reference
