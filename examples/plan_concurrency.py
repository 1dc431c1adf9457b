"""How many concurrent sequences fit beside a model on one GPU, for each KV cache policy.

    python examples/plan_concurrency.py                        # Llama 3 8B on an 80 GB GPU, 8K context
    python examples/plan_concurrency.py --preset llama3-70b --context 4096
"""
import argparse

from kvcompile import Policy
from kvcompile import plan as P

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="llama3-8b", choices=sorted(P.PRESETS))
ap.add_argument("--gpu-gb", type=float, default=80)
ap.add_argument("--context", type=int, default=8192)
ap.add_argument("--plot", default=None)
args = ap.parse_args()

shape = P.PRESETS[args.preset]
avail = P.available_bytes(args.gpu_gb * P.GB, 0.9, shape.weight_bytes)
policies = {
    "ideal 16-bit": 16,                                   # the textbook count: bits/8 bytes, nothing else
    "ideal 4-bit": 4,
    "KIVI 4-bit": Policy.kivi(4),                         # the exact layout: scales, zero points, residual
    "KIVI 2-bit, first layer 8-bit": Policy.kivi(2).override({0: Policy.kivi(8)}),
}
rows = P.plan(shape, args.context, available=avail, policies=policies)
print(P.format_table(rows, shape, args.context, avail))

# The count is a sympy expression: bytes per sequence as a function of the context length C.
print("bytes per sequence, KIVI 4-bit:", P.sequence_bytes_expr(Policy.kivi(4), shape))
if args.plot:
    print("wrote", P.plot(shape, avail, args.plot, policies))
