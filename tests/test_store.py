"""The reference layer store: streaming invariance, regions, ragged batches, capacity, rotation, accounting."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import kvcompile as kc
import profiles
from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import (DTYPE_NAMES, ROW_TOKENS, KVStore, LayerSpec, QuantizedKV, dequantize_reference,
                             hadamard)

PACKED_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
ROW_FIELDS = ("k_sink", "v_sink", "lengths", "table")


def used(kv, name):
    """A pool tensor's blocks in use, in each sequence's order (pools of stores grown differently differ in
    size and in their free blocks, not in what the sequences hold)."""
    t = getattr(kv.state, name)
    if not t.numel():
        return t
    return torch.cat([t[kv.store.tables[b]] for b in range(kv.store.batch)]) if kv.store.used_blocks else t[:0]


@st.composite
def policies(draw):
    def quant():
        fmt = draw(st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]))
        axis = draw(st.sampled_from(["token", "channel"]))
        group = draw(st.sampled_from([None, 8]) if axis == "token" else st.sampled_from([4, 8]))
        sym = True if fmt.startswith("fp8") else draw(st.booleans())
        return Quant(fmt, axis, group, sym)
    return Policy(quant(), quant(), residual=draw(st.sampled_from([0, 1, 5, 8])),
                  sink=draw(st.sampled_from([0, 3])), rotate=draw(st.booleans()))


def _chunks(draw, total):
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(draw(st.integers(1, 13)), total - sum(sizes)))
    return sizes


@given(policies(), st.data())
def test_appending_in_any_chunks_equals_appending_at_once(policy, data):
    B, H, D, C = 2, 2, 16, 48
    L = data.draw(st.integers(0, C))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    k, v = torch.randn(2, B, H, L, D, generator=g)
    once = QuantizedKV(policy, B, H, C, D)
    if L:
        once.append(k, v)
    chunked = QuantizedKV(policy, B, H, C, D)
    at = 0
    for n in _chunks(data.draw, L):
        chunked.append(k[:, :, at:at + n], v[:, :, at:at + n])
        at += n
    for name in PACKED_FIELDS:
        assert torch.equal(used(once, name), used(chunked, name)), name
    for name in ROW_FIELDS:
        assert torch.equal(getattr(once.state, name), getattr(chunked.state, name)), name
    for a, b in zip(once.dequantized(), chunked.dequantized()):
        assert torch.equal(a, b)


@given(policies(), st.data())
def test_appending_to_some_rows_equals_appending_to_all_with_the_others_empty(policy, data):
    """``KVStore.append_rows`` (a serving engine's group of requests, consecutive slots or not) stores exactly
    what ``append`` stores with the other sequences given no token, and returns the rows' state."""
    B, H, D, n = 4, 2, 16, data.draw(st.integers(1, 9))
    spec = LayerSpec(policy, H, D, "float32")
    rows = sorted(data.draw(st.sets(st.integers(0, B - 1), min_size=1)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    past = torch.randn(2, B, H, 7, D, generator=g)
    k, v = torch.randn(2, len(rows), H, n, D, generator=g)
    some, every = KVStore(spec, B), KVStore(spec, B)
    for st_ in (some, every):
        st_.append(past[0], past[1])
    sub = some.append_rows(torch.tensor(rows), k, v)
    full_k, full_v = torch.zeros(2, B, H, n, D)
    full_k[rows], full_v[rows] = k, v
    every.append(full_k, full_v, torch.tensor([n if b in rows else 0 for b in range(B)]))
    assert some.lengths == every.lengths and some.tables == every.tables
    for a, b, name in zip(some.state, every.state, some.state._fields):
        assert torch.equal(a, b), name
    for a, b, name in zip(sub[6:], every.state[6:], sub._fields[6:]):
        assert torch.equal(a, b[rows]), name  # the rows' own fields, as stored


@pytest.mark.parametrize("L", [0, 1, 31, 32, 33, 159, 160, 161, 256])
def test_regions_at_boundary_lengths(L):
    """Sinks and the residual are exact; the packed region is within the format's bound; the rest is zero."""
    policy = Policy.kivi(4, group=32, residual=128, sink=4)
    B, H, D, C = 1, 2, 64, 256
    spec = LayerSpec(policy, H, D)
    g = torch.Generator().manual_seed(L)
    k, v = torch.randn(2, B, H, L, D, generator=g) * 3
    kv = QuantizedKV(policy, B, H, C, D)
    if L:
        kv.append(k, v)
    kh, vh = kv.dequantized(end=C)
    q0 = spec.boundary(L)
    assert q0 == (4 + ((L - 4 - 128) // 32) * 32 if L >= 4 + 128 else 4)
    exact = list(range(min(L, 4))) + list(range(max(q0, 4), L))
    assert torch.equal(kh[:, :, exact], k[:, :, exact]) and torch.equal(vh[:, :, exact], v[:, :, exact])
    assert not kh[:, :, L:].any() and not vh[:, :, L:].any()
    if q0 > 4:  # the packed region is within half a step of its stored scale
        kq, vq = k[:, :, 4:q0], v[:, :, 4:q0]
        for x, xh, q, scale in ((kq, kh[:, :, 4:q0], policy.key, kv.state.k_scale),
                                (vq, vh[:, :, 4:q0], policy.value, kv.state.v_scale)):
            _, s, _ = Q.quantize(x, q)
            step = (s.float().repeat_interleave(32, dim=-2) if q.axis == "channel"
                    else s.float().repeat_interleave(32, dim=-1))
            assert ((xh - x).abs() <= step / 2 + 1e-5 * (1 + x.abs())).all()
    assert int(kv.lengths[0]) == L


def test_keys_per_channel_enter_packed_storage_only_in_whole_groups():
    policy = Policy.kivi(2, group=32, residual=0)
    kv = QuantizedKV(policy, 1, 1, 128, 32)
    x = torch.randn(1, 1, 31, 32)
    kv.append(x, x)
    assert not kv.state.k_codes.any() and not kv.state.k_scale.any()  # 31 < a group: all in the residual
    assert torch.equal(kv.dequantized()[0][:, :, :31], x)
    kv.append(x[:, :, :1], x[:, :, :1])  # the 32nd token completes the group and flushes it
    assert kv.state.k_scale[0, 0, 0].any() and not kv.state.k_scale[0, 0, 1:].any()


def test_ragged_batch_rows_have_their_own_lengths():
    policy = Policy.kivi(4, group=8, residual=4)
    B, H, D, C = 3, 2, 16, 64
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, B, H, 40, D, generator=g)
    ragged = QuantizedKV(policy, B, H, C, D)
    ragged.append(k[:, :, :20], v[:, :, :20], n_new=torch.tensor([20, 7, 0]))
    ragged.append(k[:, :, 20:40], v[:, :, 20:40], n_new=torch.tensor([3, 20, 1]))
    assert ragged.lengths.tolist() == [23, 27, 1]
    kh, vh = ragged.dequantized(end=C)
    # each row equals a single-row store fed the same tokens of that row
    rows = {0: list(range(23)), 1: list(range(7)) + list(range(20, 40)), 2: [20]}
    for b, idx in rows.items():
        solo = QuantizedKV(policy, 1, H, C, D)
        solo.append(k[b:b + 1, :, idx], v[b:b + 1, :, idx])
        sk, sv = solo.dequantized(end=C)
        assert torch.equal(kh[b:b + 1], sk) and torch.equal(vh[b:b + 1], sv)


def test_append_beyond_capacity_is_a_clear_error():
    kv = QuantizedKV(Policy.kivi(4, group=8, residual=8), 2, 1, 32, 16)
    kv.append(torch.randn(2, 1, 30, 16), torch.randn(2, 1, 30, 16))
    with pytest.raises(kc.CapacityError, match="holds 30 tokens and appends 3, but the cache is limited to 32 tokens"):
        kv.append(torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 16))
    assert kv.lengths.tolist() == [30, 30]  # nothing was written
    kv.append(torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))  # filling to capacity exactly is fine
    assert kv.lengths.tolist() == [32, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_policy_stores_exactly_in_the_model_dtype(dtype):
    kv = QuantizedKV(Policy.full(), 1, 2, 40, 16, dtype=dtype)
    x = torch.randn(1, 2, 33, 16).to(dtype)
    kv.append(x, x)
    assert kv.state.k_res.dtype == dtype
    assert torch.equal(kv.dequantized(dtype)[0][:, :, :33], x)


def test_rotation_is_exact_attention_in_float64():
    """Attention over rotated q/k/v, un-rotated, equals plain attention (float64)."""
    for D in (16, 64, 128):
        Hd = hadamard(D, dtype=torch.float64)
        assert torch.allclose(Hd @ Hd.T, torch.eye(D, dtype=torch.float64), atol=1e-12)
        q, k, v = torch.randn(3, 2, 4, 9, D, dtype=torch.float64)
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        rot = F.scaled_dot_product_attention(q @ Hd, k @ Hd, v @ Hd, is_causal=True) @ Hd.T
        assert (plain - rot).abs().max() < 1e-12


def test_rotated_store_attention_matches_plain_attention():
    B, Hq, H, D, L = 1, 4, 2, 64, 20
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(B, Hq, 1, D, generator=g), *torch.randn(2, B, H, L, D, generator=g)
    plain = QuantizedKV(Policy.full(), B, H, 32, D)
    rot = QuantizedKV(Policy(rotate=True), B, H, 32, D)
    for kv in (plain, rot):
        kv.append(k, v)
    expect = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert (plain.attention(q) - expect).abs().max() < 1e-5
    assert (rot.attention(q) - expect).abs().max() < 1e-5
    assert not torch.equal(rot.state.k_codes, plain.state.k_codes)  # it really stores rotated keys


def test_reference_attention_masks_and_causality():
    B, H, D, C = 2, 2, 16, 24
    kv = QuantizedKV(Policy.full(), B, H, C, D)
    k, v = torch.randn(2, B, H, 10, D)
    kv.append(k, v)
    q = torch.randn(B, 4, 3, D)
    causal = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
        attn_mask=torch.ones(3, 10, dtype=torch.bool).tril(7))
    assert (kv.attention(q) - causal).abs().max() < 1e-5
    mask = torch.zeros(B, 1, 3, C, dtype=torch.bool)
    mask[..., :5] = True  # only the first 5 positions
    full = F.scaled_dot_product_attention(q, k[:, :, :5].repeat_interleave(2, 1), v[:, :, :5].repeat_interleave(2, 1))
    assert (kv.attention(q, mask=mask) - full).abs().max() < 1e-5
    additive = torch.where(mask, 0.0, float("-inf"))
    assert (kv.attention(q, mask=additive) - full).abs().max() < 1e-5
    nothing = torch.zeros(B, 1, 3, C, dtype=torch.bool)
    assert torch.equal(kv.attention(q, mask=nothing), torch.zeros_like(q))


@given(policies(), st.sampled_from([16, 64]), st.integers(1, 3), st.sampled_from([1, 100, 1000]),
       st.sampled_from([torch.float32, torch.bfloat16]))
# one token under a window and sinks: its whole first row step (11 positions) is held, more than a 3-bit block
@example(Policy(Quant("int3", "token", 64), Quant("int3", "token", 64), residual=8, sink=3), 64, 1, 1, torch.float32)
def test_bytes_per_token_equals_measured_bytes(policy, D, batch, capacity, dtype):
    layers, heads = 3, 2
    if policy.rotate and D & (D - 1):
        return
    stores = [QuantizedKV(policy, batch, heads, capacity, D, dtype=dtype) for _ in range(layers)]
    for s in stores:  # sequences of `capacity` tokens, appended in two calls
        x = torch.randn(batch, heads, capacity, D).to(dtype)
        s.append(x[:, :, :capacity // 3], x[:, :, :capacity // 3])
        s.append(x[:, :, capacity // 3:], x[:, :, capacity // 3:])
    measured = sum(s.nbytes for s in stores)
    assert kc.cache_bytes(policy, layers, heads, D, capacity, batch, dtype) == measured
    assert kc.bytes_per_token(policy, layers, heads, D, capacity, batch, dtype) == measured / (batch * capacity)
    spec = LayerSpec(policy, heads, D, kvcompile_dtype(dtype))
    assert spec.nbytes(batch, capacity) == stores[0].nbytes
    # within one block (and its table entry) per sequence of the exact count, and the rows' growth step: the ring
    # and the sinks are allocated in steps of ROW_TOKENS positions, so each holds at most ROW_TOKENS - 1 more
    slack = spec.block_nbytes() + 4 + 2 * (ROW_TOKENS - 1) * spec.position_nbytes()
    assert spec.exact_nbytes(batch, capacity) <= stores[0].nbytes <= spec.exact_nbytes(batch, capacity) + batch * slack


def test_packed_layout_memory_is_the_packed_size():
    """A 4-bit KIVI store at long context is ~0.28x the bf16 cache: codes + fp16 scales + residual."""
    D, H, C = 128, 8, 32768
    bf16 = 2 * H * C * D * 2
    got = LayerSpec(Policy.kivi(4, group=64), H, D, "bfloat16").nbytes(1, C)
    expected_bits = 4 + 2 * 16 / 64  # codes + fp16 scale and zero per 64 elements
    assert got == pytest.approx(bf16 * expected_bits / 16, rel=0.02)
    assert got / bf16 < 0.3
    two = LayerSpec(Policy.kivi(2, group=64), H, D, "bfloat16").nbytes(1, C)
    assert two / bf16 < 0.17
    # the residual ring is the only full-precision part: R + F - 1 tokens
    spec = LayerSpec(Policy.kivi(4, group=64, residual=128), H, D, "bfloat16")
    assert spec.ring == 128 + 64 - 1 and spec.boundary(C) - spec.sink == ((C - 128) // 64) * 64


def test_layer_spec_validation():
    with pytest.raises(kc.PolicyError, match="head_dim=48"):
        LayerSpec(Policy(Quant("int4", "token", 32), Quant("int4")), 1, 48)
    with pytest.raises(kc.PolicyError, match="resolved per-layer policy"):
        LayerSpec(Policy.kivi(4).override({0: None}), 1, 64)
    with pytest.raises(kc.PolicyError, match="heads=0"):
        LayerSpec(Policy.kivi(4), 0, 64)
    with pytest.raises(kc.PolicyError, match="block_tokens=24"):
        LayerSpec(Policy.kivi(4), 1, 64, "float32", 24)
    with pytest.raises(kc.PolicyError, match=r"block_tokens=16 .*flush group \(32\)"):
        LayerSpec(Policy.kivi(4, group=32), 1, 64, "float32", 16)
    assert math.isfinite(LayerSpec(Policy.kivi(4), 1, 64).nbytes(1, 16))


def test_dequantize_reference_model_space_and_rotated_space():
    spec = LayerSpec(Policy(Quant("none"), Quant("none"), rotate=True), 1, 16)
    state = spec.allocate(1, 8)
    kv = QuantizedKV(spec.policy, 1, 1, 8, 16)
    x = torch.randn(1, 1, 5, 16)
    kv.append(x, x)
    model_space = dequantize_reference(kv.state, kv.spec)[0][:, :, :5]
    rotated = dequantize_reference(kv.state, kv.spec, rotated=True)[0][:, :, :5]
    assert (model_space - x).abs().max() < 1e-5
    assert (rotated - x @ hadamard(16)).abs().max() < 1e-5
    assert state.lengths.tolist() == [0]


@given(policies(), st.data())
def test_dequantize_reference_range_equals_slice_of_whole(policy, data):
    B, H, D, C = 2, 2, 16, 40
    kv = QuantizedKV(policy, B, H, C, D)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    n = data.draw(st.integers(1, C))
    kv.append(*torch.randn(2, B, H, n, D, generator=g), n_new=torch.tensor([n, data.draw(st.integers(0, n))]))
    start = data.draw(st.integers(0, C - 1))
    end = data.draw(st.integers(start + 1, C))
    whole = dequantize_reference(kv.state, kv.spec, end=C)
    part = dequantize_reference(kv.state, kv.spec, start=start, end=end)
    for w, p in zip(whole, part):
        assert torch.equal(w[:, :, start:end], p)


# --------------------------------------------------------------------------- the queries' own chunk
def test_a_prefill_attends_to_its_own_chunk_in_full_precision():
    # An empty store, one call of 40 tokens at 2 bits: with the chunk given, attention is the full-precision
    # causal attention of those tokens (KIVI's prefill); without it, the 2-bit copies (residual 4) are read.
    B, Hq, H, D, n = 2, 4, 2, 16, 40
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(B, Hq, n, D, generator=g), *torch.randn(2, B, H, n, D, generator=g)
    kv = QuantizedKV(Policy.kivi(2, group=8, residual=4), B, H, 64, D)
    kv.append(k, v)
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                           v.double().repeat_interleave(2, 1), is_causal=True)
    own = kc.store.attention_reference(q.double(), kv.state, kv.spec, None, None, torch.float64, k_new=k, v_new=v)
    assert (own - exact).abs().max() < 1e-12
    assert (kv.attention(q).double() - exact).abs().max() > 1e-2  # the store alone holds 2-bit copies
    # a later call of 3 queries sees the first 40 quantized and its own 3 exactly
    k2, v2 = torch.randn(2, B, H, 3, D, generator=g)
    kv.append(k2, v2)
    q2 = torch.randn(B, Hq, 3, D, generator=g)
    k_hat, v_hat = kv.dequantized(torch.float64)
    k_hat[:, :, 40:43], v_hat[:, :, 40:43] = k2.double(), v2.double()
    mask = torch.ones(3, 43, dtype=torch.bool).tril(40)
    want = F.scaled_dot_product_attention(q2.double(), k_hat[:, :, :43].repeat_interleave(2, 1),
                                          v_hat[:, :, :43].repeat_interleave(2, 1), attn_mask=mask)
    got = kc.store.attention_reference(q2.double(), kv.state, kv.spec, None, None, torch.float64, k_new=k2,
                                       v_new=v2)
    assert (got - want).abs().max() < 1e-12


@given(policies(), st.data())
def test_chunk_needed_is_exact(policy, data):
    # Kernels skip the chunk when chunk_needed() says none of its positions can be packed: then the chunk and
    # the store must give bit-identical attention, after any sequence of appends.
    B, H, D, C = 2, 1, 16, 48
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    kv = QuantizedKV(policy, B, H, C, D)
    L = data.draw(st.integers(1, C))
    k, v = torch.randn(2, B, H, L, D, generator=g)
    at = 0
    for n in _chunks(data.draw, L):
        kv.append(k[:, :, at:at + n], v[:, :, at:at + n])
        at += n
    q = torch.randn(B, 2 * H, n, D, generator=g)
    mine = kc.store.attention_reference(q, kv.state, kv.spec, k_new=k[:, :, L - n:], v_new=v[:, :, L - n:])
    if not kc.store.chunk_needed(kv.spec, n):
        assert torch.equal(mine, kv.attention(q))


def test_chunk_of_the_wrong_shape_is_a_clear_error():
    kv = QuantizedKV(Policy.kivi(4, group=8), 1, 2, 64, 16)
    k = torch.randn(1, 2, 5, 16)
    kv.append(k, k)
    with pytest.raises(ValueError, match=r"own keys and values, of shape \[1, 2, 3, 16\]"):
        kv.attention(torch.randn(1, 2, 3, 16), k_new=k, v_new=k)
    with pytest.raises(ValueError, match="together"):
        kv.attention(torch.randn(1, 2, 5, 16), k_new=k)


def kvcompile_dtype(dtype):
    return DTYPE_NAMES[dtype]


# --------------------------------------------------------------------------- the block manager: crop, fork, grow
def _filled(policy, B, L, seed, block=16, dtype=torch.float32):
    spec = LayerSpec(policy, 2, 16, DTYPE_NAMES[dtype], max(block, policy.flush))
    st = KVStore(spec, B)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, 2, L, 16, generator=g) * 3).to(dtype), torch.randn(B, 2, L, 16, generator=g).to(dtype)
    at = 0
    while at < L:  # uneven appends, as a decode would make them
        n = min(L - at, 1 + (at * 7) % 23)
        st.append(k[:, :, at:at + n], v[:, :, at:at + n])
        at += n
    return st, k, v


@given(policies(), st.data())
def test_crop_keeps_what_the_store_held(policy, data):
    """After crop(L'), every sequence reads its first L' positions exactly as the store held them before (the
    positions that go back to the ring keep their dequantized values: exact in float32), and holds only the
    blocks its new length needs."""
    L = data.draw(st.integers(1, 90))
    keep = data.draw(st.integers(0, L))
    kv, _, _ = _filled(policy, 2, L, data.draw(st.integers(0, 999)))
    before = dequantize_reference(kv.state, kv.spec, end=L)
    kv.crop(keep)
    after = dequantize_reference(kv.state, kv.spec, end=L)
    for b, a in zip(before, after):
        assert torch.equal(a[:, :, :keep], b[:, :, :keep]) and not a[:, :, keep:].any()
    assert kv.lengths == [keep, keep] and kv.state.lengths.tolist() == [keep, keep]
    assert all(len(t) == kv.spec.blocks_for(keep) for t in kv.tables)
    assert kv.used_blocks == 2 * kv.spec.blocks_for(keep)


@given(policies(), st.data())
def test_crop_within_the_full_precision_window_is_exact(policy, data):
    """A crop that leaves the packed region where it is (Q(L') == Q(L): only full-precision positions are
    dropped, as in a speculative-decoding rollback within the window's slack) leaves the store exactly as if
    the dropped tokens had never been appended; so does any crop of a store that quantizes nothing
    (Policy.full())."""
    L = data.draw(st.integers(1, 90))
    seed = data.draw(st.integers(0, 999))
    kv, k, v = _filled(policy, 1, L, seed)
    keep = data.draw(st.sampled_from([c for c in range(L + 1) if kv.spec.boundary(c) == kv.spec.boundary(L)]))
    kv.crop(keep)
    more = torch.randn(2, 1, 2, 7, 16)
    kv.append(more[0], more[1])
    fresh = KVStore(kv.spec, 1)
    fresh.append(k[:, :, :keep], v[:, :, :keep])
    fresh.append(more[0], more[1])
    for a, b in zip(dequantize_reference(kv.state, kv.spec), dequantize_reference(fresh.state, fresh.spec)):
        assert torch.equal(a, b)
    full, fk, fv = _filled(Policy.full(), 1, L, seed)
    cut = data.draw(st.integers(0, L))
    full.crop(cut)
    assert torch.equal(dequantize_reference(full.state, full.spec)[0], fk[:, :, :cut])


def test_crop_into_packed_storage_requantizes_from_what_was_held():
    """Crop back past Q(L): the positions that return to the ring hold their dequantized values, and are
    quantized again from those values when they leave it (the cost of a crop into packed storage)."""
    policy = Policy(Quant("int4", "token", 8), Quant("int4", "token", 8))  # no residual: everything is packed
    kv, k, v = _filled(policy, 1, 40, 3)
    held = dequantize_reference(kv.state, kv.spec, end=40)
    kv.crop(30)
    assert kv.spec.boundary(30) == 30  # nothing goes back to a ring here: the packed rows are simply kept
    assert torch.equal(dequantize_reference(kv.state, kv.spec)[0], held[0][:, :, :30])
    kivi = Policy.kivi(4, group=8, residual=8)
    kv, k, v = _filled(kivi, 1, 40, 3)
    held = dequantize_reference(kv.state, kv.spec, end=40)
    kv.crop(30)  # Q(40) = 32 > 30: positions 16..29 go back to the ring, as held
    assert kv.spec.boundary(30) == 16
    assert torch.equal(dequantize_reference(kv.state, kv.spec)[0], held[0][:, :, :30])
    kv.append(k[:, :, 30:40], v[:, :, 30:40])  # the same tokens again: 16..31 quantized from the held values
    again = dequantize_reference(kv.state, kv.spec)[0]
    assert torch.equal(again[:, :, :16], held[0][:, :, :16])
    assert (again[:, :, 16:32] - held[0][:, :, 16:32]).abs().max() < 0.5  # a second rounding, within a step


def test_select_forks_and_reorders_sharing_blocks_until_written():
    """select([1, 0, 0]): three sequences from two, the forked ones sharing blocks; appending different tokens
    to each then gives each exactly what a store of its own history would hold (a shared block is copied
    before it is written), and the blocks of a dropped sequence are freed."""
    policy = Policy.kivi(4, group=8, residual=8)
    kv, k, v = _filled(policy, 2, 70, 5)
    shared_before = kv.used_blocks
    kv.select([1, 0, 0])
    assert kv.batch == 3 and kv.used_blocks == shared_before  # forks share every block
    assert kv.tables[1] == kv.tables[2]
    new = torch.randn(2, 3, 2, 40, 16)
    kv.append(new[0], new[1])
    assert kv.tables[1] != kv.tables[2]  # written: the shared tail was copied
    for row, src in ((0, 1), (1, 0), (2, 0)):
        solo = KVStore(kv.spec, 1)
        solo.append(k[src:src + 1], v[src:src + 1])
        solo.append(new[0][row:row + 1], new[1][row:row + 1])
        for a, b in zip(dequantize_reference(kv.state, kv.spec), dequantize_reference(solo.state, solo.spec)):
            assert torch.equal(a[row:row + 1], b)
    kv.select([2])  # keep one: the others' blocks return to the pool
    assert kv.batch == 1 and kv.used_blocks == len(kv.tables[0]) == kv.spec.blocks_for(110)
    with pytest.raises(IndexError, match="outside the store's 1 sequences"):
        kv.select([1])


def test_the_pool_grows_and_a_block_budget_is_a_clear_error():
    spec = LayerSpec(Policy.int8(), 2, 16, "float32", 16)
    kv = KVStore(spec, 2)
    x = torch.randn(2, 2, 100, 16)
    kv.append(x, x)
    assert kv.used_blocks == 2 * 7 and kv.blocks >= kv.used_blocks
    assert kv.reserved_nbytes == sum(t.numel() * t.element_size() for t in kv.state)
    for _ in range(30):  # decode steps: the pool doubles, never grows per step
        kv.append(x[:, :, :1], x[:, :, :1])
    assert kv.blocks in (16, 28) and kv.lengths == [130, 130]
    budget = KVStore(spec, 1, max_blocks=3)
    budget.append(x[:1, :, :48], x[:1, :, :48])
    with pytest.raises(kc.CapacityError, match=r"out of blocks: an append needs 1 free blocks .* limited to 3 blocks"):
        budget.append(x[:1, :, :1], x[:1, :, :1])
    assert budget.lengths == [48] and budget.state.lengths.tolist() == [48]  # nothing was written
    budget.reset()
    assert budget.used_blocks == 0 and budget.lengths == [0]
    budget.append(x[:1, :, :48], x[:1, :, :48])  # the freed blocks are reused


def test_expect_allocates_once_for_the_tokens_to_come():
    """expect(N): the pool is sized, exactly, for every sequence to reach N tokens; appends up to N then never
    grow (or copy) it; what the sequences hold is unchanged. Clamped to max_tokens and to a block budget."""
    spec = LayerSpec(Policy.kivi(4, group=4, residual=8), 2, 16, "float32", 16)
    x = torch.randn(2, 2, 100, 16)
    kv = KVStore(spec, 2)
    kv.append(x[:, :, :30], x[:, :, :30])
    held = kv.nbytes
    kv.expect(100)
    assert kv.blocks == 2 * spec.blocks_for(100) and kv.nbytes == held
    pool = kv.state.k_codes
    for t in range(30, 100):
        kv.append(x[:, :, t:t + 1], x[:, :, t:t + 1])
    assert kv.state.k_codes is pool and kv.blocks == 2 * spec.blocks_for(100)
    ref = KVStore(spec, 2)
    ref.append(x, x)  # the same tokens, no expectation: the same bytes held, bit for bit
    assert kv.nbytes == ref.nbytes
    for a, b in zip(dequantize_reference(kv.state, spec), dequantize_reference(ref.state, spec)):
        assert torch.equal(a, b)
    kv.expect(50)  # never shrinks
    assert kv.blocks == 2 * spec.blocks_for(100)
    capped = KVStore(spec, 1, max_tokens=40)
    capped.expect(10 ** 6)
    assert capped.blocks == spec.blocks_for(40)
    budget = KVStore(spec, 3, max_blocks=4)
    budget.expect(10 ** 6)
    assert budget.blocks == 4
    with pytest.raises(ValueError, match=r"expect tokens=-1 is not valid: expected a whole number of tokens"):
        kv.expect(-1)


def test_an_unreserved_append_is_a_clear_error_not_a_wild_write():
    spec = LayerSpec(Policy.int8(), 2, 16, "float32", 16)
    state = spec.allocate(1, 16)
    from kvcompile.store import store_reference
    x = torch.randn(1, 2, 17, 16)
    with pytest.raises(kc.CapacityError, match="needs 2 blocks of 16 packed tokens, but 1 are reserved"):
        store_reference(state, spec, x, x)
    assert state.lengths.tolist() == [0]


@profiles.CHEAP
@given(st.data())
def test_the_capacity_check_finds_the_first_row_short_of_blocks(data):
    """``store._state_capacity_check`` (tensor ops over the rows) refuses exactly the appends a row at a time would
    (``LayerSpec.blocks_for`` of its end against the row's reserved table entries), naming the first such row."""
    from kvcompile.store import KVState, _state_capacity_check
    policy = data.draw(st.sampled_from([Policy.int8(), Policy.kivi(4, group=16, residual=8, sink=2)]))
    spec = LayerSpec(policy, 1, 16, "float32", 16)
    B, W = data.draw(st.integers(1, 5)), data.draw(st.integers(0, 4))
    table = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, 3), min_size=W, max_size=W), min_size=B,
                                            max_size=B)), dtype=torch.int32).view(B, W)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 80), min_size=B, max_size=B)), dtype=torch.int32)
    n_new = torch.tensor(data.draw(st.lists(st.integers(0, 20), min_size=B, max_size=B)), dtype=torch.int32)
    state = KVState(*[None] * 10, lengths, table)
    need = [spec.blocks_for(int(a) + int(b)) for a, b in zip(lengths, n_new)]
    short = [b for b, nb in enumerate(need) if nb > W or (nb and int(table[b, :nb].min()) < 0)]
    if not short:
        _state_capacity_check(state, spec, lengths, n_new)
        return
    b = short[0]
    with pytest.raises(kc.CapacityError, match=f"sequence {b} holds {int(lengths[b])} tokens and appends "
                                               f"{int(n_new[b])}, which needs {need[b]} blocks of 16 packed tokens, "
                                               f"but {int((table[b] >= 0).sum())} are reserved"):
        _state_capacity_check(state, spec, lengths, n_new)


