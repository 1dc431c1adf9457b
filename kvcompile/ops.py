"""kvcompile's operators, registered with ``torch.library`` so ``torch.compile(fullgraph=True)`` traces them.

    torch.ops.kvcompile.store(state, k, v, pos, spec)            -> None   (mutates ``state``)
    torch.ops.kvcompile.attention(q, state, mask, scale, spec, k_new, v_new)  -> out [B, Hq, n, D]
    torch.ops.kvcompile.dequantize(state, spec)                   -> (k, v) [B, H, C, D]

``state`` is a layer's ``KVState`` as a list, ``spec`` the name of its registered ``LayerSpec``.

Which implementation runs (``kernels()``):
- "triton": the generated Triton kernels in ``kvcompile.templates`` -- the default on CUDA;
- "cpu": on the CPU, decode attention (up to 16 query rows per kv head) runs the C kernel generated from
  ``kvcompile/templates/cpu_attention.c`` per store layout (compiled with the system C compiler, cached on
  disk); longer query blocks (prefill) dequantize the layer transiently and run PyTorch's fused SDPA; the
  store runs the C kernel generated from ``kvcompile/templates/cpu_store.c`` (bit-exact with the reference)
  -- the default on the CPU;
- "inductor": on the CPU, attention runs ``kvcompile.templates.inductor`` compiled by Inductor once per
  store layout (one fused C++ kernel that unpacks inside its reductions);
- "reference": the pure-torch specification in ``kvcompile.store`` (dequantizes the whole cache per read);
- on the CPU, ``KVCOMPILE_KERNELS=triton`` together with ``TRITON_INTERPRET=1`` (both set before
  kvcompile is imported) runs the Triton kernels through Triton's interpreter: slow, for tests.
``set_kernels(name)`` switches at run time.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .store import KVState, LayerSpec, attention_reference, check_chunk, dequantize_reference, store_reference

KERNELS = ("auto", "triton", "cpu", "inductor", "reference")


def _check_kernels(name, what: str, fix: str = "") -> None:
    """Refuse a kernel family that does not exist, or Triton where it cannot run; ``what`` names the setting."""
    if not isinstance(name, str) or name not in KERNELS:
        raise ValueError(f"{what}={name!r} is not valid: expected one of {', '.join(KERNELS)} "
                         f"(auto: Triton on CUDA, the C kernels on the CPU){fix}")
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{what}='triton' needs CUDA, or TRITON_INTERPRET=1 set before kvcompile is imported "
                           f"(Triton's interpreter, slow: for tests); no GPU is visible here. Use 'cpu' or 'auto'.")


def _kernels_from_env() -> str:
    # read once, at import: an unknown value used to run the slow reference silently. Empty counts as unset.
    value = os.environ.get("KVCOMPILE_KERNELS", "") or "auto"
    _check_kernels(value, "the environment variable KVCOMPILE_KERNELS", "; set it to one of these, or unset it")
    return value


_KERNELS = _kernels_from_env()


def set_kernels(name: str) -> None:
    """Choose "auto" (Triton on CUDA, the C kernels on the CPU), "triton", "cpu", "inductor" or "reference"."""
    global _KERNELS
    _check_kernels(name, "kvcompile.ops.set_kernels(name)")
    _KERNELS = name


def kernels(device: torch.device) -> str:
    if _KERNELS == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return _KERNELS


def _fused_attention(q, state, mask, scale, spec_name, k_new=None, v_new=None):
    from .templates import inductor
    return inductor.attention(q, KVState(*state), LayerSpec.from_name(spec_name), mask, scale, k_new, v_new)


@functools.lru_cache(maxsize=None)
def _compiled_attention(spec_name: str):
    """``templates.inductor.attention`` compiled for one store layout (built once, shared by every layer
    with that layout). Its own code object per layout, so Dynamo's per-code recompile limit is per layout."""
    code = _fused_attention.__code__.replace(co_name=f"kvcompile_attention_{abs(hash(spec_name)):x}")
    fn = type(_fused_attention)(code, _fused_attention.__globals__)
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _triton():
    from .templates import launch  # imported lazily: Triton is only needed when its kernels run
    return launch


