"""Serving: transformers' own continuous batching over kvcompile's packed store.

    model = kvcompile.apply(model, Policy.kivi(4))
    out = model.generate_batch(prompts, generation_config)        # transformers' engine, kvcompile's cache
    manager = model.init_continuous_batching(...)                  # or the manager API; `transformers serve`

transformers' continuous batching (``transformers.generation.continuous_batching``) schedules requests over a
``PagedAttentionCache``: pages of ``page_size`` tokens, handed to requests as they grow, a ragged batch of
prefill chunks and decode tokens per forward, keys and values written through write indices and read back
in full precision through read indices before SDPA. Here that engine runs unchanged -- its scheduler, its
request states, its page accounting, its HTTP server -- with two things replaced:

- the cache (``PagedKVCompileCache``, a ``PagedAttentionCache``): transformers' allocator hands out, shares
  and frees the pages as it does for its own cache, but its full-precision tensor is never allocated (it
  lives on the ``meta`` device): page ``p`` is block ``p - first`` of every layer's ``KVStore`` pool, in
  kvcompile's packed format (``page_size`` = the store's block; ``KVStore.engine_owns_blocks``). Each
  request gets a row (a *slot*) of every layer's store while it holds pages, its table the request's pages;
  finishing, cancelling or being evicted (soft reset) clears the row. A request of ``L`` tokens holds the
  pages its store writes (``request_pages``: ``ceil(L / page_size)`` without a window or sinks, fewer with
  them, whose tokens are in the slot); transformers' allocator is told that count.
- prefix sharing and forks (transformers' ``allow_block_sharing``, on by default): a prompt that begins with
  the complete pages of an earlier prompt starts with those pages and their length in its row instead of
  computing them; a fork shares its parent's complete pages, and the pages transformers copies are copied
  in every layer's pool. A page can be shared only when it holds all its tokens -- a policy with no
  full-precision window and no sinks (``shares_pages``: ``Policy.full()``, ``Policy.int8()``, the
  token-axis policies); with a window (KIVI, ``Policy.fp8()``) sharing is turned off with a warning, and
  forks copy their pages.
- the attention (``kvcompile_paged``, registered with transformers' ``AttentionInterface`` and switched on
  while a manager runs -- while any of them does, when several serve one model from their threads -- as
  transformers switches to its own paged implementations; each forward's layers read the cache that stored
  their keys in the same thread, so managers never read each other's caches): each request's
  queries attend to its row of the store through kvcompile's kernels (the C decode kernel reads the packed
  blocks where they lie; prefill chunks dequantize transiently, as ``generate`` does), with the chunk's own
  keys and values in full precision. No read index, no full-precision copy of the cache.

The byte budget: the pool, the slots' rings and sinks, and the block tables are sized from one number of
bytes (``configure(model, budget=...)``; by default the bytes transformers' own cache would take for the
``ContinuousBatchingConfig``'s ``num_blocks`` x ``page_size`` tokens, else ``DEFAULT_BUDGET``), and
transformers is told the number of pages that budget buys.

Slots: held slots stay ``0 .. n-1`` (a leaving request's slot is taken by the one in the highest slot), and
requests of one query length are sorted by slot, so a batch of every running request works on views of
the stores' rows; a group whose slots are not a range has its rows' rings and sinks gathered and put back.

Compiled (``ContinuousBatchingConfig(varlen_compile_config=kvcompile.serving.compile_config())``, or any
``CompileConfig(backend="kvcompile", ...)``): transformers compiles its CB forward, padded to static sizes,
with the kvcompile backend. The attention stays transformers' own ``sdpa`` and the cache's ``update`` is
transformers' own paged update, traced, over *stand-ins* of each layer's page-pool views (one token row,
registered to this cache and layer: ``kvcompile.paged_ops``). The backend's paged pass
(``kvcompile.passes.paged``) finds per layer the two ``index_copy_`` writes through ``write_index``, the two
``index_select`` reads through ``read_index`` and the SDPA (with the ragged mask) that consumes them, and
rewrites them into ``kvcompile.paged_store`` / ``paged_attention``, which do the same per-request store and
attention as the eager path for the batch's host-side plan; padding rows are neither stored nor attended
(zeros), transformers' warmup requests likewise. A graph the pass cannot match completely is refused, and a
compiled cache's update refuses to run outside Dynamo (an eager fallback would read the stand-ins).

What this is not yet. Refused with a message where the user asks for them: asynchronous batching, CUDA
graphs, ``decode_compile_config`` (there is no block-table decode path: ``varlen_compile_config`` compiles
every forward), compiling with another backend than kvcompile's, sliding-window layers, other attention
implementations than SDPA. Not used: transformers' block-table decode fast path (kvcompile's attention reads its
own tables).

Evicted requests (the pages ran out): transformers' scheduler picks them and frees their pages; kvcompile's
row is cleared with them, and the request is prefilled again when it is scheduled -- or, with
``cpu_offload_space``, copied to host memory first, packed as it was, and back when it returns
(``KVCompileOffloading``; under tensor parallelism every rank evicts the same requests and copies its heads).

Under tensor parallelism (a model ``kvcompile.apply`` found sharded) every rank runs the engine with the same
requests and schedules them alike; its stores hold the rank's KV heads, and its budget is the rank's.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from .backend import Options
from .errors import ArgumentError, UnsupportedError
from .hf import model_shape
from .policy import Policy
from .pool import (DEFAULT_BUDGET, DEFAULT_SLOTS, MAX_BATCH_TOKENS, PoolSize, ServingOptions,  # noqa: F401
                   check_shared_tokens, default_slots, full_precision_bytes_per_token, layer_specs, make_stores,
                   most_slots, pages_for, pages_held, pool_blocks, pool_nbytes, request_limit, request_pages,
                   requests_held, serving_windows, shared_pages, shares_pages, size_pool, slots_for, specs_for,
                   table_width, transformers_pages)
from .store import KVStore, state_nbytes

# the engine's public names, imported from it on first use (it imports transformers' continuous batching)
_ENGINE_NAMES = ("ATTN", "PagedKVCompileCache", "KVCompileBatchingManager", "KVCompileOffloading",
                 "KVCompileMemoryHandler", "paged_attention")


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configure(model, *, budget: int | None = None, max_requests: int | None = None,
              request_tokens: int | None = None) -> None:
    """Size the continuous-batching cache of an applied model: ``budget`` bytes in all (pool, slots, tables),
    and either ``max_requests`` requests holding cache at once or, with ``request_tokens``, as many as the
    budget holds requests of that many tokens at once (``most_slots``, as ``kvcompile plan --serving``
    counts them)."""
    opts = getattr(model, "_kvcompile_serving", None)
    if opts is None:
        raise UnsupportedError("kvcompile.serving.configure: this model was not prepared by kvcompile.apply")
    for name, v in (("budget", budget), ("max_requests", max_requests), ("request_tokens", request_tokens)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ArgumentError(f"kvcompile.serving.configure({name}={v!r}): expected a positive integer")
    if max_requests is not None and request_tokens is not None:
        raise ArgumentError(f"kvcompile.serving.configure(max_requests={max_requests}, request_tokens={request_tokens})"
                         f": both give the number of request slots; pass one of them")
    if budget is not None:  # what the budget cannot hold is said now, not at the first request
        slots_for(layer_specs(model.config, opts, next(model.parameters()).dtype), budget, max_requests,
                  request_tokens, request_limit(model.config))
    opts.budget, opts.max_requests, opts.request_tokens = budget, max_requests, request_tokens


def capacity(model_config, policy: Policy, budget: int, dtype: torch.dtype = torch.bfloat16,
             request_tokens: int = 1024, page_size: int = 256, layer_names=None,
             max_requests: int | None = None, shared_tokens: int = 0,
             max_batch_tokens: int = MAX_BATCH_TOKENS) -> dict:
    """For one byte ``budget``: what kvcompile's serving cache and transformers' own paged cache hold, counted
    from the tensors each allocates (both are allocated here, on the CPU).

    - ``tokens``: the pages each engine's scheduler may hand out, in tokens (kvcompile: pool blocks x block,
      with ``slots`` rows paid for first; transformers: its pages x ``page_size``);
    - ``requests``: concurrent requests of ``request_tokens`` tokens each the budget holds: each takes
      ``ceil(request_tokens / page)`` pages in transformers' cache; in kvcompile's the pages its store
      writes (``request_pages``) and a slot, whose full-precision ring and sinks are part of the budget.
      ``max_requests``: the slots (as ``configure``); None: sized to the requests (``size_pool``).
      ``shared_tokens``: the first tokens of every request are the same prompt, whose whole pages they
      share (``pages_held``) in transformers' engine and, where the policy ``shares_pages``, in kvcompile's
      (``pool.shareable_tokens`` of them, at ``max_batch_tokens`` a forward);
    - ``allocated``: bytes of the tensors allocated (kvcompile: pools, rings, sinks, lengths and block
      tables, as wide as a request of the model's positions needs; transformers: its tensor, with its two
      trash sectors; ``data``: without them).
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from . import engine

    if serving_windows(model_config):
        raise UnsupportedError(
            "kvcompile.serving.capacity compares the caches of models whose every layer attends to every token; "
            "this model has sliding-window layers, whose windows transformers' engine keeps in pages of their own "
            "(not counted here yet)")
    layers, kv, _ = model_shape(model_config)
    names = layer_names or [f"model.layers.{i}.self_attn" for i in range(layers)]
    specs = layer_specs(model_config, ServingOptions(policy, names, kv), dtype)
    limit = request_limit(model_config)
    size = size_pool(specs, budget, request_tokens, max_requests, shared_tokens, limit, max_batch_tokens)
    stores = make_stores(specs, size.slots, size.blocks, max_tokens=limit)
    paged = next(st for st in stores if isinstance(st, KVStore))  # (a sliding-window layer's rings hold no blocks)
    blocks, slots = paged.state.k_codes.shape[0], paged.state.lengths.numel()  # as allocated
    ours = dict(allocated=sum(state_nbytes(st.state) for st in stores), budgeted=budget, blocks=blocks,
                block_tokens=specs[0].block, tokens=blocks * specs[0].block, slots=slots,
                requests=replace(size, blocks=blocks, slots=slots).requests)
    del stores
    fp = full_precision_bytes_per_token(model_config, dtype)
    cbc = ContinuousBatchingConfig(num_blocks=transformers_pages(budget, page_size, fp), page_size=page_size,
                                   max_batch_tokens=256, max_blocks_per_request=0, max_memory_percent=1.0)
    with engine.SWAP:  # transformers' own cache, never one of its names swapped for ours
        theirs_cache = engine.tcache.PagedAttentionCache(model_config, cbc, "cpu", DistributedHelper(None, None, {}),
                                                         dtype)
    data = theirs_cache.num_sectors * theirs_cache.bytes_per_sector  # without the two trash sectors
    pages = data // (page_size * fp)  # counted from the tensor: pages of page_size tokens it holds
    theirs = dict(allocated=theirs_cache.cache_tensor.numel(), data=data, blocks=pages, page_size=page_size,
                  tokens=pages * page_size,
                  requests=requests_held(pages, pages_for(request_tokens, page_size),
                                         shared_pages(shared_tokens, page_size)))
    del theirs_cache
    return dict(kvcompile=ours, transformers=theirs, token_ratio=ours["tokens"] / theirs["tokens"],
                request_ratio=ours["requests"] / max(1, theirs["requests"]))


