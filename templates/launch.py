"""The two entry points ``kvcompile.ops`` calls when its kernels are "triton".

    store(state, spec, k, v)                 -> None            append k, v [B, H, n, D]
    attention(q, state, spec, mask, scale)   -> [B, Hq, n, D]   attention of the last n tokens' queries

They check shapes, apply the policy's rotation in torch -- keys and values with ``kvcompile.store.rotate``
as ``store_reference`` does; the query in and the output back out as fp32 products with the same Hadamard
matrix, as ``attention_reference`` does -- and launch the kernels of ``templates.store`` /
``templates.attention``. Kernels never rotate, so kernel and reference see identical inputs.
Nothing here reads a device tensor on the host when the state is on CUDA, so a decode step can be captured in
a CUDA graph; on the CPU (Triton's interpreter) the capacity check reads ``lengths`` like the reference does.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from kvcompile.store import KVState, LayerSpec, _check_append, check_chunk, hadamard, rotate, stored_chunk

from . import attention as _attention
from . import store as _store

MAX_HEAD_DIM = 256  # one head is a single tile in registers


def check_supported(spec: LayerSpec) -> None:
    """Raise for a layout the Triton kernels do not implement (never fall back silently)."""
    if spec.head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"kvcompile's Triton kernels hold one head in registers and support head_dim <= {MAX_HEAD_DIM}; "
            f"policy {spec.policy.key_str()} was applied to head_dim={spec.head_dim}. Use the reference "
            f"kernels for this layer (kvcompile.ops.set_kernels('reference'))."
        )


def _check_state(state: KVState, spec: LayerSpec) -> None:
    """The kernels index the last dimension with unit stride and everything else through strides."""
    for name, t in zip(state._fields, state):
        if t.numel() and t.dim() > 1 and t.stride(-1) != 1:
            raise ValueError(f"kvcompile store tensor {name} of layout {spec.name} has stride {t.stride()}: the "
                             f"Triton kernels need a unit stride along the last dimension (use spec.allocate()).")


def store(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
    """``kvcompile.store.store_reference`` with Triton kernels: append ``k, v [B, H, n, D]`` in place.

    ``n_new`` (int [B], optional): row ``b`` appends only its first ``n_new[b]`` tokens.
    """
    check_supported(spec)
    _check_state(state, spec)
    B, H, n, D = k.shape
    if (B, H, D) != (spec.batch, spec.heads, spec.head_dim) or v.shape != k.shape:
        raise ValueError(f"store expects k, v of shape [{spec.batch}, {spec.heads}, n, {spec.head_dim}]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    dev = state.lengths.device
    if n_new is None:
        n_new = torch.full((B,), n, dtype=torch.int32, device=dev)
    else:
        n_new = n_new.to(device=dev, dtype=torch.int32)
    if dev.type == "cpu":
        _check_append(spec, state.lengths, n_new)
    else:  # no host sync on CUDA: an overflow fails on the device instead of corrupting memory
        torch._assert_async((state.lengths + n_new <= spec.capacity).all(),
                            f"kvcompile KV cache overflow: capacity is {spec.capacity} tokens")
    if n == 0:
        return
    dt = spec.torch_dtype
    k = rotate(k, spec).to(dt).contiguous()
    v = rotate(v, spec).to(dt).contiguous()
    _store.launch_store(state, spec, k, v, n_new)


def dot_precision(device: torch.device) -> str:
    """Operand precision of the two matrix products: tf32 tensor cores on CUDA (operands rounded to 10
    mantissa bits, fp32 accumulation), exact fp32 elsewhere. ``KVCOMPILE_DOT=ieee|tf32`` overrides."""
    return os.environ.get("KVCOMPILE_DOT") or ("tf32" if device.type == "cuda" else "ieee")


def attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
              scale: float | None = None, *, tiles: tuple[int, int, int] | None = None,
              k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
    """``kvcompile.store.attention_reference`` with Triton kernels.

    q: [B, Hq, n, D], the last n tokens' queries (already stored); Hq a multiple of the store's heads.
    mask: None (causal), or bool / float broadcastable to [B, Hq, n, C] over absolute key positions.
    Returns [B, Hq, n, D] in q's dtype. ``tiles`` = (BLOCK_Q, BLOCK_N, NSPLIT) overrides the tiling.
    k_new, v_new: [B, H, n, D], the queries' own chunk, read in full precision at positions [L - n, L).
    """
    check_supported(spec)
    _check_state(state, spec)
    B, Hq, n, D = q.shape
    H, C = spec.heads, spec.capacity
    if B != spec.batch or D != spec.head_dim or Hq % H:
        raise ValueError(f"attention expects q of shape [{spec.batch}, k*{H}, n, {spec.head_dim}]; got {tuple(q.shape)}")
    if mask is not None:
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise TypeError(f"attention mask must be bool or floating point; got {mask.dtype}")
        mask = mask[..., :C].expand(B, Hq, n, C)
    check_chunk(q, k_new, v_new, spec)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qr = q.float()
    if spec.policy.rotate:  # as the reference: the query rotated in fp32, the output un-rotated in fp32
        qr = qr @ hadamard(D, q.device)
    chunk = stored_chunk(spec, k_new, v_new, n)
    out = _attention.launch_attention(qr, state, spec, mask, scale, dot_precision(q.device), tiles, chunk)
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device)
    return out.to(q.dtype)
