"""The quantized KV store of one layer: its layout, and the reference append / read / attention.

A layer's store is a fixed tuple of tensors (``KVState``), preallocated for ``(batch, kv_heads, capacity,
head_dim)``. Position ``p`` of sequence ``b`` lives in exactly one place, decided by that sequence's
length ``L`` alone (so appending the same tokens in any chunking gives the same bytes)::

    p < S                          sink        full precision   k_sink[b, :, p]
    S <= p < Q(L)                  quantized   packed codes     k_codes[b, :, p - S], scales by group
    Q(L) <= p < L                  residual    full precision   k_res[b, :, p % W]   (a ring)

    Q(L) = S + floor(max(0, L - S - R) / F) * F        R = policy.residual, F = policy.flush
    W    = min(R + F - 1, C - S)                       (the most tokens the residual can hold)

``F`` is the per-channel group size (1 if nothing is quantized per channel): a per-channel scale covers F
tokens, so tokens enter packed storage only in whole groups (KIVI). The ring never needs data movement:
each append first flushes ``[Q(L), Q(L'))`` into codes, then writes the newcomers at ``p % W``.

Rotation (``policy.rotate``) multiplies keys, values and queries by an orthonormal Hadamard matrix before
anything else (``rotate``); everything in the store is in rotated space, and attention un-rotates its
output. Rotation runs in torch (not in the kernels), so kernel and reference see identical inputs.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from . import quant as Q
from .policy import Policy, PolicyError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CapacityError(RuntimeError):
    """An append that does not fit in the cache."""


class KVState(NamedTuple):
    """The tensors of one layer's store, in the order every op takes them.

    k_codes:  uint8 [B, H, Cq, D*bits/8] packed codes (model dtype [B, H, Cq, D] for format "none")
    k_scale:  scale dtype [B, H, Cq, D/g] (axis="token") or [B, H, Cq/g, D] (axis="channel"); empty if none
    k_zero:   same shape as k_scale for asymmetric integers, else empty
    v_*:      the same for values
    k_res:    model dtype [B, H, W, D] full-precision ring of the most recent tokens (slot p % W)
    v_res:    same
    k_sink:   model dtype [B, H, S, D] the first S tokens
    v_sink:   same
    lengths:  int32 [B] tokens held per sequence
    """

    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    k_res: Tensor
    v_res: Tensor
    k_sink: Tensor
    v_sink: Tensor
    lengths: Tensor


@dataclass(frozen=True)
class LayerSpec:
    """Everything that fixes a store's layout; its ``name`` keys compiled kernels and op calls."""

    policy: Policy
    batch: int
    heads: int
    capacity: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self):
        if self.policy.overrides:
            raise PolicyError("LayerSpec needs a resolved per-layer policy (call policy.resolve first)")
        if self.dtype not in DTYPES:
            raise PolicyError(f"dtype={self.dtype!r} is not supported: expected one of {sorted(DTYPES)}")
        for f in ("batch", "heads", "capacity", "head_dim"):
            if getattr(self, f) < 1:
                raise PolicyError(f"LayerSpec.{f}={getattr(self, f)} must be at least 1")
        self.policy.check(self.head_dim)

    # ---- geometry
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def sink(self) -> int:
        return min(self.policy.sink, self.capacity)

    @property
    def flush(self) -> int:
        return self.policy.flush

    @property
    def ring(self) -> int:
        return min(self.policy.residual + self.flush - 1, self.capacity - self.sink)

    @property
    def quantized_capacity(self) -> int:
        return self.boundary(self.capacity) - self.sink

    def boundary(self, L: int) -> int:
        """Q(L): tokens at positions [sink, Q(L)) are in packed storage once the sequence holds L tokens."""
        S, R, F = self.sink, self.policy.residual, self.flush
        return S + (max(0, L - S - R) // F) * F

    @property
    def name(self) -> str:
        return (f"{self.policy.key_str()};B={self.batch};H={self.heads};C={self.capacity};"
                f"D={self.head_dim};dt={self.dtype}")

    @staticmethod
    def from_name(name: str) -> "LayerSpec":
        """The spec registered under ``name`` (ops receive the spec as this string)."""
        try:
            return _SPECS[name]
        except KeyError:
            raise KeyError(f"no kvcompile store layout named {name!r} was created in this process") from None

    def register(self) -> str:
        _SPECS[self.name] = self
        return self.name

    # ---- allocation
    def _tensor_shapes(self, which: str):
        q = self.policy.key if which == "k" else self.policy.value
        B, H, D, Cq = self.batch, self.heads, self.head_dim, self.quantized_capacity
        if not q.quantized:
            return (B, H, Cq, D), self.torch_dtype, (0,), (0,)
        ss = (B, H, *Q.scale_shape(q, Cq, D))
        return (B, H, Cq, Q.packed_bytes(D, q.bits)), torch.uint8, ss, ss if q.has_zero else (0,)

    def allocate(self, device="cpu") -> KVState:
        """Zero-filled store. Its memory is the packed size, never the full-precision one."""
        B, H, D = self.batch, self.heads, self.head_dim
        out = []
        for which in ("k", "v"):
            q = self.policy.key if which == "k" else self.policy.value
            cshape, cdt, sshape, zshape = self._tensor_shapes(which)
            sdt = Q.SCALE_TORCH_DTYPE[q.scale_dtype]
            out += [torch.zeros(cshape, dtype=cdt, device=device), torch.zeros(sshape, dtype=sdt, device=device),
                    torch.zeros(zshape, dtype=sdt, device=device)]
        dt = self.torch_dtype
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = out
        return KVState(
            k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
            torch.zeros(B, H, self.ring, D, dtype=dt, device=device),
            torch.zeros(B, H, self.ring, D, dtype=dt, device=device),
            torch.zeros(B, H, self.sink, D, dtype=dt, device=device),
            torch.zeros(B, H, self.sink, D, dtype=dt, device=device),
            torch.zeros(B, dtype=torch.int32, device=device),
        )

    def nbytes(self) -> int:
        """Exact bytes ``allocate`` holds, computed from the layout alone."""
        def size(shape, dt):
            return math.prod(shape) * torch.empty((), dtype=dt).element_size()
        total = 0
        for which in ("k", "v"):
            q = self.policy.key if which == "k" else self.policy.value
            cshape, cdt, sshape, zshape = self._tensor_shapes(which)
            sdt = Q.SCALE_TORCH_DTYPE[q.scale_dtype]
            total += size(cshape, cdt) + size(sshape, sdt) + size(zshape, sdt)
        B, H, D = self.batch, self.heads, self.head_dim
        total += 2 * size((B, H, self.ring + self.sink, D), self.torch_dtype)
        return total + size((B,), torch.int32)


_SPECS: dict[str, LayerSpec] = {}


def state_nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state)


