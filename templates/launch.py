"""The two entry points ``kvcompile.ops`` calls when its kernels are "triton".

    store(state, spec, k, v)                 -> None            append k, v [B, H, n, D]
    attention(q, state, spec, mask, scale)   -> [B, Hq, n, D]   attention of the last n tokens' queries
                                                                (``rope=``: pre-RoPE keys, rotated in the kernel)

They check shapes, apply the policy's rotation in torch -- keys and values with ``kvcompile.store.rotate``
as ``store_reference`` does; the query in and the output back out as fp32 products with the same Hadamard
matrix, as ``attention_reference`` does -- and launch the kernels of ``templates.store`` /
``templates.attention``. Kernels never rotate, so kernel and reference see identical inputs.
Packed tokens live in blocks named by the state's block table (``kvcompile.store``): the kernels follow it.
Nothing here reads a device tensor on the host when the state is on CUDA, so a decode step can be captured in
a CUDA graph (an append into an unreserved block fails on the device instead); on the CPU (Triton's
interpreter) the checks read ``lengths`` and the table like the reference does.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.store import (CapacityError, KVState, LayerSpec, Rope, _state_capacity_check, check_chunk, check_kv,
                             hadamard, rotate, row_widths, stored_chunk)

from . import attention as _attention
from . import store as _store

MAX_HEAD_DIM = 256  # one head is a single tile in registers
UNRESERVED = ("kvcompile KV cache overflow: an append writes packed tokens into a block that is not reserved in "
              "its sequence's block table (state.table: -1, past the table, or not in the pool). Reserve the "
              "blocks first (KVStore.reserve; KVStore.append does), or allocate a larger store.")


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
    B, table = state.lengths.shape[0], state.table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B:
        raise ValueError(f"the store's block table must be int32 [{B}, blocks]; got {table.dtype} "
                         f"{list(table.shape)}")


def store(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
    """``kvcompile.store.store_reference`` with Triton kernels: append ``k, v [B, H, n, D]`` in place.

    ``n_new`` (int [B], optional): row ``b`` appends only its first ``n_new[b]`` tokens.
    """
    check_supported(spec)
    _check_state(state, spec)
    check_kv(spec, k, v, state.lengths.shape[0])
    B, H, n, D = k.shape
    dev = state.lengths.device
    if n_new is None:
        n_new = torch.full((B,), n, dtype=torch.int32, device=dev)
    else:
        n_new = n_new.to(device=dev, dtype=torch.int32)
    host = dev.type == "cpu" and state.table.device.type == "cpu"
    if host:  # the reference's checks, where reading lengths and the table costs no device sync
        if bool(((n_new < 0) | (n_new > n)).any()):
            raise ValueError(f"n_new={n_new.tolist()} must be within [0, {n}] for a chunk of {n} tokens")
        _state_capacity_check(state, spec, state.lengths, n_new)
        row_widths(state, spec, n_new)  # the rings and sinks reach every position written (a grown store's)
    if n == 0:
        return
    dt = spec.torch_dtype
    k = Q.saturate(rotate(k, spec, keys=True), dt).contiguous()  # as store_reference: finite values clamp, never inf
    v = Q.saturate(rotate(v, spec), dt).contiguous()
    err = _store.launch_store(state, spec, k, v, n_new)
    if not host:  # no host sync on CUDA: an unreserved block is not written, and the device raises
        torch._assert_async(err == 0, UNRESERVED)
    elif int(err):  # a table entry outside the pool (the reference check passed)
        raise CapacityError(UNRESERVED)


def dot_precision(device: torch.device) -> str:
    """Operand precision of the two matrix products: tf32 tensor cores on CUDA (operands rounded to 10
    mantissa bits, fp32 accumulation), exact fp32 elsewhere. ``KVCOMPILE_DOT=ieee|tf32`` overrides."""
    return os.environ.get("KVCOMPILE_DOT") or ("tf32" if device.type == "cuda" else "ieee")


def attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
              scale: float | None = None, *, tiles: tuple[int, int, int] | None = None,
              k_new: Tensor | None = None, v_new: Tensor | None = None, rope: Rope | None = None) -> Tensor:
    """``kvcompile.store.attention_reference`` with Triton kernels.

    q: [B, Hq, n, D], the last n tokens' queries (already stored); Hq a multiple of the store's heads.
    mask: None (causal), or bool / float broadcastable to [B, Hq, n, P] over absolute key positions 0 .. P-1;
    positions past P are invisible (``kvcompile.store.cover``).
    Returns [B, Hq, n, D] in q's dtype. ``tiles`` = (BLOCK_Q, BLOCK_N, NSPLIT) overrides the tiling.
    k_new, v_new: [B, H, n, D], the queries' own chunk, read in full precision at positions [L - n, L).
    rope (``KVStore.rope``): the store holds pre-RoPE keys; the kernel rotates each key it reads by its
    position (``kvcompile.store.apply_rope``).
    """
    check_supported(spec)
    _check_state(state, spec)
    B, Hq, n, D = q.shape
    H = spec.heads
    batch = state.lengths.shape[0]
    if B != batch or D != spec.head_dim or Hq % H:
        raise ValueError(f"attention expects q of shape [{batch}, k*{H}, n, {spec.head_dim}]; got {tuple(q.shape)}")
    if mask is not None:
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise TypeError(f"attention mask must be bool or floating point; got {mask.dtype}")
        mask = mask.expand(B, Hq, n, mask.shape[-1])  # positions past its width are invisible (the kernel)
    check_chunk(q, k_new, v_new, spec)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qr = q.float()
    if spec.policy.rotates_keys:  # as the reference: the query rotated in fp32, the output un-rotated in fp32
        qr = qr @ hadamard(D, q.device)
    chunk = stored_chunk(spec, k_new, v_new, n)
    out = _attention.launch_attention(qr, state, spec, mask, scale, dot_precision(q.device), tiles, chunk, rope)
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device)
        out = torch.where(torch.isfinite(out), out, float("nan"))  # as the reference: inf -> NaN
    return Q.saturate(out, q.dtype)
