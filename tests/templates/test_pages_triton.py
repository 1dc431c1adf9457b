"""``kvcompile.pages`` on Triton's kernels (CUDA's path for an engine such as vLLM; here Triton's interpreter, on a
GPU the real thing: ``benchmarks/gpu_session.sh`` runs this directory on CUDA): a token's attention is the same bits
however the engine cut the work -- whole, in chunks, after a prefix, decoded, recomputed -- as on the C kernels
(``tests/test_pages.py``). On CUDA this also covers what the interpreter cannot: the rotation's and the store's
matrix products over batches of other sizes."""
import pytest
import torch

from kvcompile import Policy, Quant, ops
from kvcompile import pages as P
from test_pages import bits, cut_outputs, scrambled_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUTS = {"whole": [40], "chunks": [16, 16, 8], "cached": [32, 1, 7], "recomputed": [24, 1, 1, 14], "decoded": [1] * 40}


@pytest.mark.slow
@pytest.mark.parametrize("policy,windowed,D", [
    (Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True), False, 64),
    (Policy.kivi(4, group=16, residual=20, sink=2, rotate=True), True, 64),  # key groups, a window and sinks
    (Policy.fp8(residual=0, axis="tensor", rotate=True), False, 64),  # one fixed scale, none stored
    # layouts the decode kernel does not serve: the general kernel, a program a row
    (Policy(Quant("int8", "token"), Quant("int8", "token")), False, 80),
    (Policy.kivi(3, group=16, residual=20), True, 64),
], ids=["tok+rot:4", "kivi+sinks", "fp8-tensor+rot", "int8-D80", "kivi3"])
def test_a_tokens_attention_is_the_same_bits_however_the_work_is_cut_on_triton(policy, windowed, D):
    H, Hq, block, n_pages = 2, 4, 16, 24
    g = torch.Generator().manual_seed(7)
    mine, other = ([torch.randn(40, h, D, generator=g).to(torch.bfloat16).to(DEV) for h in (H, H, Hq)]
                   for _ in range(2))
    lay = P.PageLayout(policy, H, D, "bfloat16", block, window=windowed)
    ops.set_kernels("triton")
    try:
        results = cut_outputs(lay, CUTS, mine, other, n_pages, scrambled_table(2, 8, n_pages, seed=1).to(DEV),
                              scrambled_table(2, 8, n_pages, seed=2).to(DEV))
    finally:
        ops.set_kernels("auto")
    for name, got in results.items():
        assert torch.equal(bits(got), bits(results["decoded"])), (name, int((got != results["decoded"]).sum()))
