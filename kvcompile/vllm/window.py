"""The window cache: where a policy's full-precision window and pending key groups live inside vLLM.

A policy with a recent window (``residual``: KIVI, ``Policy.fp8()``) or per-channel key groups (KIVI keys) keeps
each sequence's newest positions in full precision beside its packed pages (``kvcompile.pages``, "a window of
full-precision tokens"). vLLM gives a request pages and nothing else, so those positions live in pages too: each
such attention layer gets a companion, ``<layer>.kvcompile_window``, that vLLM sees as a sliding-window attention
layer -- a ``SlidingWindowSpec`` of the window's length, full precision -- and so manages as it manages Gemma's or
Mistral's windowed layers: its own cache group and block table, pages allocated as a request grows and freed
behind its window, shared through the prefix cache (a cached prefix brings its window's pages) and recomputed
after preemption, all from vLLM's one pool of memory and counted in its capacity. The companion never runs:
its attention layer writes and reads both caches (``pages.store_windowed``, ``pages.attention_windowed``).

vLLM keeps the groups of one pool in pages of one size: the window's page is padded to the packed page
(``page_size_padded``), holding as many tokens as fit (a multiple of what the backend's kernels take).
"""
from __future__ import annotations

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from .backend import KVCompileImpl
from .config import refuse

SUFFIX = ".kvcompile_window"


def window_block(layout, backend) -> int:
    """Tokens in one window page: the most whose keys and values in full precision fit one packed page, a multiple
    of the block the backend's kernels take (its ``MultipleOf``, else 16). A packed page too small for even that
    is refused, naming the block size that would fit."""
    bases = [s.base for s in backend.get_supported_kernel_block_sizes() if isinstance(s, MultipleOf)] or [16]
    base = max(bases)
    per_token = layout.window_page_bytes(1)
    fit = layout.page_bytes // per_token // base * base
    if fit < base:
        need = -(-base * per_token // (layout.heads * layout.token_head_bytes))
        need = 1 << (need - 1).bit_length()
        refuse(f"{layout.policy} keeps a full-precision window in pages the size of its packed pages, and a packed "
               f"page of {layout.block} tokens ({layout.page_bytes} bytes) holds fewer than {base} tokens of it",
               f"start vLLM with block_size={need} (--block-size {need}) or larger")
    return fit


class WindowLayer(AttentionLayerBase):
    """vLLM's view of one attention layer's window cache: a sliding-window layer that never runs (module
    docstring). ``owner``: vLLM's ``Attention`` whose implementation is kvcompile's with a windowed layout."""

    def __init__(self, owner):
        self.owner = owner
        self.layer_name = owner.layer_name + SUFFIX
        self.num_heads = owner.impl.num_heads
        self.kv_cache = None
        self.block = window_block(owner.impl.layout, owner.get_attn_backend())

    def get_attn_backend(self):
        return self.owner.get_attn_backend()

    def get_kv_cache_spec(self, vllm_config):
        lay = self.owner.impl.layout
        return SlidingWindowSpec(block_size=self.block, num_kv_heads=lay.heads, head_size=lay.head_dim,
                                 dtype=vllm_config.model_config.dtype, sliding_window=lay.window_tokens,
                                 page_size_padded=lay.page_bytes)


def attach(layer) -> None:
    """Give ``layer`` (an ``Attention`` just built) its window cache when its layout keeps a window."""
    impl = getattr(layer, "impl", None)
    if not isinstance(impl, KVCompileImpl) or impl.layout is None or not impl.layout.window:
        return
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    window = WindowLayer(layer)
    if window.layer_name in ctx:
        raise ValueError(f"Duplicate layer name: {window.layer_name}")
    ctx[window.layer_name] = window
    impl.window = window
