"""Hugging Face transformers integration: a Cache whose layers are kvcompile stores.

``KVCompileCache`` is a drop-in ``transformers.Cache``. Each layer holds a packed, paged store
(``kvcompile.store.KVStore``): it grows as tokens come (no full-precision tensor of full capacity is ever
allocated, and a sequence holds the blocks it has written), and it is cropped (assisted and prompt-lookup
decoding), forked and reordered (beam search, ``num_return_sequences``) in place.

Under Dynamo tracing (``torch.compiler.is_dynamo_compiling()``, a constant of the trace, so another thread's
compilation never changes what an eager call does) ``update`` does what a StaticLayer does --
``keys.index_copy_(2, pos, k)`` and returns ``keys, values`` -- on *stand-ins* (``kvcompile.standin``): tensors
of the cache's shape ``[B, H, C, D]`` over ``B + H + C + D`` elements (unit strides). The graph therefore shows
the write/read pattern of a plain StaticCache, and the FX pass (``kvcompile.passes``) rewrites it into
``kvcompile.store`` / ``kvcompile.attention`` over the layer's packed store, so no full-precision view of the
cache is ever built. ``C`` is only the width of the attention mask: it grows in steps of ``CAPACITY_STEP``
tokens (new stand-ins over the same store) and is a dynamic dimension of the graph, so one compiled graph
serves every length.

Eager mode (no torch.compile: the unmodified model given a ``KVCompileCache``), ``update`` appends through the
store and returns the dequantized cache with the chunk just appended in full precision, for the model's own
attention to read: the exact numerics of the policy (``attention_reference`` with the chunk), at the cost of
a full-precision view every step (the reference path, and the quality evaluation's).

Importing this module registers every transformers sliding-window ring (``StaticSlidingWindowLayer``) as the
model's own when it is allocated (``standin.leave``), in kvcompile's caches and in a user's ``StaticCache``
alike: the pass must never route a ring's writes to a packed store.
"""
from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer

from . import ops, standin
from .errors import ArgumentError, ArgumentTypeError, KVCompileWarning, Unimplemented, UnsupportedError
from .policy import Policy
from .store import RopeError, RopeTable, DTYPE_NAMES, KVStore, LayerSpec, dequantize_reference, normal_tensors


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




RING_REASON = ("sliding window of {w} tokens: left to transformers' ring (StaticSlidingWindowLayer), which keeps "
               "only the window, in full precision")


def _leave_rings_alone(init):
    """transformers' sliding-window layer rolls its window in place with its own writes: kvcompile must not
    route them to a packed store (the pass would shadow the ring until the window fills, then find the roll).
    Every such layer's tensors are registered as the model's own as they are allocated."""
    @functools.wraps(init)
    def lazy_initialization(self, key_states, value_states):
        init(self, key_states, value_states)
        if not torch.compiler.is_dynamo_compiling():  # (allocated inside a graph: the pass sees the ring's roll)
            standin.leave(self.keys, self.values, RING_REASON.format(w=self.max_cache_len))
    lazy_initialization._kvcompile = True
    return lazy_initialization


if not getattr(StaticSlidingWindowLayer.lazy_initialization, "_kvcompile", False):
    StaticSlidingWindowLayer.lazy_initialization = _leave_rings_alone(StaticSlidingWindowLayer.lazy_initialization)


def _ring_is_smaller(policy: Policy, window: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether a full-precision ring of ``window`` tokens holds fewer bytes than ``policy``'s store of
    ``capacity`` tokens (per sequence, everything included)."""
    from .accounting import full_precision_bytes_per_token
    dt = dtype if isinstance(dtype, torch.dtype) else torch.float32
    ring = min(window, capacity) * full_precision_bytes_per_token(1, kv_heads, head_dim, dt)
    return ring <= LayerSpec(policy, kv_heads, head_dim, DTYPE_NAMES[dt]).nbytes(1, capacity)


CAPACITY_STEP = 256  # the stand-ins' width (the attention mask's) grows in steps of this many tokens


def _copy_attributes(obj, memo: dict, keep: tuple = ()):
    """A new object of ``obj``'s class whose attributes are deep copies of ``obj``'s (those named in ``keep``: the
    same objects), for ``__deepcopy__``. Run it outside inference mode (``normal_tensors``): a copy made inside
    ``torch.inference_mode`` is written in place by later calls, as the original is."""
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    for k, v in obj.__dict__.items():
        new.__dict__[k] = v if k in keep else copy.deepcopy(v, memo)
    return new


def _tracing() -> bool:
    return torch.compiler.is_dynamo_compiling()


def _width(tokens: int) -> int:
    """The stand-ins' width (the attention mask's) for ``tokens`` tokens: whole steps, at least one."""
    return max(1, -(-tokens // CAPACITY_STEP)) * CAPACITY_STEP


def _query_length(x) -> int:
    """``get_mask_sizes``' argument: the query length (transformers 5.2x) or the cache positions (5.1x)."""
    return x.shape[-1] if isinstance(x, torch.Tensor) else int(x)


