"""kvcompile under tensor parallelism: a model loaded with ``tp_plan="auto"``, then ``kvcompile.apply``.

    torchrun --nproc_per_node 3 examples/generate_tp.py                  # the embedded SmolLM2 (3 KV heads)
    torchrun --nproc_per_node 2 examples/generate_tp.py --model DIR      # a model whose KV heads 2 ranks split

Every rank runs this script with the same prompt; transformers shards the attention heads over the ranks
(gloo on the CPU, NCCL on GPUs), and each rank's kvcompile cache keeps the KV heads its attention computes.
Each rank prints its cache's bytes (its share of the KV heads: about 1/N of an unsharded cache); rank 0
prints the reply, which every rank generated alike.
"""
import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvcompile
from kvcompile import Policy, models

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the embedded SmolLM2)")
ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens in the reply (default: %(default)s)")
ap.add_argument("--prompt", default="What is the capital of France?")
args = ap.parse_args()

if "RANK" not in os.environ:
    ap.error("run it under torchrun: torchrun --nproc_per_node N examples/generate_tp.py")
# rank 0 converts the embedded model once (the first run only) while the others wait for it
path = models.resolve(args.model) if os.environ["RANK"] == "0" else None
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
dist.barrier()
path = path or models.resolve(args.model, log=lambda *a: None)

tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="sdpa").eval()
kvcompile.apply(model, Policy.kivi(4, sink=4, rotate=True))

messages = [{"role": "user", "content": args.prompt}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    out = model.generate(ids.to(model.device), max_new_tokens=args.max_new_tokens, do_sample=False,
                         return_dict_in_generate=True)
cache = getattr(out, "cache", None) or out.past_key_values
rank, world = dist.get_rank(), dist.get_world_size()
# One write per line (the newline inside it, end=""): under PYTHONUNBUFFERED print's separate write of its end
# lets the ranks' lines interleave on the shared stdout.
print(f"rank {rank} of {world}: cache {kvcompile.nbytes(cache):,} bytes\n", end="", flush=True)
dist.barrier()
if rank == 0:
    print("reply:", tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True), flush=True)
    print("tokens:", out.sequences[0, ids.shape[1]:].tolist(), flush=True)
dist.destroy_process_group()