def compile_config(compiler: str | None = None, *, fullgraph: bool = False, dynamic: bool | None = None):
    """The ``CompileConfig`` of a compiled continuous-batching forward over kvcompile's store:

        ContinuousBatchingConfig(varlen_compile_config=kvcompile.serving.compile_config())

    is ``CompileConfig(backend="kvcompile", mode=None, options={"compiler": compiler})``. ``compiler``:
    "inductor" or "eager" (how the rest of the graph runs); None, the model's own (``kvcompile.apply``'s
    ``compiler``: Inductor on a GPU, eager on the CPU)."""
    from transformers.generation.configuration_utils import CompileConfig

    options = None
    if compiler is not None:
        options = {"compiler": Options(compiler=compiler).compiler}  # validated here, at the call
    return CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend="kvcompile", mode=None, options=options)


def model_shares_pages(model) -> bool:
    """``shares_pages`` for a model ``kvcompile.apply`` prepared."""
    return shares_pages(layer_specs(model.config.get_text_config(), model._kvcompile_serving, model.dtype))


def cache_class():
    """The ``PagedAttentionCache`` subclass whose pages are kvcompile's blocks (``engine.PagedKVCompileCache``)."""
    from .engine import PagedKVCompileCache
    return PagedKVCompileCache


def manager_class():
    """The ``ContinuousBatchingManager`` subclass ``init_continuous_batching`` returns
    (``engine.KVCompileBatchingManager``)."""
    from .engine import KVCompileBatchingManager
    return KVCompileBatchingManager


