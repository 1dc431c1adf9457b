"""kvcompile.apply / explain / the "kvcompile" backend on tiny Hugging Face Llamas (random weights).

The eager reference is the unmodified model with a ``KVCompileCache`` passed in: its ``update`` stores through
the reference store and returns the dequantized cache, which the model's own SDPA reads. Logits must equal it
at fp32 rounding (``assert_close``'s fp32 defaults) wherever every quantized layer sees identical inputs --
see tests/passes/test_kv_cache_pass.py for why layers after the first one are kept in full precision there.
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from hypothesis import assume, given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, StaticCache

import kvcompile
from kvcompile import CapacityError, KVCompileError, Policy, PolicyError, Quant
from kvcompile.errors import UnsupportedError
from kvcompile.hf_model import cache_kwarg as _cache_kwarg
from kvcompile.hf import KVCompileCache
from kvcompile import standin
from kvcompile.store import KVStore, LayerSpec
from kvcompile.passes import counters
import profiles
from tiers import slow_after

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def tiny(layers=2, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      attn_implementation="sdpa", **kw)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def twin(model):
    other = LlamaForCausalLM(model.config).to(next(model.parameters()).dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


def chunks(model, ids, prefill, cache=None):
    """Logits of a prefill then one-token steps, passing the returned cache back each time."""
    kw = _cache_kwarg(model)
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True, **({kw: cache} if cache is not None else {}))
        logits, cache = [out.logits], cache_of(out)
        for p in range(prefill, ids.shape[1]):
            out = model(ids[:, p:p + 1], use_cache=True, **{kw: cache})
            logits.append(out.logits)
            cache = cache_of(out)
    return torch.cat(logits, 1), cache


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    dynamo_utils.counters.clear()
    # The API's wiring is under test, so the ops run the reference on the CPU; the default CPU attention
    # (compiled per store layout) would add a compile per random layout and has its own tests.
    kvcompile.ops.set_kernels("reference")
    yield
    kvcompile.ops.set_kernels("auto")


# --------------------------------------------------------------------------- compiled == eager reference
FORMATS = ("none", "int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2")


@st.composite
def quants(draw):
    fmt = draw(st.sampled_from(FORMATS))
    axis = draw(st.sampled_from(("token", "channel")))
    group = draw(st.sampled_from((None, 4, 8))) if axis == "token" else draw(st.sampled_from((4, 8)))
    sym = draw(st.sampled_from((None, True))) if fmt.startswith("int") else None
    try:
        return Quant(fmt, axis, group, sym)
    except PolicyError:
        assume(False)


@st.composite
def policies(draw):
    return Policy(draw(quants()), draw(quants()), residual=draw(st.sampled_from((0, 3, 8))),
                  sink=draw(st.sampled_from((0, 2))), rotate=draw(st.booleans()))


@profiles.MODEL
@given(policy=policies(), layers=st.integers(1, 2), kv_heads=st.sampled_from((1, 2)), ratio=st.sampled_from((1, 2)),
       head_dim=st.sampled_from((8, 16)), batch=st.integers(1, 2), prefill=st.integers(1, 9),
       steps=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_compiled_equals_eager_reference(policy, layers, kv_heads, ratio, head_dim, batch, prefill, steps, seed):
    torch._dynamo.reset()
    counters.clear()
    policy = Policy.full().override({0: policy})  # quantized layer 0; a second layer is rewritten, full precision
    model = tiny(layers, kv_heads * ratio, kv_heads, head_dim, seed=seed)
    ref = twin(model)
    ids = torch.randint(3, 64, (batch, prefill + steps))
    C = prefill + steps + 4
    want, _ = chunks(ref, ids, prefill, KVCompileCache(ref.config, policy, C))
    applied = kvcompile.apply(model, policy, max_cache_len=C, compiler="eager", prefill="compiled")
    got, cache = chunks(applied, ids, prefill)
    torch.testing.assert_close(got, want)
    assert isinstance(cache, KVCompileCache) and cache.tokens == prefill + steps
    assert counters["attention_rewritten"] == counters["stores_inserted"] == layers * len(applied._kvcompile.reports)


def test_policy_full_equals_the_unmodified_model():
    model = tiny(layers=2)
    plain = twin(model)
    ids = torch.randint(3, 64, (2, 9))
    want, _ = chunks(plain, ids, 5, DynamicCache(config=plain.config))
    got, _ = chunks(kvcompile.apply(model, Policy.full(), max_cache_len=16, compiler="eager", prefill="compiled"), ids, 5)
    assert torch.equal(got, want)  # bit for bit (tests/test_exact.py)


# --------------------------------------------------------------------------- generate
@pytest.mark.slow
def test_generate_greedy_and_sampling_batched_with_left_padding():
    policy = Policy.kivi(4, group=4, residual=4)
    model = tiny(layers=2)
    ref = twin(model)
    ids = torch.randint(3, 64, (3, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ids[2, :1], mask[2, :1] = 0, 0
    kw = _cache_kwarg(model)
    gen = dict(attention_mask=mask, max_new_tokens=8)
    with torch.no_grad():
        want = ref.generate(ids, do_sample=False, **gen, **{kw: KVCompileCache(ref.config, policy, 15)})
        torch.manual_seed(7)
        want_s = ref.generate(ids, do_sample=True, top_k=8, **gen, **{kw: KVCompileCache(ref.config, policy, 15)})
        applied = kvcompile.apply(model, policy, compiler="eager", prefill="compiled")
        got = applied.generate(ids, do_sample=False, **gen)
        torch.manual_seed(7)
        got_s = applied.generate(ids, do_sample=True, top_k=8, **gen)
    assert got.shape == (3, 15)
    assert torch.equal(got, want)
    assert torch.equal(got_s, want_s)
    # one graph for prefill, one for decode: no recompile per step, nor for the second generate's fresh cache
    assert len(applied._kvcompile.reports) == 2
    assert not dynamo_utils.counters["graph_break"]


@pytest.mark.slow
def test_generate_continues_a_conversation_in_the_same_cache():
    """Multi-turn use: a second generate over the first turn's output plus new tokens, with the same cache,
    prefills only the new tokens and equals the reference cache used the same way."""
    model = tiny()
    ref = twin(model)
    policy = Policy.full().override({0: Policy.kivi(4, group=4, residual=4)})
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    first, more = torch.randint(3, 64, (1, 9)), torch.randint(3, 64, (1, 5))
    kw = _cache_kwarg(model)
    with torch.no_grad():
        rc = KVCompileCache(ref.config, policy, 64)
        w1 = ref.generate(first, **gen, **{kw: rc})
        w2 = ref.generate(torch.cat([w1.sequences, more], 1), **gen, **{kw: rc})
        applied = kvcompile.apply(model, policy, compiler="eager", prefill="compiled")
        cache = KVCompileCache(model.config, policy, 64)
        g1 = applied.generate(first, **gen, **{kw: cache})
        g2 = applied.generate(torch.cat([g1.sequences, more], 1), **gen, **{kw: cache})
    assert torch.equal(g1.sequences, w1.sequences) and torch.equal(g2.sequences, w2.sequences)
    torch.testing.assert_close(torch.stack(g2.logits), torch.stack(w2.logits))
    assert cache.tokens == rc.tokens == 9 + 6 + 5 + 6 - 1  # the last generated token is never fed back


@pytest.mark.slow
def test_forward_returns_a_cache_that_reports_its_bytes():
    applied = kvcompile.apply(tiny(), Policy.kivi(4, group=4, residual=4), max_cache_len=32, compiler="eager", prefill="compiled")
    with torch.no_grad():
        out = applied(torch.randint(3, 64, (1, 5)), use_cache=True)
    cache = cache_of(out)
    assert isinstance(cache, KVCompileCache)
    allocated = sum(t.untyped_storage().nbytes() for layer in cache.layers
                    for t in (*layer.store.state, layer.keys, layer.values))
    assert cache.reserved_nbytes == allocated > 0
    standins = sum(2 * layer.keys.untyped_storage().nbytes() for layer in cache.layers)
    spec = cache.layers[0].spec  # what the sequences hold: exactly the accounting for their 5 tokens
    assert cache.nbytes == 2 * spec.nbytes(1, 5) + standins <= cache.reserved_nbytes
    with torch.no_grad():  # without a cache nothing is compiled or quantized
        applied(torch.randint(3, 64, (1, 5)), use_cache=False)


# --------------------------------------------------------------------------- memory
def test_memory_4bit_cache_is_under_0_3x_of_bf16_and_no_full_cache_exists():
    B, H, D, C, L = 1, 2, 64, 1024, 2
    model = tiny(layers=L, heads=H, kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    model.config.max_position_embeddings = C
    policy = Policy(Quant("int4"), Quant("int4"))  # one fp16 scale + zero point per token-head
    applied = kvcompile.apply(model, policy, compiler="eager", prefill="compiled")
    with torch.no_grad():
        cache = cache_of(applied(torch.randint(3, 64, (B, C)), use_cache=True))
    bf16 = 2 * L * B * H * C * D * 2
    storages = {}
    for layer in cache.layers:
        for t in (*layer.store.state, layer.keys, layer.values):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    held = sum(storages.values())
    assert held <= 0.3 * bf16, (held, bf16)
    # nothing of a full layer's bf16 size lives anywhere (weights here are far smaller); fake tensors kept in
    # compiled graphs' metadata describe shapes and hold no memory, so they are not counted
    gc.collect()
    big = [tuple(o.shape) for o in gc.get_objects()
           if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.device.type != "meta"
           and o.is_floating_point() and o.untyped_storage().nbytes() >= B * H * C * D * 2]
    assert not big, big


# --------------------------------------------------------------------------- explain and the backend
def test_explain_lists_every_site():
    applied = kvcompile.apply(tiny(layers=2), Policy.kivi(4, group=4, residual=4), max_cache_len=32)
    ex = kvcompile.explain(applied)  # traced for the purpose: nothing compiled or run
    assert [s.layer for s in ex.sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all("index_copy_" in s.write and "sdpa" in s.read and s.memory_saved for s in ex.sites)
    assert all(0 < s.bytes_per_token < s.fp_bytes_per_token for s in ex.sites)
    assert "2 cache site(s) rewritten" in str(ex)


@pytest.mark.slow
def test_backend_option_with_a_kvcompile_cache_equals_reference():
    policy = Policy.int8(residual=2)
    model = tiny()
    ref = twin(model)
    ids = torch.randint(3, 64, (1, 8))
    want, _ = chunks(ref, ids, 5, KVCompileCache(ref.config, policy, 12))
    compiled = torch.compile(model, backend="kvcompile", fullgraph=True,
                             options={"policy": policy, "compiler": "eager"})
    got, cache = chunks(compiled, ids, 5, KVCompileCache(model.config, policy, 12, batch_size=1))
    torch.testing.assert_close(got, want)
    assert counters["attention_rewritten"] == 2 * 2


@pytest.mark.slow
def test_backend_with_a_full_precision_static_cache_quantizes_but_says_memory_is_not_saved():
    policy = Policy.int8(residual=2)
    model = tiny()
    ref = twin(model)
    ids = torch.randint(3, 64, (1, 8))
    want, _ = chunks(ref, ids, 5, KVCompileCache(ref.config, policy, 12))
    static = StaticCache(config=model.config, max_cache_len=12)
    static.early_initialization(1, 2, 8, torch.float32, "cpu")
    compiled = torch.compile(model, backend="kvcompile", fullgraph=True,
                             options={"policy": policy, "compiler": "eager"})
    got, _ = chunks(compiled, ids, 5, static)
    torch.testing.assert_close(got, want)
    fresh = StaticCache(config=model.config, max_cache_len=12)
    fresh.early_initialization(1, 2, 8, torch.float32, "cpu")
    ex = kvcompile.explain(compiled, ids[:, :2], **{_cache_kwarg(model): fresh, "use_cache": True}, policy=policy)
    assert len(ex.sites) == 2 and not any(s.memory_saved for s in ex.sites)
    assert any("still allocated" in n for n in ex.notes)


@pytest.mark.slow
def test_backend_with_a_lazily_initialized_static_cache_allocates_a_standin():
    """A StaticCache allocating on its first update does so inside the compiled graph: the pass rewrites the
    allocation into a stand-in (no full-precision tensor is created) whose store the first write creates, and the
    next call's graph finds it there."""
    policy = Policy.int8(residual=2)
    model = tiny()
    ref = twin(model)
    ids = torch.randint(3, 64, (1, 8))
    want, _ = chunks(ref, ids, 5, KVCompileCache(ref.config, policy, 12))
    static = StaticCache(config=model.config, max_cache_len=12)  # no early_initialization
    compiled = torch.compile(model, backend="kvcompile", fullgraph=True,
                             options={"policy": policy, "compiler": "eager"})
    got, _ = chunks(compiled, ids, 5, static)
    torch.testing.assert_close(got, want)
    assert counters["allocation_standin"] == 2 * 2  # the prefill graph's two layers, keys and values
    assert all(standin.is_standin(layer.keys) and standin.lookup(layer.keys).owned for layer in static.layers)


