"""The Inductor (CPU) attention template equals the reference attention, eagerly and compiled."""
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile.store import LayerSpec, attention_reference
from kvcompile.templates import inductor
from attention_checks import filled
from store_checks import scrambled
from tiers import slow_after

# Both sides accumulate in fp32 over at most C=96 positions of O(1) values; a few fp32 ulps of the output.
TOL = 2e-6


@st.composite
def cases(draw):
    def quant():
        fmt = draw(st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]))
        if fmt.startswith("fp8") and draw(st.integers(0, 2)) == 0:
            return Quant(fmt, "tensor")  # one fixed scale (1.0), none stored
        axis = draw(st.sampled_from(["token", "channel"]))
        group = draw(st.sampled_from([None, 8, 16]) if axis == "token" else st.sampled_from([4, 8]))
        return Quant(fmt, axis, group, True if fmt.startswith("fp8") else draw(st.booleans()))
    pol = Policy(quant(), quant(), residual=draw(st.sampled_from([0, 3, 16])), sink=draw(st.sampled_from([0, 2])),
                 rotate=draw(st.booleans()))
    B, H, G, D, C = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 3])), 32, 96
    lengths = [draw(st.integers(1, C)) for _ in range(B)]
    n = draw(st.integers(1, min(lengths)))
    own = draw(st.booleans())  # pass the queries' own chunk (read in full precision)
    block = draw(st.sampled_from([16, 32, 64]))  # packed tokens per block (scrambled blocks, see filled)
    width = draw(st.sampled_from([C, max(lengths) // 2 + 1]))  # a mask's width (narrower: the rest unseen)
    return (pol, B, H, G, D, width, lengths, n, draw(st.sampled_from([None, "bool", "float"])), own, block,
            draw(st.integers(0, 999)))


@given(cases())
def test_inductor_attention_equals_reference(case):
    pol, B, H, G, D, C, lengths, n, mask_kind, own, block, seed = case
    g = torch.Generator().manual_seed(seed)
    spec, state, k_new, v_new = filled(pol, lengths, H, D, seed=seed, own=n, block=block)
    if not own:
        k_new = v_new = None
    q = torch.randn(B, H * G, n, D, generator=g)
    mask = None
    if mask_kind is not None:
        keep = torch.rand(B, 1, n, C, generator=g) > 0.3
        mask = keep if mask_kind == "bool" else torch.where(keep, torch.randn(B, 1, n, C, generator=g), -torch.inf)
    expect = attention_reference(q, state, spec, mask, 0.3, torch.float64, k_new=k_new, v_new=v_new)
    got = inductor.attention(q, state, spec, mask, 0.3, k_new, v_new)
    assert (got.double() - expect).abs().max() <= TOL * (1 + expect.abs().max())


@pytest.mark.parametrize("policy", slow_after(1, [Policy.kivi(4, group=8, residual=8), Policy.fp8(residual=4),
                                                 Policy.kivi(3, group=8, residual=0, sink=2, rotate=True),
                                                 Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"),
                                                        residual=4, rotate=True)]))
def test_compiled_inductor_attention_equals_reference(policy):
    """Compiled decode over a forked store with scrambled blocks of 16 equals the reference, and the gather
    through the table, the unpacking and the dequantization stay folded into the reductions' loads: no
    intermediate buffer holds an eighth of the packed region in full precision (int3's eight planes of D/8
    channels, materialized as before paging, are each exactly that)."""
    from torch._inductor.utils import run_and_get_code

    B, H, D = 2, 2, 32
    spec = LayerSpec(policy, H, D, block_tokens=16)
    store = scrambled(spec, B, 12, 0)
    store.append(torch.randn(B, H, 50, D), torch.randn(B, H, 50, D), torch.tensor([50, 37]))
    store.select([1, 0, 0])
    store.append(torch.randn(3, H, 3, D), torch.randn(3, H, 3, D), torch.tensor([3, 0, 2]))
    state = store.state
    fn = torch.compile(lambda q, st: inductor.attention(q, st, spec, None, None), fullgraph=True)
    q = torch.randn(3, 2 * H, 1, D)
    expect = attention_reference(q, state, spec, None, None, torch.float64)
    got, (code,) = run_and_get_code(fn, q, state)
    assert (got.double() - expect).abs().max() <= TOL * (1 + expect.abs().max())
    sizes = [[int(x) for x in s.split(",") if x.strip()] for s in re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)]
    region = 3 * H * state.table.shape[1] * 16 * D  # the packed region the table reaches, in full precision
    # int4/fp8 planes fuse into the reductions; int3's eight planes of D/8 channels are materialized (as they
    # were before paging): then no buffer holds more than one plane
    limit = region // 8 + 1 if 3 in (policy.key.bits, policy.value.bits) else region // 8
    assert sizes and max(torch.Size(s).numel() for s in sizes) < limit, sizes


@pytest.mark.slow
def test_op_dispatches_to_the_compiled_template_on_cpu():
    """kernels "inductor": attention runs the template compiled once per store layout."""
    from kvcompile import ops

    spec = LayerSpec(Policy.kivi(4, group=8, residual=8), 2, 32, block_tokens=16)
    spec.register()
    store = scrambled(spec, 1, 4, 1)
    store.append(torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32))
    q = torch.randn(1, 4, 1, 32)
    expect = attention_reference(q, store.state, spec, None, 0.2, torch.float64)
    before = ops._compiled_attention.cache_info().misses
    try:
        ops.set_kernels("inductor")
        for _ in range(2):
            got = ops.backend(q.device).attention(q, store.state, spec, None, 0.2)
            assert (got.double() - expect).abs().max() <= TOL * (1 + expect.abs().max())
    finally:
        ops.set_kernels("auto")
    assert ops._compiled_attention.cache_info().misses == before + 1  # built once for this layout


