"""kvcompile's operators, registered with ``torch.library`` so ``torch.compile(fullgraph=True)`` traces them.

    torch.ops.kvcompile.store(k_cache, v_cache, k, v, pos, spec, cos, sin, rope)        -> token
    torch.ops.kvcompile.attention(q, k_cache, v_cache, token, mask, scale, spec, k_new, v_new)  -> [B, Hq, n, D]
    torch.ops.kvcompile.standin(shape, dtype, device)                                   -> a stand-in

``k_cache, v_cache`` are the layer's cache tensors as the model sees them -- kvcompile's stand-ins, or a
cache the user allocated in full precision -- and ``spec`` the name of the store's ``LayerSpec``. The ops
find the layer's packed store from the cache tensor at every call (``kvcompile.standin``), so the store
lives outside the graph: it grows, is cropped and reordered between calls, and the graph never sees its
tensors or their shapes (one compiled graph serves every length). ``store`` returns an empty token that
``attention`` takes, which orders the two for any compiler (neither declares the store's mutation: the store
is not a graph value).

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
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import standin
from .errors import ArgumentError, UnsupportedError
from .store import (KVState, KVStore, LayerSpec, attention_reference, check_chunk, cover, dequantize_reference,
                    row_rings, store_reference)

KERNELS = ("auto", "triton", "cpu", "inductor", "reference")


def _check_kernels(name, what: str, fix: str = "") -> None:
    """Refuse a kernel family that does not exist, or Triton where it cannot run; ``what`` names the setting."""
    if not isinstance(name, str) or name not in KERNELS:
        raise ArgumentError(f"{what}={name!r} is not valid: expected one of {', '.join(KERNELS)} "
                         f"(auto: Triton on CUDA, the C kernels on the CPU){fix}")
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnsupportedError(f"{what}='triton' needs CUDA, or TRITON_INTERPRET=1 set before kvcompile is imported "
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


# --------------------------------------------------------------------------- kernel families
@dataclass(frozen=True)
class Backend:
    """One family of kernels: ``store(state, spec, k, v, n_new)`` appends (blocks reserved by the caller),
    ``attention(q, state, spec, mask, scale, k_new, v_new, rope, invariant, groups, rings)`` reads; both with
    ``store_reference``'s and ``attention_reference``'s contracts. ``invariant``: each row's result depends on
    that row alone, not on the batch beside it (the reference and the C kernels always; Triton's decode kernel
    when asked: ``templates.launch.attention``). ``groups``: offsets of runs of rows that are one sequence's
    positions in ascending order (a prompt's queries as decode rows), which a kernel may read shared tiles once
    for (the C kernels: ``templates.cpu.attention``); the result is the same bits without it. ``rings``: row ``b``
    reads ring ``rings[b]`` of the state's ``k_res, v_res`` (rows of a group whose full-precision positions begin
    at the same position share one), or None: its own. ``flat`` (``kvcompile.store.FlatRecent``): each row's
    full-precision positions are rows of one flat tensor by a map, not the state's rings (the C kernels read them
    there; the others read ``store.flat_rings``). ``devices``: the device types it runs on."""

    store: Callable
    attention: Callable
    devices: tuple[str, ...]


def _triton():
    from .templates import launch  # imported lazily: Triton is only needed when its kernels run
    return launch


def _cpu_store(state, spec, k, v, n_new=None):
    from .templates import cpu_store
    cpu_store.store(state, spec, k, v, n_new)


def _reference_attention(q, state, spec, mask, scale, k_new=None, v_new=None, rope=None, invariant=False,
                         groups=None, rings=None, flat=None):
    return attention_reference(q, row_rings(state, spec, rings, flat), spec, mask, scale, k_new=k_new,
                               v_new=v_new, rope=rope)


def _cpu_attention(q, state, spec, mask, scale, k_new=None, v_new=None, rope=None, invariant=False,
                   groups=None, rings=None, flat=None):
    # (a row's result never depends on the batch: the C decode kernel's splits follow its own length)
    from .templates import cpu, prefill
    if cpu.check_decode(q, spec) is None:  # decode: the C kernel reads the packed bytes (and ``flat``) where they lie
        return cpu.attention(q, state, spec, mask, scale, k_new=k_new, v_new=v_new, rope=rope, groups=groups,
                             rings=rings, flat=flat)
    return prefill.prefill_attention(q, row_rings(state, spec, rings, flat), spec, mask, scale,
                                     k_new=k_new, v_new=v_new, rope=rope)


def _triton_store(state, spec, k, v, n_new=None):
    _triton().store(state, spec, k, v, n_new)


def _triton_attention(q, state, spec, mask, scale, k_new=None, v_new=None, rope=None, invariant=False,
                      groups=None, rings=None, flat=None):
    return _triton().attention(q, row_rings(state, spec, rings, flat), spec, mask, scale, k_new=k_new,
                               v_new=v_new, rope=rope, invariant=invariant, groups=groups)


def _fused_attention(q, state, mask, scale, spec_name, k_new=None, v_new=None, rope=None):
    from .templates import inductor
    from .store import Rope
    return inductor.attention(q, KVState(*state), LayerSpec.from_name(spec_name), mask, scale, k_new, v_new,
                              rope=Rope(*rope) if rope is not None else None)


@functools.lru_cache(maxsize=None)
def _compiled_attention(spec_name: str):
    """``templates.inductor.attention`` compiled for one store layout (built once, shared by every layer
    with that layout). Its own code object per layout, so Dynamo's per-code recompile limit is per layout."""
    code = _fused_attention.__code__.replace(co_name=f"kvcompile_attention_{abs(hash(spec_name)):x}")
    fn = type(_fused_attention)(code, _fused_attention.__globals__)
    return torch.compile(fn, fullgraph=True)


