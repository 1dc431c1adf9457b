"""The two entry points ``kvcompile.ops`` calls when its kernels are "triton".

    store(state, spec, k, v)                 -> None            append k, v [B, H, n, D]
    attention(q, state, spec, mask, scale)   -> [B, Hq, n, D]   attention of the last n tokens' queries
                                                                (``rope=``: pre-RoPE keys, rotated in the kernel)

They check shapes, apply the policy's rotation -- keys and values with ``kvcompile.store.rotate`` as
``store_reference`` does (on CUDA its Triton kernel, ``templates.rotate``: the specification's bits); the query in
and the output back out as fp32 products with the same Hadamard matrix, as ``attention_reference`` does -- and
launch the kernels of ``templates.store`` / ``templates.decode`` / ``templates.attention``, or on CUDA for many
queries ``templates.prefill``'s path (SDPA's fused kernels over the dequantized store, in the query's dtype). The
store and attention kernels never rotate, so kernel and reference see identical inputs.
Packed tokens live in blocks named by the state's block table (``kvcompile.store``): the kernels follow it.
Nothing here reads a device tensor on the host when the state is on CUDA, so a decode step can be captured in
a CUDA graph (an append into an unreserved block fails on the device instead), except the prefill path, which
sizes the dequantized past by the longest length; on the CPU (Triton's interpreter) the checks read ``lengths``
and the table like the reference does.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.errors import ArgumentError, UnsupportedError
from kvcompile.store import (CapacityError, KVState, LayerSpec, Rope, _state_capacity_check, check_chunk, check_kv,
                             hadamard, rotate, row_widths, stored_chunk)

from . import attention as _attention
from . import common as _common
from . import decode as _decode
from . import prefill as _prefill
from . import store as _store
from kvcompile.errors import ArgumentTypeError, Unimplemented

MAX_HEAD_DIM = 256  # one head is a single tile in registers
UNRESERVED = ("kvcompile KV cache overflow: an append writes packed tokens into a block that is not reserved in "
              "its sequence's block table (state.table: -1, past the table, or not in the pool). Reserve the "
              "blocks first (KVStore.reserve; KVStore.append does), or allocate a larger store.")
# The same, for ``torch._assert_async`` on CUDA, which refuses messages of 255 characters or more ("Message
# length must be smaller than 255": every GPU store raised that on the first H200 run, 2026-12-04).
UNRESERVED_DEVICE = ("kvcompile KV cache overflow: an append wrote into a block its sequence's table does not "
                     "reserve. Reserve blocks first (KVStore.reserve), or allocate a larger store.")


def check_supported(spec: LayerSpec) -> None:
    """Raise for a layout the Triton kernels do not implement (never fall back silently)."""
    if spec.head_dim > MAX_HEAD_DIM:
        raise Unimplemented(
            f"kvcompile's Triton kernels hold one head in registers and support head_dim <= {MAX_HEAD_DIM}; "
            f"policy {spec.policy.key_str()} was applied to head_dim={spec.head_dim}. Use the reference "
            f"kernels for this layer (kvcompile.ops.set_kernels('reference'))."
        )


def check_devices(state: KVState, **tensors: Tensor | None) -> None:
    """Every tensor a kernel reads must be on the store's device (``state.lengths``'s), and that device one the
    kernels run on: CUDA, or the CPU under Triton's interpreter (or ``common.compile_only``). A tensor elsewhere
    fails here with its name, not inside Triton ("Pointer argument cannot be accessed from Triton")."""
    dev = state.lengths.device
    named = [(f"state.{f}", t) for f, t in zip(state._fields, state)] + list(tensors.items())
    for name, t in named:
        if t is not None and t.device != dev:
            raise ArgumentError(f"kvcompile's Triton kernels read every tensor on one device: {name} is on "
                                f"{t.device}, the store on {dev}. Move it there (.to({str(dev)!r})).")
    if dev.type != "cuda" and not _common.INTERPRET and _common._compiler is None:
        raise ArgumentError(f"kvcompile's Triton kernels run on CUDA tensors; this store is on {dev}. Use the C "
                            f"kernels there (kvcompile.ops.set_kernels('cpu')), or TRITON_INTERPRET=1 for Triton's "
                            f"interpreter.")


def _check_state(state: KVState, spec: LayerSpec) -> None:
    """The kernels index the last dimension with unit stride and everything else through strides."""
    for name, t in zip(state._fields, state):
        if t.numel() and t.dim() > 1 and t.stride(-1) != 1:
            raise ArgumentError(f"kvcompile store tensor {name} of layout {spec.name} has stride {t.stride()}: the "
                             f"Triton kernels need a unit stride along the last dimension (use spec.allocate()).")
    B, table = state.lengths.shape[0], state.table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B:
        raise ArgumentError(f"the store's block table must be int32 [{B}, blocks]; got {table.dtype} "
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
            raise ArgumentError(f"n_new={n_new.tolist()} must be within [0, {n}] for a chunk of {n} tokens")
        _state_capacity_check(state, spec, state.lengths, n_new)
        row_widths(state, spec, n_new)  # the rings and sinks reach every position written (a grown store's)
    check_devices(state, k=k, v=v)
    if n == 0:
        return
    dt = spec.torch_dtype
    k = Q.saturate(rotate(k, spec, keys=True), dt).contiguous()  # as store_reference: finite values clamp, never inf
    v = Q.saturate(rotate(v, spec), dt).contiguous()
    err = _store.launch_store(state, spec, k, v, n_new)
    if not host:  # no host sync on CUDA: an unreserved block is not written, and the device raises
        torch._assert_async(err == 0, UNRESERVED_DEVICE)
    elif int(err):  # a table entry outside the pool (the reference check passed)
        raise CapacityError(UNRESERVED)


class Plan(NamedTuple):
    """What ``attention`` launches for a call: the decode kernel (``templates.decode``) or the general one
    (``templates.attention``), with its tiles, or with ``sdpa`` the prefill path (``templates.prefill``: SDPA
    over the dequantized store, operands in the query's dtype; no tiles of ours). ``nsplit``: the partial
    results merged per query row (the decode kernel's full-precision program included), as
    ``reference_and_bound`` counts them."""

    decode: bool
    block_q: int
    block_n: int
    nsplit: int
    positions: int
    slots: int
    sdpa: bool = False


# Queries a row from which CUDA runs prefill as SDPA over the dequantized store in bf16 / fp16 (FlashAttention's
# tensor-core arithmetic, the model's own): reading the past back (templates.past) costs a pass over it, a small
# part of attending to it from this many queries; fewer queries read the packed bytes in the general kernel.
SDPA_QUERIES = 64


def plan(state: KVState, spec: LayerSpec, q_shape, mask: Tensor | None = None, tiles=None, rope: bool = False,
         kernel: str = "auto", device: torch.device | None = None, chunk: bool = False,
         invariant: bool = False, dtype: torch.dtype | None = None) -> Plan:
    """The kernel and tiles ``attention`` uses for queries of shape ``q_shape`` and ``dtype`` (host-known sizes
    only); ``chunk``: the queries' own keys and values are read from the chunk (``stored_chunk`` gave them);
    ``invariant``: the decode kernel's row-invariant splits (``decode.decode_tiles``), or for a layout it does not
    serve the general kernel without splits (one program a row: tiles from position 0, to the row's own end).
    "auto" takes the prefill path (``sdpa``) on CUDA for ``SDPA_QUERIES`` queries or more in bf16 / fp16 (head_dim
    a multiple of 8, as SDPA's fused kernels read it), not with ``tiles`` or ``invariant``."""
    if kernel not in ("auto", "decode", "general", "sdpa"):
        raise ArgumentError(f"attention kernel={kernel!r} is not valid: expected 'auto', 'decode', 'general' or "
                            f"'sdpa'")
    if invariant and kernel == "sdpa":
        raise ArgumentError("row-invariant attention runs on the decode kernel or the general one, not kernel='sdpa' "
                            "(SDPA's result for a row may depend on the batch beside it)")
    B, Hq, n, D = q_shape
    G = Hq // spec.heads
    device = device or state.lengths.device
    positions = _attention.position_bound(state, spec, mask)
    if kernel == "sdpa" or (kernel == "auto" and device.type == "cuda" and n >= SDPA_QUERIES and D % 8 == 0
                            and dtype in (torch.bfloat16, torch.float16) and tiles is None and not invariant):
        return Plan(False, n, 0, 1, positions, max(positions, 1), True)  # slots: SDPA's rescales, at most
    layout = _decode.decode_layout(spec, n, rope, G) if kernel != "general" else None
    if kernel == "decode" and layout is None:
        raise ArgumentError(f"the decode kernel does not serve {n} queries over {spec.name}"
                         f"{' with pre-RoPE keys' if rope else ''} (templates.decode.decode_layout)")
    if layout is not None:
        block_n, nsplit = _decode.decode_tiles(spec, G, B, positions, device, tiles and (tiles[1], tiles[2]),
                                               invariant)
        full = spec.sink > 0 or spec.ring > 0 or chunk
        return Plan(True, 1, block_n, nsplit, positions, nsplit + int(full))
    bq, bn, ns = tiles or _attention.default_tiles(spec, n, G, device, B, positions)
    if invariant and n == 1:
        # a layout the decode kernel does not serve (int3, groups inside a byte, ...): one program a row, no splits.
        # Its tiles start at position 0 and are sized by the layout alone, and its loop ends at the row's own end,
        # so a row's result depends on that row alone
        if tiles and ns != 1:
            raise ArgumentError(f"row-invariant attention over {spec.name} runs on the general kernel, whose rows "
                                f"take no splits: got tiles={tuple(tiles)}; give NSPLIT 1")
        ns = 1
    return Plan(False, bq, min(bn, spec.block), ns, positions, ns)


def stored_chunk_needed(spec: LayerSpec, n: int) -> bool:
    from kvcompile.store import chunk_needed
    return chunk_needed(spec, n)


def reference_and_bound(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
                        scale: float | None = None, *, tiles=None, k_new: Tensor | None = None,
                        v_new: Tensor | None = None, rope: Rope | None = None, kernel: str = "auto",
                        device=None, invariant: bool = False) -> tuple[Tensor, Tensor]:
    """``templates.attention.reference_and_bound`` for what ``attention`` runs on ``device`` (default: the
    state's) with these arguments: the kernel, its splits and operand precision as ``plan`` chooses them.
    """
    device = torch.device(device) if device is not None else state.lengths.device
    pl = plan(state, spec, q.shape, mask, tiles, rope is not None, kernel, device,
              k_new is not None and stored_chunk_needed(spec, q.shape[2]), invariant, q.dtype)
    return _attention.reference_and_bound(q, state, spec, mask, scale, nsplit=pl.slots,
                                          dot=dot_precision(device), k_new=k_new, v_new=v_new, rope=rope,
                                          decode=pl.decode, pdot=packed_precision(device),
                                          operands=q.dtype if pl.sdpa else None)


def packed_precision(device: torch.device) -> str:
    """Operand precision of the general kernel's products at packed positions (prefill over the quantized
    past): bf16 on CUDA (the tensor cores' fast path, fp32 accumulation), else ``dot_precision``'s.
    ``KVCOMPILE_PACKED_DOT=ieee|tf32|bf16`` overrides (the interpreter runs the GPU's bf16 path with it). The
    decode kernel's packed positions are always bf16."""
    return os.environ.get("KVCOMPILE_PACKED_DOT") or ("bf16" if device.type == "cuda" else dot_precision(device))


def dot_precision(device: torch.device) -> str:
    """Operand precision of the two matrix products at full-precision positions (sinks, the ring, the queries'
    own chunk, format "none"): tf32 tensor cores on CUDA (operands rounded to 10 mantissa bits, fp32
    accumulation), exact fp32 elsewhere. ``KVCOMPILE_DOT=ieee|tf32`` overrides. Packed positions:
    ``packed_precision``."""
    return os.environ.get("KVCOMPILE_DOT") or ("tf32" if device.type == "cuda" else "ieee")


def attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
              scale: float | None = None, *, tiles: tuple[int, int, int] | None = None,
              k_new: Tensor | None = None, v_new: Tensor | None = None, rope: Rope | None = None,
              kernel: str = "auto", invariant: bool = False, groups: Tensor | None = None) -> Tensor:
    """``kvcompile.store.attention_reference`` with Triton kernels.

    q: [B, Hq, n, D], the last n tokens' queries (already stored); Hq a multiple of the store's heads.
    mask: None (causal), or bool / float broadcastable to [B, Hq, n, P] over absolute key positions 0 .. P-1;
    positions past P are invisible (``kvcompile.store.cover``).
    Returns [B, Hq, n, D] in q's dtype. ``tiles`` = (BLOCK_Q, BLOCK_N, NSPLIT) overrides the tiling (the decode
    kernel takes BLOCK_N and NSPLIT from it).
    k_new, v_new: [B, H, n, D], the queries' own chunk, read in full precision at positions [L - n, L).
    rope (``KVStore.rope``): the store holds pre-RoPE keys; the kernel rotates each key it reads by its
    position (``kvcompile.store.apply_rope``).
    kernel: "auto" (``plan``: the decode kernel where it serves the call, on CUDA the prefill path for many
    queries in bf16 / fp16, else the general one), "decode", "general" or "sdpa" (``templates.prefill`` with
    operands in q's dtype, on any device) to compare them; "decode" raises where it cannot serve the call.
    invariant: each row's result depends on that row alone, not on the batch beside it (the decode kernel's
    row-invariant splits and an in-order merge: ``decode.decode_tiles``; where the decode kernel does not serve the
    layout, the general kernel with one program a row), as the C kernels' always does; one query per row (an
    engine's flat batch, each query a row: ``kvcompile.pages``). Else the splits fill the GPU.
    groups: int32 ``[g + 1]`` offsets, rows ``groups[i] .. groups[i + 1] - 1`` positions of one sequence in
    ascending order, one block table (``common.check_groups``: the offsets at the call; the tables and lengths at
    the call on the CPU, on a GPU by a device assert, no host sync): with ``invariant`` a program of the decode
    kernel reads a packed tile once for several of them (``decode.run_rows``). The same bits as without ``groups``.
    """
    check_supported(spec)
    _check_state(state, spec)
    B, Hq, n, D = q.shape
    H = spec.heads
    batch = state.lengths.shape[0]
    if B != batch or D != spec.head_dim or Hq % H:
        raise ArgumentError(f"attention expects q of shape [{batch}, k*{H}, n, {spec.head_dim}]; got {tuple(q.shape)}")
    given = mask
    if mask is not None:
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ArgumentTypeError(f"attention mask must be bool or floating point; got {mask.dtype}")
        mask = mask.expand(B, Hq, n, mask.shape[-1])  # positions past its width are invisible (the kernel)
    check_chunk(q, k_new, v_new, spec)
    check_devices(state, q=q, mask=mask, k_new=k_new, v_new=v_new)
    if groups is not None:
        groups = _common.check_groups(groups, state, n, k_new, rope)  # (now on the state's device)
    if invariant and n != 1:
        raise UnsupportedError(f"row-invariant attention takes one query a row; got {n} queries a row over "
                               f"{spec.name}: give each query a row of its own (kvcompile.pages does)")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pl = plan(state, spec, q.shape, mask, tiles, rope is not None, kernel, q.device,
              k_new is not None and stored_chunk_needed(spec, n), invariant, q.dtype)
    if pl.sdpa:  # the mask as given (not expanded: its causal form is recognised once for every layer)
        return _prefill.prefill_attention(q, state, spec, given, scale, k_new=k_new, v_new=v_new, rope=rope,
                                          operands=q.dtype, kernel=True)
    chunk = stored_chunk(spec, k_new, v_new, n)  # (the prefill path above reads the chunk itself)
    qr = q.float()
    if spec.policy.rotates_keys:  # as the reference: the query rotated in fp32, the output un-rotated in fp32
        qr = qr @ hadamard(D, q.device)
    if pl.decode:
        out = _decode.launch_decode(qr, state, spec, mask, scale, dot_precision(q.device), pl.block_n, pl.nsplit,
                                    chunk, invariant, groups if invariant else None)
    else:
        out = _attention.launch_attention(qr, state, spec, mask, scale, dot_precision(q.device),
                                          (pl.block_q, pl.block_n, pl.nsplit), chunk, rope,
                                          packed_precision(q.device))
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device)
        out = _common.inf_to_nan(out)  # as the reference: inf -> NaN
    return Q.saturate(out, q.dtype)
