"""The serving pool's sizes: one byte budget for the whole continuous-batching cache (``kvcompile.serving``).

The one place these sizes are written: the engine (``kvcompile.engine``) allocates them, ``kvcompile.serving.
capacity`` counts them, and ``kvcompile plan --serving`` predicts them from a model's shape (nothing allocated).
A budget pays, per layer, for each request slot's row (a policy's full-precision window and sinks, its length),
for the pool's blocks (transformers' pages: ``page_size`` is the block) and for the slots' block tables.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .accounting import full_precision_bytes_per_token as fp_bytes
from .errors import ArgumentError, UnsupportedError
from .hf import _text_config, model_shape, windowed_layers
from .policy import Policy
from .store import DTYPE_NAMES, KVStore, LayerSpec
from .window import WindowRing, WindowSpec

DEFAULT_BUDGET = 256 * 2**20  # bytes, when neither configure(budget=) nor the CB config's num_blocks says
DEFAULT_SLOTS = 32            # at most this many concurrent requests by default (see default_slots)


@dataclass
class ServingOptions:
    """What serving keeps of an applied model (``model._kvcompile_serving``, set by ``serving.attach``): the policy
    per layer, the KV heads this rank caches, and the sizing knobs (``serving.configure``)."""

    policy: Policy
    layer_names: list
    kv_heads: int
    budget: int | None = None        # bytes for the whole cache; None: see kvcompile.serving
    max_requests: int | None = None  # slots (requests holding cache at once); None: see ``slots_for``
    request_tokens: int | None = None  # size the slots for requests of this many tokens (``most_slots``)


def specs_for(policies: list[Policy], kv_heads: int, head_dim: int, dtype: str,
              windows: dict[int, int] | None = None) -> list[LayerSpec | WindowSpec]:
    """One spec per layer (resolved per-layer ``policies``), every one with the same block (the largest any
    layer's policy needs): transformers counts pages of one size for all layers. A layer in ``windows`` (index:
    window) attends over a sliding window and keeps it in each slot's ring (``WindowSpec``, its policy unused)."""
    windows = windows or {}
    paged = [p for i, p in enumerate(policies) if i not in windows]
    if not paged:
        raise UnsupportedError(
            f"kvcompile serving: every attention layer of this model attends over a sliding window "
            f"({sorted(set(windows.values()))} tokens), which continuous batching keeps in full precision as "
            f"transformers does: kvcompile would quantize nothing. Serve it with transformers' own continuous "
            f"batching (the unapplied model).")
    block = max(LayerSpec(p, kv_heads, head_dim, dtype).block for p in paged)
    return [WindowSpec(windows[i], kv_heads, head_dim, dtype, block) if i in windows else
            LayerSpec(p, kv_heads, head_dim, dtype, block_tokens=block) for i, p in enumerate(policies)]


def serving_windows(model_config) -> dict[int, int]:
    """Layer index -> window of the model's sliding-window layers, which serving keeps in each slot's ring
    (``kvcompile.window``). Chunked attention (Llama 4) is refused: transformers' continuous batching has no
    allocator for it."""
    text = _text_config(model_config)
    types = getattr(text, "layer_types", None)
    if "chunked_attention" in (types or ()) or (types is None and getattr(text, "attention_chunk_size", None)
                                                and not getattr(text, "sliding_window", None)):
        raise UnsupportedError("kvcompile serving does not support chunked-attention layers (Llama 4): "
                               "transformers' continuous batching has no cache allocator for them. Use generate.")
    return windowed_layers(model_config)


def layer_specs(model_config, opts: ServingOptions, dtype: torch.dtype) -> list[LayerSpec | WindowSpec]:
    """``specs_for`` an applied model's layers, its sliding-window layers kept in the slots' rings."""
    _, _, head_dim = model_shape(model_config)
    return specs_for(opts.policy.resolve(opts.layer_names), opts.kv_heads, head_dim, DTYPE_NAMES[dtype],
                     serving_windows(model_config))


