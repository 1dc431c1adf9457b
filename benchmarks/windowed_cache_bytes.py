"""Cache bytes of a model with sliding-window layers: transformers' StaticCache, kvcompile's cache, and what
kvcompile's cache would hold with every layer as a packed store (the behaviour before sliding-window layers
kept transformers' ring). Bytes are what the caches hold once one sequence has ``context`` tokens: the
StaticCache's allocated tensors, kvcompile's stores filled with that many tokens (its rings are allocated
whole); no weights are loaded.

    python benchmarks/windowed_cache_bytes.py                    # Gemma-3-1B-shaped: 26 layers, 22 sliding (512)
    python benchmarks/windowed_cache_bytes.py --contexts 1024    # the test suite runs this
"""
from __future__ import annotations

import argparse

import torch
import transformers
from transformers.cache_utils import StaticCache

from kvcompile import Policy, cache_bytes
from kvcompile.hf import KVCompileCache, KVCompileLayer

POLICIES = {"int8": Policy.int8(), "fp8": Policy.fp8(), "KIVI int4": Policy.kivi(4), "KIVI int2": Policy.kivi(2)}


def gemma3_1b_shape() -> transformers.PretrainedConfig:
    """Gemma 3 1B's attention geometry (layers, heads, head_dim, window, layer pattern); sizes that do not
    shape the cache are left at their defaults."""
    return transformers.Gemma3TextConfig(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, hidden_size=1152, sliding_window=512,
                                         max_position_embeddings=32768)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    args = ap.parse_args(argv)
    cfg = gemma3_1b_shape()
    n = cfg.num_hidden_layers
    sliding = cfg.layer_types.count("sliding_attention")
    print(f"Gemma-3-1B-shaped cache ({n} layers, {sliding} with a {cfg.sliding_window}-token window, 1 kv head x "
          f"256, bf16), one sequence, MiB:")
    print(f"{'context':>7} {'policy':<10} {'StaticCache':>11} {'kvcompile':>10} {'x':>6} {'all stores':>10} {'x':>6}")
    rows = []
    for C in args.contexts:
        static = StaticCache(config=cfg, max_cache_len=C)
        static.early_initialization(1, 1, 256, torch.bfloat16, "cpu")
        native = sum(layer.keys.nbytes + layer.values.nbytes for layer in static.layers)
        del static
        for name, policy in POLICIES.items():
            ours = KVCompileCache(cfg, policy, C, batch_size=1, dtype=torch.bfloat16)
            x = torch.randn(1, 1, C, 256, dtype=torch.bfloat16)
            for layer in ours.layers:
                if isinstance(layer, KVCompileLayer):  # a store holds what it was given: a whole sequence
                    layer.update(x, x)
            stores = cache_bytes(policy, n, 1, 256, C, dtype=torch.bfloat16)
            rows.append(dict(context=C, policy=name, static=native, kvcompile=ours.nbytes, all_stores=stores,
                             rings=len(ours.rings)))
            print(f"{C:>7} {name:<10} {native / 2**20:>11.1f} {ours.nbytes / 2**20:>10.1f} "
                  f"{ours.nbytes / native:>5.2f}x {stores / 2**20:>10.1f} {stores / native:>5.2f}x")
            del ours
    return rows


if __name__ == "__main__":
    main()