# --------------------------------------------------------------------------- non-finite values and saturation
from kvcompile.store import attention_reference  # noqa: E402
from nonfinite_checks import BAD, assert_close, assert_nan_pattern, oracle, placements  # noqa: E402

# keys per channel in groups of 4 (KIVI), values per token in groups of 8, two sinks, a residual of 3
NF_POLICY = Policy(Quant("int4", "channel", 4), Quant("int8", "token", 8), residual=3, sink=2)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("region", ["sink", "packed", "residual"])
def test_reference_attention_follows_its_non_finite_rule(which, bad, region):
    """One NaN or +-inf key or value, in a sink, a packed group (its first or last token and
    channel) or the residual window. A causal prefill over all 24 tokens and a decode with a mask that hides
    the bad position: attention_reference is NaN exactly where its rule says (``nonfinite_checks.oracle``,
    written row by row), rows that do not see the position stay finite, and the rest matches float64
    attention. Before, a NaN key's rows came back as zeros and a NaN value poisoned rows that do not see it."""
    H, D, L = 1, 16, 24
    spec = LayerSpec(NF_POLICY, H, D, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    for p, c in placements(spec, L)[region]:
        k, v = torch.randn(2, 1, H, L, D, generator=g)
        (k if which == "k" else v)[0, 0, p, c] = bad
        st = KVStore(spec, 1)
        st.append(k, v)
        q = torch.randn(1, 2, L, D, generator=g)
        got = attention_reference(q, st.state, spec, None, None, torch.float64)
        assert_close(got, oracle(q, st.state, spec), what=f"{which} {bad} at {p, c}")
        held = dequantize_reference(st.state, spec, rotated=True)[0 if which == "k" else 1][0, 0]
        bad_at = (~held.isfinite()).any(-1).nonzero().flatten().tolist()  # p, or its packed group
        assert p in bad_at and (region == "packed" or bad_at == [p])
        assert torch.isfinite(got[:, :, :bad_at[0]]).all()  # the rows before it do not see it
        assert got[:, :, bad_at[0]:].isnan().any(-1).all()  # every row that sees it is poisoned
        hide = torch.ones(1, 1, 1, L, dtype=torch.bool)
        hide[..., bad_at] = False
        for mask in (hide, torch.zeros(1, 1, 1, L).masked_fill(~hide, float("-inf"))):
            got = attention_reference(q[:, :, -1:], st.state, spec, mask, None, torch.float64)
            assert_close(got, oracle(q[:, :, -1:], st.state, spec, mask), what=f"hidden {which} {bad} at {p, c}")
            assert torch.isfinite(got).all()  # every bad position is hidden: nothing leaks


def test_reference_nan_spread_against_full_precision():
    """How far one NaN spreads compared with full precision (format "none" stores exactly, so the reference
    there is SDPA restricted to what each row sees): a NaN value poisons its channel of the rows that see it,
    a NaN key those rows entirely; with an integer format a key's NaN spreads to its per-channel group (4
    tokens), which the causal rows past the group see anyway."""
    H, D, L = 1, 16, 20
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 1, H, L, D, generator=g)
    q = torch.randn(1, 1, L, D, generator=g)
    for which, p in (("k", 9), ("v", 9)):
        kk, vv = k.clone(), v.clone()
        (kk if which == "k" else vv)[0, 0, p, 5] = float("nan")
        full = LayerSpec(Policy.full(), H, D)
        st = KVStore(full, 1)
        st.append(kk, vv)
        got = attention_reference(q, st.state, full, None, None, torch.float64)
        want = torch.zeros(1, 1, L, D, dtype=torch.bool)
        if which == "k":
            want[0, 0, p:] = True
        else:
            want[0, 0, p:, 5] = True
        assert torch.equal(got.isnan(), want)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.double()[:, :, :p], kk.double()[:, :, :p],
                                                                vv.double()[:, :, :p], is_causal=True)
        assert torch.allclose(got[:, :, :p].double(), sdpa)  # rows that never see it: full precision, untouched
        st = KVStore(LayerSpec(NF_POLICY, H, D, block_tokens=16), 1)
        st.append(kk, vv)
        got = attention_reference(q, st.state, st.spec, None, None, torch.float64)
        first = p if which == "v" or p >= st.spec.boundary(L) else 2 + ((p - 2) // 4) * 4  # the key's group
        assert not got[:, :, :first].isnan().any() and got[:, :, p:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", [Policy.int8(), Policy.kivi(2, group=4, residual=2), Policy.fp8("fp8_e5m2"),
                                    Policy(Quant("int4", symmetric=True), Quant("fp8_e4m3"), sink=1, rotate=True)])
