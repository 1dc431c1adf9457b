"""``kvcompile.pages`` on Triton's kernels (CUDA's path for an engine such as vLLM; here Triton's interpreter, on a
GPU the real thing: ``benchmarks/gpu_session.sh`` runs this directory on CUDA): a token's attention is the same bits
however the engine cut the work -- whole, in chunks, after a prefix, decoded, recomputed -- as on the C kernels
(``tests/test_pages.py``). On CUDA this also covers what the interpreter cannot: the rotation's and the store's
matrix products over batches of other sizes."""
import pytest
import torch

from kvcompile import Policy, Quant, ops
from kvcompile import pages as P
from test_pages import bits, engine_pages, scrambled_table, window_pages

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUTS = {"whole": [40], "chunks": [16, 16, 8], "cached": [32, 1, 7], "recomputed": [24, 1, 1, 14], "decoded": [1] * 40}


@pytest.mark.slow
@pytest.mark.parametrize("policy,windowed", [
    (Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True), False),
    (Policy.kivi(4, group=16, residual=20, sink=2, rotate=True), True),  # key groups, a window and sinks
], ids=["tok+rot:4", "kivi+sinks"])
def test_a_tokens_attention_is_the_same_bits_however_the_work_is_cut_on_triton(policy, windowed):
    H, Hq, D, block, wblock, n_pages = 2, 4, 64, 16, 16, 24
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(7)
    k, v, q = (torch.randn(40, h, D, generator=g).to(dt).to(DEV) for h in (H, H, Hq))
    ko, vo, qo = (torch.randn(40, h, D, generator=g).to(dt).to(DEV) for h in (H, H, Hq))  # the other sequence's
    results = {}
    ops.set_kernels("triton")
    try:
        for name, cut in CUTS.items():
            lay = P.PageLayout(policy, H, D, "bfloat16", block, window=windowed)
            pages = engine_pages(lay, n_pages, interleave=2).to(DEV)
            table = scrambled_table(2, 8, n_pages, seed=1).to(DEV)
            window = window_pages(lay, n_pages, wblock).to(DEV) if windowed else None
            wtable = scrambled_table(2, 8, n_pages, seed=2).to(DEV)
            held, oheld, outs = 0, 0, []
            for n in cut:
                other = 1 if n > 1 else 2  # the other sequence decodes beside a chunk, or takes two beside a decode
                sl, o = slice(held, held + n), slice(oheld % 36, oheld % 36 + other)
                kk, vv, qq = (torch.cat([x[sl], y[o]]) for x, y in ((k, ko), (v, vo), (q, qo)))
                oheld += other
                qs, seq = torch.tensor([0, n, n + other]), torch.tensor([held + n, oheld])
                batch = P.Ragged.of(qs, seq, table)
                if windowed:
                    recent = P.store_windowed(lay, pages, window, wblock, kk, vv, batch, P.Ragged.of(qs, seq, wtable))
                    out = P.attention_windowed(lay, pages, qq, batch, recent, 0.125)
                else:
                    P.store_ragged(lay, pages, kk, vv, batch)
                    out = P.attention_ragged(lay, pages, qq, None, None, batch, 0.125)
                outs.append(out[:n])
                held += n
            results[name] = torch.cat(outs).cpu()
    finally:
        ops.set_kernels("auto")
    for name, got in results.items():
        assert torch.equal(bits(got), bits(results["decoded"])), (name, int((got != results["decoded"]).sum()))
