"""Does centering the keys help per-token low-bit keys? Attention is unchanged when one vector is subtracted from
every key a query reads (each score drops by the same q . mu, which softmax ignores), so keys can be stored as
``k - mu`` for free; SmolLM2's post-RoPE keys carry a large common offset (its norm is about 0.6-0.8 of a key's,
``offset_over_key_norm`` per layer in the output), which a per-token scale spends its range on. A modest result, kept so that it can be run again (docs/results.md,
"Serving").

``mu``: per layer and KV head, the mean post-RoPE key over the calibration text (``kvcompile calibrate``'s).
Every key the held-out protocol feeds through the cache -- stored, and the chunk's own ones attended in full
precision -- is shifted by it (the full-precision loss is unchanged: checked below).

    python benchmarks/key_centering.py full tok+rot:4 tok+rot+sym:4 tok+rot:3 tok+rot:2 kivi+rot+sink:4 \\
        --out benchmarks/results/eval_serving/key_centering.json
"""
from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvcompile import evaluate as E
from kvcompile import models
from kvcompile.calibrate import calibration_windows
from kvcompile.policy import Policy


def key_means(model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean post-RoPE key per layer, KV head and channel over ``windows`` (float32 ``[L, H, D]``), and the
    mean key norm per layer and KV head (``[L, H]``)."""
    total, norms, n = 0, 0, 0
    with torch.no_grad():
        for w in tqdm(windows, desc="key means", leave=False):
            cache = DynamicCache()
            model(w[None], past_key_values=cache, use_cache=True)
            keys = torch.stack([layer.keys[0].double() for layer in cache.layers])  # [L, H, T, D]
            total, norms, n = total + keys.sum(2), norms + keys.norm(dim=-1).sum(2), n + w.numel()
    return (total / n).float(), (norms / n).float()


def centered(make_cache, mu: torch.Tensor):
    """``evaluate.make_cache`` whose caches store (and attend) every key less its layer's ``mu``."""
    def make(model, policy, n, fast):
        cache = make_cache(model, policy, n, fast)
        update = cache.update

        def shifted(k, v, layer, *a, **kw):
            return update(k - mu[layer].view(1, -1, 1, k.shape[-1]).to(k.dtype), v, layer, *a, **kw)

        cache.update = shifted
        return cache
    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("entries", nargs="+", help="full or SCHEME:BITS, as kvcompile eval takes them")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = models.load(log=lambda *a: None)
    mu, norms = key_means(model, calibration_windows(tok))
    offset = (mu.norm(dim=-1) / norms).mean(1)  # per layer: the common offset's norm over a key's
    windows = E.heldout_windows(tok)
    plain = E.make_cache
    rows = []
    try:
        for entry in args.entries:
            policy = Policy.full() if entry == "full" else E.scheme_policy(*E.parse_entry(entry))
            row = {"entry": entry, "policy": str(policy)}
            for key, make in (("loss", plain), ("loss_centered", centered(plain, mu))):
                E.make_cache = make
                with torch.no_grad():
                    losses = E.heldout_loss(model, windows, policy, progress=True)
                row[key] = sum(losses) / len(losses)
                row[key + "_windows"] = losses
            rows.append(row)
            print(f"{entry:18s} loss {row['loss']:.5f}  centered {row['loss_centered']:.5f}", flush=True)
    finally:
        E.make_cache = plain
    full = next((r for r in rows if r["entry"] == "full"), None)
    if full is not None:
        assert abs(full["loss"] - full["loss_centered"]) < 1e-4, "centering changed the full-precision loss"
        for r in rows:
            r["delta"], r["delta_centered"] = r["loss"] - full["loss"], r["loss_centered"] - full["loss"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"offset_over_key_norm": offset.tolist(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