def test_finite_keys_near_the_dtype_max_give_finite_attention(policy, dtype):
    """A key or value beyond fp16 scales' reach (6.5e4 for int8 asymmetric, ~1e6 int4
    symmetric, ~3e7 fp8 e4m3) made a scale inf and attention NaN or 0. Up to the model dtype's largest value
    the store, what it reads back (in fp32 and in the model dtype) and attention are finite."""
    H, D, L = 2, 16, 24
    spec = LayerSpec(policy, H, D, DTYPE_NAMES[dtype], block_tokens=16)
    g = torch.Generator().manual_seed(2)
    top = torch.finfo(dtype).max
    k = (torch.randn(1, H, L, D, generator=g) * 10).to(dtype)
    v = (torch.randn(1, H, L, D, generator=g) * 10).to(dtype)
    k[0, 0, 5, 3], v[0, 1, 7, 2], k[0, 1, 6, 0] = top, -top, min(top, 1e6)
    st = KVStore(spec, 1)
    st.append(k, v)
    for t in st.state[:6]:
        assert torch.isfinite(t.float()).all()
    for dt in (torch.float32, dtype):
        for x in dequantize_reference(st.state, spec, dt):
            assert torch.isfinite(x).all()
    q = torch.randn(1, 2 * H, 1, D, generator=g) / top  # scores stay O(1)
    out = attention_reference(q.to(dtype), st.state, spec)
    assert torch.isfinite(out).all()
    assert_nan_pattern(out, oracle(q.to(dtype), st.state, spec))


