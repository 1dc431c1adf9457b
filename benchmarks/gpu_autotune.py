"""Choose the decode kernel's tile per layout on a GPU, and keep the choice in templates/decode_configs.json.

    python benchmarks/gpu_autotune.py --budget 300 --out $OUT/decode_configs.json   # on a CUDA machine
    python benchmarks/gpu_autotune.py --write                  # ... and rewrite templates/decode_configs.json
    python benchmarks/gpu_autotune.py --smoke                  # the candidates and their order, no GPU

For each timed format (``gpu_kernels.FORMATS``: fp8, int8, int4, int2, KIVI int4/int2) at head_dim 128 and 4
query heads per KV head, every candidate tile (BLOCK_N tokens, warps, pipeline stages) is compiled as
``launch.attention`` launches it; one that spills registers is rejected (the compiled kernel's own count),
the others are timed at batch 8 x 32K (CUDA-graph medians, ``gpu_kernels.bench``) and the fastest is kept,
with its time and the runner-up's. Candidates run in the order the static model ranks them
(``benchmarks/gpu_sass.py``: fewest loop instructions per byte first) until ``--budget`` seconds are spent, so
a short call still times the likeliest ones. The table records the card, the date and the versions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CANDIDATES = [(bn, w, s) for bn in (64, 128, 256, 32) for w in (4, 8) for s in (3, 2, 4)]


def ranked(name: str, table: dict) -> list[tuple[int, int, int]]:
    """The candidates, the static table's choice for this layout first, then by bytes per tile nearest the
    rule's (``tile_bytes``), then fewer warps and the default stages."""
    from gpu_kernels import FORMATS
    from kvcompile.store import LayerSpec
    from kvcompile.templates import decode

    spec = LayerSpec(FORMATS[name], 8, 128, "bfloat16")
    key = config_key(spec)
    first = table["configs"].get(key)
    per_token = (spec.policy.key.bits + spec.policy.value.bits) * 128 // 8
    want = table["default"]["tile_bytes"]
    order = sorted(CANDIDATES, key=lambda c: (abs(c[0] * per_token - want), c[1], abs(c[2] - 3)))
    if first:
        top = (first["block_n"], first["warps"], first["stages"])
        order = [top] + [c for c in order if c != top]
    return order


def config_key(spec) -> str:
    from kvcompile.templates import decode
    return f"{decode.format_key(spec.policy.key)}/{decode.format_key(spec.policy.value)};D={spec.head_dim};G=4"


def spills(name: str, tile) -> int | None:
    """Bytes of stack (spilled registers) of the compiled decode kernel for this tile, None off CUDA."""
    if not torch.cuda.is_available():
        return None
    from gpu_sass import compiled_decode
    from gpu_kernels import FORMATS

    _, c, _, _ = compiled_decode(FORMATS[name], 128, 4, "decode", tile=tile)
    c._init_handles()
    return int(c.n_spills)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=300.0, help="seconds to spend (the call stops cleanly)")
    ap.add_argument("--formats", nargs="+", default=None)
    ap.add_argument("--out", default=None, help="write the new table here")
    ap.add_argument("--write", action="store_true", help="rewrite templates/decode_configs.json")
    ap.add_argument("--smoke", action="store_true", help="list the candidates in order; time nothing")
    args = ap.parse_args(argv)
    from gpu_kernels import FORMATS, bench, filled_state
    from kvcompile.store import LayerSpec
    from kvcompile.templates import decode, launch

    started = time.time()
    with open(decode.CONFIGS) as f:
        table = json.load(f)
    names = args.formats or list(FORMATS)
    results = {}
    if args.smoke or not torch.cuda.is_available():
        for name in names:
            print(name, ranked(name, table)[:6])
        return {}
    card = torch.cuda.get_device_name()
    B, ctx, Hq, H, D = 8, 32768, 32, 8, 128
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device="cuda")
    order = {n: ranked(n, table) for n in names}
    per_format = args.budget / max(1, len(names))
    for name in names:
        spec = LayerSpec(FORMATS[name], H, D, "bfloat16", max(64, FORMATS[name].flush))
        state = filled_state(spec, "cuda", B, ctx)
        times = {}
        t0 = time.time()
        saved = decode.tile_config
        for tile in order[name]:
            if time.time() - t0 > per_format or time.time() - started > args.budget:
                break
            try:
                spilled = spills(name, tile)
                if spilled:
                    print(f"{name} {tile}: rejected, spills {spilled} B", flush=True)
                    continue
                decode.tile_config = lambda *a, _t=tile: dict(block_n=_t[0], warps=_t[1], stages=_t[2],
                                                             source="autotune")
                times[tile] = bench(lambda: launch.attention(q, state, spec), False)
                print(f"{name} {tile}: {times[tile]:.4f} ms", flush=True)
            except Exception as e:  # a tile that fails to compile or launch is reported and skipped
                print(f"{name} {tile}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
            finally:
                decode.tile_config = saved
        del state
        torch.cuda.empty_cache()
        if times:
            best = sorted(times, key=times.get)
            results[config_key(spec)] = {"block_n": best[0][0], "warps": best[0][1], "stages": best[0][2],
                                         "why": f"autotune: {times[best[0]]:.4f} ms at batch 8 x 32K"
                                                + (f", next {best[1]} {times[best[1]]:.4f} ms" if len(best) > 1 else "")
                                                + f"; {len(times)} tiles timed"}
    new = dict(table)
    new["configs"] = {**table["configs"], **results}
    new["source"] = (f"autotune on {card}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
                     f"triton {__import__('triton').__version__} ({len(results)} layouts timed)")
    text = json.dumps(new, indent=2) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.write:
        with open(decode.CONFIGS, "w") as f:
            f.write(text)
    print(text)
    return new


if __name__ == "__main__":
    main()
