"""Decode-attention kernels on a GPU: correctness first, then time / bandwidth / speedup against bf16 SDPA.

    python benchmarks/gpu_kernels.py            # on a CUDA machine (H200: about 2-3 minutes)
    python benchmarks/gpu_kernels.py --record   # ... and put the run on top of docs/results.md
    python benchmarks/gpu_kernels.py --smoke    # tiny sizes; on a machine without CUDA through TRITON_INTERPRET=1

1. Correctness on the device: for every benchmarked format (and a few more layouts), over blocks of 16 tokens
   handed out in a scrambled order, the store kernels must equal ``store_reference`` bit for bit and the
   attention kernel must be within the derived bound of float64 attention
   (``templates.attention.reference_and_bound``, with tf32 operands). Any failure stops the run.
2. Timing: decode attention (one query token, 32 query heads over 8 KV heads, head_dim 128) at batch 1/8/32 and
   context 4K/32K/128K for fp8, int8, int4, int2 and bf16 ``F.scaled_dot_product_attention`` (the first of the
   flash / efficient / cuDNN / math backends that accepts GQA) on the same lengths. Times are triton's
   ``do_bench_cudagraph`` medians (a CUDA graph per call, so the numbers are the GPU's, not Python's launch
   overhead). GB/s is over the bytes the call actually moves: every byte of the store (every sequence holds the
   context in whole blocks, its block table a random permutation of the pool: codes, scales, zero points, block
   table, ring, sinks), the query, the output and the split-K workspace
   (written, then read). Speedup is bf16 SDPA time / kernel time.
3. Growth with context: each kernel's time per 1K tokens of context (4K to 128K) against bf16 SDPA's, beside
   its bytes against bf16's (the target: a slope proportional to the cache's bytes).
4. Tile length: at batch 8, 32K, the decode time of KIVI int4/int2, int4 and fp8 at BLOCK_N 16, 32 and 64
   against the launcher's default (static SASS says the default KIVI tile spills registers under Triton 3.6).
"""
import argparse
import datetime
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the kernels run through Triton's interpreter: must be set before they exist
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kvcompile import Policy, Quant  # noqa: E402
from kvcompile.store import KVStore, LayerSpec, state_nbytes  # noqa: E402
from kvcompile.templates import attention as kattn  # noqa: E402
from kvcompile.templates import launch  # noqa: E402

FORMATS = {  # name -> policy; every position packed (no residual, no sinks) so the table measures the kernel
    "fp8": Policy(Quant("fp8_e4m3", "token"), Quant("fp8_e4m3", "token")),
    "int8": Policy(Quant("int8", "token"), Quant("int8", "token")),
    "int4": Policy(Quant("int4", "token"), Quant("int4", "token")),
    "int2": Policy(Quant("int2", "token"), Quant("int2", "token")),
    "int4-kivi": Policy.kivi(4, group=32, residual=0),  # per-channel keys, 32-groups: 1 bit/elem of scales
    "int2-kivi": Policy.kivi(2, group=32, residual=0),
}
TARGET_SPEEDUP_32K = {"fp8": 1.9, "int8": 1.9, "int4": 3.5, "int2": 6.0}
NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


# --------------------------------------------------------------------------- 1. correctness
def check_correctness(device: str, B: int, H: int, G: int, D: int, C: int, names=None) -> list[str]:
    """Store exactness and attention bound for each format (or ``names``); returns a line per layout."""
    dot = launch.dot_precision(torch.device(device))
    extra = {
        "kivi4+res+sink+rot": Policy.kivi(4, group=16, residual=8, sink=2, rotate=True),
        "fp8e5m2/int3": Policy(Quant("fp8_e5m2", "token"), Quant("int3", "channel", 8), residual=3),
    }
    lines = []
    g = torch.Generator().manual_seed(0)
    lengths = [C, C * 2 // 3 + 1][:B] + [C // 3] * max(0, B - 2)
    for name, policy in {**FORMATS, **extra}.items():
        if names is not None and name not in names:
            continue
        # blocks of 16 packed tokens handed out in a scrambled order: the kernels must follow the block table
        spec = LayerSpec(policy, H, D, "bfloat16", max(16, policy.flush))
        ref = KVStore(spec, B, blocks=B * (spec.blocks_for(C) + 1))
        ref.free = [ref.free[i] for i in torch.randperm(len(ref.free), generator=g).tolist()]
        got = ref.copy(device)
        L = 0
        for n in (C // 2, 1, 1, C - C // 2 - 2):  # prefill, decode, decode, chunk
            k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
            n_new = torch.tensor([max(0, min(n, x - L)) for x in lengths], dtype=torch.int32)
            ref.append(k, v, n_new)
            got.append(k.to(device), v.to(device), n_new, kernel=launch.store)
            L += n
            for field, a, b in zip(ref.state._fields, ref.state, got.state):
                if field in ("k_res", "v_res"):
                    continue  # dead ring slots are unspecified; they are read back through attention below
                if not torch.equal(a, b.cpu()):
                    raise SystemExit(f"FAIL store {name}: {field} differs from the reference after {L} tokens")
            for nq in (1, 4):
                q = torch.randn(B, H * G, nq, D, generator=g).to(torch.bfloat16)
                out = launch.attention(q.to(device), got.state, spec).cpu()
                nsplit = kattn.default_tiles(spec, nq, G, torch.device(device), B,
                                             kattn.position_bound(got.state, spec, None))[2]
                want, bound = kattn.reference_and_bound(q, ref.state, spec, nsplit=nsplit, dot=dot)
                err = (out.double() - want).abs()
                if (err > bound).any():
                    raise SystemExit(f"FAIL attention {name} n={nq} after {L} tokens: max error {err.max():.3g}, "
                                     f"{int((err > bound).sum())} outputs outside the derived bound")
        lines.append(f"ok  {name:20s} store exact, attention within bound ({spec.policy.key_str()})")
    return lines


# --------------------------------------------------------------------------- 2. timing
def filled_state(spec: LayerSpec, device: str, B: int, L: int):
    """A store of ``B`` sequences holding L tokens each, of random (finite) codes: timing does not depend on
    the values. Each sequence's blocks are a random permutation of the pool's (as a serving pool's would be
    after many requests), so the timing includes following the block table."""
    state = spec.allocate(B, L, device)
    state.table.copy_(torch.randperm(state.table.numel(), device=device).view_as(state.table).to(torch.int32))
    for t in state[:6]:
        if t.numel() == 0:
            continue
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 119, t.shape, dtype=torch.uint8, device=device))  # < 0x77: finite fp8
        else:
            t.fill_(0.01)
    for t in state[6:10]:
        if t.numel():
            t.normal_()
    state.lengths.fill_(L)
    return state