@pytest.mark.parametrize("policy", [Policy.kivi(4, sink=100_000), Policy.kivi(2, group=8, residual=150, sink=70,
                                                                               rotate=True),
                                    Policy.int8(residual=100), Policy.full()], ids=str)
def test_sinks_and_window_grow_with_the_tokens_written_not_at_creation(policy):
    """A store allocates its sinks and full-precision window as its sequences reach them (``LayerSpec.row_widths``:
    steps of ``ROW_TOKENS`` positions, up to the policy's), not when it is created: 100,000 sinks cost a 24-token
    sequence 64 positions. What it holds, and what attention reads from it, are bit for bit those of a store whose
    rows are allocated whole (``whole_rows``, as a serving pool's are); its bytes are ``LayerSpec.nbytes``'."""
    B, H, D = 2, 2, 16
    spec = LayerSpec(policy, H, D, "float32", max(16, policy.flush))
    lazy, whole = KVStore(spec, B), KVStore(spec, B, whole_rows=True)
    assert lazy.reserved_nbytes == lazy.nbytes == B * 4  # at creation: the lengths, no sink, no window
    assert whole.reserved_nbytes == B * spec.row_nbytes() == B * ((spec.ring + spec.sink) * spec.position_nbytes() + 4)
    g = torch.Generator().manual_seed(0)
    for n, n_new in [(24, [24, 24]), (1, [1, 0]), (45, [45, 40]), (70, [3, 70]), (130, [130, 130]), (1, [1, 1])]:
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        n_new = torch.tensor(n_new)
        lazy.append(k, v, n_new)
        whole.append(k, v, n_new)
        longest = max(lazy.lengths)
        ring, sink = spec.row_widths(longest)
        assert (ring, sink) == (min(spec.ring, -(-longest // 64) * 64), min(spec.sink, -(-longest // 64) * 64))
        assert lazy.state.k_res.shape[2] == lazy.state.v_res.shape[2] == ring
        assert lazy.state.k_sink.shape[2] == lazy.state.v_sink.shape[2] == sink
        assert whole.nbytes - lazy.nbytes == B * (spec.row_nbytes() - spec.row_nbytes(longest))
        for a, b in zip(dequantize_reference(lazy.state, spec), dequantize_reference(whole.state, spec)):
            assert torch.equal(a, b)
        q = torch.randn(B, 2 * H, 1, D, generator=g)  # a decode step's queries: every stored token
        assert torch.equal(kc.store.attention_reference(q, lazy.state, spec),
                           kc.store.attention_reference(q, whole.state, spec))
    assert lazy.lengths == [204, 265]
    one = KVStore(spec, 1)  # the case: a 24-token sequence under 100,000 sinks
    one.append(*torch.randn(2, 1, H, 24, D, generator=g))
    assert one.nbytes == spec.nbytes(1, 24) and one.state.k_sink.shape[2] == min(spec.sink, 64)
