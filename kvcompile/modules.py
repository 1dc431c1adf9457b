"""``kvcompile.apply`` on a plain PyTorch module that keeps its KV caches as buffers (gpt-fast style).

Each submodule holding a pair of same-shape 4-D cache buffers (``k_cache``/``v_cache``, ``cache_k``/``cache_v``,
``key_cache``/``value_cache``, ``k``/``v``, ``keys``/``values``) gets stand-ins in their place (the
full-precision buffers are released) and a packed store of the buffers' batch, limited to their capacity;
the module is returned compiled through the kvcompile backend. The store holds the blocks the sequence has
written, not the buffers' whole capacity, and a write at an earlier position (position 0: a new prompt)
rewinds it, as writing into the buffers would.
"""
from __future__ import annotations

from torch import nn

from . import standin
from .backend import check_kernel_support, dtype_name
from .errors import UnsupportedError
from .policy import Policy
from .store import KVStore, LayerSpec

CACHE_PAIRS = (("k_cache", "v_cache"), ("cache_k", "cache_v"), ("key_cache", "value_cache"), ("k", "v"),
               ("keys", "values"))


def find_cache_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, str]]:
    """(module path, module, key buffer name, value buffer name) for each module holding a KV cache pair."""
    found = []
    for path, mod in model.named_modules():
        bufs = dict(mod.named_buffers(recurse=False))
        for kn, vn in CACHE_PAIRS:
            k, v = bufs.get(kn), bufs.get(vn)
            if k is not None and v is not None and k.dim() == 4 and k.shape == v.shape and k.is_floating_point():
                found.append((path, mod, kn, vn))
                break
    return found


def apply_module(model: nn.Module, policy: Policy) -> list[str]:
    """Swap every cache buffer pair of ``model`` for stand-ins over packed stores; returns the layer names."""
    found = find_cache_buffers(model)
    if not found:
        raise UnsupportedError(
            "kvcompile.apply found no KV cache in this module: it looks for submodules with two same-shape 4-D "
            f"buffers named {', '.join('/'.join(p) for p in CACHE_PAIRS)} (allocate the caches first, e.g. "
            "model.setup_caches(...)). Or compile with torch.compile(model, backend='kvcompile', "
            "options={'policy': ...}), which finds caches in the traced graph.")
    names = [p for p, *_ in found]
    head_dim = getattr(found[0][1], found[0][2]).shape[-1]
    policy.check(head_dim)
    policies = policy.resolve(names)
    for (path, mod, kn, vn), pol in zip(found, policies):
        k = getattr(mod, kn)
        B, H, C, D = k.shape
        spec = LayerSpec(pol, H, D, dtype_name(k.dtype, path))
        check_kernel_support(spec, k.device)
        ks = standin.make_standin(k.shape, k.dtype, k.device)
        vs = standin.make_standin(k.shape, k.dtype, k.device)
        setattr(mod, kn, ks)  # re-registers the buffer: the full tensor is released here
        setattr(mod, vn, vs)
        standin.register(ks, vs, KVStore(spec, B, k.device, max_tokens=C), path, owned=True)
    return names


def stores(model: nn.Module) -> dict[str, KVStore]:
    """Module path -> the packed store behind each cache buffer pair of an applied module."""
    out = {}
    for path, mod in model.named_modules():
        for kn, _ in CACHE_PAIRS:
            slot = standin.lookup(getattr(mod, kn, None))
            if slot is not None:
                out[path] = slot.store
                break
    return out