def test_backend_without_a_policy_says_how_to_pass_one():
    model = tiny()
    static = StaticCache(config=model.config, max_cache_len=12)
    static.early_initialization(1, 2, 8, torch.float32, "cpu")
    compiled = torch.compile(model, backend="kvcompile", fullgraph=True, options={"compiler": "eager"})
    ids = torch.randint(3, 64, (1, 3))
    for _ in range(2):  # twice in a row: the same error, not Dynamo's BackendCompilerFailed around it
        with pytest.raises(PolicyError, match=r"options=\{'policy'") as e:
            compiled(ids, use_cache=True, **{_cache_kwarg(model): static})
        assert type(e.value) is PolicyError
        # its traceback still leads to where compiling found it
        assert "bind" in [f.name for f in e.traceback]


@pytest.mark.slow
def test_eager_graphs_call_kvcompile_functions_without_the_dispatcher():
    """With compiler="eager" the rewritten graph runs as Python and calls ops.PLAIN's functions: the profiler
    sees no kvcompile operator (it does see one called through torch.ops), and the results are the reference's
    (every other test of compiler="eager" checks that)."""
    from torch.profiler import profile
    model = kvcompile.apply(tiny(), Policy.int8(), compiler="eager", prefill="compiled")
    ids = torch.randint(3, 64, (1, 6))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        with profile() as prof:
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        spec = LayerSpec(Policy.int8(), 2, 8, "float32")
        kc = standin.make_standin((1, 2, 16, 8), torch.float32, "cpu")
        vc = standin.make_standin((1, 2, 16, 8), torch.float32, "cpu")
        standin.register(kc, vc, KVStore(spec, 1), "layer", owned=True)
        with profile() as direct:
            torch.ops.kvcompile.store(kc, vc, torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), torch.tensor([0]),
                                      spec.register())
    assert not {e.name for e in prof.events() if e.name.startswith("kvcompile::")}
    assert "kvcompile::store" in {e.name for e in direct.events()}