def full_precision_bytes_per_token(model_config, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """What transformers' paged cache allocates per token, every layer: keys and values in the model dtype;
    ``kv_heads``: a rank's share under tensor parallelism (default: the model's)."""
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


MAX_BATCH_TOKENS = 256  # kvcompile serve's --max-batch-tokens: a forward's tokens, a quantized prompt's pieces


def shared_pages(shared_tokens: int, page_size: int) -> int:
    """Pages of a ``shared_tokens``-token prefix every request shares: transformers' prefix sharing matches
    whole pages, so only the complete ones."""
    return shared_tokens // page_size


def shareable_tokens(tokens: int, page_size: int, piece: int | None) -> int:
    """Of a prompt prefix of ``tokens`` tokens found in the cache, those a request reads from shared pages:
    whole pages, and under a quantized policy (``piece``: the forward's token budget, ``max_batch_tokens``;
    None for a policy that stores every layer exactly) whole pieces too. A quantized prompt is prefilled in
    pieces at multiples of the budget, each reading the earlier ones as stored (``kvcompile.scheduler``), so
    pages holding a prompt's first pieces hold the very codes the request's own pieces would store, and a
    request that takes them gets the reply it gets computing them itself; a match ending inside a piece would
    have it read as stored what its own piece reads in full precision."""
    return tokens - tokens % (math.lcm(page_size, piece) if piece else page_size)


def quantizes(specs) -> bool:
    """Some layer is stored quantized (a sliding-window layer's ring is full precision): a prompt's numbers then
    depend on where its pieces fall and which pages it shares."""
    return any(isinstance(s, LayerSpec) and not s.policy.exact for s in specs)


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
        raise ArgumentError(f"kvcompile serving: shared_tokens={shared_tokens!r}: expected a number of tokens from 0 to "
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
    slot and column (``table_width``). A sliding-window layer (``WindowSpec``): its rings only."""
    width = table_width(specs, blocks, max_tokens)
    return sum(slots * s.row_nbytes() + blocks * s.block_nbytes()
               + (4 * slots * width if isinstance(s, LayerSpec) else 0) for s in specs)


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
              shared_tokens: int = 0, max_tokens: int | None = None,
              max_batch_tokens: int = MAX_BATCH_TOKENS) -> PoolSize:
    """The pool ``budget`` bytes buy with ``slots`` request rows; ``slots=None``: the most requests of
    ``request_tokens`` tokens the budget holds (``most_slots``), their first ``shared_tokens`` tokens a
    prompt prefix they share where the policy shares pages (``shares_pages``; what of it they read from shared
    pages: ``shareable_tokens`` at ``max_batch_tokens`` a forward); block tables as wide as a request of
    ``max_tokens`` tokens needs (``table_width``)."""
    for name, v in (("budget", budget), ("request_tokens", request_tokens), ("slots", slots)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ArgumentError(f"kvcompile serving: {name}={v!r}: expected a positive integer")
    check_shared_tokens(shared_tokens, request_tokens)
    shared_tokens = (shareable_tokens(shared_tokens, specs[0].block, max_batch_tokens if quantizes(specs) else None)
                     if shares_pages(specs) else 0)
    slots = slots_for(specs, budget, slots, request_tokens, max_tokens, shared_tokens)
    blocks = pool_blocks(specs, budget, slots, max_tokens)
    return PoolSize(budget, slots, blocks, specs[0].block, request_tokens,
                    pool_nbytes(specs, slots, blocks, max_tokens), request_pages(specs, request_tokens), shared_tokens)


def make_stores(specs: list[LayerSpec], slots: int, blocks: int, device="cpu",
                max_tokens: int | None = None) -> list[KVStore]:
    """One store per layer: ``slots`` rows, a pool of ``blocks`` blocks allocated now (it never grows), and
    the block table at ``table_width``; a sliding-window layer's rings (``WindowRing``). Its tensors are exactly
    what ``pool_nbytes`` counts."""
    out, width = [], table_width(specs, blocks, max_tokens)
    for s in specs:
        if isinstance(s, WindowSpec):
            out.append(WindowRing(s, slots, device))
            continue
        # the rows whole: the budget pays for every slot's window and sinks up front (``pool_nbytes``)
        out.append(KVStore(s, slots, device, max_blocks=blocks, blocks=blocks, table_width=width, whole_rows=True))
    return out


def shares_pages(specs: list[LayerSpec]) -> bool:
    """Whether requests may share pages (a common prompt prefix, forks): a page's content must be a function
    of its tokens alone, so every layer must keep all its tokens in its pages -- no full-precision window
    (residual, or KIVI's partial group of per-channel keys), no sinks held per request, and no sliding-window
    layer (its window is in the slot: transformers' own engine shares no pages for such a model either)."""
    return all(s.ring == 0 and s.sink == 0 for s in specs)
