"""Zero-stride stand-ins for cache tensors, and the registry that maps each one to its packed store.

A model's cache tensor (``k_cache [B, H, C, D]``, a StaticLayer's ``keys``) is replaced by a *stand-in*: a
tensor of the same shape, dtype and device whose strides are all zero, a view of one element. It costs one
element of memory, it traces through Dynamo exactly like the real buffer (the graph shows the same writes
and reads on a placeholder), and it can never be used by mistake: writing into it raises ("more than one
element of the written-to tensor refers to a single memory location") unless the pass replaced the write.

Each stand-in is registered here with the layer's packed ``KVState``. The registry is keyed by tensor
identity and holds its keys weakly, so a cache that goes away takes its store with it. The compiled graph
looks the state up at every call from the stand-in it receives (``kvcompile.api``), so a fresh cache of the
same shape reuses the compiled code and never reads a stale store.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .store import KVState, LayerSpec


@dataclass
class Slot:
    """The packed store behind one cache tensor (a layer's keys or values).

    owned: True when the full-precision tensor was replaced by a stand-in (memory saved); False when the
           store shadows a real full-precision tensor the user allocated (the pass still routes writes and
           reads to the store, but the full tensor's memory is still held by its owner).
    """

    state: KVState
    spec: LayerSpec
    spec_name: str
    role: str  # "k" or "v"
    layer: str
    owned: bool


_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def make_standin(shape, dtype: torch.dtype, device) -> Tensor:
    """A ``shape`` tensor of ``dtype`` on ``device`` that holds one element (all strides zero).

    Each stand-in gets its own one-element base: two stand-ins sharing storage would look aliased to
    Dynamo and AOTAutograd.
    """
    return torch.zeros(1, dtype=dtype, device=device).expand(*shape)


def is_standin(t: Tensor) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and all(s == 0 for s in t.stride()) and t.numel() > 1


def register(k: Tensor, v: Tensor, spec: LayerSpec, layer: str, owned: bool, state: KVState | None = None) -> KVState:
    """Give the cache tensors ``k, v [B, H, C, D]`` one packed store (allocated unless ``state`` is given)."""
    name = spec.register()
    if state is None:
        state = spec.allocate(k.device)
    _SLOTS[k] = Slot(state, spec, name, "k", layer, owned)
    _SLOTS[v] = Slot(state, spec, name, "v", layer, owned)
    return state


def lookup(t: Tensor) -> Slot | None:
    try:
        return _SLOTS.get(t)
    except TypeError:  # not a tensor
        return None