def _inductor_attention(q, state, spec, mask, scale, k_new=None, v_new=None, rope=None, invariant=False,
                        groups=None, rings=None, flat=None):
    return _compiled_attention(spec.name)(q, list(row_rings(state, spec, rings, flat)), mask, scale,
                                          spec.name, k_new, v_new, list(rope) if rope is not None else None)


BACKENDS = {
    "reference": Backend(store_reference, _reference_attention, ("cpu", "cuda")),
    "cpu": Backend(_cpu_store, _cpu_attention, ("cpu",)),
    "inductor": Backend(_cpu_store, _inductor_attention, ("cpu",)),
    "triton": Backend(_triton_store, _triton_attention, ("cuda", "cpu")),  # CPU: Triton's interpreter (tests)
}


def backend(device: torch.device) -> Backend:
    """The kernels that run for tensors on ``device`` (``kernels(device)``); an error, never a silent
    substitute, when that family cannot run there."""
    name = kernels(device)
    b = BACKENDS[name]
    if device.type not in b.devices:
        raise UnsupportedError(f"kvcompile kernels {name!r} run on {'/'.join(b.devices)} tensors, but this cache is on "
                           f"{device}: choose kernels that run there (kvcompile.ops.set_kernels('auto'))")
    return b


# --------------------------------------------------------------------------- the store behind a cache tensor
def store_for(k_cache: Tensor, v_cache: Tensor, spec_name: str) -> KVStore:
    """The packed store behind the cache tensors, created on first use for a cache kvcompile did not allocate.

    Not yet registered: a stand-in the compiled graph itself allocated (a transformers StaticCache that
    initializes lazily inside the compiled region: its ``torch.zeros`` became ``kvcompile.standin``), or a
    cache the user allocated in full precision (``torch.compile(..., backend="kvcompile")`` over a
    StaticCache): it gets an empty store that shadows it, limited to the tensor's capacity, as the tensor is.
    """
    slot = standin.lookup(k_cache)
    if slot is not None:
        if slot.spec_name != spec_name:
            from .errors import UnsupportedError
            raise UnsupportedError(
                f"layer {slot.layer}: this graph was compiled for the store layout {spec_name} but the cache passed "
                f"in holds {slot.spec_name}. Use caches of the policy the model was compiled with (or "
                f"torch._dynamo.reset() before compiling for another).")
        return slot.store
    spec = LayerSpec.from_name(spec_name)
    st = KVStore(spec, k_cache.shape[0], k_cache.device, max_tokens=k_cache.shape[2])
    return standin.register(k_cache, v_cache, st, "", owned=standin.is_standin(k_cache))


