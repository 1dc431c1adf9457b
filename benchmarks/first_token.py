"""Time to the first token after ``kvcompile.apply`` on SmolLM2, and what later prompts of new lengths cost.

    python benchmarks/first_token.py                     # KIVI 4-bit, prompts of 5 lengths up to 4K tokens
    python benchmarks/first_token.py --policy int8 --lengths 50 400 3000 --out benchmarks/results/first_token.json

Each row: a prompt of that many tokens, generate(max_new_tokens=1) (the first token), then
generate(max_new_tokens=8) on the same prompt (the decode steps); seconds for each, and how many graphs Dynamo
had compiled after it (torch._dynamo's counters). The first row pays the compilation: Dynamo traces the prefill
(and the first decode call, the decode graph), kvcompile's C kernels build (about a second each, cached on
disk, so a second run of this script skips them). Later rows compile nothing: the prompt length and the cache
size are dynamic dimensions of the two graphs. The unmodified model's eager prefill is timed beside each row
for scale.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils
from tqdm.auto import tqdm

import kvcompile
from kvcompile import models
from kvcompile.cli import _entry_policy

FILLER = ("The history of the printing press begins with movable type, and every page that followed "
          "carried the marks of the people who set it by hand. ")


def prompt_ids(tok, n: int) -> torch.Tensor:
    ids = tok(FILLER * (n // 10 + 2), return_tensors="pt")["input_ids"][:, :n]
    assert ids.shape[1] == n, (ids.shape, n)
    return ids


def timed(fn):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the embedded SmolLM2)")
    ap.add_argument("--policy", default="kivi:4", help="a policy as `kvcompile demo --policy` takes it "
                                                       "(default: %(default)s)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 500, 1500, 2500, 4000],
                    help="prompt lengths, in order (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = _entry_policy(args.policy)
    model, tok = models.load(args.model)
    plain, _ = models.load(args.model)
    t0 = time.perf_counter()
    kvcompile.apply(model, policy)
    apply_s = time.perf_counter() - t0
    dynamo_utils.counters.clear()
    rows = []
    for i, n in enumerate(tqdm(args.lengths, desc="prompt lengths")):
        ids = prompt_ids(tok, n)
        _, first = timed(lambda: model.generate(ids, max_new_tokens=1, do_sample=False))
        g1 = dynamo_utils.counters["stats"]["unique_graphs"]
        _, steps = timed(lambda: model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False))
        g2 = dynamo_utils.counters["stats"]["unique_graphs"]
        _, eager = timed(lambda: plain(ids))
        rows.append(dict(prompt=n, first_token_s=round(first, 2), generate_8_s=round(steps, 2),
                         graphs_after_first=g1, graphs_after_8=g2, unmodified_prefill_s=round(eager, 2)))
    print(f"kvcompile.apply({policy}) took {apply_s:.2f} s; then, per prompt:")
    print(f"{'prompt':>7} {'first token s':>14} {'generate 8 s':>13} {'graphs':>7} {'unmodified prefill s':>21}")
    for r in rows:
        print(f"{r['prompt']:>7} {r['first_token_s']:>14.2f} {r['generate_8_s']:>13.2f} {r['graphs_after_8']:>7} "
              f"{r['unmodified_prefill_s']:>21.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(policy=str(policy), apply_s=apply_s, threads=torch.get_num_threads(),
                                                  rows=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
