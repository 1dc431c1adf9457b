"""What a prompt's rotation costs beside its attention over the pages, per layer, side by side in one run.

    python benchmarks/rotation_cost.py [--requests 8] [--tokens 256]

SmolLM2's layer (3 kv heads, 9 query heads, head_dim 64, float32), ``--requests`` prompts of ``--tokens`` tokens in
pages of 128: the plugin's store (``kvcompile.pages.store_ragged``) and attention (``attention_ragged``, every query
its own decode row) under ``fp8-r0``, ``fp8-tensor`` and ``fp8-tensor+rot``; and the rotation of the keys and
values a rotating policy stores (the store's ``kvcompile.store._rotate``: the C kernel ``templates.cpu_rotate``),
beside the pure-torch specification (``rotate_reference``: the transform in float64) and the float64 matrix
product that computed it until 2026-12-06 (``(x @ S) / sqrt(block)``, then saturated). Milliseconds per call, the
mean of three after a warm-up.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompile import pages as P  # noqa: E402
from kvcompile.presets import named  # noqa: E402
from kvcompile import quant as Q  # noqa: E402
from kvcompile.store import _rotate, _signs_cpu, rotate_reference  # noqa: E402

H, HQ, D = 3, 9, 64
POLICIES = ["fp8-r0", "fp8-tensor", "fp8-tensor+rot"]


def ms(fn, reps: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    B, T = args.requests, args.tokens
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B * T, H, D, generator=g), torch.randn(B * T, H, D, generator=g)
    q = torch.randn(B * T, HQ, D, generator=g)
    per = -(-T // 128)
    table = torch.arange(B * per, dtype=torch.int32).view(B, per)
    batch = P.Ragged.of(torch.arange(0, B * T + 1, T, dtype=torch.int32), torch.full((B,), T, dtype=torch.int32),
                        table)
    out = {}
    for name in POLICIES:
        lay = P.PageLayout(named(name), H, D, "float32", 128)
        buf = torch.zeros(B * per, lay.page_bytes, dtype=torch.uint8)
        out[name] = {"store_ms": ms(lambda: P.store_ragged(lay, buf, k, v, batch)),
                     "attention_ms": ms(lambda: P.attention_ragged(lay, buf, q, None, None, batch))}
        print(f"{name:16s} store {out[name]['store_ms']:7.1f} ms   attention {out[name]['attention_ms']:7.1f} ms")
    matmul = lambda x: Q.saturate((x.double() @ _signs_cpu(D)) * (1 / D ** 0.5), x.dtype)  # noqa: E731 (D = 64)
    out["rotations_ms"] = {name: ms(lambda: (f(k), f(v))) for name, f in
                           (("kernel", _rotate), ("reference", rotate_reference), ("float64 matmul", matmul))}
    print("rotating the keys and values: " + ", ".join(f"{n} {t:.1f} ms" for n, t in out["rotations_ms"].items()))
    return out


if __name__ == "__main__":
    main()
