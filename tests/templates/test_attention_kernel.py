"""The fused dequantize-attention kernels against float64 attention over the reference's dequantized store.

The bound is derived, not tuned: see ``kvcompile.templates.attention.reference_and_bound`` (fp32 dot products,
online softmax, split merge, rotation and output rounding, each with its own term). It is about 1e-6 relative,
three orders of magnitude below one quantization step, so a wrong code, scale, region or mask fails it (see
``test_the_bound_catches_one_wrong_code``).
"""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import LayerSpec, dequantize_reference
from kvcompile.templates import attention as kattn
from kvcompile.templates import launch
import profiles
from attention_checks import LENGTHS, MIXED, ROTATED, filled, one_wrong_code
from store_checks import bad_store, scrambled
from tiers import slow_after

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def check(q, state, spec, mask=None, scale=None, tiles=None, chunk=(None, None), kernel="auto"):
    """Run the kernel and assert it is within the derived bound of float64 attention, elementwise.
    ``chunk``: the queries' own (k_new, v_new), read in full precision. ``kernel``: as ``launch.attention``'s
    (a decode call runs the decode kernel where it serves the layout; "general" forces the other one)."""
    k_new, v_new = (None if x is None else x.to(DEV) for x in chunk)
    got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                           None if mask is None else mask.to(DEV), scale, tiles=tiles, k_new=k_new, v_new=v_new,
                           kernel=kernel)
    assert got.dtype == q.dtype and got.shape == q.shape
    want, bound = launch.reference_and_bound(q, state, spec, mask, scale, tiles=tiles, k_new=chunk[0],
                                             v_new=chunk[1], kernel=kernel, device=DEV)
    err = (got.cpu().double() - want).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst error "
                           f"{err[bad].max():.3g} vs bound {bound[bad][err[bad].argmax()]:.3g}; {spec.name}")
    return err, bound


# each GQA group size once, and 3 (a group that pads its tile) at both head sizes: the interpreter takes ~15 s a case,
# so the whole grid is slow; the fast tier's cases of this kernel are the property below (shapes drawn at random)
# and the non-finite, fork and mask tests
@pytest.mark.slow
@pytest.mark.parametrize("gqa, D", [(1, 128), (3, 64), (3, 128), (4, 64), (8, 128)])
def test_attention_kernel_grid(gqa, D):
    H, C = 2, 48  # C: the masks' width
    g = torch.Generator().manual_seed(gqa * D)
    spec, state = filled(MIXED, LENGTHS, H, D)
    B, Hq = len(LENGTHS), H * gqa
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec)  # decode, split-K
    check(torch.randn(B, Hq, 5, D, generator=g), state, spec)  # chunked prefill (row 0 has 1 < 5 tokens)
    spec, state = filled(ROTATED, LENGTHS, H, D)
    keep = torch.rand(B, 1, 1, C, generator=g) > 0.4
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec, mask=keep)
    soft = torch.where(torch.rand(B, Hq, 3, C, generator=g) > 0.2, torch.randn(B, Hq, 3, C, generator=g), -torch.inf)
    check(torch.randn(B, Hq, 3, D, generator=g), state, spec, mask=soft, scale=0.3)
    # the queries' own chunk in full precision: 12 > residual 8 (prefill), and decode with no residual
    spec, state, *chunk = filled(MIXED, LENGTHS, H, D, own=12)
    check(torch.randn(B, Hq, 12, D, generator=g), state, spec, chunk=chunk)
    spec, state, *chunk = filled(Policy(MIXED.key, MIXED.value, residual=0, sink=2), LENGTHS, H, D, own=1)
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec, chunk=chunk)


@st.composite
def quants(draw, D):
    fmt = draw(st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]))
    if fmt.startswith("fp8") and draw(st.integers(0, 2)) == 0:
        return Quant(fmt, "tensor")  # one fixed scale (1.0), none stored
    axis = draw(st.sampled_from(["token", "channel"]))
    group = draw(st.sampled_from([None, 8, 16]) if axis == "token" else st.sampled_from([2, 4, 8]))
    return Quant(fmt, axis, group, True if fmt.startswith("fp8") else draw(st.booleans()),
                 draw(st.sampled_from(["float16", "float32", "fp8_e4m3"])))


