"""The window cache: where a policy's full-precision window and pending key groups live inside vLLM.

A policy with a recent window (``residual``: KIVI, ``Policy.fp8()``) or per-channel key groups (KIVI keys) keeps
each sequence's newest positions in full precision beside its packed pages (``kvcompile.pages``, "a window of
full-precision tokens"). vLLM gives a request pages and nothing else, so those positions live in pages too: each
such attention layer gets a companion, ``<layer>.kvcompile_window``, that vLLM manages as one of its own kinds of
cache, from its one pool and counted in its capacity:

- key groups alone (``residual=0``): a ring per request (``CircularBufferSpec``: one page for the request's
  lifetime, slot ``p % slots``: the window and any speculative tokens). A cached prefix ends at a page's end, a
  group's, so nothing of it is pending.
- a recent window: a sliding-window layer of the window's length (``WindowSpec``, vLLM's ``SlidingWindowSpec``
  with a manager of ours, ``WindowManager``): its own block table, pages freed behind the window, shared through
  the prefix cache (a cached prefix brings its window's pages), recomputed after preemption. Unlike a model's
  sliding-window layer it gives a step pages only for the positions later steps read -- the step's newest
  ``window`` positions and those before the last packed page boundary it reaches, where a prefix-cache hit on the
  same text lands -- because the step's own queries read its tokens from the step's own keys and values
  (``pages.Recent``); a prompt's chunk of thousands of tokens then holds a few window pages, not one per 32 tokens.

The companion never runs: its attention layer writes and reads both caches (``pages.store_windowed``,
``pages.attention_windowed``). vLLM keeps the groups of one pool in pages of one size: the window's page is padded
to the packed page (``page_size_padded``) -- except under a per-layer policy, whose pages vLLM lays side by side in
each block, each of its own size: there a window page gets its share of a block (``WindowLayer._budget``).
"""
from __future__ import annotations

import dataclasses

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .backend import _ACTIVE, KVCompileImpl, block_for, log
from ..errors import ArgumentError
from .config import refuse

SUFFIX = ".kvcompile_window"


# A sliding window's pages hold a power of two of at least WINDOW_BASE tokens, so one divides a packed page (a
# prefix-cache hit must end on a page of both). vLLM's kernels never read a window cache (kvcompile's gather its
# positions), so ``WindowSpec`` declares WINDOW_BASE as its kernel block (``KVCompileBackend``): 16, where vLLM's
# CPU kernel's 32 made a float32 window page of KIVI int4 outgrow its 128-token packed page. A ring is vLLM's own
# ``CircularBufferSpec``, whose kernel block is the backend's: RING_BASE slots, a multiple of each backend's (CPU
# 32, CUDA 16).
WINDOW_BASE, RING_BASE = 16, 32