@pytest.mark.slow
def test_inductor_compiles_the_rest_of_the_graph():
    policy = Policy.full().override({0: Policy.kivi(4, group=4, residual=4)})
    model = tiny(layers=1)
    ref = twin(model)
    ids = torch.randint(3, 64, (1, 7))
    want, _ = chunks(ref, ids, 5, KVCompileCache(ref.config, policy, 12))
    counters.clear()
    got, _ = chunks(kvcompile.apply(model, policy, max_cache_len=12, compiler="inductor"), ids, 5)
    # Inductor compiles the rest of the graph; kvcompile's ops are opaque calls in it (the store is not a
    # graph value, so it grows between calls without a recompile).
    assert counters["attention_op"] >= 1
    # Seen: 6e-8. Inductor fuses the projections, so keys could differ in the last bit and flip a code (see
    # tests/passes); with this seed they do not, and a flip here would be worth a look, not a wider bound.
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_shapes_changing_in_one_process_still_rewrite():
    """Models of other head sizes and cache lengths in one process (no dynamo reset in between): Dynamo
    makes those sizes dynamic for the shared modeling code, and the graph then holds shape queries
    (``size``) on the cache and a symbolic scale. The pass must still pair every write with its read.
    Seen failing before the fix: 'the keys cache ... is also used by size_10 (size)'."""
    policy = Policy.full().override({0: Policy.kivi(4, group=4, residual=4)})
    ids = torch.randint(3, 64, (1, 9))
    for head_dim, cap in ((8, 12), (16, 16), (32, 20), (8, 24)):
        model = tiny(head_dim=head_dim)
        ref = twin(model)
        applied = kvcompile.apply(model, policy, compiler="eager", prefill="compiled")
        want, _ = chunks(ref, ids, 6, KVCompileCache(ref.config, policy, cap))
        got, _ = chunks(applied, ids, 6, KVCompileCache(model.config, policy, cap))
        torch.testing.assert_close(got, want)
    assert counters["reads_skipped"] == 0


