"""Prefill over the quantized past as SDPA over the dequantized store (``templates.prefill``), operands in the
query's dtype: what ``launch.attention`` runs on CUDA for many bf16 / fp16 queries (``launch.plan``'s "sdpa").

Here it runs on the CPU (``kernel="sdpa"`` forces it; SDPA's CPU kernels take bf16 and fp16 operands with fp32
accumulation too), against float64 attention over the reference's dequantized store within the bound derived
for that arithmetic (``templates.attention.reference_and_bound(..., operands=)``): the operands' rounding,
computed exactly, then the kernel's sums, weights rounded to the operands' dtype and the output's rounding. A
wrong code fails it, and so does the bf16 path against the fp32 derivation (its own terms are the ones that
hold it).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile.errors import ArgumentError, ArgumentTypeError, UnsupportedError
from kvcompile.store import KVStore, LayerSpec, attention_reference
from kvcompile.templates import attention as kattn
from kvcompile.templates import launch
from kvcompile.templates import prefill as kprefill
import profiles
from attention_checks import MIXED, ROTATED, filled, one_wrong_code
from nonfinite_checks import NONFINITE_POLICIES, assert_nan_pattern
from store_checks import bad_store
from test_attention_kernel import quants
from test_triton_prerope import LENGTHS as ROPE_LENGTHS
from test_triton_prerope import make_rope
from tiers import slow_after

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def on_dev(state):
    return type(state)(*[t.to(DEV) for t in state])


def check(q, state, spec, mask=None, scale=None, chunk=(None, None), rope=None):
    """The path within its derived bound of float64 attention, elementwise; NaN where the reference is.
    Returns (error, bound)."""
    k_new, v_new = (None if x is None else x.to(DEV) for x in chunk)
    got = launch.attention(q.to(DEV), on_dev(state), spec, None if mask is None else mask.to(DEV), scale,
                           k_new=k_new, v_new=v_new, rope=None if rope is None else type(rope)(*[t.to(DEV) for t in rope]),
                           kernel="sdpa").cpu()
    assert got.dtype == q.dtype and got.shape == q.shape
    want, bound = launch.reference_and_bound(q, state, spec, mask, scale, k_new=chunk[0], v_new=chunk[1],
                                             rope=rope, kernel="sdpa", device=DEV)
    assert torch.equal(got.isnan(), want.isnan()), spec.name
    err = (got.double() - want).abs().nan_to_num(0.0)
    bad = err > bound.nan_to_num(0.0)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst error "
                           f"{err[bad].max():.3g} vs bound {bound[bad][err[bad].argmax()]:.3g}; {spec.name}")
    return err, bound


def causal(n, L, additive=False):
    """The causal mask of ``n`` queries at positions ``[L - n, L)`` over ``L`` positions, as transformers passes
    it (bool, or 0 / -inf)."""
    tri = (torch.arange(L).view(1, L) <= L - n + torch.arange(n).view(n, 1)).view(1, 1, n, L)
    return torch.zeros(tri.shape).masked_fill(~tri, float("-inf")) if additive else tri


@st.composite
def cases(draw):
    D = draw(st.sampled_from([16, 32, 48]))
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 3, 16])),
                    sink=draw(st.sampled_from([0, 2])), rotate=D != 48 and draw(st.booleans()))
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    C = 80
    same = draw(st.booleans())  # equal lengths: SDPA's causal kernels (no mask tensor)
    lengths = [C] * B if same else [draw(st.integers(1, C)) for _ in range(B)]
    n = draw(st.sampled_from([1, 7, 24, 80]))
    mask = draw(st.sampled_from([None, None, "causal", "additive causal", "bool", "float"]))
    dtype = draw(st.sampled_from(["bfloat16", "float16", "bfloat16", "float32"]))
    return (policy, B, H, G, D, C, lengths, n, mask, dtype, draw(st.booleans()), draw(st.sampled_from([16, 32])),
            draw(st.integers(0, 2**31 - 1)))


@profiles.KERNEL
@given(cases())
def test_sdpa_prefill_equals_float64_attention(case):
    """Every layout, equal and ragged rows, chunks over a past and whole prompts, the queries' own chunk or
    not, no mask, the causal one (bool and additive: recognised and dropped), others; bf16, fp16 and fp32."""
    policy, B, H, G, D, C, lengths, n, mask_kind, dtype, own, block, seed = case
    g = torch.Generator().manual_seed(seed)
    spec, state, *chunk = filled(policy, lengths, H, D, dtype, seed, own=n, block=block)
    mask = None
    if mask_kind in ("causal", "additive causal"):
        mask = causal(n, C, mask_kind != "causal")
    elif mask_kind == "bool":
        mask = torch.rand(B, 1, n, C, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.where(torch.rand(1, H * G, 1, C + 5, generator=g) > 0.3, torch.randn(C + 5, generator=g) * 4,
                           -torch.inf)
    q = torch.randn(B, H * G, n, D, generator=g).to(spec.torch_dtype)
    check(q, state, spec, mask, scale=float(torch.rand((), generator=g)) + 0.05, chunk=chunk if own else (None, None))


def same_bits(got, want):
    """Equal bit for bit, NaN where the other is NaN (a NaN's payload aside)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    ok = ~want.isnan()
    assert torch.equal(got.view(ints)[ok], want.view(ints)[ok]), (got[ok] != want[ok]).sum()


@st.composite
def past_cases(draw):
    D = draw(st.sampled_from([16, 32, 48]))
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 3, 16])),
                    sink=draw(st.sampled_from([0, 2, 5])), rotate=D != 48 and draw(st.booleans()))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    lengths = [draw(st.one_of(st.integers(0, 6), st.integers(0, 90))) for _ in range(B)]  # some inside the sinks
    lengths[0] = max(lengths[0], 1)
    P = max(1, max(lengths) + draw(st.sampled_from([-3, 0, 0, 17])))
    return (policy, D, B, H, lengths, P, draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), draw(st.sampled_from([0, 1, 9, 40])),
            draw(st.sampled_from([16, 32, 64])), draw(st.integers(0, 2**31 - 1)))


