"""The CPU kernels (``kvcompile.templates.cpu``): the generated C decode kernel and the SDPA prefill path,
against float64 attention over the reference's dequantized store.

The bound is the one derived for the Triton kernels (``kvcompile.templates.attention.reference_and_bound``;
fp32 dot products, online softmax, split merge, rotation, output rounding): the C kernel is built with
``-ffp-contract=off`` so it dequantizes with exactly the reference's fp32 operations, its exp is within
2**-22 relative (the derivation allows 2**-21 on the exponent), and ``nsplit`` is the split count the
launcher chose. The prefill path (PyTorch's SDPA) is checked with the same bound taking every key as its own
block (``nsplit`` = the positions scored), the loosest way SDPA can sum.

Stores are paged in blocks of 16 packed tokens (``attention_checks.filled``; 32, 64 where drawn) handed out
in a scrambled order, so a row's packed positions span several blocks that are neither contiguous nor in
order, and a 16-token block is shorter than the kernel's tile of 32 positions.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompile
from kvcompile import Policy, Quant
from kvcompile.store import KVStore, LayerSpec, attention_reference, dequantize_reference
from kvcompile.templates import attention as kattn
from kvcompile.templates import cpu, cpu_store
from kvcompile.templates import prefill as kprefill
import profiles
from attention_checks import LENGTHS, MIXED, ROTATED, filled, one_wrong_code
from store_checks import bad_store, scrambled

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")


class _Scored:
    """``spec`` with the ``capacity`` ``kattn.reference_and_bound`` still reads: the positions it scores, the
    longest row's (those past it are visible to no query)."""

    def __init__(self, spec, state):
        self._spec, self.capacity = spec, int(state.lengths.max())

    def __getattr__(self, name):
        return getattr(self._spec, name)


def bound(q, state, spec, mask=None, scale=None, nsplit=None, k_new=None, v_new=None):
    """``kattn.reference_and_bound`` for this store: (float64 attention, elementwise bound)."""
    return kattn.reference_and_bound(q, state, _Scored(spec, state), mask, scale, nsplit=nsplit, k_new=k_new,
                                     v_new=v_new)


