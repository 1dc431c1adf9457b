"""Zero-stride stand-ins for cache tensors, and the registry that maps each one to its packed store.

A model's cache tensor (``k_cache [B, H, C, D]``, a StaticLayer's ``keys``) is replaced by a *stand-in*: a
tensor of the same shape, dtype and device with strides ``(1, 1, 1, 1)`` over ``B + H + C + D - 3``
elements (16 KB for a [1, 8, 8192, 128] bf16 cache that would hold 16 MB). It traces through Dynamo exactly
like the real buffer: the graph shows the same writes and reads on a placeholder.

Why not all-zero strides (one element): fake-tensor propagation rejects a slice assignment into a tensor
with a zero stride ("more than one element of the written-to tensor refers to a single memory location"),
so torchtune-style ``cache[:, :, a:b] = k`` would not trace. Unit strides overlap just as much but are not
flagged by the overlap check, and every write/read of a registered stand-in is rewritten by the pass (or the
backend raises), so the overlapping memory is never used.

Each stand-in is registered here with the layer's packed store (a ``KVStore``). The registry is keyed by
tensor identity and holds its keys weakly, so a cache that goes away takes its store with it. kvcompile's
ops receive the stand-ins themselves (the graph's cache placeholders) and look their store up at every
call (``kvcompile.ops``), so a fresh cache of the same shape reuses the compiled code and never reads a
stale store, and a store can grow (its tensors replaced) without the compiled graph noticing.

A second registry holds the cache tensors kvcompile must *leave alone*: a transformers sliding-window layer's
ring (``StaticSlidingWindowLayer``), which rolls its window in full precision with its own writes; the pass
reports reads and writes of those tensors as left to the model instead of routing them to a packed store.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .store import KVStore, LayerSpec


@dataclass
class Slot:
    """The packed store behind one cache tensor (a layer's keys or values).

    owned: True when the full-precision tensor was replaced by a stand-in (memory saved); False when the
           store shadows a real full-precision tensor the user allocated (the pass still routes writes and
           reads to the store, but the full tensor's memory is still held by its owner).
    """

    store: KVStore
    spec: LayerSpec
    spec_name: str
    role: str  # "k" or "v"
    layer: str
    owned: bool
    # writes always continue the store (a KVCompileCache layer: the positions it traces are its own count, kept in
    # step with the store by its crop, reset and reorder), so the store op need not read them: on a GPU each read
    # is a device-to-host sync, two per layer and decode step
    appends: bool = False


_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LEFT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> why kvcompile leaves it to the model


def make_standin(shape, dtype: torch.dtype, device) -> Tensor:
    """A ``shape`` tensor of ``dtype`` on ``device`` over ``sum(shape) - len(shape) + 1`` elements.

    Each stand-in gets its own storage: two stand-ins sharing storage would look aliased to Dynamo and
    AOTAutograd.
    """
    base = torch.zeros(sum(shape) - len(shape) + 1, dtype=dtype, device=device)
    return base.as_strided(tuple(shape), (1,) * len(shape))


def is_standin(t: Tensor) -> bool:
    return (isinstance(t, Tensor) and t.dim() > 0 and t.numel() > 1
            and t.untyped_storage().nbytes() < t.numel() * t.element_size())


def register(k: Tensor, v: Tensor, store: KVStore, layer: str, owned: bool, appends: bool = False) -> KVStore:
    """Give the cache tensors ``k, v [B, H, C, D]`` the packed store ``store`` (a new stand-in pair of a growing
    cache is registered to the store its predecessors had); ``appends``: see ``Slot``."""
    name = store.spec.register()
    _SLOTS[k] = Slot(store, store.spec, name, "k", layer, owned, appends)
    _SLOTS[v] = Slot(store, store.spec, name, "v", layer, owned, appends)
    return store


def lookup(t: Tensor) -> Slot | None:
    try:
        return _SLOTS.get(t)
    except TypeError:  # not a tensor
        return None


def leave(k: Tensor, v: Tensor, why: str) -> None:
    """Mark the cache tensors ``k, v`` as the model's own: the pass does not rewrite what writes or reads them."""
    _LEFT[k] = why
    _LEFT[v] = why


def left(t) -> str | None:
    """Why ``t`` is left to the model, or None."""
    try:
        return _LEFT.get(t)
    except TypeError:  # not a tensor
        return None
