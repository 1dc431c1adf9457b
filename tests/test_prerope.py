"""Pre-RoPE key storage (``Policy.pre_rope``): the policy field, the rotary formula the store applies, the
kernels against the reference, and the compiled model against the unmodified one."""
import copy
import dataclasses
import json
import os
import sys

import pytest
import torch
from hypothesis import given, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompile
from kvcompile import Policy, Quant
from kvcompile.policy import PolicyError
from kvcompile.store import (KVStore, LayerSpec, Rope, RopeError, RopeTable, apply_rope, attention_reference,
                             dequantize_reference, rope_pairing)
from kvcompile.templates import cpu, inductor
from kvcompile.templates import prefill as kprefill

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "passes"))
sys.path.insert(0, os.path.dirname(__file__))
import zoo  # noqa: E402
from nonfinite_checks import assert_close  # noqa: E402
from tiers import slow_after  # noqa: E402

TOL = 2e-6  # the Inductor and C kernels' tolerance against the reference (tests/templates)


# --------------------------------------------------------------------------- the policy field
def test_policy_field_is_validated_named_and_saved(tmp_path):
    with pytest.raises(PolicyError, match="pre_rope"):
        Policy(pre_rope="yes")
    p = Policy.kivi(2, sink=4, rotate=True, pre_rope=True)
    assert p.key_str().endswith(";pre=1") and ";pre" not in Policy.kivi(2).key_str()
    assert LayerSpec(p, 2, 64).name != LayerSpec(Policy.kivi(2, sink=4, rotate=True), 2, 64).name
    assert Policy.load(p.save(tmp_path / "p.json")) == p
    assert "pre_rope" not in Policy.kivi(2).to_dict()  # files without it read as before
    assert p.rotates_keys is False and p.rotate is True
    d = json.loads((tmp_path / "p.json").read_text())
    d["pre_rope"] = 1
    with pytest.raises(PolicyError, match="pre_rope"):
        Policy.from_dict(d)


# --------------------------------------------------------------------------- the formula
def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _cos_sin(positions, rd, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, rd, 2).float() / rd))
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


