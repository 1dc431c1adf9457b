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

import contextlib
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from . import ops
from .errors import UnsupportedError
from .policy import Policy
from .store import DTYPE_NAMES, KVState, KVStore, LayerSpec, state_nbytes

ATTN = "kvcompile_paged"
DEFAULT_BUDGET = 256 * 2**20  # bytes, when neither configure(budget=) nor the CB config's num_blocks says
DEFAULT_SLOTS = 32            # at most this many concurrent requests by default (see default_slots)


@dataclass
class ServingOptions:
    """What ``apply`` records for serving: the policy per layer, the kv heads, and the sizing knobs."""

    policy: Policy
    layer_names: list
    kv_heads: int
    budget: int | None = None        # bytes for the whole cache; None: see the module docstring
    max_requests: int | None = None  # slots (requests holding cache at once); None: see ``slots_for``
    request_tokens: int | None = None  # size the slots for requests of this many tokens (``most_slots``)


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
            raise ValueError(f"kvcompile.serving.configure({name}={v!r}): expected a positive integer")
    if max_requests is not None and request_tokens is not None:
        raise ValueError(f"kvcompile.serving.configure(max_requests={max_requests}, request_tokens={request_tokens})"
                         f": both give the number of request slots; pass one of them")
    if budget is not None:  # what the budget cannot hold is said now, not at the first request
        slots_for(layer_specs(model.config, opts, next(model.parameters()).dtype), budget, max_requests,
                  request_tokens, request_limit(model.config))
    opts.budget, opts.max_requests, opts.request_tokens = budget, max_requests, request_tokens


# --------------------------------------------------------------------------- sizing
# The one place the serving pool's sizes are written; ``capacity`` allocates them and ``kvcompile.plan``
# predicts them with the same functions (from a model's shape, nothing allocated).
def specs_for(policies: list[Policy], kv_heads: int, head_dim: int, dtype: str) -> list[LayerSpec]:
    """One spec per layer (resolved per-layer ``policies``), every one with the same block (the largest any
    layer's policy needs): transformers counts pages of one size for all layers."""
    block = max(LayerSpec(p, kv_heads, head_dim, dtype).block for p in policies)
    return [LayerSpec(p, kv_heads, head_dim, dtype, block_tokens=block) for p in policies]


def layer_specs(model_config, opts: ServingOptions, dtype: torch.dtype) -> list[LayerSpec]:
    """``specs_for`` an applied model's layers."""
    from .hf import model_shape

    _, _, head_dim = model_shape(model_config)
    return specs_for(opts.policy.resolve(opts.layer_names), opts.kv_heads, head_dim, DTYPE_NAMES[dtype])


