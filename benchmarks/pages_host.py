"""Host time of a prompt's attention through the pages (vLLM's path) with the Triton launchers, kernels not run.

Through vLLM (``kvcompile.pages``) every query of a prompt is a decode row of the row-invariant kernel; on a GPU
the host prepares each layer's calls (rows, lengths, tables, runs of one sequence's rows) while the device runs
the previous ones, and a host sync makes it wait instead. This times that host work on any machine: the Triton
launchers run as on a GPU (``TRITON_INTERPRET=1`` lets ``set_kernels("triton")`` take CPU tensors) with the
kernel launches replaced by a counter, so what is timed is Python and the small tensor ops that prepare the
calls -- on a GPU the latter are asynchronous kernels, here they run on the CPU, so the numbers are an upper
bound. A step's first layer makes the calls' plan (``Ragged.plans``), the other layers reuse it.

    python benchmarks/pages_host.py [--tokens 4096] [--layers 8] [--policy int4]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvcompile: the Triton launchers accept CPU tensors

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvcompile import Policy, Quant, ops  # noqa: E402
from kvcompile import pages as P  # noqa: E402
from kvcompile.templates import decode  # noqa: E402

# per-token formats, every position packed (as in benchmarks/gpu_kernels.py's table)
POLICIES = {f: Policy(Quant(q, "token"), Quant(q, "token"), residual=0)
            for f, q in [("fp8", "fp8_e4m3"), ("int8", "int8"), ("int4", "int4"), ("int2", "int2")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--policy", default="int4", choices=["fp8", "int8", "int4", "int2"])
    args = ap.parse_args()
    H, Hq, D, T, BS = args.kv_heads, args.heads, args.head_dim, args.tokens, 16
    lay = P.PageLayout(POLICIES[args.policy], H, D, "bfloat16", BS)
    n_pages = T // BS + 1
    raw = torch.zeros(n_pages * lay.page_bytes, dtype=torch.int8)
    C = lay.token_head_bytes
    pages = raw.as_strided((n_pages, H, BS, C), (lay.page_bytes, BS * C, C, 1))
    table = torch.arange(n_pages, dtype=torch.int32)[None]
    launches = []
    decode.run = lambda kernel, grid, args, **kw: launches.append(kernel.__name__)
    ops.set_kernels("triton")
    q = torch.randn(T, Hq, D).bfloat16()
    batch = P.Ragged.of(torch.tensor([0, T]), torch.tensor([T]), table)
    times = []
    for _ in tqdm(range(args.layers), desc="layers", leave=False):
        t = time.perf_counter()
        P.attention_ragged(lay, pages, q, None, None, batch)
        times.append(time.perf_counter() - t)
    per_layer = len(launches) // args.layers
    rest = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else float("nan")
    g = torch.tensor([0, T], dtype=torch.int32)
    stops = torch.arange(1, T + 1)
    t = time.perf_counter()
    for _ in range(20):
        decode.run_offsets(g, stops, 4, 0, 256)
    cut = (time.perf_counter() - t) / 20
    print(f"{T}-token prompt, {args.policy}, {Hq} query / {H} KV heads, head_dim {D}: "
          f"{per_layer} launches a layer (decode and merge; calls: {per_layer // 2})")
    print("| layer | host ms |\n|---|---:|")
    print(f"| first (makes the step's plan) | {times[0] * 1e3:.1f} |")
    print(f"| the others (median of {len(times) - 1}) | {rest * 1e3:.1f} |")
    print(f"runs cut for {T} rows (decode.run_offsets): {cut * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