@profiles.KERNEL
@given(past_cases())
def test_the_past_kernel_is_the_reference_bit_for_bit(case):
    """``templates.past`` (what the path reads the past with on CUDA) equals ``dequantize_reference``, the
    queries' own chunk and the rounding to the operands (finite values saturated) bit for bit: every layout,
    sinks, packed blocks, the ring, rows shorter than the others or empty, positions past them (zeros)."""
    policy, D, B, H, lengths, P, dtype, out, n, block, seed = case
    spec, state, k_new, v_new = filled(policy, lengths, H, D, dtype, seed, own=max(n, 1), block=block)
    chunk = (k_new, v_new) if n else (None, None)
    want = kprefill.dequantized_past(state, spec, P, out, *chunk, n)
    got = kprefill.dequantized_past(on_dev(state), spec, P, out, *(None if x is None else x.to(DEV) for x in chunk),
                                    n, kernel=True)
    for g, w in zip(got, want):
        same_bits(g.cpu(), w)


@pytest.mark.parametrize("policy", slow_after(1, NONFINITE_POLICIES))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
def test_the_past_kernel_reads_non_finite_stores_as_the_reference(policy):
    """NaN and +-inf in sinks, packed groups (a poisoned group's NaN scale) and the ring."""
    spec, store, k, v = bad_store(policy, "float32", 2, 1, 16, 40)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        want = kprefill.dequantized_past(store.state, spec, 45, out)
        got = kprefill.dequantized_past(on_dev(store.state), spec, 45, out, kernel=True)
        for g, w in zip(got, want):
            same_bits(g.cpu(), w)


def test_the_past_kernel_saturates_beyond_the_operands_range():
    """An fp32 model's keys and values past fp16's range (packed, in the ring, in the sinks) read back as fp16's
    largest finite value, as ``quant.saturate`` rounds, never inf."""
    spec = LayerSpec(Policy(Quant("int8", "token"), Quant("int4", "token"), residual=4, sink=2), 1, 16, "float32", 16)
    store = KVStore(spec, 1, blocks=4)
    g = torch.Generator().manual_seed(0)
    store.append(torch.randn(1, 1, 40, 16, generator=g) * 1e6, torch.randn(1, 1, 40, 16, generator=g) * 1e6)
    want = kprefill.dequantized_past(store.state, spec, 40, torch.float16)
    assert (want[0].abs() == 65504).any() and want[0].isfinite().all()
    got = kprefill.dequantized_past(on_dev(store.state), spec, 40, torch.float16, kernel=True)
    for g_, w in zip(got, want):
        same_bits(g_.cpu(), w)


