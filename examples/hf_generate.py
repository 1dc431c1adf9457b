"""kvcompile.apply on a Hugging Face model, then generate: the cache is stored per the policy.

    python examples/hf_generate.py                              # the embedded SmolLM2, 4-bit KIVI
    python examples/hf_generate.py --model DIR --compiler eager
"""
import argparse
import time

import torch

import kvcompile
from kvcompile import Policy, models
from kvcompile.evaluate import cache_kwarg
from kvcompile.hf import KVCompileCache

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None)
ap.add_argument("--compiler", default="auto", choices=["auto", "inductor", "eager"])
ap.add_argument("--max-new-tokens", type=int, default=24)
args = ap.parse_args()

model, tok = models.load(args.model)
policy = Policy.kivi(4)
kvcompile.apply(model, policy, compiler=args.compiler)     # same model object, forward now compiled

msgs = [{"role": "user", "content": "What is the capital of France?"}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

# generate() creates a quantized cache by itself; passing one lets us look at it afterwards.
cache = KVCompileCache(model.config, policy, max_cache_len=ids.shape[1] + args.max_new_tokens,
                       batch_size=1, dtype=next(model.parameters()).dtype)
t0 = time.perf_counter()
with torch.no_grad():
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=args.max_new_tokens, do_sample=False)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"{time.perf_counter() - t0:.1f} s (compile included); cache holds {cache.nbytes:,} bytes")
print(kvcompile.explain(model))
