"""The reference layer store: streaming invariance, regions, ragged batches, capacity, rotation, accounting."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kvcompile as kc
from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import LayerSpec, QuantizedKV, dequantize_reference, hadamard

PACKED_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_sink", "v_sink", "lengths")


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
        assert torch.equal(getattr(once.state, name), getattr(chunked.state, name)), name
    for a, b in zip(once.dequantized(), chunked.dequantized()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("L", [0, 1, 31, 32, 33, 159, 160, 161, 256])
def test_regions_at_boundary_lengths(L):
    """Sinks and the residual are exact; the packed region is within the format's bound; the rest is zero."""
    policy = Policy.kivi(4, group=32, residual=128, sink=4)
    B, H, D, C = 1, 2, 64, 256
    spec = LayerSpec(policy, B, H, C, D)
    g = torch.Generator().manual_seed(L)
    k, v = torch.randn(2, B, H, L, D, generator=g) * 3
    kv = QuantizedKV(policy, B, H, C, D)
    if L:
        kv.append(k, v)
    kh, vh = kv.dequantized()
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
    kh, vh = ragged.dequantized()
    # each row equals a single-row store fed the same tokens of that row
    rows = {0: list(range(23)), 1: list(range(7)) + list(range(20, 40)), 2: [20]}
    for b, idx in rows.items():
        solo = QuantizedKV(policy, 1, H, C, D)
        solo.append(k[b:b + 1, :, idx], v[b:b + 1, :, idx])
        sk, sv = solo.dequantized()
        assert torch.equal(kh[b:b + 1], sk) and torch.equal(vh[b:b + 1], sv)


def test_append_beyond_capacity_is_a_clear_error():
    kv = QuantizedKV(Policy.kivi(4, group=8, residual=8), 2, 1, 32, 16)
    kv.append(torch.randn(2, 1, 30, 16), torch.randn(2, 1, 30, 16))
    with pytest.raises(kc.CapacityError, match="holds 30 tokens and appends 3.*allocated for 32 tokens"):
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
def test_bytes_per_token_equals_measured_bytes(policy, D, batch, capacity, dtype):
    layers, heads = 3, 2
    if policy.rotate and D & (D - 1):
        return
    stores = [QuantizedKV(policy, batch, heads, capacity, D, dtype=dtype) for _ in range(layers)]
    measured = sum(s.nbytes for s in stores)
    assert kc.cache_bytes(policy, layers, heads, D, capacity, batch, dtype) == measured
    assert kc.bytes_per_token(policy, layers, heads, D, capacity, batch, dtype) == measured / (batch * capacity)
    assert LayerSpec(policy, batch, heads, capacity, D).nbytes() == QuantizedKV(policy, batch, heads, capacity, D).nbytes


def test_packed_layout_memory_is_the_packed_size():
    """A 4-bit KIVI store at long context is ~0.28x the bf16 cache: codes + fp16 scales + residual."""
    D, H, C = 128, 8, 32768
    bf16 = 2 * H * C * D * 2
    got = LayerSpec(Policy.kivi(4, group=64), 1, H, C, D, "bfloat16").nbytes()
    expected_bits = 4 + 2 * 16 / 64  # codes + fp16 scale and zero per 64 elements
    assert got == pytest.approx(bf16 * expected_bits / 16, rel=0.02)
    assert got / bf16 < 0.3
    two = LayerSpec(Policy.kivi(2, group=64), 1, H, C, D, "bfloat16").nbytes()
    assert two / bf16 < 0.17
    # the residual ring is the only full-precision part: R + F - 1 tokens
    spec = LayerSpec(Policy.kivi(4, group=64, residual=128), 1, H, C, D, "bfloat16")
    assert spec.ring == 128 + 64 - 1 and spec.quantized_capacity == ((C - 128) // 64) * 64


def test_layer_spec_validation():
    with pytest.raises(kc.PolicyError, match="head_dim=48"):
        LayerSpec(Policy(Quant("int4", "token", 32), Quant("int4")), 1, 1, 16, 48)
    with pytest.raises(kc.PolicyError, match="resolved per-layer policy"):
        LayerSpec(Policy.kivi(4).override({0: None}), 1, 1, 16, 64)
    with pytest.raises(kc.PolicyError, match="capacity=0"):
        LayerSpec(Policy.kivi(4), 1, 1, 0, 64)
    assert math.isfinite(LayerSpec(Policy.kivi(4), 1, 1, 16, 64).nbytes())


def test_dequantize_reference_model_space_and_rotated_space():
    spec = LayerSpec(Policy(Quant("none"), Quant("none"), rotate=True), 1, 1, 8, 16)
    state = spec.allocate()
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
    whole = dequantize_reference(kv.state, kv.spec)
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
