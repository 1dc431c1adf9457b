"""Where the CPU decode-attention kernel's time goes: the whole kernel against two cut-down copies of it.

    python benchmarks/cpu_kernel_parts.py                     # SmolLM2's layer shape, 8K positions, batch 4
    python benchmarks/cpu_kernel_parts.py --context 2048 --batch 1
    python benchmarks/cpu_kernel_parts.py --smoke             # tiny, seconds (run by the tests)

The template (``templates/cpu_attention.c``) is compiled three ways per policy, from copies edited here:

- ``whole``: the kernel as shipped (checked against the reference first);
- ``dequant only``: each packed tile is unpacked and dequantized into the tile buffers, but not attended to;
- ``attention only``: the packed tiles are not dequantized (nor their next block prefetched); the products,
  softmax and accumulation run over tile buffers that stay in L1 (zero-filled once, so no NaN or subnormal
  slows them). Its output is garbage; only its time counts.

Times are medians over ``--repeats`` round-robin calls, in nanoseconds per (position, kv head). Beside them:
the time to read the bytes the store holds at the measured read bandwidth (the memory floor), and the time
the products alone take at the core's FMA rate: ``2 * gqa * head_dim`` fp32 multiply-adds per (position,
kv head) (keys and values), at ``--fma-per-cycle`` (16 for two 256-bit FMA pipes: Zen 4, most AVX2 cores)
and the clock ``/proc/cpuinfo`` reports. When the product floor is above the memory floor, no width below it
can make the kernel bound by memory with fp32 products.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvcompile.templates import cpu

try:
    from . import cpu_kernels as ck
except ImportError:  # run as a script: benchmarks/ is on the path
    import cpu_kernels as ck

POLICIES = {n: ck.POLICIES[n] for n in ck.SINGLE_LAYER_POLICIES}

# the edits that make the cut-down copies (each must match the template exactly once)
_DEQUANT = ("                dequant_packed(K_FMT", "                dequant_packed(V_FMT",
            "                    prefetch_tile(K_FMT", "                    prefetch_tile(V_FMT")
_ATTEND = "                attend_tile(P, K_FMT == 0 ? q_nat"
_BUFFERS = "float kt[TILE * D] __attribute__((aligned(64))), vt[TILE * D] __attribute__((aligned(64)));"


def variants(dest: Path) -> dict[str, Path]:
    src = cpu.SOURCE.read_text()
    for s in (*_DEQUANT, _ATTEND, _BUFFERS):
        if src.count(s) != 1:
            raise RuntimeError(f"templates/cpu_attention.c changed: {s.strip()!r} is no longer found once; "
                               f"update benchmarks/cpu_kernel_parts.py's edits")
    att = src.replace(_BUFFERS, _BUFFERS + " memset(kt, 0, sizeof kt); memset(vt, 0, sizeof vt);")
    for s in _DEQUANT:
        att = att.replace(s, s[:len(s) - len(s.lstrip())] + "if (0) " + s.strip())
    deq = src.replace(_ATTEND, "                if (0) " + _ATTEND.strip())
    out = {}
    for name, text in (("dequant only", deq), ("attention only", att)):
        path = dest / f"cpu_attention_{name.split()[0]}.c"
        path.write_text(text)
        out[name] = path
    return out


def cpu_ghz() -> float | None:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(ln.split(":")[1]) for ln in f if ln.startswith("cpu MHz")]
        return max(mhz) / 1e3 if mhz else None
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ck.single_layer_args(ap, repeats=15)
    ap.add_argument("--fma-per-cycle", type=int, default=16, help="fp32 multiply-adds per cycle per core")
    a = ap.parse_args(argv)
    B, H, G, D, L, q, k, v = ck.single_layer(a)
    bw, _ = ck.measured_bandwidth(a.smoke)
    ghz = cpu_ghz()
    fma_ns = 2 * G * D / a.fma_per_cycle / ghz if ghz else float("nan")
    print(f"{B=} kv heads={H} gqa={G} head_dim={D} positions={L}, 1 thread, median of {a.repeats}; "
          f"read bandwidth {bw / 1e9:.1f} GB/s; products: {2 * G * D} FMAs per position-head = {fma_ns:.1f} ns at "
          f"{a.fma_per_cycle} per cycle and {ghz or float('nan'):.2f} GHz")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = variants(Path(tmp))
        for name, make in POLICIES.items():
            spec, st, read = ck.checked_store(name, make(), q, k, v)
            sources = {"whole": cpu.SOURCE} | paths
            for src in sources.values():
                cpu.attention(q, st, spec, None, None, source=src)  # builds each copy once, warms the caches
            times = ck.time_sources(q, st, spec, sources, a.repeats)
            ns = {n: statistics.median(ts) * 1e9 / (B * H * L) for n, ts in times.items()}
            rows.append(dict(contender=name, **{n.replace(" ", "_"): x for n, x in ns.items()},
                             memory_floor_ns=read / bw * 1e9, product_floor_ns=fma_ns, bytes_per_position_head=read))
    print(f"{'contender':<20}{'whole':>8}{'dequant':>9}{'attention':>11}{'sum':>7}{'mem floor':>11}{'FMA floor':>11}"
          "   (ns per position-head)")
    for r in rows:
        print(f"{r['contender']:<20}{r['whole']:8.1f}{r['dequant_only']:9.1f}{r['attention_only']:11.1f}"
              f"{r['dequant_only'] + r['attention_only']:7.1f}{r['memory_floor_ns']:11.1f}{r['product_floor_ns']:11.1f}")
    return rows


if __name__ == "__main__":
    main()
