"""generate_batch on SmolLM2 (the embedded model, float32, CPU): transformers' own continuous batching against
the same engine over kvcompile's cache, one process, same prompts, same configuration.

    python -m benchmarks.serve_batch [--requests 8] [--new 32] [--threads 1]

Reports per contender: wall time, generated tokens/s, and (kvcompile) the tokens that agree with
transformers' own engine. Mixed prompt lengths (16..400 tokens), greedy decoding, max_batch_tokens=256.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def random_prompts(n: int, shortest: int, longest: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """``n`` prompts of random token ids, their lengths spread evenly from ``shortest`` to ``longest``:
    ``(lengths, prompts)``."""
    g = torch.Generator().manual_seed(seed)
    lengths = [shortest + ((longest - shortest) * i) // max(1, n - 1) for i in range(n)]
    return lengths, [torch.randint(100, 20000, (k,), generator=g).tolist() for k in lengths]


def greedy(new: int):
    """``new`` greedy tokens a request, never ended early (no end-of-sequence token)."""
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    from kvcompile import Policy
    from kvcompile.models import load

    _, prompts = random_prompts(args.requests, 16, 400)
    gen = greedy(args.new)

    def cbc():
        return ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256)

    rows, want = [], None
    for name, policy in (("transformers", None), ("kvc-full", Policy.full()), ("kvc-int8", Policy.int8()),
                         ("kvc-kivi4", Policy.kivi(4))):
        model, _ = load(None, log=lambda *a: None)
        if policy is not None:
            model = kvcompile.apply(model, policy)
        with torch.no_grad():
            t = time.perf_counter()
            out = model.generate_batch(prompts, gen, continuous_batching_config=cbc(), progress_bar=False)
            wall = time.perf_counter() - t
        toks = [r.generated_tokens for r in out.values()]
        assert all(r.error is None for r in out.values())
        if want is None:
            want = toks
        same = sum(a == b for x, y in zip(toks, want) for a, b in zip(x, y)) / sum(map(len, want))
        rows.append(dict(contender=name, wall_s=round(wall, 2), tok_s=round(sum(map(len, toks)) / wall, 1),
                         agree=round(same, 3)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
