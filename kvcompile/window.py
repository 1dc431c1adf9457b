"""Sliding-window layers under continuous batching: each request's window, in full precision, in its slot.

A sliding-window layer (Gemma 3's local layers) attends to the last ``window`` tokens only. transformers' own
continuous batching keeps exactly those, in full precision, in a ring of pages per request; kvcompile's engine
keeps them as transformers does -- the same tokens, the same precision -- in a ring per request slot
(``WindowRing``), and quantizes the full-attention layers into its pools. The ring's bytes are part of each
slot's row in the serving budget (``WindowSpec.row_nbytes``), like a policy's full-precision window.

    ring k, v:  [slots, H, window, D]  (model dtype)    token at position p of a slot's request: place p % window

A forward's chunk of ``n`` new tokens at positions ``P .. P+n-1`` reads the ring's ``window - 1`` tokens before
``P`` (``WindowRing.before``), then writes the chunk's last ``min(n, window)`` tokens over them (``write``), and
attends (``window_attention``): query ``P+i`` to the keys at positions ``P+i-window+1 .. P+i`` -- what
transformers' sliding-window mask allows, read from the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .store import DTYPES
from .errors import ArgumentError, UnsupportedError


@dataclass(frozen=True)
class WindowSpec:
    """One sliding-window layer's share of the serving pool: a full-precision ring of ``window`` tokens per
    slot and nothing in the pages. Has the sizing surface of a ``LayerSpec`` (``kvcompile.pool`` sums both):
    ``block`` is the pages' size (the full-attention layers'), which this layer does not use."""

    window: int
    heads: int
    head_dim: int
    dtype: str
    block: int

    def __post_init__(self):
        for name in ("window", "heads", "head_dim", "block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ArgumentError(f"WindowSpec {name}={v!r}: expected a positive integer")
        if self.dtype not in DTYPES:
            raise ArgumentError(f"WindowSpec dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")

    ring = property(lambda self: self.window)  # tokens a slot holds outside the pages
    sink = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def blocks_for(self, tokens: int) -> int:
        return 0

    def block_nbytes(self) -> int:
        return 0

    def row_nbytes(self) -> int:
        """Bytes of one slot's ring: keys and values of ``window`` tokens."""
        return 2 * self.heads * self.window * self.head_dim * self.torch_dtype.itemsize


class SavedWindow(NamedTuple):
    """One slot's ring copied out (``WindowRing.save``): its keys, values and length."""

    k: Tensor
    v: Tensor
    length: int

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class WindowRing:
    """A sliding-window layer's rings, one per slot, with the row operations the engine calls on every layer's
    store (``clear``, ``fork``, ``save``, ``restore``; the page operations do nothing: it holds no pages)."""

    def __init__(self, spec: WindowSpec, slots: int, device="cpu"):
        self.spec = spec
        shape = (slots, spec.heads, spec.window, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.torch_dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.torch_dtype, device=device)
        self.lengths = [0] * slots  # tokens each slot's request has had (its ring holds the last ``window``)

    @property
    def state(self) -> tuple[Tensor, Tensor]:
        """The tensors allocated (what ``pool_nbytes`` counts for this layer)."""
        return self.k, self.v

    blocks = used_blocks = 0

    # ---- what the engine calls on every layer (a ring holds no pages)
    def engine_owns_blocks(self) -> None:
        pass

    def set_tables(self, tables: dict[int, list[int]]) -> None:
        pass

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        pass

    def reserve(self, counts: Sequence[int]) -> None:
        pass

    def set_length(self, b: int, length: int) -> None:
        raise UnsupportedError(f"WindowRing.set_length({b}, {length}): a sliding-window layer's tokens are not in "
                           f"pages, so no request starts from shared pages (prefix sharing is off for this model)")

    def clear(self, rows: Sequence[int]) -> None:
        for b in rows:
            self.lengths[b] = 0

    def fork(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst] = self.k[src], self.v[src]
        self.lengths[dst] = self.lengths[src]

    def save(self, b: int, device="cpu") -> SavedWindow:
        return SavedWindow(self.k[b].to(device, copy=True), self.v[b].to(device, copy=True), self.lengths[b])

    def restore(self, b: int, saved: SavedWindow, blocks: Sequence[int] = ()) -> None:
        self.k[b].copy_(saved.k)
        self.v[b].copy_(saved.v)
        self.lengths[b] = saved.length

    # ---- a forward
    def before(self, rows: Tensor, past: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The ``window - 1`` tokens before each row's chunk: keys and values ``[R, H, window - 1, D]`` in
        position order, and their positions ``[R, window - 1]`` (negative: before the request's first token,
        no token). ``rows``: slots ``[R]``; ``past``: each one's tokens so far ``[R]``."""
        W = self.spec.window
        pos = past[:, None] - (W - 1) + torch.arange(W - 1, device=past.device)
        place = (pos.clamp(min=0) % W)[:, None, :, None].expand(-1, self.spec.heads, -1, self.spec.head_dim)
        k = self.k.index_select(0, rows).gather(2, place)
        v = self.v.index_select(0, rows).gather(2, place)
        return k, v, pos

    def write(self, rows: Sequence[int], past: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Each row's chunk ``k, v [R, H, n, D]`` (positions ``past .. past + n - 1``): its last ``window``
        tokens into the slot's ring."""
        W, n = self.spec.window, k.shape[2]
        m = min(n, W)
        for r, (b, p) in enumerate(zip(rows, past)):
            place = torch.arange(p + n - m, p + n, device=k.device) % W
            self.k[b].index_copy_(1, place, k[r, :, n - m:])
            self.v[b].index_copy_(1, place, v[r, :, n - m:])
            self.lengths[b] = p + n


def window_attention(q: Tensor, k_old: Tensor, v_old: Tensor, pos_old: Tensor, k: Tensor, v: Tensor, past: Tensor,
                     window: int, scale: float | None) -> Tensor:
    """Sliding-window attention of a chunk: queries ``q [R, Hq, n, D]`` at positions ``past + i`` over the
    tokens before the chunk (``k_old, v_old [R, H, W - 1, D]`` at ``pos_old [R, W - 1]``, negative: none) and
    the chunk itself (``k, v [R, H, n, D]``): query ``p`` sees the keys at positions ``p - window + 1 .. p``.
    Returns ``[R, Hq, n, D]``."""
    n = q.shape[2]
    new = past[:, None] + torch.arange(n, device=q.device)  # [R, n]
    kpos = torch.cat([pos_old, new], 1)  # [R, W - 1 + n]
    valid = torch.cat([pos_old >= 0, torch.ones_like(new, dtype=torch.bool)], 1)
    gap = new[:, :, None] - kpos[:, None, :]  # [R, n, W - 1 + n]: query position minus key position
    mask = valid[:, None, :] & (gap >= 0) & (gap < window)
    return F.scaled_dot_product_attention(q, torch.cat([k_old, k], 2), torch.cat([v_old, v], 2),
                                          attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1])