@pytest.mark.slow
def test_many_shapes_in_one_process_compile_past_dynamos_default_limit():
    """Each (batch, capacity) is a prefill and a decode graph, shared by every applied model of the class:
    four policies over eight shapes went past the old limit of 64 in the decode benchmark. Five shapes, two
    graphs each (both of the one forward: test_error_recompile_limit_says_what_to_do fails at a limit of 2 on
    the second batch size), go past Dynamo's default of 8 here, with the limit apply sets. (torch's own
    config.patch, not pytest's monkeypatch, which hides the entry for good when undoing it on pytest 9.2.)"""
    with torch._dynamo.config.patch(recompile_limit=8):  # Dynamo's default, as in a fresh process
        applied = kvcompile.apply(tiny(layers=1), Policy.int8(), compiler="eager", prefill="compiled")
        assert torch._dynamo.config.recompile_limit >= 20
        for b in range(1, 6):
            chunks(applied, torch.randint(3, 64, (b, 4)), 3, KVCompileCache(applied.config, Policy.int8(), 4 + b))
    assert len(applied._kvcompile.reports) == 10 > 8


@pytest.mark.slow
def test_error_recompile_limit_says_what_to_do():
    """A user's own lower recompile limit, met by a new batch size (one prefill and one decode graph each;
    new lengths compile nothing)."""
    applied = kvcompile.apply(tiny(layers=1), Policy.int8(), compiler="eager", prefill="compiled")
    with torch._dynamo.config.patch(recompile_limit=2):  # what a user's own setting may be
        chunks(applied, torch.randint(3, 64, (1, 4)), 3, KVCompileCache(applied.config, Policy.int8()))
        chunks(applied, torch.randint(3, 64, (1, 9)), 5, KVCompileCache(applied.config, Policy.int8()))
        with pytest.raises(KVCompileError, match=r"LlamaForCausalLM\.forward under kvcompile.*recompile_limit=2.*"
                                                 r"fewer distinct batch sizes"):
            chunks(applied, torch.randint(3, 64, (3, 4)), 3, KVCompileCache(applied.config, Policy.int8()))


