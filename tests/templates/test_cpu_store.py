"""The CPU store kernel (``kvcompile.templates.cpu_store``, the C template ``cpu_store.c``) equals the reference
store bit for bit: codes, scales, zero points, sinks, live ring slots, lengths and block tables, for every
format, axis, group, scale dtype, model dtype, chunk length, ragged batch and block size, into blocks handed
out in a scrambled order (shared between rows after ``select``, freed and reserved again after ``crop``); and
it fails like the reference.

One caveat is not tested because it is not a property of the reference: when a group's minimum (or maximum)
is a zero that occurs with both signs, which sign torch's vectorized reduction returns depends on its
reduction tree, so the sign bit of that zero point may differ (the codes and every dequantized value do not).
The inputs here (randn, exact +0.0 rows, constants) never hold -0.0.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import CapacityError, KVState, KVStore, LayerSpec, dequantize_reference, store_reference
from kvcompile.templates import cpu, cpu_store
import profiles
from store_checks import around, assert_same_store, quants, scrambled, tie_rows, with_history


pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")


# --------------------------------------------------------------------------- the store


def contiguous_elsewhere(store) -> bool:
    """Whether some row's blocks are not where a kernel ignoring the block table would look for them
    (``LayerSpec.allocate``'s layout: row ``b``'s block ``j`` is ``b * MB + j``): a test on such a store fails
    for a kernel that assumes contiguous blocks."""
    mb = store.state.table.shape[1]
    return any(blk != b * mb + j for b, t in enumerate(store.tables) for j, blk in enumerate(t))


def chunk(g, B, H, n, D, scale, dtype=torch.float32):
    """Keys and values of ``n`` new tokens: randn keys at ``scale``, values with a per-row offset (asymmetric
    zero points); for n > 2 a constant value token (scale 0, codes exact) and an all-zero key token."""
    k = torch.randn(B, H, n, D, generator=g) * scale
    v = torch.randn(B, H, n, D, generator=g) + torch.randn(B, H, 1, D, generator=g) * 4
    if n > 2:
        v[:, :, 1] = 3.25
        k[:, :, 2] = 0.0
    return k.to(dtype), v.to(dtype)


def append_both(ref, got, k, v, n_new=None):
    """The same append through the reference and through the kernel (both stores reserve the same blocks)."""
    ref.append(k, v, n_new)
    got.append(k, v, n_new, kernel=cpu_store.store)
    assert_same_store(ref.state, got.state, ref.spec)


@st.composite
def store_cases(draw):
    D = draw(st.sampled_from([16, 32, 48, 64, 128]))  # 48: a head that is not a power of two
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 1, 5, 16, 128])),
                    sink=draw(st.sampled_from([0, 0, 3])), rotate=D != 48 and draw(st.booleans()))
    B, H = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    history = [draw(st.integers(0, 40)) for _ in range(B)]  # ragged prefix, appended by the reference
    chunks = draw(st.lists(st.sampled_from([1, 1, 1, 2, 7, 16, 33, 70]), min_size=1, max_size=4))
    ragged = draw(st.booleans())  # appends of per-row lengths (n_new)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    in_model_dtype = draw(st.booleans())  # k, v given in the model dtype, or fp32 (converted on the way in)
    threads = draw(st.sampled_from([1, 2]))
    block = draw(st.sampled_from([16, 16, 32, 64]))  # packed tokens per block (the flush group if larger)
    return (policy, B, H, D, dtype, history, chunks, ragged, in_model_dtype, threads, block,
            draw(st.integers(0, 2**31 - 1)))


@profiles.KERNEL
@given(store_cases())
def test_cpu_store_equals_reference(case):
    policy, B, H, D, dtype, history, chunks, ragged, in_model_dtype, threads, block, seed = case
    spec, ref, got, g, scale = with_history(policy, B, H, D, dtype, history, chunks, seed, block=block)
    in_dt = spec.torch_dtype if in_model_dtype else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: long appends are shared among OpenMP threads
    try:
        for n in chunks:
            k, v = chunk(g, B, H, n, D, scale, in_dt)
            n_new = torch.randint(0, n + 1, (B,), generator=g, dtype=torch.int32) if ragged else None
            append_both(ref, got, k, v, n_new)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("policy", [Policy.kivi(2, group=4, residual=3, sink=2), Policy.fp8(residual=0),
                                    Policy.fp8("fp8_e5m2", residual=2, axis="tensor"),
                                    Policy(Quant("int3", "channel", 8, True, "float32"), Quant("none"), residual=2)])
def test_cpu_store_decode_steps_cross_every_boundary(policy):
    """Token by token through sinks, the residual, several flushes, block boundaries and the ring's
    wrap-around, into scrambled blocks of 16 packed tokens."""
    B, H, D, steps = 2, 2, 16, 70
    spec = LayerSpec(policy, H, D, block_tokens=16)
    ref = scrambled(spec, B, 2 * spec.blocks_for(steps), seed=0)
    got = ref.copy()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        append_both(ref, got, torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
    assert len(got.tables[0]) >= 3 and contiguous_elsewhere(got)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("B", [1, 3])
def test_cpu_store_paged_layouts(block, B):
    """Each block size, one sequence and a ragged batch: a prefill spanning several blocks (appended in one call
    on two threads, the OpenMP path, and decode steps on one), then steps that cross block boundaries; the
    blocks handed out in a scrambled order, so each row's are neither contiguous nor in order."""
    policy = Policy(Quant("int4", "channel", 16), Quant("int8", "token", 32), residual=8, sink=2)
    H, D = 2, 32
    spec = LayerSpec(policy, H, D, block_tokens=block)
    history = [3 * block + 21, block + 5, 2][:B]
    ref = scrambled(spec, B, B * (spec.blocks_for(max(history) + 2 * block) + 1), seed=block + B)
    got = ref.copy()
    g = torch.Generator().manual_seed(block)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        append_both(ref, got, *chunk(g, B, H, max(history), D, 3.0), torch.tensor(history, dtype=torch.int32))
    finally:
        torch.set_num_threads(before)
    for n in (1, 7, block + 3, 1):
        n_new = torch.tensor([n, max(0, n - 2), n][:B], dtype=torch.int32)
        append_both(ref, got, *chunk(g, B, H, n, D, 3.0), n_new)
    assert len(got.tables[0]) >= 4 and contiguous_elsewhere(got)