def full_precision_bytes_per_token(model_config, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """What transformers' paged cache allocates per token, every layer: keys and values in the model dtype;
    ``kv_heads``: a rank's share under tensor parallelism (default: the model's)."""
    from .accounting import full_precision_bytes_per_token as fp_bytes
    from .hf import model_shape

    layers, heads, head_dim = model_shape(model_config)
    return fp_bytes(layers, heads if kv_heads is None else kv_heads, head_dim, dtype)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages transformers' allocator hands a request of ``tokens`` tokens in its own cache:
    ``ceil(tokens / page_size)`` (in kvcompile's: ``request_pages``)."""
    return -(-tokens // page_size)


def request_pages(specs: list[LayerSpec], tokens: int) -> int:
    """Pages a request of ``tokens`` tokens holds in kvcompile's pool: the blocks its store writes (the most any
    layer writes). The tokens of a full-precision window and the sinks are in the request's slot, not in pages,
    so a windowed policy's request holds fewer than ``pages_for(tokens, block)``; transformers' allocator is
    told this count (``PagedKVCompileCache``). Without a window or sinks it is ``pages_for``."""
    return max(s.blocks_for(tokens) for s in specs)


def shared_pages(shared_tokens: int, page_size: int) -> int:
    """Pages of a ``shared_tokens``-token prefix every request shares: transformers' prefix sharing matches
    whole pages, so only the complete ones."""
    return shared_tokens // page_size


def pages_held(n: int, need: int, shared: int = 0) -> int:
    """Pages ``n`` requests of ``need`` pages each hold at once when the first ``shared`` of every one's pages
    are the same prompt's (transformers' prefix sharing matches whole pages): those are held once."""
    return n * (need - shared) + (shared if n else 0)


def requests_held(pages: int, need: int, shared: int = 0) -> int:
    """The most requests of ``need`` pages (``shared`` of them shared) ``pages`` pages hold at once
    (``pages_held``); ``sys.maxsize`` when a request needs no page of its own (all its tokens in its slot)."""
    if pages < need:
        return 0
    own = need - shared
    return 1 + (pages - need) // own if own else sys.maxsize


def check_shared_tokens(shared_tokens: int, request_tokens: int) -> None:
    if not isinstance(shared_tokens, int) or isinstance(shared_tokens, bool) or not 0 <= shared_tokens < request_tokens:
        raise ValueError(f"kvcompile serving: shared_tokens={shared_tokens!r}: expected a number of tokens from 0 to "
                         f"request_tokens - 1 = {request_tokens - 1} (the prompt prefix every request shares)")


def transformers_pages(budget: int, page_size: int, bytes_per_token: int) -> int:
    """Pages of ``page_size`` tokens a ``budget`` buys in transformers' own paged cache (what ``capacity`` and
    ``benchmarks/serve_load.py`` give it as ``num_blocks``): its tensor holds every layer's keys and values
    in full precision, ``bytes_per_token`` per token."""
    return budget // (page_size * bytes_per_token)


def default_slots(specs: list[LayerSpec], budget: int) -> int:
    """Slots when ``configure(max_requests=)`` does not say: ``DEFAULT_SLOTS``, fewer where the slots' full-
    precision rings and sinks (KIVI's residual window: 159 tokens a layer at residual 128) would take more
    than a quarter of the budget -- the rest is for the packed pool."""
    return max(1, min(DEFAULT_SLOTS, budget // (4 * sum(s.row_nbytes() for s in specs))))


def slots_for(specs: list[LayerSpec], budget: int, max_requests: int | None, request_tokens: int | None,
              max_tokens: int | None, shared_tokens: int = 0) -> int:
    """The request slots a serving cache of ``budget`` bytes gets (``configure``, ``size_pool``):
    ``max_requests`` if given (the pool must still hold a block after them); else, with ``request_tokens``,
    the most requests of that many tokens (the first ``shared_tokens`` of them shared) the budget holds at
    once (``most_slots``); else ``default_slots``."""
    if max_requests is not None:
        pool_blocks(specs, budget, max_requests, max_tokens)
        return max_requests
    if request_tokens is None:
        slots = default_slots(specs, budget)
        pool_blocks(specs, budget, slots, max_tokens)  # one slot's window and sinks may take the whole budget
        return slots
    slots = most_slots(specs, budget, request_tokens, shared_tokens, max_tokens)
    if slots < 1:
        one = pool_nbytes(specs, 1, request_pages(specs, request_tokens), max_tokens)
        raise UnsupportedError(f"kvcompile serving: a budget of {budget:,} bytes holds no request of {request_tokens:,} "
                             f"tokens (one takes {one:,} bytes: its slot and its pages); raise the budget or shorten "
                             f"the requests")
    return slots


def request_limit(model_config) -> int | None:
    """Tokens one request may hold at most: the model's positions (``max_position_embeddings``; None where the
    config gives none)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "max_position_embeddings", None)


def table_width(specs: list[LayerSpec], blocks: int, max_tokens: int | None = None) -> int:
    """Columns of a slot's block table: the blocks one request of at most ``max_tokens`` tokens holds
    (``request_pages``), and never more than the pool's ``blocks`` (every block where ``max_tokens`` is None).
    Allocated once at this width; a request longer than ``max_tokens`` widens its store's table."""
    return blocks if max_tokens is None else min(blocks, request_pages(specs, max_tokens))


def pool_nbytes(specs: list[LayerSpec], slots: int, blocks: int, max_tokens: int | None = None) -> int:
    """Bytes the stores allocate for ``slots`` rows and a pool of ``blocks`` blocks per layer: each row's ring,
    sinks and length; each block's codes, scales and zero points; and each layer's block table, an int32 per
    slot and column (``table_width``)."""
    width = table_width(specs, blocks, max_tokens)
    return sum(slots * s.row_nbytes() + blocks * s.block_nbytes() + 4 * slots * width for s in specs)


def pool_blocks(specs: list[LayerSpec], budget: int, slots: int, max_tokens: int | None = None) -> int:
    """Blocks per layer that ``budget`` bytes buy once ``slots`` rows (ring, sinks, length) are paid for: the
    most ``blocks`` with ``pool_nbytes(specs, slots, blocks, max_tokens) <= budget``."""
    def cost(n):
        return pool_nbytes(specs, slots, n, max_tokens)

    fixed = cost(0)
    blocks = (budget - fixed) // (cost(1) - fixed)  # a table column per block
    width = table_width(specs, blocks, max_tokens)
    if width < blocks:  # the tables stop at ``width`` columns: past them a block costs only its own bytes
        blocks = width + (budget - cost(width)) // (cost(width + 1) - cost(width))
    if blocks < 1:
        least = cost(1)
        raise UnsupportedError(
            f"kvcompile serving: a budget of {budget:,} bytes does not hold one block after {slots} request "
            f"slot{'s' if slots > 1 else ''} ({fixed:,} bytes of full-precision rings, sinks and lengths: "
            f"up to {max(s.ring for s in specs)} window and {max(s.sink for s in specs)} sink tokens a layer per "
            f"slot) and so serves no request; "
            f"raise the budget to at least {least:,} bytes ({-(-least // 2**20)} MiB)"
            + (", or lower max_requests" if slots > 1 else ", or use a policy with a smaller window or fewer sinks"))
    return int(blocks)


def most_slots(specs: list[LayerSpec], budget: int, request_tokens: int, shared_tokens: int = 0,
               max_tokens: int | None = None) -> int:
    """The most slots whose requests of ``request_tokens`` tokens the budget holds all at once: each slot's
    row and table, and the pool blocks the requests hold (``pages_held``; ``shared_tokens``: a prompt prefix
    they share). 0 if not one."""
    need, shared = request_pages(specs, request_tokens), shared_pages(shared_tokens, specs[0].block)
    own = need - shared

    def fits(n):
        return pool_nbytes(specs, n, pages_held(n, need, shared), max_tokens) <= budget

    lo, hi = 0, budget // pool_nbytes(specs, 1, own, max_tokens) + 1  # fits(lo); not fits(hi): a slot costs that
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class PoolSize:
    """The serving pool one budget buys (``size_pool``): what ``configure(budget=, max_requests=slots)`` and
    ``kvcompile serve --budget-mib --max-requests`` allocate."""

    budget: int          # bytes
    slots: int           # request rows (requests holding cache at once, at most)
    blocks: int          # pool blocks per layer = transformers' pages
    block_tokens: int    # tokens per block = transformers' page_size
    request_tokens: int  # tokens per request, for ``requests``
    nbytes: int          # bytes allocated: rows, pool, tables (``pool_nbytes``)
    pages_per_request: int  # ``request_pages``
    shared_tokens: int = 0  # a prompt prefix every request shares (0 where the policy shares no pages)

    @property
    def tokens(self) -> int:
        """Tokens the pool's pages hold (what transformers' scheduler may hand out)."""
        return self.blocks * self.block_tokens

    @property
    def requests(self) -> int:
        """Concurrent requests of ``request_tokens`` tokens: limited by the slots and by the pages."""
        return min(self.slots, requests_held(self.blocks, self.pages_per_request,
                                             shared_pages(self.shared_tokens, self.block_tokens)))


def size_pool(specs: list[LayerSpec], budget: int, request_tokens: int, slots: int | None = None,
              shared_tokens: int = 0, max_tokens: int | None = None) -> PoolSize:
    """The pool ``budget`` bytes buy with ``slots`` request rows; ``slots=None``: the most requests of
    ``request_tokens`` tokens the budget holds (``most_slots``), their first ``shared_tokens`` tokens a
    prompt prefix they share where the policy shares pages (``shares_pages``); block tables as wide as a
    request of ``max_tokens`` tokens needs (``table_width``)."""
    for name, v in (("budget", budget), ("request_tokens", request_tokens), ("slots", slots)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"kvcompile serving: {name}={v!r}: expected a positive integer")
    check_shared_tokens(shared_tokens, request_tokens)
    shared_tokens = shared_tokens if shares_pages(specs) else 0
    slots = slots_for(specs, budget, slots, request_tokens, max_tokens, shared_tokens)
    blocks = pool_blocks(specs, budget, slots, max_tokens)
    return PoolSize(budget, slots, blocks, specs[0].block, request_tokens,
                    pool_nbytes(specs, slots, blocks, max_tokens), request_pages(specs, request_tokens), shared_tokens)


def capacity(model_config, policy: Policy, budget: int, dtype: torch.dtype = torch.bfloat16,
             request_tokens: int = 1024, page_size: int = 256, layer_names=None,
             max_requests: int | None = None, shared_tokens: int = 0) -> dict:
    """For one byte ``budget``: what kvcompile's serving cache and transformers' own paged cache hold, counted
    from the tensors each allocates (both are allocated here, on the CPU).

    - ``tokens``: the pages each engine's scheduler may hand out, in tokens (kvcompile: pool blocks x block,
      with ``slots`` rows paid for first; transformers: its pages x ``page_size``);
    - ``requests``: concurrent requests of ``request_tokens`` tokens each the budget holds: each takes
      ``ceil(request_tokens / page)`` pages in transformers' cache; in kvcompile's the pages its store
      writes (``request_pages``) and a slot, whose full-precision ring and sinks are part of the budget.
      ``max_requests``: the slots (as ``configure``); None: sized to the requests (``size_pool``).
      ``shared_tokens``: the first tokens of every request are the same prompt, whose whole pages they
      share (``pages_held``) in transformers' engine and, where the policy ``shares_pages``, in kvcompile's;
    - ``allocated``: bytes of the tensors allocated (kvcompile: pools, rings, sinks, lengths and block
      tables, as wide as a request of the model's positions needs; transformers: its tensor, with its two
      trash sectors; ``data``: without them).
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from .hf import model_shape

    layers, kv, _ = model_shape(model_config)
    names = layer_names or [f"model.layers.{i}.self_attn" for i in range(layers)]
    specs = layer_specs(model_config, ServingOptions(policy, names, kv), dtype)
    limit = request_limit(model_config)
    size = size_pool(specs, budget, request_tokens, max_requests, shared_tokens, limit)
    stores = make_stores(specs, size.slots, size.blocks, max_tokens=limit)
    blocks, slots = stores[0].state.k_codes.shape[0], stores[0].state.lengths.numel()  # as allocated
    ours = dict(allocated=sum(state_nbytes(st.state) for st in stores), budgeted=budget, blocks=blocks,
                block_tokens=specs[0].block, tokens=blocks * specs[0].block, slots=slots,
                requests=replace(size, blocks=blocks, slots=slots).requests)
    del stores
    fp = full_precision_bytes_per_token(model_config, dtype)
    cbc = ContinuousBatchingConfig(num_blocks=transformers_pages(budget, page_size, fp), page_size=page_size,
                                   max_batch_tokens=256, max_blocks_per_request=0, max_memory_percent=1.0)
    with _SWAP:
        theirs_cache = _transformers().PagedAttentionCache(model_config, cbc, "cpu", DistributedHelper(None, None, {}),
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


def make_stores(specs: list[LayerSpec], slots: int, blocks: int, device="cpu",
                max_tokens: int | None = None) -> list[KVStore]:
    """One store per layer: ``slots`` rows, a pool of ``blocks`` blocks allocated now (it never grows), and
    the block table at ``table_width``. Its tensors are exactly what ``pool_nbytes`` counts."""
    out, width = [], table_width(specs, blocks, max_tokens)
    for s in specs:
        # the rows whole: the budget pays for every slot's window and sinks up front
        st = KVStore(s, slots, device, max_blocks=blocks, blocks=blocks, whole_rows=True)
        st.state = st.state._replace(table=torch.full((slots, width), -1, dtype=torch.int32, device=device))
        out.append(st)
    return out


# --------------------------------------------------------------------------- the cache
def _transformers():
    from transformers.generation.continuous_batching import cache as tcache
    return tcache


class _Plan:
    """One forward's ragged batch: requests in order, in groups (one kernel call per group): the decoding requests
    together, each prefill chunk alone.
    ``entries``: (request_id, slot, past, n, skip); a skipped entry (a warmup request of a compiled forward)
    takes its ``n`` rows of the batch but is neither stored nor attended (its rows stay zeros)."""

    def __init__(self, entries, slots, device):
        self.entries = entries
        self.total = sum(e[3] for e in entries)
        groups, start = {}, 0
        for _, slot, _, n, skip in entries:
            if not skip:
                # decode rows attend together (the C kernel computes each row alone); a prefill chunk attends
                # alone: attention over a group pads its rows to the longest, and a row would get other bits
                # beside others than alone (docs/usage.md, "What a batch changes")
                groups.setdefault((n, None if n == 1 else slot), []).append((slot, start))
            start += n
        self.groups = []
        for (n, _), members in groups.items():
            members.sort()  # by slot: rows that are a contiguous range of slots are read and written in place
            rows = [slot for slot, _ in members]
            idx = [t for _, s0 in members for t in range(s0, s0 + n)]
            span = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None
            self.groups.append((n, torch.tensor(rows, dtype=torch.long, device=device),
                                torch.tensor(idx, dtype=torch.long, device=device), span))
        self.counts = [0] * slots
        for _, slot, _, n, skip in entries:
            if not skip:
                self.counts[slot] = n
        self.complete = all(not e[4] for e in entries)


def _gather(x: torch.Tensor, idx: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """``x [1, H, T, D]`` -> ``[rows, H, n, D]``: the tokens ``idx`` (rows x n, request by request)."""
    H, D = x.shape[1], x.shape[3]
    return x[0].index_select(1, idx).view(H, rows, n, D).transpose(0, 1).contiguous()


class _OneRank:
    """transformers' ``DistributedHelper`` as ``PagedAttentionCache.__init__`` reads it, for one rank."""

    tp_size = 1


def _memory_handler(compiled: bool, window_tokens: int):
    """transformers' ``PagedAttentionMemoryHandler``, which checks the cache's footprint against the free memory,
    for a cache whose pages are kvcompile's: the pages' bytes are in kvcompile's budget (transformers' tensor is
    on the ``meta`` device), and the read back of the cache is no full-precision copy (the attention reads the
    packed rows); what transformers still allocates is counted -- the per-batch-token inputs and activations,
    the read indices, and, for a compiled forward (transformers' SDPA traced), its ragged attention mask
    (``[max_batch_tokens, max_tokens_read + max_batch_tokens]`` in the model dtype, ``max_tokens_read`` the
    pages' tokens and the slots' ``window_tokens``). Eager, the ``kvcompile_paged`` attention takes no mask and
    transformers allocates none."""
    base = _transformers().PagedAttentionMemoryHandler

    class KVCompileMemoryHandler(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trash_bytes = 0  # the trash sectors are on the meta device too

        @property
        def bytes_per_cache_sector(self) -> int:
            return self.tokens_per_sector * self.io_multiplier * self.num_groups * 8  # read_index (int64)

        def attention_mask_bytes(self, max_batch_tokens: int, num_sectors: int) -> int:
            if not compiled:
                return 0
            per_token = self.io_multiplier * self.num_attention_masks * self.activation_dtype.itemsize
            return (super().attention_mask_bytes(max_batch_tokens, num_sectors)
                    + per_token * max_batch_tokens * window_tokens)

    return KVCompileMemoryHandler


_SWAP = threading.RLock()  # held while a transformers name is swapped (below), and while transformers' own
                           # cache is built beside (``capacity``), so that it never sees a swapped name


@contextlib.contextmanager
def _swapped(module, name: str, value):
    """``module.name`` is ``value`` for the block (transformers builds its cache's parts by module-level name)."""
    with _SWAP:
        orig = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, orig)


_base_update = None  # transformers' PagedAttentionCache.update, unwrapped (set with the class)
WARMUP_PREFIX = "__warmup_"  # transformers' warmup request ids (continuous_batching.requests)


def _make_cache_class():
    import inspect

    base = _transformers().PagedAttentionCache
    # transformers' update is wrapped in torch.compiler.disable; the compiled path traces the function itself
    global _base_update
    _base_update = inspect.unwrap(base.update)

    class PagedKVCompileCache(base):
        """transformers' ``PagedAttentionCache`` whose pages are kvcompile blocks: see ``kvcompile.serving``."""

        def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype=torch.float16,
                     model_supports_logits_to_keep=False, *, specs: list[LayerSpec], slots: int, blocks: int,
                     compiled: bool = False, max_tokens: int | None = None):
            # transformers' own tensor is only counted, never used: it lives on the meta device
            # transformers builds its page accounting for this rank alone: its heads are counted in kvcompile's
            # specs (the rank's own), and its sizes come from the budget, the same on every rank (checked below;
            # its own check all-reduces a tensor on the cache's device, which is meta here)
            window = slots * max(s.ring + s.sink for s in specs)  # tokens the slots hold outside the pages
            try:
                with _swapped(_transformers(), "PagedAttentionMemoryHandler", _memory_handler(compiled, window)):
                    super().__init__(config, continuous_batching_config, "meta", _OneRank(), dtype,
                                     model_supports_logits_to_keep)
            except MemoryError as e:
                cbc = continuous_batching_config
                m = cbc.max_batch_tokens or _transformers().PagedAttentionMemoryHandler._default_max_batch_tokens
                mask = m * (blocks * cbc.page_size + window + m)
                raise UnsupportedError(
                    f"kvcompile serving: what transformers allocates beside kvcompile's cache does not fit in free "
                    f"memory ({e}): "
                    + (f"a compiled forward's attention mask takes max_batch_tokens x (pages x page_size + the "
                       f"slots' windows + max_batch_tokens) = {m} x ({blocks} x {cbc.page_size} + {window} + {m}) "
                       f"= {mask:,} elements; lower "
                       f"max_batch_tokens in the ContinuousBatchingConfig, or the cache budget "
                       f"(kvcompile.serving.configure(model, budget=...))" if compiled else
                       f"lower max_batch_tokens in the ContinuousBatchingConfig (now {m})")) from e
            self.device = torch.device(device)
            if distributed_helper.tp_size > 1:
                sizes = torch.tensor([self.max_batch_tokens, self.num_sectors, blocks, slots], device=self.device)
                agreed = sizes.clone()
                distributed_helper.tp_all_reduce_min(agreed)
                if not torch.equal(agreed, sizes):
                    raise UnsupportedError(
                        f"kvcompile serving: the tensor-parallel ranks sized their caches differently (this rank: "
                        f"{sizes.tolist()}, the least: {agreed.tolist()} as max_batch_tokens, sectors, blocks, "
                        f"slots); give every rank the same budget and ContinuousBatchingConfig")
            if set(self.cache_allocators) != {_transformers().FULL_ATTENTION}:
                raise UnsupportedError("kvcompile serving supports full-attention layers only (this model has "
                                     f"{sorted(self.cache_allocators)})")
            allocator = self.cache_allocators[_transformers().FULL_ATTENTION]
            if self.num_blocks != blocks or allocator.num_blocks != blocks:
                raise UnsupportedError(f"kvcompile serving: transformers made {self.num_blocks} pages where the pool "
                                     f"has {blocks} blocks")
            self.max_decode_fast_path_length = 0  # no block tables: attention reads kvcompile's own
            self.specs, self.slots = specs, slots
            self.stores = make_stores(specs, slots, blocks, self.device, max_tokens)
            # transformers' allocator hands out the pages and shares or frees them; page p is block p - first
            # of every layer's pool (its page ids start after the pool's reserved sectors)
            self._allocator = allocator
            self._first_page = self.pool.num_reserved_sectors * allocator.blocks_per_sector
            # a request holds the pages its store writes (request_pages): transformers' allocator counts them
            # so, and its scheduler's budget of tokens read per forward (the pages' tokens in its own cache)
            # counts the slots' windows and sinks too
            allocator._compute_blocks_needed = lambda allocated, past, query: max(
                0, request_pages(specs, past + query) - allocated)
            self.max_tokens_read = blocks * allocator.tokens_per_page + window
            self.prefix_tokens = 0  # prompt tokens found in shared pages (not computed again)
            for st in self.stores:
                st.engine_owns_blocks()
            self.slot_of: dict[str, int] = {}
            self.free_slots = list(range(slots - 1, -1, -1))
            self.keep_freed: dict | None = None  # while transformers evicts requests: the rows it frees
            self._pending: list = []
            self._scheduler = None  # transformers' scheduler of this cache (a weak reference): its requests
            self._plan: _Plan | None = None
            self._work: dict = {}
            # compiled: the forward is traced by Dynamo with transformers' own paged update and SDPA, over
            # stand-ins of the page pool's views that kvcompile's pass rewrites (see _compiled_views)
            self.compiled = compiled
            if compiled:
                self._compiled_views()

        def _compiled_views(self) -> None:
            """Replace each layer's page-pool views (``FullAttentionCacheAllocator._kv_token_views``, ``[N, H, D]``
            on ``meta`` here) by stand-ins registered to this cache and layer: transformers' ``update`` then traces
            into writes and reads of the stand-ins, which ``kvcompile.passes.paged`` rewrites into
            ``kvcompile.paged_ops``. A stand-in is one token row ``[1, H, D]`` over ``H + D - 1`` elements: what
            the graph does with the pool (``index_copy_``/``index_select`` along dim 0) does not depend on ``N``
            when traced, every such use is rewritten (or the pass refuses the graph), and the rewritten ops never
            touch the stand-in; a stand-in of ``N`` rows would cost ``N`` elements per layer, and ``N`` grows
            with the pool and the number of layers."""
            from . import paged_ops, standin

            allocator = self.cache_allocators[_transformers().FULL_ATTENTION]
            for layer_idx, (kv, vv) in list(allocator._kv_token_views.items()):
                heads = self.specs[layer_idx].heads  # the rank's (transformers' views count every head: _OneRank)
                k = standin.make_standin((1, heads, kv.shape[2]), kv.dtype, self.device)
                v = standin.make_standin((1, heads, vv.shape[2]), vv.dtype, self.device)
                paged_ops.register(k, v, self, layer_idx)
                allocator._kv_token_views[layer_idx] = (k, v)
            allocator._kv_page_views = {}  # no block-table decode path (max_blocks_per_request=0)

        @property
        def standin_nbytes(self) -> int:
            """Bytes of the compiled forward's stand-ins of transformers' page pool (0 when eager)."""
            if not self.compiled:
                return 0
            views = self.cache_allocators[_transformers().FULL_ATTENTION]._kv_token_views.values()
            return sum(t.untyped_storage().nbytes() for kv in views for t in kv)

        # ---- sizes
        @property
        def allocated_nbytes(self) -> int:
            """Bytes of every tensor the stores allocated (pools, rings, sinks, lengths, tables)."""
            return sum(state_nbytes(st.state) for st in self.stores)

        @property
        def free_blocks_count(self) -> int:
            """Pages no running request holds: free in transformers' pool, or kept only as a cached prompt prefix
            (evicted as soon as a request needs the page). Every layer's pool has the same count."""
            a = self._allocator
            return (self.pool.count_free_blocks(a.index) + self.pool.num_free_sectors * a.blocks_per_sector
                    + len(a.ledger.cached_blocks))

        def _blocks(self, pages) -> list[int]:
            """transformers' page ids as blocks of the stores' pools."""
            return [p - self._first_page for p in pages]

        def _table(self, request_id: str) -> list[int]:
            """The request's pages, as blocks of the stores' pools."""
            return self._blocks(self._allocator.block_table.get(request_id, ()))

        # ---- slots
        def _take_slot(self, request_id: str) -> int:
            slot = self.free_slots.pop()
            self.slot_of[request_id] = slot
            return slot

        def _drop(self, request_id: str) -> None:
            """Clear the request's row. The request in the highest held slot moves into it (its blocks are
            shared, then released: only its ring and sinks are copied), so held slots stay 0..n-1 and a
            batch of every running request reads the stores' rows in place."""
            slot = self.slot_of.get(request_id)
            if slot is None:
                return
            last = max((s for r, s in self.slot_of.items() if r != request_id), default=-1)
            if last > slot:
                mover = next(r for r, s in self.slot_of.items() if s == last)
                for st in self.stores:
                    st.fork(last, slot)
                    st.clear([last])
                self.slot_of[mover] = slot  # before the request leaves: a reader never sees it gone, unmoved
                slot = last
            else:
                for st in self.stores:
                    st.clear([slot])
            del self.slot_of[request_id]
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)  # the lowest free slot is taken next

        def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
            new = state.request_id not in self.slot_of
            if new and not self.free_slots and state.request_id != "":
                return False  # every slot is held: the request waits, as for pages
            ok = super().can_store_request_tokens(state, request_len, dry_run)
            if ok and new and not dry_run and state.request_id != "":
                self._take_slot(state.request_id)
            return ok

        def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
            slot = self.slot_of.get(request_id)
            if self.keep_freed is not None and slot is not None:  # an eviction that may offload the request:
                # its row copied to host memory now (its pages are handed out again, its slot moved into)
                self.keep_freed[request_id] = [st.save(slot, "cpu") for st in self.stores]
            super().free_blocks(request_id, no_cache)
            self._drop(request_id)

        def restore(self, request_id: str, rows: list) -> None:
            """An offloaded request comes back (``KVCompileOffloading``): each layer's saved row into the slot
            and the pages transformers gave it for this forward."""
            slot, table = self.slot_of[request_id], self._table(request_id)
            for st, row in zip(self.stores, rows):
                st.restore(slot, row, table)

        def free_all_requests(self, clear_ledgers: bool = False) -> None:
            super().free_all_requests(clear_ledgers)
            for rid in list(self.slot_of):
                self._drop(rid)
            self._pending, self._plan, self._work = [], None, {}

        def prompt_rows(self, request_id: str) -> int:
            """How many of the request's prompt tokens have their log probabilities asked (0: none), by what the
            request carries (``sampling.PROMPT_ROWS``): under tensor parallelism every rank's engine has the
            request, and so keeps the same rows, though only rank 0 records them."""
            from .sampling import PROMPT_ROWS
            sched = None if self._scheduler is None else self._scheduler()
            if sched is None:
                return 0
            state = sched.active_requests.get(request_id) or sched.waiting_requests.get(request_id)
            return 0 if state is None else int(state.logit_processor_kwargs.get(PROMPT_ROWS, 0))

        def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
            """transformers' prefix match (pages of an earlier request whose tokens begin this prompt); the request
            starts with those pages and their length in its row. Only with a free slot: a matched request holds
            its pages while it waits, so one that would wait for a slot stays unmatched until it gets one."""
            if request_id not in self.slot_of and not self.free_slots:
                return 0
            if self.prompt_rows(request_id):
                return 0  # its prompt's log probabilities are asked: every prompt token is computed
            n = super().search_prefix_match(request_id, prompt_ids)
            if n:
                self.prefix_tokens += n
                slot = self.slot_of.get(request_id)
                slot = self._take_slot(request_id) if slot is None else slot
                for st in self.stores:
                    st.set_tables({slot: self._table(request_id)})
                    st.set_length(slot, n)
            return n

        def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
            src = self.slot_of[src_state.request_id]
            forked = super().prepare_fork_request(src_state, list(dst_req_ids)[:len(self.free_slots)],
                                                  copy_src_and_dst)
            for rid in forked:
                dst = self._take_slot(rid)
                for st in self.stores:
                    st.fork(src, dst)  # length, ring and sinks
                    st.set_tables({dst: self._table(rid)})  # its own pages: shared ones and copies
            return forked

        def perform_cache_copy(self, copy_src_and_dst) -> None:
            """The forks' pages that transformers does not share are copied, block by block, in every layer."""
            for src, dst in copy_src_and_dst.values():
                src, dst = self._blocks(src), self._blocks(dst)
                for st in self.stores:
                    st.copy_blocks(src, dst)

        # ---- the batch
        def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
            # Record the batch: kvcompile's attention reads each request's row of the store. Eager: no indices.
            # Compiled: indices of transformers' lengths, which the traced graph takes (the rewritten ops ignore
            # their values; transformers' own would point into pages a windowed request does not hold)
            self._pending.append((request_id, past_length, query_length))
            if self.compiled:
                for w in write_index:
                    w.extend([0] * query_length)
                for r in read_index or ():
                    r.extend([0] * (past_length + query_length))

        def fill_block_table(self, *a, **k):
            raise UnsupportedError("kvcompile serving has no block-table decode path (max_blocks_per_request=0)")

        def _plan_for(self, total: int) -> _Plan:
            if self._pending:
                entries = []
                for rid, past, n in self._pending:
                    slot = self.slot_of.get(rid)
                    if slot is None:
                        raise UnsupportedError(f"kvcompile serving: request {rid} has no slot")
                    # transformers' compile warmup runs fake requests that "continue" a past they never wrote:
                    # their rows are computed as padding (zeros) and nothing is stored
                    skip = self.compiled and rid.startswith(WARMUP_PREFIX)
                    have = self.stores[0].lengths[slot]
                    if have != past and not skip:
                        raise UnsupportedError(
                            f"kvcompile serving: request {rid} continues at position {past} but its store holds "
                            f"{have} tokens")
                    entries.append((rid, slot, past, n, skip))
                tables = {slot: self._table(rid) for rid, slot, _, _, skip in entries if not skip}
                for st in self.stores:  # the pages transformers allocated for this forward
                    st.set_tables(tables)
                self._plan, self._pending = _Plan(entries, self.slots, self.device), []
            plan = self._plan
            # a compiled forward is padded to a static size: the tokens past the plan's are padding
            if plan is None or (plan.total > total if self.compiled else plan.total != total):
                raise UnsupportedError(
                    f"kvcompile serving: the forward has {total} tokens but the batch scheduled "
                    f"{None if plan is None else plan.total}"
                    + ("" if self.compiled else " (padded inputs need a compiled forward: varlen_compile_config)"))
            return plan

        def update(self, key_states, value_states, layer_idx, kwargs):
            """Eager: store the batch's new keys and values ``[1, H, T, D]`` in each request's row and return them
            as they came (``kvcompile_paged`` reads the chunk in full precision, the rest from the store).
            Compiled: transformers' own paged update, traced over the stand-ins (kvcompile's pass rewrites it)."""
            if not self.compiled:
                return self._eager_update(key_states, value_states, layer_idx)
            if not torch.compiler.is_compiling():
                raise UnsupportedError(
                    "kvcompile serving: this continuous-batching cache serves a compiled forward, but the forward ran "
                    "without Dynamo (an eager fallback: torch._dynamo.config.suppress_errors, a recompile limit, "
                    "torch.compiler.disable); its attention would read the stand-ins, not the store. Refusing.")
            return _base_update(self, key_states, value_states, layer_idx, kwargs)

        @torch.compiler.disable
        def _eager_update(self, key_states, value_states, layer_idx):
            self.store_layer(layer_idx, key_states, value_states)
            _BOUND.cache = weakref.ref(self)  # what this thread's attention reads next (``_attention``)
            return key_states, value_states

        def store_layer(self, layer_idx: int, key_states, value_states) -> None:
            """Store the forward's new keys and values ``[1, H, T, D]`` in their requests' rows of the layer's
            store (per the batch's plan; a compiled forward's padding rows past it are not stored)."""
            plan = self._plan_for(key_states.shape[2])
            st = self.stores[layer_idx]
            spec = st.spec
            st.reserve(plan.counts)
            state = st.state
            be = ops.backend(key_states.device)
            work = []
            for n, rows, idx, span in plan.groups:
                R = rows.numel()
                k, v = _gather(key_states, idx, R, n), _gather(value_states, idx, R, n)
                if span is not None:  # slots span..span+R-1: the kernels work on views of the store's rows
                    sub = KVState(*state[:6], *(t[span:span + R] for t in state[6:]))
                    be.store(sub, spec, k, v, None)
                else:  # scattered slots: their rows gathered, and the written rings, sinks, lengths put back
                    sub = KVState(*state[:6], *(t.index_select(0, rows) for t in state[6:]))
                    be.store(sub, spec, k, v, None)
                    for i in range(6, 11):
                        state[i].index_copy_(0, rows, sub[i])
                work.append((n, rows, idx, sub, k, v))
            for slot, n in enumerate(plan.counts):
                st.lengths[slot] += n
            self._work[layer_idx] = work

        def attend(self, layer_idx: int, query: torch.Tensor, scaling) -> torch.Tensor:
            """Attention of the batch's queries ``[1, Hq, T, D]`` over their requests' rows: ``[1, T, Hq, D]``."""
            work = self._work.pop(layer_idx, None)
            if work is None:
                raise UnsupportedError(f"kvcompile serving: layer {layer_idx} attends before it stored its keys")
            spec = self.specs[layer_idx]
            be = ops.backend(query.device)
            _, Hq, T, D = query.shape
            padded = T != sum(n * rows.numel() for n, rows, *_ in work)  # padding or warmup rows: zeros
            out = query.new_zeros(T, Hq, D) if padded else query.new_empty(T, Hq, D)
            for n, rows, idx, sub, k, v in work:
                R = rows.numel()
                q = _gather(query, idx, R, n)
                o = be.attention(q, sub, spec, None, scaling, k_new=k, v_new=v)  # [R, Hq, n, D]
                out.index_copy_(0, idx, o.permute(0, 2, 1, 3).reshape(R * n, Hq, D).to(out.dtype))
            return out.unsqueeze(0)

    return PagedKVCompileCache


_CLASSES: dict = {}


def cache_class():
    """The ``PagedAttentionCache`` subclass (built on first use: transformers' CB is imported lazily)."""
    if "cache" not in _CLASSES:
        _CLASSES["cache"] = _make_cache_class()
    return _CLASSES["cache"]


def is_paged(cache) -> bool:
    """Whether ``cache`` is a transformers paged (continuous-batching) cache, ours or its own."""
    t = type(cache)
    return any(c.__name__ == "PagedAttentionCache" for c in t.__mro__)


# --------------------------------------------------------------------------- the attention
_BOUND = threading.local()  # .cache: a weakref to the cache that stored this thread's current layer's keys


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A continuous-batching forward's layer reads the cache that stored its keys in this thread."""
    ref = getattr(_BOUND, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None:
        if "write_index" in kwargs:  # a continuous-batching forward whose keys went elsewhere
            raise UnsupportedError(f"attn_implementation={ATTN!r}: layer {module.layer_idx} of a continuous-batching "
                                 f"forward attends, but kvcompile's cache stored no keys for it in this thread (use "
                                 f"model.generate_batch / init_continuous_batching on a model kvcompile.apply "
                                 f"prepared)")
        raise UnsupportedError(
            f"this model's attention is {ATTN!r} while a continuous-batching manager runs on it, and that attention "
            f"serves only the manager's forwards: stop the manager (manager.stop()) before calling the model "
            f"otherwise (generate, a forward), or use a second model for it.")
    _BOUND.cache = None
    return cache.attend(module.layer_idx, query, scaling), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN, _attention)


# --------------------------------------------------------------------------- the manager
def _cache_factory(factory):
    """transformers' manager builds ``PagedAttentionCache`` by name: for the one call that builds ours."""
    from transformers.generation.continuous_batching import continuous_api as api
    return _swapped(api, "PagedAttentionCache", factory)


def compile_config(compiler: str | None = None, *, fullgraph: bool = False, dynamic: bool | None = None):
    """The ``CompileConfig`` of a compiled continuous-batching forward over kvcompile's store:

        ContinuousBatchingConfig(varlen_compile_config=kvcompile.serving.compile_config())

    is ``CompileConfig(backend="kvcompile", mode=None, options={"compiler": compiler})``. ``compiler``:
    "inductor" or "eager" (how the rest of the graph runs); None, the model's own (``kvcompile.apply``'s
    ``compiler``: Inductor on a GPU, eager on the CPU)."""
    from transformers.generation.configuration_utils import CompileConfig

    options = None
    if compiler is not None:
        from .backend import Options
        options = {"compiler": Options(compiler=compiler).compiler}  # validated here, at the call
    return CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend="kvcompile", mode=None, options=options)


def _is_kvcompile_backend(backend) -> bool:
    from .backend import kvcompile_backend
    return backend == "kvcompile" or backend is kvcompile_backend


def _compiled_request(asked):
    """The user's ``varlen_compile_config`` if it asks for kvcompile's backend, None if nothing is compiled;
    anything else is refused (it would trace kvcompile's cache without rewriting it)."""
    if asked.decode_compile_config is not None:
        raise UnsupportedError(
            "kvcompile serving has no decode fast path (block tables), so decode_compile_config would never run: "
            "pass varlen_compile_config=kvcompile.serving.compile_config() instead; it compiles every forward, "
            "prefill chunks and decode steps alike")
    cfg = asked.varlen_compile_config
    if cfg is None:
        if getattr(asked, "default_compile_level", 0):
            raise UnsupportedError(
                f"kvcompile serving: default_compile_level={asked.default_compile_level} compiles the forward with "
                f"Inductor over transformers' own cache; pass varlen_compile_config=kvcompile.serving."
                f"compile_config() for a compiled forward over kvcompile's store")
        return None
    if not _is_kvcompile_backend(cfg.backend):
        raise UnsupportedError(
            f"kvcompile serving compiles continuous-batching forwards with the 'kvcompile' backend only (got "
            f"backend={cfg.backend!r}, which would trace the cache without kvcompile's pass): use "
            f"varlen_compile_config=kvcompile.serving.compile_config() or CompileConfig(backend='kvcompile', ...)")
    from .backend import Options
    Options.parse(cfg.options)  # unknown options are refused now, not at the first forward
    return cfg


def _refuse(asked) -> None:
    """What kvcompile's cache does not serve yet, where the user asked for it."""
    def refuse(what):
        raise UnsupportedError(f"kvcompile serving does not support {what} yet")

    if asked.use_async_batching:
        refuse("use_async_batching=True")
    graphs = asked.use_cuda_graph
    if any(graphs) if isinstance(graphs, (tuple, list)) else graphs:
        refuse("CUDA graphs (use_cuda_graph)")
    if asked.cpu_offload_space is None:
        refuse("cpu_offload_space=None (a host swap sized from free memory); give its size in GiB")


def shares_pages(specs: list[LayerSpec]) -> bool:
    """Whether requests may share pages (a common prompt prefix, forks): a page's content must be a function
    of its tokens alone, so every layer must keep all its tokens in its pages -- no full-precision window
    (residual, or KIVI's partial group of per-channel keys) and no sinks held per request."""
    return all(s.ring == 0 and s.sink == 0 for s in specs)


def model_shares_pages(model) -> bool:
    """``shares_pages`` for a model ``kvcompile.apply`` prepared."""
    return shares_pages(layer_specs(model.config.get_text_config(), model._kvcompile_serving, model.dtype))


def _restrict(cb, varlen=None, share: bool = False) -> None:
    """The resolved config, with what kvcompile's cache does not serve yet turned off; ``varlen``: the compile
    config of a compiled forward (kvcompile's backend), or None; ``share``: whether pages may be shared."""
    cb.use_async_batching = False
    cb.varlen_compile_config, cb.decode_compile_config = varlen, None
    cb.use_cuda_graph = (False, False)
    cb.cpu_offload_space = 0.0
    cb.max_blocks_per_request = 0
    cb.allow_block_sharing = bool(share and cb.allow_block_sharing)


_ATTN_LOCK = threading.Lock()
_ATTN_HOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model: {manager: compiled}


def _release_attention(model, manager) -> None:
    """``manager`` no longer runs on ``model``: the last eager one to stop puts ``sdpa`` back."""
    with _ATTN_LOCK:
        holders = _ATTN_HOLDERS.get(model, {})
        holders.pop(manager, None)
        if not holders and model.config._attn_implementation == ATTN:
            model.set_attn_implementation("sdpa")


def _make_manager_class():
    from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                             ContinuousBatchProcessor)

    class KVCompileBatchingManager(ContinuousBatchingManager):
        """transformers' ``ContinuousBatchingManager`` over ``PagedKVCompileCache`` and ``kvcompile_paged``."""

        def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
            # everything that can refuse runs before transformers' manager switches the model's attention
            asked = continuous_batching_config
            _refuse(asked)
            self._compiled = _compiled_request(asked)  # and refuses what compiles otherwise
            opts: ServingOptions = model._kvcompile_serving
            text = model.config.get_text_config()
            self._specs = layer_specs(text, opts, model.dtype)
            budget = opts.budget
            if budget is None:
                budget = (asked.num_blocks * asked.page_size  # the rank's heads, as transformers counts them
                          * full_precision_bytes_per_token(text, model.dtype, opts.kv_heads)
                          if asked.num_blocks else DEFAULT_BUDGET)
            self._max_tokens = request_limit(text)
            self._slots = slots_for(self._specs, budget, opts.max_requests, opts.request_tokens, self._max_tokens)
            self.budget = budget
            self._blocks = pool_blocks(self._specs, budget, self._slots, self._max_tokens)
            if model.config._attn_implementation not in ("sdpa", ATTN):
                raise UnsupportedError(f"kvcompile serving needs a model loaded with attn_implementation='sdpa' "
                                     f"(this one uses {model.config._attn_implementation!r})")
            super().__init__(model, generation_config, continuous_batching_config, workload_hints)
            cb = self.continuous_batching_config
            share = shares_pages(self._specs)
            if cb.allow_block_sharing and not share:
                warnings.warn(
                    f"kvcompile serving: prefix sharing (ContinuousBatchingConfig.allow_block_sharing) is off for "
                    f"{opts.policy}: the policy keeps each request's recent tokens or sinks in full precision "
                    f"outside its pages, so a page cannot be handed to another request. Policies without a window "
                    f"or sinks share pages (Policy.full(), Policy.int8(), 'tok+rot:4'); pass "
                    f"allow_block_sharing=False to silence this.", stacklevel=3)
            self._offload_space = int(asked.cpu_offload_space * 2 ** 30)  # transformers' offloader gets 0 (below)
            _restrict(cb, self._varlen_config(model, self._compiled) if self._compiled is not None else None, share)
            cb.page_size = self._specs[0].block
            cb.num_blocks = self._blocks
            self._use_prefix_sharing = cb.allow_block_sharing

        @staticmethod
        def _varlen_config(model, asked):
            """The compile config transformers' model runner gets: the user's, its backend the kvcompile backend
            with the model's compiler unless ``options`` names one (and no report: the pass keeps its own)."""
            from transformers.generation.configuration_utils import CompileConfig

            from .backend import Options, compile_graph

            opts = Options.parse({"compiler": model._kvcompile.compiler, **(asked.options or {})})

            def kvcompile_paged_backend(gm, example_inputs, **_):
                return compile_graph(gm, example_inputs, opts)

            return CompileConfig(fullgraph=asked.fullgraph, dynamic=asked.dynamic, backend=kvcompile_paged_backend,
                                 mode=None, options=None)

        def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
            """Eager: the model's attention is ``kvcompile_paged`` while this manager or another runs on it
            (``_ATTN_HOLDERS``: the last to stop puts ``sdpa`` back, not the first, whose restoring would leave
            the others' forwards reading their chunks alone). Compiled: transformers' own SDPA is traced, and
            kvcompile's pass rewrites it; the two kinds cannot share one model at once."""
            compiled = getattr(self, "_compiled", None) is not None
            with _ATTN_LOCK:
                holders = _ATTN_HOLDERS.setdefault(model, weakref.WeakKeyDictionary())
                impl = model.config._attn_implementation
                if impl not in ("sdpa", ATTN):
                    raise UnsupportedError(f"kvcompile serving needs a model loaded with attn_implementation='sdpa' "
                                         f"(this one uses {impl!r})")
                others = {c for m, c in holders.items() if m is not self}
                if others and others != {compiled}:
                    mine, theirs = ("a compiled", "an eager") if compiled else ("an eager", "a compiled")
                    raise UnsupportedError(
                        f"kvcompile serving: another continuous-batching manager runs {theirs} forward on this "
                        f"model; {mine} one cannot run beside it (the two read the model's attention differently). "
                        f"Stop that manager first, or give both the same varlen_compile_config.")
                holders[self] = compiled
                if not compiled and impl != ATTN:
                    _register_attention()
                    model.set_attn_implementation(ATTN)
                elif compiled and impl == ATTN:  # left by an eager manager dropped without being stopped
                    model.set_attn_implementation("sdpa")

        def start(self) -> None:
            if not self.is_running():  # stopped before: it holds the model's attention again
                self.switch_to_cb_friendly_attn(self.model)
            super().start()

        def _run_generation_loop(self, *args, **kwargs) -> None:
            try:
                super()._run_generation_loop(*args, **kwargs)
            finally:  # its last forward has run (stop(block=False) returns before that)
                _release_attention(self.model, self)

        def stop(self, *args, **kwargs) -> None:
            try:
                super().stop(*args, **kwargs)
            finally:
                if not self.is_running():  # never started, or joined
                    _release_attention(self.model, self)

        def _create_batch_processor(self):
            bp = getattr(self, "batch_processor", None)
            if isinstance(bp, ContinuousBatchProcessor):
                bp.reset()
                return bp
            cls = cache_class()

            def factory(*args, **kwargs):
                return cls(*args, specs=self._specs, slots=self._slots, blocks=self._blocks,
                           max_tokens=self._max_tokens, compiled=self._compiled is not None, **kwargs)

            with _cache_factory(factory):
                bp = super()._create_batch_processor()
            if self._offload_space:
                old = bp.offloading_manager
                bp.offloading_manager = _offloading_class()(bp.cache, old.scheduler, self._offload_space,
                                                             old._compute_stream, bp.distributed_helper)
            bp.cache._scheduler = weakref.ref(bp.scheduler)
            self.cache = bp.cache
            return bp

    return KVCompileBatchingManager


def _make_offloading_class():
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    class KVCompileOffloading(OffloadingManager):
        """transformers' offloading of evicted requests (``ContinuousBatchingConfig.cpu_offload_space``) over
        kvcompile's pages: a request the scheduler evicts to make room is copied to host memory as its store
        holds it -- its pages packed, its row's ring and sinks -- in every layer, and copied back into the pages
        and slot it gets when it is scheduled again, so that it goes on exactly where it was (a soft reset
        re-prefills it instead, computing its keys and values again). Up to ``space`` bytes of host memory, the
        packed bytes counted; a victim that does not fit is soft reset, as transformers does. Which requests are
        evicted, and when, is transformers' own decision."""

        def __init__(self, cache, scheduler, space: int, compute_stream, distributed_helper):
            super().__init__(cache, scheduler, 0.0, 0.8, compute_stream, distributed_helper)
            self.space, self.used = space, 0
            self.saved: dict[str, tuple[list, int]] = {}  # request id: (each layer's SavedRow, bytes)
            self.offloaded = self.restored = 0  # requests copied out and back in (``/kvcompile/stats``)

        def offload_requests(self) -> bool:
            self.cache.keep_freed = {}  # the rows the eviction frees, kept for _offload_to_cpu
            try:
                return super().offload_requests()
            finally:
                self.cache.keep_freed = None

        def _offload_to_cpu(self, victims, victim_block_tables) -> set[str]:
            out = set()
            for state in victims:
                rows = self.cache.keep_freed.get(state.request_id)
                if rows is None:
                    continue
                size = sum(r.nbytes for r in rows)
                if self.used + size > self.space:
                    continue  # soft reset
                self.saved[state.request_id] = (rows, size)
                self.used += size
                self.offloaded += 1
                state.is_cpu_offloaded = True
                out.add(state.request_id)
            return out

        def restore_scheduled_requests(self, requests_in_batch) -> None:
            for future in requests_in_batch:
                state = future.state
                if not state.is_cpu_offloaded:
                    continue
                rows, size = self.saved.pop(state.request_id)
                self.used -= size
                state.is_cpu_offloaded = False
                self.cache.restore(state.request_id, rows)
                self.restored += 1
                if self.cache.use_prefix_sharing:  # its restored pages are complete: hashed at the next update
                    for name, allocator in self.cache.cache_allocators.items():
                        whole = state.position_offset // allocator.tokens_per_page
                        if whole:
                            future.complete_blocks[name] = future.complete_blocks.get(name, 0) + whole

        def free_request_cpu_cache(self, state) -> None:
            if state.is_cpu_offloaded:
                self.used -= self.saved.pop(state.request_id)[1]
                state.is_cpu_offloaded = False

        def reset(self) -> None:
            self.free_all_waiting_cpu_caches()
            self.saved.clear()
            self.used = 0

    return KVCompileOffloading


def _offloading_class():
    if "offloading" not in _CLASSES:
        _CLASSES["offloading"] = _make_offloading_class()
    return _CLASSES["offloading"]


def manager_class():
    if "manager" not in _CLASSES:
        _CLASSES["manager"] = _make_manager_class()
    return _CLASSES["manager"]


def install(model, policy: Policy, layer_names, kv_heads: int) -> None:
    """Route ``model.init_continuous_batching`` (and so ``generate_batch``, the context manager and
    ``transformers serve``) through kvcompile's manager. Called by ``kvcompile.apply``."""
    model._kvcompile_serving = ServingOptions(policy, list(layer_names), kv_heads)
    if not hasattr(type(model), "init_continuous_batching"):
        return

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cls = manager_class()
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if isinstance(cached, cls):
            cached.switch_to_cb_friendly_attn(model)
            return cached
        gen = generation_config if generation_config is not None else model.generation_config
        if gen is None:
            raise ValueError("A GenerationConfig must be provided or set in the model.")
        if gen.eos_token_id is None:
            gen.eos_token_id = -1
        cbc = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
        return cls(model, gen, cbc, workload_hints)

    model.init_continuous_batching = init_continuous_batching


def paged_forward(orig_forward, paged_cache, /, *args, **kwargs):
    """The applied model's forward when transformers' continuous batching calls it: eager (the cache's
    ``update`` and the ``kvcompile_paged`` attention do the work), and only over kvcompile's paged cache."""
    if not isinstance(paged_cache, cache_class()):
        raise UnsupportedError(
            f"this model was prepared by kvcompile.apply but was given transformers' own {type(paged_cache).__name__}, "
            f"which stores keys and values in full precision. Use model.generate_batch / "
            f"model.init_continuous_batching on the applied model (they build kvcompile's paged cache).")
    wanted = _prompt_places(paged_cache)
    if not wanted:
        return orig_forward(*args, **kwargs)
    keep = kwargs.get("logits_to_keep")
    rows = torch.tensor([i for i, _, _ in wanted])
    if isinstance(keep, torch.Tensor):  # the head runs on the kept rows and the prompt's rows, then they part
        out = orig_forward(*args, **{**kwargs, "logits_to_keep": torch.cat([keep, rows.to(keep.device)])})
        logits, out.logits = out.logits[0, len(keep):], out.logits[:, :len(keep)]
    else:  # the head ran on every row; the engine picks its own
        out = orig_forward(*args, **kwargs)
        logits = out.logits[0, rows.to(out.logits.device)]
    from .sampling import RECORDS

    for row, (_, rid, place) in zip(logits, wanted):
        asked = RECORDS.prompt_asked(rid)  # None on the other ranks, or once its reply is gone
        if asked is not None:
            asked.took_prompt(place, row)
    return out


def _prompt_places(paged_cache) -> list[tuple[int, str, int]]:
    """The rows of the forward about to run whose logits give a prompt token's log probability, for requests
    that ask for them (``PagedKVCompileCache.prompt_rows``): ``(row, the request's id, the place in its prompt
    of the token the row predicts)``. Eager forwards only (a compiled one has a static shape)."""
    if paged_cache.compiled or not paged_cache._pending:
        return []
    out, row = [], 0
    for rid, past, n in paged_cache._pending:
        if asked := paged_cache.prompt_rows(rid):
            out += [(row + j, rid, past + j + 1) for j in range(n) if past + j + 1 < asked]
        row += n
    return out