# --------------------------------------------------------------------------- errors
def test_error_override_naming_no_layer():
    with pytest.raises(PolicyError, match="matches none of the 2 attention layers"):
        kvcompile.apply(tiny(), Policy.int8().override({"model.layers.7": None}))


def test_error_group_not_dividing_head_dim():
    with pytest.raises(PolicyError, match="does not divide head_dim=24"):
        kvcompile.apply(tiny(head_dim=24), Policy(Quant("int4", "token", 16), Quant("int4", "token", 16)))


def test_error_model_without_sdpa():
    model = tiny()
    model.config._attn_implementation = "eager"
    with pytest.raises(KVCompileError, match="no scaled_dot_product_attention read"):
        kvcompile.apply(model, Policy.int8())


def test_error_found_while_compiling_reaches_the_caller_as_itself(monkeypatch):
    """A layout the Triton kernels cannot run is found when the first call compiles (binding the layer's store):
    the call raises kvcompile's error as itself, not Dynamo's BackendCompilerFailed around it, and again on the
    next call."""
    monkeypatch.setattr(kvcompile.ops, "_KERNELS", "triton")  # what KVCOMPILE_KERNELS=triton selects
    model = kvcompile.apply(tiny(layers=1, head_dim=512), Policy.int8(), compiler="eager", prefill="compiled")
    for _ in range(2):
        with pytest.raises(UnsupportedError, match=r"Triton kernels do not support the layout .*head_dim") as e:
            with torch.no_grad():
                model(torch.randint(3, 64, (1, 4)), use_cache=True)
        assert type(e.value) is UnsupportedError


def test_error_model_class_without_sdpa():
    """Gemma 2 soft-caps its attention logits, which SDPA cannot do (recent transformers refuse SDPA for it), so
    "load it with sdpa" would be wrong advice; the error says the model is not supported and why, whichever
    attention implementation it was loaded with."""
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with pytest.raises(KVCompileError, match=r"unsupported model: Gemma2ForCausalLM: it soft-caps its attention "
                                             r"logits \(attn_logit_softcapping=50\.0\)"):
        kvcompile.apply(model, Policy.int8())
    model.config._attn_implementation = "sdpa"  # what older transformers allowed, silently without the cap
    with pytest.raises(KVCompileError, match=r"unsupported model: Gemma2ForCausalLM: it soft-caps"):
        kvcompile.apply(model, Policy.int8())


def test_error_hybrid_model():
    """Qwen3-Next mixes linear-attention layers (a recurrent state, its own cache class) with attention: refused
    with what was found, instead of failing inside Dynamo."""
    cfg = transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64, attn_implementation="sdpa")
    with pytest.raises(KVCompileError, match=r"unsupported model: Qwen3NextForCausalLM is a hybrid: besides "
                                             r"attention it has 'linear_attention' layers"):
        kvcompile.apply(transformers.Qwen3NextForCausalLM(cfg).eval(), Policy.int8())


def windowed(window, layer_types=None):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=window,
        layer_types=layer_types, attn_implementation="sdpa")
    return transformers.Gemma3ForCausalLM(cfg).eval()


def test_windowed_layers_keep_transformers_ring_where_it_holds_fewer_bytes():
    """Gemma 3 attends over a sliding window in most layers. For those, transformers keeps a full-precision
    ring of the window; kvcompile's store would keep every token. The cache takes, per windowed layer, whichever
    holds fewer bytes at its horizon (max_cache_len, else max_position_embeddings), checked against the
    accounting module's bytes."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    policy = Policy.kivi(4, group=4, residual=4)
    model = windowed(128, types)
    ring = 2 * 2 * 8 * 128 * 4  # keys and values, 2 kv heads x head_dim 8 x 128 tokens, fp32

    def store(capacity):  # one layer's store for one sequence of `capacity` tokens
        return kvcompile.cache_bytes(policy, 1, 2, 8, capacity, dtype=torch.float32)

    long = KVCompileCache(model.config, policy, 512, batch_size=1, dtype=torch.float32)
    assert long.rings == {0: 128, 2: 128} and store(512) > ring
    assert KVCompileCache(model.config, policy).rings == {0: 128, 2: 128}  # no limit: max_position_embeddings
    standins = 2 * 4 * (1 + 2 + 256 + 8 - 3)  # the quantized layer's two stand-ins (kvcompile.standin)
    assert long.nbytes == 2 * ring + store(0) + standins  # empty: the rings, one sequence
    short = KVCompileCache(model.config, policy, 150, batch_size=1, dtype=torch.float32)
    assert short.rings == {} and store(150) < ring  # the window never slides far in 150 tokens: quantize
    edge = next(c for c in range(129, 512) if store(c) > ring)  # the first capacity at which the ring wins
    assert KVCompileCache(model.config, policy, edge - 1).rings == {}
    assert KVCompileCache(model.config, policy, edge).rings == {0: 128, 2: 128}


@pytest.mark.slow
def test_windowed_model_compiled_equals_the_reference_cache():
    """apply on a model with sliding layers: the rings are the model's own (the pass leaves their reads and
    writes alone and says so), the full layer is quantized, and generate equals the eager reference cache,
    with a prompt shorter than the window (it slides during decode) and longer (the ring fills at prefill)."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    policy = Policy.kivi(4, group=4, residual=4)
    for prompt in (5, 24):
        model = windowed(8, types)
        ref = type(model)(model.config).eval()
        ref.load_state_dict(model.state_dict())
        ids = torch.randint(3, 64, (1, prompt))
        gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
        with torch.no_grad():
            cache = KVCompileCache(ref.config, policy, 256)
            want = ref.generate(ids, **gen, **{_cache_kwarg(ref): cache})
            assert cache.rings == {0: 8, 2: 8}
            applied = kvcompile.apply(model, policy, compiler="eager", prefill="compiled")
            got = applied.generate(ids, **gen)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits))
        ex = kvcompile.explain(applied)
        assert {s.layer for s in ex.sites} == {"model.layers.1.self_attn"}
        assert ex.skipped and all("sliding window of 8 tokens: left to transformers' ring" in k.reason
                                  for k in ex.skipped)  # also when the prefill's SDPA reads the chunk, not the ring


