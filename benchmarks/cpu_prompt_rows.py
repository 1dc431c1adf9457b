"""A prompt's queries as decode rows of their own positions, through the C kernel: each row alone against the rows
of one sequence sharing their packed tiles (``groups``: ``kvc_attention_rows``), one layer.

    python benchmarks/cpu_prompt_rows.py                        # SmolLM2's layer, bf16, prompts of 1K and 4K
    python benchmarks/cpu_prompt_rows.py --smoke                # tiny, seconds (run by the tests)
    python benchmarks/cpu_prompt_rows.py --base HEAD --shape gemma3 # shared tiles: the template at HEAD vs now

This is how the vLLM plugin's pages compute a prompt (``kvcompile.pages``: a token's attention is the same bits
however vLLM cut the work), so its attention reads every position once for each query. A store of one sequence
(random keys with an outlier channel and values, the C store kernel, pages of 128 tokens) is read by P rows, row
``p`` over positions ``[0, p]`` with its own ring (the sequence's, copied). Both ways give the same bits (checked
before timing). Times: the median of ``--repeats`` calls, taken in turn.

With ``--base REV`` (or ``--base-file``) both columns share their tiles: the template at git revision ``REV``
against the working tree's (``benchmarks/cpu_kernel_ab.py``'s way of judging a change; the same bits checked
first). ``--shape``: the layer's kv heads x query heads per kv head x head_dim, SmolLM2's (3 x 3 x 64) or Gemma 3
1B's (1 x 4 x 256).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_kernel_ab import template_at  # noqa: E402
from benchmarks.cpu_kernels import random_layer  # noqa: E402
from kvcompile.presets import named  # noqa: E402
from kvcompile.store import LayerSpec  # noqa: E402
from kvcompile.templates import cpu, cpu_store  # noqa: E402

POLICIES = ["int8", "tok+rot:4", "kivi-r0+rot+fp8s:4"]


SHAPES = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256)}  # kv heads, query heads per kv head, head_dim


def rows_of(spec: LayerSpec, P: int, dtype: torch.dtype, g, G: int = 3):
    """(queries [P, H*G, 1, D], the state P rows read, the runs): row p is position p of one sequence."""
    H, D = spec.heads, spec.head_dim
    q, k, v = random_layer(1, H, G, D, P, g)
    st = spec.allocate(1, P)
    cpu_store.store(st, spec, k.to(dtype), v.to(dtype))
    one = torch.zeros(P, dtype=torch.long)
    rows = type(st)(*st[:6], *(t.index_select(0, one) for t in st[6:]))
    rows = rows._replace(lengths=torch.arange(1, P + 1, dtype=torch.int32))
    q = torch.randn(P, H * G, 1, D, generator=g).to(dtype)
    return q, rows, torch.tensor([0, P], dtype=torch.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--base", help="a git revision: its template's shared tiles against the working tree's")
    ap.add_argument("--base-file", type=Path, help="a template file as the base instead")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    a = ap.parse_args(argv)
    if a.smoke:
        a.prompts, a.repeats = [200], 1
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    H, G, D = SHAPES[a.shape]
    tmp = tempfile.TemporaryDirectory()
    base = a.base_file or (template_at(a.base, Path(tmp.name)) if a.base else None)
    label = (a.base or a.base_file.name) if base else "rows alone"  # what the first column times
    print(f"{'policy':<22}{'prompt':>8}{label + ' (ms)':>17}{'shared tiles (ms)':>19}{'x':>7}")

    def before(q, st, spec, runs):
        if base is None:
            return cpu.attention(q, st, spec, None, None)
        return cpu.attention(q, st, spec, None, None, groups=runs, source=base)
    out = []
    for P in a.prompts:
        for name in POLICIES:
            spec = LayerSpec(named(name), H, D, a.dtype, 128)
            spec.register()
            q, st, runs = rows_of(spec, P, dtype, g, G)
            alone = before(q, st, spec, runs)
            shared = cpu.attention(q, st, spec, None, None, groups=runs)
            if not (torch.equal(alone.nan_to_num(), shared.nan_to_num()) and torch.equal(alone.isnan(), shared.isnan())):
                raise AssertionError(f"{name}: rows sharing their tiles got other bits than {label} at {P} rows")
            ta, tb = [], []
            for _ in range(a.repeats):
                t = time.perf_counter()
                before(q, st, spec, runs)
                ta.append(time.perf_counter() - t)
                t = time.perf_counter()
                cpu.attention(q, st, spec, None, None, groups=runs)
                tb.append(time.perf_counter() - t)
            ma, mb = statistics.median(ta), statistics.median(tb)
            print(f"{name:<22}{P:>8}{ma * 1e3:>17.1f}{mb * 1e3:>19.1f}{ma / mb:>7.2f}", flush=True)
            out.append({"policy": name, "prompt": P, "shape": a.shape, "base": label if base else None,
                        "alone_ms": ma * 1e3, "shared_ms": mb * 1e3})
    return out


if __name__ == "__main__":
    main()
