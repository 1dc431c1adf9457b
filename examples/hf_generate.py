"""kvcompile.apply on a Hugging Face model, then generate as usual: a chat of two turns in one growing cache.

    python examples/hf_generate.py                              # the embedded SmolLM2, 4-bit KIVI
    python examples/hf_generate.py --model DIR --compiler eager

Prints each reply, what the cache holds after each turn against a full-precision cache of the same tokens,
and kvcompile's report of the cache sites it rewrote.
"""
import argparse
import time

import torch

import kvcompile
from kvcompile import Policy, models
from kvcompile.accounting import full_precision_bytes_per_token
from kvcompile.hf import model_shape
from kvcompile.hf_model import cache_kwarg  # "cache" on transformers 5.2x, "past_key_values" before

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the embedded SmolLM2)")
ap.add_argument("--compiler", default="auto", choices=["auto", "inductor", "eager"],
                help="what compiles the rest of the graph (default: %(default)s)")
ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per reply (default: %(default)s)")
args = ap.parse_args()

model, tok = models.load(args.model)
policy = Policy.kivi(4, residual=32)
kvcompile.apply(model, policy, compiler=args.compiler)     # the same model object, its forward now compiled
p = next(model.parameters())
full_per_token = full_precision_bytes_per_token(*model_shape(model.config), dtype=p.dtype)

messages, cache, sequence = [], None, None
for turn in ("What is the capital of France?", "And the capital of Italy?"):
    messages.append({"role": "user", "content": turn})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    t0 = time.perf_counter()
    with torch.no_grad():
        # generate() creates the quantized cache itself; passing the previous turn's back continues it
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=tok.eos_token_id, **({cache_kwarg(model): cache} if cache else {}))
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # (named cache on transformers 5.2x)
    reply = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
    messages.append({"role": "assistant", "content": reply})
    print(f"user:      {turn}\nassistant: {reply}")
    print(f"           ({time.perf_counter() - t0:.1f} s; the first turn compiles the decode step, the second the "
          f"graph for a chunk into a filled cache; the cache holds "
          f"{cache.tokens} tokens in {kvcompile.nbytes(cache):,} bytes, full precision would be "
          f"{full_per_token * cache.tokens:,})")
print("(a short chat is mostly the policy's full-precision window of the newest tokens, here 63 per layer: the\n"
      " packed part, and with it the saving, grows with the conversation; see kvcompile plan for long ones)\n")
print(kvcompile.explain(model))