def test_error_apply_twice_and_to_a_compiled_model():
    model = kvcompile.apply(tiny(), Policy.int8(), compiler="eager", prefill="compiled")
    with pytest.raises(KVCompileError, match="already applied"):
        kvcompile.apply(model, Policy.int8())
    with pytest.raises(KVCompileError, match="already compiled"):
        kvcompile.apply(torch.compile(tiny()), Policy.int8())


OUTER = "kvcompile.apply has compiled this model's forward already"


@pytest.mark.slow
def test_torch_compile_around_an_applied_transformers_model_leaves_its_forward_to_kvcompile():
    """A user's reflex, torch.compile around the applied model (or transformers' recipe, model.forward =
    torch.compile(model.forward)): traced by another backend, the forward would lose kvcompile's pass. It runs as
    kvcompile compiled it; with fullgraph=True Dynamo says why it cannot trace it."""
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported, match=OUTER):
        torch.compile(kvcompile.apply(tiny(), Policy.full()), backend="eager", fullgraph=True)(ids, use_cache=True)
    torch._dynamo.reset()
    model = kvcompile.apply(tiny(), Policy.int8(residual=2))
    alone = kvcompile.apply(twin(model), Policy.int8(residual=2))
    want, _ = chunks(alone, ids, 5)
    got, cache = chunks(torch.compile(model, backend="eager"), ids, 5)
    assert torch.equal(got, want) and isinstance(cache, KVCompileCache) and cache.tokens == 9
    ref = tiny(seed=4)
    applied = kvcompile.apply(twin(ref), Policy.full())
    applied.forward = torch.compile(applied.forward, backend="eager")
    with torch.no_grad():
        assert torch.equal(applied.generate(ids[:1], max_new_tokens=8, do_sample=False),
                           ref.generate(ids[:1], max_new_tokens=8, do_sample=False))


