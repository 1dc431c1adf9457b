"""Per-call cost of kvcompile's operators on the CPU, one decode step of one layer (SmolLM2's shape: 3 kv heads,
9 query heads, head_dim 64, 1,000 cached tokens): through the torch.library dispatcher (what Inductor-compiled
graphs call), as the plain Python function (what kvcompile's eager graphs call since ops.PLAIN), and the C
kernel's Python wrapper alone. Best of 5 rounds of ``--calls`` calls, microseconds. The op calls are decode
steps (each stores one more token into the paged store behind the cache tensors, ``KVStore.append``: block
reservation included); the kernel wrapper's store calls append at one position again and again.

    python benchmarks/op_overhead.py
"""
from __future__ import annotations

import argparse
import time

import torch

from kvcompile import Policy, ops
from kvcompile.store import LayerSpec
from kvcompile.templates import cpu, cpu_store


def best_us(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = LayerSpec(Policy.kivi(4), 3, 64, "float32")
    name = spec.register()
    T = args.tokens
    prefill = torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64)
    # the ops find the paged store behind the cache tensors: here a full-precision cache they shadow, as long
    # as every call below needs (each op call is a decode step, one more token)
    k_cache, v_cache = (torch.zeros(1, 3, T + 12 * (args.calls + 1), 64) for _ in range(2))
    token = torch.ops.kvcompile.store(k_cache, v_cache, *prefill, torch.arange(T), name)
    st = spec.allocate(1, T + 1)  # the kernel wrapper's own store, every call appending at the same position
    cpu_store.store(st, spec, *prefill)
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)
    plain_store, plain_attention = ops.PLAIN[torch.ops.kvcompile.store.default], \
        ops.PLAIN[torch.ops.kvcompile.attention.default]
    pos = [T]

    def step(fn):  # a decode step: the next position
        def call():
            fn(k_cache, v_cache, k, v, torch.tensor(pos), name)
            pos[0] += 1
        return call

    def again():
        st.lengths.fill_(T)
        cpu_store.store(st, spec, k, v)

    res = {"store": {"dispatcher": best_us(step(torch.ops.kvcompile.store), args.calls),
                     "plain": best_us(step(plain_store), args.calls),
                     "kernel wrapper": best_us(again, args.calls)}}
    ops.store_for(k_cache, v_cache, name).crop(T + 1)  # attention over as many tokens as the wrapper's store
    res |= {
        "attention": {"dispatcher": best_us(lambda: torch.ops.kvcompile.attention(q, k_cache, v_cache, token, None,
                                                                                    0.125, name, k, v), args.calls),
                      "plain": best_us(lambda: plain_attention(q, k_cache, v_cache, token, None, 0.125, name, k, v),
                                       args.calls),
                      "kernel wrapper": best_us(lambda: cpu.attention(q, st, spec, None, 0.125, k_new=k, v_new=v),
                                                args.calls)},
    }
    # the three ways of calling attention read the same tokens: they must agree bit for bit
    outs = [torch.ops.kvcompile.attention(q, k_cache, v_cache, token, None, 0.125, name, k, v),
            plain_attention(q, k_cache, v_cache, token, None, 0.125, name, k, v),
            cpu.attention(q, st, spec, None, 0.125, k_new=k, v_new=v)]
    res["attention_outputs_equal"] = all(torch.equal(outs[0], o) for o in outs[1:])
    print(f"one layer, KIVI int4, {args.tokens} cached tokens, 1 thread: microseconds per call (best of 5 x {args.calls})")
    print(f"{'op':<10} {'dispatcher':>10} {'plain':>8} {'kernel wrapper':>14}")
    for op, r in res.items():
        if not isinstance(r, dict):
            continue
        print(f"{op:<10} {r['dispatcher']:>10.1f} {r['plain']:>8.1f} {r['kernel wrapper']:>14.1f}")
    return res


if __name__ == "__main__":
    main()
