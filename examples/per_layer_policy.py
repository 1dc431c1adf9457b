"""A per-layer policy: most layers at 2 bits, the first at 8 bits and the last in full precision.

    python examples/per_layer_policy.py                       # the embedded SmolLM2
    python examples/per_layer_policy.py --model DIR --window 256

Prints each layer's resolved policy and bytes per token, then what the mix costs in held-out loss
(eager reference cache, the numerics kvcompile.apply computes).
"""
import argparse

from tqdm.auto import tqdm

from kvcompile import Policy, models
from kvcompile.accounting import bytes_per_token, full_precision_bytes_per_token
from kvcompile.evaluate import heldout_loss, heldout_windows
from kvcompile.hf import model_shape

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the embedded SmolLM2)")
ap.add_argument("--window", type=int, default=1024, help="held-out window in tokens (default: %(default)s)")
args = ap.parse_args()

model, tok = models.load(args.model)
layers, kv_heads, head_dim = model_shape(model.config)
policy = Policy.kivi(2, sink=4).override({
    0: Policy.kivi(8, sink=4),            # a layer index (negative counts from the end)
    -1: None,                             # None keeps that layer in full precision
    range(1, max(2, layers // 4)): Policy.kivi(4, sink=4),   # a range of indices
})
names = [f"model.layers.{i}.self_attn" for i in range(layers)]
for name, p in zip(names, policy.resolve(names)):
    print(f"{name:<28} {bytes_per_token(p, 1, kv_heads, head_dim, args.window):>8.1f} B/token  {p.key_str()}")
print(f"(bytes per token of a {args.window}-token sequence, its full-precision window and sinks included)")
mixed = bytes_per_token(policy, layers, kv_heads, head_dim, args.window)
full = full_precision_bytes_per_token(layers, kv_heads, head_dim)
print(f"whole model: {mixed:,.0f} B/token vs {full:,} in bf16 ({full / mixed:.2f}x smaller)")

W = heldout_windows(tok, args.window, 1)
runs = {"full precision": Policy.full(), "plain 2-bit KIVI": Policy.kivi(2), "per-layer mix": policy}
loss = {}
for label, p in tqdm(runs.items(), desc="held-out loss (one window each)"):  # about a minute each on 2 cores
    loss[label] = heldout_loss(model, W, p)[0]
for label in ("plain 2-bit KIVI", "per-layer mix"):
    print(f"{label:<18} loss delta {loss[label] - loss['full precision']:+.4f} nats/token")