def test_cpu_store_writes_shared_blocks_like_the_reference():
    """After ``select([0, 0, 1])`` two rows share their blocks, the last one half full (flush groups of 8 in
    blocks of 16); appending to each copies the shared block it writes (``KVStore.reserve``), and the kernel
    must write the copy, never the block the other row still reads."""
    policy = Policy.kivi(4, group=8, residual=4)
    spec, ref, got, g, scale = with_history(policy, 2, 2, 32, "float32", [45, 70], [40, 40], seed=3)
    for st_ in (ref, got):
        st_.select([0, 0, 1])
    assert got.tables[0] == got.tables[1] and len(got.tables[0]) == 3  # packed [0, 40): the third block half full
    half = got.tables[0][2]
    for n, n_new in ((1, [1, 0, 1]), (20, [20, 13, 20]), (1, [0, 1, 1]), (16, None)):
        k, v = chunk(g, 3, 2, n, 32, scale)
        append_both(ref, got, k, v, None if n_new is None else torch.tensor(n_new, dtype=torch.int32))
    assert got.tables[0][:2] == got.tables[1][:2]  # never written: still shared
    assert half not in (got.tables[0][2], got.tables[1][2]) and got.tables[0][2] != got.tables[1][2]  # copied
    assert contiguous_elsewhere(got)


@pytest.mark.parametrize("crop", [0, 3, 30, 41, 60])
def test_cpu_store_appends_after_a_crop(crop):
    """``KVStore.crop`` frees blocks and returns packed positions to the ring; the kernel's appends after it
    (which flush those positions again, into freshly reserved blocks) equal the reference's."""
    policy = Policy(Quant("int4", "channel", 8), Quant("fp8_e4m3", "token"), residual=6, sink=2)
    spec, ref, got, g, scale = with_history(policy, 3, 2, 16, "bfloat16", [70, 33, 5], [40, 40], seed=crop)
    for st_ in (ref, got):
        st_.crop(crop)
    assert got.lengths == [min(L, crop) for L in (70, 33, 5)]
    for n in (1, 25, 1, 40):
        append_both(ref, got, *chunk(g, 3, 2, n, 16, scale))
    assert contiguous_elsewhere(got)


