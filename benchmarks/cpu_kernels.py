"""CPU decode-attention kernel, one layer, side by side: kvcompile's generated C kernel per policy against
PyTorch's fp32 SDPA over the same positions.

    python benchmarks/cpu_kernels.py                          # SmolLM2's layer shape, 2K and 8K positions
    python benchmarks/cpu_kernels.py --contexts 1024 4096 --batch 4 --threads 2
    python benchmarks/cpu_kernels.py --smoke                  # tiny, seconds (run by the tests)

For each context: a store (paged, blocks of the layout's default size reserved in order) filled by the C
store kernel with random keys (one outlier channel, as real keys have) and values, one query token per sequence, ``--heads`` kv heads and ``--gqa`` query heads per kv head.
Times are medians over ``--repeats`` calls, taken round-robin across contenders (A B C ... A B C ...) so
machine drift hits all alike; each kernel's output is first checked against the reference. Columns:
microseconds per call, nanoseconds per (position, kv head), the bytes the store holds per (position, kv head)
(what the kernel reads; fp32 model), the ratio to fp32 SDPA, and "x floor": the time over the time a plain
pass over the same bytes takes (the read bandwidth is measured first) -- near 1 the kernel is bound by
memory, far above 1 by arithmetic.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcompile import Policy
from kvcompile import evaluate as E
from kvcompile.accounting import bytes_per_token
from kvcompile.store import LayerSpec, attention_reference
from kvcompile.templates import cpu, cpu_store

BW_BYTES = 256 << 20  # the buffer the read bandwidth is measured on: far beyond the caches
POLICIES = {
    "int8 (Policy.int8)": lambda: Policy.int8(),
    "fp8 (Policy.fp8)": lambda: Policy.fp8(),
    "KIVI int4": lambda: Policy.kivi(4),
    "KIVI int3": lambda: Policy.kivi(3),
    "kivi-k3v2:2": lambda: E.scheme_policy("kivi-k3v2", 2),
    "KIVI int2": lambda: Policy.kivi(2),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    layer_args(ap, batch=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.contexts, a.repeats = [256], 3
    torch.set_num_threads(a.threads)
    B, H, G, D = a.batch, a.heads, a.gqa, a.head_dim
    g = torch.Generator().manual_seed(0)
    print(f"{B=} kv heads={H} gqa={G} head_dim={D} threads={a.threads}, median of {a.repeats}")
    bw, bw_bytes = measured_bandwidth(a.smoke)
    print(f"{'contender':<20}{'ctx':>7}{'us/call':>10}{'ns/pos-head':>13}{'B/pos-head':>12}{'x SDPA':>8}{'x floor':>10}")
    rows = []
    for L in a.contexts:
        q, k, v = random_layer(B, H, G, D, L, g)
        calls = {"fp32 SDPA": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=G > 1), 2 * 4 * D)}
        for name, make in POLICIES.items():
            spec, st, read = checked_store(name, make(), q, k, v)
            calls[name] = (lambda st=st, spec=spec: cpu.attention(q, st, spec, None, None), read)
        times = {name: [] for name in calls}
        for fn, _ in calls.values():
            fn()  # builds the kernel once, warms the caches
        for _ in range(a.repeats):
            for name, (fn, _) in calls.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["fp32 SDPA"])
        for name, (_, read) in calls.items():
            t = statistics.median(times[name])
            floor = read / bw  # seconds per position-head if the call only had to stream its bytes
            ns = t / (L * H * B)
            print(f"{name:<20}{L:>7}{t * 1e6:>10.1f}{ns * 1e9:>13.1f}{read:>12.1f}{t / base:>8.2f}{ns / floor:>10.1f}")
            rows.append({"contender": name, "context": L, "us": t * 1e6, "bytes_per_position_head": read,
                         "ratio_to_sdpa": t / base, "x_read_floor": ns / floor})
    print(f"x floor: time over the time to stream the same bytes at {bw / 1e9:.1f} GB/s (a {a.threads}-thread read of "
          f"{bw_bytes >> 20} MiB, measured first); near 1 means bound by memory, far above it by arithmetic")
    return rows


def layer_args(ap, batch: int):
    """The layer-shape options of the kernel benchmarks (SmolLM2's layer by default)."""
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--gqa", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)


SINGLE_LAYER_POLICIES = ("int8 (Policy.int8)", "fp8 (Policy.fp8)", "KIVI int4", "KIVI int2")


def time_sources(q, st, spec, sources: dict, repeats: int) -> dict:
    """Seconds per call of the decode kernel built from each of ``sources`` (name -> template path) on one
    store, ``repeats`` rounds, the order reversed every other round so that none always goes first."""
    times = {n: [] for n in sources}
    for i in range(repeats):
        for n, src in list(sources.items())[::1 if i % 2 else -1]:
            t = time.perf_counter()
            cpu.attention(q, st, spec, None, None, source=src)
            times[n].append(time.perf_counter() - t)
    return times


def single_layer_args(ap, repeats: int):
    """The options of the one-layer benchmarks (cpu_kernel_parts, cpu_kernel_ab): SmolLM2's layer at 8K x 4."""
    ap.add_argument("--context", type=int, default=8192)
    layer_args(ap, batch=4)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--smoke", action="store_true")


def single_layer(a):
    """One thread, and the random layer the options ``a`` ask for (tiny under --smoke, which also cuts the
    repeats): (B, H, G, D, L, q, k, v)."""
    if a.smoke:
        a.context, a.batch, a.repeats = 256, 1, 3
    torch.set_num_threads(1)
    B, H, G, D, L = a.batch, a.heads, a.gqa, a.head_dim, a.context
    return (B, H, G, D, L, *random_layer(B, H, G, D, L, torch.Generator().manual_seed(0)))


def random_layer(B, H, G, D, L, g):
    """One decode query per sequence and L positions of random keys (channel 3 an outlier, as real keys
    have) and values: (q [B, H*G, 1, D], k, v [B, H, L, D])."""
    k, v = torch.randn(2, B, H, L, D, generator=g)
    k[..., 3] *= 8
    q = torch.randn(B, H * G, 1, D, generator=g)
    return q, k, v


def checked_store(name, pol, q, k, v, source=cpu.SOURCE):
    """``pol``'s store filled with k, v by the C store kernel, once the decode kernel (built from ``source``)
    is checked against the reference on it (a fast wrong kernel measures nothing). Returns (spec, state, the
    bytes one position of one kv head holds)."""
    B, H, L, D = k.shape
    spec = LayerSpec(pol, H, D)
    spec.register()
    st = spec.allocate(B, L)
    cpu_store.store(st, spec, k, v)
    if not torch.allclose(cpu.attention(q, st, spec, None, None, source=source), attention_reference(q, st, spec),
                          atol=1e-4, rtol=1e-4):
        raise AssertionError(f"{name}: the kernel disagrees with the reference at {L} positions")
    return spec, st, bytes_per_token(pol, 1, H, D, L, dtype=torch.float32) / H


def measured_bandwidth(smoke: bool) -> tuple[float, int]:
    """(bytes per second, buffer bytes): ``read_bandwidth`` over ``BW_BYTES`` (a small buffer when smoke)."""
    nbytes = 4 << 20 if smoke else BW_BYTES
    return read_bandwidth(nbytes, 3 if smoke else 7), nbytes


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second one pass over a large fp32 buffer streams (``sum``: one add per four bytes read)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return nbytes / statistics.median(ts)


if __name__ == "__main__":
    main()