def _store(state: list[Tensor], k: Tensor, v: Tensor, pos: Tensor, spec: str) -> None:
    """Append ``k, v [B, H, n, D]`` at each sequence's current length.

    ``pos [n]`` are the positions the model meant to write (``cache_position`` / ``input_pos``); on the CPU
    they are checked against the store's lengths, so a rewound or skipped position fails loudly.
    """
    ls = LayerSpec.from_name(spec)
    st = KVState(*state)
    if pos.device.type == "cpu" and st.lengths.device.type == "cpu" and pos.numel():
        first = int(pos[0])
        bad = st.lengths != first
        if bool(bad.any()):
            raise RuntimeError(
                f"kvcompile cache write at position {first}, but the cache holds {st.lengths.tolist()} tokens: "
                f"the quantized cache is append-only. Reset the cache (cache.reset()) before a new sequence."
            )
    if kernels(k.device) == "triton":
        _triton().store(st, ls, k, v)
    elif kernels(k.device) == "cpu" and k.device.type == "cpu":
        from .templates import cpu_store
        cpu_store.store(st, ls, k, v)
    else:
        store_reference(st, ls, k, v)


store = torch.library.custom_op("kvcompile::store", mutates_args=("state",))(_store)


@store.register_fake
def _(state, k, v, pos, spec):
    return None


def _attention(q: Tensor, state: list[Tensor], mask: Tensor | None, scale: float, spec: str,
               k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
    """Attention of the last ``n`` tokens' queries ``q [B, Hq, n, D]`` over the store; ``k_new, v_new
    [B, H, n, D]``, the chunk just stored, are read in full precision at its own positions (see
    ``attention_reference`` for the exact semantics of ``mask`` and the chunk)."""
    ls = LayerSpec.from_name(spec)
    st = KVState(*state)
    check_chunk(q, k_new, v_new, ls)
    which = kernels(q.device)
    if which == "triton":
        return _triton().attention(q, st, ls, mask, scale, k_new=k_new, v_new=v_new)
    if which == "cpu" and q.device.type == "cpu":
        from .templates import cpu
        if cpu.check_decode(q, ls) is None:
            return cpu.attention(q, st, ls, mask, scale, k_new=k_new, v_new=v_new)
        return cpu.prefill_attention(q, st, ls, mask, scale, k_new=k_new, v_new=v_new)
    if which == "inductor" and q.device.type == "cpu":
        return _compiled_attention(spec)(q, state, mask, scale, spec, k_new, v_new)
    return attention_reference(q, st, ls, mask, scale, k_new=k_new, v_new=v_new)


attention = torch.library.custom_op("kvcompile::attention", mutates_args=())(_attention)


@attention.register_fake
def _(q, state, mask, scale, spec, k_new=None, v_new=None):
    return q.new_empty(q.shape)  # contiguous, like every implementation's output (not q's strides)


# What a graph that runs as plain Python (the kvcompile backend's compiler="eager") may call instead of the
# registered operators: the same functions without the dispatcher's per-call work (about 45 us for the store,
# whose eleven mutated state tensors each get a version bump, and 25 us for attention, per layer and step on
# this project's CPU). Inductor and AOTAutograd need the operators themselves.
PLAIN = {torch.ops.kvcompile.store.default: _store, torch.ops.kvcompile.attention.default: _attention}


@torch.library.custom_op("kvcompile::dequantize", mutates_args=())
def dequantize(state: list[Tensor], spec: str) -> tuple[Tensor, Tensor]:
    """The store's contents in model space and dtype, ``[B, H, C, D]`` each; zeros past each length."""
    ls = LayerSpec.from_name(spec)
    k, v = dequantize_reference(KVState(*state), ls, ls.torch_dtype)
    return k, v


@dequantize.register_fake
def _(state, spec):
    ls = LayerSpec.from_name(spec)
    shape = (ls.batch, ls.heads, ls.capacity, ls.head_dim)
    dev = state[0].device
    return (torch.empty(shape, dtype=ls.torch_dtype, device=dev),
            torch.empty(shape, dtype=ls.torch_dtype, device=dev))