@pytest.mark.parametrize("fmt,sym", [("int8", False), ("int4", False), ("int3", True), ("int2", False),
                                     ("int2", True), ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_cpu_store_rounds_ties_to_even(fmt, sym):
    """Rows and columns that hold the group's extremes (scale 1) and ties: per-token keys and per-channel values
    both round half to even, as torch.round and torch's fp8 cast do."""
    D = 16
    row = tie_rows(fmt, sym, D)
    x = torch.stack([row.roll(t) for t in range(D)])[None, None]  # [1, 1, 16 tokens, 16 channels]
    policy = Policy(Quant(fmt, "token", None, sym), Quant(fmt, "channel", D, sym), residual=0)
    ref = KVStore(LayerSpec(policy, 1, D), 1)
    append_both(ref, ref.copy(), x, x)


def test_cpu_store_takes_strided_chunks():
    """k, v as the model hands them (a transposed [B, n, H, D] view): no copy needed, same bytes."""
    spec = LayerSpec(Policy.kivi(4, group=8, residual=4), 3, 32, block_tokens=16)
    ref = scrambled(spec, 2, 8, seed=1)
    got = ref.copy()
    g = torch.Generator().manual_seed(1)
    for n in (20, 1, 9):
        k = torch.randn(2, n, 3, 32, generator=g).transpose(1, 2)
        v = torch.randn(2, n, 3, 32, generator=g).transpose(1, 2)
        append_both(ref, got, k, v)


@pytest.mark.parametrize("policy", [Policy.kivi(2, group=8, residual=150, sink=70, rotate=True),
                                    Policy.int8(residual=100), Policy.full()], ids=str)
def test_the_kernels_take_rings_and_sinks_as_far_as_they_have_grown(policy):
    """A store's sinks and window grow with its sequences (``LayerSpec.row_widths``), so the kernels take the rows'
    allocated widths as their strides: through every growth (ragged appends sliding past the window), the store
    kernel writes bit for bit what the reference does, and a grown store holds, and the decode kernel reads from it,
    exactly what a store allocated whole does."""
    B, H, D = 2, 2, 16
    spec = LayerSpec(policy, H, D, "float32", max(16, policy.flush))
    ref, got, whole = KVStore(spec, B), KVStore(spec, B), KVStore(spec, B, whole_rows=True)
    g = torch.Generator().manual_seed(1)
    for n, n_new in [(24, [24, 24]), (1, [1, 0]), (45, [45, 40]), (70, [3, 70]), (130, [130, 130]), (1, [1, 1])]:
        k, v = chunk(g, B, H, n, D, 1.0)
        append_both(ref, got, k, v, torch.tensor(n_new))
        whole.append(k, v, torch.tensor(n_new), kernel=cpu_store.store)
        assert got.state.k_res.shape[2] == spec.row_widths(max(got.lengths))[0] <= whole.state.k_res.shape[2]
        assert got.state.k_sink.shape[2] == spec.row_widths(max(got.lengths))[1] <= whole.state.k_sink.shape[2]
        for a, b in zip(dequantize_reference(got.state, spec), dequantize_reference(whole.state, spec)):
            assert torch.equal(a, b)
        q = torch.randn(B, 2 * H, 1, D, generator=g)
        assert torch.equal(cpu.attention(q, got.state, spec, None, None, nsplit=2),
                           cpu.attention(q, whole.state, spec, None, None, nsplit=2))
    assert got.lengths == [204, 265]


def test_cpu_store_unreserved_write_raises_like_the_reference_and_writes_nothing():
    """A store call whose blocks were not reserved (the caller skipped ``KVStore.reserve``) fails with the
    reference's ``CapacityError`` and writes nothing -- not even the rows that had room: a row whose next
    block is missing (-1), or whose table has no column for it."""
    spec = LayerSpec(Policy.kivi(4, group=4, residual=2), 1, 16, block_tokens=16)
    store = scrambled(spec, 2, 8, seed=2)
    store.append(torch.randn(2, 1, 20, 16), torch.randn(2, 1, 20, 16), torch.tensor([20, 17]),
                 kernel=cpu_store.store)
    narrow = store.state  # one block per row (16 packed tokens each), a table of one column
    assert narrow.table.shape[1] == 1 and (narrow.table >= 0).all()
    wide = narrow._replace(table=torch.cat([narrow.table, torch.full((2, 3), -1, dtype=torch.int32)], 1))
    k, v = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    # 17 -> 22 and 20 -> 24 tokens flush packed positions [16, 20): the second block
    for state, n_new, row in ((wide, [1, 5], 1), (wide, [4, 5], 0), (narrow, [1, 5], 1), (narrow, [4, 0], 0)):
        before = [t.clone() for t in state]
        with pytest.raises(CapacityError) as want:
            store_reference(KVState(*[t.clone() for t in state]), spec, k, v, torch.tensor(n_new))
        with pytest.raises(CapacityError) as got:
            cpu_store.store(state, spec, k, v, torch.tensor(n_new))
        assert str(got.value) == str(want.value) and f"sequence {row} holds" in str(got.value)
        assert all(torch.equal(a, b) for a, b in zip(before, state))
    # reserved, the same appends go through
    store.append(k, v, torch.tensor([4, 5]), kernel=cpu_store.store)
    assert store.lengths == [24, 22] and store.state.lengths.tolist() == [24, 22]


def test_cpu_store_rejects_bad_calls_like_the_reference():
    spec = LayerSpec(Policy.kivi(4, group=4, residual=2), 1, 16, block_tokens=16)
    state = spec.allocate(2, 40)
    k, v = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    with pytest.raises(ValueError, match=r"n_new\[0\]=6 is outside \[0, 5\]"):
        cpu_store.store(state, spec, k, v, torch.tensor([6, 0]))
    with pytest.raises(ValueError, match=r"store expects k, v of shape \[2, 1, n, 16\]"):
        cpu_store.store(state, spec, k[:1], v[:1])
    bad = state.table.clone()
    bad[1, 0] = 99  # names no block of the pool: torch's indexing fails in the reference
    with pytest.raises(IndexError):
        store_reference(KVState(*[t.clone() for t in state._replace(table=bad)]), spec, torch.randn(2, 1, 30, 16),
                        torch.randn(2, 1, 30, 16))
    before = [t.clone() for t in state]
    with pytest.raises(IndexError, match="sequence 1 names block 99, but the pool holds 6 blocks"):
        cpu_store.store(state._replace(table=bad), spec, torch.randn(2, 1, 30, 16), torch.randn(2, 1, 30, 16))
    assert all(torch.equal(a, b) for a, b in zip(before, state))


def test_the_store_op_runs_the_cpu_kernel(monkeypatch):
    """``torch.ops.kvcompile.store`` on the CPU (kernels "cpu", the default there) calls this kernel, into the
    paged store behind the cache tensors."""
    from kvcompile import ops
    spec = LayerSpec(Policy.int8(), 1, 16, block_tokens=16)
    name = spec.register()
    calls = []
    real = cpu_store.store
    monkeypatch.setattr(cpu_store, "store", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "_KERNELS", "cpu")
    k_cache, v_cache = torch.zeros(1, 1, 64, 16), torch.zeros(1, 1, 64, 16)  # a cache the store shadows
    ref = KVStore(spec, 1)
    g = torch.Generator().manual_seed(4)
    for pos in (torch.arange(40), torch.tensor([40])):
        k, v = torch.randn(1, 1, len(pos), 16, generator=g), torch.randn(1, 1, len(pos), 16, generator=g)
        torch.ops.kvcompile.store(k_cache, v_cache, k, v, pos, name)
        ref.append(k, v)
    assert calls == [1, 1]
    got = ops.store_for(k_cache, v_cache, name)
    assert got.lengths == [41] and len(got.tables[0]) == spec.blocks_for(41) >= 2
    assert_same_store(ref.state, got.state, spec)


# --------------------------------------------------------------------------- the numeric helpers, exhaustively
def _helpers():
    return cpu_store.build(LayerSpec(Policy.int8(), 1, 16)).lib


def test_fp16_directed_rounding_matches_the_reference():
    f16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = around(f16[f16.isfinite()])
    x = torch.cat([x, torch.tensor([1e6, -1e6, 65504.5, -65504.5, 1e-10, -1e-10, 0.0, -0.0, float("inf"),
                                    float("-inf")])]).contiguous()
    lib = _helpers()
    for up, direction in ((1, "up"), (0, "down")):
        out = torch.empty(x.numel(), dtype=torch.int16)
        lib.kvc_round_f16(x.data_ptr(), out.data_ptr(), x.numel(), up)
        want = Q.round_to_dtype(x, torch.float16, direction).view(torch.int16)
        assert torch.equal(out, want), (direction, x[out != want][:8])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encoding_matches_torch(fmt):
    vals = torch.arange(256, dtype=torch.uint8).view(Q.FP8_DTYPES[fmt]).float()
    x = around(vals[vals.isfinite()])
    edge = 464.0 if fmt == "fp8_e4m3" else 61440.0  # halfway above the largest value (e4m3fn: 448; e5m2: even = inf)
    x = torch.cat([x, torch.tensor([edge, -edge, 1e-30])]).contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _helpers().kvc_fp8_encode(x.data_ptr(), out.data_ptr(), x.numel(), int(fmt == "fp8_e4m3"))
    want = x.to(Q.FP8_DTYPES[fmt]).view(torch.uint8)
    assert torch.equal(out, want), x[out != want][:8]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encoding_beyond_the_range(fmt):
    """What cpu_store.c's header specifies for values the store never encodes (|x / scale| <= the maximum by
    construction; only inf or NaN inputs get here): e4m3fn saturates to +-448 from 464 up, infinities
    included, e5m2 goes to +-inf from 61440 up (round half to even), NaN stays NaN. Written out rather than taken from torch, whose
    cast beyond e4m3fn's range changed between releases (2.13 saturates, 2.11 gives NaN)."""
    x = torch.tensor([1e9, -1e9, 480.0, 65536.0, float("inf"), -float("inf"), float("nan")])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _helpers().kvc_fp8_encode(x.data_ptr(), out.data_ptr(), x.numel(), int(fmt == "fp8_e4m3"))
    top = 0x7E if fmt == "fp8_e4m3" else 0x7C  # 448, or inf
    big = 0x7E if fmt == "fp8_e4m3" else 0x60  # 480 is representable in e5m2
    assert out.tolist() == [top, top | 0x80, big, top, top, top | 0x80, 0x7F]


# --------------------------------------------------------------------------- non-finite and huge inputs
from nonfinite_checks import BAD, NONFINITE_POLICIES, bad_inputs  # noqa: E402



@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("policy", NONFINITE_POLICIES)
def test_cpu_store_non_finite_and_huge_inputs_equal_reference(policy, dtype):
    """NaN, +inf and -inf in sinks, on packed groups' first and last tokens and
    channels, and in the residual window, among values up to the model dtype's largest -- appended as a
    prefill, decode steps and a chunk -- are stored bit for bit as the reference stores them (before, the C
    store wrote finite codes for a NaN and the reference inf scales for a large key). Without the bad values,
    everything stored is finite."""
    B, H, D, L = 2, 2, 16, 40
    spec = LayerSpec(policy, H, D, dtype, block_tokens=16)
    top = torch.finfo(spec.torch_dtype).max
    for magnitude, bad in ((1.0, True), (1e5, True), (top, True), (top / 4, False)):
        k, v = bad_inputs(spec, B, L, int(magnitude) % 1000, magnitude, bad=BAD if bad else ())
        ref = scrambled(spec, B, 2 * B * spec.blocks_for(L), seed=1)
        got = ref.copy()
        at = 0
        for n in (7, 1, 1, 20, 11):
            append_both(ref, got, k[:, :, at:at + n], v[:, :, at:at + n])
            at += n
        if not bad:
            assert all(torch.isfinite(t.float()).all() for t in got.state[:10])