def _positions_at(st: KVStore, pos: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Bring the store to where the model writes: ``pos [n]`` are the positions the model meant to write
    (``cache_position`` / ``input_pos``). Writing where the store ends appends; writing earlier rewinds (as a
    static cache overwrites its slots: the store is cropped to ``pos[0]``, so position 0 starts a new
    sequence); a gap is an error. A full-precision cache kvcompile shadows since after some tokens were
    written into it (a prefill that ran eagerly) is taken over: those tokens are stored first."""
    if not pos.numel():
        return
    first = int(pos.reshape(-1)[0])
    L = st.lengths
    if len(set(L)) != 1:
        raise UnsupportedError(f"kvcompile cache write at position {first} into sequences of different lengths {L}: "
                           f"a write by position needs every sequence at the same length")
    if first == L[0]:
        return
    if first < L[0]:
        st.crop(first)
        return
    if L[0] == 0 and not standin.is_standin(k_cache) and first <= k_cache.shape[2]:
        if st.spec.policy.pre_rope:
            from .store import RopeError
            raise RopeError(
                f"kvcompile cache write at position {first} into a cache whose first {first} tokens were written "
                f"outside the compiled graph, after their rotary embedding: a pre_rope policy cannot take them "
                f"over. Run the whole generation through the compiled model (kvcompile.apply), or use a policy "
                f"without pre_rope.")
        st.append(k_cache[:, :, :first], v_cache[:, :, :first], kernel=backend(k_cache.device).store)
        return
    raise UnsupportedError(
        f"kvcompile cache write at position {first}, but the cache holds {L[0]} tokens: positions must continue "
        f"where the cache ends (or go back: the cache is cropped there). Reset the cache (cache.reset()) before "
        f"a new sequence.")


def _store(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, pos: Tensor, spec: str,
           cos: Tensor | None = None, sin: Tensor | None = None, rope: str = "") -> Tensor:
    """Append ``k, v [B, H, n, D]`` to the store behind ``k_cache``/``v_cache`` at positions ``pos [n]``.

    ``rope`` ("half:<rotary_dim>" or "pairs:<rotary_dim>", ``kvcompile.store.rope_pairing``), with the chunk's
    ``cos, sin`` as the model computed them: ``k`` is the keys before their rotary embedding (a pre_rope
    policy, the pass found the embedding); the store keeps them so and captures cos/sin per position."""
    st = store_for(k_cache, v_cache, spec)
    slot = standin.lookup(k_cache)
    if slot is None or not slot.appends:
        _positions_at(st, pos, k_cache, v_cache)
    if st.spec.policy.pre_rope:
        st.write_keys(bool(rope))
    elif rope:
        raise ArgumentError(f"kvcompile.store got pre-RoPE keys ({rope}) for the layout {spec}, which stores "
                         f"post-RoPE keys")
    if rope:
        form, rd = rope.split(":")
        st.capture_rope(cos, sin, form, k.shape[2])
    st.append(k, v, kernel=backend(k.device).store)
    return k.new_empty(0)


store = torch.library.custom_op("kvcompile::store", mutates_args=())(_store)


@store.register_fake
def _(k_cache, v_cache, k, v, pos, spec, cos=None, sin=None, rope=""):
    return k.new_empty(0)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, token: Tensor, mask: Tensor | None, scale: float,
               spec: str, k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
    """Attention of the last ``n`` tokens' queries ``q [B, Hq, n, D]`` over the store behind ``k_cache``;
    ``k_new, v_new [B, H, n, D]``, the chunk just stored, are read in full precision at its own positions (see
    ``attention_reference`` for the exact semantics of ``mask`` and the chunk). ``token``: ``store``'s."""
    st = store_for(k_cache, v_cache, spec)
    check_chunk(q, k_new, v_new, st.spec)
    mask = cover(mask, st.state, max(st.lengths, default=0))  # (the host's lengths: no device sync)
    rope = st.rope()  # pre-RoPE keys: attention rotates them (None otherwise, and no argument is passed)
    kw = {"rope": rope} if rope is not None else {}
    return backend(q.device).attention(q, st.state, st.spec, mask, scale, k_new=k_new, v_new=v_new, **kw)


attention = torch.library.custom_op("kvcompile::attention", mutates_args=())(_attention)


@attention.register_fake
def _(q, k_cache, v_cache, token, mask, scale, spec, k_new=None, v_new=None):
    return q.new_empty(q.shape)  # contiguous, like every implementation's output (not q's strides)


def _exact_view(k_cache: Tensor, v_cache: Tensor, token: Tensor, spec: str) -> tuple[Tensor, Tensor]:
    """For an exact layout (``Policy.exact``): the store behind ``k_cache`` as a full-precision cache of its shape
    ``[B, H, C, D]`` -- the values written, zeros past each length (``KVStore.exact_view``) -- for the graph's
    own attention to read. ``token``: ``store``'s (orders the read after the write)."""
    return store_for(k_cache, v_cache, spec).exact_view(k_cache.shape[2])


exact_view = torch.library.custom_op("kvcompile::exact_view", mutates_args=())(_exact_view)


@exact_view.register_fake
def _(k_cache, v_cache, token, spec):
    return k_cache.new_empty(k_cache.shape), v_cache.new_empty(v_cache.shape)  # contiguous, as KVStore's


def _rotate(x: Tensor, kernel: str) -> Tensor:
    """``kvcompile.store.rotate_reference(x)``'s bits from one of its kernels: "cpu" (C, ``templates.cpu_rotate``)
    or "triton" (``templates.rotate``); ``store._rotate`` chooses. An operator too, so that a graph Dynamo traces
    (the "inductor" family's attention, which rotates its chunk) holds the kernel itself, not the specification's
    torch operations."""
    if kernel == "cpu":
        from .templates.cpu_rotate import rotate as cpu_rotate
        return cpu_rotate(x)
    from .templates.rotate import rotate as triton_rotate
    return triton_rotate(x)


rotate = torch.library.custom_op("kvcompile::rotate", mutates_args=())(_rotate)


@rotate.register_fake
def _(x, kernel):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as both kernels return


def _new_standin(shape: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cache tensor the graph allocates (a lazily initialized StaticCache), as a stand-in: no
    full-precision memory; its store is created by the first ``store`` call that writes it."""
    return standin.make_standin(shape, dtype, device)


new_standin = torch.library.custom_op("kvcompile::standin", mutates_args=())(_new_standin)


@new_standin.register_fake
def _(shape, dtype, device):
    return torch.empty_strided(shape, [1] * len(shape), dtype=dtype, device=device)


# kvcompile's operators that do host-side work at every call (the store's block manager, the store looked up from
# its cache tensor, the serving cache's plan of the batch): a CUDA graph must never record them
# (``backend.cudagraph_patches`` partitions the graph around them)
HOST_OPS = ("kvcompile::store", "kvcompile::attention", "kvcompile::standin", "kvcompile::exact_view",
            "kvcompile::paged_store", "kvcompile::paged_attention", "kvcompile::paged_read")

# What a graph that runs as plain Python (the kvcompile backend's compiler="eager") may call instead of the
# registered operators: the same functions without the dispatcher's per-call work. Inductor and AOTAutograd
# need the operators themselves.
PLAIN = {torch.ops.kvcompile.store.default: _store, torch.ops.kvcompile.attention.default: _attention,
         torch.ops.kvcompile.standin.default: _new_standin, torch.ops.kvcompile.exact_view.default: _exact_view}


def dequantized(k_cache: Tensor, v_cache: Tensor, spec: str, positions: int) -> tuple[Tensor, Tensor]:
    """The store's contents in model space and dtype, ``[B, H, positions, D]`` each; zeros past each length
    (the eager path of ``KVCompileCache``, which hands the model's own attention the dequantized cache)."""
    st = store_for(k_cache, v_cache, spec)
    return dequantize_reference(st.state, st.spec, st.spec.torch_dtype, end=positions)