class KVCompileLayer(StaticLayer):
    """One decoder layer's quantized cache, with StaticLayer's interface.

    keys, values: stand-ins ``[B, H, C, D]`` (B + H + C + D elements each) over the layer's packed ``store``
    (a ``KVStore``); ``C`` is the attention mask's width, at least the tokens held plus the next call's.
    max_cache_len: the most tokens a sequence may hold (``CapacityError`` beyond), or None for no limit.
    """

    def __init__(self, policy: Policy, name: str = "", max_cache_len: int | None = None):
        super().__init__(max_cache_len=max_cache_len or 0)
        self.policy = policy
        self.name = name
        self.limit = max_cache_len
        self.spec: LayerSpec | None = None
        self.store: KVStore | None = None
        self.expected = 0  # tokens each sequence is expected to reach (KVCompileCache.expect)
        self.rope_table = None  # pre_rope: the cos/sin per position, shared by the cache's layers
        # every layer of the cache is exact (KVCompileCache.exact): eagerly, this layer is a DynamicLayer over the
        # paged store -- it returns the tokens held, no more, and sizes the mask as DynamicLayer does
        self.dynamic = False

    @property
    def is_compileable(self) -> bool:
        """A StaticLayer's (masks are built for a static width), except where this layer is read eagerly as a
        DynamicLayer (``dynamic``): transformers then builds the masks it builds for a DynamicCache."""
        return not (self.dynamic and not _tracing())

    def expect(self, tokens: int) -> None:
        self.expected = max(self.expected, tokens)
        if self.store is not None:
            self.store.expect(self.expected)

    # ---- allocation (always outside any compiled region)
    @normal_tensors
    def initialize(self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Create the (empty) packed store and the stand-ins."""
        if _tracing():
            raise UnsupportedError(
                f"KVCompileCache layer {self.name!r} is first used inside torch.compile: its packed store must be "
                f"created outside the graph. Create the cache with batch_size=... (or call "
                f"cache.early_initialization(...)) before the compiled call, or use kvcompile.apply, which does it.")
        if dtype not in DTYPE_NAMES:
            raise ArgumentTypeError(f"KVCompileCache: the model's dtype {dtype} has no kvcompile store; supported: "
                            f"{sorted(DTYPE_NAMES.values(), key=str)}")
        self.device = torch.device(device)
        self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim = batch_size, num_heads, head_dim, head_dim
        self.dtype = dtype
        self.spec = LayerSpec(self.policy, num_heads, head_dim, DTYPE_NAMES[dtype])
        self.spec_name = self.spec.register()
        self.store = KVStore(self.spec, batch_size, self.device, max_tokens=self.limit)
        self.store.rope_table = self.rope_table
        if self.expected:
            self.store.expect(self.expected)
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=self.device)
        # a fixed address, as transformers' StaticLayer marks its own: the compiled graph adds to it in place, and
        # CUDA graphs skip a graph that mutates an input of no fixed address (mode="reduce-overhead")
        torch._dynamo.mark_static_address(self.cumulative_length)
        self._standins(CAPACITY_STEP)
        self.is_initialized = True

    @normal_tensors
    def _standins(self, width: int) -> None:
        """New stand-ins of ``width`` positions (and the store's batch) over the same store. Their width is a
        dynamic dimension for Dynamo, so new widths reuse the compiled graph."""
        shape = (self.store.batch, self.num_heads, width, self.k_head_dim)
        self.keys = standin.make_standin(shape, self.dtype, self.device)
        self.values = standin.make_standin(shape, self.dtype, self.device)
        torch._dynamo.mark_dynamic(self.keys, 2)
        torch._dynamo.mark_dynamic(self.values, 2)
        # fixed addresses: CUDA graphs then pass kvcompile's ops these very tensors (the store is looked up by
        # identity), never copies into a recorded graph's input buffers
        torch._dynamo.mark_static_address(self.keys)
        torch._dynamo.mark_static_address(self.values)
        standin.register(self.keys, self.values, self.store, self.name, owned=True, appends=True)
        self.batch_size = self.store.batch

    @normal_tensors
    def __deepcopy__(self, memo) -> "KVCompileLayer":
        """An independent layer holding the same tokens (transformers' prompt-reuse recipe deep-copies a cache
        per continuation): the store copied (``KVStore.copy``: blocks, ring, sinks, tables), and new stand-ins
        registered to the copy. The stand-ins themselves are never copied: a copy of a stand-in is a tensor no
        store stands behind."""
        new = _copy_attributes(self, memo, keep=("policy", "spec", "keys", "values"))
        if self.is_initialized:
            new._standins(self.keys.shape[2])
        return new

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, Dk = key_states.shape
        Dv = value_states.shape[-1]
        if Dv != Dk:
            raise Unimplemented(
                f"kvcompile needs keys and values of the same head_dim; layer {self.name!r} has {Dk} and {Dv}")
        self.initialize(B, H, Dk, key_states.dtype, key_states.device)

    def ensure(self, n: int) -> None:
        """Make the stand-ins wide enough for the tokens held plus ``n`` more (eagerly, before a call)."""
        if not self.is_initialized or _tracing():
            return
        need = max(self.store.lengths, default=0) + n
        if need > self.keys.shape[2]:
            self._standins(_width(need))

    # ---- what the model calls
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        pos = torch.arange(n, device=self.cumulative_length.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        if _tracing():
            # The pattern the FX pass rewrites into kvcompile.store / kvcompile.attention (a StaticLayer's).
            self.keys.index_copy_(2, pos, key_states)
            self.values.index_copy_(2, pos, value_states)
            return self.keys, self.values
        if self.policy.pre_rope:
            raise RopeError(
                f"KVCompileCache layer {self.name!r}: its policy stores keys before the rotary embedding "
                f"(pre_rope=True), which only the compiled model can do (the FX pass finds the embedding); this "
                f"update runs eagerly and receives rotated keys. Use kvcompile.apply (which compiles every call of a "
                f"pre_rope policy), or a policy without pre_rope for an eager cache.")
        self.ensure(n)
        held = self.store.lengths[0]
        ops._store(self.keys, self.values, key_states, value_states, pos.cpu(), self.spec_name)
        if self.dynamic:  # what DynamicLayer returns (its torch.cat): the tokens held, contiguous, as written
            return self.store.exact_view(held + n)
        width = self.keys.shape[2]
        if held == 0:  # a first prefill reads only its own chunk, in full precision: no view to dequantize
            pad = (0, 0, 0, width - n)
            return F.pad(key_states, pad), F.pad(value_states, pad)
        k, v = ops.dequantized(self.keys, self.values, self.spec_name, width)
        # The chunk attends to itself in full precision (``attention_reference`` with k_new, v_new): the
        # compiled path reads the same positions from the chunk's own keys and values.
        pos = pos.to(k.device)
        return k.index_copy_(2, pos, key_states.to(k.dtype)), v.index_copy_(2, pos, value_states.to(v.dtype))

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        n = _query_length(query_length)
        if self.dynamic and not _tracing():  # DynamicLayer's: the tokens held and the query's
            return (self.store.lengths[0] if self.is_initialized else 0) + n, 0
        self.ensure(n)
        return (self.keys.shape[2] if self.is_initialized else _width(n)), 0

    def get_seq_length(self):
        if not self.is_initialized:
            return 0
        return self.cumulative_length if _tracing() else self.store.lengths[0]

    def get_max_length(self) -> int:
        return self.limit if self.limit is not None else -1

    # ---- cache operations (generate's)
    def crop(self, tokens_to_remove: int) -> None:
        """Negative (or 0): remove that many tokens from the end (transformers 5.2x); positive: keep that many
        (the older convention). See ``KVStore.crop`` for what a crop into packed storage keeps."""
        if not self.is_initialized:
            return
        L = self.store.lengths[0]
        keep = L + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        keep = max(0, keep)
        if keep >= L:
            return
        self.store.crop(keep)
        self.cumulative_length.fill_(keep)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Sequence ``i`` becomes sequence ``indices[i]`` (reorder, fork or drop)."""
        if not self.is_initialized:
            return
        self.store.select(torch.as_tensor(indices).reshape(-1).cpu())
        if self.keys.shape[0] != self.store.batch:
            self._standins(self.keys.shape[2])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.store.batch).repeat_interleave(repeats))

    def reset(self) -> None:
        if self.is_initialized:
            self.store.reset()
            self.cumulative_length.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes the sequences hold (``KVStore.nbytes``: their blocks, rings, sinks, lengths, tables), plus the
        two stand-ins (B + H + C + D elements each)."""
        if not self.is_initialized:
            return 0
        return self.store.nbytes + 2 * self.keys.untyped_storage().nbytes()

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated: ``nbytes``, plus the pool's free blocks (the pool grows by doubling)."""
        if not self.is_initialized:
            return 0
        return self.store.reserved_nbytes + 2 * self.keys.untyped_storage().nbytes()