def attach(model, applied) -> None:
    """Route ``model.init_continuous_batching`` (and so ``generate_batch``, the context manager and
    ``transformers serve``) through kvcompile's manager. Registered with the core's ``extension.on_apply`` by the
    package (``kvcompile/__init__.py``): runs at the end of every ``kvcompile.apply`` on a transformers model."""
    model._kvcompile_serving = ServingOptions(applied.policy, list(applied.layer_names), applied.kv_heads)
    if hasattr(type(model), "init_continuous_batching"):
        model.init_continuous_batching = functools.partial(init_continuous_batching, model)


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """transformers' ``init_continuous_batching`` for a model ``kvcompile.apply`` prepared: kvcompile's manager
    (the one cached on the model if it has one)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from .engine import KVCompileBatchingManager as cls

    check_transformers()
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, cls):
        cached.switch_to_cb_friendly_attn(model)
        return cached
    gen = generation_config if generation_config is not None else model.generation_config
    if gen is None:
        raise ArgumentError("A GenerationConfig must be provided or set in the model.")
    if gen.eos_token_id is None:
        gen.eos_token_id = -1
    cbc = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
    return cls(model, gen, cbc, workload_hints)


def check_transformers() -> None:
    """kvcompile's serving subclasses the continuous batching of transformers 5.24 (its cache allocators, memory
    handler and page accounting); another release's engine is refused at the call, saying what to install."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("transformers.generation.continuous_batching.cache_allocators") is None:
        raise UnsupportedError(
            f"kvcompile serving (generate_batch, init_continuous_batching, kvcompile serve) is built on the "
            f"continuous batching of transformers 5.24, and transformers {transformers.__version__} has another "
            f"one (no continuous_batching.cache_allocators). Install transformers 5.24 for serving (pip install "
            f"'kvcompile[serve]'); apply, generate and the backend work with this release.")
