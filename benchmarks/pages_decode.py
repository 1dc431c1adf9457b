"""A decode step through ``kvcompile.pages`` -- what the vLLM plugin runs per layer and step -- side by side for
several policies, in one run.

    python benchmarks/pages_decode.py                                   # SmolLM2's layer, 16 x 1K, float32
    python benchmarks/pages_decode.py --layers 30                       # a step of all of SmolLM2's 30 layers
    python benchmarks/pages_decode.py --policies tok+rot:4 kivi-r0+rot+fp8s:4 --profile
    python benchmarks/pages_decode.py --smoke                           # tiny, seconds (run by the tests)

Each policy gets an engine's buffers as vLLM lays them out (packed pages of ``--block`` tokens; a policy that
keeps tokens in full precision -- KIVI's pending key groups, a recent window -- also a window cache: a ring of
the window's slots a sequence when it has at most 32, as the plugin's, else a sliding window of pages), for each of
``--layers`` layers, ``--sequences`` prompts of ``--prompt`` random tokens stored at once, then ``--steps`` decode
steps of one token each: the store (``store_ragged`` / ``store_windowed``) and the attention
(``attention_ragged`` / ``attention_windowed``) of every layer, each layer handed the step's one flat batch as
vLLM's layers are, timed together. Printed: milliseconds a layer's step (a step's time over its layers; the median
of ``--repeats`` passes over the steps), and with ``--profile`` the functions that took the most time under
cProfile. One process, both threads.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompile import pages as P  # noqa: E402
from kvcompile.presets import named  # noqa: E402

POLICIES = ["int8", "tok+rot:4", "kivi-r0+rot+fp8s:4", "kivi+rot:4"]
RING = 32  # a ring's slots (vLLM's window cache of one page a sequence)


def engine(name: str, heads: int, head_dim: int, block: int, sequences: int, positions: int):
    """(layout, packed pages, table, window cache or None, its table, its page, ring) for one policy."""
    policy = named(name)
    win = P.needs_window(policy)
    lay = P.PageLayout(policy, heads, head_dim, "float32", block, window=win)
    per = -(-positions // block) + 1
    pages = torch.zeros(sequences * per, lay.page_bytes, dtype=torch.uint8)
    table = torch.arange(sequences * per, dtype=torch.int32).view(sequences, per)
    if not win:
        return lay, pages, table, None, None, 0, False
    ring = lay.window_tokens <= RING
    # a ring's slots: the window's positions, the kernels' own ring (``kvcompile.vllm.window``'s ``slots``)
    wblock = lay.window_tokens if ring else 32
    wper = 1 if ring else -(-positions // wblock) + 1
    window = torch.zeros(sequences * wper, heads, wblock, 2 * head_dim)
    return lay, pages, table, window, torch.arange(sequences * wper, dtype=torch.int32).view(sequences, wper), \
        wblock, ring


def step(layers: list, heads: int, qheads: int, head_dim: int, n: int, before: int, g) -> None:
    """One step of ``n`` tokens for every sequence, each having ``before`` positions stored, through every layer
    (``engine``'s, one each), all handed the step's flat batches."""
    lay, _, table, window, wtable, wblock, ring = layers[0]
    B = table.shape[0]
    T = B * n
    starts = torch.arange(0, T + 1, n)
    batch = P.Ragged.of(starts, torch.full((B,), before + n), table)
    wbatch = P.Ragged.of(starts, torch.full((B,), before + n), wtable) if window is not None else None
    for _, pages, _, window, *_ in layers:
        k, v = torch.randn(T, heads, head_dim, generator=g), torch.randn(T, heads, head_dim, generator=g)
        q = torch.randn(T, qheads, head_dim, generator=g)
        if window is None:
            P.store_ragged(lay, pages, k, v, batch)
            P.attention_ragged(lay, pages, q, None, None, batch)
        else:
            recent = P.store_windowed(lay, pages, window, wblock, k, v, batch, wbatch, ring=ring)
            P.attention_windowed(lay, pages, q, batch, recent)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1, help="layers a step runs (each its own pages)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="3,3,64", help="kv heads, query heads per kv head, head_dim (SmolLM2's)")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.sequences, a.prompt, a.steps, a.repeats, a.layers = 2, 40, 3, 1, 2
    H, G, D = (int(x) for x in a.shape.split(","))
    print(f"{'policy':<22}{'ms a layer step':>18}")
    out = []
    for name in a.policies:
        times = []
        for _ in range(a.repeats):
            g = torch.Generator().manual_seed(0)
            e = [engine(name, H, D, a.block, a.sequences, a.prompt + a.steps) for _ in range(a.layers)]
            step(e, H, H * G, D, a.prompt, 0, g)
            prof = cProfile.Profile() if a.profile else None
            t = time.perf_counter()
            if prof:
                prof.enable()
            for s in range(a.steps):
                step(e, H, H * G, D, 1, a.prompt + s, g)
            if prof:
                prof.disable()
            times.append((time.perf_counter() - t) / a.steps / a.layers)
        ms = statistics.median(times) * 1e3
        print(f"{name:<22}{ms:>18.2f}", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        out.append({"policy": name, "ms_per_step": ms, "layers": a.layers, "window": e[0][3] is not None,
                    "ring": e[0][6]})
    return out


if __name__ == "__main__":
    main()