@st.composite
def attention_cases(draw):
    D = draw(st.sampled_from([16, 32, 48]))
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 3, 16])),
                    sink=draw(st.sampled_from([0, 2])), rotate=D != 48 and draw(st.booleans()))
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 4]))
    C = 80  # the longest row, and the masks' width
    lengths = [draw(st.integers(1, C)) for _ in range(B)]
    n = draw(st.sampled_from([1, 1, 2, 6]))
    block_q = 1 if n == 1 else draw(st.sampled_from([1, 2, 4]))
    tiles = (block_q, draw(st.sampled_from([16, 32])), draw(st.sampled_from([1, 2, 3, 5])))
    mask = draw(st.sampled_from([None, "bool", "float"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    own = draw(st.booleans())  # pass the queries' own chunk (read in full precision)
    block = draw(st.sampled_from([16, 16, 32, 64]))  # packed tokens per block; tiles longer are cut to it
    return policy, B, H, G, D, C, lengths, n, tiles, mask, dtype, own, block, draw(st.integers(0, 2**31 - 1))


@profiles.KERNEL
@given(attention_cases())
def test_attention_kernel_equals_float64_attention(case):
    policy, B, H, G, D, C, lengths, n, tiles, mask_kind, dtype, own, block, seed = case
    g = torch.Generator().manual_seed(seed)
    spec, state, *chunk = filled(policy, lengths, H, D, dtype, seed, own=n, block=block)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, n, C, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.where(torch.rand(1, H * G, 1, C + 5, generator=g) > 0.3, torch.randn(C + 5, generator=g), -torch.inf)
    q = torch.randn(B, H * G, n, D, generator=g).to(spec.torch_dtype)
    check(q, state, spec, mask, scale=float(torch.rand((), generator=g)) + 0.05, tiles=tiles,
          chunk=chunk if own else (None, None))


@pytest.mark.parametrize("block", slow_after(1, [16, 32, 64]))
def test_attention_kernel_reads_forked_cropped_stores(block):
    """Attention over a KVStore that forked (``select([0, 0, 1])``: rows 0 and 1 share blocks, then each copies
    the block it writes), was cropped into packed storage and appended to again, its blocks handed out in a
    scrambled order: decode (split-K), a masked decode and a prefill reading its own chunk."""
    H, G, D = 1, 2, 32
    spec = LayerSpec(MIXED, H, D, block_tokens=block)
    spec.register()
    store = scrambled(spec, 2, 16, block)
    g = torch.Generator().manual_seed(block)

    def append(n, n_new=None):
        k, v = torch.randn(store.batch, H, n, D, generator=g), torch.randn(store.batch, H, n, D, generator=g)
        k[..., 3] *= 8
        store.append(k, v, n_new)
        return k, v

    append(2 * block + 30, torch.tensor([2 * block + 30, block + 11]))
    store.select([0, 0, 1])
    append(block + 5, torch.tensor([block + 5, 17, 3]))
    store.crop(2 * block + 20)
    append(1)
    assert store.tables[0][0] == store.tables[1][0] and len({len(t) for t in store.tables}) > 1
    state = store.state
    B, n = 3, 5
    check(torch.randn(B, H * G, 1, D, generator=g), state, spec)
    P = max(store.lengths) + 3
    check(torch.randn(B, H * G, 1, D, generator=g), state, spec, mask=torch.rand(B, 1, 1, P, generator=g) > 0.3)
    chunk = append(n)
    check(torch.randn(B, H * G, n, D, generator=g), store.state, spec, chunk=chunk)


def test_attention_tiles_fit_the_blocks_and_splits_follow_the_positions(monkeypatch):
    """A packed tile lies in one block: BLOCK_N never exceeds the store's block, also when asked for (the
    result stays within the bound). On a GPU the number of splits follows the positions scored -- the mask's
    width, or the block table's reach -- and the batch, never a capacity."""
    spec, state = filled(MIXED, [40, 9], 1, 32, block=16)
    q = torch.randn(2, 2, 1, 32, generator=torch.Generator().manual_seed(0))
    check(q, state, spec, tiles=(1, 64, 2))
    assert kattn.default_tiles(spec, 1, 2, torch.device("cpu"), 2, 1000)[1] == 16
    assert kattn.position_bound(state, spec, None) == 2 + state.table.shape[1] * 16 + spec.ring
    assert kattn.position_bound(state, spec, torch.ones(1, 1, 1, 77, dtype=torch.bool)) == 77
    monkeypatch.setattr(kattn, "INTERPRET", False)  # the GPU's choice (4 SMs counted off CUDA)
    big = LayerSpec(MIXED, 2, 128)
    assert kattn.default_tiles(big, 1, 4, torch.device("cpu"), 1, 4096) == (1, 32, 4)  # 2 programs, 8 wanted
    assert kattn.default_tiles(big, 1, 4, torch.device("cpu"), 1, 200) == (1, 32, 2)  # 4 tiles per split
    assert kattn.default_tiles(big, 1, 4, torch.device("cpu"), 8, 1 << 20)[2] == 1  # the batch fills the GPU


def test_positions_past_a_narrow_mask_are_invisible():
    """A mask narrower than a sequence (``kvcompile.store.cover``): the positions past its width are not seen,
    and the mask is never read there."""
    spec, state = filled(MIXED, [30, 60], 1, 32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 32, generator=g)
    check(q, state, spec, mask=torch.ones(2, 1, 1, 37, dtype=torch.bool))
    check(q, state, spec, mask=torch.randn(1, 2, 1, 21, generator=g))
    dq, dstate = q.to(DEV), type(state)(*[t.to(DEV) for t in state])
    full = launch.attention(dq, dstate, spec).cpu()  # sees all 60 positions: a different answer for row 1
    narrow = launch.attention(dq, dstate, spec, mask=torch.zeros(1, 1, 1, 37, device=DEV)).cpu()
    assert torch.equal(full[0], narrow[0]) and not torch.allclose(full[1], narrow[1])


@pytest.mark.parametrize("kernel", ["general", "decode"])
def test_a_query_that_sees_nothing_returns_zeros(kernel):
    """Row 0 sees no position: zeros. Row 1 sees one (a packed one, position 5): its weight is 1, so the output
    is that position's stored value, in both query heads: as it is stored with the general kernel's fp32 operands,
    within its bound with the decode kernel's bf16 ones (int2 values at head_dim 32, over a padded head)."""
    spec, state = filled(MIXED, [3, 40], 1, 32)
    mask = torch.zeros(2, 1, 1, 48, dtype=torch.bool)
    mask[1, ..., 5] = True
    q = torch.randn(2, 2, 1, 32, generator=torch.Generator().manual_seed(0))
    got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec, mask.to(DEV),
                           kernel=kernel).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    v = dequantize_reference(state, spec)[1]
    if kernel == "general" and launch.dot_precision(torch.device(DEV)) == "ieee":
        torch.testing.assert_close(got[1, :, 0], v[1, 0, 5].expand(2, -1))
    else:
        bound = launch.reference_and_bound(q, state, spec, mask, kernel=kernel, device=DEV)[1]
        assert ((got[1, :, 0] - v[1, 0, 5]).abs() <= bound[1, :, 0]).all()


@pytest.mark.parametrize("kernel", ["general", "decode"])
def test_the_bound_catches_one_wrong_code(kernel):
    """The check is sharp enough to fail: flip one stored key code of one position and it must fire."""
    exact = kernel == "general" and launch.dot_precision(torch.device(DEV)) == "ieee"
    # one int8 code off by one step (fp32 operands); bf16 operands (the decode kernel; the general one's packed
    # positions on CUDA) loosen the bound to about 2**-7 of each score, so there it is off by 128, half its range
    spec, state, bad, q = one_wrong_code(1 if exact else 128)
    check(q, state, spec, kernel=kernel)
    got = launch.attention(q.to(DEV), type(bad)(*[t.to(DEV) for t in bad]), spec, kernel=kernel).cpu()
    want, bound = launch.reference_and_bound(q, state, spec, kernel=kernel, device=DEV)
    assert ((got.double() - want).abs() > bound).any()


def test_attention_keys_spell_out_the_specialization():
    key, kw = kattn.attention_config(MIXED, 128, 2, 16, 23, 64, 4, 1, 64, True, 0, "tf32")
    assert key == ("attention[k=int4.channel.16.asym.f16;v=int2.token.32.asym.f16;S=2;R=8;F=16;W=23;BS=64;D=128;"
                   "gqa=4;bq=1;bn=64;split=1;mask=0;dot=tf32;chunk=0]")
    assert kw["GP"] == 4 and kw["BLOCK_M"] == 16 and kw["K_CHANNEL"] and not kw["V_CHANNEL"] and not kw["CHUNK"]
    assert kw["BS"] == 64 and kw["BLOCK_N"] == 64
    assert kattn.attention_config(MIXED, 128, 2, 16, 23, 64, 4, 1, 64, True, 0, "tf32")[1] is kw
    assert kattn.attention_config(MIXED, 128, 2, 16, 23, 64, 4, 8, 64, False, 0, "tf32", True)[0].endswith("chunk=1]")
    with pytest.raises(ValueError, match="tile of 64 tokens does not divide the store's blocks of 32"):
        kattn.attention_config(MIXED, 128, 2, 16, 23, 32, 4, 1, 64, True, 0, "tf32")


@triton.jit
def _decode_kernel(c_ptr, o_ptr, E4M3: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(o_ptr + i, kattn._fp8_decode(tl.load(c_ptr + i), E4M3))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decode_equals_torch_for_every_finite_code(fmt):
    codes = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256, device=DEV)
    _decode_kernel[(1,)](codes.to(DEV), out, E4M3=fmt == "fp8_e4m3")
    want = codes.to(torch.uint8).view(Q.FP8_DTYPES[fmt]).float()
    if fmt == "fp8_e4m3":
        want = want * 2.0**-8  # the decode gives e4m3 values over 2**8 (exact); the kernel folds 2**8 into the scale
    finite = want.isfinite()  # NaN/inf codes are never written (|x / scale| <= max)
    assert torch.equal(out.cpu()[finite].view(torch.int32), want[finite].view(torch.int32))
    # the codes include fp8 subnormals, which become fp16 subnormals (below fp16's smallest normal) on the way
    assert ((want[finite] != 0) & (want[finite].abs() < torch.finfo(torch.float16).tiny)).sum() >= 6


# --------------------------------------------------------------------------- non-finite and huge values
from kvcompile.store import attention_reference  # noqa: E402
from nonfinite_checks import NONFINITE_POLICIES, assert_nan_pattern  # noqa: E402


@pytest.mark.parametrize("policy,dtype", slow_after(1, [
    (Policy(Quant("int4", "channel", 4), Quant("int8", "token", 8), residual=3, sink=2), "float32"),
    (Policy(Quant("fp8_e4m3", "channel", 4, scale_dtype="float32"), Quant("fp8_e5m2", "token", 8), residual=2,
            sink=1, rotate=True), "bfloat16"),
    (NONFINITE_POLICIES[3], "float32"),  # fp8 scales, int8 zero points
    (NONFINITE_POLICIES[5], "bfloat16"),  # one fixed scale, none stored: a poisoned token-head holds NaN codes
    (Policy(Quant("fp8_e5m2", "tensor"), Quant("fp8_e4m3", "tensor"), residual=3, sink=2, rotate=True), "float32"),
]))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
def test_attention_kernel_non_finite_values_poison_what_the_reference_says(policy, dtype):
    """The Triton kernel: NaN, +inf and -inf keys and values in sinks, packed groups' edges
    and the residual window; split-K decode, a chunked prefill, masks hiding some bad positions, the queries'
    own chunk: NaN exactly where ``attention_reference`` is, never inf, the rest within the derived bound."""
    B, H, G, D, L = 2, 1, 2, 16, 40
    spec, store, k, v = bad_store(policy, dtype, B, H, D, L)
    lengths = store.state.lengths
    state = store.state
    g = torch.Generator().manual_seed(4)

    def one(q, mask=None, chunk=(None, None)):
        got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                               None if mask is None else mask.to(DEV), None,
                               k_new=None if chunk[0] is None else chunk[0].to(DEV),
                               v_new=None if chunk[1] is None else chunk[1].to(DEV)).cpu()
        ref = attention_reference(q, state, spec, mask, None, torch.float64, k_new=chunk[0], v_new=chunk[1])
        assert_nan_pattern(got, ref, spec.name)
        want, tol = launch.reference_and_bound(q, state, spec, mask, None, k_new=chunk[0], v_new=chunk[1],
                                               device=DEV)
        assert torch.equal(want.isnan(), ref.isnan())
        ok = ~want.isnan()
        assert ((got.double() - want).abs()[ok] <= tol[ok]).all(), spec.name

    for n in (1, 5):
        q = torch.randn(B, H * G, n, D, generator=g)
        keep = torch.rand(B, 1, n, L + 2, generator=g) > 0.5
        for mask in (None, keep, torch.where(keep, torch.randn(B, 1, n, L + 2, generator=g), -torch.inf)):
            one(q, mask)
    own = torch.stack([k[b, :, int(lengths[b]) - 5:int(lengths[b])] for b in range(B)])
    own_v = torch.stack([v[b, :, int(lengths[b]) - 5:int(lengths[b])] for b in range(B)])
    one(torch.randn(B, H * G, 5, D, generator=g), chunk=(own, own_v))


@pytest.mark.parametrize("kf,vf", [("fp8_e4m3", "fp8_e5m2"), ("fp8_e5m2", "fp8_e4m3")])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
def test_fixed_scale_poisoned_token_head_reads_nan_there_and_nowhere_else(kf, vf):
    """fp8 with one fixed scale (axis="tensor", no scale stored): an inf in one key of one head and a NaN in one
    value of another head, written by the Triton store, make every code of exactly those two token-heads the NaN
    code (0x7F) and no other code NaN; the Triton kernels read them as NaN. A query that sees only the poisoned
    position gets NaN in the query heads of that KV head and a finite value elsewhere (the general kernel, one
    query per position; the decode kernel, one position at a time), and one that sees neither is finite."""
    B, H, G, D, L = 1, 2, 2, 32, 40
    spec = LayerSpec(Policy(Quant(kf, "tensor"), Quant(vf, "tensor"), residual=0), H, D, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    k[0, 0, 20, 0] = float("inf")  # key: token 20 of KV head 0
    v[0, 1, 7, 5] = float("nan")  # value: token 7 of KV head 1
    ref = scrambled(spec, B, 2 * spec.blocks_for(L), 1)
    got = ref.copy(DEV)
    ref.append(k, v)
    got.append(k.to(DEV), v.to(DEV), kernel=launch.store)
    from store_checks import assert_same_store
    assert_same_store(ref.state, got.state, spec)
    state = got.copy("cpu").state
    assert spec.boundary(L) == L  # every position packed
    table = state.table[0].long()
    for codes, (pos, head) in ((state.k_codes, (20, 0)), (state.v_codes, (7, 1))):
        per_pos = torch.stack([codes[table[p // 16], :, p % 16] for p in range(L)])  # [L, H, D]
        nan_code = (per_pos & 0x7F) == Q.FP8_NAN
        want = torch.zeros(L, H, dtype=torch.bool)
        want[pos, head] = True
        assert torch.equal(nan_code.all(-1), want) and torch.equal(nan_code.any(-1), want)
        assert (per_pos[pos, head] == Q.FP8_NAN).all()
    heads = torch.arange(H * G) // G  # each query head's KV head
    # the general kernel: query i sees position i only, so its output is that position's value (or NaN)
    q = torch.randn(B, H * G, L, D, generator=g)
    only = torch.zeros(B, 1, L, L, dtype=torch.bool)
    only[0, 0, torch.arange(L), torch.arange(L)] = True
    out = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec, only.to(DEV)).cpu()
    want = torch.zeros(B, H * G, L, D, dtype=torch.bool)
    want[0, heads == 0, 20] = True  # the poisoned key: its score is NaN, so the row is
    want[0, heads == 1, 7] = True  # the poisoned value: every channel NaN
    assert torch.equal(out.isnan(), want) and not out.isinf().any()
    assert_nan_pattern(out, attention_reference(q, state, spec, only, None, torch.float64))
    ok = ~want
    want_v, bound = launch.reference_and_bound(q, state, spec, only, device=DEV)
    assert ((out.double() - want_v).abs()[ok] <= bound[ok]).all()
    # the decode kernel: a query that sees position 7, 20, or everything but those two
    q1 = torch.randn(B, H * G, 1, D, generator=g)
    for seen, bad_head in (([7, 3], 1), ([20, 11], 0), ([p for p in range(L) if p not in (7, 20)], -1)):
        mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
        mask[..., seen] = True
        assert launch.plan(state, spec, q1.shape, mask).decode
        out = launch.attention(q1.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec, mask.to(DEV),
                               kernel="decode").cpu()
        want = (heads == bad_head).view(1, H * G, 1, 1).expand(B, H * G, 1, D)
        assert torch.equal(out.isnan(), want) and not out.isinf().any(), seen
        want_v, bound = launch.reference_and_bound(q1, state, spec, mask, kernel="decode", device=DEV)
        assert torch.equal(want_v.isnan(), want)
        assert ((out.double() - want_v).abs()[~want] <= bound[~want]).all(), seen