def check(q, state, spec, mask=None, scale=None, prefill=False, nsplit=None, chunk=(None, None)):
    """Run the decode kernel (or the prefill path) and assert it is within the derived bound, elementwise.
    ``chunk``: the queries' own (k_new, v_new), read in full precision."""
    B, Hq, n, D = q.shape
    k_new, v_new = chunk
    if prefill:
        got = kprefill.prefill_attention(q, state, spec, mask, scale, k_new=k_new, v_new=v_new)
        nsplit = max(int(state.lengths.max()), 1)
    else:
        assert cpu.check_decode(q, spec) is None
        got = cpu.attention(q, state, spec, mask, scale, nsplit=nsplit, k_new=k_new, v_new=v_new)
        nsplit = nsplit or cpu.splits(state.lengths, spec.heads, cpu.threads_for(state.lengths, spec.heads))
    assert got.dtype == q.dtype and got.shape == q.shape
    want, tol = bound(q, state, spec, mask, scale, nsplit=nsplit, k_new=k_new, v_new=v_new)
    err = (got.double() - want).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst error "
                           f"{err[bad].max():.3g} vs bound {tol[bad][err[bad].argmax()]:.3g}; {spec.name}")
    return got


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_cpu_attention_grid(gqa, D):
    H, C = 2, 48  # C: the masks' width (every row holds fewer tokens)
    g = torch.Generator().manual_seed(gqa * D)
    spec, state = filled(MIXED, LENGTHS, H, D, chunk=10)
    B, Hq = len(LENGTHS), H * gqa
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec)  # decode
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec, nsplit=4)  # split in four, merged
    n = 16 // gqa  # as many query tokens as the decode kernel takes (row 0 holds fewer tokens than that)
    check(torch.randn(B, Hq, n, D, generator=g), state, spec)
    check(torch.randn(B, Hq, 20, D, generator=g), state, spec, prefill=True)
    spec, state = filled(ROTATED, LENGTHS, H, D)
    keep = torch.rand(B, 1, 1, C, generator=g) > 0.4
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec, mask=keep)
    soft = torch.where(torch.rand(B, Hq, 2, C, generator=g) > 0.2, torch.randn(B, Hq, 2, C, generator=g), -torch.inf)
    check(torch.randn(B, Hq, 2, D, generator=g), state, spec, mask=soft, scale=0.3)
    check(torch.randn(B, Hq, 2, D, generator=g), state, spec, mask=soft, scale=0.3, prefill=True)
    # 3-bit KIVI: eight-code units, and per-token groups narrower than an 8-lane vector of a plane
    kivi3 = Policy(Quant("int3", "channel", 16), Quant("int3", "token", 32), residual=8, sink=2)
    spec, state = filled(kivi3, LENGTHS, H, D, chunk=10)
    check(torch.randn(B, Hq, 1, D, generator=g), state, spec, nsplit=2)
    # the queries' own chunk in full precision: 20 > residual 8 (prefill), and decode with no residual
    spec, state, *chunk = filled(MIXED, LENGTHS, H, D, chunk=10, own=20)
    check(torch.randn(B, Hq, 20, D, generator=g), state, spec, prefill=True, chunk=chunk)
    no_ring = Policy(MIXED.key, MIXED.value, residual=0, sink=2)
    spec, state, *chunk = filled(no_ring, LENGTHS, H, D, own=16 // gqa)
    check(torch.randn(B, Hq, 16 // gqa, D, generator=g), state, spec, chunk=chunk, nsplit=3)


@pytest.mark.parametrize("policy", [MIXED, ROTATED], ids=["mixed", "rotated"])
def test_a_rows_decode_attention_does_not_depend_on_the_batch_or_the_threads(policy, monkeypatch):
    """What the decode kernel gives a sequence's row is the same bits alone, beside other sequences of other
    lengths, and on one thread or several (the machine's load decides how many): each sequence's positions are
    cut into the same pieces (``cpu.splits``) and merged in order. (A split count chosen per call, to keep the
    threads busy, gave a request other bits batched than alone.)"""
    H, D, G = 2, 64, 4
    lengths = [300, 40, 7, 1200, 299]  # ~10 to 40 tiles of 32: long enough to be split
    spec, state = filled(policy, lengths, H, D, chunk=97)
    q = torch.randn(len(lengths), H * G, 1, D, generator=torch.Generator().manual_seed(1))
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu, "available_threads", lambda t=threads: t)
        monkeypatch.setattr(cpu, "MIN_TILES_PER_THREAD", 1)  # every call may take all of them
        whole = cpu.attention(q, state, spec, None, None)
        for b in range(len(lengths)):
            rows = torch.tensor([b])
            alone = kvcompile.store.KVState(*state[:6], *(t.index_select(0, rows) for t in state[6:]))
            assert torch.equal(cpu.attention(q[b:b + 1], alone, spec, None, None), whole[b:b + 1]), (threads, b)
        outs.append(whole)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("policy", [MIXED, Policy.int8(), Policy(Quant("fp8_e4m3", "tensor"), Quant("int4"))],
                         ids=["mixed", "int8", "fp8-tensor"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_query_heads_bits_do_not_depend_on_the_heads_beside_it(policy, n):
    """The kernel computes two query rows' scores and values in one pass over a tile (``ROWB`` on AVX-512): each
    head's output -- causal chunks of ``n`` queries (a hidden tail), a mask hiding positions at random, a row
    seeing nothing -- is the bits it gets as the only query head of its kv head."""
    H, D, G = 2, 64, 5
    spec, state = filled(policy, [70, 33, 200], H, D, chunk=51)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, H * G, n, D, generator=g)
    mask = torch.zeros(3, H * G, n, 200).masked_fill_(torch.rand(3, H * G, n, 200, generator=g) < 0.3,
                                                     float("-inf"))
    mask[1, 3] = float("-inf")
    for m in (None, mask):
        both = cpu.attention(q, state, spec, m, None)
        for j in range(G):
            heads = [h * G + j for h in range(H)]
            alone = cpu.attention(q[:, heads], state, spec, None if m is None else m[:, heads], None)
            assert torch.equal(both[:, heads].nan_to_num(), alone.nan_to_num()), (j, m is None)
            assert torch.equal(both[:, heads].isnan(), alone.isnan())


PROMPT_POLICIES = {  # every region and code path of the shared-tile walk: sinks, rings, channel and token groups
    "mixed": MIXED, "rotated": ROTATED, "int8": Policy.int8(),
    "kivi-ring": Policy(Quant("int4", "channel", 32), Quant("int4", "token", 32), residual=0),
    "keys-unquantized": Policy(Quant("none"), Quant("int8")),
    "fp8": Policy(Quant("fp8_e4m3", "token"), Quant("fp8_e4m3", "token")),
    "fp8-tensor": Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), rotate=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PROMPT_POLICIES))
def test_a_prompts_rows_sharing_their_tiles_get_the_bits_each_row_gets_alone(name, dtype, monkeypatch):
    """A prompt's queries through the pages are each the decode row of its own position (``kvcompile.pages``);
    given the runs of rows that are one sequence (``groups``), the kernel dequantizes a packed tile once for a
    group's rows (``kvc_attention_rows``). Every row's output is the bits it gets without them -- its own
    splits, its own tiles in order -- whatever the splits and however the runs are cut into groups."""
    H, D, G = 2, 64, 3
    spec, state = filled(PROMPT_POLICIES[name], [300, 45], H, D, dtype=dtype, chunk=97)
    seq = torch.tensor([0] * 300 + [1] * 45)
    rows = kvcompile.store.KVState(*state[:6], *(t.index_select(0, seq) for t in state[6:]))
    rows = rows._replace(lengths=torch.cat([torch.arange(1, 301), torch.arange(1, 46)]).to(torch.int32))
    q = torch.randn(len(seq), H * G, 1, D, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    runs = torch.tensor([0, 300, 345], dtype=torch.int32)
    for nsplit in (1, 2, 3):
        alone = cpu.attention(q, rows, spec, None, None, nsplit=nsplit)
        for most in (32, 7, 1000):
            monkeypatch.setattr(cpu, "GROUP_ROWS", most)
            got = cpu.attention(q, rows, spec, None, None, nsplit=nsplit, groups=runs)
            assert torch.equal(got.nan_to_num(), alone.nan_to_num()) and torch.equal(got.isnan(), alone.isnan()), \
                (nsplit, most, (got.float() - alone.float()).abs().max())


@pytest.mark.parametrize("name", list(PROMPT_POLICIES))
def test_masked_rows_sharing_their_tiles_get_the_bits_each_row_gets_alone(name, monkeypatch):
    """A sliding window's prompt rows (``kvcompile.pages``) share their tiles too, each under its own row of an
    additive mask: a window of 50 positions, a few more positions hidden at random, and for the shorter sequence
    a mask narrower than its rows (positions past the width are hidden). Every row gets the bits it gets alone,
    and rows whose mask hides everything get what they get alone (zeros)."""
    H, D, G = 2, 64, 3
    spec, state = filled(PROMPT_POLICIES[name], [300, 45], H, D, chunk=97)
    seq = torch.tensor([0] * 300 + [1] * 45)
    rows = kvcompile.store.KVState(*state[:6], *(t.index_select(0, seq) for t in state[6:]))
    L = torch.cat([torch.arange(1, 301), torch.arange(1, 46)])
    rows = rows._replace(lengths=L.to(torch.int32))
    at = torch.arange(300)
    g = torch.Generator().manual_seed(3)
    hide = (at < L[:, None] - 50) | (at >= L[:, None]) | (torch.rand(345, 300, generator=g) < 0.05)
    hide[300:, 30:] = True  # the shorter sequence: nothing past position 29 (its width, below)
    hide[7] = True  # a row that sees nothing
    mask = torch.zeros(345, 1, 1, 300).masked_fill_(hide[:, None, None], float("-inf"))
    q = torch.randn(len(seq), H * G, 1, D, generator=torch.Generator().manual_seed(1))
    runs = torch.tensor([0, 300, 345], dtype=torch.int32)
    for nsplit in (1, 3):
        alone = cpu.attention(q, rows, spec, mask, None, nsplit=nsplit)
        assert torch.equal(alone[7], torch.zeros_like(alone[7]))
        for most in (32, 7):
            monkeypatch.setattr(cpu, "GROUP_ROWS", most)
            got = cpu.attention(q, rows, spec, mask, None, nsplit=nsplit, groups=runs)
            assert torch.equal(got.nan_to_num(), alone.nan_to_num()) and torch.equal(got.isnan(), alone.isnan()), \
                (nsplit, most, (got.float() - alone.float()).abs().max())
    causal = cpu.attention(q, rows, spec, None, None, groups=runs)
    assert not torch.equal(causal, alone)  # the mask was applied


@pytest.mark.parametrize("name", ["mixed", "kivi-ring"])
def test_rows_sharing_a_ring_get_the_bits_of_rows_with_their_own(name):
    """With ``rings``, row ``b`` reads ring ``rings[b]``: rows whose full-precision positions begin at the same
    position share one (the pages give a prompt's rows the ring of the last of them). Each row's output is the
    bits it gets from a copy of its own, through the rows kernel and through every path that expands them."""
    H, D, G = 2, 64, 3
    spec, state = filled(PROMPT_POLICIES[name], [300, 45], H, D, chunk=97)
    seq = torch.tensor([0] * 300 + [1] * 45)
    rows = kvcompile.store.KVState(*state[:6], *(t.index_select(0, seq) for t in state[6:]))
    rows = rows._replace(lengths=torch.cat([torch.arange(1, 301), torch.arange(1, 46)]).to(torch.int32))
    # rings: each sequence's, scrambled with a decoy in between, and a few rows of sequence 0 on a copy
    decoy = torch.randn_like(state.k_res[:1])
    shared = rows._replace(k_res=torch.cat([state.k_res[1:], decoy, state.k_res[:1], state.k_res[:1]]),
                           v_res=torch.cat([state.v_res[1:], decoy, state.v_res[:1], state.v_res[:1]]))
    rings = torch.tensor([2] * 150 + [3] * 150 + [0] * 45, dtype=torch.int32)
    q = torch.randn(len(seq), H * G, 1, D, generator=torch.Generator().manual_seed(2))
    runs = torch.tensor([0, 300, 345], dtype=torch.int32)
    own = cpu.attention(q, rows, spec, None, None, groups=runs)
    assert torch.equal(cpu.attention(q, shared, spec, None, None, groups=runs, rings=rings), own)
    assert torch.equal(cpu.attention(q, shared, spec, None, None, rings=rings), own)  # no groups: expanded
    with pytest.raises(kvcompile.errors.ArgumentError, match="rings must be int32"):
        cpu.attention(q, shared, spec, None, None, groups=runs, rings=torch.full((345,), 4, dtype=torch.int32))


def test_row_groups_that_do_not_describe_the_rows_are_refused():
    spec, state = filled(MIXED, [40, 20], 1, 64)
    seq = torch.tensor([0] * 5 + [1] * 3)
    rows = kvcompile.store.KVState(*state[:6], *(t.index_select(0, seq) for t in state[6:]))
    rows = rows._replace(lengths=torch.tensor([1, 2, 3, 4, 5, 1, 2, 3], dtype=torch.int32))
    q = torch.randn(8, 2, 1, 64)
    ok = cpu.attention(q, rows, spec, None, None, groups=torch.tensor([0, 5, 8], dtype=torch.int32))
    assert torch.equal(ok, cpu.attention(q, rows, spec, None, None))
    with pytest.raises(kvcompile.errors.ArgumentError, match="share their block table"):
        cpu.attention(q, rows, spec, None, None, groups=torch.tensor([0, 6, 8], dtype=torch.int32))  # two tables
    backwards = rows._replace(lengths=torch.tensor([5, 4, 3, 2, 1, 1, 2, 3], dtype=torch.int32))
    with pytest.raises(kvcompile.errors.ArgumentError, match="ascending"):
        cpu.attention(q, backwards, spec, None, None, groups=torch.tensor([0, 5, 8], dtype=torch.int32))
    with pytest.raises(kvcompile.errors.ArgumentError, match="offsets from 0"):
        cpu.attention(q, rows, spec, None, None, groups=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(kvcompile.errors.ArgumentError, match="one query a row"):
        cpu.attention(q.expand(8, 2, 2, 64), rows, spec, None, None, groups=torch.tensor([0, 5, 8], dtype=torch.int32))


@st.composite
def quants(draw, D):
    fmt = draw(st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]))
    if fmt.startswith("fp8") and draw(st.integers(0, 2)) == 0:
        return Quant(fmt, "tensor")  # one fixed scale, none stored
    axis = draw(st.sampled_from(["token", "channel"]))
    group = draw(st.sampled_from([None, 1, 2, 8, 16]) if axis == "token" else st.sampled_from([2, 4, 8]))
    if axis == "token" and group is not None and D % group:
        group = None
    return Quant(fmt, axis, group, True if fmt.startswith("fp8") else draw(st.booleans()),
                 draw(st.sampled_from(["float16", "float32", "fp8_e4m3"])))


@st.composite
def cases(draw):
    D = draw(st.sampled_from([8, 24, 32, 40, 64]))  # vector and scalar unpack paths (D/per not a multiple of 8)
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 3, 16])),
                    sink=draw(st.sampled_from([0, 2])), rotate=D in (8, 32, 64) and draw(st.booleans()))
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 4, 8]))
    C = 80
    lengths = [draw(st.integers(0, C)) for _ in range(B)]
    n = draw(st.sampled_from([1, 1, 2])) if G <= 8 else 1
    mask = draw(st.sampled_from([None, "bool", "float"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    chunk = draw(st.sampled_from([None, 1, 7, 32]))
    nsplit = draw(st.sampled_from([None, 1, 2, 3, 5]))  # flash-decoding pieces, merged at the end
    own = draw(st.booleans())  # pass the queries' own chunk (read in full precision)
    block = draw(st.sampled_from([16, 16, 32, 64]))  # packed tokens per block (the flush group if larger)
    return policy, B, H, G, D, C, lengths, n, mask, dtype, chunk, nsplit, own, block, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@profiles.KERNEL
@given(cases())
def test_cpu_attention_equals_float64_attention(case):
    policy, B, H, G, D, C, lengths, n, mask_kind, dtype, chunk, nsplit, own, block, seed = case
    if max(lengths) == 0:
        lengths[0] = 1
    g = torch.Generator().manual_seed(seed)
    spec, state, *mine = filled(policy, lengths, H, D, dtype, seed, chunk, own=n, block=block)
    mine = mine if own else (None, None)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, n, C, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.where(torch.rand(1, H * G, 1, C + 5, generator=g) > 0.3, torch.randn(C + 5, generator=g), -torch.inf)
    q = torch.randn(B, H * G, n, D, generator=g).to(spec.torch_dtype)
    scale = float(torch.rand((), generator=g)) + 0.05
    check(q, state, spec, mask, scale, nsplit=nsplit, chunk=mine)
    check(q, state, spec, mask, scale, prefill=True, chunk=mine)


def scattered(state, spec) -> bool:
    """Whether some row's packed blocks are not where a kernel ignoring the block table would look for them
    (``LayerSpec.allocate``'s layout: row ``b``'s block ``j`` is ``b * MB + j``)."""
    mb = state.table.shape[1]
    return any(int(state.table[b, j]) != b * mb + j
               for b, L in enumerate(state.lengths.tolist()) for j in range(spec.blocks_for(L)))


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("B", [1, 3])
def test_cpu_attention_paged_layouts(block, B):
    """Each block size (16: shorter than the kernel's tile of 32, which must stop at the block's end), one
    sequence and a ragged batch, rows spanning several scrambled blocks: decode (one split and three),
    several query tokens, and the prefill path."""
    H, G, D = 2, 3, 32
    lengths = [3 * block + 21, block + 5, 2][:B]
    spec, state = filled(MIXED, lengths, H, D, seed=block, chunk=block + 3, block=block)
    assert spec.block == block and state.table.shape[1] >= 3 and scattered(state, spec)
    g = torch.Generator().manual_seed(block + B)
    check(torch.randn(B, H * G, 1, D, generator=g), state, spec)
    check(torch.randn(B, H * G, 1, D, generator=g), state, spec, nsplit=3)
    check(torch.randn(B, H * G, 4, D, generator=g), state, spec)
    check(torch.randn(B, H * G, 9, D, generator=g), state, spec, prefill=True)


def test_cpu_attention_after_select_and_crop():
    """Rows that share blocks (``select([0, 0, 1])``), then diverge (the shared block they write is copied),
    then are cropped and grow again: the kernel reads each row's own blocks through its table."""
    policy = Policy(Quant("int4", "channel", 8), Quant("int2", "token", 16), residual=4, sink=1)
    H, G, D = 2, 2, 32
    spec = LayerSpec(policy, H, D, block_tokens=16)
    store = scrambled(spec, 2, 24, seed=5)
    g = torch.Generator().manual_seed(5)
    store.append(torch.randn(2, H, 60, D, generator=g), torch.randn(2, H, 60, D, generator=g), torch.tensor([45, 60]))
    store.select([0, 0, 1])
    q = torch.randn(1, H * G, 1, D, generator=g).expand(3, -1, -1, -1).contiguous()
    same = check(q, store.state, spec)
    assert torch.equal(same[0], same[1]) and scattered(store.state, spec)  # one sequence, read twice
    store.append(torch.randn(3, H, 20, D, generator=g), torch.randn(3, H, 20, D, generator=g), torch.tensor([20, 9, 3]))
    assert store.tables[0][:2] == store.tables[1][:2] and store.tables[0][2] != store.tables[1][2]
    diverged = check(q, store.state, spec)
    assert not torch.equal(diverged[0], diverged[1])
    check(torch.randn(3, H * G, 3, D, generator=g), store.state, spec, nsplit=2)
    store.crop(37)  # packed positions return to the ring; blocks past the new length are freed
    check(q, store.state, spec)
    store.append(torch.randn(3, H, 30, D, generator=g), torch.randn(3, H, 30, D, generator=g))
    check(q, store.state, spec)
    check(torch.randn(3, H * G, 20, D, generator=g), store.state, spec, prefill=True)
    assert scattered(store.state, spec)


def test_a_table_that_names_no_block_is_an_error():
    """A table entry that is unreserved (-1) or names no block of the pool, where a row's packed positions lie,
    or a table too narrow for them, is a clear error rather than a read out of bounds."""
    spec, state = filled(MIXED, [50, 30], 1, 32)
    q = torch.randn(2, 2, 1, 32)
    cpu.attention(q, state, spec, None, None)
    for b, j, blk in ((0, 1, -1), (1, 0, state.k_codes.shape[0]), (0, 0, 10 ** 6)):
        bad = state.table.clone()
        bad[b, j] = blk
        with pytest.raises(ValueError, match=f"block table of sequence {b} .* does not name a block of the pool"):
            cpu.attention(q, state._replace(table=bad), spec, None, None)
    narrow = state._replace(table=state.table[:, :1].contiguous())  # row 0 has packed positions in two blocks
    with pytest.raises(ValueError, match="block table of sequence 0"):
        cpu.attention(q, narrow, spec, None, None)
    past = state.table.clone()
    past[1, spec.blocks_for(30):] = -1  # entries past a row's packed positions are never read
    cpu.attention(q, state._replace(table=past), spec, None, None)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_narrower_than_a_sequence_hides_the_positions_past_it(kind):
    """A mask narrower than the longest row: positions past its width are visible to no query, as in the
    reference (``store.cover``). Checked against the bound computed with the mask widened by invisible
    positions, which the reference's own output equals."""
    spec, state = filled(MIXED, [20, 40], 1, 32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 2, 32, generator=g)
    mask = torch.rand(2, 1, 2, 33, generator=g) > 0.3
    hidden = False
    if kind == "float":
        mask, hidden = torch.where(mask, torch.randn(2, 1, 2, 33, generator=g), -torch.inf), float("-inf")
    wide = torch.nn.functional.pad(mask, (0, 7), value=hidden)  # positions 33 .. 39 visible to no query
    assert torch.equal(attention_reference(q, state, spec, mask), attention_reference(q, state, spec, wide))
    for prefill in (False, True):
        fn = kprefill.prefill_attention if prefill else cpu.attention
        got = fn(q, state, spec, mask, None)
        ref, tol = bound(q, state, spec, wide, nsplit=40 if prefill else
                         cpu.splits(state.lengths, 1, cpu.threads_for(state.lengths, 1)))
        assert ((got.double() - ref).abs() <= tol).all()
        # the hidden positions matter: visible, they would change the output beyond the bound
        seen = torch.nn.functional.pad(mask, (0, 7), value=True if kind == "bool" else 0.0)
        assert not ((fn(q, state, spec, seen, None).double() - ref).abs() <= tol).all()


def test_a_query_that_sees_nothing_returns_zeros():
    spec, state = filled(MIXED, [3, 40], 1, 32)
    mask = torch.zeros(2, 1, 1, 48, dtype=torch.bool)
    mask[1, ..., 5] = True
    q = torch.randn(2, 2, 1, 32, generator=torch.Generator().manual_seed(0))
    v = dequantize_reference(state, spec)[1]
    for got in (cpu.attention(q, state, spec, mask, None), kprefill.prefill_attention(q, state, spec, mask, None)):
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        # row 1 sees one packed position (5): weight 1, so the output is its stored value in both query heads
        torch.testing.assert_close(got[1, :, 0], v[1, 0, 5].expand(2, -1))


def test_the_bound_catches_one_wrong_code():
    """The check is sharp enough to fail: one stored int8 key code off by one step must break it."""
    spec, state, bad, q = one_wrong_code()
    check(q, state, spec)
    got = cpu.attention(q, bad, spec, None, None)
    nsplit = cpu.splits(state.lengths, 1, cpu.threads_for(state.lengths, 1))
    want, tol = bound(q, state, spec, nsplit=nsplit)
    assert ((got.double() - want).abs() > tol).any()


@pytest.mark.parametrize("D", [64, 8])  # sixteen codes at a time, and eight
@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decode_equals_torch_for_every_finite_code(fmt, flush, D):
    """The kernel's fp8 decode (through the CPU's fp16 conversion where it has one) gives torch's value for
    every finite code, subnormals included, also with denormals flushed (DAZ/FTZ, as
    torch.set_flush_denormal(True) sets them on the calling thread, where this helper runs)."""
    from kvcompile import quant as Q
    lib = cpu._kernel_for(LayerSpec(Policy.fp8(fmt), heads=1, head_dim=D))
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(Q.FP8_DTYPES[fmt]).float()
    got = torch.empty(256)
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no denormal flushing to set")
    try:
        assert ((torch.tensor([1e-40]) * 1.0).item() == 0.0) == flush  # the mode is what the test says
        lib.kvc_fp8_decode(codes.data_ptr(), got.data_ptr(), 256, int(fmt == "fp8_e5m2"))
    finally:
        torch.set_flush_denormal(False)
    fin = want.isfinite()
    tiny = torch.finfo(Q.FP8_DTYPES[fmt]).smallest_normal
    assert ((want[fin] != 0) & (want[fin].abs() < tiny)).sum() >= 6  # fp8 subnormals are among the codes checked
    wrong = got[fin] != want[fin]
    assert not wrong.any(), (codes[fin][wrong][:8], got[fin][wrong][:8], want[fin][wrong][:8])


def test_causal_mask_shortcut_is_exact():
    """transformers passes an explicit causal mask at prefill; the path recognises it and lets SDPA skip the
    upper triangle. A mask that differs anywhere is used as given."""
    spec, state = filled(Policy.kivi(4, group=8, residual=4), [30, 30], 2, 32)
    q = torch.randn(2, 4, 30, 32, generator=torch.Generator().manual_seed(2))
    tri = torch.ones(30, 40, dtype=torch.bool).tril().view(1, 1, 30, 40)
    assert kprefill._is_causal(tri, 30, 30)
    check(q, state, spec, tri, prefill=True)
    additive = torch.zeros(1, 1, 30, 40).masked_fill(~tri, float("-inf"))
    assert kprefill._is_causal(additive, 30, 30)
    other = tri.clone()
    other[0, 0, 7, 2] = False
    assert not kprefill._is_causal(other, 30, 30)
    check(q, state, spec, other, prefill=True)
    big = torch.ones(300, 310, dtype=torch.bool).tril().view(1, 1, 300, 310)  # checked in blocks of rows
    assert kprefill._is_causal(big, 300, 300)
    big = big.clone()
    big[..., 280, 290] = True
    assert not kprefill._is_causal(big, 300, 300)


def test_kernel_is_built_once_per_layout_and_named_by_it():
    spec = LayerSpec(Policy.kivi(4), 3, 64)
    key = tuple(sorted(cpu.defines(spec).items()))
    assert dict(key)["K_AXIS"] == 1 and dict(key)["V_AXIS"] == 0 and dict(key)["K_BITS"] == 4
    assert dict(key)["BS"] == spec.block == 64 and "CQ" not in dict(key)  # the layout, no capacity, no batch
    assert "G" not in dict(key) and "H" not in dict(key)  # nor the head counts: the kernel takes them as arguments
    assert cpu.build(key) is cpu.build(key)
    assert "k_bits4" in cpu.build(key)._name and "bs64" in cpu.build(key)._name
    # one build serves stores of any batch and length of the layout, and any head counts
    assert cpu.defines(spec) == cpu.defines(LayerSpec(Policy.kivi(4), 3, 64))
    assert cpu.defines(spec) == cpu.defines(LayerSpec(Policy.kivi(4), 1, 64))
    assert cpu._kernel_for(spec) is cpu._kernel_for(LayerSpec(Policy.kivi(4), 5, 64))
    assert cpu.defines(LayerSpec(Policy.kivi(4), 3, 64, block_tokens=128))["BS"] == 128


def test_one_build_serves_every_head_count():
    """The decode kernel of one layout, called for 1, 2 and 3 kv heads with 1, 3 and 8 query heads each (and
    several query tokens), is within the bound every time: the head counts are arguments, not constants."""
    D = 32
    before = cpu.build.cache_info().currsize
    for H, G in ((1, 1), (2, 3), (3, 8), (2, 1)):
        spec, state = filled(MIXED, LENGTHS, H, D, chunk=10)
        g = torch.Generator().manual_seed(H * 10 + G)
        check(torch.randn(len(LENGTHS), H * G, 1, D, generator=g), state, spec)
        check(torch.randn(len(LENGTHS), H * G, 16 // G, D, generator=g), state, spec, nsplit=3)
    assert cpu.build.cache_info().currsize <= before + 1  # one kernel for all of them


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu, "compiler", lambda: None)
    spec = LayerSpec(Policy.kivi(4, group=8), 1, 16)
    key = tuple(sorted(cpu.defines(spec).items()))
    cpu.build.cache_clear()
    cpu.compile_template.cache_clear()
    with pytest.raises(cpu.CompilerError, match=r"need a C compiler .*ops.set_kernels\('reference'\)"):
        cpu.build(key)
    cpu.build.cache_clear()
    cpu.compile_template.cache_clear()


def test_calls_the_kernel_cannot_take_are_said():
    spec = LayerSpec(Policy.kivi(4, group=4), 2, 12)
    assert "multiple of 8" in cpu.check_decode(torch.zeros(1, 2, 1, 12), spec)
    assert "prefill" in cpu.check_decode(torch.zeros(1, 6, 6, 16), LayerSpec(Policy.kivi(4, group=4), 2, 16))
    with pytest.raises(ValueError, match="decode kernel cannot take"):
        cpu.attention(torch.zeros(1, 2, 1, 12), spec.allocate(1, 16), spec, None, None)


def test_the_op_routes_decode_to_the_kernel_and_prefill_to_sdpa(monkeypatch):
    calls = []
    for mod, name in ((cpu, "attention"), (kprefill, "prefill_attention")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    spec = LayerSpec(MIXED, 2, 32, block_tokens=16)
    spec.register()
    k_cache, v_cache = torch.zeros(2, 2, 64, 32), torch.zeros(2, 2, 64, 32)  # a cache the store shadows
    kvcompile.ops.set_kernels("cpu")
    try:
        token = torch.ops.kvcompile.store(k_cache, v_cache, torch.randn(2, 2, 30, 32), torch.randn(2, 2, 30, 32),
                                          torch.arange(30), spec.name)
        torch.ops.kvcompile.attention(torch.randn(2, 6, 1, 32), k_cache, v_cache, token, None, 0.2, spec.name)
        torch.ops.kvcompile.attention(torch.randn(2, 6, 9, 32), k_cache, v_cache, token, None, 0.2, spec.name)
    finally:
        kvcompile.ops.set_kernels("auto")
    assert calls == ["attention", "prefill_attention"]


def test_mask_conversions_are_reused_only_for_the_same_unchanged_mask():
    """Every layer gets the same mask object, so its conversion is memoized -- but never across a change."""
    spec, state = filled(MIXED, [30, 30], 2, 32)
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 1, 1, 48, dtype=torch.bool)
    check(q, state, spec, mask)
    mask[:, :, :, 10:] = False  # in place: a new version of the same tensor
    check(q, state, spec, mask)
    check(q, state, spec, torch.rand(2, 1, 1, 48, generator=torch.Generator().manual_seed(4)) > 0.5)


def test_short_contexts_run_on_one_thread(monkeypatch):
    """A parallel region costs a time slice on a loaded machine: it is only opened when every thread gets
    at least MIN_TILES_PER_THREAD tiles. (Two threads fixed here: on a busy machine the free cores would
    lower the count.)"""
    n_threads = 2
    monkeypatch.setattr(cpu, "FIXED_THREADS", n_threads)
    assert cpu.threads_for(torch.tensor([160], dtype=torch.int32), 2) == 1
    long = torch.tensor([8192] * 4, dtype=torch.int32)
    assert cpu.threads_for(long, 3) == n_threads
    # the pieces a sequence is cut into do not follow the threads nor the batch (a row's bits would): always two
    for lengths, heads, threads in ((long, 3, 2), (torch.tensor([8192], dtype=torch.int32), 1, 2),
                                    (torch.tensor([160], dtype=torch.int32), 2, 1)):
        assert cpu.splits(lengths, heads, threads) == cpu.DECODE_SPLITS == 2


# --------------------------------------------------------------------------- non-finite and huge values
from nonfinite_checks import BAD, NONFINITE_POLICIES, assert_nan_pattern, bad_inputs  # noqa: E402

CPU_NONFINITE_POLICIES = NONFINITE_POLICIES + [Policy(Quant("fp8_e5m2", "token", 8), Quant("none"), residual=4, sink=2)]


def check_pattern(q, state, spec, mask=None, prefill=False, nsplit=None, chunk=(None, None)):
    """The kernel is NaN exactly where ``attention_reference`` is (its rule for non-finite values), never inf,
    and every other output is within the derived bound of float64 attention."""
    k_new, v_new = chunk
    if prefill:
        got = kprefill.prefill_attention(q, state, spec, mask, None, k_new=k_new, v_new=v_new)
        nsplit = max(int(state.lengths.max()), 1)
    else:
        got = cpu.attention(q, state, spec, mask, None, nsplit=nsplit, k_new=k_new, v_new=v_new)
        nsplit = nsplit or cpu.splits(state.lengths, spec.heads, cpu.threads_for(state.lengths, spec.heads))
    ref = attention_reference(q, state, spec, mask, None, torch.float64, k_new=k_new, v_new=v_new)
    assert_nan_pattern(got, ref, f"{'prefill' if prefill else 'decode'} {spec.name}")
    want, tol = bound(q, state, spec, mask, None, nsplit=nsplit, k_new=k_new, v_new=v_new)
    assert torch.equal(want.isnan(), ref.isnan())
    ok = ~want.isnan()
    assert ((got.double() - want).abs()[ok] <= tol[ok]).all(), spec.name
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", CPU_NONFINITE_POLICIES)
def test_cpu_attention_non_finite_values_poison_what_the_reference_says(policy, dtype):
    """NaN, +inf and -inf keys and values in sinks, on packed groups' first and last tokens and
    channels and in the residual window. Decode (one split and three), several query rows (a causal tail),
    the prefill path, masks that hide some of the bad positions, the queries' own chunk: the C kernel is NaN
    exactly where the reference is. Before, the C store wrote finite codes for a NaN, a NaN score in a tile
    with nothing else visible was skipped, a hidden NaN value poisoned its rows (0 * NaN), and the reference
    turned a NaN key's rows into zeros."""
    B, H, G, D, L = 2, 2, 2, 16, 40
    spec, store, k, v = bad_store(policy, dtype, B, H, D, L, kernel=cpu_store.store)
    lengths = store.state.lengths
    state = store.state
    g = torch.Generator().manual_seed(4)
    for n in (1, 4, 20):
        q = torch.randn(B, H * G, n, D, generator=g)
        keep = torch.rand(B, 1, n, L + 2, generator=g) > 0.5
        for mask in (None, keep, torch.where(keep, torch.randn(B, 1, n, L + 2, generator=g), -torch.inf)):
            if n * G <= cpu.ROWS_MAX:
                for nsplit in (1, 3):
                    check_pattern(q, state, spec, mask, nsplit=nsplit)
            check_pattern(q, state, spec, mask, prefill=True)
    own = torch.stack([k[b, :, int(lengths[b]) - 4:int(lengths[b])] for b in range(B)])
    own_v = torch.stack([v[b, :, int(lengths[b]) - 4:int(lengths[b])] for b in range(B)])
    q = torch.randn(B, H * G, 4, D, generator=g)
    check_pattern(q, state, spec, nsplit=2, chunk=(own, own_v))
    check_pattern(q, state, spec, prefill=True, chunk=(own, own_v))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_attention_is_finite_for_keys_beyond_fp16_scales(dtype):
    """int8 keys and values with fp16 scales (Policy.int8()) beyond 65,504 -- here up to the
    model dtype's largest value -- made a scale inf and the C kernel's output NaN. Now every output is finite
    and within the bound of float64 attention over what the store holds."""
    B, H, G, D, L = 1, 2, 2, 16, 40
    spec = LayerSpec(Policy.int8(residual=4), H, D, dtype, block_tokens=16)
    spec.register()
    top = torch.finfo(spec.torch_dtype).max
    k, v = bad_inputs(spec, B, L, 5, min(top, 1e6), bad=())
    store = scrambled(spec, B, 8, seed=5)
    store.append(k, v, kernel=cpu_store.store)
    q = torch.randn(B, H * G, 1, D, generator=torch.Generator().manual_seed(5)) / top  # O(1) scores
    for got in (check_pattern(q, store.state, spec, nsplit=2), check_pattern(q, store.state, spec, prefill=True)):
        assert torch.isfinite(got).all()
