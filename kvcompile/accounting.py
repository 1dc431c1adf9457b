"""Exact memory accounting: bytes per cached token for a model shape and a policy, everything included."""
from __future__ import annotations

import torch

from .policy import Policy
from .store import DTYPE_NAMES, DTYPES, LayerSpec


def cache_bytes(policy: Policy, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                batch: int = 1, dtype=torch.bfloat16, layer_names=None) -> int:
    """Bytes the whole model's quantized cache holds when each of ``batch`` sequences holds ``capacity``
    tokens: packed blocks (whole blocks), scales, zero points, residual, sinks, lengths, block tables.

    ``policy`` may carry per-layer overrides; layers are named ``layers.<i>`` unless ``layer_names`` is given.
    """
    names = layer_names or [f"layers.{i}" for i in range(num_layers)]
    dt = DTYPE_NAMES[dtype] if isinstance(dtype, torch.dtype) else dtype
    return sum(LayerSpec(p, kv_heads, head_dim, dt).nbytes(batch, capacity) for p in policy.resolve(names))


def bytes_per_token(policy: Policy, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 8192,
                    batch: int = 1, dtype=torch.bfloat16, layer_names=None) -> float:
    """Exact bytes per cached token of a sequence of ``capacity`` tokens (scales and residual included).

    The fixed per-sequence parts (full-precision residual window, sinks) are spread over ``capacity``,
    so the number depends on it; ``cache_bytes(...) / (batch * capacity)``.
    """
    return cache_bytes(policy, num_layers, kv_heads, head_dim, capacity, batch, dtype, layer_names) / (
        batch * capacity)


def full_precision_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> int:
    """Bytes per token of a plain full-precision cache (keys and values); ``dtype`` a torch dtype or its name.
    The one place this is written."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dt).element_size()