def test_the_past_kernel_is_sharp():
    """One stored code off by one step changes the read-back: the comparison above can fail."""
    spec, state, bad, _ = one_wrong_code(1)
    a = kprefill.dequantized_past(on_dev(state), spec, 40, torch.float32, kernel=True)[0]
    b = kprefill.dequantized_past(on_dev(bad), spec, 40, torch.float32, kernel=True)[0]
    assert int((a != b).sum()) == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_chunks_over_a_past_in_the_models_dtype(dtype):
    """The case the path is for: a chunk of queries over a packed past, GQA, the model's dtype, the causal mask
    transformers passes and none; rotated layouts (the query rotated in fp32, then rounded; the output rounded
    before and after it is rotated back)."""
    for policy in (MIXED, ROTATED, Policy.kivi(2, group=16, residual=8), Policy.int8()):
        spec, state, *chunk = filled(policy, [90, 90], 2, 32, dtype, own=30)
        q = torch.randn(2, 8, 30, 32, generator=torch.Generator().manual_seed(1)).to(spec.torch_dtype)
        for mask in (None, causal(30, 90), causal(30, 90, True).to(spec.torch_dtype)):
            check(q, state, spec, mask, chunk=chunk)
        spec, state, *chunk = filled(policy, [90, 61], 2, 32, dtype, own=30)  # ragged: an explicit mask
        check(q, state, spec, None, chunk=chunk)


