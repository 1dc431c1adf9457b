"""Host time of a prompt's attention through the pages (vLLM's path) with the Triton launchers, kernels not run.

Through vLLM (``kvcompile.pages``) every query of a prompt is a decode row of the row-invariant kernel; on a GPU
the host prepares each layer's calls (rows, lengths, tables, runs of one sequence's rows) while the device runs
the previous ones, and a host sync makes it wait instead. This times that host work on any machine: the Triton
launchers run as on a GPU (``TRITON_INTERPRET=1`` lets ``set_kernels("triton")`` take CPU tensors) with the
kernel launches replaced by a counter, so what is timed is Python and the small tensor ops that prepare the
calls -- on a GPU the latter are asynchronous kernels, here they run on the CPU, so the numbers are an upper
bound. A step's first layer makes the calls' plan (``Ragged.plans``), the other layers reuse it.

``--decode B``: instead of a prompt, a decode step of B sequences of ``--tokens + 1`` to ``--tokens + B``
positions (lengths apart, as a serving batch's: a few complete a key group and pack), under a KIVI policy with its
window cache (``--policy kivi4`` / ``kivi2``: ``store_windowed`` then ``attention_windowed``, the
path every decode step of a windowed layout takes through vLLM; ``--ring``: the window cache as a ring).

    python benchmarks/pages_host.py [--tokens 4096] [--layers 8] [--policy int4]
    python benchmarks/pages_host.py --decode 64 --tokens 4096 --policy kivi4
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
from kvcompile.templates import attention, decode, store  # noqa: E402

# per-token formats, every position packed (as in benchmarks/gpu_kernels.py's table)
POLICIES = {f: Policy(Quant(q, "token"), Quant(q, "token"), residual=0)
            for f, q in [("fp8", "fp8_e4m3"), ("int8", "int8"), ("int4", "int4"), ("int2", "int2")]}
WINDOWED = {"kivi4": Policy.kivi(4), "kivi2": Policy.kivi(2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--policy", default="int4", choices=[*POLICIES, *WINDOWED])
    ap.add_argument("--decode", type=int, default=0, metavar="B",
                    help="time a decode step of B sequences of about --tokens positions (a KIVI --policy)")
    ap.add_argument("--ring", action="store_true", help="with --decode: the window cache as a ring")
    args = ap.parse_args()
    H, Hq, D, T, BS = args.kv_heads, args.heads, args.head_dim, args.tokens, 16
    launches = []
    for module in (decode, attention, store):  # every Triton launcher: counted, not run
        module.run = lambda kernel, grid, args, **kw: launches.append(kernel.__name__)
    ops.set_kernels("triton")
    if args.decode:
        return decode_step(args, launches)
    if args.policy not in POLICIES:
        ap.error(f"--policy {args.policy} takes --decode (a prompt times the per-token policies)")
    lay = P.PageLayout(POLICIES[args.policy], H, D, "bfloat16", BS)
    n_pages = T // BS + 1
    pages = _pages(lay, n_pages)
    table = torch.arange(n_pages, dtype=torch.int32)[None]
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


def _pages(lay, n_pages):
    """An engine's pages for one layer: ``[pages, heads, block, C]`` int8."""
    C = lay.token_head_bytes
    raw = torch.zeros(n_pages * lay.page_bytes, dtype=torch.int8)
    return raw.as_strided((n_pages, lay.heads, lay.block, C), (lay.page_bytes, lay.block * C, C, 1))


def decode_step(args, launches) -> None:
    """One decode step (a token for each of ``args.decode`` sequences holding ``args.tokens`` positions or a few
    more) through a windowed layout's store and attention, layer after layer."""
    if args.policy not in WINDOWED:
        raise SystemExit(f"--decode times a windowed (KIVI) policy: {', '.join(WINDOWED)}")
    H, Hq, D, L, B, BS = args.kv_heads, args.heads, args.head_dim, args.tokens, args.decode, 128
    lay = P.PageLayout(WINDOWED[args.policy], H, D, "bfloat16", BS, window=True)
    per = -(-(L + B) // BS)
    pages = _pages(lay, B * per + 1)
    table = torch.arange(1, B * per + 1, dtype=torch.int32).view(B, per)
    wblock = -(-lay.window_tokens // 16) * 16 if args.ring else 32
    wper = 1 if args.ring else -(-(L + B) // wblock)
    es = 2
    per_page = lay.window_page_bytes(wblock) // es
    window = torch.zeros((B * wper + 1) * per_page, dtype=torch.bfloat16).as_strided(
        (B * wper + 1, H, wblock, 2 * D), (per_page, wblock * 2 * D, 2 * D, 1))
    wtable = torch.arange(1, B * wper + 1, dtype=torch.int32).view(B, wper)
    qs, seq = torch.arange(B + 1), L + 1 + torch.arange(B)  # lengths apart: a few complete a group each step
    k, v, q = torch.randn(B, H, D).bfloat16(), torch.randn(B, H, D).bfloat16(), torch.randn(B, Hq, D).bfloat16()
    # a step before the timed one, so that the launchers' first calls are not the first layer's time
    warm = P.store_windowed(lay, pages, window, wblock, k, v, P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable),
                            ring=args.ring, null_page=0)
    P.attention_windowed(lay, pages, q, P.Ragged.of(qs, seq, table), warm, 0.125)
    del launches[:]
    batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
    times = []
    for _ in tqdm(range(args.layers), desc="layers", leave=False):
        t = time.perf_counter()
        recent = P.store_windowed(lay, pages, window, wblock, k, v, batch, wbatch, ring=args.ring, null_page=0)
        P.attention_windowed(lay, pages, q, batch, recent, 0.125)
        times.append(time.perf_counter() - t)
    per_layer = len(launches) // args.layers
    rest = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else float("nan")
    print(f"decode step of {B} sequences at {L + 1}-{L + B} positions, {args.policy} ({'ring' if args.ring else 'window'} "
          f"cache of {wblock}-token pages), {Hq} query / {H} KV heads, head_dim {D}: {per_layer} launches a layer")
    print("| layer | host ms |\n|---|---:|")
    print(f"| first (makes the step's plan) | {times[0] * 1e3:.2f} |")
    print(f"| the others (median of {len(times) - 1}) | {rest * 1e3:.2f} |")


if __name__ == "__main__":
    main()
