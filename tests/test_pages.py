"""``kvcompile.pages``: a policy's packed blocks inside an engine's fixed-size pages.

What a page holds is the reference store's block, byte for byte: each test stores the same keys and values
through the pages (the kernels ``kvcompile.ops`` picks: the C kernels here) and through
``store_reference`` into a store of ``layout.spec`` with the same block table, and compares every field of
every page with that block. Attention over the pages is checked against float64 attention over the reference's
dequantized store within the bound derived for the kernels (``templates.attention.reference_and_bound``).
Pages are handed out scrambled, and laid out as an engine lays them out (vLLM: ``[pages, heads, block, C]`` bytes,
another layer's page between two of this layer's).
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import slow_after

from kvcompile import Policy, Quant
from kvcompile import pages as P
from kvcompile.errors import KVCompileError, UnsupportedError
from kvcompile.store import KVState, attention_reference, store_reference
from kvcompile.templates import attention as kattn
from kvcompile.templates import cpu

PER_TOKEN = [
    Policy.int8(),
    Policy(Quant("int4", "token"), Quant("int4", "token")),
    Policy(Quant("int2", "token", 32), Quant("int2", "token", 32), rotate=True),
    Policy(Quant("int3", "token"), Quant("int3", "token", symmetric=True)),
    Policy.fp8(residual=0),
    Policy.fp8("fp8_e5m2", residual=0),
    Policy(Quant("int4", "token", scale_dtype="fp8_e4m3"), Quant("int8", "token", scale_dtype="float32")),
    Policy(Quant("int8", "token"), Quant("none")),
    Policy.full(),
]


def bits(t):
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


def engine_pages(layout, n_pages, interleave=1):
    """An engine's int8 buffer for one layer, as vLLM views it: ``[pages, heads, block, C]``; with
    ``interleave > 1`` other layers' pages lie between this layer's (a block-outermost layout)."""
    H, BS, C = layout.heads, layout.block, layout.token_head_bytes
    raw = torch.zeros(n_pages * interleave * layout.page_bytes, dtype=torch.int8)
    return raw.as_strided((n_pages, H, BS, C), (interleave * layout.page_bytes, BS * C, C, 1))


def reference_state(layout, n_pages, lengths, table):
    """A store of ``layout.spec`` with pools of its own (``LayerSpec.pool``) and the engine's tables."""
    sp = layout.spec
    rows = sp.rows(len(lengths), table.shape[1])
    rows[-1].copy_(table)
    rows[-2].copy_(torch.tensor(lengths, dtype=torch.int32))
    return KVState(*sp.pool(n_pages), *rows)


def assert_pages_hold(layout, pages, ref):
    """Every field of every page equals the reference pool's block, bit for bit."""
    for name, got, want in zip(P.POOL_FIELDS, layout.views(pages), ref[:6]):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(bits(got), bits(want)), (name, layout.policy, int((bits(got) != bits(want)).sum()))


def scrambled_table(B, per_row, n_pages, seed):
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[:B * per_row]
    return perm.view(B, per_row).to(torch.int32)


# --------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("policy", PER_TOKEN, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,head_dim,block", [(1, 64, 16), (2, 128, 128), (3, 32, 32)])
def test_a_page_holds_the_block_and_nothing_overlaps(policy, dtype, heads, head_dim, block):
    lay = P.PageLayout(policy, heads, head_dim, dtype, block)
    assert lay.spec.block == block
    assert lay.page_bytes == heads * block * lay.token_head_bytes
    live = [f for f in lay.fields if f.shape]
    assert sum(f.nbytes for f in live) == lay.spec.block_nbytes()  # a page holds the block: no more, no less
    assert all(f.offset % P.ALIGN == 0 for f in live)
    ends = sorted((f.offset, f.offset + f.nbytes) for f in live)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] <= lay.page_bytes < lay.spec.block_nbytes() + 6 * P.ALIGN + heads * block


def test_int8_pages_are_about_half_of_bf16():
    """int8 keys and values with an fp16 scale and zero point per token-head: 2 * (D + 4) bytes per token-head
    where bf16 takes 4 * D (vLLM's own page: its C is 2 * head_size * 2)."""
    lay = P.PageLayout(Policy.int8(), 8, 128, "bfloat16", 128)
    assert lay.token_head_bytes == 2 * (128 + 4)
    assert lay.page_bytes / (8 * 128 * 4 * 128) == pytest.approx(0.516, abs=1e-3)


def test_layouts_are_values():
    lay = P.PageLayout(Policy.int8(), 2, 64, torch.bfloat16, 16)
    assert lay.dtype == "bfloat16" and lay == P.PageLayout(Policy.int8(), 2, 64, "bfloat16", 16)
    assert pickle.loads(pickle.dumps(lay)) == lay and hash(lay) == hash(P.PageLayout(Policy.int8(), 2, 64,
                                                                                        "bfloat16", 16))


@pytest.mark.parametrize("policy,block,kind", [
    (Policy.kivi(4), 128, P.Refusal.WINDOW),
    (Policy.kivi(4, residual=0), 128, P.Refusal.PER_CHANNEL),
    (Policy.fp8(), 128, P.Refusal.WINDOW),
    (Policy(Quant("int4"), Quant("int4"), sink=4), 128, P.Refusal.SINKS),
    (Policy(Quant("int4"), Quant("int4"), pre_rope=True), 128, P.Refusal.PRE_ROPE),
    (Policy.int8().override({0: Policy.full()}), 128, P.Refusal.OVERRIDES),
    (Policy.int8(), 48, P.Refusal.BLOCK),
    (Policy.int8(), 8, P.Refusal.BLOCK),
])
def test_what_pages_cannot_hold_is_refused_with_the_reason(policy, block, kind):
    found, reason = P.refusal(policy, block)
    assert found is kind
    with pytest.raises(P.PageError) as e:
        P.PageLayout(policy, 2, 64, "float32", block)
    assert e.value.kind is kind and isinstance(e.value, UnsupportedError) and isinstance(e.value, KVCompileError)
    assert isinstance(e.value, RuntimeError) and reason in str(e.value)
    assert any(w in reason for w in ("use ", "give ", "resolve "))  # what to do instead


@pytest.mark.parametrize("policy,kind", [
    (Policy.kivi(4), None), (Policy.kivi(2, residual=0), None), (Policy.fp8(), None), (Policy.int8(residual=16), None),
    (Policy.kivi(4, sink=4), None), (Policy.fp8(sink=4, rotate=True), None),  # sinks in the first page
    (Policy.kivi(4, residual=0, sink=4), P.Refusal.SINKS),  # packed tokens a page later: no window holds them
    (Policy.kivi(4, residual=64, sink=4), P.Refusal.SINKS),
    (Policy(Quant("int4"), Quant("int4"), pre_rope=True, residual=8), P.Refusal.PRE_ROPE),
])
def test_a_window_cache_holds_windows_key_groups_and_sinks(policy, kind):
    assert (P.refusal(policy, 128, window=True) or (None,))[0] is kind
    alone = P.Refusal.SINKS if policy.sink else P.Refusal.WINDOW if policy.residual else P.Refusal.PER_CHANNEL
    assert P.refusal(policy, 128)[0] is (kind or alone)
    if kind is None:
        lay = P.PageLayout(policy, 2, 64, "bfloat16", 128, window=True)
        assert lay.window_tokens == policy.residual + policy.flush - 1
        assert lay.page_bytes == P.PageLayout(Policy(policy.key, policy.value), 2, 64, "bfloat16", 128,
                                              window=policy.flush > 1).page_bytes  # the window costs no page byte
    elif kind is P.Refusal.SINKS:  # what would hold them: smaller pages, or a longer window
        reason = P.refusal(policy, 128, window=True)[1]
        assert f"residual >= {128 - policy.sink}" in reason
        if policy.residual:
            assert "pages of at most 64 tokens" in reason and P.refusal(policy, 64, window=True) is None


def test_sinks_that_do_not_fit_the_first_page_are_refused():
    with pytest.raises(P.PageError, match=r"its 40 sinks in full precision \(20480 bytes\) do not fit the first "
                                          r"page \(4096 bytes\): use fewer sinks or larger pages") as e:
        P.PageLayout(Policy.kivi(3, residual=40, sink=40), 2, 64, "bfloat16", 32, window=True)
    assert e.value.kind is P.Refusal.SINKS


