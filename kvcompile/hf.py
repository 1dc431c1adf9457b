"""Hugging Face transformers integration: a Cache whose layers are kvcompile stores.

``KVCompileCache`` is a drop-in ``transformers.Cache`` (static: preallocated to ``max_cache_len``). Each layer
holds a packed ``KVState``; no full-precision tensor of full capacity is allocated.

Eager mode (no torch.compile), ``update`` appends through ``torch.ops.kvcompile.store`` and returns the
dequantized cache (``torch.ops.kvcompile.dequantize``) with the chunk just appended in full precision, for
the model's own attention to read: the exact numerics of the policy (``attention_reference`` with the
chunk), at the cost of materializing the full-precision view every step (this is what the reference path
and the quality evaluation use).

Under Dynamo tracing (``torch.compiler.is_compiling()``) ``update`` does what a StaticLayer does --
``keys.index_copy_(2, pos, k)`` and returns ``keys, values`` -- on *stand-ins* (``kvcompile.standin``):
tensors of the full cache shape over ``B + H + C + D`` elements (unit strides). The graph therefore shows the same
write/read pattern as a plain StaticCache, and the FX pass (``kvcompile.passes``) rewrites it into
``kvcompile.store`` / ``kvcompile.attention`` over the layer's packed state, so no full-precision view of
the cache is ever built. The stand-ins and the packed state are created together, outside the graph, by
``initialize`` (``early_initialization`` or the first eager ``update``).

Importing this module registers every transformers sliding-window ring (``StaticSlidingWindowLayer``) as the
model's own when it is allocated (``standin.leave``), in kvcompile's caches and in a user's ``StaticCache``
alike: the pass must never route a ring's writes to a packed store.
"""
from __future__ import annotations

import functools
import warnings

import torch
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer

