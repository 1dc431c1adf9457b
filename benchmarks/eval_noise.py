"""How far a float32-sized change of the model moves a quantized policy's held-out loss: the noise floor under
which two implementations of one model (vLLM's and transformers') cannot agree on a policy's quality.

    python -m benchmarks.eval_noise int8:8 tok+rot:4 [--scale 1e-7] [--windows 4] [--out FILE]

For each entry (``SCHEME:BITS`` or a policy file), ``kvcompile eval``'s held-out loss (``own="stored"``, every
position read as stored, as vLLM's pages are read) on SmolLM2 in float32, then again with every weight multiplied
by ``1 + scale * N(0, 1)`` (seeded): the change of each window's loss. In full precision a change of 1e-7 moves
the loss by less than 1e-5; under a quantized cache it moves a key across a code's rounding boundary now and then,
and the next layers carry the change on. docs/vllm.md ("Quality through vLLM") cites it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("entries", nargs="+", help="SCHEME:BITS or policy files (full precision is measured too)")
    ap.add_argument("--scale", type=float, default=1e-7, help="relative size of the change of each weight")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from kvcompile import Policy, models
    from kvcompile.evaluate import entry_policy, heldout_loss, heldout_windows

    model, tok = models.load(dtype=torch.float32)
    W = heldout_windows(tok, args.window, args.windows)
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(args.seed)
    noise = [torch.randn(p.shape, generator=gen) for p in params]
    out = {"scale": args.scale, "windows": args.windows, "window": args.window, "seed": args.seed, "rows": {}}
    for entry in ["full"] + args.entries:
        pol = Policy.full() if entry == "full" else entry_policy(entry, model.config)[2]
        base = heldout_loss(model, W, pol, own="stored")
        with torch.no_grad():
            for p, n in zip(params, noise):
                p.mul_(1 + args.scale * n)
        moved = heldout_loss(model, W, pol, own="stored")
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        change = [b - a for a, b in zip(base, moved)]
        out["rows"][entry] = {"loss": base, "loss_changed": moved, "change": change}
        print(f"{entry:>24}  change a window " + " ".join(f"{c:+.5f}" for c in change)
              + f"  mean {sum(change) / len(change):+.5f}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