@pytest.mark.slow
def test_torch_compile_around_an_applied_module_leaves_its_forward_to_kvcompile():
    """The same for a gpt-fast-style module, whose apply returns a compiled module: compiled again at the top,
    inside another compiled module, or in place (module.compile()), it gives the tokens it gives alone."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpt_fast_model", EXAMPLES / "gpt_fast_model.py")
    gf = importlib.util.module_from_spec(spec)
    sys.modules["gpt_fast_model"] = gf  # dataclasses look their module up
    spec.loader.exec_module(gf)

    def applied():
        torch.manual_seed(0)
        m = gf.Transformer(gf.ModelArgs()).eval()
        m.setup_caches(max_batch_size=1, max_seq_length=64)
        return kvcompile.apply(m, Policy.int8())

    class Outer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, pos):
            return self.inner(x, pos)

    def in_place(m):
        m.compile(backend="eager")
        return m

    prompt = torch.randint(0, 256, (1, 12))
    with pytest.raises(torch._dynamo.exc.Unsupported, match=OUTER):
        gf.generate(torch.compile(applied(), backend="eager", fullgraph=True), prompt, 8)
    torch._dynamo.reset()
    want = gf.generate(applied(), prompt, 8)
    for wrap in (lambda m: torch.compile(m, backend="eager"), lambda m: torch.compile(Outer(m), backend="eager"),
                 in_place):
        assert torch.equal(gf.generate(wrap(applied()), prompt, 8), want)


def test_compiler_auto_is_eager_on_the_cpu():
    """apply's default: kvcompile's own kernels do the cache work on the CPU; Inductor codegen is opt-in there."""
    assert kvcompile.apply(tiny(), Policy.int8())._kvcompile.compiler == "eager"
    assert kvcompile.apply(tiny(), Policy.int8(), compiler="inductor")._kvcompile.compiler == "inductor"
    with pytest.raises(KVCompileError, match="expected 'auto' or one of"):
        kvcompile.apply(tiny(), Policy.int8(), compiler="jit")


def test_error_sequence_longer_than_capacity():
    applied = kvcompile.apply(tiny(), Policy.int8(), max_cache_len=8, compiler="eager", prefill="compiled")
    with torch.no_grad():
        cache = cache_of(applied(torch.randint(3, 64, (1, 6)), use_cache=True))
        with pytest.raises(CapacityError, match="holds 6 tokens and appends 3, but the cache is limited to 8"):
            applied(torch.randint(3, 64, (1, 3)), use_cache=True, **{_cache_kwarg(applied): cache})
        with pytest.raises(CapacityError):
            applied(torch.randint(3, 64, (1, 9)), use_cache=True)


def test_error_dynamic_cache_holding_tokens_given_to_an_applied_model():
    """An empty DynamicCache becomes the model's kvcompile cache (tests/test_hf_cache.py); one that holds the
    unmodified model's full-precision tokens is refused, saying what to pass instead."""
    model = tiny()
    plain = twin(model)
    applied = kvcompile.apply(model, Policy.int8(), compiler="eager", prefill="compiled")
    ids = torch.randint(3, 64, (1, 3))
    with torch.no_grad():
        held = cache_of(plain(ids, use_cache=True, **{_cache_kwarg(plain): DynamicCache(config=plain.config)}))
        with pytest.raises(KVCompileError, match=r"a DynamicCache that already holds 3 tokens, kept in full precision "
                                                 r"by the unmodified model.*Pass no cache"):
            applied(ids, use_cache=True, **{_cache_kwarg(applied): held})