from . import ops  # noqa: F401  (registers torch.ops.kvcompile)
from . import standin
from .policy import Policy
from .store import DTYPE_NAMES, CapacityError, KVState, LayerSpec, state_nbytes


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_shape(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers config."""
    c = _text_config(config)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, kv, hd


def windowed_layers(config) -> dict[int, int]:
    """Layer index -> window, for the layers that attend only to the last ``window`` tokens (sliding or
    chunked attention), read from the config the way transformers' own caches read it: ``layer_types`` if
    the config has it, else every layer sliding when ``sliding_window`` is set (Mistral), else chunked when
    ``attention_chunk_size`` is."""
    c = _text_config(config)
    sliding, chunk = getattr(c, "sliding_window", None), getattr(c, "attention_chunk_size", None)
    types = getattr(c, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if sliding else "chunked_attention" if chunk else "full_attention"
        types = [kind] * c.num_hidden_layers
    window = {"sliding_attention": sliding, "chunked_attention": chunk}
    return {i: window[t] for i, t in enumerate(types) if window.get(t)}


class KVCompileWarning(UserWarning):
    """kvcompile runs, but does less than a user would assume; the message says what and why."""


RING_REASON = ("sliding window of {w} tokens: left to transformers' ring (StaticSlidingWindowLayer), which keeps "
               "only the window, in full precision")


def _leave_rings_alone(init):
    """transformers' sliding-window layer rolls its window in place with its own writes: kvcompile must not
    route them to a packed store (the pass would shadow the ring until the window fills, then find the roll).
    Every such layer's tensors are registered as the model's own as they are allocated."""
    @functools.wraps(init)
    def lazy_initialization(self, key_states, value_states):
        init(self, key_states, value_states)
        standin.leave(self.keys, self.values, RING_REASON.format(w=self.max_cache_len))
    lazy_initialization._kvcompile = True
    return lazy_initialization


if not getattr(StaticSlidingWindowLayer.lazy_initialization, "_kvcompile", False):
    StaticSlidingWindowLayer.lazy_initialization = _leave_rings_alone(StaticSlidingWindowLayer.lazy_initialization)


def _ring_is_smaller(policy: Policy, window: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether a full-precision ring of ``window`` tokens holds fewer bytes than ``policy``'s store of
    ``capacity`` tokens (per sequence, everything included)."""
    dt = dtype if isinstance(dtype, torch.dtype) else torch.float32
    ring = 2 * kv_heads * head_dim * min(window, capacity) * torch.empty((), dtype=dt).element_size()
    return ring <= LayerSpec(policy, 1, kv_heads, capacity, head_dim, DTYPE_NAMES[dt]).nbytes()


class KVCompileLayer(StaticLayer):
    """One decoder layer's quantized cache, with StaticLayer's interface (``max_cache_len`` slots).

    keys, values: stand-ins ``[B, H, max_cache_len, D]`` (B + H + C + D elements each); the data lives in
    ``state`` (a packed ``KVState``), registered with ``kvcompile.standin`` under the stand-ins.
    """

    def __init__(self, max_cache_len: int, policy: Policy, name: str = ""):
        super().__init__(max_cache_len=max_cache_len)
        self.policy = policy
        self.name = name
        self.spec: LayerSpec | None = None
        self.state: KVState | None = None

    def initialize(self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Allocate the packed store and the stand-ins (outside any compiled region)."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"KVCompileCache layer {self.name!r} is first used inside torch.compile: its packed store must be "
                f"allocated outside the graph. Create the cache with batch_size=... (or call "
                f"cache.early_initialization(...)) before the compiled call, or use kvcompile.apply, which does it.")
        self.device = torch.device(device)
        self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim = batch_size, num_heads, head_dim, head_dim
        self.spec = LayerSpec(self.policy, batch_size, num_heads, self.max_cache_len, head_dim, DTYPE_NAMES[dtype])
        shape = (batch_size, num_heads, self.max_cache_len, head_dim)
        self.keys = standin.make_standin(shape, dtype, self.device)
        self.values = standin.make_standin(shape, dtype, self.device)
        self.state = standin.register(self.keys, self.values, self.spec, self.name, owned=True)
        self.spec_name = self.spec.name
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, Dk = key_states.shape
        Dv = value_states.shape[-1]
        if Dv != Dk:
            raise NotImplementedError(
                f"kvcompile needs keys and values of the same head_dim; layer {self.name!r} has {Dk} and {Dv}")
        self.initialize(B, H, Dk, key_states.dtype, key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        pos = torch.arange(n, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        if torch.compiler.is_compiling():
            # The pattern the FX pass rewrites into kvcompile.store / kvcompile.attention (a StaticLayer's).
            self.keys.index_copy_(2, pos, key_states)
            self.values.index_copy_(2, pos, value_states)
            return self.keys, self.values
        torch.ops.kvcompile.store(list(self.state), key_states, value_states, pos, self.spec_name)
        k, v = torch.ops.kvcompile.dequantize(list(self.state), self.spec_name)
        # The chunk attends to itself in full precision (``attention_reference`` with k_new, v_new): the
        # compiled path reads the same positions from the chunk's own keys and values.
        return k.index_copy_(2, pos, key_states.to(k.dtype)), v.index_copy_(2, pos, value_states.to(v.dtype))

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.state:
                t.zero_()
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a kvcompile cache is append-only: it cannot be cropped (quantized tokens "
                                  "cannot be un-quantized); reset() it and prefill again")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a kvcompile cache is allocated for a fixed batch; beam search and "
                                  "num_return_sequences > 1 need a cache created for the expanded batch")

    batch_select_indices = reorder_cache = batch_repeat_interleave

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed store plus the two stand-ins (B + H + C + D elements each)."""
        if not self.is_initialized:
            return 0
        return state_nbytes(self.state) + 2 * self.keys.untyped_storage().nbytes()


class KVCompileCache(Cache):
    """A transformers Cache storing every layer per ``policy`` (per-layer overrides resolved by layer name).

    >>> cache = KVCompileCache(model.config, Policy.kivi(4), max_cache_len=4096)
    >>> out = model(input_ids, past_key_values=cache, use_cache=True)   # ``cache=`` on transformers >= 5.2x
    >>> cache.nbytes        # bytes the cache really holds

    With ``batch_size`` (and optionally ``dtype``, ``device``) the packed stores are allocated at once, which
    ``torch.compile`` needs (nothing may be allocated inside the graph); otherwise on the first eager update.

    Layers the model attends over a sliding (or chunked) window only (``windowed_layers``) get transformers'
    own full-precision ring (``StaticSlidingWindowLayer``) instead of a store when that ring holds fewer bytes
    than the policy's store of ``max_cache_len`` tokens; ``rings`` lists them. The pass leaves their reads and
    writes to transformers.
    """

    def __init__(self, config, policy: Policy, max_cache_len: int, layer_names: list[str] | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None, device=None):
        n_layers, kv_heads, head_dim = model_shape(config)
        names = layer_names or [f"model.layers.{i}.self_attn" for i in range(n_layers)]
        policy.check(head_dim)
        self.policies = policy.resolve(names)
        if dtype is None:
            c = _text_config(config)  # transformers 5.x has `dtype` (reading `torch_dtype` warns it is deprecated)
            dtype = (c.dtype if hasattr(c, "dtype") else getattr(c, "torch_dtype", None)) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        windows = windowed_layers(config)
        layers = []
        for i, (p, n) in enumerate(zip(self.policies, names)):
            w = windows.get(i)
            if w is not None and w < max_cache_len and _ring_is_smaller(p, w, max_cache_len, kv_heads, head_dim,
                                                                         dtype):
                layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=w))
            else:
                layers.append(KVCompileLayer(max_cache_len, p, n))
        if all(not isinstance(layer, KVCompileLayer) for layer in layers):
            sizes = sorted({windows[i] for i in range(len(layers))})
            warnings.warn(
                f"every attention layer of this model attends over a window of {', '.join(map(str, sizes))} "
                f"tokens, and at max_cache_len={max_cache_len} transformers' full-precision ring of the window holds "
                f"fewer bytes than kvcompile's store of every token would: kvcompile quantizes nothing in this cache "
                f"(it is the model's own). Quantized stores are used up to about 2x the window for 8-bit policies, "
                f"2.5-5x for 4- and 2-bit KIVI.", KVCompileWarning, stacklevel=2)
        super().__init__(layers=layers)
        self.policy = policy
        self.capacity = max_cache_len
        self.tokens = 0  # tokens appended so far (host-side count: the capacity check needs no device sync)
        if batch_size is not None:
            self.early_initialization(batch_size, kv_heads, head_dim, dtype, device or "cpu")

    @property
    def max_cache_len(self) -> int:
        """Tokens the cache holds at most (a property: transformers 5.1x's ``Cache`` defines it as a read-only
        property, so it cannot be assigned)."""
        return self.capacity

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        for layer in self.layers:
            if layer.is_initialized:
                continue
            if isinstance(layer, KVCompileLayer):
                layer.initialize(batch_size, num_heads, head_dim, dtype, device)
            else:  # a sliding-window ring: allocated by its own code, from an empty chunk of the right shape
                empty = torch.zeros(batch_size, num_heads, 0, head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(empty, empty)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self.check_capacity(key_states.shape[-2])
            self.tokens += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_capacity(self, n: int) -> None:
        if self.tokens + n > self.max_cache_len:
            raise CapacityError(
                f"KV cache overflow: the cache holds {self.tokens} tokens and {n} more were given, but it was "
                f"allocated for {self.max_cache_len} (max_cache_len). Create a larger cache, or pass "
                f"max_cache_len=... to kvcompile.apply.")

    def reset(self) -> None:
        super().reset()
        self.tokens = 0

    @property
    def is_initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's store (codes, scales, zero points, residual, sinks, lengths), and by
        the full-precision rings of sliding-window layers left to transformers."""
        return sum(layer.nbytes if isinstance(layer, KVCompileLayer) else
                   (layer.keys.nbytes + layer.values.nbytes if layer.is_initialized else 0) for layer in self.layers)

    @property
    def rings(self) -> dict[int, int]:
        """Layer index -> window, for the sliding-window layers kept as transformers' full-precision ring
        (chosen where that ring holds fewer bytes than the policy's store of the whole capacity)."""
        return {i: layer.max_cache_len for i, layer in enumerate(self.layers) if not isinstance(layer, KVCompileLayer)}
