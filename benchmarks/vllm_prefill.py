"""Prompt processing through vLLM, side by side in one run: how long a batch of prompts takes to prefill.

    /path/to/vllm-env/bin/python benchmarks/vllm_prefill.py --model $MODEL \
        --only "vLLM fp8" "kvcompile fp8-tensor" "kvcompile fp8-tensor+rot" --out prefill.json

Each contender (``benchmarks/vllm_side_by_side.py``'s labels) gets a fresh engine in a child process: an ``LLM``
with the engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's default front-end process
takes a core of its own, which on a 2-core machine halves every contender's rate alike), ``--dtype`` (float32),
``--kv-mib`` of KV memory. It generates one token for each of ``--prompts`` random prompts of ``--tokens`` tokens
(greedy), once to warm up (vLLM compiles its graphs for the first batch shapes), then ``--reps`` times: the
seconds of each timed run, and prompt tokens per second at their median. Every run has prompts of its own: a
prompt seen before would be served from vLLM's prefix cache (on by default) and only its last token computed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def contenders() -> dict:
    from benchmarks.vllm_side_by_side import CONTENDERS
    return {label: (policy, engine) for label, policy, engine in CONTENDERS}


def one(args) -> dict:
    """In the child: one contender's engine, its warm-up and its timed runs."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    policy, engine = contenders()[args.child]
    block = engine.get("min_block", {}).get(args.dtype)  # a page the contender needs in this dtype
    engine = {k: v for k, v in engine.items() if k != "min_block"} | ({"block_size": block} if block else {})
    extra = {"additional_config": {"kvcompile": {"policy": policy}}} if policy else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.tokens + 1, seed=0,
              kv_cache_memory_bytes=args.kv_mib << 20, enforce_eager=args.eager, disable_log_stats=False, **engine,
              **extra)

    def hits():  # prompt tokens vLLM's prefix cache has served so far
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    vocab = llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)

    def fresh():  # prompts no run has seen: vLLM's prefix cache (on by default) would serve a repeated one
        return [TokensPrompt(prompt_token_ids=torch.randint(10, vocab - 10, (args.tokens,), generator=g).tolist())
                for _ in range(args.prompts)]
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(fresh(), sp, use_tqdm=False)
    seconds, served = [], hits()
    for _ in range(args.reps):
        prompts = fresh()
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    med = statistics.median(seconds)
    return {"seconds": seconds, "prompt_tokens_per_s": args.prompts * args.tokens / med,
            "prefix_cache_hits": hits() - served}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--only", nargs="*", default=["vLLM fp8", "kvcompile fp8-tensor", "kvcompile fp8-tensor+rot"])
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (no graph compilation)")
    ap.add_argument("--timeout-s", type=int, default=900, help="each contender's limit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return {}
    known = contenders()
    unknown = [c for c in args.only if c not in known]
    if unknown:
        ap.error(f"unknown contenders {unknown}; choose among {list(known)}")
    base = list(argv if argv is not None else sys.argv[1:])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    results = []
    for i, label in enumerate(args.only, 1):
        print(f"[{i}/{len(args.only)}] {label} ...", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, *base, "--child", label], env=env, capture_output=True,
                           text=True, timeout=args.timeout_s)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        row = {"label": label, **(json.loads(line[-1][7:]) if line else
                                  {"failed": (r.stderr or r.stdout)[-2000:], "returncode": r.returncode})}
        row["wall_s"] = time.perf_counter() - t0
        results.append(row)
        print(f"    {json.dumps({k: v for k, v in row.items() if k != 'failed'})}", flush=True)
    out = {"command": "benchmarks/vllm_prefill.py " + " ".join(base), "date": time.strftime("%Y-%m-%d"),
           "results": results}
    print("\n| contender | seconds (each run) | prompt tokens/s | prompt tokens from the prefix cache |\n"
          "|---|---|---:|---:|")
    for r in results:
        if "seconds" in r:
            runs = " / ".join(f"{s:.2f}" for s in r["seconds"])
            print(f"| {r['label']} | {runs} | {r['prompt_tokens_per_s']:,.0f} | {r['prefix_cache_hits']:,} |")
        else:
            print(f"| {r['label']} | failed: {r['failed'][-200:]!r} | | |")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
