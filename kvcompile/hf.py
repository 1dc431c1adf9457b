"""Hugging Face transformers integration: a Cache whose layers are kvcompile stores.

``KVCompileCache`` is a drop-in ``transformers.Cache`` (static: preallocated to ``max_cache_len``). Each layer
holds a packed ``KVState``; no full-precision tensor of full capacity is allocated.

Eager mode (no torch.compile), ``update`` appends through ``torch.ops.kvcompile.store`` and returns the
dequantized cache (``torch.ops.kvcompile.dequantize``) for the model's own attention to read: the exact
numerics of the policy, at the cost of materializing the full-precision view every step (this is what the
reference path and the quality evaluation use). Under ``kvcompile.apply`` the FX pass replaces that read by
the fused attention op, so the view is never built.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

from . import ops  # noqa: F401  (registers torch.ops.kvcompile)
from .policy import Policy
from .store import DTYPE_NAMES, KVState, LayerSpec, state_nbytes


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_shape(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers config."""
    c = _text_config(config)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, kv, hd


class KVCompileLayer(StaticLayer):
    """One decoder layer's quantized cache, with StaticLayer's interface (``max_cache_len`` slots)."""

    def __init__(self, max_cache_len: int, policy: Policy, name: str = ""):
        super().__init__(max_cache_len=max_cache_len)
        self.policy = policy
        self.name = name
        self.spec: LayerSpec | None = None
        self.state: KVState | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads, _, self.k_head_dim = key_states.shape
        self.v_head_dim = value_states.shape[-1]
        if self.v_head_dim != self.k_head_dim:
            raise NotImplementedError(
                f"kvcompile needs keys and values of the same head_dim; layer {self.name!r} has "
                f"{self.k_head_dim} and {self.v_head_dim}")
        self.spec = LayerSpec(self.policy, self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim,
                              DTYPE_NAMES[key_states.dtype])
        self.spec_name = self.spec.register()
        self.state = self.spec.allocate(self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        pos = torch.arange(n, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        torch.ops.kvcompile.store(list(self.state), key_states, value_states, pos, self.spec_name)
        return torch.ops.kvcompile.dequantize(list(self.state), self.spec_name)

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.state:
                t.zero_()
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a kvcompile cache is append-only: it cannot be cropped (quantized tokens "
                                  "cannot be un-quantized); reset() it and prefill again")

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state) if self.is_initialized else 0


class KVCompileCache(Cache):
    """A transformers Cache storing every layer per ``policy`` (per-layer overrides resolved by layer name).

    >>> cache = KVCompileCache(model.config, Policy.kivi(4), max_cache_len=4096)
    >>> out = model(input_ids, past_key_values=cache, use_cache=True)
    >>> cache.nbytes        # bytes the cache really holds
    """

    def __init__(self, config, policy: Policy, max_cache_len: int, layer_names: list[str] | None = None):
        n_layers, _, head_dim = model_shape(config)
        names = layer_names or [f"model.layers.{i}.self_attn" for i in range(n_layers)]
        policy.check(head_dim)
        self.policies = policy.resolve(names)
        layers = [KVCompileLayer(max_cache_len, p, n) for p, n in zip(self.policies, names)]
        super().__init__(layers=layers)
        self.policy = policy
        self.max_cache_len = max_cache_len

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's store (codes, scales, zero points, residual, sinks, lengths)."""
        return sum(layer.nbytes for layer in self.layers)
