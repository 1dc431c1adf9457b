"""kvcompile's operators for transformers' paged cache under a compiled continuous-batching forward.

    torch.ops.kvcompile.paged_store(k_cache, v_cache, k, v, write_index)                      -> token
    torch.ops.kvcompile.paged_attention(q, k_cache, v_cache, token, read_index, mask, scale)  -> [1, Hq, T, D]

What they replace (``kvcompile.passes.paged`` rewrites them in): transformers' ``FullAttentionCacheAllocator.update``
writes a layer's new keys and values ``[T, H, D]`` into its page pool with ``k_cache.index_copy_(0, write_index,
k)``, reads the batch's whole sequences back with ``torch.index_select(k_cache, 0, read_index)``, and its SDPA
attends over them under the ragged batch's mask. Under kvcompile the pool views ``k_cache, v_cache`` are
*stand-ins* (``kvcompile.standin.make_standin``: the views' shapes over a few elements, no full-precision
memory), registered here to the ``PagedKVCompileCache`` and the layer they stand for.

- ``paged_store`` quantizes the layer's new keys and values into each request's row of the layer's
  ``KVStore`` (``PagedKVCompileCache.store_layer``: the same kernels and the same per-request rows as the eager
  serving path) and returns an empty token;
- ``paged_attention`` takes that token (which orders it after the store for any compiler: neither op declares
  the store's mutation, the store is not a graph value) and computes each request's attention over its row,
  the packed blocks read where they lie, the chunk just stored in full precision
  (``PagedKVCompileCache.attend``), in SDPA's layout ``[1, Hq, T, D]``.

Which request owns which of the forward's ``T`` tokens is the cache's host-side plan of the batch (built from
the same ``extend_read_and_write_indices`` calls transformers makes to fill ``write_index``/``read_index`` and
the mask), so the index tensors and the mask are inputs for ordering only. ``T`` may be padded (transformers
pads compiled forwards to static sizes): rows past the plan's tokens are not stored, and attend to nothing
(zeros); transformers never reads their logits.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .errors import UnsupportedError

_PAGED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # stand-in -> (weakref to the cache, layer_idx, "k" | "v")
calls: Counter = Counter()  # how often each op ran (its real implementation, not its fake)


def register(k: Tensor, v: Tensor, cache, layer_idx: int) -> None:
    """Make the stand-ins ``k, v`` (a layer's page-pool views) stand for layer ``layer_idx`` of ``cache``."""
    ref = weakref.ref(cache)
    _PAGED[k] = (ref, layer_idx, "k")
    _PAGED[v] = (ref, layer_idx, "v")


def lookup(t) -> tuple | None:
    """``(cache, layer_idx, role)`` for a registered stand-in (the cache still alive), else None."""
    try:
        entry = _PAGED.get(t)
    except TypeError:  # not a tensor
        return None
    if entry is None:
        return None
    cache = entry[0]()
    return None if cache is None else (cache, entry[1], entry[2])


def _layer(k_cache: Tensor, v_cache: Tensor):
    k, v = lookup(k_cache), lookup(v_cache)
    if k is None or v is None:
        raise UnsupportedError("kvcompile.paged op called with tensors that are not a live PagedKVCompileCache's "
                             "stand-ins (was the continuous-batching manager stopped and its cache freed?)")
    if k[0] is not v[0] or k[1] != v[1] or (k[2], v[2]) != ("k", "v"):
        raise UnsupportedError(f"kvcompile.paged op: the key and value stand-ins belong to different layers "
                             f"({k[1]}, {v[1]}) or roles ({k[2]}, {v[2]})")
    return k[0], k[1]


def _paged_store(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, write_index: Tensor) -> Tensor:
    """Quantize the forward's new keys and values ``k, v [T, H, D]`` into each request's row of the layer's
    store (the first ``plan.total`` rows of ``T``; the rest is padding)."""
    cache, layer = _layer(k_cache, v_cache)
    calls["paged_store"] += 1
    cache.store_layer(layer, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
    return k.new_empty(0)


paged_store = torch.library.custom_op("kvcompile::paged_store", mutates_args=())(_paged_store)


@paged_store.register_fake
def _(k_cache, v_cache, k, v, write_index):
    return k.new_empty(0)


def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, token: Tensor, read_index: Tensor | None,
                     mask: Tensor | None, scale: float) -> Tensor:
    """Each request's queries (of ``q [1, Hq, T, D]``) over its row of the layer's store -> ``[1, Hq, T, D]``;
    padding rows are zeros."""
    cache, layer = _layer(k_cache, v_cache)
    calls["paged_attention"] += 1
    return cache.attend(layer, q, scale).transpose(1, 2).contiguous()


paged_attention = torch.library.custom_op("kvcompile::paged_attention", mutates_args=())(_paged_attention)


@paged_attention.register_fake
def _(q, k_cache, v_cache, token, read_index, mask, scale):
    return q.new_empty(q.shape)  # contiguous, as the implementation returns


def _paged_read(k_cache: Tensor, v_cache: Tensor, token: Tensor, read_index: Tensor) -> tuple[Tensor, Tensor]:
    """An exact layer (``Policy.full()``): what ``torch.index_select(pool, 0, read_index)`` reads from
    transformers' own pool, read from the layer's store (``PagedKVCompileCache.read_exact``): ``k, v [T, H,
    D]``, for transformers' own SDPA."""
    cache, layer = _layer(k_cache, v_cache)
    calls["paged_read"] += 1
    return cache.read_exact(layer, read_index)


paged_read = torch.library.custom_op("kvcompile::paged_read", mutates_args=())(_paged_read)


@paged_read.register_fake
def _(k_cache, v_cache, token, read_index):
    shape = (read_index.shape[0], *k_cache.shape[1:])
    return k_cache.new_empty(shape), v_cache.new_empty(shape)


# the kvcompile backend's compiler="eager" calls these directly instead of through the dispatcher
ops.PLAIN[torch.ops.kvcompile.paged_store.default] = _paged_store
ops.PLAIN[torch.ops.kvcompile.paged_attention.default] = _paged_attention
ops.PLAIN[torch.ops.kvcompile.paged_read.default] = _paged_read
