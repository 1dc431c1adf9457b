"""The Triton kernels on a GPU: correctness of every layout first, then decode, prefill and store timings against
bf16 SDPA, with the targets of issue 43 printed as met or missed.

    python benchmarks/gpu_kernels.py                   # on a CUDA machine (an H200: about 4 minutes)
    python benchmarks/gpu_kernels.py --quick           # correctness of 3 layouts, decode at batch 8 x 32K (~1 min)
    python benchmarks/gpu_kernels.py --record          # ... and put the run on top of docs/results.md
    python benchmarks/gpu_kernels.py --smoke           # tiny sizes; without CUDA through TRITON_INTERPRET=1
    python benchmarks/gpu_kernels.py --quick --tile int4=256,4,3   # try a decode tile (BLOCK_N, warps, stages)

1. **Correctness on the device.** For every layout below, over blocks handed out in a scrambled order, the store
   kernels must equal ``store_reference`` bit for bit, and attention -- the decode kernel (one query) and the
   general one (four queries: chunked prefill) and the prefill path (64 queries: SDPA over the dequantized
   store in bf16) -- must be within the derived bound of float64 attention (``launch.reference_and_bound``:
   bf16 operands where the kernels use them). Any failure stops the run, but the prefill path's (new: it
   skips the prefill timing, and the run exits 1 at its end).
2. **Decode.** One query token, 32 query heads over 8 KV heads, head_dim 128, bf16 queries, at batch 1/8/32 and
   context 4K/32K/128K, each format against bf16 ``F.scaled_dot_product_attention`` (flash) on the same
   lengths. Times are CUDA-graph medians (``triton.testing.do_bench_cudagraph``); GB/s is over the bytes the call
   moves (every byte of the store -- codes, scales, zero points, block table, ring, sinks -- the query, the
   output and the split workspace, written and read); % of the H200's 4.8 TB/s. Then the growth per 1K tokens
   against bf16's, the old general kernel at batch 8 x 32K, and the targets.
3. **Prefill.** A prompt of 8K/16K/32K tokens prefilled in 4K chunks over the quantized past (each chunk's
   attention reads its own chunk in full precision and the earlier ones packed), against SDPA flash over the
   whole prompt (causal): total attention time, plain calls. The path is ``launch.plan``'s (on CUDA "sdpa":
   the past dequantized into bf16, then SDPA's flash kernel, ``templates.prefill``); at 8K the general Triton
   kernel too, for comparison. Then the prefill path's read-back of the past alone (``templates.past``, 32K
   tokens into bf16), GB/s over the packed bytes read and the bf16 written.
   And a prompt's attention as an engine computes it through ``kvcompile.pages`` (vLLM's path): each query a
   decode row of the row-invariant kernel, its rows as runs of the sequence (a program reads each packed tile
   once for several rows: ``decode.run_rows``; checked first: each row's bits as alone) or a row a program.
4. **Store.** Quantize-on-write: a decode append (one token, batch 32) and a 4K-token chunk, GB/s over the
   bytes read and written.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the kernels run through Triton's interpreter: must be set before they exist
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kvcompile import Policy, Quant  # noqa: E402
from kvcompile.store import KVStore, LayerSpec, state_nbytes  # noqa: E402
from kvcompile.templates import decode as kdecode  # noqa: E402
from kvcompile.templates import launch  # noqa: E402

FORMATS = {  # name -> policy; every position packed (no residual, no sinks), so the table measures the kernel
    "fp8": Policy(Quant("fp8_e4m3", "token"), Quant("fp8_e4m3", "token"), residual=0),
    "int8": Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0),
    "int4": Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0),
    "int2": Policy(Quant("int2", "token"), Quant("int2", "token"), residual=0),
    "int4-kivi": Policy.kivi(4, group=32, residual=0),  # per-channel keys, 32-groups: 1 bit/elem of scales
    "int2-kivi": Policy.kivi(2, group=32, residual=0),
}
EXTRA = {  # correctness only: sinks, a residual ring, rotation, fp8 scales, per-channel values, fp32 scales
    "kivi4+res+sink+rot": Policy.kivi(4, group=16, residual=8, sink=2, rotate=True),
    "fp8e5m2/int3": Policy(Quant("fp8_e5m2", "token"), Quant("int3", "channel", 8), residual=3),
    "int4 fp8-scales/int2 chan": Policy(Quant("int4", "token", None, False, "fp8_e4m3"),
                                        Quant("int2", "channel", 16), residual=0, sink=4),
    "int8 f32-scales": Policy(Quant("int8", "token", 32, False, "float32"), Quant("int8", "token", 32), residual=5),
}
# issue 43's targets: speedup over bf16 SDPA at these (batch, context); 65 % of HBM peak at batch 8 x 32K
TARGETS = {"fp8": 1.7, "int8": 1.7, "int4": 2.8, "int4-kivi": 2.8, "int2": 4.0, "int2-kivi": 4.0}
TARGET_SHAPES = ((8, 32768), (32, 131072))
LAUNCH_BOUND = (1, 4096, 0.8)  # batch 1 x 4K: at least 0.8x SDPA for every format
PEAK_SHARE, SLOPE_FACTOR, PREFILL_TARGET = 0.65, 1.2, 0.7
NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


def fmt_ctx(c: int) -> str:
    return f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c)


# --------------------------------------------------------------------------- 1. correctness
def check_correctness(device: str, B: int, H: int, G: int, D: int, C: int, names=None,
                      block: int = 16) -> list[str]:
    """Store exactness and attention bounds (decode and chunked-prefill kernels) per layout; a line each. A
    failure stops the run, except the prefill path's (SDPA over the dequantized past, new): its failure is a
    "FAIL" line, so that the decode timing still runs (``main`` then skips the prefill timing and exits 1)."""
    lines, failed = [], []
    g = torch.Generator().manual_seed(0)
    lengths = [C, C * 2 // 3 + 1][:B] + [C // 3] * max(0, B - 2)
    for name, policy in {**FORMATS, **EXTRA}.items():
        if names is not None and name not in names:
            continue
        spec = LayerSpec(policy, H, D, "bfloat16", max(block, policy.flush))
        ref = KVStore(spec, B, blocks=B * (spec.blocks_for(C) + 1))
        ref.free = [ref.free[i] for i in torch.randperm(len(ref.free), generator=g).tolist()]
        got = ref.copy(device)
        L, kernels = 0, set()
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
            for nq in (1, 4, 64) if min(min(L, x) for x in lengths) >= 64 else (1, 4):  # 64: SDPA's, on CUDA
                q = torch.randn(B, H * G, nq, D, generator=g).to(torch.bfloat16)
                pl = launch.plan(got.state, spec, q.shape, dtype=q.dtype)
                path = "decode" if pl.decode else "sdpa" if pl.sdpa else "general"
                kernels.add(path)
                try:
                    out = launch.attention(q.to(device), got.state, spec).cpu()
                except Exception as e:
                    if not pl.sdpa:
                        raise
                    failed.append(f"FAIL attention {name} n={nq} (sdpa) after {L} tokens: {type(e).__name__}: {e}")
                    continue
                want, bound = launch.reference_and_bound(q, ref.state, spec, device=device)
                err = (out.double() - want).abs()
                if (err > bound).any() or not torch.equal(out.isnan(), want.isnan()):
                    msg = (f"FAIL attention {name} n={nq} ({path} kernel) after {L} tokens: max error "
                           f"{err.max():.3g}, {int((err > bound).sum())} outputs outside the derived bound")
                    if not pl.sdpa:
                        raise SystemExit(msg)
                    failed.append(msg)
        lines.append(f"ok  {name:26s} store exact, attention within bound ({'+'.join(sorted(kernels))} kernels; "
                     f"{spec.policy.key_str()}; head_dim {D})")
    return lines + failed


def rows_of(state, lengths):
    """A flat batch's rows over one sequence's ``state`` (batch 1): a row a query at each of ``lengths``
    (ascending), each with the sequence's block table, sinks and ring -- an engine's prompt, each query a decode
    row (``kvcompile.pages``)."""
    rep = [0] * len(lengths)
    return state._replace(k_res=state.k_res[rep], v_res=state.v_res[rep], k_sink=state.k_sink[rep],
                          v_sink=state.v_sink[rep], table=state.table[rep].contiguous(),
                          lengths=torch.tensor(lengths, dtype=torch.int32, device=state.lengths.device))


def check_runs(device: str, H: int, G: int, D: int, C: int, names, rows: int = 41, block: int = 16) -> list[str]:
    """A prompt's rows as runs of one sequence (``decode.run_rows``: a program reads each packed tile once for
    several rows) against each row in a call of its own (the kernel without runs, a decode step's): the same bits,
    and within the derived bound. A line each; a failure is a "FAIL" line (``main`` then skips the prompt-rows
    timing and exits 1)."""
    lines = []
    g = torch.Generator().manual_seed(1)
    for name in names:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
        ref = KVStore(spec, 1, blocks=spec.blocks_for(C) + 1)
        ref.append(torch.randn(1, H, C, D, generator=g), torch.randn(1, H, C, D, generator=g))
        lengths = list(range(C - rows + 1, C + 1))
        host, on_dev = rows_of(ref.state, lengths), type(ref.state)(*[t.to(device) for t in ref.state])
        q = torch.randn(len(lengths), H * G, 1, D, generator=g).to(torch.bfloat16)
        try:
            runs = launch.attention(q.to(device), rows_of(on_dev, lengths), spec, invariant=True,
                                    groups=torch.tensor([0, len(lengths)], dtype=torch.int32)).cpu()
            alone = torch.cat([launch.attention(q[i:i + 1].to(device), rows_of(on_dev, [x]), spec,
                                                invariant=True).cpu() for i, x in enumerate(lengths)])
        except Exception as e:
            lines.append(f"FAIL runs {name}: {type(e).__name__}: {e}")
            continue
        want, bound = launch.reference_and_bound(q, host, spec, invariant=True, device=device)
        same = torch.equal(runs.isnan(), alone.isnan()) and torch.equal(runs.nan_to_num(), alone.nan_to_num())
        inside = not ((runs.double() - want).abs() > bound).any()
        if same and inside:
            lines.append(f"ok  runs {name:21s} {len(lengths)} rows of one sequence: each row's bits as alone, "
                         f"within bound")
        else:
            lines.append(f"FAIL runs {name}: {'the same bits as alone' if same else 'other bits than alone'}, "
                         f"{'within' if inside else 'outside'} the bound")
    return lines


# --------------------------------------------------------------------------- 2. decode timing
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
        elif t.dtype == torch.int8:
            t.copy_(torch.randint(-8, 8, t.shape, dtype=torch.int8, device=device))
        else:
            t.copy_(torch.rand(t.shape, device=device).to(t.dtype) * 0.02 + 0.001)
    for t in state[6:10]:
        if t.numel():
            t.normal_()
    state.lengths.fill_(L)
    return state


def bench(fn, smoke: bool, graph: bool = True) -> float:
    """Median milliseconds of fn() (a CUDA graph's replays on a GPU, or with ``graph=False`` plain calls, for
    a path that reads lengths on the host; one call in the interpreter)."""
    fn()
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing as tt
    torch.cuda.synchronize()
    if not graph:
        return float(tt.do_bench(fn, warmup=5, rep=40, return_mode="median"))
    return float(tt.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def sdpa(q, k, v, causal: bool = False):
    """bf16 SDPA on its flash backend (GQA through ``enable_gqa``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def decode_bytes(spec: LayerSpec, state, q, slots: int) -> int:
    """Bytes a decode call moves: the store, the query and output (bf16), the split workspace (fp32, written
    and read)."""
    B, Hq, _, D = q.shape
    return state_nbytes(state) + 2 * q.numel() * 2 + 2 * B * Hq * slots * (D + 2) * 4


def time_decode(device: str, batches, contexts, Hq: int, H: int, D: int, formats, smoke: bool, block: int,
                tiles=None):
    """Rows (batch, context, kernel, ms, bytes, speedup over SDPA). ``tiles``: name -> (BLOCK_N, warps, stages)."""
    rows = []
    for B in batches:
        for ctx in contexts:
            q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device=device)
            k = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=device)
            v = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=device)
            t_ref = bench(lambda: sdpa(q, k, v), smoke)
            rows.append((B, ctx, "bf16 sdpa (flash)", t_ref, 2 * k.numel() * 2 + 2 * q.numel() * 2, 1.0))
            del k, v
            for name in formats:
                spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
                state = filled_state(spec, device, B, ctx)
                saved = kdecode.tile_config
                if tiles and name in tiles:
                    bn, w, st = tiles[name]
                    kdecode.tile_config = lambda *a, _t=(bn, w, st): dict(block_n=_t[0], warps=_t[1], stages=_t[2],
                                                                         source="--tile")
                try:
                    pl = launch.plan(state, spec, q.shape)
                    t = bench(lambda: launch.attention(q, state, spec), smoke)
                    # the row-invariant splits an engine's flat batch runs with (kvcompile.pages): their cost
                    pli = launch.plan(state, spec, q.shape, invariant=True)
                    ti = bench(lambda: launch.attention(q, state, spec, invariant=True), smoke)
                finally:
                    kdecode.tile_config = saved
                rows.append((B, ctx, name, t, decode_bytes(spec, state, q, pl.slots), t_ref / t))
                rows.append((B, ctx, name + " (row-invariant)", ti, decode_bytes(spec, state, q, pli.slots), t_ref / ti))
                del state
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def time_general(device: str, B: int, ctx: int, Hq: int, H: int, D: int, formats, smoke: bool, block: int):
    """The general kernel on the same decode calls (what every decode ran before the decode kernel)."""
    rows = []
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device=device)
    for name in formats:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
        state = filled_state(spec, device, B, ctx)
        pl = launch.plan(state, spec, q.shape, kernel="general")
        t = bench(lambda: launch.attention(q, state, spec, kernel="general"), smoke)
        rows.append((B, ctx, name + " (general kernel)", t, decode_bytes(spec, state, q, pl.slots), None))
        del state
    return rows


