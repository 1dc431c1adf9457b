"""How often a greedy reply differs between a request run alone and the same request beside others, on SmolLM2
(the embedded model, float32, CPU, kvcompile's continuous batching: ``generate_batch``, the engine ``kvcompile
serve`` runs). docs/usage.md, "What a batch changes", cites it.

    python -m benchmarks.batch_invariance [--requests 12] [--new 32] [--threads 1] [--record]

Each row: a policy, the forward's token budget (``max_batch_tokens``: 2048 prefills every prompt whole, 256
cuts the longer ones into chunks), and whether the model's linear layers are computed in float64 and rounded
once to float32 (``--exact``: a row's products then no longer depend on how many rows the product has, which
torch's float32 CPU products do). Each prompt is generated alone (one ``generate_batch`` call each), then all
together in one call; ``differ`` counts the prompts whose tokens are not the same. Prompts: random token ids,
lengths spread over 40..600; no prefix sharing (random prompts share no pages anyway).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

CONFIGS = (("full", 2048, False), ("tok+rot:4", 2048, False), ("tok+rot:4", 2048, True), ("tok+rot:4", 256, True),
           ("tok+rot:4", 256, False))


def exact_products(model):
    """``model`` with its linear layers computed in float64 and rounded once to its float32: what a row gets no
    longer depends on the other rows of the product. (torch's float32 products on the CPU do -- one row alone,
    two and four rows give other last bits --, in the unmodified model and in transformers' engine alike: the
    model's own dependence on the batch; tests/test_serving.py takes it away to see kvcompile's.)"""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            def forward(x, m=m):
                bias = None if m.bias is None else m.bias.double()
                return torch.nn.functional.linear(x.double(), m.weight.double(), bias).to(x.dtype)
            m.forward = forward
    return model


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (a fixed count: its products' bits "
                    "may follow it)")
    ap.add_argument("--record", action="store_true", help="add the table to docs/results.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    from benchmarks.serve_batch import greedy, random_prompts
    from kvcompile.models import load
    from kvcompile.presets import named

    lengths, prompts = random_prompts(args.requests, 40, 600)
    gen = greedy(args.new)
    blocks = args.requests * -(-(max(lengths) + args.new) // 64) + 8

    rows = []
    for scheme, budget, exact in CONFIGS:
        model, _ = load(None, log=lambda *a: None)
        model = kvcompile.apply(model, named(scheme))
        if exact:
            exact_products(model)

        def run(batch):
            cbc = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=budget, allow_block_sharing=False)
            with torch.no_grad():
                out = model.generate_batch(batch, gen, continuous_batching_config=cbc, progress_bar=False)
            assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
            by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in out.values()}
            return [by_prompt[tuple(p)] for p in batch]

        t = time.perf_counter()
        alone = [run([p])[0] for p in prompts]
        together = run(prompts)
        differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
        rows.append(dict(policy=scheme, max_batch_tokens=budget, exact_products=exact, requests=len(prompts),
                         differ=len(differ), differing_prompt_lengths=[lengths[i] for i in differ],
                         first_difference=[next(j for j, (x, y) in enumerate(zip(alone[i], together[i])) if x != y)
                                           for i in differ], wall_s=round(time.perf_counter() - t, 1)))
        print(json.dumps(rows[-1]), flush=True)
    if args.record:
        from benchmarks.record import record
        table = "\n".join(f"| {r['policy']} | {r['max_batch_tokens']} | {'float64' if r['exact_products'] else 'float32'} "
                          f"| {r['differ']} of {r['requests']} |" for r in rows)
        record("Greedy replies alone and in a batch (SmolLM2, CPU)",
               f"`python -m benchmarks.batch_invariance --requests {args.requests} --new {args.new} --threads "
               f"{args.threads} --record`: "
               f"{args.requests} prompts of random token ids, {lengths[0]} to {lengths[-1]} tokens, {args.new} greedy "
               f"tokens each, generated alone (one `generate_batch` call each) and all in one call; the replies "
               f"that differ. \"products\": the model's linear layers as they are (float32) or computed in float64 "
               f"and rounded once (a row's products then do not depend on the batch).\n\n"
               f"| policy | max_batch_tokens | products | replies that differ |\n|---|---|---|---|\n{table}")
    return rows


if __name__ == "__main__":
    main()