class RingLayer(StaticSlidingWindowLayer):
    """transformers' sliding-window ring, kept for a windowed layer where it is smaller than a store. Its
    tensors are registered as the model's own (the pass leaves them alone) again whenever transformers
    replaces them (beam search's reorder, forks)."""

    @normal_tensors
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def lazy_initialization(self, key_states, value_states):
        if _tracing():  # (allocated inside a graph: see _leave_rings_alone)
            return super().lazy_initialization(key_states, value_states)
        with torch.inference_mode(False):
            super().lazy_initialization(key_states, value_states)

    @normal_tensors
    def __deepcopy__(self, memo) -> "RingLayer":
        """A copy of the ring, registered as the model's own like the original."""
        new = _copy_attributes(self, memo)
        new._leave()
        return new

    def _leave(self):
        if self.is_initialized:
            standin.leave(self.keys, self.values, RING_REASON.format(w=self.max_cache_len))

    @normal_tensors
    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._leave()

    @normal_tensors
    def batch_select_indices(self, indices):
        if self.is_initialized:
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]
        self._leave()

    @normal_tensors
    def batch_repeat_interleave(self, repeats):
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)
        self._leave()

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    reserved_nbytes = nbytes


def _exact_layers(config, policies: list[Policy], names: list[str], max_cache_len: int | None) -> list:
    """For a cache whose every layer is exact: the layers of the ``DynamicCache`` transformers makes for
    ``config`` (what the unmodified model's ``generate`` uses), each plain ``DynamicLayer`` a ``KVCompileLayer``
    (``dynamic``: read eagerly as a DynamicLayer), the others (sliding-window layers) transformers' own."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    own = DynamicCache(config=config).layers
    if len(own) != len(policies):  # (a config transformers builds no layers for: every layer full attention)
        own = [DynamicLayer() for _ in policies]
    layers = []
    for layer, p, n in zip(own, policies, names):
        if type(layer) is DynamicLayer:
            layer = KVCompileLayer(p, n, max_cache_len)
            layer.dynamic = True
        layers.append(layer)
    return layers


class KVCompileCache(Cache):
    """A transformers Cache storing every layer per ``policy`` (per-layer overrides resolved by layer name).

    >>> cache = KVCompileCache(model.config, Policy.kivi(4))
    >>> out = model(input_ids, cache=cache, use_cache=True)   # ``past_key_values=`` on transformers 5.1x
    >>> cache.nbytes        # bytes the cache really holds

    max_cache_len: the most tokens a sequence may hold (``CapacityError`` beyond); None (the default): the
    cache grows as long as memory lasts. Every layer exact (``Policy.full()``, ``exact``): the layers of the
    ``DynamicCache`` transformers makes, its full-attention ones paged stores that an eager forward reads as
    ``DynamicLayer``s (``model_arithmetic=False`` keeps the compiled path's layout instead). With ``batch_size`` (and optionally ``dtype``, ``device``) the
    stores are created at once, which ``torch.compile`` needs (nothing may be allocated inside the graph);
    otherwise on the first eager update (``kvcompile.apply`` does it before each compiled call).

    Layers the model attends over a sliding (or chunked) window only (``windowed_layers``) get transformers'
    own full-precision ring instead of a store when that ring holds fewer bytes than the policy's store of
    ``max_cache_len`` tokens (without a limit: of the model's ``max_position_embeddings``); ``rings`` lists
    them. The pass leaves their reads and writes to transformers.
    """

    def __init__(self, config, policy: Policy, max_cache_len: int | None = None, layer_names: list[str] | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None, device=None,
                 kv_heads: int | None = None, model_arithmetic: bool = True):
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                          or max_cache_len < 1):
            raise ArgumentError(f"KVCompileCache max_cache_len={max_cache_len!r} is not valid: expected a positive "
                             f"number of tokens, or None for a cache that grows without limit")
        n_layers, model_kv_heads, head_dim = model_shape(config)
        # kv_heads: the KV heads this process's attention computes -- under tensor parallelism its share of the
        # model's (kvcompile.tp); default: the config's
        if kv_heads is not None and (not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1):
            raise ArgumentError(f"KVCompileCache kv_heads={kv_heads!r} is not valid: expected a positive number of KV "
                             f"heads (this rank's share under tensor parallelism), or None for the config's")
        kv_heads = kv_heads or model_kv_heads
        names = layer_names or [f"model.layers.{i}.self_attn" for i in range(n_layers)]
        if not isinstance(policy, Policy):
            raise ArgumentTypeError(f"KVCompileCache(config, policy): policy={policy!r} is not a kvcompile.Policy")
        policy.check(head_dim)
        self.policies = policy.resolve(names)
        self.explicit_dtype = dtype is not None
        if dtype is None:
            c = _text_config(config)  # transformers 5.x has `dtype` (reading `torch_dtype` warns it is deprecated)
            dtype = (c.dtype if hasattr(c, "dtype") else getattr(c, "torch_dtype", None)) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        windows = windowed_layers(config)
        horizon = max_cache_len or getattr(_text_config(config), "max_position_embeddings", None) or 2 ** 20
        # every layer exact (Policy.full()): the layers of the DynamicCache transformers would make, each plain
        # DynamicLayer a KVCompileLayer over a paged store, which an eager forward reads as a DynamicLayer
        # (model_arithmetic=False: the layout a compiled graph reads even then -- what explain traces)
        self.exact = model_arithmetic and all(p.exact for p in self.policies)
        layers = _exact_layers(config, self.policies, names, max_cache_len) if self.exact else []
        for i, (p, n) in enumerate(zip(self.policies, names) if not self.exact else ()):
            w = windows.get(i)
            if w is not None and w < horizon and _ring_is_smaller(p, w, horizon, kv_heads, head_dim, dtype):
                layers.append(RingLayer(max_cache_len=horizon, sliding_window=w))
            else:
                layers.append(KVCompileLayer(p, n, max_cache_len))
        if not self.exact and all(not isinstance(layer, KVCompileLayer) for layer in layers):
            sizes = sorted({windows[i] for i in range(len(layers))})
            warnings.warn(
                f"every attention layer of this model attends over a window of {', '.join(map(str, sizes))} "
                f"tokens, and at {horizon} tokens transformers' full-precision ring of the window holds fewer bytes "
                f"than kvcompile's store of every token would: kvcompile quantizes nothing in this cache (it is the "
                f"model's own). Quantized stores are used up to about 2x the window for 8-bit policies, 2.5-5x for "
                f"4- and 2-bit KIVI (pass a smaller max_cache_len to bound the cache).", KVCompileWarning,
                stacklevel=2)
        super().__init__(layers=layers)
        self.policy = policy
        self.layer_names = names
        table = RopeTable() if any(p.pre_rope for p in self.policies) else None
        for layer in layers:
            if isinstance(layer, KVCompileLayer):
                layer.rope_table = table
        self.limit = max_cache_len
        self.dtype = dtype
        self.shape = (kv_heads, head_dim)
        if batch_size is not None:
            self.early_initialization(batch_size, kv_heads, head_dim, dtype, device or "cpu")

    def __copy__(self) -> "KVCompileCache":
        """``copy.copy`` gives an independent cache too: two caches sharing one store would each append into the
        other's sequences (transformers' own ``copy.copy`` of a cache shares its layers)."""
        return copy.deepcopy(self)

    @property
    def max_cache_len(self) -> int | None:
        """The most tokens a sequence may hold, or None (no limit). A property: transformers 5.1x's ``Cache``
        defines it as a read-only property."""
        return self.limit

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        for layer in self.layers:
            if layer.is_initialized:
                continue
            if isinstance(layer, KVCompileLayer):
                layer.initialize(batch_size, num_heads, head_dim, dtype, device)
            else:  # a sliding-window ring: allocated by its own code, from an empty chunk of the right shape
                empty = torch.zeros(batch_size, num_heads, 0, head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(empty, empty)

    def prepare(self, batch: int, n: int, dtype: torch.dtype, device, heads: int | None = None) -> None:
        """Before a compiled call of ``n`` tokens for ``batch`` sequences: create the stores if needed, check
        they match the call, and widen the stand-ins for the new tokens (all outside the graph). ``heads``:
        the KV heads the model's attention computes here (under tensor parallelism, this rank's share)."""
        if heads is not None and heads != self.shape[0]:
            if any(layer.is_initialized for layer in self.layers):
                raise ArgumentError(
                    f"this KVCompileCache holds {self.shape[0]} KV heads per layer, but the model's attention "
                    f"computes {heads} here (under tensor parallelism: this rank's share of the model's heads): "
                    f"create the cache with kv_heads={heads}, or pass no cache (kvcompile.apply creates one per rank)")
            self.shape = (heads, self.shape[1])
        if not self.is_initialized:
            if self.explicit_dtype and self.dtype != dtype:
                raise ArgumentError(
                    f"this KVCompileCache stores {self.dtype}, but the model runs in {dtype}: create the cache for "
                    f"the model as it is now (dtype={dtype}, or no dtype: the model's)")
            self.early_initialization(batch, *self.shape, dtype, device)
        first = next((layer for layer in self.layers if isinstance(layer, KVCompileLayer)), None)
        if first is not None:
            if first.store.batch != batch:
                raise ArgumentError(
                    f"this KVCompileCache holds {first.store.batch} sequences but the call passes a batch of {batch}: "
                    f"a cache belongs to one batch (create one per batch, or reorder it with "
                    f"cache.batch_select_indices)")
            if first.dtype != dtype or first.device != torch.device(device):
                raise ArgumentError(
                    f"this KVCompileCache stores {first.dtype} on {first.device}, but the model runs in {dtype} on "
                    f"{torch.device(device)}: create the cache for the model as it is now (kvcompile.apply's "
                    f"caches are created per call, so after model.to(...) pass no cache, or a new one)")
        for layer in self.layers:
            if isinstance(layer, KVCompileLayer):
                layer.ensure(n)

    def set_positions(self, position_ids: torch.Tensor | None, n: int) -> None:
        """Before a call of ``n`` tokens: each sequence's rotary positions, for layers storing pre-RoPE keys.
        Token ``t`` of a call is at cache index ``held + t``; its rotary position is ``position_ids[b, t]``
        (left padding: ``cumsum(mask) - 1``). The store keeps one offset per sequence (position minus index,
        from the call's last token), set by the first call into an empty cache and checked by the later ones."""
        stores = [layer.store for layer in self.layers
                  if isinstance(layer, KVCompileLayer) and layer.policy.pre_rope and layer.store is not None]
        if not stores:
            return
        B, held = stores[0].batch, stores[0].lengths
        if position_ids is None:
            offsets = [0] * B
        else:
            last = position_ids.reshape(-1, position_ids.shape[-1])[:, -1].tolist()
            if len(last) == 1 and B > 1:
                last = last * B
            offsets = [int(p) - (L + n - 1) for p, L in zip(last, held)]
        if any(held):
            if offsets != stores[0].rope_offset:
                raise RopeError(
                    f"pre-RoPE keys: this call's position_ids put its tokens at rotary positions "
                    f"{[o + L for o, L in zip(offsets, held)]} (per sequence, its first), but the cache holds "
                    f"{held} tokens at offsets {stores[0].rope_offset}: positions must continue where each sequence "
                    f"ends. Reset the cache for a new sequence, or use a policy without pre_rope.")
            return
        for st in stores:
            st.set_rope_offsets(offsets)

    def expect(self, tokens: int) -> None:
        """Allocate, now or when the stores are created, room for every sequence to reach ``tokens`` tokens,
        so that the stores' pools do not grow (each growth copies a pool) while decoding. ``generate`` on an
        applied model calls it with its ``max_length``. Only the allocation changes: ``nbytes`` still counts
        what the sequences hold, ``reserved_nbytes`` what is allocated."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ArgumentError(f"KVCompileCache.expect(tokens={tokens!r}): expected a whole number of tokens >= 0")
        for layer in self.layers:
            if isinstance(layer, KVCompileLayer):
                layer.expect(tokens)

    @property
    def tokens(self) -> int:
        """Tokens the first sequence holds (every sequence of a generate call holds as many)."""
        for layer in self.layers:
            if isinstance(layer, KVCompileLayer) and layer.is_initialized:
                return layer.store.lengths[0]
            if layer.is_initialized:
                return int(layer.cumulative_length)
        return 0

    def get_seq_length(self, layer_idx: int = 0):
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def __iter__(self):
        """``(keys, values, sliding_window)`` per layer, as transformers' ``DynamicCache`` yields them (so that
        ``DynamicCache(cache)`` copies it into a full-precision cache): what each layer holds, ``[B, H, L, D]`` in
        the model's dtype and space -- a store's tokens dequantized (``dequantize_reference``: under
        ``Policy.full()`` the values written), a ring's window as transformers holds it (with its window
        length). ``layer.keys`` of a store's layer is a stand-in, not its contents."""
        for layer in self.layers:
            if not layer.is_initialized:
                yield None, None, None
            elif isinstance(layer, KVCompileLayer):
                k, v = dequantize_reference(layer.store.state, layer.spec, layer.dtype, end=max(layer.store.lengths))
                yield k, v, None
            elif isinstance(layer, RingLayer):
                held = min(int(layer.cumulative_length_int), layer.max_cache_len)
                yield (layer.keys[:, :, :held], layer.values[:, :, :held],
                       torch.tensor(layer.max_cache_len, dtype=torch.int64))
            else:  # a layer transformers keeps itself, as its own caches yield it
                yield layer.keys, layer.values, getattr(layer, "_sliding_window_tensor", None)

    def to_legacy_cache(self) -> tuple:
        """``((keys, values), ...)`` per layer, what each holds (``__iter__``): the tuple format transformers'
        ``DynamicCache.to_legacy_cache`` returned, for code that reads a cache that way."""
        return tuple((k, v) for k, v, _ in self)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative (or 0): remove that many tokens from the end (transformers 5.2x); positive: keep that many (the
        older convention). Every layer the same count: transformers' rings take only the negative form."""
        remove = tokens_to_remove if tokens_to_remove <= 0 else min(0, tokens_to_remove - self.tokens)
        for layer in self.layers:
            if isinstance(layer, KVCompileLayer) or layer.is_initialized:
                layer.crop(remove)

    @property
    def is_initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's store (blocks in use, rings, sinks, lengths, tables) and the
        full-precision rings of sliding-window layers left to transformers; with pre-RoPE keys, the cos/sin
        table of the positions held (shared by the layers)."""
        table = self._rope_table()
        return sum(layer.nbytes for layer in self.layers) + (table.nbytes if table is not None else 0)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated, the stores' free blocks (and the cos/sin table's spare rows) included."""
        table = self._rope_table()
        return sum(layer.reserved_nbytes for layer in self.layers) + (table.reserved_nbytes if table is not None else 0)

    def _rope_table(self):
        return next((layer.rope_table for layer in self.layers if getattr(layer, "rope_table", None) is not None),
                    None)

    @property
    def rings(self) -> dict[int, int]:
        """Layer index -> window, for the sliding-window layers kept as transformers' full-precision ring
        (chosen where that ring holds fewer bytes than the policy's store of the cache's horizon)."""
        return {i: layer.max_cache_len for i, layer in enumerate(self.layers) if isinstance(layer, RingLayer)}
