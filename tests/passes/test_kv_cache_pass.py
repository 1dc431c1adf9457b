"""The KV-cache pass on the zoo of cache modules and on the gpt-fast-style example.

Compiled results are compared with the eager reference (the same model whose caches go through the
reference store and are read back dequantized) at fp32 rounding: ``assert_close``'s fp32 defaults.

Why only the first layer is quantized where logits are compared: the two paths sum attention in different
orders (kvcompile's attention vs SDPA over the dequantized view), so layer 1's output differs in the last
bits, and layer 2's keys with it. A last-bit difference can move a value across a rounding boundary of the
quantizer and change one code by one step (seen: int4, seed 0, a 1.6e-5 logit difference from position 7
on). That is fp32 rounding amplified by a discontinuous quantizer, not a wrong rewrite, but no fp32-rounding
bound covers it. So: logits are compared where every quantized layer sees identical inputs (the first
layer; later layers in full precision but still rewritten), and with every layer quantized the packed codes
of the first layer are compared exactly and the greedy tokens must agree.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch.nn.functional as F

import kvcompile
import zoo
from kvcompile import KVCompileError, Policy, Quant
from kvcompile.errors import UnsupportedError
from kvcompile.passes import analyze, counters

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICY = Policy.kivi(4, group=4, residual=4)
FIRST = Policy.full().override({0: POLICY})  # quantize layer 0 only: logits comparable at fp32 rounding

# Every write idiom, GQA style and mask style appears; each row is one compile of a 2-layer model (~1 s).
ZOO = [
    ("setitem", "repeat_interleave", "bool", 2),
    ("setitem", "repeat_kv", "float", 1),
    ("setitem", "enable_gqa", "bool", 4),
    ("index_put_", "repeat_kv", "bool", 2),
    ("index_put_", "enable_gqa", "float", 2),
    ("index_copy_", "repeat_interleave", "float", 4),
    ("index_copy_", "repeat_kv", "bool", 4),
    ("slice", "enable_gqa", "bool", 2),
    ("slice", "repeat_interleave", "float", 2),
]


@pytest.mark.parametrize("write,gqa,mask,ratio", ZOO)
def test_zoo_compiled_equals_reference(write, gqa, mask, ratio):
    torch.manual_seed(0)
    model = zoo.Decoder(write, gqa, mask, layers=2, dim=32, heads=4, kv_heads=4 // ratio).eval()
    ref = zoo.reference(model, FIRST)
    tokens = torch.randint(0, 64, (1, 10))
    compiled = kvcompile.apply(model, FIRST, compiler="eager")
    with torch.no_grad():
        out, want = zoo.run(compiled, tokens, 5), zoo.run(ref, tokens, 5)
    torch.testing.assert_close(out, want)
    # prefill + decode graph, each rewriting both layers; no recompile as the position advances
    assert len(model._kvcompile.reports) == 2
    assert counters[f"write_{write}"] == 2 * 2 * 2  # 2 graphs x 2 layers x (keys, values)
    assert counters["stores_inserted"] == counters["attention_rewritten"] == 4
    assert counters["checked_fused"] == 4
    style = "none" if ratio == 1 and gqa != "enable_gqa" else gqa
    if ratio == 1 and gqa == "enable_gqa":
        style = "enable_gqa"
    assert counters[f"gqa_{style}"] == 4
    assert not dynamo_utils.counters["graph_break"]


def test_policy_full_equals_unmodified_model():
    torch.manual_seed(1)
    model = zoo.Decoder("setitem", "repeat_interleave", "bool").eval()
    plain = zoo.Decoder("setitem", "repeat_interleave", "bool").eval()
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (1, 9))
    compiled = kvcompile.apply(model, Policy.full(), compiler="eager")
    with torch.no_grad():
        torch.testing.assert_close(zoo.run(compiled, tokens, 4), zoo.run(plain, tokens, 4))


def test_per_layer_policy_reaches_the_right_layer():
    torch.manual_seed(2)
    pol = Policy.int8().override({1: Policy.kivi(2, group=4, residual=0), "attn.0": None})
    model = zoo.Decoder("index_copy_", "repeat_kv", "bool", layers=3).eval()
    compiled = kvcompile.apply(model, pol, compiler="eager")
    with torch.no_grad():
        zoo.run(compiled, torch.randint(0, 64, (1, 8)), 8)
    ex = kvcompile.explain(model)
    assert [s.layer for s in ex.sites] == ["attn.0.cache", "attn.1.cache", "attn.2.cache"]
    assert [s.policy.split(";")[0] for s in ex.sites] == ["k=none", "k=int2.channel.4.asym.f16",
                                                          "k=int8.token.head.asym.f16"]
    assert max(ex.sites[1].bytes_per_token, ex.sites[2].bytes_per_token) < ex.sites[0].bytes_per_token


def test_every_layer_quantized_first_layer_codes_exact_and_same_greedy_tokens():
    from kvcompile import standin

    torch.manual_seed(3)
    model = zoo.Decoder("setitem", "repeat_interleave", "bool", layers=3).eval()
    ref = zoo.reference(model, POLICY)
    tokens = torch.randint(0, 64, (1, 12))
    compiled = kvcompile.apply(model, POLICY, compiler="eager")
    with torch.no_grad():
        out, want = zoo.run(compiled, tokens, 5), zoo.run(ref, tokens, 5)
    assert torch.equal(out.argmax(-1), want.argmax(-1))
    got = standin.lookup(model.attn[0].cache.k_cache).store.state
    for a, b in zip(got, ref.attn[0].cache.kv.state):
        assert torch.equal(a, b)
    for layer in model.attn:
        assert standin.lookup(layer.cache.k_cache).store.state.lengths.tolist() == [12]


# --------------------------------------------------------------------------- what analyze finds and skips
def _dynamo_graph(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def _cache(B=1, H=2, C=16, D=8):
    return torch.zeros(B, H, C, D), torch.zeros(B, H, C, D)


def test_analyze_skips_a_maskless_read_with_the_reason():
    kc, vc = _cache()

    def f(q, k, v, pos):
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        return F.scaled_dot_product_attention(q, kc, vc)

    x = torch.randn(1, 2, 3, 8)
    a = analyze(_dynamo_graph(f, x, x, x, torch.arange(3)))
    assert a.reads_found == 1 and not a.sites
    assert "no attn_mask" in a.skipped[0].reason
    assert counters["reads_skipped"] == 1


def test_analyze_reads_a_causal_prefix_only_over_the_query_length():
    """``SDPA(q, cache[:, :, :n], ..., is_causal=True)`` with n queries is transformers' prefill shortcut over an
    empty static cache (passes/kv_cache.py, CAUSAL_PREFIX): a site. A slice of another length is not."""
    for extra, found in ((0, True), (2, False)):
        kc, vc = _cache()

        def f(q, k, v, pos):
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            n = q.shape[2] + extra
            return F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], is_causal=True, enable_gqa=True)

        q, x = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        a = analyze(_dynamo_graph(f, q, x, x, torch.arange(3)))
        if found:
            assert len(a.sites) == 1 and a.sites[0].causal_prefix and a.sites[0].repeat == "enable_gqa"
        else:
            assert not a.sites and "is_causal=True over a cache longer than the query" in a.skipped[0].reason


@pytest.mark.parametrize("policy, counter", [(Policy.int8(residual=64), "mask_causal_prefix"),
                                             (Policy.full(), "exact_causal_prefix")], ids=["int8-window", "full"])
def test_causal_prefix_read_is_rewritten_with_the_mask_it_stands_for(policy, counter):
    """The rewritten read equals SDPA over the slice exactly: also on a second call, where the slice holds the
    first call's tokens (what the original graph reads), not the new ones. (int8 with a window longer than the
    tokens: kvcompile's attention with the causal mask, over full-precision values; Policy.full(): the graph's
    own SDPA over the slice of ``exact_view``.)"""
    def make(kc, vc):
        def f(q, k, v, pos):
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            n = q.shape[2]
            return F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], is_causal=True, enable_gqa=True)
        return f

    torch.manual_seed(4)
    eager = make(*_cache())
    compiled = torch.compile(make(*_cache()), backend="kvcompile", fullgraph=True,
                             options={"policy": policy, "compiler": "eager"})
    for start in (0, 3):
        q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        pos = torch.arange(start, start + 3)
        torch.testing.assert_close(compiled(q, k, v, pos), eager(q, k, v, pos))
    assert counters[counter] == 1 and counters["graphs_rewritten"] == 1


def test_analyze_pairs_a_read_only_with_its_queries_own_chunk():
    """kvcompile's attention reads the queries' own tokens from what the layer writes, so the write must be
    the chunk of those queries; a read by the last query only, after writing three tokens, is left alone."""
    for last_only in (False, True):
        kc, vc = _cache()
        mask = torch.ones(1, 1, 3, 16, dtype=torch.bool)

        def f(q, k, v, pos):
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            qq = q[:, :, -1:] if last_only else q
            return F.scaled_dot_product_attention(qq, kc, vc, attn_mask=mask[:, :, -qq.shape[2]:])

        x = torch.randn(1, 2, 3, 8)
        a = analyze(_dynamo_graph(f, x, x, x, torch.arange(3)))
        if last_only:
            assert not a.sites and "are not the 1 queries' own [1, 2, n, 8] chunk" in a.skipped[0].reason
        else:
            assert len(a.sites) == 1


def test_analyze_skips_a_tiled_gqa_layout():
    kc, vc = _cache()
    mask = torch.ones(1, 1, 3, 16, dtype=torch.bool)

    def f(q, k, v, pos):
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        # .repeat tiles heads (h -> h % H), not kvcompile's consecutive layout (h -> h // n): left alone
        return F.scaled_dot_product_attention(q, kc.repeat(1, 2, 1, 1), vc.repeat(1, 2, 1, 1), attn_mask=mask)

    q, x = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    a = analyze(_dynamo_graph(f, q, x, x, torch.arange(3)))
    assert not a.sites and "repeat" in a.skipped[0].reason


def test_analyze_finds_a_write_with_no_read():
    kc, vc = _cache()

    def f(q, k, v, pos):
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, k, v)  # attends over the new tokens only

    x = torch.randn(1, 2, 3, 8)
    a = analyze(_dynamo_graph(f, x, x, x, torch.arange(3)))
    assert not a.sites and len(a.unpaired_writes) == 2
    assert "no scaled_dot_product_attention reads it" in a.unpaired_writes[0].reason


# --------------------------------------------------------------------------- errors a user can hit
class _ManualAttention(zoo.Attention):
    def forward(self, x, input_pos, start, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2 * self.kvh, self.d).transpose(1, 2).chunk(2, dim=1)
        k, v = self.cache.update(input_pos, start, k, v)
        s = (q @ zoo.repeat_kv(k, self.h // self.kvh).transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        y = torch.softmax(s / self.d ** 0.5, -1) @ zoo.repeat_kv(v, self.h // self.kvh)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class _UnreadCache(zoo.Attention):
    def forward(self, x, input_pos, start, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2 * self.kvh, self.d).transpose(1, 2).chunk(2, dim=1)
        self.cache.update(input_pos, start, k, v)
        y = F.scaled_dot_product_attention(q, zoo.repeat_kv(k, 2), zoo.repeat_kv(v, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


def _with_attention(cls):
    model = zoo.Decoder("setitem", "repeat_kv", "bool").eval()
    for i, a in enumerate(model.attn):
        new = cls(32, 4, 2, "repeat_kv", "bool")
        new.load_state_dict(a.state_dict(), strict=False)
        new.cache = a.cache
        model.attn[i] = new
    return model


def test_error_no_sdpa_read_says_what_was_found():
    model = kvcompile.apply(_with_attention(_ManualAttention), POLICY, compiler="eager")
    with pytest.raises(UnsupportedError, match=r"no scaled_dot_product_attention read found.*(matmul|softmax)") as e:
        zoo.run(model, torch.randint(0, 64, (1, 4)), 4)
    assert type(e.value) is UnsupportedError  # found while compiling, raised as itself (not Dynamo's wrapper)
    with pytest.raises(UnsupportedError, match=r"no scaled_dot_product_attention read found") as e:  # so is explain
        kvcompile.explain(_with_attention(_ManualAttention), torch.randint(0, 64, (1, 4)), torch.arange(4),
                          policy=POLICY)
    assert type(e.value) is UnsupportedError


def test_error_write_that_cannot_be_paired_with_a_read():
    model = kvcompile.apply(_with_attention(_UnreadCache), POLICY, compiler="eager")
    with pytest.raises(UnsupportedError, match=r"cannot pair its write with an attention read") as e:
        zoo.run(model, torch.randint(0, 64, (1, 4)), 4)
    assert type(e.value) is UnsupportedError


def test_error_unsupported_model_dtype_for_kernels():
    model = zoo.Decoder(dtype=torch.float64)
    with pytest.raises(KVCompileError, match="float64 has no kvcompile kernel format"):
        kvcompile.apply(model, POLICY)


def test_error_unsupported_format_for_triton_kernels(monkeypatch):
    import kvcompile.templates.launch  # noqa: F401  (Triton is a dependency: its absence must fail, not skip)
    from kvcompile import ops

    monkeypatch.setattr(ops, "_KERNELS", "triton")  # what KVCOMPILE_KERNELS=triton selects
    model = zoo.Decoder(dim=4 * 512, heads=4, kv_heads=2, capacity=8, vocab=8)  # head_dim 512 > the kernels' 256
    with pytest.raises(KVCompileError, match=r"Triton kernels do not support the layout .*head_dim"):
        kvcompile.apply(model, Policy(Quant("int8"), Quant("int8")))


def test_error_apply_twice_and_apply_to_compiled():
    model = zoo.Decoder()
    compiled = kvcompile.apply(model, POLICY, compiler="eager")
    with pytest.raises(KVCompileError, match="already applied"):
        kvcompile.apply(model, POLICY)
    with pytest.raises(KVCompileError, match="already applied|already compiled"):
        kvcompile.apply(compiled, POLICY)
    with pytest.raises(KVCompileError, match="already compiled"):
        kvcompile.apply(torch.compile(zoo.Decoder()), POLICY)


def test_error_group_that_does_not_divide_head_dim():
    model = zoo.Decoder(dim=4 * 24)  # head_dim 24
    with pytest.raises(kvcompile.PolicyError, match="group=16 does not divide head_dim=24"):
        kvcompile.apply(model, Policy(Quant("int4", "token", 16), Quant("int4", "token", 16)))


def test_error_sequence_longer_than_capacity():
    model = zoo.Decoder(capacity=8)
    model.causal = torch.tril(torch.ones(16, 8, dtype=torch.bool))  # mask rows past the capacity: the store fails
    model = kvcompile.apply(model, Policy.int8(), compiler="eager")
    with pytest.raises(kvcompile.CapacityError, match="KV cache overflow") as e:
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 6)), torch.arange(6), 0)
            model(torch.randint(0, 64, (1, 3)), torch.arange(6, 9), 6)
    assert type(e.value) is kvcompile.CapacityError


# --------------------------------------------------------------------------- the gpt-fast-style example
def _example():
    spec = importlib.util.spec_from_file_location("gpt_fast_model", ROOT / "examples" / "gpt_fast_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpt_fast_model"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gpt_fast_example_generates_like_the_reference():
    gf = _example()
    torch.manual_seed(0)
    args = gf.ModelArgs(vocab_size=64, dim=32, n_head=4, n_local_heads=2, intermediate_size=64)
    model = gf.Transformer(args).eval()
    ref = gf.Transformer(args).eval()
    ref.load_state_dict(model.state_dict())
    model.setup_caches(1, 32)
    ref.setup_caches(1, 32)
    for b in ref.layers:  # the eager reference: caches through the reference store
        kv = kvcompile.QuantizedKV(POLICY, 1, 2, 32, 8)
        b.attention.kv_cache = _RefKV(kv)
    compiled = kvcompile.apply(model, POLICY, compiler="eager")
    prompt = torch.randint(0, 64, (1, 7))
    out = gf.generate(compiled, prompt, 6)
    assert torch.equal(out, gf.generate(ref, prompt, 6))
    assert counters["write_setitem"] == 2 * 2 * 2 and counters["gqa_repeat_interleave"] == 4
    assert len(model._kvcompile.reports) == 2
    # gpt-fast reuses its caches for the next prompt (writes start at position 0 again): same answer
    assert torch.equal(gf.generate(compiled, prompt, 6), out)


class _RefKV(torch.nn.Module):
    def __init__(self, kv):
        super().__init__()
        self.kv = kv

    def update(self, input_pos, k, v):
        if int(input_pos[0]) == 0:
            self.kv.reset()
        self.kv.append(k, v)
        return self.kv.dequantized(k.dtype, end=32)  # the buffers' width, as the model's mask


def test_gpt_fast_example_main_runs(capsys):
    _example().main()
    out = capsys.readouterr().out
    assert "2 cache site(s) rewritten" in out and "kvcompile" in out