# --------------------------------------------------------------------------- non-finite values
from nonfinite_checks import NONFINITE_POLICIES, assert_close, bad_inputs  # noqa: E402



@pytest.mark.parametrize("policy", NONFINITE_POLICIES)
def test_inductor_attention_non_finite_values_poison_what_the_reference_says(policy):
    """The Inductor template (eager): NaN, +inf and -inf keys and values in sinks, packed
    groups' edges and the residual window; decode, several rows (unrolled) and a prefill (> 16 rows: the
    matrix path), masks hiding some bad positions: NaN exactly where attention_reference is, never inf."""
    B, H, G, D, L = 2, 1, 2, 16, 40
    spec = LayerSpec(policy, H, D, block_tokens=16)
    k, v = bad_inputs(spec, B, L, 3, 1.0, extremes=False)
    store = scrambled(spec, B, 2 * B * spec.blocks_for(L), 3)
    store.append(k, v, torch.tensor([L, L - 13]))
    g = torch.Generator().manual_seed(4)
    for n in (1, 4, 20):
        q = torch.randn(B, H * G, n, D, generator=g)
        keep = torch.rand(B, 1, n, L + 2, generator=g) > 0.5
        for mask in (None, keep, torch.where(keep, torch.randn(B, 1, n, L + 2, generator=g), -torch.inf)):
            want = attention_reference(q, store.state, spec, mask, 0.3, torch.float64)
            assert_close(inductor.attention(q, store.state, spec, mask, 0.3), want, TOL, spec.name)


@pytest.mark.slow
def test_compiled_inductor_attention_non_finite_values():
    """The same rule compiled: decode over a store holding NaN and inf values in every region (keys finite, so
    that only the channels they poison are NaN)."""
    policy = NONFINITE_POLICIES[0]
    B, H, D, L = 2, 1, 16, 40
    spec = LayerSpec(policy, H, D, block_tokens=16)
    k, v = bad_inputs(spec, B, L, 5, 1.0, extremes=False)
    k = torch.where(k.isfinite(), k, 0.0)
    store = scrambled(spec, B, 2 * B * spec.blocks_for(L), 5)
    store.append(k, v, torch.tensor([L, L - 7]))
    fn = torch.compile(lambda q, st: inductor.attention(q, st, spec, None, None), fullgraph=True)
    q = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(5))
    want = attention_reference(q, store.state, spec, None, None, torch.float64)
    assert want.isnan().any() and (~want.isnan()).any()
    assert_close(fn(q, store.state), want, TOL, spec.name)


def test_compiled_inductor_attention_reads_fixed_scale_nan_codes():
    """fp8 with one fixed scale (axis="tensor", no scale stored), compiled: a NaN value in one packed token of
    KV head 1 is stored as that token-head's NaN codes (0x7F), which read NaN -- every channel of the query heads
    of KV head 1 that see it, and nothing of KV head 0's -- as attention_reference says."""
    policy = Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=3, sink=1)
    B, H, D, L = 2, 2, 16, 40
    spec = LayerSpec(policy, H, D, block_tokens=16)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    v[0, 1, 7, 2] = float("nan")
    store = scrambled(spec, B, 2 * B * spec.blocks_for(L), 6)
    store.append(k, v, torch.tensor([L, L - 7]))
    fn = torch.compile(lambda q, st: inductor.attention(q, st, spec, None, None), fullgraph=True)
    q = torch.randn(B, 2 * H, 1, D, generator=g)
    want = attention_reference(q, store.state, spec, None, None, torch.float64)
    nan = torch.zeros_like(want, dtype=torch.bool)
    nan[0, 2:] = True  # the query heads of KV head 1 in row 0
    assert torch.equal(want.isnan(), nan)
    assert_close(fn(q, store.state), want, TOL, spec.name)
