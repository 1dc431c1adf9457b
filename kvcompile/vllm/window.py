"""The window cache: where a policy's full-precision window and pending key groups live inside vLLM.

A policy with a recent window (``residual``: KIVI, ``Policy.fp8()``) or per-channel key groups (KIVI keys) keeps
each sequence's newest positions in full precision beside its packed pages (``kvcompile.pages``, "a window of
full-precision tokens"). vLLM gives a request pages and nothing else, so those positions live in pages too: each
such attention layer gets a companion, ``<layer>.kvcompile_window``, that vLLM manages as one of its own kinds of
cache, from its one pool and counted in its capacity:

- key groups alone (``residual=0``): a ring per request (``CircularBufferSpec``: one page for the request's
  lifetime, slot ``p % block``). A cached prefix ends at a page's end, a group's, so nothing of it is pending.
- a recent window: a sliding-window layer of the window's length (``SlidingWindowSpec``, as Gemma's windowed
  layers): its own block table, pages freed behind the window, shared through the prefix cache (a cached prefix
  brings its window's pages), recomputed after preemption.

The companion never runs: its attention layer writes and reads both caches (``pages.store_windowed``,
``pages.attention_windowed``). vLLM keeps the groups of one pool in pages of one size: the window's page is padded
to the packed page (``page_size_padded``).
"""
from __future__ import annotations

import logging

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec

from .backend import KVCompileImpl
from ..errors import ArgumentError
from .config import refuse

SUFFIX = ".kvcompile_window"
log = logging.getLogger("kvcompile.vllm")
_told: set = set()


def window_block(layout, backend, ring: bool, lookahead: int = 0) -> int:
    """Tokens in one window page: for a sliding window, the most whose keys and values in full precision fit one
    packed page, a multiple of the block the backend's kernels take (its ``MultipleOf``, else 16); for a ring, the
    window's length and ``lookahead`` (the speculative tokens a step stores before vLLM knows which it accepts: a
    ring that held only the window would lose pending positions to rejected drafts) rounded up to that block. A
    packed page too small for it is refused, naming the block size that would fit."""
    bases = [s.base for s in backend.get_supported_kernel_block_sizes() if isinstance(s, MultipleOf)] or [16]
    base = max(bases)
    per_token = layout.window_page_bytes(1)
    fit = layout.page_bytes // per_token // base * base
    want = -(-(layout.window_tokens + lookahead) // base) * base if ring else base
    if fit < want:
        need = -(-want * per_token // (layout.heads * layout.token_head_bytes))
        need = 1 << (need - 1).bit_length()
        drafts = (f" (its window and the {lookahead} speculative tokens a step may store, in whole blocks of {base})"
                  if ring and lookahead else "")
        fix = f"start vLLM with block_size={need} (--block-size {need}) or larger"
        S, R = layout.policy.sink, layout.policy.residual
        if S and R < need - S:  # its sinks would then be refused: say the way out that works
            fix = (f"with its {S} sinks, pages of {need} tokens need a window of residual >= {need - S} (the sinks "
                   f"take a request's first page): {fix} and such a window, or run the model in bfloat16 or "
                   f"float16 (full-precision tokens of half the bytes)")
        refuse(f"{layout.policy} keeps {want if ring else 'a window of'} full-precision tokens{drafts} in pages the size of "
               f"its packed pages, and a packed page of {layout.block} tokens ({layout.page_bytes} bytes) holds "
               f"{'only ' + str(fit) if ring else 'fewer than ' + str(base)} of them", fix)
    return want if ring else fit


class WindowLayer(AttentionLayerBase):
    """vLLM's view of one attention layer's window cache: a ring or a sliding-window layer that never runs (module
    docstring). ``owner``: vLLM's ``Attention`` whose implementation is kvcompile's with a windowed layout."""

    def __init__(self, owner):
        self.owner = owner
        self.layer_name = owner.layer_name + SUFFIX
        self.num_heads = owner.impl.num_heads
        self.kv_cache = None
        # no recent window (KIVI's key groups alone): a ring per request, which a cached prefix never needs (its
        # end is a page's, so a group's: nothing pending); a window: a sliding window, which a cached prefix brings
        self.ring = owner.impl.layout.policy.residual == 0
        spec = get_current_vllm_config().speculative_config
        self.block = window_block(owner.impl.layout, owner.get_attn_backend(), self.ring,
                                  (spec.num_speculative_tokens or 0) if spec is not None else 0)

    def get_attn_backend(self):
        return self.owner.get_attn_backend()

    def get_kv_cache_spec(self, vllm_config):
        lay = self.owner.impl.layout
        if self.ring:
            return CircularBufferSpec(block_size=self.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                                      dtype=vllm_config.model_config.dtype, page_size_padded=lay.page_bytes)
        spec = SlidingWindowSpec(block_size=self.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                                 dtype=vllm_config.model_config.dtype, sliding_window=lay.window_tokens,
                                 page_size_padded=lay.page_bytes)
        step = vllm_config.scheduler_config.max_num_batched_tokens
        said = (id(vllm_config), lay.window_tokens, step)
        if said not in _told:  # once per engine and window, not per layer
            _told.add(said)
            pages = spec.max_admission_blocks_per_request(max_in_flight_tokens=vllm_config.max_in_flight_tokens,
                                                          max_model_len=vllm_config.model_config.max_model_len)
            log.warning("kvcompile: %s keeps a window of %d full-precision tokens, which vLLM manages as a "
                        "sliding-window layer and charges each request, for admission, the window plus every token "
                        "one step may schedule (max_num_batched_tokens=%d), at most max_model_len: %d window pages of %d "
                        "tokens a request. A smaller --max-num-batched-tokens raises the concurrency vLLM reports "
                        "(docs/vllm.md)", lay.policy, lay.window_tokens, step, pages, self.block)
        return spec


def attach(layer) -> None:
    """Give ``layer`` (an ``Attention`` just built) its window cache when its layout keeps a window."""
    impl = getattr(layer, "impl", None)
    if not isinstance(impl, KVCompileImpl) or impl.layout is None or not impl.layout.window:
        return
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    window = WindowLayer(layer)
    if window.layer_name in ctx:
        raise ArgumentError(f"a layer named {window.layer_name} is already in vLLM's forward context: kvcompile names "
                            f"its window caches so; rename that layer")
    ctx[window.layer_name] = window
    impl.window = window