@given(D=st.sampled_from([8, 16, 64]), frac=st.sampled_from([1.0, 0.5, 0.25]), n=st.integers(1, 9),
       pads=st.lists(st.integers(0, 5), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_apply_rope_is_the_models_formula_bit_for_bit(D, frac, n, pads, seed):
    """Captured cos/sin rotate stored keys exactly as transformers' apply_rotary_pos_emb (whole head or partial
    rotary), at rotary positions index - pads (left padding)."""
    rd = max(2, int(D * frac)) // 2 * 2
    B = len(pads)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, 2, n, D, generator=g)
    r = torch.arange(n).view(1, n) - torch.tensor(pads).view(B, 1)
    cos, sin = _cos_sin(r.clamp(min=0), rd)
    cos, sin = cos[:, None], sin[:, None]
    kr = k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin
    want = torch.cat([kr, k[..., rd:]], -1)
    spec = LayerSpec(Policy(pre_rope=True), 2, D)
    store = KVStore(spec, B)
    store.set_rope_offsets([-p for p in pads])
    store.write_keys(True)
    store.capture_rope(cos, sin, "half", n)
    got = apply_rope(k, store.rope(), torch.arange(n))
    real = r >= 0  # pads are never visible: their rotation is only required to be finite
    assert torch.equal(got[real.view(B, 1, n, 1).expand_as(got)], want[real.view(B, 1, n, 1).expand_as(want)])
    assert torch.isfinite(got).all()


def test_a_position_seen_with_other_cos_sin_is_an_error():
    t = RopeTable()
    cos, sin = _cos_sin(torch.arange(4), 8)
    t.capture(cos[None, None], sin[None, None], "half", torch.arange(4).view(1, 4), torch.ones(1, 4, dtype=bool), 8)
    with pytest.raises(RopeError, match="differ"):
        t.capture(cos[None, None] * 2, sin[None, None], "half", torch.arange(4).view(1, 4),
                  torch.ones(1, 4, dtype=bool), 8)


# --------------------------------------------------------------------------- kernels against the reference
POLICIES = [Policy.kivi(2, group=16, residual=8, sink=2, pre_rope=True),
            Policy.kivi(4, group=16, residual=4, rotate=True, pre_rope=True),
            Policy(Quant("int3", "channel", 16), Quant("int8", "token"), residual=3, pre_rope=True),
            Policy.fp8(residual=5, sink=1, pre_rope=True),
            Policy(pre_rope=True)]


def _pre_rope_store(policy, H=2, D=64, offsets=(0, -3), chunks=(37, 1, 20, 1), rd=None, seed=0):
    """A store filled in ``chunks`` with keys (channel 3 an outlier) whose rotary cos/sin were captured at
    positions index + offset; yields (store, k_new, v_new) after each chunk."""
    g = torch.Generator().manual_seed(seed)
    spec = LayerSpec(policy, H, D, block_tokens=max(16, policy.flush))
    spec.register()
    B = len(offsets)
    store = KVStore(spec, B)
    store.set_rope_offsets(list(offsets))
    rd = rd or D
    for n in chunks:
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        k[..., 3] *= 8
        r = torch.tensor(store.lengths).view(B, 1) + torch.arange(n) + torch.tensor(offsets).view(B, 1)
        cos, sin = _cos_sin(r.clamp(min=0), rd)
        store.write_keys(True)
        store.capture_rope(cos[:, None], sin[:, None], "half", n)
        store.append(k, v)
        yield store, k, v


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.key_str())
def test_cpu_and_inductor_kernels_equal_the_reference_on_pre_rope_keys(policy):
    g = torch.Generator().manual_seed(1)
    for store, k, v in _pre_rope_store(policy, rd=48 if policy.sink else None):
        spec, rope = store.spec, store.rope()
        assert rope is not None
        B, H, n, D = k.shape
        for G in (1, 3):
            q = torch.randn(B, H * G, n, D, generator=g)
            want = attention_reference(q, store.state, spec, None, None, k_new=k, v_new=v, rope=rope).double()
            fam = cpu.attention if cpu.check_decode(q, spec) is None else kprefill.prefill_attention
            assert_close(fam(q, store.state, spec, None, None, k_new=k, v_new=v, rope=rope), want, TOL, spec.name)
            assert_close(inductor.attention(q, store.state, spec, None, None, k_new=k, v_new=v, rope=rope), want, TOL,
                         spec.name)
        # the rotation matters: without it the reference differs
        assert not torch.allclose(attention_reference(q, store.state, spec, None, None, k_new=k, v_new=v),
                                  want.float(), atol=1e-3)


def test_decode_kernel_splits_and_masks_on_pre_rope_keys():
    policy = POLICIES[0]
    *_, (store, k, v) = _pre_rope_store(policy, chunks=(70, 1))
    spec, rope = store.spec, store.rope()
    B, H, n, D = k.shape
    q = torch.randn(B, 2 * H, n, D)
    mask = torch.rand(B, 1, n, 75) > 0.3
    want = attention_reference(q, store.state, spec, mask, 0.2, k_new=k, v_new=v, rope=rope).double()
    for nsplit in (1, 3, 7):
        assert_close(cpu.attention(q, store.state, spec, mask, 0.2, nsplit=nsplit, k_new=k, v_new=v, rope=rope),
                     want, TOL, spec.name)


# The decode kernel rotates keys with contiguous vectors for the "half" and "pairs" forms (whole head, or rotary
# dims a multiple of 8 channels per half / in all), an indexed loop for the rest: each equals apply_rope exactly.
ROPE_FORMS = [("half", 64), ("half", 48), ("half", 20), ("pairs", 64), ("pairs", 40), ("pairs", 6), ("reversed", 64)]