def render_decode(rows, peak_tbps: float | None) -> str:
    out = ["| batch | context | kernel | time (ms) | GB moved | GB/s | % of peak | speedup vs bf16 |",
           "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for B, ctx, name, t, nbytes, speedup in rows:
        gbps = nbytes / (t * 1e-3) / 1e9
        peak = f"{100 * gbps / (peak_tbps * 1e3):.0f}%" if peak_tbps else "-"
        sp = "-" if speedup is None else f"{speedup:.2f}x"
        out.append(f"| {B} | {fmt_ctx(ctx)} | {name} | {t:.4f} | {nbytes / 1e9:.3f} | {gbps:.0f} | {peak} | {sp} |")
    return "\n".join(out)


def slopes(rows):
    """{(batch, kernel): (growth ms per 1K tokens, x bf16's growth, bytes x bf16's)} between the shortest and
    longest context of each batch."""
    by = {(B, ctx, name): (t, nbytes) for B, ctx, name, t, nbytes, _ in rows}
    out = {}
    for B in sorted({r[0] for r in rows}):
        ctxs = sorted({r[1] for r in rows if r[0] == B})
        if len(ctxs) < 2:
            continue
        lo, hi = ctxs[0], ctxs[-1]
        names = [r[2] for r in rows if r[0] == B and r[1] == hi]
        ref = next(n for n in names if n.startswith("bf16"))
        grow = {n: (by[(B, hi, n)][0] - by[(B, lo, n)][0]) / ((hi - lo) / 1024) for n in names if (B, lo, n) in by}
        for n in grow:
            out[(B, n)] = (grow[n], grow[n] / grow[ref], by[(B, hi, n)][1] / by[(B, hi, ref)][1])
    return out


def render_slopes(sl) -> str:
    lines = ["| batch | kernel | growth (ms per 1K tokens) | x bf16's growth | bytes x bf16 | target (<= 1.2 x bytes) |",
             "|---:|---|---:|---:|---:|---|"]
    for (B, n), (g, gx, bx) in sl.items():
        tgt = "-" if n.startswith("bf16") else ("met" if gx <= SLOPE_FACTOR * bx else "MISSED")
        lines.append(f"| {B} | {n} | {g:.5f} | {gx:.3f} | {bx:.3f} | {tgt} |")
    return "\n".join(lines)


def targets(rows, sl, peak_tbps, prefill_rows) -> list[str]:
    """Issue 43's targets, each met or MISSED, with the number."""
    by = {(B, ctx, name): (t, nbytes, sp) for B, ctx, name, t, nbytes, sp in rows}
    out = []
    for (B, ctx) in TARGET_SHAPES:
        for name, want in TARGETS.items():
            if (B, ctx, name) in by:
                sp = by[(B, ctx, name)][2]
                out.append(f"{'met   ' if sp >= want else 'MISSED'} decode {name} at {B} x {fmt_ctx(ctx)}: "
                           f"{sp:.2f}x bf16 SDPA (target >= {want}x)")
    B, ctx, want = LAUNCH_BOUND
    for name in TARGETS:
        if (B, ctx, name) in by:
            sp = by[(B, ctx, name)][2]
            out.append(f"{'met   ' if sp >= want else 'MISSED'} decode {name} at {B} x {fmt_ctx(ctx)} "
                       f"(launch-bound): {sp:.2f}x (target >= {want}x)")
    if peak_tbps:
        for name in TARGETS:
            if (8, 32768, name) in by:
                t, nbytes, _ = by[(8, 32768, name)]
                share = nbytes / (t * 1e-3) / (peak_tbps * 1e12)
                out.append(f"{'met   ' if share >= PEAK_SHARE else 'MISSED'} decode {name} at 8 x 32K: "
                           f"{100 * share:.0f}% of HBM peak on the bytes moved (target >= {100 * PEAK_SHARE:.0f}%)")
    for (B, n), (g, gx, bx) in sl.items():
        if n in TARGETS:
            out.append(f"{'met   ' if gx <= SLOPE_FACTOR * bx else 'MISSED'} growth {n} at batch {B}: "
                       f"{gx:.3f}x bf16's per 1K tokens (target <= {SLOPE_FACTOR} x bytes ratio {bx:.3f} = "
                       f"{SLOPE_FACTOR * bx:.3f})")
    for T, name, t, t_ref, _ in prefill_rows:  # "int4 (sdpa)": the format, the path "auto" chose
        if name.split(" (")[0] in TARGETS and "comparison" not in name:
            out.append(f"{'met   ' if t_ref / t >= PREFILL_TARGET else 'MISSED'} prefill {name} at "
                       f"{fmt_ctx(T)}: {t_ref / t:.2f}x SDPA flash (target >= {PREFILL_TARGET}x)")
    return out


def time_prompt_rows(device: str, prompts, Hq: int, H: int, D: int, formats, smoke: bool, block: int):
    """Rows (prompt, layout, rows a program, ms as runs, ms a row a program, SDPA's ms): a prompt's attention as an
    engine computes it through ``kvcompile.pages`` -- each query a decode row of the row-invariant kernel over the
    positions up to its own, ``pages.ROWS_PER_CALL`` row-heads a call -- with the rows as runs of the sequence
    (``groups``) and each row a program of its own, against SDPA flash over the whole prompt (causal). Plain
    calls; the runs are cut on the device (``decode.run_offsets``)."""
    from kvcompile.pages import ROWS_PER_CALL
    rows = []
    step = max(1, ROWS_PER_CALL // H)
    for T in prompts:
        q = torch.randn(1, Hq, T, D, dtype=torch.bfloat16, device=device)
        k = torch.randn(1, H, T, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(1, H, T, D, dtype=torch.bfloat16, device=device)
        t_ref = bench(lambda: sdpa(q, k, v, causal=True), smoke, graph=False)
        qr = q[0].transpose(0, 1).unsqueeze(2).contiguous()  # [T, Hq, 1, D]: a row a query
        del k, v
        for name in formats:
            spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
            state = filled_state(spec, device, 1, T)
            calls = [(rows_of(state, list(range(a + 1, min(a + step, T) + 1))), qr[a:a + step])
                     for a in range(0, T, step)]

            def prompt(runs: bool):
                for st, qc in calls:
                    launch.attention(qc, st, spec, invariant=True,
                                     groups=torch.tensor([0, qc.shape[0]], dtype=torch.int32) if runs else None)

            run = kdecode.layer_run_rows(spec, Hq // H)
            rows.append((T, name, run, bench(lambda: prompt(True), smoke, graph=False),
                         bench(lambda: prompt(False), smoke, graph=False), t_ref))
            del state, calls
        del q, qr
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def render_prompt_rows(rows) -> str:
    out = ["| prompt | layout | rows a program | attention, runs (ms) | a row a program (ms) | runs' speedup | "
           "runs x SDPA flash |", "|---:|---|---:|---:|---:|---:|---:|"]
    for T, name, run, t_runs, t_rows, t_ref in rows:
        out.append(f"| {fmt_ctx(T)} | {name} | {run} | {t_runs:.3f} | {t_rows:.3f} | {t_rows / t_runs:.2f}x | "
                   f"{t_ref / t_runs:.2f}x |")
    return "\n".join(out)


# --------------------------------------------------------------------------- 3. prefill, 4. store
def time_prefill(device: str, prompts, chunk: int, Hq: int, H: int, D: int, formats, smoke: bool, block: int):
    """Rows (prompt, kernel, ms, SDPA's ms, ms of storing the prompt): chunked prefill attention over the
    quantized past, summed over the chunks, against SDPA flash over the whole prompt; the kernel named as
    ``launch.plan`` chose it ("sdpa": SDPA over the dequantized past), and at the first prompt the first format
    once more through the general Triton kernel. Plain calls, not CUDA graphs: the prefill path reads lengths
    on the host."""
    rows = []
    for T in prompts:
        q = torch.randn(1, Hq, T, D, dtype=torch.bfloat16, device=device)
        k = torch.randn(1, H, T, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(1, H, T, D, dtype=torch.bfloat16, device=device)
        t_ref = bench(lambda: sdpa(q, k, v, causal=True), smoke, graph=False)
        rows.append((T, "bf16 sdpa (flash, causal)", t_ref, t_ref, None))
        for name, kernel in [(f, "auto") for f in formats] + ([(formats[0], "general")] if T == prompts[0] else []):
            spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
            store = KVStore(spec, 1, device, blocks=spec.blocks_for(T) + 1)
            steps = []
            for a in range(0, T, chunk):  # the state after each chunk's append, and that chunk's attention
                store.append(k[:, :, a:a + chunk], v[:, :, a:a + chunk], kernel=launch.store)
                st = type(store.state)(*[t.clone() for t in store.state])
                steps.append((st, q[:, :, a:a + chunk], k[:, :, a:a + chunk], v[:, :, a:a + chunk]))

            def prefill():
                for st, qc, kc, vc in steps:
                    launch.attention(qc, st, spec, k_new=kc, v_new=vc, kernel=kernel)

            t = bench(prefill, smoke, graph=False)
            st, qc = steps[-1][:2]
            pl = launch.plan(st, spec, qc.shape, kernel=kernel, chunk=True, dtype=qc.dtype)
            path = "decode" if pl.decode else "sdpa" if pl.sdpa else "general"
            path += ", for comparison" if kernel != "auto" else ""
            fresh = KVStore(spec, 1, device, blocks=spec.blocks_for(T) + 1)
            fresh.reserve(T)  # every block the prompt writes, so the kernels alone run in the timed calls
            empty = fresh.state

            def write():  # quantize-on-write of the whole prompt, chunk by chunk, from an empty sequence
                empty.lengths.zero_()
                for a in range(0, T, chunk):
                    launch.store(empty, spec, k[:, :, a:a + chunk], v[:, :, a:a + chunk])

            rows.append((T, f"{name} ({path})", t, t_ref, bench(write, smoke)))
            del steps
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def render_prefill(rows) -> str:
    out = ["| prompt | kernel | attention (ms) | x SDPA flash | store of the prompt (ms) |", "|---:|---|---:|---:|---:|"]
    for T, name, t, t_ref, t_store in rows:
        st = "-" if t_store is None else f"{t_store:.3f}"
        out.append(f"| {fmt_ctx(T)} | {name} | {t:.3f} | {t_ref / t:.2f}x | {st} |")
    return "\n".join(out)


def time_store(device: str, B: int, ctx: int, n: int, H: int, D: int, formats, smoke: bool, block: int):
    """Rows (batch, appended tokens, kernel, ms, bytes): one append of ``n`` tokens to stores holding ``ctx``."""
    rows = []
    for name in formats:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
        state = filled_state(spec, device, B, ctx + n)
        state.lengths.fill_(ctx)
        k = torch.randn(B, H, n, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(B, H, n, D, dtype=torch.bfloat16, device=device)
        L0 = state.lengths.clone()

        def append():
            state.lengths.copy_(L0)  # the same append each time (the lengths advance in the kernel launch)
            launch.store(state, spec, k, v)

        t = bench(append, smoke)
        moved = 2 * k.numel() * 2 + spec.exact_nbytes(B, n) - B * spec.row_nbytes()  # read chunk, write codes
        rows.append((B, n, name, t, max(moved, 1)))
    return rows


def time_past(device: str, B: int, ctx: int, H: int, D: int, formats, smoke: bool, block: int):
    """Rows (batch, context, layout, ms, bytes moved): the prefill path's read-back of the past
    (``templates.past``: every packed byte read once, keys and values written once in bf16)."""
    from kvcompile.templates import past
    rows = []
    for name in formats:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(block, FORMATS[name].flush))
        state = filled_state(spec, device, B, ctx)
        moved = state_nbytes(state) + 2 * B * H * ctx * D * 2
        rows.append((B, ctx, name, bench(lambda: past.launch_past(state, spec, ctx, torch.bfloat16), smoke), moved))
        del state
    return rows


def render_past(rows, peak_tbps) -> str:
    out = ["| batch | context | layout | time (ms) | GB/s (packed read + bf16 written) | % of peak |",
           "|---:|---:|---|---:|---:|---:|"]
    for B, ctx, name, t, moved in rows:
        rate = moved / (t * 1e-3)
        share = f"{100 * rate / (peak_tbps * 1e12):.0f}" if peak_tbps else "-"
        out.append(f"| {B} | {fmt_ctx(ctx)} | {name} | {t:.4f} | {rate / 1e9:.0f} | {share} |")
    return "\n".join(out)


def render_store(rows) -> str:
    out = ["| batch | tokens appended | kernel | time (ms) | GB/s (chunk read + codes written) |",
           "|---:|---:|---|---:|---:|"]
    for B, n, name, t, moved in rows:
        out.append(f"| {B} | {n} | {name} | {t:.4f} | {moved / (t * 1e-3) / 1e9:.0f} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- main
def parse_tiles(items) -> dict:
    out = {}
    for item in items or []:
        name, vals = item.split("=")
        out[name] = tuple(int(x) for x in vals.split(","))
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (automatic without CUDA)")
    p.add_argument("--quick", action="store_true", help="3 layouts' correctness, decode at batch 8 x 32K")
    p.add_argument("--record", action="store_true", help="put this run on top of docs/results.md, the results record")
    p.add_argument("--out", default=None, help="also write the report (markdown) and rows (json) here")
    p.add_argument("--tile", nargs="*", metavar="FORMAT=BLOCK_N,WARPS,STAGES", help="decode tiles to try")
    p.add_argument("--block", type=int, default=64, help="packed tokens per block of the timed stores")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    device = "cuda" if cuda else "cpu"
    tiles = parse_tiles(args.tile)
    started = time.time()
    card = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    peak = next((v for k, v in NOMINAL_TBPS.items() if k in card), None) if cuda else None
    sections = []

    def log(msg):
        print(f"[{time.time() - started:6.1f}s] {msg}", flush=True)

    if smoke:  # every step once, at sizes the interpreter runs in about a minute
        checks = check_correctness(device, B=2, H=1, G=2, D=64, C=34, names=["int2", "kivi4+res+sink+rot"])
        checks += check_correctness(device, B=2, H=1, G=1, D=80, C=34, names=["int4"])  # a padded head
        checks += check_runs(device, H=1, G=2, D=64, C=60, names=["int4"], rows=6)
        log("correctness done")
        rows = time_decode(device, [1], [128], Hq=2, H=1, D=64, formats=["int4-kivi"], smoke=True, block=16,
                           tiles=tiles)
        general = time_general(device, 1, 128, 2, 1, 64, ["int4"], True, 16)
        prefill = time_prefill(device, [48], 32, 2, 1, 64, ["int4"], True, 16)
        store = time_store(device, 1, 32, 1, 1, 64, ["int4"], True, 16)
        readback = time_past(device, 1, 48, 1, 64, ["int4"], True, 16)
        prompt_rows = time_prompt_rows(device, [48], 2, 1, 64, ["int4"], True, 16)
        padded = []
    elif args.quick:
        checks = check_correctness(device, B=3, H=8, G=4, D=128, C=300, names=["int4", "int2-kivi", "fp8"])
        log("correctness done")
        rows = time_decode(device, [8], [32768], 32, 8, 128, list(FORMATS), False, args.block, tiles)
        general, prefill, store, readback, prompt_rows, padded = [], [], [], [], [], []
    else:
        checks = check_correctness(device, B=3, H=8, G=4, D=128, C=300)
        # heads padded to 128 (decode.padded_head): Phi-3-mini's 96 channels, one query head a KV head; Phi-2's 80
        # (small: the full table's step has a time budget, and these layouts' kernels compile afresh)
        checks += check_correctness(device, B=2, H=2, G=1, D=96, C=130, names=["fp8", "int8", "int4", "int4-kivi"])
        checks += check_correctness(device, B=2, H=2, G=1, D=80, C=130, names=["int4", "int2"])
        checks += check_runs(device, H=8, G=4, D=128, C=600, names=["fp8", "int8", "int4", "int2"])
        log("correctness done")
        rows = time_decode(device, [1, 8, 32], [4096, 32768, 131072], 32, 8, 128, list(FORMATS), False,
                           args.block, tiles)
        log("decode table done")
        general = time_general(device, 8, 32768, 32, 8, 128, list(FORMATS), False, args.block)
        log("general kernel done")
        padded = time_decode(device, [8], [32768], 32, 32, 96, ["fp8", "int8", "int4", "int4-kivi"], False,
                             args.block, tiles)
        log("padded head done")
        if any(c.startswith("FAIL attention") for c in checks):
            prefill = []
            log("prefill timing skipped: the prefill path failed its correctness check")
        else:
            prefill = time_prefill(device, [8192, 16384, 32768], 4096, 32, 8, 128, ["int8", "int4", "int4-kivi"],
                                   False, args.block)
            log("prefill done")
        readback = time_past(device, 1, 32768, 8, 128, list(FORMATS), False, args.block)
        log("read-back done")
        store = time_store(device, 32, 32768, 1, 8, 128, list(FORMATS), False, args.block)
        store += time_store(device, 1, 28672, 4096, 8, 128, list(FORMATS), False, args.block)
        log("store done")
        if any(c.startswith("FAIL runs") for c in checks):
            prompt_rows = []
            log("prompt rows timing skipped: the runs failed their check")
        else:
            prompt_rows = time_prompt_rows(device, [4096, 16384], 32, 8, 128, ["int8", "int4"], False, args.block)
            log("prompt rows done")
    sl = {} if smoke else slopes(rows)
    sections.append("Decode (one query; 32 query heads over 8 KV heads, head_dim 128, bf16):\n\n"
                    + render_decode(rows + general, peak))
    if padded:
        sections.append("Decode at head_dim 96 over a padded head of 128 (Phi-3-mini's 32 query heads, one a KV head, "
                        "bf16):\n\n" + render_decode(padded, peak))
    if sl:
        sections.append("Growth with context (target: at most 1.2 x the bytes ratio x bf16's):\n\n" + render_slopes(sl))
    if prefill:
        sections.append("Prefill in 4K chunks over the quantized past (batch 1), against SDPA flash over the whole "
                        "prompt:\n\n" + render_prefill(prefill))
    if readback:
        sections.append("The prefill path's read-back of the past (templates.past, 8 KV heads, head_dim 128, into "
                        "bf16):\n\n" + render_past(readback, peak))
    if prompt_rows:
        sections.append("A prompt's attention through an engine's rows (kvcompile.pages: each query a row of the "
                        "row-invariant decode kernel, batch 1), its rows as runs of the sequence or a row a program, "
                        "against SDPA flash over the whole prompt:\n\n" + render_prompt_rows(prompt_rows))
    if store:
        sections.append("Store (quantize-on-write):\n\n" + render_store(store))
    tg = targets(rows, sl, peak, prefill)
    if tg and not smoke:
        sections.append("Targets (issue 43):\n\n" + "\n".join("    " + t for t in tg))
    cfg = kdecode.config_table()
    head = (f"## {datetime.date.today().isoformat()} -- {card}\n\n"
            f"`python benchmarks/gpu_kernels.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
            f"(torch {torch.__version__}, triton {__import__('triton').__version__}, {time.time() - started:.0f} s; "
            f"decode tiles: {cfg['source']}{', smoke: timings are single interpreter calls, not GPU numbers' if smoke else ''})")
    report = head + "\n\n" + "\n".join("    " + c for c in checks) + "\n\n" + "\n\n".join(sections) + "\n"
    print(report, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"decode": rows, "general": general, "prefill": prefill, "readback": readback, "store": store,
                       "prompt_rows": prompt_rows, "targets": tg}, f)
    if args.record:
        _results_record()(f"decode attention on {card} (benchmarks/gpu_kernels.py)", report.split("\n", 1)[1])
    if any(c.startswith("FAIL") for c in checks):
        raise SystemExit("FAIL: " + "; ".join(c for c in checks if c.startswith("FAIL")))
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