# --------------------------------------------------------------------------- rotation
@functools.lru_cache(maxsize=None)
def _hadamard_cpu(D: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(D)


def hadamard(D: int, device=None, dtype=torch.float32) -> Tensor:
    """Orthonormal (Sylvester) Hadamard matrix [D, D] (built in float64); symmetric, its own inverse."""
    return _hadamard_cpu(D).to(device=device, dtype=dtype)


def rotate(x: Tensor, spec: LayerSpec) -> Tensor:
    """Keys/values/queries into the store's space: ``x @ H`` in fp32, back to ``x``'s dtype."""
    if not spec.policy.rotate:
        return x
    return (x.float() @ hadamard(x.shape[-1], x.device)).to(x.dtype)


def unrotate(x: Tensor, spec: LayerSpec) -> Tensor:
    if not spec.policy.rotate:
        return x
    return (x.float() @ hadamard(x.shape[-1], x.device)).to(x.dtype)  # H is symmetric and orthonormal


# --------------------------------------------------------------------------- reference append
def _check_append(spec: LayerSpec, lengths: Tensor, n_new: Tensor) -> None:
    new = lengths.long() + n_new.long()
    if bool((new > spec.capacity).any()):
        b = int(torch.argmax((new > spec.capacity).int()))
        raise CapacityError(
            f"KV cache overflow: sequence {b} holds {int(lengths[b])} tokens and appends {int(n_new[b])}, "
            f"but the cache was allocated for {spec.capacity} tokens. Allocate a larger cache "
            f"(max_cache_len / capacity) or shorten the sequence."
        )


def store_reference(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
    """Append ``k, v [B, H, n, D]`` (model space) to the store, in place.

    ``n_new`` (int [B], optional): row ``b`` appends only its first ``n_new[b]`` tokens (ragged batches);
    the default appends all ``n``. Tokens go at positions ``lengths[b] ...``; ``lengths`` advances.
    """
    B, H, n, D = k.shape
    if (B, H, D) != (spec.batch, spec.heads, spec.head_dim) or v.shape != k.shape:
        raise ValueError(f"store expects k, v of shape [{spec.batch}, {spec.heads}, n, {spec.head_dim}]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if n_new is None:
        n_new = torch.full((B,), n, dtype=torch.int32)
    n_new = n_new.to(torch.int32).cpu()
    lengths_cpu = state.lengths.cpu()
    _check_append(spec, lengths_cpu, n_new)
    k, v = rotate(k, spec), rotate(v, spec)
    for b in range(B):
        L, nb = int(lengths_cpu[b]), int(n_new[b])
        _append_row(state, spec, b, L, k[b, :, :nb], v[b, :, :nb])
        state.lengths[b] = L + nb


def _append_row(state: KVState, spec: LayerSpec, b: int, L: int, k: Tensor, v: Tensor) -> None:
    n = k.shape[1]
    L2 = L + n
    S, W, dt = spec.sink, spec.ring, spec.torch_dtype
    q0, q1 = spec.boundary(L), spec.boundary(L2)
    dev = k.device
    # sinks
    if L < S:
        state.k_sink[b, :, L:min(L2, S)] = k[:, :min(L2, S) - L].to(dt)
        state.v_sink[b, :, L:min(L2, S)] = v[:, :min(L2, S) - L].to(dt)
    # flush [q0, q1) into packed storage, from the ring (p < L) or from the chunk (p >= L)
    if q1 > q0:
        old = torch.arange(q0, max(q0, min(L, q1)), device=dev)
        def window(res, x):
            return torch.cat([res[b, :, old % max(W, 1)], x[:, max(L, q0) - L:max(L, q1) - L].to(dt)], dim=1)
        _write_quantized(state.k_codes, state.k_scale, state.k_zero, spec.policy.key, window(state.k_res, k),
                         b, q0 - S)
        _write_quantized(state.v_codes, state.v_scale, state.v_zero, spec.policy.value, window(state.v_res, v),
                         b, q0 - S)
    # the newcomers that stay in full precision, at p % W in the ring
    new = torch.arange(max(L, S, q1), max(L, S, q1, L2), device=dev)
    state.k_res[b, :, new % max(W, 1)] = k[:, new - L].to(dt)
    state.v_res[b, :, new % max(W, 1)] = v[:, new - L].to(dt)


def _write_quantized(codes, scale, zero, q, x: Tensor, b: int, start: int) -> None:
    """Quantize ``x [H, T, D]`` (tokens start..start+T of the packed region) into row ``b``."""
    T = x.shape[1]
    if not q.quantized:
        codes[b, :, start:start + T] = x
        return
    c, s, z = Q.quantize(x, q)
    codes[b, :, start:start + T] = Q.pack(c, q.bits)
    if q.axis == "token":
        scale[b, :, start:start + T] = s
        if z is not None:
            zero[b, :, start:start + T] = z
    else:
        g0 = start // q.group
        scale[b, :, g0:g0 + T // q.group] = s
        if z is not None:
            zero[b, :, g0:g0 + T // q.group] = z


# --------------------------------------------------------------------------- reference read
def dequantize_reference(state: KVState, spec: LayerSpec, dtype=torch.float32, rotated: bool = False,
                         start: int = 0, end: int | None = None):
    """What the store holds at positions ``[start, end)`` (default: all ``C``), as ``k^, v^ [B, H, end-start, D]``
    in ``dtype``; positions >= a row's length are zero.

    In model space unless ``rotated=True`` (the store's own space, which attention works in). Only the packed
    rows inside the range are unpacked, so refreshing a few recent positions is cheap.
    """
    B, H, C, D, S = spec.batch, spec.heads, spec.capacity, spec.head_dim, spec.sink
    W, F = spec.ring, spec.flush
    end = C if end is None else end
    # packed rows to unpack: the range, widened to whole flush groups so per-channel scales line up
    p0 = S + (max(start - S, 0) // F) * F
    p1 = min(spec.boundary(C), S + -(-(max(end, S) - S) // F) * F)
    out = []
    for codes, scale, zero, res, sink, q in (
        (state.k_codes, state.k_scale, state.k_zero, state.k_res, state.k_sink, spec.policy.key),
        (state.v_codes, state.v_scale, state.v_zero, state.v_res, state.v_sink, spec.policy.value),
    ):
        full = torch.zeros(B, H, end - start, D, dtype=dtype, device=codes.device)
        deq = None
        if p1 > p0:
            rows = slice(p0 - S, p1 - S)
            if q.quantized:
                srows = rows if q.axis == "token" else slice((p0 - S) // q.group, -(-(p1 - S) // q.group))
                z = zero[:, :, srows] if q.has_zero else None
                deq = Q.dequantize(Q.unpack(codes[:, :, rows], q.bits, D), scale[:, :, srows], z, q, dtype)
            else:
                deq = codes[:, :, rows].to(dtype)
        for b in range(B):
            L = min(int(state.lengths[b]), end)
            qb = spec.boundary(int(state.lengths[b]))
            lo, hi = max(start, 0), min(L, S)  # sinks
            if hi > lo:
                full[b, :, lo - start:hi - start] = sink[b, :, lo:hi].to(dtype)
            lo, hi = max(start, S), min(qb, L)  # packed
            if hi > lo:
                full[b, :, lo - start:hi - start] = deq[b, :, lo - p0:hi - p0]
            live = torch.arange(max(qb, S, start), max(qb, S, start, L), device=codes.device)  # residual ring
            full[b, :, live - start] = res[b, :, live % max(W, 1)].to(dtype)
        if not rotated and spec.policy.rotate:
            full = (full.double() @ hadamard(D, full.device, torch.float64)).to(dtype)
        out.append(full)
    return out[0], out[1]


def chunk_needed(spec: LayerSpec, n: int) -> bool:
    """Whether the ``n`` newest tokens can be in packed storage right after they were appended.

    They cannot when ``n <= residual`` (``Q(L) <= max(S, L - R)``: the newest ``R`` tokens are always in the
    ring or the sinks, which hold exactly ``rotate(k).to(dtype)``, the chunk's own full-precision values), or
    when nothing is quantized. Kernels use it to skip reading the chunk; the result is the same either way.
    """
    quantized = spec.policy.key.quantized or spec.policy.value.quantized
    return quantized and n > spec.policy.residual


def as_stored(x: Tensor, spec: LayerSpec, dtype=torch.float32) -> Tensor:
    """Keys or values exactly as the store keeps them in full precision (``rotate(x).to(model dtype)``), in
    ``dtype``: what the sinks and the ring hold, and what attention reads for the queries' own chunk."""
    return rotate(x, spec).to(spec.torch_dtype).to(dtype)


def stored_chunk(spec: LayerSpec, k_new: Tensor | None, v_new: Tensor | None, n: int,
                 dtype=torch.float32) -> tuple[Tensor, Tensor] | None:
    """The chunk ``as_stored`` (contiguous) for a kernel to read, or None when none was given or none of its
    positions can be in packed storage (``chunk_needed``: the kernel's store reads give the same values)."""
    if k_new is None or not chunk_needed(spec, n):
        return None
    return as_stored(k_new, spec, dtype).contiguous(), as_stored(v_new, spec, dtype).contiguous()


def check_chunk(q: Tensor, k_new: Tensor | None, v_new: Tensor | None, spec: LayerSpec) -> None:
    if (k_new is None) != (v_new is None):
        raise ValueError("attention takes the chunk's keys and values together (k_new and v_new), or neither")
    if k_new is None:
        return
    B, _, n, D = q.shape
    want = (B, spec.heads, n, spec.head_dim)
    if tuple(k_new.shape) != want or tuple(v_new.shape) != want:
        raise ValueError(f"k_new and v_new must be the {n} queries' own keys and values, of shape {list(want)}; "
                         f"got {list(k_new.shape)} and {list(v_new.shape)}")


def with_chunk(k: Tensor, v: Tensor, state: KVState, spec: LayerSpec, k_new: Tensor,
               v_new: Tensor) -> tuple[Tensor, Tensor]:
    """``k, v [B, H, P, D]`` (the store's rotated space, positions ``0 .. P``) with each row's newest ``n``
    positions ``[L - n, L)`` replaced by the chunk ``k_new, v_new [B, H, n, D]`` (model space) ``as_stored``.
    Returns new tensors."""
    B, H, n, D = k_new.shape
    P = k.shape[2]
    first = state.lengths.to(k.device).long().view(B, 1, 1, 1) - n  # the chunk's first position
    j = torch.arange(P, device=k.device).view(1, 1, P, 1) - first  # index into the chunk
    inside = (j >= 0) & (j < n)
    idx = j.clamp(0, n - 1).expand(B, H, P, D)
    out = []
    for full, new in ((k, k_new), (v, v_new)):
        out.append(torch.where(inside, as_stored(new, spec, full.dtype).gather(2, idx), full))
    return out[0], out[1]


def attention_reference(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
                        scale: float | None = None, compute_dtype=torch.float32,
                        k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
    """Attention of ``q [B, Hq, n, D]`` over the store; returns ``[B, Hq, n, D]`` in q's dtype.

    The ``n`` queries are the sequence's last ``n`` tokens (positions ``L-n .. L-1``, already stored).
    Key ``p`` is visible to query ``i`` when ``p < L`` and
      - with no mask: ``p <= L - n + i`` (causal);
      - with a mask (bool, or float added to the scores; broadcastable to ``[B, Hq, n, C]`` over
        absolute positions): as the mask says.
    A query that sees no key returns zeros. ``Hq`` must be a multiple of the store's heads (GQA).

    ``k_new, v_new [B, H, n, D]``: the chunk just appended (the queries' own keys and values). Given, the
    chunk's positions ``[L-n, L)`` are read from them in full precision, not from the store: a prefill
    attends to its own tokens unquantized, as KIVI does, and only later calls see them quantized (the
    kv-cache pass always passes them). Without them every position is read from the store.
    """
    B, Hq, n, D = q.shape
    H, C = spec.heads, spec.capacity
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of the cache's kv heads {H}")
    check_chunk(q, k_new, v_new, spec)
    k, v = dequantize_reference(state, spec, compute_dtype, rotated=True)
    if k_new is not None:
        k, v = with_chunk(k, v, state, spec, k_new, v_new)
    qr = q.to(compute_dtype)
    if spec.policy.rotate:
        qr = qr @ hadamard(D, q.device).to(compute_dtype)
    k = k.repeat_interleave(Hq // H, dim=1)
    v = v.repeat_interleave(Hq // H, dim=1)
    sc = (qr @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(D))
    pos = torch.arange(C, device=q.device)
    L = state.lengths.to(q.device).long().view(B, 1, 1, 1)
    visible = pos.view(1, 1, 1, C) < L
    if mask is None:
        qpos = L - n + torch.arange(n, device=q.device).view(1, 1, n, 1)
        visible = visible & (pos.view(1, 1, 1, C) <= qpos)
    elif mask.dtype == torch.bool:
        visible = visible & mask[..., :C]
    else:
        sc = sc + mask[..., :C].to(compute_dtype)
    sc = sc.masked_fill(~visible, float("-inf"))
    p = torch.softmax(sc, dim=-1).nan_to_num(0.0)  # a query that sees nothing gets zeros, not NaN
    out = p @ v
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device).to(compute_dtype)
    return out.to(q.dtype)


# --------------------------------------------------------------------------- the user-facing store
class QuantizedKV:
    """One layer's quantized KV store (reference implementation, any device).

    >>> kv = QuantizedKV(Policy.kivi(4), batch=1, heads=3, capacity=2048, head_dim=64)
    >>> kv.append(k, v)             # k, v: [1, 3, n, 64]
    >>> k_hat, v_hat = kv.dequantized()
    """

    def __init__(self, policy: Policy, batch: int, heads: int, capacity: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        self.spec = LayerSpec(policy, batch, heads, capacity, head_dim, DTYPE_NAMES[dtype])
        self.state = self.spec.allocate(device)

    @property
    def lengths(self) -> Tensor:
        return self.state.lengths

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state)

    def append(self, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
        store_reference(self.state, self.spec, k, v, n_new)

    def dequantized(self, dtype=torch.float32):
        return dequantize_reference(self.state, self.spec, dtype)

    def attention(self, q: Tensor, mask: Tensor | None = None, scale: float | None = None,
                  k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
        return attention_reference(q, self.state, self.spec, mask, scale, k_new=k_new, v_new=v_new)

    def reset(self) -> None:
        for t in self.state:
            t.zero_()
