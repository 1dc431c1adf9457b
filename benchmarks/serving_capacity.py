"""Serving capacity: for one byte budget, the tokens and concurrent requests kvcompile's serving pool holds
against transformers' own ``PagedAttentionCache``, counted from the tensors each allocates.

    python benchmarks/serving_capacity.py                     # SmolLM2-135M's shape, bf16, 256 MiB, 1K requests
    python benchmarks/serving_capacity.py --budget-mib 256 --request-tokens 1024 \\
        --out benchmarks/results/serving_capacity.json

For each policy ``kvcompile.serving.capacity`` allocates both caches on the CPU (the cache tensors only, no
weights: a config of the model's shape) and counts: kvcompile's pool blocks x block tokens and its slots
(sized to the most requests of ``--request-tokens`` tokens the budget holds; each slot's full-precision ring
and sinks are paid out of the budget), transformers' pages x page size; a request takes ``ceil(tokens /
page)`` pages in transformers' cache and the pages its store writes in kvcompile's (``request_pages``).
Each row is also checked against ``kvcompile plan --serving``'s prediction from the layout formulas
(``kvcompile.plan.serving_pool``): the script fails if they differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

# SmolLM2-135M's cache geometry: 30 layers, 3 KV heads of 64 (hidden 576, 9 query heads)
SMOL = dict(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
# the issue's bars: tokens and requests over transformers' cache, by the serving policy's width
BARS = {8: 1.9, 4: 3.5, 2: 6.0}


def policies():
    """(label, policy, bar or None): the serving policies at 8/4/2 bits, then the policies with a window."""
    from kvcompile import Policy
    from kvcompile.evaluate import scheme_policy

    return [
        ("tok+rot+sym:8 (int8 sym, per token-head)", scheme_policy("tok+rot+sym", 8), BARS[8]),
        ("fp8 e4m3, R=0 (fp8-r0, fp8-r0+rot)", Policy.fp8(residual=0), BARS[8]),
        ("tok+rot:4 (int4 asym, per token-head)", scheme_policy("tok+rot", 4), BARS[4]),
        ("tok+rot+sym:4", scheme_policy("tok+rot+sym", 4), BARS[4]),
        ("tok+rot:3", scheme_policy("tok+rot", 3), None),
        ("tok+rot:2 (int2 asym, per token-head)", scheme_policy("tok+rot", 2), BARS[2]),
        ("int8 (Policy.int8: asym, R=0)", Policy.int8(), BARS[8]),
        ("fp8 e4m3, R=128 (Policy.fp8)", Policy.fp8(), BARS[8]),
        ("KIVI int4 G32 R128", Policy.kivi(4), BARS[4]),
        ("kivi+rot+sink:4", Policy.kivi(4, sink=4, rotate=True), BARS[4]),
        ("KIVI int2 G32 R128", Policy.kivi(2), BARS[2]),
        ("kivi+rot+sink:2", Policy.kivi(2, sink=4, rotate=True), BARS[2]),
        ("full (Policy.full)", Policy.full(), None),
    ]


def main(argv=None) -> list[dict]:
    from transformers import LlamaConfig

    from kvcompile import plan as P
    from kvcompile import serving

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-mib", type=int, default=256, help="the byte budget, MiB (default: %(default)s)")
    ap.add_argument("--request-tokens", type=int, default=1024, help="tokens per request (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model's dtype (default: %(default)s)")
    ap.add_argument("--page-size", type=int, default=256,
                    help="transformers' page size in tokens (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (default: none)")
    args = ap.parse_args(argv)

    cfg = LlamaConfig(**SMOL)
    dtype = getattr(torch, args.dtype)
    budget = args.budget_mib * 2**20
    shape = replace(P.shape_from_config(cfg, 0, "SmolLM2-135M"),
                    dtype_bytes=torch.empty((), dtype=dtype).element_size())
    rows = []
    for label, pol, bar in policies():
        r = serving.capacity(cfg, pol, budget, dtype, request_tokens=args.request_tokens, page_size=args.page_size)
        ours, theirs = r["kvcompile"], r["transformers"]
        planned = P.serving_pool(label, pol, shape, budget, args.request_tokens)
        if (planned.blocks, planned.slots, planned.requests, planned.nbytes) != (
                ours["blocks"], ours["slots"], ours["requests"], ours["allocated"]):
            sys.exit(f"{label}: kvcompile plan --serving predicts {planned} but the allocation holds {ours}")
        rows.append(dict(label=label, policy=str(pol), bar=bar, kvcompile=ours, transformers=theirs,
                         token_ratio=r["token_ratio"], request_ratio=r["request_ratio"],
                         meets_bar=None if bar is None else r["token_ratio"] >= bar and r["request_ratio"] >= bar))
    t = rows[0]["transformers"]
    print(f"SmolLM2-135M's shape, {args.dtype}, {args.budget_mib} MiB, {args.request_tokens}-token requests; "
          f"transformers' PagedAttentionCache: {t['blocks']} pages of {t['page_size']} = {t['tokens']:,} tokens, "
          f"{t['requests']} requests\n")
    print("| policy | slots | pool blocks | tokens | × tokens | requests | × requests | bar | met |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        o = r["kvcompile"]
        met = "" if r["bar"] is None else ("yes" if r["meets_bar"] else "no")
        print(f"| {r['label']} | {o['slots']} | {o['blocks']:,} | {o['tokens']:,} | {r['token_ratio']:.2f} | "
              f"{o['requests']} | {r['request_ratio']:.2f} | {'' if r['bar'] is None else r['bar']} | {met} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(budget_bytes=budget, request_tokens=args.request_tokens,
                                                  dtype=args.dtype, rows=rows), indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