def window_block(layout, ring: bool, lookahead: int = 0, budget: int | None = None, share: int = 1) -> int:
    """Tokens in one window page: for a sliding window, the most whose keys and values in full precision fit one
    packed page, a power of two of at least ``WINDOW_BASE``; for a ring, the window's length and ``lookahead``
    (the speculative tokens a step stores before vLLM knows which it accepts: a ring that held only the window
    would lose pending positions to rejected drafts) rounded up to ``RING_BASE``. A packed page too small for it
    is refused, naming the block size that would fit.

    Under a per-layer policy whose pages vLLM packs side by side in each block (``backend._Active.mixed``) a window
    page has ``budget`` bytes instead: its share of the block's packed pages among the ``share`` layers whose window
    caches are of its kind (one cache group: pages of the same tokens)."""
    base = RING_BASE if ring else WINDOW_BASE
    per_token = layout.window_page_bytes(1)
    room = layout.page_bytes if budget is None else budget
    fit = room // per_token
    fit = fit // base * base if ring else (1 << fit.bit_length() - 1 if fit >= base else 0)
    want = -(-(layout.window_tokens + lookahead) // base) * base if ring else base
    if fit < want:
        need = block_for(layout, want * per_token) if budget is None else \
            layout.block << (-(-want * per_token // room) - 1).bit_length()
        drafts = (f" (its window and the {lookahead} speculative tokens a step may store, in whole blocks of {base})"
                  if ring and lookahead else "")
        fix = f"start vLLM with block_size={need} (--block-size {need}) or larger"
        S, R = layout.policy.sink, layout.policy.residual
        if S and R < need - S:  # its sinks would then be refused: say the way out that works
            fix = (f"with its {S} sinks, pages of {need} tokens need a window of residual >= {need - S} (the sinks "
                   f"take a request's first page): {fix} and such a window, or run the model in bfloat16 or "
                   f"float16 (full-precision tokens of half the bytes)")
        where = (f"in pages the size of its packed pages, and a packed page of {layout.block} tokens "
                 f"({layout.page_bytes} bytes)" if budget is None else
                 f"in vLLM's blocks beside the packed pages of every layer, and a block of {layout.block} tokens "
                 f"leaves each of the {share} layers that keep one {room} bytes, which")
        refuse(f"{layout.policy} keeps {want if ring else 'a window of'} full-precision tokens{drafts} {where} "
               f"holds {'only ' + str(fit) if ring else 'fewer than ' + str(base)} of them", fix)
    return want if ring else fit


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowSpec(SlidingWindowSpec):
    """vLLM's sliding-window spec for a window cache whose steps are given pages only for the positions later steps
    read (``WindowManager``), so a request holds ``max_admission_blocks_per_request`` pages at most however many
    tokens a step schedules (vLLM's own sliding window charges the window plus every token a step may schedule).

    sliding_window: the window, ``PageLayout.window_tokens``: a query at ``p`` reads positions ``> p - window``.
    lookahead:      speculative tokens a step may store before vLLM knows which it accepts.
    align:          tokens of a packed page: where a prefix-cache hit lands.
    steps:          steps vLLM keeps in flight at once (its ``max_concurrent_batches``).
    """

    lookahead: int = 0
    align: int = 0
    steps: int = 1

    @property
    def hit_blocks(self) -> int:
        """Window pages a prefix-cache hit needs just before it (vLLM's rule for a sliding window)."""
        return cdiv(self.sliding_window - 1, self.block_size)

    def kept_from(self, end: int) -> int:
        """The first position a step whose tokens end at ``end`` keeps: its newest window (drafts beside), and the
        pages a hit needs before the last packed page boundary it reaches, so a request with the same text hits
        the prefix cache there."""
        keep = end - (self.sliding_window - 1) - self.lookahead
        if self.align:
            keep = min(keep, (end - 1) // self.align * self.align - self.hit_blocks * self.block_size)
        return max(0, keep)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Pages a request holds at most: the window the steps in flight read (vLLM frees behind the processed
        tokens) and what each step in flight keeps -- or, where steps schedule fewer tokens than that, vLLM's own
        sliding window's bound (every page from the window to the newest token)."""
        B, span = self.block_size, self.sliding_window - 1 + self.lookahead
        if self.align:
            span = max(span, self.align + self.hit_blocks * B)
        read = cdiv(self.sliding_window - 1 + 2 * self.lookahead, B) + 1
        kept = cdiv(span + self.lookahead, B) + 1
        every = super().max_admission_blocks_per_request(max_in_flight_tokens + self.steps * self.lookahead,
                                                         max_model_len + self.lookahead)
        return min(read + self.steps * kept, every)


class WindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager for a ``WindowSpec``: a step's new pages before ``kept_from`` are vLLM's null
    block (positions no later step reads: ``pages.store_windowed`` skips them, and a prefix-cache hit never lands
    after them), and the pages behind the window are freed across those gaps."""

    def __init__(self, kv_cache_spec: WindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._freed: dict[str, int] = {}  # per request: its pages before this index are freed or null

    def _first(self, end: int) -> int:
        return self.kv_cache_spec.kept_from(end) // self.block_size

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        if apply_admission_cap:  # vLLM's gate for a whole request: its rule, capped at the bound
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_local_computed_tokens,
                                                      num_tokens_main_model, True, prefill_end)
        held = len(self.req_to_blocks.get(request_id, ()))  # pages in the table, null ones too
        # what allocate_new_blocks takes: pages from the first one kept (or the table's end) to the newest token
        new = max(cdiv(num_tokens, self.block_size)
                  - max(held + len(new_computed_blocks), self._first(num_tokens_main_model)), 0)
        if request_id in self.num_cached_block:  # a running request has no new prefix-cache hits
            return new
        # cached pages of a hit that are free now are taken from the free queue: they count as allocated
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        return new + self._get_num_evictable_blocks(new_computed_blocks[max(0, skipped - held):])

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        # what this returns is what the worker appends to the request's block table: the null pages too, in place
        # (a sliding window's hits are whole pages, so vLLM copies no page on write here)
        blocks = self.req_to_blocks[request_id]
        first = min(self._first(num_tokens_main_model), cdiv(num_tokens, self.block_size))
        gap = [self._null_block] * max(0, first - len(blocks))
        blocks.extend(gap)
        return gap + super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None) -> None:
        # vLLM's own stops at the first null page it meets going back; a step's gap would hide the pages before it
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(self.get_num_skipped_tokens(processed_computed_tokens) // self.block_size, len(blocks))
        start = self._freed.get(request_id, 0)
        if end <= start:
            return
        freed = [b for b in blocks[start:end] if not b.is_null]
        blocks[start:end] = [self._null_block] * (end - start)
        self._freed[request_id] = end
        if freed:
            self.block_pool.free_blocks(reversed(freed))  # the newest first, as vLLM frees

    def pop_blocks_for_free(self, request_id):
        self._freed.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


# vLLM fills its registry of cache kinds only while it is empty: its own kinds first, then this one
KVCacheSpecRegistry._ensure_registered()
KVCacheSpecRegistry.register(WindowSpec, WindowManager, uniform_type_base_spec=SlidingWindowSpec)


class WindowLayer(AttentionLayerBase):
    """vLLM's view of one attention layer's window cache: a ring or a sliding-window layer that never runs (module
    docstring). ``owner``: vLLM's ``Attention`` whose implementation is kvcompile's, with a windowed layout or,
    under a per-layer policy, one that may get one (its layout is chosen when vLLM asks the owner for its spec,
    just before this layer: ``settle``)."""

    ring: bool
    block: int
    slots: int

    def __init__(self, owner):
        self.owner = owner
        self.layer_name = owner.layer_name + SUFFIX
        self.num_heads = owner.impl.num_heads
        self.kv_cache = None
        self.layout = None
        spec = get_current_vllm_config().speculative_config
        self.lookahead = (spec.num_speculative_tokens or 0) if spec is not None else 0
        if owner.impl.layout is not None:  # one policy for every layer: settled now, refused now
            self.settle()

    def settle(self, vllm_config=None):
        """The window cache of the owner's layout (None when it keeps no window), sized once: under one policy for
        every layer its page is the packed page; under a per-layer policy (``vllm_config`` given) its share of a
        block (``_budget``)."""
        lay = self.owner.impl.layout
        if lay is None or not lay.window:
            return None
        if self.layout is None:
            # no recent window (KIVI's key groups alone): a ring per request, which a cached prefix never needs
            # (its end is a page's, so a group's: nothing pending); a window: a sliding window, which a cached
            # prefix brings
            self.ring = lay.policy.residual == 0
            budget, share = self._budget(vllm_config) if _ACTIVE.mixed else (None, 1)
            self.block = window_block(lay, self.ring, self.lookahead, budget, share)
            # a ring's slots (position p in slot p % slots): the positions it must hold, so that without speculation
            # it is the kernels' own ring, read where it lies (``pages.store_windowed``); vLLM's page has ``block``
            self.slots = lay.window_tokens + self.lookahead if self.ring else self.block
            self.padded = lay.page_bytes if budget is None else None
            self.layout = lay
        return self.layout

    def _budget(self, vllm_config) -> tuple[int, int]:
        """(bytes, layers) under a per-layer policy: vLLM packs each block with one page of every layer side by side,
        each of its own size (its block-outermost layout), and the window caches of one kind (rings, or windows)
        share blocks in cache groups of ``layers``: each window page gets an equal share of a block, the bytes of
        every full-attention layer's page (``backend.block_bytes``; a group that held more would widen every block).
        Window caches of one kind have the same spec (a ring or a window, of as many positions). Every layer's layout
        is chosen by then (``backend.layer_spec``, which vLLM asks for the owner's spec just before this one's).

        The groups are vLLM's (``kv_cache_utils._get_packed_kv_cache_groups``): where the full-attention layers'
        pages repeat a pattern of sizes (``backend.pattern``), every other kind of cache is cut into groups of as
        many pattern repeats; otherwise a kind is one group."""
        from collections import Counter

        from vllm.v1.core.kv_cache_utils import _approximate_gcd

        from .backend import _impls, block_bytes, pattern
        kind = lambda lay: (lay.policy.residual == 0, lay.window_tokens)  # noqa: E731  (one spec: one bucket)
        lays = [i.layout for i in _impls(vllm_config).values() if i.layout is not None]
        kinds = Counter(kind(lay) for lay in lays if lay.window)
        share = kinds[kind(self.owner.impl.layout)]
        repeats = pattern(vllm_config)
        if repeats is not None:
            share = min(share, _approximate_gcd([repeats, *kinds.values()], lower_bound=repeats))
        return block_bytes(vllm_config) // share, share

    def get_attn_backend(self):
        return self.owner.get_attn_backend()

    def get_kv_cache_spec(self, vllm_config):
        lay = self.settle(vllm_config)
        if lay is None:  # a per-layer policy gave the owner no window: no cache (vLLM skips the layer)
            self.owner.impl.window = None
            return None
        if self.ring:
            return CircularBufferSpec(block_size=self.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                                      dtype=vllm_config.model_config.dtype, page_size_padded=self.padded)
        spec = WindowSpec(block_size=self.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                          dtype=vllm_config.model_config.dtype, sliding_window=lay.window_tokens,
                          page_size_padded=self.padded, lookahead=self.lookahead, align=lay.block,
                          steps=vllm_config.max_concurrent_batches)
        ctx = vllm_config.compilation_config.static_forward_context
        said = {w.layout.policy for w in ctx.values() if isinstance(w, WindowLayer) and getattr(w, "said", False)}
        if lay.policy not in said:  # once per engine and policy, not per layer
            self.said = True
            pages = spec.max_admission_blocks_per_request(max_in_flight_tokens=vllm_config.max_in_flight_tokens,
                                                          max_model_len=vllm_config.model_config.max_model_len)
            log.info("kvcompile: %s keeps a window of %d full-precision tokens in vLLM's pages, at most %d window "
                     "pages of %d tokens a request. A prefix-cache hit needs the window before it, which is kept at "
                     "the last page boundary of each prefill chunk and everywhere a request decoded (docs/vllm.md)",
                     lay.policy, lay.window_tokens, pages, self.block)
        return spec


def attach(layer) -> None:
    """Give ``layer`` (an ``Attention`` just built) its window cache when its layout keeps a window, or under a
    per-layer policy when one of the layouts it may get does (``KVCompileImpl.windowed``)."""
    impl = getattr(layer, "impl", None)
    if not isinstance(impl, KVCompileImpl) or not impl.windowed:
        return
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    window = WindowLayer(layer)
    if window.layer_name in ctx:
        raise ArgumentError(f"a layer named {window.layer_name} is already in vLLM's forward context: kvcompile names "
                            f"its window caches so; rename that layer")
    ctx[window.layer_name] = window
    impl.window = window