def test_pre_rope_keys():
    """Pre-RoPE keys rotated by their positions in fp32, then rounded with the rest."""
    policy = Policy.kivi(4, group=16, residual=5, sink=2, pre_rope=True)
    spec, state, *chunk = filled(policy, ROPE_LENGTHS, 1, 32, "bfloat16", own=7)
    rope = make_rope("half", 32, 32, 64, (0, 3, -2), seed=3)
    q = torch.randn(len(ROPE_LENGTHS), 2, 7, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    check(q, state, spec, chunk=chunk, rope=rope)
    mask = torch.rand(len(ROPE_LENGTHS), 1, 7, 50, generator=torch.Generator().manual_seed(6)) > 0.3
    check(q, state, spec, mask, chunk=chunk, rope=rope)


def test_masks_beyond_the_operands_range_saturate():
    """A float mask is added in the operands' dtype: fp32's most negative finite value is finite there too
    (saturated, not -inf), so a row whose every position it covers still attends, as the reference says."""
    spec, state = filled(MIXED, [40], 1, 32, "bfloat16")
    q = torch.randn(1, 2, 3, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    mask = torch.full((1, 1, 3, 40), torch.finfo(torch.float32).min)
    mask[0, 0, 1, 7] = 0.0
    err, bound = check(q, state, spec, mask)
    got = launch.attention(q.to(DEV), on_dev(state), spec, mask.to(DEV), kernel="sdpa").cpu()
    assert got.isfinite().all() and (got[0, :, 0] != 0).any()  # row 0 sees every position, weighted alike


@pytest.mark.parametrize("policy,dtype", slow_after(1, [
    (Policy(Quant("int4", "channel", 4), Quant("int8", "token", 8), residual=3, sink=2), "bfloat16"),
    (NONFINITE_POLICIES[3], "float16"),  # fp8 scales, int8 zero points
    (Policy(Quant("fp8_e5m2", "tensor"), Quant("fp8_e4m3", "tensor"), residual=3, sink=2, rotate=True), "bfloat16"),
]))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
def test_non_finite_values_poison_what_the_reference_says(policy, dtype):
    """NaN and +-inf keys and values in sinks, packed groups and the ring: NaN exactly where
    ``attention_reference`` puts it (in the model's dtype, a NaN row or channel), the rest within the bound."""
    B, H, G, D, L = 2, 1, 2, 16, 40
    spec, store, k, v = bad_store(policy, dtype, B, H, D, L)
    state = store.state
    g = torch.Generator().manual_seed(4)
    for n in (5, 12):
        q = torch.randn(B, H * G, n, D, generator=g).to(spec.torch_dtype)
        keep = torch.rand(B, 1, n, L + 2, generator=g) > 0.5
        for mask in (None, keep, torch.where(keep, torch.randn(B, 1, n, L + 2, generator=g), -torch.inf)):
            got = launch.attention(q.to(DEV), on_dev(state), spec, None if mask is None else mask.to(DEV),
                                   kernel="sdpa").cpu()
            assert_nan_pattern(got, attention_reference(q, state, spec, mask, None, torch.float64), spec.name)
            check(q, state, spec, mask)


def test_the_bound_catches_one_wrong_code():
    """Sharp enough to fail: one int8 key code off by 128 steps (about 2**-7 of each score, the operands'
    rounding, loosens it; fp32 operands: off by one step)."""
    for flip, dtype in ((128, torch.bfloat16), (1, torch.float32)):
        spec, state, bad, q = one_wrong_code(flip)
        q = q.to(dtype)
        check(q, state, spec)
        got = launch.attention(q.to(DEV), on_dev(bad), spec, kernel="sdpa").cpu()
        want, bound = launch.reference_and_bound(q, state, spec, kernel="sdpa", device=DEV)
        assert ((got.double() - want).abs() > bound).any(), dtype


def test_the_operands_terms_hold_the_bound():
    """The bf16 path against the derivation for fp32 operands (one split a position, as the CPU's fp32 path is
    checked) fails: the operands' rounding is what the bound has to cover, not slack."""
    spec, state, *chunk = filled(ROTATED, [70, 70], 2, 32, "bfloat16", own=20)
    q = torch.randn(2, 4, 20, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    err, bound = check(q, state, spec, chunk=chunk)
    _, fp32_bound = kattn.reference_and_bound(q, state, spec, nsplit=70, k_new=chunk[0], v_new=chunk[1])
    assert (err > fp32_bound).any()
    assert (bound > fp32_bound).all()


def test_plan_takes_sdpa_for_many_half_precision_queries_on_cuda():
    spec, state = filled(MIXED, [90], 2, 32)
    cuda = torch.device("cuda")

    def sdpa(n=64, **kw):
        kw.setdefault("device", cuda)
        kw.setdefault("dtype", torch.bfloat16)
        return launch.plan(state, spec, (1, 4, n, 32), **kw).sdpa

    assert sdpa() and sdpa(dtype=torch.float16) and sdpa(200)
    assert not sdpa(launch.SDPA_QUERIES - 1)
    assert not sdpa(dtype=torch.float32)  # fp32 models: the general kernel (tf32 at full precision)
    assert not sdpa(device=torch.device("cpu"))  # the CPU: the C kernels and templates.prefill in fp32 (ops)
    assert not sdpa(tiles=(8, 16, 1))  # tiles of the general kernel asked for
    assert sdpa(5, kernel="sdpa", device=torch.device("cpu"))
    assert launch.plan(state, spec, (1, 4, 64, 32), kernel="general", device=cuda, dtype=torch.bfloat16).sdpa is False
    with pytest.raises(ArgumentError, match="'sdpa'"):
        launch.plan(state, spec, (1, 4, 64, 32), kernel="flash")
    spec44, state44 = filled(Policy.int8(), [90], 2, 44)  # head_dim not a multiple of 8: the general kernel
    assert not launch.plan(state44, spec44, (1, 4, 64, 44), device=cuda, dtype=torch.bfloat16).sdpa
    q = torch.randn(1, 4, 8, 32, device=DEV)
    with pytest.raises(UnsupportedError, match="row-invariant"):
        launch.attention(q, on_dev(state), spec, kernel="sdpa", invariant=True)


def test_operands_are_fp32_or_the_querys_dtype():
    spec, state = filled(MIXED, [40], 1, 32)
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(ArgumentTypeError, match="query's dtype"):
        kprefill.prefill_attention(q, state, spec, None, None, operands=torch.bfloat16)


def test_lower_right_causal_masks_are_recognised():
    """A chunk's causal mask (query i sees positions up to L - n + i) is SDPA's causal kernel, aligned to the
    last position; the upper-left one (query i sees up to i) is not that mask."""
    assert kprefill._is_causal(causal(5, 12), 5, 12)
    assert kprefill._is_causal(causal(5, 12, True), 5, 12)
    upper = (torch.arange(12).view(1, 12) <= torch.arange(5).view(5, 1)).view(1, 1, 5, 12)
    assert not kprefill._is_causal(upper, 5, 12)
    wide = torch.cat([causal(5, 12), torch.zeros(1, 1, 5, 3, dtype=torch.bool)], -1)  # past the longest row
    assert kprefill._is_causal(wide, 5, 12)