def bench(fn, smoke: bool) -> float:
    """Median milliseconds of fn()."""
    fn()
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing as tt
    torch.cuda.synchronize()
    try:
        return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception:  # a call that cannot be captured: time it eagerly (recorded in the table)
        return float(tt.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def sdpa_backend(q, k, v):
    """The first SDPA backend that runs GQA decode here, and a closure calling it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            fn()
            return backend.name.lower(), fn
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend accepts this GQA decode shape")


def time_table(device: str, batches, contexts, Hq: int, H: int, D: int, formats, smoke: bool):
    rows = []
    for B in batches:
        for ctx in contexts:
            q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device=device)
            k = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=device)
            v = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=device)
            backend, sdpa = sdpa_backend(q, k, v)
            t_ref = bench(sdpa, smoke)
            bytes_ref = 2 * k.numel() * 2 + 2 * q.numel() * 2
            rows.append((B, ctx, f"bf16 sdpa ({backend})", t_ref, bytes_ref, 1.0))
            del k, v
            for name in formats:
                spec = LayerSpec(FORMATS[name], H, D, "bfloat16")
                state = filled_state(spec, device, B, ctx)
                nsplit = kattn.default_tiles(spec, 1, Hq // H, torch.device(device), B,
                                             kattn.position_bound(state, spec, None))[2]
                moved = state_nbytes(state) + 2 * q.numel() * 2 + (2 * B * Hq * nsplit * (128 + 2) * 4 if nsplit > 1 else 0)
                t = bench(lambda: launch.attention(q, state, spec), smoke)
                rows.append((B, ctx, name, t, moved, t_ref / t))
                del state
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def tile_sweep(device: str, B: int, ctx: int, Hq: int, H: int, D: int, formats, blocks, smoke: bool):
    """Decode time per tile length (BLOCK_N) against the launcher's default, same shape and splits. Static
    SASS (benchmarks/gpu_sass.py) says the KIVI decode tile of 32 x 128 needs 255 registers and spills 72 B
    per thread under Triton 3.6 (none with 16 rows, none under 3.9): this measures what that costs."""
    rows = []
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device=device)
    for name in formats:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16")
        state = filled_state(spec, device, B, ctx)
        bq, default_n, nsplit = kattn.default_tiles(spec, 1, Hq // H, torch.device(device), B,
                                                    kattn.position_bound(state, spec, None))
        times = {bn: bench(lambda: launch.attention(q, state, spec, tiles=(bq, bn, nsplit)), smoke) for bn in blocks}
        if default_n not in times:  # the default is timed once, among the others when it is one of them
            times[default_n] = bench(lambda: launch.attention(q, state, spec), smoke)
        rows += [(name, bn, bn == default_n, times[bn], times[default_n] / times[bn]) for bn in blocks]
        del state
    return rows


def render_sweep(rows, B: int, ctx: int) -> str:
    out = (f"Tile length (BLOCK_N) check, batch {B}, context {f'{ctx // 1024}K' if ctx >= 1024 else ctx}:\n\n"
           "| kernel | BLOCK_N | time (ms) | default's time / this |\n|---|---:|---:|---:|\n")
    return out + "\n".join(f"| {name} | {bn}{' (default)' if d else ''} | {t:.4f} | {r:.2f}x |"
                            for name, bn, d, t, r in rows)


def render_slopes(rows) -> str:
    """Issue 6's "slope proportional to the cache's bytes", per batch: each kernel's time growth per 1K tokens
    of context between the shortest and longest context, as a multiple of bf16 SDPA's, beside its bytes as a
    multiple of bf16's (the bytes moved at the longest context)."""
    by = {(B, ctx, name): (t, nbytes) for B, ctx, name, t, nbytes, _ in rows}
    lines = ["| batch | kernel | growth (ms per 1K tokens) | x bf16's growth | bytes x bf16 |", "|---:|---|---:|---:|---:|"]
    for B in sorted({r[0] for r in rows}):
        ctxs = sorted({r[1] for r in rows if r[0] == B})
        if len(ctxs) < 2:
            continue
        lo, hi = ctxs[0], ctxs[-1]
        names = [r[2] for r in rows if r[0] == B and r[1] == hi]
        ref = next(n for n in names if n.startswith("bf16"))
        grow = {n: (by[(B, hi, n)][0] - by[(B, lo, n)][0]) / ((hi - lo) / 1024) for n in names if (B, lo, n) in by}
        for n in names:
            if n in grow:
                lines.append(f"| {B} | {n} | {grow[n]:.5f} | {grow[n] / grow[ref]:.3f} | "
                             f"{by[(B, hi, n)][1] / by[(B, hi, ref)][1]:.3f} |")
    return "Growth with context (target: a slope proportional to the bytes):\n\n" + "\n".join(lines)


def render(rows, card: str, peak_tbps: float | None) -> str:
    head = "| batch | context | kernel | time (ms) | GB moved | GB/s | % of peak | speedup vs bf16 |\n"
    head += "|---:|---:|---|---:|---:|---:|---:|---:|\n"
    lines = []
    for B, ctx, name, t, nbytes, speedup in rows:
        gbps = nbytes / (t * 1e-3) / 1e9
        peak = f"{100 * gbps / (peak_tbps * 1e3):.0f}%" if peak_tbps else "-"
        target = ""
        if ctx == 32768 and name in TARGET_SPEEDUP_32K:
            target = " (target %.1fx: %s)" % (TARGET_SPEEDUP_32K[name], "met" if speedup >= TARGET_SPEEDUP_32K[name] else "MISSED")
        lines.append(f"| {B} | {f'{ctx // 1024}K' if ctx >= 1024 else ctx} | {name} | {t:.4f} | {nbytes / 1e9:.3f} | {gbps:.0f} | {peak} | "
                     f"{speedup:.2f}x{target} |")
    return head + "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (automatic without CUDA)")
    p.add_argument("--record", action="store_true", help="put this run on top of docs/results.md, the results record")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    device = "cuda" if cuda else "cpu"
    started = time.time()
    if smoke:
        checks = check_correctness(device, B=2, H=2, G=2, D=32, C=40,
                                   names=["int2", "int4-kivi", "kivi4+res+sink+rot"])
        rows = time_table(device, [1], [256, 512], Hq=8, H=2, D=128, formats=["fp8", "int4-kivi"], smoke=True)
        sweep_at = (1, 256)
        sweep = tile_sweep(device, *sweep_at, Hq=8, H=2, D=128, formats=["int4-kivi"], blocks=[16], smoke=True)
        card, peak = ("cpu (Triton interpreter)" if not cuda else torch.cuda.get_device_name()), None
    else:
        checks = check_correctness(device, B=3, H=8, G=4, D=128, C=300)
        card = torch.cuda.get_device_name()
        peak = next((v for k, v in NOMINAL_TBPS.items() if k in card), None)
        rows = time_table(device, [1, 8, 32], [4096, 32768, 131072], Hq=32, H=8, D=128, formats=list(FORMATS),
                          smoke=False)
        sweep_at = (8, 32768)
        sweep = tile_sweep(device, *sweep_at, Hq=32, H=8, D=128, formats=["int4-kivi", "int2-kivi", "int4", "fp8"],
                           blocks=[16, 32, 64], smoke=False)
    table = render(rows, card, peak) + "\n\n" + render_slopes(rows) + "\n\n" + render_sweep(sweep, *sweep_at)
    report = (f"## {datetime.date.today().isoformat()} -- {card}\n\n"
              f"`python benchmarks/gpu_kernels.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
              f" (torch {torch.__version__}, triton {__import__('triton').__version__}, "
              f"{time.time() - started:.0f} s{', smoke: timings are single interpreter calls, not GPU numbers' if smoke else ''})\n\n"
              + "\n".join("    " + c for c in checks) + "\n\n" + table + "\n")
    print(report)
    if args.record:
        _results_record()(f"decode attention on {card} (benchmarks/gpu_kernels.py)", report.split("\n", 1)[1])
    return report


def _results_record():
    """``benchmarks.record.record``, whether this file runs as a script or as ``benchmarks.gpu_kernels``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.record import record
    return record


if __name__ == "__main__":
    main()