# --------------------------------------------------------------------------- the Triton kernels, end to end
@pytest.mark.slow
def test_tiny_llama_through_the_pass_runs_the_triton_kernels(monkeypatch):
    from kvcompile import ops
    from kvcompile.templates import launch

    calls = {"store": 0, "attention": 0}
    for name in calls:
        fn = getattr(launch, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(launch, name, counted)
    policy = Policy.full().override({0: Policy.kivi(4, group=4, residual=4)})
    model = tiny(layers=1, head_dim=16)
    ref = twin(model)
    ids = torch.randint(3, 64, (1, 7))
    want, _ = chunks(ref, ids, 5, KVCompileCache(ref.config, policy, 12))  # reference kernels, eager
    monkeypatch.setattr(ops, "_KERNELS", "triton")
    got, _ = chunks(kvcompile.apply(model, policy, max_cache_len=12, compiler="eager", prefill="compiled"), ids, 5)
    assert calls["store"] == 3 and calls["attention"] == 3  # prefill + two decode steps, all through the kernels
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- bad input at apply
def test_a_policy_that_quantizes_nothing_is_said_at_apply():
    with pytest.warns(kvcompile.KVCompileWarning, match=r"max_position_embeddings=64\): .*residual=1000000 >= 64"):
        kvcompile.apply(tiny(), Policy.kivi(4, group=4, residual=10 ** 6))
    with pytest.warns(kvcompile.KVCompileWarning, match=r"fewer than one per-channel group of 128"):
        kvcompile.apply(tiny(), Policy(Quant("int4", "channel", 128), Quant("int4")))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcompile.apply(tiny(), Policy.kivi(4, group=4, residual=8))  # quantizes: no word
        kvcompile.apply(tiny(), Policy.full())  # nothing by request: no word


@pytest.mark.parametrize("bad", [3.5, "64", True, 0, -8])
def test_error_max_cache_len_of_the_wrong_kind_at_apply(bad):
    with pytest.raises(ValueError, match=rf"max_cache_len={bad!r}\): expected a positive number of tokens"):
        kvcompile.apply(tiny(), Policy.int8(), max_cache_len=bad)


def test_error_model_on_the_meta_device():
    with pytest.raises(KVCompileError, match=r"weights are on the 'meta' device \(not loaded\)"):
        kvcompile.apply(tiny().to("meta"), Policy.int8())


def test_error_unknown_prefill_and_a_module_limit():
    with pytest.raises(KVCompileError, match=r"prefill='lazy' is not valid"):
        kvcompile.apply(tiny(), Policy.int8(), prefill="lazy")


# --------------------------------------------------------------------------- generate on a module compiled by the backend
@pytest.mark.slow
def test_generate_on_a_module_compiled_by_the_backend_is_refused_when_called():
    """torch.compile(model, backend="kvcompile", options=...) compiles the forward only: its generate would run the
    original model, uncompiled, over transformers' full-precision DynamicCache, the policy silently not applied. It
    is refused when called, saying what to do; a compiled forward over a DynamicCache (the default cache) is refused
    by the backend. A forward without a cache runs (nothing to quantize), and an applied model compiled again
    generates as kvcompile does."""
    ids = torch.randint(3, 64, (1, 6))
    options = {"policy": Policy.int8(), "compiler": "eager"}
    compiled = torch.compile(tiny(), backend="kvcompile", options=options)
    with torch.no_grad():
        with pytest.raises(KVCompileError, match=r"compiles the model's forward only: generate\(\.\.\.\) on the "
                                                 r"compiled module runs the original model's generate.*kvcompile.apply"):
            compiled.generate(ids, max_new_tokens=2)
        with pytest.raises(KVCompileError, match=r"generate_batch"):
            compiled.generate_batch([[5, 6, 7]])
        with pytest.raises(Exception, match=r"grows by concatenation \(torch.cat along the sequence: "
                                            r"transformers' DynamicCache"):
            compiled(ids)
        compiled(ids, use_cache=False)
        ex = kvcompile.explain(tiny(), ids, policy=Policy.int8())  # explain says it rather than refusing
        assert not ex.sites and any("grows by concatenation" in n for n in ex.notes)
        recipe = tiny()  # transformers' recipe without its static cache: the default cache reaches the backend
        recipe.forward = torch.compile(recipe.forward, backend="kvcompile", options=options)
        with pytest.raises(Exception, match=r"grows by concatenation"):
            recipe.generate(ids, max_new_tokens=2)
        applied = kvcompile.apply(tiny(), Policy.int8(), compiler="eager")
        want = applied.generate(ids, max_new_tokens=4, do_sample=False)
        again = torch.compile(applied, backend="kvcompile", options=options)
        assert torch.equal(again.generate(ids, max_new_tokens=4, do_sample=False), want)


# --------------------------------------------------------------------------- pickling an applied model
def _round_trip(how, obj, tmp_path):
    import copy
    import pickle
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    if how == "torch.save":
        torch.save(obj, tmp_path / "model.pt")
        return torch.load(tmp_path / "model.pt", weights_only=False)  # (a whole model, as the unmodified one needs)
    return {"deepcopy": copy.deepcopy, "copy": copy.copy}[how](obj)


@pytest.mark.parametrize("policy", [Policy.full(), Policy.kivi(4, group=4, residual=4)], ids=["full", "kivi"])
@pytest.mark.parametrize("how", slow_after(1, ["pickle", "torch.save", "deepcopy", "copy"]))
def test_an_applied_model_pickles_and_loads_back_applied(how, policy, tmp_path):
    """pickle, torch.save, copy.deepcopy and copy.copy of an applied transformers model give an applied model (the
    same policy and settings), whose generate is the original's: tokens and logits, and under Policy.full() the
    unmodified model's. The copy's weights are its own (deepcopy, pickle) and the original still works."""
    model = tiny()
    ref = twin(model)
    kvcompile.apply(model, policy, compiler="eager", max_cache_len=48)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **gen)
        loaded = _round_trip(how, model, tmp_path)
        assert type(loaded) is type(model) and loaded is not model
        assert loaded._kvcompile.policy == policy and loaded._kvcompile.settings == model._kvcompile.settings
        got = loaded.generate(ids, **gen)
        assert isinstance(got.past_key_values, KVCompileCache)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(torch.stack(got.logits),
                                                                        torch.stack(want.logits))
        if policy == Policy.full():
            plain = ref.generate(ids, **gen)
            assert torch.equal(got.sequences, plain.sequences)
            assert torch.equal(torch.stack(got.logits), torch.stack(plain.logits))
        shared = loaded.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
        assert shared == (how == "copy")
        assert torch.equal(model.generate(ids, **gen).sequences, want.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_an_applied_module_pickles_and_loads_back_applied(how, tmp_path):
    """A gpt-fast-style module (apply returns it compiled): loaded back applied, its cache buffers empty (as
    setup_caches leaves them), and it generates the original's tokens."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpt_fast_model", EXAMPLES / "gpt_fast_model.py")
    gf = importlib.util.module_from_spec(spec)
    sys.modules["gpt_fast_model"] = gf  # dataclasses look their module up
    spec.loader.exec_module(gf)
    torch.manual_seed(0)
    m = gf.Transformer(gf.ModelArgs()).eval()
    m.setup_caches(max_batch_size=1, max_seq_length=64)
    applied = kvcompile.apply(m, Policy.int8())
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    want = gf.generate(applied, prompt, 8)
    loaded = _round_trip(how, applied, tmp_path)
    assert loaded._kvcompile.policy == Policy.int8() and kvcompile.nbytes(loaded) < kvcompile.nbytes(applied)
    assert torch.equal(gf.generate(loaded, prompt, 8), want)