def test_a_bad_buffer_is_refused_at_the_call():
    lay = P.PageLayout(Policy.int8(), 2, 64, "float32", 16)
    with pytest.raises(ValueError, match="dense bytes"):
        lay.views(torch.zeros(4, 2, 16, lay.token_head_bytes + 1, dtype=torch.int8))
    nhd = torch.zeros(4, 16, 2, lay.token_head_bytes, dtype=torch.int8).transpose(1, 2)  # tokens outside heads
    assert lay.views(nhd)[0].shape == (4, 2, 16, 64)  # still one page of dense bytes: kvcompile's own field order
    gap = torch.zeros(4, 2, 32, lay.token_head_bytes, dtype=torch.int8)[:, :, :16]
    with pytest.raises(ValueError, match="dense bytes"):
        lay.views(gap)
    with pytest.raises(ValueError, match="uint8 or int8"):
        lay.views(torch.zeros(4, lay.page_bytes // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="policy"):
        P.PageLayout("int8", 2, 64, "float32", 16)


def test_views_are_the_engines_bytes():
    lay = P.PageLayout(Policy(Quant("int4"), Quant("int8")), 2, 32, "float32", 16)
    pages = engine_pages(lay, 3, interleave=2)
    k_codes, k_scale, k_zero, v_codes, *_ = lay.views(pages)
    assert k_codes.shape == (3, 2, 16, 16) and k_scale.shape == (3, 2, 16, 1) and v_codes.shape == (3, 2, 16, 32)
    k_scale[2, 1, 5, 0] = 1.5
    flat = pages[2].reshape(-1).view(torch.uint8)
    f = lay.fields[1]
    at = f.offset + (1 * 16 + 5) * 2
    assert flat[at:at + 2].view(torch.float16).item() == 1.5


# --------------------------------------------------------------------------- the bytes
@st.composite
def batches(draw):
    policy = draw(st.sampled_from(PER_TOKEN))
    H, D = draw(st.sampled_from([(1, 64), (2, 32), (3, 64)]))
    block = draw(st.sampled_from([16, 32]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    lengths = draw(st.lists(st.integers(1, 70), min_size=1, max_size=4))
    steps = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))  # chunk sizes, cycled
    return policy, H, D, block, dtype, lengths, steps, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(batches())
def test_pages_hold_exactly_what_the_reference_stores(case):
    """Sequences of ragged lengths stored in chunks of drawn sizes (a prefill, chunked prefill, decode steps),
    through the engine's flat batches (``store_ragged``), into scrambled pages between another layer's pages."""
    policy, H, D, block, dtype, lengths, steps, seed = case
    lay = P.PageLayout(policy, H, D, dtype, block)
    g = torch.Generator().manual_seed(seed)
    B, per_row = len(lengths), -(-max(lengths) // block)
    n_pages = B * per_row + 3
    table = scrambled_table(B, per_row, n_pages, seed)
    pages = engine_pages(lay, n_pages, interleave=2)
    ref = reference_state(lay, n_pages, [0] * B, table)
    k = torch.randn(B, H, max(lengths), D, generator=g)
    k[..., 3] *= 8
    v = torch.randn(B, H, max(lengths), D, generator=g)
    held, i = [0] * B, 0
    while held != lengths:
        step = steps[i % len(steps)]
        i += 1
        n = [min(step, L - h) for L, h in zip(lengths, held)]
        live = [b for b in range(B) if n[b]]
        qs = torch.tensor([0] + [sum(n[b] for b in live[:j + 1]) for j in range(len(live))])
        kk = torch.cat([k[b, :, held[b]:held[b] + n[b]].transpose(0, 1) for b in live]).to(lay.spec.torch_dtype)
        vv = torch.cat([v[b, :, held[b]:held[b] + n[b]].transpose(0, 1) for b in live]).to(lay.spec.torch_dtype)
        batch = P.Ragged.of(qs, torch.tensor([held[b] + n[b] for b in live]), table[live])
        P.store_ragged(lay, pages, kk, vv, batch)
        chunk = max(n)
        kp = torch.zeros(B, H, chunk, D, dtype=kk.dtype)
        vp = torch.zeros_like(kp)
        for b in live:
            kp[b, :, :n[b]] = k[b, :, held[b]:held[b] + n[b]]
            vp[b, :, :n[b]] = v[b, :, held[b]:held[b] + n[b]]
        store_reference(ref, lay.spec, kp, vp, torch.tensor(n))
        held = [h + x for h, x in zip(held, n)]
    assert_pages_hold(lay, pages, ref)


# --------------------------------------------------------------------------- attention
def check_attention(lay, pages, ref, q, k_new, v_new, prefill):
    got = P.attention(lay, pages, q, ref.lengths, ref.table, k_new, v_new, scale=0.3)
    nsplit = max(int(ref.lengths.max()), 1) if prefill else \
        cpu.splits(ref.lengths, lay.heads, cpu.threads_for(ref.lengths, lay.heads))
    want, tol = kattn.reference_and_bound(q, ref, lay.spec, None, 0.3, nsplit=nsplit, k_new=k_new, v_new=v_new)
    err = (got.double() - want).abs()
    assert not (err > tol).any(), (lay.policy, float(err.max()), float(tol.min()))
    return got


@pytest.mark.parametrize("policy", slow_after(1, PER_TOKEN[:-1]), ids=str)
def test_attention_over_pages_is_the_kernels_attention(policy):
    """Decode (the C decode kernel, reading the pages in place) and a chunk of many queries (the prefill path),
    both with the queries' own keys and values read in full precision, against float64 attention over what the
    reference stored."""
    H, G, D, block = 2, 4, 64, 16
    lay = P.PageLayout(policy, H, D, "float32", block)
    lengths = [1, 17, 40, 70]
    g = torch.Generator().manual_seed(3)
    B, per_row = len(lengths), -(-max(lengths) // block)
    table = scrambled_table(B, per_row, B * per_row + 2, 3)
    pages = engine_pages(lay, B * per_row + 2)
    ref = reference_state(lay, B * per_row + 2, [0] * B, table)
    k = torch.randn(B, H, max(lengths), D, generator=g)
    v = torch.randn(B, H, max(lengths), D, generator=g)
    n_new = torch.tensor(lengths)
    P.store(lay, pages, k, v, torch.zeros(B, dtype=torch.int32), table, n_new)
    store_reference(ref, lay.spec, k, v, n_new)
    assert_pages_hold(lay, pages, ref)
    own = [k[b:b + 1, :, L - 1:L] for b, L in enumerate(lengths)]
    k1 = torch.cat(own)
    v1 = torch.cat([v[b:b + 1, :, L - 1:L] for b, L in enumerate(lengths)])
    q = torch.randn(B, H * G, 1, D, generator=g)
    assert cpu.check_decode(q, lay.spec) is None
    check_attention(lay, pages, ref, q, k1, v1, prefill=False)
    # the last 20 tokens of the sequences that have them, as one prefill chunk
    rows = [b for b, L in enumerate(lengths) if L >= 20]
    sub = KVState(*ref[:10], ref.lengths[rows], ref.table[rows])
    kc = torch.stack([k[b, :, lengths[b] - 20:lengths[b]] for b in rows])
    vc = torch.stack([v[b, :, lengths[b] - 20:lengths[b]] for b in rows])
    q20 = torch.randn(len(rows), H * G, 20, D, generator=g)
    check_attention(lay, pages, sub, q20, kc, vc, prefill=True)


@pytest.mark.slow
def test_ragged_attention_is_each_sequences_attention():
    """A flat batch mixing decodes and chunks of several lengths gives each sequence exactly the attention of
    the equal-length call for it alone (the kernels see the same rows), and writes nothing past the batch."""
    H, G, D, block = 2, 2, 32, 16
    lay = P.PageLayout(Policy(Quant("int4"), Quant("int4")), H, D, "float32", block)
    g = torch.Generator().manual_seed(5)
    seq = [30, 5, 41, 17]   # positions held after this step
    new = [1, 5, 9, 1]      # this step's tokens: decode, a first prefill, a chunk, decode
    B, per_row = len(seq), 3
    table = scrambled_table(B, per_row, 14, 5)
    pages = engine_pages(lay, 14)
    k = torch.randn(B, H, max(seq), D, generator=g)
    v = torch.randn(B, H, max(seq), D, generator=g)
    P.store(lay, pages, k, v, torch.zeros(B, dtype=torch.int32), table, torch.tensor(seq))
    T = sum(new)
    qs = torch.tensor([0, 1, 6, 15, 16])
    q = torch.randn(T + 3, H * G, D, generator=g)  # 3 rows of padding past the batch
    kk = torch.cat([k[b, :, L - n:L].transpose(0, 1) for b, (L, n) in enumerate(zip(seq, new))])
    vv = torch.cat([v[b, :, L - n:L].transpose(0, 1) for b, (L, n) in enumerate(zip(seq, new))])
    out = torch.full((T + 3, H * G, D), 7.0)
    P.attention_ragged(lay, pages, q, kk, vv, P.Ragged.of(qs, torch.tensor(seq), table), out=out)
    assert torch.equal(out[T:], torch.full((3, H * G, D), 7.0))
    for b, (L, n) in enumerate(zip(seq, new)):
        a = int(qs[b])
        alone = P.attention(lay, pages, q[a:a + n].transpose(0, 1)[None], torch.tensor([L]), table[b:b + 1],
                            k[b:b + 1, :, L - n:L], v[b:b + 1, :, L - n:L])
        assert torch.equal(out[a:a + n], alone[0].transpose(0, 1)), b


@pytest.mark.slow
def test_full_precision_pages_attend_as_the_reference():
    """``Policy.full()`` pages hold the keys and values themselves (the model's dtype)."""
    lay = P.PageLayout(Policy.full(), 2, 32, "float32", 16)
    pages = engine_pages(lay, 4)
    k, v = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    P.store(lay, pages, k, v, torch.zeros(1, dtype=torch.int32), table)
    kc = lay.views(pages)[0]
    assert torch.equal(kc[0, :, 8], k[0, :, 24]) and torch.equal(kc[3, 1, 7], k[0, 1, 39])
    q = torch.randn(1, 4, 1, 32)
    got = P.attention(lay, pages, q, torch.tensor([40]), table)
    ref = reference_state(lay, 4, [0], table)
    store_reference(ref, lay.spec, k, v)
    assert torch.allclose(got, attention_reference(q, ref, lay.spec), atol=1e-6)


def test_a_table_that_misses_a_page_writes_nothing():
    lay = P.PageLayout(Policy.int8(), 1, 32, "float32", 16)
    pages = engine_pages(lay, 2)
    from kvcompile.errors import CapacityError
    with pytest.raises(CapacityError):
        P.store(lay, pages, torch.randn(1, 1, 20, 32), torch.randn(1, 1, 20, 32), torch.zeros(1, dtype=torch.int32),
                torch.tensor([[1, -1]], dtype=torch.int32))
    assert not pages.any()


# --------------------------------------------------------------------------- the CUDA path's kernels
def test_triton_kernels_read_and_write_pages_as_the_c_kernels_do():
    """On CUDA ``kvcompile.ops`` runs the Triton kernels over the same page views (here in Triton's interpreter):
    the pages hold the reference's bytes and attention is within the bound."""
    from kvcompile import ops
    lay = P.PageLayout(Policy(Quant("int4"), Quant("int8", "token", 16)), 1, 32, "float32", 16)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    pages = engine_pages(lay, 4, interleave=2)
    ref = reference_state(lay, 4, [0, 0], table)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, 1, 24, 32, generator=g), torch.randn(2, 1, 24, 32, generator=g)
    n = torch.tensor([24, 19])
    ops.set_kernels("triton")
    try:
        P.store(lay, pages, k, v, torch.zeros(2, dtype=torch.int32), table, n)
        store_reference(ref, lay.spec, k, v, n)
        assert_pages_hold(lay, pages, ref)
        q = torch.randn(2, 2, 1, 32, generator=g)
        got = P.attention(lay, pages, q, ref.lengths, ref.table)
    finally:
        ops.set_kernels("auto")
    want, tol = kattn.reference_and_bound(q, ref, lay.spec, None, None, nsplit=24, decode=True)  # (the decode kernel)
    assert not ((got.double() - want).abs() > tol).any()


def test_triton_kernels_serve_an_engines_flat_batch():
    """The forms vLLM calls, on CUDA's kernels (here Triton's interpreter): a flat batch of a 29-token prompt and
    another sequence's first token, every query one decode row -- each within the decode kernel's bound of
    attention over the reference store as it stood when that query's token was the newest."""
    from kvcompile import ops
    lay = P.PageLayout(Policy(Quant("int4"), Quant("int8", "token", 16)), 1, 32, "float32", 16)
    table = scrambled_table(2, 2, 6, seed=3)
    pages = engine_pages(lay, 6)
    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(30, h, 32, generator=g) for h in (1, 1, 2))
    qs, seq = torch.tensor([0, 29, 30]), torch.tensor([29, 1])
    batch = P.Ragged.of(qs, seq, table)
    ops.set_kernels("triton")
    try:
        P.store_ragged(lay, pages, k, v, batch)
        out = P.attention_ragged(lay, pages, q, None, None, batch)
    finally:
        ops.set_kernels("auto")
    for i, (a, n) in enumerate([(0, 29), (29, 1)]):
        for j in range(n):
            ref = reference_state(lay, 6, [0], table[i:i + 1])
            store_reference(ref, lay.spec, k[a:a + j + 1].transpose(0, 1)[None], v[a:a + j + 1].transpose(0, 1)[None])
            qq = q[a + j].view(1, 2, 1, 32)
            want, tol = kattn.reference_and_bound(qq, ref, lay.spec, None, None, nsplit=24, decode=True)
            assert not ((out[a + j].view(1, 2, 1, 32).double() - want).abs() > tol).any(), (i, j)


# --------------------------------------------------------------------------- a window of full-precision tokens
def window_pages(layout, n_pages, wblock, pad=0):
    """An engine's window cache as vLLM lays it out: ``[pages, heads, block, 2 * D]`` of the model's dtype, each
    page padded by ``pad`` bytes (vLLM pads a window page to its packed page)."""
    dt = getattr(torch, layout.dtype)
    es = torch.empty((), dtype=dt).element_size()
    per_page = layout.window_page_bytes(wblock) // es + pad // es
    raw = torch.zeros(n_pages * per_page, dtype=dt)
    H, D = layout.heads, layout.head_dim
    return raw.as_strided((n_pages, H, wblock, 2 * D), (per_page, wblock * 2 * D, 2 * D, 1))


WINDOWED = [  # (policy, model dtype, packed block, window block, ring)
    (Policy.kivi(4), "float32", 64, 32, False),
    (Policy.kivi(2, rotate=True), "bfloat16", 32, 16, False),
    (Policy.kivi(3, residual=0), "float16", 64, 32, False),  # key groups only: 31 positions wait
    (Policy.fp8(residual=24), "bfloat16", 32, 16, False),    # a window of per-token groups
    (Policy.kivi(4, residual=0), "float32", 64, 32, True),   # the pending key group in a ring of 32 slots
    (Policy.kivi(2, residual=0, rotate=True), "bfloat16", 32, 48, True),
    (Policy.kivi(4, residual=40), "float16", 64, 80, True),  # a window in a ring (of more slots than needed)
    # sinks in each sequence's first page, its packed tokens from the second on
    (Policy.kivi(4, sink=4), "float32", 64, 32, False),
    (Policy.kivi(2, rotate=True, sink=4), "bfloat16", 32, 16, False),
    (Policy.fp8(residual=30, sink=3), "float16", 32, 16, False),  # per-token groups: the window covers 29
    (Policy.kivi(3, residual=40, sink=6), "bfloat16", 32, 16, False),
]


STEPS = [(70, 13), (1, 31), (33, 1), (1, 1), (40, 2), (1, 1), (1, 64), (5, 1)]  # two sequences' tokens a step


def windowed_steps(lay, pages, wcache, wblock, table, wtable, ring, steps, g, dt, Hq, window=None, after=None):
    """Two sequences' ``steps`` of random keys, values and queries (``dt``, ``Hq`` query heads) through
    ``store_windowed`` and ``attention_windowed`` (a sliding ``window``, if given), ``after(held)`` after each:
    ({sequence: [k, v, q, [outputs a step]]}, tokens each holds)."""
    H, D = lay.heads, lay.head_dim
    kept = {i: [torch.zeros(0, H, D, dtype=dt)] * 2 + [torch.zeros(0, Hq, D, dtype=dt), []] for i in (0, 1)}
    held = [0, 0]
    for ns in steps:
        k = torch.randn(sum(ns), H, D, generator=g).to(dt)
        v, q = torch.randn(sum(ns), H, D, generator=g).to(dt), torch.randn(sum(ns), Hq, D, generator=g).to(dt)
        qs = torch.tensor([0, ns[0], sum(ns)])
        seq = torch.tensor([held[0] + ns[0], held[1] + ns[1]])
        batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
        recent = P.store_windowed(lay, pages, wcache, wblock, k, v, batch, wbatch, ring=ring)
        out = P.attention_windowed(lay, pages, q, batch, recent, 0.125, window=window)
        for i in (0, 1):
            a, b = int(qs[i]), int(qs[i + 1])
            kk, vv, qq, oo = kept[i]
            kept[i] = [torch.cat([kk, k[a:b]]), torch.cat([vv, v[a:b]]), torch.cat([qq, q[a:b]]), oo + [out[a:b]]]
            held[i] += ns[i]
        if after is not None:
            after(held)
    return kept, held


@pytest.mark.parametrize("ring", [False, True])
def test_a_steps_layers_share_the_window_plan_of_its_first(ring, monkeypatch):
    """A step's layers share its flat batches (``vllm.backend.ragged``): the first layer's ``store_windowed``
    plans the step (``pages._Window``: the window table read back, the writes' and reads' indices, what it packs),
    the next layer -- other pages, other tokens -- reuses the plan and its calls' rows, and each layer's outputs,
    packed pages and window cache are the bits of batches of its own."""
    policy, dtype, block, wblock = Policy.kivi(4, residual=0), "float32", 64, 32
    H, Hq, D, n_pages = 2, 4, 64, 48
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    table = scrambled_table(2, 12, n_pages, seed=3)
    wtable = scrambled_table(2, 1 if ring else 24, n_pages, seed=103)
    g = torch.Generator().manual_seed(3)
    qs, seq = torch.tensor([0, 70, 83]), torch.tensor([70, 13])
    batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
    assert batch.starts == [0, 70, 83]
    planned, in_cache = [], P._in_cache  # a plan reads the window table to ask whether the cache holds the rings
    monkeypatch.setattr(P, "_in_cache", lambda *a: planned.append(1) or in_cache(*a))

    def layer(b, wb, pages, window, k, v, q):
        recent = P.store_windowed(lay, pages, window, wblock, k, v, b, wb, ring=ring)
        return P.attention_windowed(lay, pages, q, b, recent, 0.125)

    layers = [(engine_pages(lay, n_pages, interleave=2), window_pages(lay, n_pages, wblock, pad=64),
               *(torch.randn(83, h, D, generator=g) for h in (H, H, Hq))) for _ in range(2)]
    again, apart = copy.deepcopy(layers[1][:2]), copy.deepcopy(layers[1][:2])  # the second layer's pages, unwritten
    outs = [layer(batch, wbatch, *x) for x in layers]
    assert len(planned) == 1  # the window table is read (and the step planned) by the first layer alone
    (key, made), = wbatch.plans.items()
    assert made.packs is not None and made.writes is not None and len(batch.plans) == 1
    outs.append(layer(batch, wbatch, *again, *layers[1][2:]))  # the second layer again: the same plans
    assert len(planned) == 1 and wbatch.plans[key] is made and len(batch.plans) == 1
    alone = layer(P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable), *apart, *layers[1][2:])
    assert len(planned) == 2
    assert torch.equal(bits(outs[1]), bits(alone)) and torch.equal(bits(outs[2]), bits(alone))
    for mine, own in zip(layers[1][:2] + again, apart * 2):  # the pages and window caches: the same bytes
        assert torch.equal(bits(mine), bits(own))
    assert not torch.equal(bits(outs[0]), bits(outs[1]))
    # a plan is the step's: the same window batch beside another packed batch plans again
    layer(P.Ragged.of(qs, seq, table), wbatch, *copy.deepcopy(layers[1][:2]), *layers[1][2:])
    assert len(planned) == 3 and wbatch.plans[key] is not made


@pytest.mark.parametrize("policy,ring,wblock", [
    (Policy.kivi(4, residual=40), False, 16), (Policy.kivi(4, residual=0), True, 48),
    (Policy.kivi(2, residual=0), True, 32)], ids=["window", "ring-48", "ring-as-the-kernels"])
def test_a_decode_steps_layers_gather_their_rings_by_the_first_layers_indices(policy, ring, wblock, monkeypatch):
    """In a decode step (the rings come from the window cache) the first layer finds where each row's ring lies in
    the cache (``pages._ring_index``) and the step's other layers gather theirs by the same indices: each layer's
    outputs are the bits of a step of its own, and the next step finds them again."""
    dtype, block, H, Hq, D, n_pages = "bfloat16", 64, 2, 4, 64, 48
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    table = scrambled_table(2, 8, n_pages, seed=5)
    wtable = scrambled_table(2, 1 if ring else 16, n_pages, seed=105)
    g = torch.Generator().manual_seed(5)
    found, index = [], P._ring_index
    monkeypatch.setattr(P, "_ring_index", lambda *a: found.append(1) or index(*a))
    dt = getattr(torch, dtype)
    mine = [(engine_pages(lay, n_pages), window_pages(lay, n_pages, wblock)) for _ in range(2)]
    apart = copy.deepcopy(mine)
    qs = torch.tensor([0, 70, 83])
    for i, (b, w) in enumerate(mine + apart):  # a prefill of 70 and 13 tokens, each layer's own
        k, v = torch.randn(2, 83, H, D, generator=torch.Generator().manual_seed(i % 2)).to(dt)
        P.store_windowed(lay, b, w, wblock, k, v, P.Ragged.of(qs, torch.tensor([70, 13]), table),
                         P.Ragged.of(qs, torch.tensor([70, 13]), wtable), ring=ring)
    found.clear()
    qs, seq = torch.tensor([0, 1, 2]), torch.tensor([71, 14])
    for step in range(2):
        data = [tuple(torch.randn(2, h, D, generator=g).to(dt) for h in (H, H, Hq)) for _ in mine]
        batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
        shared = []
        for (pages, window), (k, v, q) in zip(mine, data):
            recent = P.store_windowed(lay, pages, window, wblock, k, v, batch, wbatch, ring=ring)
            assert recent.cache is not None  # a decode step: its rings from the cache
            shared.append(P.attention_windowed(lay, pages, q, batch, recent, 0.125))
        assert len(found) == step + 1  # the first layer found the rings, the second gathered by its indices
        for (pages, window), (k, v, q), out in zip(apart, data, shared):
            recent = P.store_windowed(lay, pages, window, wblock, k, v, P.Ragged.of(qs, seq, table),
                                      P.Ragged.of(qs, seq, wtable), ring=ring)
            assert torch.equal(bits(out), bits(P.attention_windowed(lay, pages, q, P.Ragged.of(qs, seq, table),
                                                                    recent, 0.125)))
        assert len(found) == step + 3 and not torch.equal(bits(shared[0]), bits(shared[1]))
        del found[step + 1:]
        seq = seq + 1
    # the same step's batch beside a window cache of another table (its pages moved): that table's rings
    (pages, window), (k, v, q) = copy.deepcopy(mine[0]), data[0]
    moved, wmoved = window.clone(), (wtable + 7) % n_pages
    moved[wmoved.flatten().long()] = window[wtable.flatten().long()]
    got = []
    for b in (batch, P.Ragged.of(qs, seq - 1, table)):
        p2, w2 = copy.deepcopy(pages), copy.deepcopy(moved)
        recent = P.store_windowed(lay, p2, w2, wblock, k, v, b, P.Ragged.of(qs, seq - 1, wmoved), ring=ring)
        got.append(P.attention_windowed(lay, p2, q, b, recent, 0.125))
    assert torch.equal(bits(got[0]), bits(got[1]))


@pytest.mark.parametrize("case", range(len(WINDOWED)))
def test_a_window_cache_gives_each_token_the_store_as_it_stood_when_it_was_newest(case):
    """Chunks of every size (a long prefill, decode steps, chunks that straddle groups and pages) from two
    sequences in one flat batch: each query's output is ``attention_reference`` over the reference store built one
    token at a time, read right after its own token was appended; every page of completed groups holds the
    reference's bytes (a store without the window: a group's bytes depend on its tokens alone; the reference with
    the window has them too once they leave it); the window pages hold the newest positions as the ring does."""
    policy, dtype, block, wblock, ring = WINDOWED[case]
    H, Hq, D, n_pages = 2, 4, 64, 48
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(case)
    pages = engine_pages(lay, n_pages, interleave=2)
    window = window_pages(lay, n_pages, wblock, pad=64)
    table = scrambled_table(2, 12, n_pages, seed=case)
    wtable = scrambled_table(2, 1 if ring else 24, n_pages, seed=case + 100)
    kept, held = windowed_steps(lay, pages, window, wblock, table, wtable, ring, STEPS, g, dt, Hq)
    sp, S = lay.spec, policy.sink
    # what the pages pack at once: every whole group (with sinks, those a page behind the newest token)
    eager = P.PageLayout(lay.packing_spec.policy, H, D, dtype, block, window=P.needs_window(lay.packing_spec.policy))
    wk, wv = lay.window_views(window, wblock)
    for i in (0, 1):
        kk, vv, qq, outs = kept[i]
        got = torch.cat(outs)
        # the reference's block j is in the sequence's page j (with sinks: page j + 1, its first page the sinks')
        tref = torch.cat([table[i:i + 1, 1:], table[i:i + 1, :1]], 1) if S else table[i:i + 1]
        ref = reference_state(lay, n_pages, [0], tref)
        for p in range(held[i]):
            def one(x):
                return x[p:p + 1].transpose(0, 1)[None]
            store_reference(ref, sp, one(kk), one(vv))
            want = attention_reference(one(qq), ref, sp, None, 0.125)  # its own token as stored too
            assert torch.allclose(got[p].float(), want[0, :, 0].float(), rtol=0, atol=2e-6 if dtype == "float32"
                                  else 4e-3), (p, float((got[p].float() - want[0, :, 0].float()).abs().max()))
        done = (sp.boundary(held[i]) - S) // block  # pages wholly packed in the reference store too
        for name, mine, theirs in zip(P.POOL_FIELDS, lay.views(pages), ref[:6]):
            if not mine.numel():  # a field the policy does not store
                assert not theirs.numel()
                continue
            for j in range(done):
                assert torch.equal(bits(mine[tref[0, j]]), bits(theirs[tref[0, j]])), (name, i, j)
        if S:  # the sinks, in full precision at the start of the first page
            for mine, theirs in zip(lay.sinks(pages), (ref.k_sink, ref.v_sink)):
                assert torch.equal(bits(mine[table[i, 0]]), bits(theirs[0])), i
        whole = reference_state(eager, n_pages, [0], tref)
        store_reference(whole, eager.spec, kk.transpose(0, 1)[None], vv.transpose(0, 1)[None])
        full = eager.spec.boundary(held[i]) - S
        assert full == (held[i] // policy.flush * policy.flush if not S else
                        max(0, held[i] - block) // policy.flush * policy.flush)
        for name, mine, theirs in zip(P.POOL_FIELDS, lay.views(pages), whole[:6]):
            if not mine.numel():
                continue
            for j in range(-(-full // block)):
                rows = min(block, full - j * block)
                m, t = mine[tref[0, j]], theirs[tref[0, j]]
                if name.endswith("scale") or name.endswith("zero"):
                    if policy.key.axis == "channel" and name.startswith("k"):
                        rows = rows // policy.flush
                assert torch.equal(bits(m[:, :rows]), bits(t[:, :rows])), (name, i, j)
        from kvcompile.store import as_stored
        for p in range(max(0, held[i] - lay.window_tokens), held[i]):
            page, row = (wtable[i, 0] if ring else wtable[i, p // wblock]), p % wblock
            want = as_stored(kk[p:p + 1].transpose(0, 1)[None], sp, dt, keys=True)
            assert torch.equal(wk[page, :, row], want[0, :, 0])
            assert torch.equal(wv[page, :, row], as_stored(vv[p:p + 1].transpose(0, 1)[None], sp, dt)[0, :, 0])


SLIDING_WINDOWED = [  # (policy, model dtype, packed block, window block, ring, sliding window)
    (Policy.kivi(4), "float32", 32, 32, False, 170),  # its window cache keeps 159 positions
    (Policy.kivi(2, residual=0, rotate=True), "bfloat16", 32, 48, True, 40),  # the pending group's 31 in a ring
    (Policy.fp8(residual=24), "float16", 32, 16, False, 30),
    # sinks in each sequence's first page (freed once they leave every window), its packed tokens a page later
    (Policy.kivi(4, sink=4), "float32", 32, 32, False, 170),
    (Policy.fp8(residual=30, sink=3), "bfloat16", 32, 16, False, 40),
]


@pytest.mark.parametrize("case", range(len(SLIDING_WINDOWED)))
def test_a_sliding_window_over_a_window_cache_reads_the_store_as_it_stood(case):
    """A sliding-window layer under a policy with a window cache: each query's output is ``attention_reference``
    over the reference store built one token at a time, read right after its own token was appended, masked to the
    query's last ``window`` positions. After every step the pages wholly before the window of the sequence's next
    query are filled with bytes that dequantize to NaN (the engine frees them): no later output reads one and no
    later store writes one."""
    policy, dtype, block, wblock, ring, W = SLIDING_WINDOWED[case]
    seed = case
    H, Hq, D, n_pages = 2, 4, 64, 48
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    pages = engine_pages(lay, n_pages, interleave=2)
    window = window_pages(lay, n_pages, wblock)
    table = scrambled_table(2, 12, n_pages, seed=seed)
    wtable = scrambled_table(2, 1 if ring else 24, n_pages, seed=seed + 100)
    freed = set()

    def free(held):  # vLLM's rule: pages wholly before the window of each sequence's next query
        for i in (0, 1):
            freed.update(int(table[i, j]) for j in range(max(0, held[i] - W + 1) // block))
        pages[sorted(freed)] = -1

    kept, held = windowed_steps(lay, pages, window, wblock, table, wtable, ring, STEPS + [(90, 1), (1, 1)], g, dt,
                                Hq, window=W, after=free)
    assert freed
    assert bool((pages[sorted(freed)] == -1).all())  # no store wrote a freed page
    sp = lay.spec
    for i in (0, 1):
        kk, vv, qq, outs = kept[i]
        got = torch.cat(outs)
        # the reference's block j is in the sequence's page j (with sinks: page j + 1, its first page the sinks')
        tref = torch.cat([table[i:i + 1, 1:], table[i:i + 1, :1]], 1) if policy.sink else table[i:i + 1]
        ref = reference_state(lay, n_pages, [0], tref)
        for p in range(held[i]):
            def one(x):
                return x[p:p + 1].transpose(0, 1)[None]
            store_reference(ref, sp, one(kk), one(vv))
            mask = torch.zeros(1, 1, 1, p + 1, dtype=torch.bool)
            mask[..., max(0, p - W + 1):] = True
            want = attention_reference(one(qq), ref, sp, mask, 0.125)
            assert torch.allclose(got[p].float(), want[0, :, 0].float(), rtol=0, atol=2e-6 if dtype == "float32"
                                  else 4e-3), (p, float((got[p].float() - want[0, :, 0].float()).abs().max()))


@pytest.mark.parametrize("case", [1, 4], ids=["ring", "sinks"])
def test_a_sliding_window_over_a_window_cache_is_the_same_bits_in_calls_of_any_size(case, monkeypatch):
    """A step's rows go to the kernels in calls of at most ``ROWS_PER_CALL`` rows x heads (``_query_calls``), each
    with its own rows' window masks and shared rings: calls of a few rows give every output the bits of one call."""
    policy, dtype, block, wblock, ring, W = SLIDING_WINDOWED[case]
    H, Hq, D, n_pages = 2, 4, 64, 48
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    table = scrambled_table(2, 12, n_pages, seed=case)
    wtable = scrambled_table(2, 1 if ring else 24, n_pages, seed=case + 100)
    outs = []
    for per_call in (P.ROWS_PER_CALL, 7 * H):
        monkeypatch.setattr(P, "ROWS_PER_CALL", per_call)
        kept, _ = windowed_steps(lay, engine_pages(lay, n_pages, interleave=2), window_pages(lay, n_pages, wblock),
                                 wblock, table, wtable, ring, STEPS + [(90, 1)], torch.Generator().manual_seed(1),
                                 getattr(torch, dtype), Hq, window=W)
        outs.append(torch.cat([torch.cat(kept[i][3]) for i in (0, 1)]))
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_triton_kernels_read_a_sliding_window_over_a_window_cache():
    """The CUDA path (Triton, in the interpreter here) of a sliding-window layer under KIVI: the same pages and
    window cache as the C kernels, and each query of the long sequence -- its window starting pages later --
    within the decode kernel's bound of the reference store as it stood, masked to its window."""
    W = 64  # its window cache keeps 45 positions
    lay = P.PageLayout(Policy.kivi(4, residual=30, group=16), 1, 32, "float32", 32, window=True)
    g = torch.Generator().manual_seed(12)
    table, wtable = scrambled_table(2, 5, 12, seed=5), scrambled_table(2, 8, 16, seed=6)
    steps = [(80, 1), (30, 1), (1, 1), (1, 1)]
    data = [tuple(torch.randn(sum(ns), h, 32, generator=g) for h in (1, 1, 2)) for ns in steps]
    results = windowed_on_both_kernels(lay, steps, data, table, wtable, 16, window=W)
    (pc, wc, oc), (pt, wt, ot) = results["cpu"], results["triton"]
    assert torch.equal(pc, pt) and torch.equal(wc, wt)
    for got in (ot, oc):
        assert_first_sequence_within_bound(lay, steps, data, table[:1], got, window=W)


def test_a_sliding_window_over_a_window_cache_is_checked_at_the_call():
    lay = P.PageLayout(Policy.kivi(4), 1, 32, "float32", 32, window=True)  # 159 positions in full precision
    batch = P.Ragged.of(torch.tensor([0, 3]), torch.tensor([3]), torch.tensor([[1]], dtype=torch.int32))
    q = torch.randn(3, 1, 32)
    for bad in (159, 64):
        with pytest.raises(KVCompileError, match="must be longer than the 159"):
            P.attention_windowed(lay, engine_pages(lay, 4), q, batch, None, window=bad)


def windowed_on_both_kernels(lay, steps, data, table, wtable, n_wpages, window=None) -> dict:
    """Two sequences' ``steps`` (token counts a step) of ``data`` ((k, v, q) a step) through ``store_windowed`` and
    ``attention_windowed`` (a sliding ``window``, if given) on the C kernels and on Triton's (in the interpreter):
    {kernels: (pages, window cache, outputs)}, each on 12 fresh pages and ``n_wpages`` window pages of 16."""
    from kvcompile import ops
    results = {}
    for kernels in ("cpu", "triton"):
        pages, wcache = engine_pages(lay, 12), window_pages(lay, n_wpages, 16)
        held, outs = [0, 0], []
        ops.set_kernels(kernels)
        try:
            for ns, (k, v, q) in zip(steps, data):
                qs, seq = torch.tensor([0, ns[0], sum(ns)]), torch.tensor([held[0] + ns[0], held[1] + ns[1]])
                recent = P.store_windowed(lay, pages, wcache, 16, k, v, P.Ragged.of(qs, seq, table),
                                          P.Ragged.of(qs, seq, wtable))
                outs.append(P.attention_windowed(lay, pages, q, P.Ragged.of(qs, seq, table), recent, 0.125,
                                                 window=window))
                held = seq.tolist()
        finally:
            ops.set_kernels("auto")
        results[kernels] = (pages.clone(), wcache.clone(), torch.cat(outs))
    return results


def assert_first_sequence_within_bound(lay, steps, data, tref, out, window=None):
    """Each query of the first sequence in ``out`` (``windowed_on_both_kernels``'s outputs) within the decode
    kernel's bound of the reference store (block table ``tref``) as it stood when its token was the newest -- masked
    to its last ``window`` positions, if given."""
    ref = reference_state(lay, 12, [0], tref)
    rows = [0] + [sum(map(sum, steps[:i])) for i in range(1, len(steps))]
    at = [r + j for r, ns in zip(rows, steps) for j in range(ns[0])]
    k0, v0, q0 = (torch.cat([d[x][:ns[0]] for d, ns in zip(data, steps)]) for x in range(3))
    for p, row in enumerate(at):
        store_reference(ref, lay.spec, k0[p:p + 1].transpose(0, 1)[None], v0[p:p + 1].transpose(0, 1)[None])
        mask = None
        if window is not None:
            mask = torch.zeros(1, 1, 1, p + 1, dtype=torch.bool)
            mask[..., max(0, p - window + 1):] = True
        want, tol = kattn.reference_and_bound(q0[p].view(1, 2, 1, 32), ref, lay.spec, mask, 0.125, nsplit=24,
                                              decode=True)
        assert not ((out[row].view(1, 2, 1, 32).double() - want).abs() > tol).any(), p


def test_triton_kernels_keep_sinks_and_a_window_as_the_c_kernels_do():
    """The CUDA path of a windowed layout with sinks (Triton, in the interpreter here): a prompt in two chunks beside
    decode steps of another sequence write the same sinks, packed pages and window as the C kernels (both bit-exact
    to the reference store), and every query's attention agrees with the C kernels' to float32 rounding."""
    lay = P.PageLayout(Policy.kivi(4, residual=30, sink=2, group=16), 1, 32, "float32", 32, window=True)
    g = torch.Generator().manual_seed(11)
    table, wtable = scrambled_table(2, 5, 12, seed=3), scrambled_table(2, 5, 12, seed=4)
    steps = [(50, 1), (20, 1), (1, 1), (1, 1)]
    data = [tuple(torch.randn(sum(ns), h, 32, generator=g) for h in (1, 1, 2)) for ns in steps]
    results = windowed_on_both_kernels(lay, steps, data, table, wtable, 12)
    (pc, wc, _), (pt, wt, ot) = results["cpu"], results["triton"]
    assert torch.equal(pc, pt) and torch.equal(wc, wt)
    assert lay.sinks(pt)[0][table[0, 0]].abs().sum() > 0  # the sinks were written
    # each query of the first sequence within the decode kernel's bound of the reference store as it stood
    assert_first_sequence_within_bound(lay, steps, data, torch.cat([table[:1, 1:], table[:1, :1]], 1), ot)


def test_a_window_cache_is_checked_at_the_call():
    found, reason = P.refusal(Policy.kivi(4, group=64), 32, window=True)
    assert found is P.Refusal.BLOCK and "whole per-channel groups of 64" in reason
    lay = P.PageLayout(Policy.kivi(4), 2, 64, "bfloat16", 64, window=True)
    with pytest.raises(ValueError, match="dense bytes"):
        lay.window_views(torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16), 32)  # a page of half the window
    plain = P.PageLayout(Policy.int8(), 2, 64, "bfloat16", 64)
    with pytest.raises(ValueError, match="window=True"):
        P.store_windowed(plain, None, None, 32, None, None, None, None)
    with pytest.raises(ValueError, match="window=True"):
        P.attention_windowed(plain, None, None, None, None)


@pytest.mark.parametrize("policy", [Policy.kivi(4, residual=40), Policy.kivi(2, residual=0, rotate=True),
                                    Policy.kivi(4, residual=40, sink=4)], ids=str)
def test_a_prefix_written_in_the_same_step_is_read_after_its_write(policy):
    """An engine may give a request a cached prefix whose pages another request writes in the same step (vLLM
    caches a prompt's pages as soon as they are scheduled): sequence 1 shares sequence 0's first two packed pages
    and its window pages up to position 64, and arrives with those 64 positions cached while sequence 0 writes
    them. Its outputs are sequence 0's, bit for bit."""
    H, Hq, D, block, wblock, n_pages = 2, 4, 64, 32, 16, 32
    lay = P.PageLayout(policy, H, D, "float32", block, window=True)
    g = torch.Generator().manual_seed(5)
    pages = engine_pages(lay, n_pages)
    window = window_pages(lay, n_pages, wblock)
    table = torch.tensor([[3, 7, 1, 9], [3, 7, 4, 12]], dtype=torch.int32)  # the first two pages shared
    wtable = torch.tensor([[0, 2, 5, 6, 8, 10, 11], [0, 2, 5, 6, 13, 14, 15]], dtype=torch.int32)
    k, v, q = (torch.randn(100, h, D, generator=g) for h in (H, H, Hq))
    qs = torch.tensor([0, 100, 136])
    seq = torch.tensor([100, 100])
    kk, vv, qq = (torch.cat([x, x[64:]]) for x in (k, v, q))
    batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
    recent = P.store_windowed(lay, pages, window, wblock, kk, vv, batch, wbatch)
    out = P.attention_windowed(lay, pages, qq, batch, recent, 0.125)
    assert torch.equal(out[100:], out[64:100])


def test_a_window_page_the_engine_did_not_give_is_neither_written_nor_read():
    """An engine may give a long chunk window pages only for the positions later steps read (vLLM's null block for
    the rest): a chunk of 130 tokens, then decode steps, with the window pages of positions 0-63 the null page. The
    null page is never written, every output is that of the same steps with every page given, and a step whose
    window would read the null page is refused with what it misses."""
    H, Hq, D, block, wblock, n_pages, NULL = 2, 4, 64, 32, 16, 24, 0
    lay = P.PageLayout(Policy.kivi(4, residual=40), H, D, "float32", block, window=True)  # a window of 71
    g = torch.Generator().manual_seed(9)
    k, v, q = (torch.randn(134, h, D, generator=g) for h in (H, H, Hq))
    table = torch.tensor([[3, 7, 1, 9, 11]], dtype=torch.int32)
    given = torch.tensor([[2, 5, 6, 8, 10, 12, 13, 14, 15]], dtype=torch.int32)
    gaps = given.clone()
    gaps[0, :4] = NULL  # positions 0-63: the chunk's own queries read them from the step, no later step does

    def run(wtable, cuts=(130, 1, 1, 1, 1)):
        pages, window = engine_pages(lay, n_pages), window_pages(lay, n_pages, wblock)
        window[NULL] = float("nan")  # whatever the null page holds is never read, and it is never written
        outs, held = [], 0
        for n in cuts:
            batch, wbatch = (P.Ragged.of(torch.tensor([0, n]), torch.tensor([held + n]), t) for t in (table, wtable))
            recent = P.store_windowed(lay, pages, window, wblock, k[held:held + n], v[held:held + n], batch,
                                      wbatch, null_page=NULL)
            outs.append(P.attention_windowed(lay, pages, q[held:held + n], batch, recent, 0.125))
            held += n
        return torch.cat(outs), window

    want, _ = run(given)
    got, window = run(gaps)
    assert torch.equal(got, want)
    assert window[NULL].isnan().all()
    short = given.clone()
    short[0, 7] = NULL  # positions 112-127, in the window of the first decode step (position 130)
    with pytest.raises(ValueError, match="no page for position 112 of sequence 0, which this step reads"):
        run(short)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_full_precision_rows_a_row_reads_must_exist(kernels):
    """A map that puts a position a row reads outside the flat full-precision rows (``store.FlatRecent``) is an
    error naming the row, whether the C kernels read them in place or rings are gathered out of them; positions
    the row does not read may map anywhere."""
    from kvcompile import ops
    from kvcompile.store import FlatRecent
    lay = P.PageLayout(Policy.kivi(4, residual=0), 2, 64, "float32", 32, window=True)
    st = lay.state(engine_pages(lay, 4), torch.tensor([40, 64], dtype=torch.int32),
                   torch.tensor([[1, 2], [3, 0]], dtype=torch.int32))
    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    be = ops.BACKENDS[kernels]

    def attend(fmap):  # row 0 reads positions 32 .. 39; row 1 (64 positions, all packed) none
        return be.attention(q, st, lay.spec, None, None, flat=FlatRecent(k, v, torch.tensor(fmap)))

    assert attend([[-32, -32, 40], [500, 500, 0]]).isfinite().all()
    with pytest.raises(ValueError, match=r"row 0 \(40 positions\)"):
        attend([[-15, -15, 40], [0, 0, 0]])  # positions 32 .. 39 at rows 17 .. 24, past the 20
    with pytest.raises(ValueError, match=r"row 0 \(40 positions\)"):
        attend([[-40, -40, 40], [0, 0, 0]])  # position 32 at row -8


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
@pytest.mark.parametrize("policy,ring,wblock,dtype,pad", [
    (Policy.kivi(4, residual=0, rotate=True), True, 31, "float32", 0),
    (Policy.kivi(4, residual=0, rotate=True), True, 48, "bfloat16", 6),
    (Policy.kivi(2, residual=0), True, 32, "float16", 0),
    (Policy.kivi(4, residual=40, sink=4), False, 16, "float32", 12),
    (Policy.kivi(4, residual=40, sink=4), False, 16, "bfloat16", 0)],
    ids=["ring-31-the-kernels", "ring-48-bf16-padded", "ring-32-fp16", "window-sinks-padded", "window-sinks-bf16"])
def test_decode_steps_read_their_rings_from_the_window_cache_with_the_same_bits(policy, ring, wblock, dtype, pad,
                                                                                 kernels, monkeypatch):
    """A decode step (every position it reads still in the window cache once its tokens are written) takes its
    rings from the window cache itself -- a ring of the store's own slots as it lies, others gathered into them --
    instead of from the positions it read before its write (the step's own rows, which the C kernels read where
    they lie: ``store.FlatRecent``): the outputs, the packed pages and the window cache are the same bits either
    way, for a prefill, decode steps and short chunks, in every dtype, with window pages a few bytes more than
    their keys and values apart (vLLM pads them)."""
    from kvcompile import ops
    H, Hq, D, block, n_pages = 2, 4, 64, 32, 40
    lay = P.PageLayout(policy, H, D, dtype, block, window=True)
    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(2, 120, h, D, generator=g).to(getattr(torch, dtype)) for h in (H, H, Hq))
    table, wtable = scrambled_table(2, 8, n_pages, seed=1), scrambled_table(2, 1 if ring else 10, n_pages, seed=2)
    cuts = [(70, 50)] + [(1, 1)] * 20 + [(3, 1), (1, 2)] + [(1, 1)] * 10
    used = []
    from kvcompile.templates import cpu
    in_place = []  # the C kernels' calls that read the step's own full-precision rows where they lie
    own = cpu._flat_args
    monkeypatch.setattr(cpu, "_flat_args", lambda *a: in_place.append(1) or own(*a))

    def run():
        pages, window = engine_pages(lay, n_pages), window_pages(lay, n_pages, wblock, pad)
        held, outs = [0, 0], []
        for ns in cuts:
            take = [slice(held[i], held[i] + ns[i]) for i in (0, 1)]
            kk, vv, qq = (torch.cat([x[0, take[0]], x[1, take[1]]]) for x in (k, v, q))
            qs, seq = torch.tensor([0, ns[0], sum(ns)]), torch.tensor([held[0] + ns[0], held[1] + ns[1]])
            batch, wbatch = P.Ragged.of(qs, seq, table), P.Ragged.of(qs, seq, wtable)
            recent = P.store_windowed(lay, pages, window, wblock, kk, vv, batch, wbatch, ring=ring)
            used.append(recent.cache is not None)
            outs.append(P.attention_windowed(lay, pages, qq, batch, recent, 0.125))
            held = [held[0] + ns[0], held[1] + ns[1]]
        return torch.cat(outs), pages, window

    ops.set_kernels(kernels)
    try:
        fast = run()
        # the decode steps read the cache; a ring's prefill, what it held (it outgrows the ring)
        assert sum(used) >= 30 and used[0] == (not ring), used
        assert len(in_place) == (len(cuts) - sum(used) if kernels == "cpu" else 0)
        monkeypatch.setattr(P, "_in_cache", lambda *a: False)
        in_place.clear()
        slow = run()
        assert len(in_place) == (len(cuts) if kernels == "cpu" else 0)  # every step's rows read in place
    finally:
        ops.set_kernels("auto")
    for a, b in zip(fast, slow):
        assert torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------- however the work is cut
CUTS = {  # a sequence's 150 tokens, as an engine may hand them over (beside another sequence's in each step)
    "whole": [150],
    "chunks": [64, 64, 22],        # chunked prefill
    "cached": [128, 1, 21],        # a prefix from elsewhere, then the rest
    "recomputed": [100] + [1] * 20 + [30],  # prefilled, decoded, preempted and recomputed in one piece
    "decoded": [1] * 150,
}
EXACT = [  # (policy, window, ring)
    (Policy.int8(), False, False),
    (Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True), False, False),
    (Policy.fp8(residual=0), False, False),
    (Policy.kivi(4), True, False),
    (Policy.kivi(2, residual=0, rotate=True), True, True),
    (Policy.kivi(4, rotate=True, sink=4), True, False),
]


def cut_outputs(lay, cuts, mine, other, n_pages, table, wtable=None, wblock=16, ring=False, window=None):
    """Every query's output when the sequence ``mine`` = (k, v, q) ``[T, heads, D]`` is handed over as each of
    ``cuts`` says (token counts per step), each step beside the tokens of another sequence (``other``: a decode
    token beside a chunk, two beside a decode), on fresh pages of ``lay`` (and a window cache with a windowed
    layout): {cut: [T, Hq, D] on the CPU}. The tensors' device is where the kernels run."""
    (k, v, q), (ko, vo, qo) = mine, other
    results = {}
    for name, cut in cuts.items():
        pages = engine_pages(lay, n_pages, interleave=2).to(k.device)
        window = window_pages(lay, n_pages, wblock).to(k.device) if lay.window else None
        held, oheld, outs = 0, 0, []
        for n in cut:
            two = 1 if n > 1 else 2
            sl, o = slice(held, held + n), slice(oheld % (ko.shape[0] - 2), oheld % (ko.shape[0] - 2) + two)
            kk, vv, qq = (torch.cat([x[sl], y[o]]) for x, y in ((k, ko), (v, vo), (q, qo)))
            oheld += two
            qs, seq = torch.tensor([0, n, n + two]), torch.tensor([held + n, oheld])
            batch = P.Ragged.of(qs, seq, table)
            if lay.window:
                recent = P.store_windowed(lay, pages, window, wblock, kk, vv, batch, P.Ragged.of(qs, seq, wtable),
                                          ring=ring)
                out = P.attention_windowed(lay, pages, qq, batch, recent, 0.125)
            else:
                P.store_ragged(lay, pages, kk, vv, batch)
                out = P.attention_ragged(lay, pages, qq, None, None, batch, 0.125, window=window)
            outs.append(out[:n])
            held += n
        results[name] = torch.cat(outs).cpu()
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(EXACT)), ids=lambda c: str(EXACT[c][0]))
def test_a_tokens_attention_is_the_same_bits_however_the_work_is_cut(case, dtype):
    """The same sequence handed over whole, in chunks, after a prefix, decoded, or prefilled again after decode
    steps (what vLLM does to a preempted request), each step beside another sequence's tokens: every query's output
    is the same bits, in every dtype (in bf16 a rounding difference between a prefill and a decode step, carried
    through the layers, changed greedy tokens after a recomputation)."""
    policy, windowed, ring = EXACT[case]
    H, Hq, D, block, n_pages = 2, 4, 64, 32, 64
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(case)
    mine, other = ([torch.randn(150, h, D, generator=g).to(dt) for h in (H, H, Hq)] for _ in range(2))
    lay = P.PageLayout(policy, H, D, dtype, block, window=windowed)
    results = cut_outputs(lay, CUTS, mine, other, n_pages, scrambled_table(2, 12, n_pages, seed=case),
                          scrambled_table(2, 1 if ring else 20, n_pages, seed=case + 1), 48 if ring else 16, ring)
    for name, got in results.items():
        assert torch.equal(bits(got), bits(results["decoded"])), (name, int((got != results["decoded"]).sum()))


@pytest.mark.parametrize("policy,dtype", slow_after(1, [(Policy.int8(), "bfloat16"),
                                                       (Policy(Quant("int4", "token"), Quant("int4", "token"),
                                                               rotate=True), "float16")]))
def test_triton_kernels_give_a_token_the_same_bits_however_the_work_is_cut(policy, dtype):
    """The CUDA path (Triton, in the interpreter here): a prompt's queries reach the decode kernel as runs of one
    sequence, a program reading each packed tile once for several of them (``decode.run_rows``), and every query's
    output is the same bits as when it was decoded alone, or prefilled in chunks."""
    from kvcompile import ops
    H, Hq, D, block, n_pages, T = 2, 4, 32, 16, 30, 50
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(11)
    mine, other = ([torch.randn(T, h, D, generator=g).to(dt) for h in (H, H, Hq)] for _ in range(2))
    lay = P.PageLayout(policy, H, D, dtype, block)
    ops.set_kernels("triton")
    try:
        results = cut_outputs(lay, {"whole": [T], "chunks": [23, 27], "decoded": [1] * T}, mine, other, n_pages,
                              scrambled_table(2, 12, n_pages, seed=2))
    finally:
        ops.set_kernels("auto")
    for name, got in results.items():
        assert torch.equal(bits(got), bits(results["decoded"])), (name, int((got != results["decoded"]).sum()))


def test_a_prompts_rows_are_given_to_the_kernels_as_runs_of_one_sequence():
    """A flat batch's rows (each sequence's adjacent, in order of position) reach the kernels as runs of one
    sequence (``groups``), and rows of a run whose full precision begins at the same position as one ring."""
    seq = torch.tensor([0, 0, 0, 1, 2, 2])
    assert P._runs(seq).tolist() == [0, 3, 4, 6]
    assert P._runs(torch.tensor([0, 1, 2])) is None and P._runs(torch.tensor([5])) is None  # a decode step
    lo = torch.tensor([0, 0, 32, 0, 0, 0])
    assert P._starts(seq, lo).tolist() == [True, False, True, True, True, False]


# --------------------------------------------------------------------------- a sliding-window layer
SLIDING = [Policy.int8(), Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True),
           Policy(Quant("int2", "token", 32), Quant("int2", "token", 32), rotate=True),
           Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e4m3", "tensor"), rotate=True)]


def sliding_case(policy, dtype, kernels="cpu", window=37, seed=0):
    """A prompt of 100 tokens beside one of 23 in one flat batch over scrambled pages of 16 tokens, read through a
    sliding window: (layout, pages, table, batch, k, v, q, out)."""
    from kvcompile import ops
    H, Hq, D, block, n_pages = 2, 4, 32, 16, 30
    dt = getattr(torch, dtype)
    lay = P.PageLayout(policy, H, D, dtype, block)
    table = scrambled_table(2, 8, n_pages, seed)
    pages = engine_pages(lay, n_pages, interleave=2)
    g = torch.Generator().manual_seed(seed)
    k, v, q = (torch.randn(123, h, D, generator=g).to(dt) for h in (H, H, Hq))
    batch = P.Ragged.of(torch.tensor([0, 100, 123]), torch.tensor([100, 23]), table)
    ops.set_kernels(kernels)
    try:
        P.store_ragged(lay, pages, k, v, batch)
        out = P.attention_ragged(lay, pages, q, None, None, batch, 0.2, window=window)
    finally:
        ops.set_kernels("auto")
    return lay, pages, table, batch, k, v, q, out


def check_sliding(lay, table, batch, k, v, q, out, window, n_pages=30):
    """Each query within the decode kernel's bound of float64 attention over the reference store as it stood when
    its token was the newest, masked to its window (the reference's mask: only positions ``p - window + 1 .. p``)."""
    ref = reference_state(lay, n_pages, [0, 0], table)
    store_reference(ref, lay.spec, batch.padded(k), batch.padded(v), torch.tensor(batch.n))
    Hq, D = q.shape[1:]
    worst = 0.0
    for i, (a, n) in enumerate(zip([0, 100], batch.n)):
        for p in range(n):
            st = KVState(*ref[:6], *(x[i:i + 1] for x in ref[6:10]), torch.tensor([p + 1], dtype=torch.int32),
                         table[i:i + 1])
            mask = torch.zeros(1, 1, 1, p + 1, dtype=torch.bool)
            mask[..., max(0, p - window + 1):] = True
            want, tol = kattn.reference_and_bound(q[a + p].view(1, Hq, 1, D), st, lay.spec, mask, 0.2, nsplit=p + 1,
                                                  decode=True)
            err = (out[a + p].view(1, Hq, 1, D).double() - want).abs()
            assert not (err > tol).any(), (lay.policy, i, p, float((err - tol).max()))
            worst = max(worst, float((err / tol.clamp(min=1e-30)).max()))
    return worst


@pytest.mark.parametrize("policy", SLIDING, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sliding_window_layer_reads_each_querys_window_from_its_pages(policy, dtype):
    """A sliding-window layer's pages (a model such as Gemma 3 alternates them with full attention): each query
    reads only the last ``window`` positions, its own included -- within the bound of the reference's attention
    masked to that window; and the same rows without the window (every position) are not, so the window is
    applied."""
    window = 37
    lay, pages, table, batch, k, v, q, out = sliding_case(policy, dtype, window=window)
    check_sliding(lay, table, batch, k, v, q, out, window)
    every = P.attention_ragged(lay, pages, q, None, None, batch, 0.2)
    assert torch.equal(bits(every[:window]), bits(out[:window]))  # inside the window nothing is hidden
    assert (every[window:100] - out[window:100]).abs().amax() > 0.05


@pytest.mark.parametrize("window", [None, 37])
def test_a_steps_layers_share_the_rows_of_its_calls(window):
    """Through vLLM every layer of a step reads the same flat batch (``vllm.backend.ragged``): the rows, lengths,
    tables, runs and window masks of ``_each_query``'s calls are made by the first layer (``Ragged.plans``) and
    read by the next, whose pages hold other tokens -- and each layer gets the same bits as with a batch of its
    own."""
    lay, pages, table, batch, k, v, q, out = sliding_case(Policy.int8(), "bfloat16", window=window)
    plan = batch.plans[(lay, pages.device, q.device, False, window)]
    assert len(batch.plans) == 1 and len(plan) >= 1
    g = torch.Generator().manual_seed(1)
    k2, v2, q2 = (torch.randn(x.shape, generator=g).to(x.dtype) for x in (k, v, q))
    pages2 = engine_pages(lay, 30, interleave=2)
    P.store_ragged(lay, pages2, k2, v2, batch)
    second = P.attention_ragged(lay, pages2, q2, None, None, batch, 0.2, window=window)
    assert len(batch.plans) == 1 and batch.plans[(lay, pages.device, q.device, False, window)] is plan
    alone = P.Ragged.of(batch.query_start, batch.seq_lens, table)
    assert torch.equal(bits(second), bits(P.attention_ragged(lay, pages2, q2, None, None, alone, 0.2, window=window)))
    assert not torch.equal(bits(second), bits(out))  # (the second layer's own tokens)


def test_pages_before_a_window_are_never_read():
    """An engine frees a sliding-window layer's pages wholly before the window and gives them to other sequences
    (or names its null page): filled with bytes that dequantize to NaN and inf, they change no query's output."""
    lay, pages, table, batch, k, v, q, out = sliding_case(Policy.int8(), "float32", window=37)
    # sequence 0's last query (position 99) reads positions 63 .. 99: pages 0 .. 2 of its table are before it
    gone = table[0, :3].long()
    poisoned = pages.clone()
    poisoned[gone] = -1  # every byte 0xff: NaN scales and codes
    table = table.clone()
    table[0, :2] = 0  # a freed page's entry may also name another page (vLLM's null block)
    last = P.Ragged.of(torch.tensor([0, 1]), torch.tensor([100]), table[:1])
    got = P.attention_ragged(lay, poisoned, q[99:100], None, None, last, 0.2, window=37)
    assert torch.equal(bits(got), bits(out[99:100]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_sliding_windows_attention_is_the_same_bits_however_the_work_is_cut(dtype):
    """As for full attention (above): whole, in chunks, after a prefix, decoded or recomputed, every query of a
    sliding-window layer gives the same bits (the rows' masks have one width, so no row depends on the rows beside
    it)."""
    H, Hq, D, block, n_pages = 2, 4, 64, 32, 64
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    mine, other = ([torch.randn(150, h, D, generator=g).to(dt) for h in (H, H, Hq)] for _ in range(2))
    lay = P.PageLayout(Policy(Quant("int4", "token"), Quant("int4", "token"), rotate=True), H, D, dtype, block)
    results = cut_outputs(lay, CUTS, mine, other, n_pages, scrambled_table(2, 12, n_pages, seed=3), window=50)
    for name, got in results.items():
        assert torch.equal(bits(got), bits(results["decoded"])), (name, int((got != results["decoded"]).sum()))


def test_triton_kernels_read_a_sliding_window_as_the_c_kernels_do():
    """The CUDA path (Triton, in the interpreter here) of a sliding-window layer: within the same bound."""
    window = 21
    lay, pages, table, batch, k, v, q, out = sliding_case(Policy(Quant("int4"), Quant("int8", "token", 16)),
                                                          "float32", "triton", window=window, seed=4)
    check_sliding(lay, table, batch, k, v, q, out, window)


def test_a_sliding_window_is_checked_at_the_call():
    lay = P.PageLayout(Policy.int8(), 1, 32, "float32", 16)
    pages = engine_pages(lay, 4)
    batch = P.Ragged.of(torch.tensor([0, 3]), torch.tensor([3]), torch.tensor([[1]], dtype=torch.int32))
    q, k = torch.randn(3, 1, 32), torch.randn(3, 1, 32)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(KVCompileError, match="sliding window's positions"):
            P.attention_ragged(lay, pages, q, None, None, batch, window=bad)
    with pytest.raises(KVCompileError, match="every position from the pages"):
        P.attention_ragged(lay, pages, q, k, k, batch, window=8)
    kivi = P.PageLayout(Policy.kivi(4), 1, 32, "float32", 32, window=True)
    with pytest.raises(KVCompileError, match="without a window cache"):
        P.attention_ragged(kivi, engine_pages(kivi, 4), q, None, None, batch, window=8)