@pytest.mark.parametrize("form,rd", ROPE_FORMS)
def test_decode_kernel_rotates_keys_as_apply_rope_bit_for_bit(form, rd):
    D, T, N = 64, 40, 50
    g = torch.Generator().manual_seed(rd)
    if form == "reversed":  # no form the kernel knows: a partner permutation it takes as given
        perm, sign = list(range(D - 1, -1, -1)), [1.0 if d % 3 else -1.0 for d in range(D)]
    else:
        perm, sign = rope_pairing(form, rd, D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cos[:, :rd] = torch.randn(T, rd, generator=g)
    sin[:, :rd] = torch.randn(T, rd, generator=g) * torch.tensor(sign[:rd])
    rope = Rope(cos, sin, torch.tensor(perm, dtype=torch.int32), torch.tensor([0, -3], dtype=torch.int32))
    k = torch.randn(N, D, generator=g) * torch.logspace(-3, 3, D)  # rows past the table and pads: clamped
    spec = LayerSpec(Policy(pre_rope=True), 2, D)
    spec.register()
    for b, p0 in ((0, 5), (1, 0)):
        want = apply_rope(k.expand(2, 1, N, D), rope, torch.arange(p0, p0 + N))[b, 0]
        assert torch.equal(cpu.rope_rows(k, spec, rope, p0=p0, b=b), want)


@pytest.mark.parametrize("policy", [Policy.kivi(2, group=16, residual=8, pre_rope=True),
                                    Policy(Quant("int3", "channel", 16), Quant("int8", "token"), residual=3,
                                           pre_rope=True),
                                    Policy(Quant("int4", "token", 16), Quant("int4", "token", 32), pre_rope=True),
                                    Policy(Quant("int2", "token", 8, symmetric=True), Quant("int8", "token"),
                                           pre_rope=True)],
                         ids=lambda p: p.key_str())
def test_decode_kernel_dequantizes_pre_rope_keys_in_natural_order_bit_for_bit(policy):
    """Pre-RoPE keys are unpacked in natural channel order (rotated in it): the same values as the plane order
    the kernel reads post-RoPE keys in, and as the reference."""
    *_, (store, k, v) = _pre_rope_store(policy, H=2, offsets=(0,), chunks=(150,))
    spec, st_ = store.spec, store.state
    ref, _ = dequantize_reference(st_, spec, torch.float32, rotated=True)
    S, packed = spec.sink, spec.boundary(store.lengths[0]) - spec.sink
    order = cpu.plane_order(spec)
    assert packed > spec.block
    for j in range(spec.blocks_for(store.lengths[0])):
        blk, n = int(st_.table[0, j]), min(spec.block, packed - j * spec.block)
        for h in range(2):
            nat = cpu.dequant_keys(st_, spec, blk, h, natural=True)
            assert torch.equal(nat[:, order], cpu.dequant_keys(st_, spec, blk, h, natural=False))
            assert torch.equal(nat[:n], ref[0, h, S + j * spec.block:S + j * spec.block + n])


# --------------------------------------------------------------------------- the compiled model
def tiny(layers=2, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      attn_implementation="sdpa", **kw)
    return LlamaForCausalLM(cfg).eval()


def _gen(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def applied_full():
    ref = tiny()
    m = copy.deepcopy(ref)
    kvcompile.apply(m, Policy(pre_rope=True), compiler="eager")
    return ref, m


@pytest.mark.slow
def test_full_precision_pre_rope_equals_the_unmodified_model_left_padded(applied_full):
    ref, m = applied_full
    ids = torch.randint(1, 64, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :1] = 0
    a, b = _gen(m, ids, mask, max_new_tokens=8), _gen(ref, ids, mask, max_new_tokens=8)
    assert a.sequences.tolist() == b.sequences.tolist()
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert "keys pre-RoPE (half:16)" in str(kvcompile.explain(m))


@pytest.mark.slow
def test_full_precision_pre_rope_beam_search_and_crop(applied_full):
    ref, m = applied_full
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    a = _gen(m, ids, mask, max_new_tokens=5, num_beams=3, num_return_sequences=2)
    b = _gen(ref, ids, mask, max_new_tokens=5, num_beams=3, num_return_sequences=2)
    assert a.sequences.tolist() == b.sequences.tolist()
    # crop (speculative decoding's rewind): decode, drop two tokens, decode them again
    seq = torch.randint(1, 64, (1, 12))
    with torch.no_grad():
        want = ref(seq).logits
        out = m(seq[:, :8], use_cache=True)
        cache = out.past_key_values
        m(seq[:, 8:10], past_key_values=cache, use_cache=True)
        cache.crop(8)
        got = m(seq[:, 8:12], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, want[:, 8:12], rtol=1e-5, atol=1e-5)
    # the cache's bytes count its cos/sin table: one fp32 cos and sin row (and a flag) per position held
    table = next(layer.rope_table for layer in cache.layers if getattr(layer, "rope_table", None) is not None)
    D = table.cos.shape[1]
    assert table.nbytes == 12 * (2 * 4 * D + 1)
    assert cache.nbytes == sum(layer.nbytes for layer in cache.layers) + table.nbytes
    assert cache.reserved_nbytes >= sum(layer.reserved_nbytes for layer in cache.layers) + table.nbytes


@pytest.mark.slow
def test_quantized_pre_rope_compiled_equals_the_reference_kernels():
    """The compiled model on the C kernels against the same model on the reference kernels (both pre-RoPE), and
    both away from post-RoPE storage (the keys are stored otherwise)."""
    pol = Policy.kivi(2, group=16, residual=4, sink=1, pre_rope=True)
    ids = torch.randint(1, 64, (2, 40))
    outs = {}
    for kern, p in (("cpu", pol), ("reference", pol), ("cpu", Policy.kivi(2, group=16, residual=4, sink=1))):
        m = tiny()
        kvcompile.apply(m, p, compiler="eager")
        kvcompile.ops.set_kernels(kern)
        try:
            with torch.no_grad():
                cache = m(ids[:, :30], use_cache=True).past_key_values
                outs[(kern, p.pre_rope)] = torch.cat([m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                                                      for t in range(30, 40)], 1)
        finally:
            kvcompile.ops.set_kernels("auto")
    torch.testing.assert_close(outs[("cpu", True)], outs[("reference", True)], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[("cpu", True)], outs[("cpu", False)], atol=1e-4)


def test_a_rotary_form_the_pass_does_not_know_keeps_post_rope_keys_and_explain_says_so():
    """The zoo's decoder has no rotary embedding: a pre_rope policy stores the keys written, exactly the
    post-RoPE store's results (no Hadamard on keys either way here), and explain names the layers."""
    torch.manual_seed(0)
    model = zoo.Decoder("index_copy_", "repeat_kv", "bool", layers=2, dim=32, heads=4, kv_heads=2).eval()
    post = Policy(Quant("int4", "channel", 4), Quant("int4", "token"), residual=2)
    pol = dataclasses.replace(post, pre_rope=True)
    ref = zoo.reference(model, post)
    tokens = torch.randint(0, 64, (1, 10))
    compiled = kvcompile.apply(copy.deepcopy(model), pol, compiler="eager")
    with torch.no_grad():
        torch.testing.assert_close(zoo.run(compiled, tokens, 5), zoo.run(ref, tokens, 5))
    ex = kvcompile.explain(copy.deepcopy(model), tokens[:, :5], torch.arange(5), policy=pol)
    assert len([n for n in ex.notes if "keys stored post-RoPE" in n]) == 2, str(ex)


def test_paths_that_cannot_store_pre_rope_keys_refuse():
    from kvcompile.hf import KVCompileCache
    m = tiny()
    cache = KVCompileCache(m.config, Policy(pre_rope=True))
    with pytest.raises(RopeError, match="only the compiled model"):
        m(torch.randint(1, 64, (1, 4)), past_key_values=cache, use_cache=True)
    dyn = tiny(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(PolicyError, match="dynamic"):
        kvcompile.apply(dyn, Policy(pre_rope=True), compiler="eager")


# --------------------------------------------------------------------------- gpt-fast's rotary form ("pairs")
def _gpt_fast(complex_rope=False, heads_first=False):
    """examples/gpt_fast_model.py loaded afresh (its apply_rotary_emb optionally replaced by Meta Llama's
    view_as_complex form, which the pass does not match; or applied after the transpose to [B, H, n, D])."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "gpt_fast_model.py")
    spec = importlib.util.spec_from_file_location("gpt_fast_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpt_fast_model"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    if complex_rope:
        def apply_rotary_emb(x, freqs_cis):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            fc = torch.view_as_complex(freqs_cis.contiguous()).view(1, xc.size(1), 1, xc.size(3))
            return torch.view_as_real(xc * fc).flatten(3).type_as(x)
        mod.apply_rotary_emb = apply_rotary_emb
    if heads_first:
        def rope_heads_first(x, freqs_cis):  # gpt-fast's formula on [B, H, n, D]
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
            fc = freqs_cis.view(1, 1, xs.size(2), xs.size(3), 2)
            out = torch.stack([xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
                               xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1]], -1)
            return out.flatten(3).type_as(x)

        def forward(self, x, freqs_cis, mask, input_pos):
            a, (B, S, _) = self.a, x.shape
            kv = a.n_local_heads * a.head_dim
            q, k, v = (t.view(B, S, -1, a.head_dim).transpose(1, 2)
                       for t in self.wqkv(x).split([a.dim, kv, kv], dim=-1))
            q, k = rope_heads_first(q, freqs_cis), rope_heads_first(k, freqs_cis)
            k, v = self.kv_cache.update(input_pos, k, v)
            g = a.n_head // a.n_local_heads
            y = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1),
                                                                 v.repeat_interleave(g, dim=1), attn_mask=mask)
            return self.wo(y.transpose(1, 2).contiguous().view(B, S, a.dim))
        mod.Attention.forward = forward
    return mod


def _gpt_fast_pair(gf, batch=2, seed=0):
    torch.manual_seed(seed)
    args = gf.ModelArgs(vocab_size=64, dim=64, n_head=4, n_local_heads=2, intermediate_size=64)  # head_dim 16
    ref = gf.Transformer(args).eval()
    ref.setup_caches(batch, 48)
    return ref, copy.deepcopy(ref)


def _gpt_fast_run(model, ids, steps, seed=1):
    """Prefill ``ids`` at positions 0..T-1, then ``steps`` decode steps of fixed random tokens: the logits."""
    g = torch.Generator().manual_seed(seed)
    B, T = ids.shape
    with torch.no_grad():
        out = [model(ids, torch.arange(T))]
        for t in range(T, T + steps):
            out.append(model(torch.randint(0, 64, (B, 1), generator=g), torch.tensor([t])))
    return torch.cat(out, 1)


@pytest.mark.parametrize("heads_first", slow_after(1, [False, True]), ids=["gpt-fast", "heads-first"])
def test_gpt_fast_full_precision_pre_rope_equals_the_unmodified_model(heads_first):
    """gpt-fast's apply_rotary_emb (complex multiply of adjacent pairs, in fp32, before the transpose; or the
    same after it) is recognised: keys are stored pre-RoPE ("pairs"), their rotation by the captured cos/sin
    equals the model's rotated keys bit for bit, and the logits equal the unmodified model's within fp32
    rounding (attention itself is computed by other kernels)."""
    from kvcompile import standin
    gf = _gpt_fast(heads_first=heads_first)
    ref, m = _gpt_fast_pair(gf)
    compiled = kvcompile.apply(m, Policy(pre_rope=True), compiler="eager")
    ids = torch.randint(0, 64, (2, 11))
    got, want = _gpt_fast_run(compiled, ids, 6), _gpt_fast_run(ref, ids, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ex = kvcompile.explain(m)
    assert [s.keys for s in ex.sites] == ["pre-RoPE (pairs:16)"] * 2, str(ex)
    assert "keys pre-RoPE (pairs:16)" in str(ex) and not ex.notes
    n = 11 + 6
    for i, (layer, rl) in enumerate(zip(m.layers, ref.layers)):
        st = standin.lookup(layer.attention.kv_cache.k_cache).store
        assert st.rope_keys and st.lengths == [n, n]
        k, _ = dequantize_reference(st.state, st.spec, torch.float32)  # full precision: the keys as written
        rotated = apply_rope(k, st.rope(), torch.arange(n))
        # gpt-fast's own rotation of these keys, on [B, n, H, D] as the model applies it
        own = gf.apply_rotary_emb(k.transpose(1, 2), ref.freqs_cis[:n]).transpose(1, 2)
        assert torch.equal(rotated, own) and not torch.equal(k, rotated)
        if i == 0:  # the first layer's keys do not depend on attention: the unmodified model's cache itself
            assert torch.equal(rotated, rl.attention.kv_cache.k_cache[:, :, :n])
    # gpt-fast starts the next prompt at position 0 again over the same caches: the same answer
    torch.testing.assert_close(_gpt_fast_run(compiled, ids, 6), got, rtol=0, atol=0)


def test_gpt_fast_quantized_pre_rope_c_kernels_equal_the_reference_kernels():
    """The compiled gpt-fast model with a quantized pre_rope policy on the C kernels against the same on the
    reference kernels (both "pairs" pre-RoPE), and both away from post-RoPE storage."""
    gf = _gpt_fast()
    pol = Policy.kivi(2, group=16, residual=4, sink=1, pre_rope=True)
    ids = torch.randint(0, 64, (2, 30))
    outs = {}
    for kern, p in (("cpu", pol), ("reference", pol), ("cpu", Policy.kivi(2, group=16, residual=4, sink=1))):
        _, m = _gpt_fast_pair(gf)
        compiled = kvcompile.apply(m, p, compiler="eager")
        kvcompile.ops.set_kernels(kern)
        try:
            outs[(kern, p.pre_rope)] = _gpt_fast_run(compiled, ids, 10)[:, 30:]
        finally:
            kvcompile.ops.set_kernels("auto")
        keys = [s.keys for s in kvcompile.explain(m).sites]
        assert keys == (["pre-RoPE (pairs:16)"] * 2 if p.pre_rope else ["post-RoPE"] * 2)
    torch.testing.assert_close(outs[("cpu", True)], outs[("reference", True)], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[("cpu", True)], outs[("cpu", False)], atol=1e-4)


def test_gpt_fast_view_as_complex_form_keeps_post_rope_keys_and_explain_says_so():
    """Meta Llama's view_as_complex form (a complex product whose rounding the pass does not state) is not
    matched: the pre_rope policy stores the keys written, with the post-RoPE store's results."""
    gf = _gpt_fast(complex_rope=True)
    ref, m = _gpt_fast_pair(gf)
    compiled = kvcompile.apply(m, Policy(pre_rope=True), compiler="eager")
    ids = torch.randint(0, 64, (2, 7))
    torch.testing.assert_close(_gpt_fast_run(compiled, ids, 3), _gpt_fast_run(ref, ids, 3), rtol=1e-5, atol=1e-5)
    ex = kvcompile.explain(m)
    assert [s.keys for s in ex.sites] == ["post-RoPE"] * 2
    notes = [n for n in ex.notes if "keys stored post-RoPE" in n]
    assert len(notes) == 2 and all("not a rotary embedding the pass recognises" in n for n in notes), str(ex)
