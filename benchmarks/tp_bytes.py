"""Per-rank KV cache bytes under tensor parallelism: a random Llama-3-shaped model (8 KV heads of 128) loaded
with ``from_pretrained(..., tp_plan="auto")`` on N ranks, ``kvcompile.apply``, a prompt prefilled through
``generate``; each rank's ``cache.nbytes`` against the unsharded model's (same prompt, one process) and the
planner's bytes per GPU (``kvcompile plan --tp N``).

    python benchmarks/tp_bytes.py                         # 2 ranks, gloo on the CPU (torchrun underneath)
    python benchmarks/tp_bytes.py --world 4 --prompt 4096
    python benchmarks/tp_bytes.py --device cuda --world 2 # NCCL, one GPU per rank

A rank's cache is its stores (1/N of the heads) plus what does not shrink with heads: per layer and
sequence an int32 length and an int32 block-table entry per block, and the two stand-ins' B + C + D - 3
elements. The table shows that constant and the planner's per-GPU bytes (stores only, no stand-ins).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

POLICIES = {
    "full": lambda P: P.full(),
    "int8": lambda P: P.int8(),
    "fp8 R128": lambda P: P.fp8(),
    "KIVI 4-bit": lambda P: P.kivi(4),
    "KIVI 2-bit +rot +sink4": lambda P: P.kivi(2, sink=4, rotate=True),
}
SMOKE = dict(layers=2, kv_heads=2, head_dim=32, prompt=40, policies=["KIVI 2-bit +rot +sink4"])


def save_model(folder: Path, layers: int, kv_heads: int, head_dim: int) -> None:
    """Llama 3's attention geometry (GQA: 2 query heads per KV head), few layers, random weights; a narrow
    residual stream and MLP (the cache does not depend on them) keep the weights small."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    heads = 2 * kv_heads
    cfg = LlamaConfig(vocab_size=256, hidden_size=min(1024, heads * head_dim), intermediate_size=512,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=65536, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def measure(model, policy, prompt: int, device) -> dict:
    """Prefill ``prompt`` tokens through generate (one new token: nothing is decoded into the cache)."""
    import kvcompile
    model = kvcompile.apply(model, policy, prefill="eager")  # the prefill runs without a compile
    ids = torch.randint(3, 256, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        cache = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False,
                               return_dict_in_generate=True).past_key_values
    return {"nbytes": cache.nbytes, "stores": sum(layer.store.nbytes for layer in cache.layers),
            "heads": cache.layers[0].store.spec.heads}


def rank_run(args) -> None:
    """One rank (under torchrun): the sharded model per policy; rank 0 also the unsharded one."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from kvcompile import Policy
    backend = "nccl" if args.device == "cuda" else "gloo"
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    got = {}
    for name in args.policies:
        policy = POLICIES[name](Policy)
        model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", attn_implementation="sdpa").eval()
        got[name] = {"rank": measure(model, policy, args.prompt, device)}
        if rank == 0:
            whole = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(device).eval()
            got[name]["unsharded"] = measure(whole, policy, args.prompt, device)
        dist.barrier()
    Path(args.rank_run, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (default: %(default)s)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="gloo on the CPU, or NCCL")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=2048, help="tokens prefilled (default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--smoke", action="store_true", help="a tiny model, two policies (the test suite runs this)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds the ranks may take (default: %(default)s)")
    ap.add_argument("--rank-run", default=None, help=argparse.SUPPRESS)  # (one rank, under torchrun)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_run:
        rank_run(args)
        return []
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model")
        save_model(model, args.layers, args.kv_heads, args.head_dim)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
               __file__, "--rank-run", tmp, "--model", str(model), "--device", args.device,
               "--prompt", str(args.prompt), "--policies", *args.policies]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"the ranks failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        ranks = [json.loads(Path(tmp, f"{i}.json").read_text()) for i in range(args.world)]
    return report(args, ranks)


def report(args, ranks: list[dict]) -> list[dict]:
    from kvcompile import Policy
    from kvcompile import plan as P
    es = 4  # float32 weights and cache
    whole = P.ModelShape("bench", args.layers, args.kv_heads, args.head_dim, 0.0, dtype_bytes=es)
    N = args.world
    print(f"Llama-3-shaped random model: {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, fp32, "
          f"{args.prompt}-token prompt, {N} ranks ({'NCCL' if args.device == 'cuda' else 'gloo'}), bytes:")
    print(f"{'policy':<24}{'unsharded':>12}{'per rank':>12}{'unsharded/N':>13}{'+ const':>10}{'planned/GPU':>13}"
          f"{'rank stores':>13}")
    rows = []
    for name in args.policies:
        unsharded = ranks[0][name]["unsharded"]["nbytes"]
        per_rank = [r[name]["rank"]["nbytes"] for r in ranks]
        stores = [r[name]["rank"]["stores"] for r in ranks]
        planned = int(P.sequence_bytes_expr(POLICIES[name](Policy), P.shard(whole, N)).subs(P.C, args.prompt))
        row = dict(policy=name, world=N, unsharded=unsharded, per_rank=per_rank, rank_stores=stores,
                   heads=[r[name]["rank"]["heads"] for r in ranks], planned_per_gpu=planned,
                   constant=max(per_rank) - unsharded / N)
        rows.append(row)
        same = f"{per_rank[0]:,}" if len(set(per_rank)) == 1 else "/".join(f"{b:,}" for b in per_rank)
        print(f"{name:<24}{unsharded:>12,}{same:>12}{unsharded / N:>13,.0f}{row['constant']:>10,.0f}"
              f"{planned:>13,}{stores[0]:>13,}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
