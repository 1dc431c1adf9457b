"""A prompt's queries as decode rows of their own positions, through the C kernel: each row alone against the rows
of one sequence sharing their packed tiles (``groups``: ``kvc_attention_rows``), one layer.

    python benchmarks/cpu_prompt_rows.py                        # SmolLM2's layer, bf16, prompts of 1K and 4K
    python benchmarks/cpu_prompt_rows.py --smoke                # tiny, seconds (run by the tests)

This is how the vLLM plugin's pages compute a prompt (``kvcompile.pages``: a token's attention is the same bits
however vLLM cut the work), so its attention reads every position once for each query. A store of one sequence
(random keys with an outlier channel and values, the C store kernel, pages of 128 tokens) is read by P rows, row
``p`` over positions ``[0, p]`` with its own ring (the sequence's, copied). Both ways give the same bits (checked
before timing). Times: the median of ``--repeats`` calls, taken in turn.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_kernels import random_layer  # noqa: E402
from kvcompile.presets import named  # noqa: E402
from kvcompile.store import LayerSpec  # noqa: E402
from kvcompile.templates import cpu, cpu_store  # noqa: E402

POLICIES = ["int8", "tok+rot:4", "kivi-r0+rot+fp8s:4"]


def rows_of(spec: LayerSpec, P: int, dtype: torch.dtype, g):
    """(queries [P, H*G, 1, D], the state P rows read, the runs): row p is position p of one sequence."""
    H, D = spec.heads, spec.head_dim
    q, k, v = random_layer(1, H, 3, D, P, g)
    st = spec.allocate(1, P)
    cpu_store.store(st, spec, k.to(dtype), v.to(dtype))
    one = torch.zeros(P, dtype=torch.long)
    rows = type(st)(*st[:6], *(t.index_select(0, one) for t in st[6:]))
    rows = rows._replace(lengths=torch.arange(1, P + 1, dtype=torch.int32))
    q = torch.randn(P, H * 3, 1, D, generator=g).to(dtype)
    return q, rows, torch.tensor([0, P], dtype=torch.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.prompts, a.repeats = [200], 1
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"{'policy':<22}{'prompt':>8}{'rows alone (ms)':>17}{'shared tiles (ms)':>19}{'x':>7}")
    out = []
    for P in a.prompts:
        for name in POLICIES:
            spec = LayerSpec(named(name), 3, 64, a.dtype, 128)
            spec.register()
            q, st, runs = rows_of(spec, P, dtype, g)
            alone = cpu.attention(q, st, spec, None, None)
            shared = cpu.attention(q, st, spec, None, None, groups=runs)
            if not (torch.equal(alone.nan_to_num(), shared.nan_to_num()) and torch.equal(alone.isnan(), shared.isnan())):
                raise AssertionError(f"{name}: rows sharing their tiles got other bits than alone at {P} rows")
            ta, tb = [], []
            for _ in range(a.repeats):
                t = time.perf_counter()
                cpu.attention(q, st, spec, None, None)
                ta.append(time.perf_counter() - t)
                t = time.perf_counter()
                cpu.attention(q, st, spec, None, None, groups=runs)
                tb.append(time.perf_counter() - t)
            ma, mb = statistics.median(ta), statistics.median(tb)
            print(f"{name:<22}{P:>8}{ma * 1e3:>17.1f}{mb * 1e3:>19.1f}{ma / mb:>7.2f}", flush=True)
            out.append({"policy": name, "prompt": P, "alone_ms": ma * 1e3, "shared_ms": mb * 1e3})
    return out


if __name__ == "__main__":
    main()
