"""Compiled continuous batching over kvcompile's store: transformers' engine, its compiled forward, kvcompile's pass.

``ContinuousBatchingConfig(varlen_compile_config=kvcompile.serving.compile_config())`` on a model
``kvcompile.apply`` prepared: transformers compiles its CB forward (padded to static sizes) with the kvcompile
backend; Dynamo traces transformers' own paged ``update`` (``index_copy_`` through ``write_index``,
``index_select`` through ``read_index``) and its own SDPA over stand-ins of the page pool, and
``kvcompile.passes.paged`` rewrites each layer into ``kvcompile.paged_store`` / ``paged_attention``.

The contract: under ``Policy.full()`` the tokens are exactly transformers' own (uncompiled, its own cache);
under a quantized policy exactly what the eager kvcompile serving path gives (the same stored bytes, the same
kernels); every layer's writes, reads and SDPA rewritten; the stand-ins a few hundred bytes; one model graph
for the whole run. Tiny random Llamas (``test_generate.tiny``), the workload of ``test_serving``.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch.nn.functional as F
from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig

import kvcompile
from kvcompile import KVCompileError, Policy, paged_ops, serving, standin
from kvcompile.passes import paged
from test_generate import tiny
from test_serving import GEN, KIVI, KIVI2, cb_config, prompts, shared_prefix_prompts, tokens

torch.set_num_threads(1)


def compiled_cb(**kw):
    return cb_config(varlen_compile_config=serving.compile_config("eager"), **kw)


def run(model, cbc, ps=None):
    with torch.no_grad():
        return tokens(model.generate_batch(ps or prompts(), GEN, continuous_batching_config=cbc, progress_bar=False))


@pytest.fixture(scope="module")
def own_tokens():
    """transformers' own continuous batching (uncompiled, its own full-precision paged cache)."""
    return run(tiny(), cb_config())


def test_full_policy_compiled_gives_transformers_own_tokens(own_tokens):
    model = kvcompile.apply(tiny(), Policy.full())
    before = dict(paged.counters), dict(paged_ops.calls)
    got = run(model, compiled_cb())
    assert got == own_tokens
    # the compiled graph did the work: the rewritten ops ran (one store per layer and forward; transformers' own
    # SDPA reads the pages back through paged_read wherever a request has a past, never kvcompile's attention)
    stores = paged_ops.calls["paged_store"] - before[1].get("paged_store", 0)
    reads = paged_ops.calls["paged_read"] - before[1].get("paged_read", 0)
    attends = paged_ops.calls["paged_attention"] - before[1].get("paged_attention", 0)
    assert stores > 0 and 0 < reads <= stores and attends == 0 and stores % 2 == 0
    assert paged.counters["graphs_rewritten"] > before[0].get("graphs_rewritten", 0)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Policy.int8(), KIVI, KIVI2], ids=["int8", "kivi4", "kivi2"])
def test_quantized_compiled_gives_the_eager_kvcompile_path_tokens(own_tokens, policy):
    """Token for token what kvcompile's eager serving path (the ``kvcompile_paged`` attention) gives under the
    same policy, on requests of mixed lengths (split prefills, decodes beside prefills); at 2 bits those are not
    the full-precision tokens, so the compiled path really reads the quantized store."""
    eager = run(kvcompile.apply(tiny(), policy), cb_config())
    got = run(kvcompile.apply(tiny(), policy), compiled_cb())
    assert got == eager
    if policy is KIVI2:
        assert got != own_tokens



@pytest.mark.slow
def test_compiled_forwards_share_prompt_prefixes(monkeypatch):
    """Prefix sharing under a compiled forward: the matched requests' rows start with the shared pages (the
    traced update's read indices cover them; the rewritten ops read the row). transformers' own tokens."""
    cls, found = serving.cache_class(), []
    orig = cls.search_prefix_match

    def search_prefix_match(self, request_id, prompt_ids):
        found.append(orig(self, request_id, prompt_ids))
        return found[-1]

    monkeypatch.setattr(cls, "search_prefix_match", search_prefix_match)
    ps = shared_prefix_prompts()
    want = run(tiny(), cb_config(num_blocks=32), ps)
    got = run(kvcompile.apply(tiny(), Policy.full()), compiled_cb(num_blocks=32), ps)
    assert got == want
    assert sum(found) >= 3 * 128

@pytest.mark.slow
def test_every_layer_is_rewritten_and_the_stand_ins_stay_tiny():
    """The pass's report: both layers' two writes, two reads and SDPA replaced; the page-pool views the graph
    takes are stand-ins of a few hundred bytes, and transformers' own cache tensor is never allocated."""
    model = kvcompile.apply(tiny(), KIVI)
    torch._dynamo.reset()
    n = len(paged.reports)
    manager = model.init_continuous_batching(GEN, compiled_cb())
    manager.start()
    try:
        ids = manager.add_requests(inputs=prompts()[:3], max_new_tokens=4)
        for _ in ids:
            r = manager.get_result(timeout=120)
            assert r is not None and r.error is None
        cache = manager.batch_processor.cache
        assert cache.compiled and cache.cache_tensor.device.type == "meta"
        views = cache.cache_allocators["full_attention"]._kv_token_views
        assert all(standin.is_standin(t) and paged_ops.lookup(t)[0] is cache for kv in views.values() for t in kv)
        # one token row of H x D over H + D - 1 floats per stand-in, whatever the pool's size: 2 layers x (k, v)
        assert cache.standin_nbytes == 2 * 2 * (2 + 8 - 1) * 4
        # transformers' own pool (uint8, on meta: never allocated) would take the bytes the stand-ins stand for
        assert cache.cache_tensor.numel() > 1000 * cache.standin_nbytes
    finally:
        manager.stop(block=True, timeout=30)
    new = paged.reports[n:]
    assert new, "no graph was rewritten"
    for rep in new:
        assert [(r["layer"], r["writes"], r["reads"], r["sdpa"]) for r in rep] == [(0, 2, 2, 1), (1, 2, 2, 1)]
        assert [r["module"].endswith(f"layers.{i}.self_attn") for i, r in enumerate(rep)] == [True, True]


@pytest.mark.slow
def test_one_model_graph_for_a_run_of_mixed_batches(monkeypatch):
    """Padded inputs (T to 16-token steps, read indices to the pool's size) over prefill chunks and decodes of
    several sizes: the model is traced twice for the whole run (the warmup's size static, then one dynamic
    graph every later size reuses), and no graph break falls inside a layer (the only ones are in kvcompile's
    forward wrapper, before the model: its CPU thread cap)."""
    cls = serving.cache_class()
    sizes, store_layer = set(), cls.store_layer

    def spy(self, layer, k, v):
        sizes.add(k.shape[2])
        return store_layer(self, layer, k, v)

    monkeypatch.setattr(cls, "store_layer", spy)
    eager = run(kvcompile.apply(tiny(), KIVI), cb_config(max_batch_tokens=128))
    sizes.clear()  # (the eager path stores through the same function, unpadded)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    n = len(paged.reports)
    got = run(kvcompile.apply(tiny(), KIVI), compiled_cb(max_batch_tokens=128, q_padding_interval_size=16))
    assert got == eager
    assert len(sizes) >= 3, sizes  # the forwards really came in several padded sizes ...
    assert len(paged.reports) - n == 2  # ... and two traces of the model served them all
    breaks = dynamo_utils.counters["graph_break"]
    assert breaks and all("get_num_threads" in b or "time.monotonic" in b for b in breaks), list(breaks)


@pytest.mark.slow
def test_inductor_compiles_the_rest_of_the_graph():
    """compiler="inductor": the rewritten graph goes to Inductor (kvcompile's paged ops opaque to it): the same
    tokens as the eager kvcompile path (about 30 s of code generation on a small CPU)."""
    ps = prompts()[:3]
    eager = run(kvcompile.apply(tiny(), KIVI), cb_config(), ps)
    before = paged_ops.calls["paged_store"]
    got = run(kvcompile.apply(tiny(), KIVI), cb_config(varlen_compile_config=serving.compile_config("inductor")), ps)
    assert got == eager and paged_ops.calls["paged_store"] > before


# --------------------------------------------------------------------------- refusals
def test_compiled_forwards_with_another_backend_or_path_are_refused():
    model = kvcompile.apply(tiny(), KIVI)
    with pytest.raises(KVCompileError, match="'kvcompile' backend only"):
        model.init_continuous_batching(GEN, cb_config(varlen_compile_config=CompileConfig(backend="inductor")))
    with pytest.raises(KVCompileError, match="no decode fast path"):
        model.init_continuous_batching(GEN, cb_config(decode_compile_config=serving.compile_config()))
    with pytest.raises(KVCompileError, match="default_compile_level"):
        model.init_continuous_batching(GEN, cb_config(default_compile_level=1))
    with pytest.raises(KVCompileError, match="unknown kvcompile backend option"):
        model.init_continuous_batching(GEN, cb_config(
            varlen_compile_config=CompileConfig(backend="kvcompile", mode=None, options={"policy2": 1})))
    with pytest.raises(KVCompileError, match="compiler"):
        serving.compile_config("tvm")
    assert model.config._attn_implementation == "sdpa"  # refusals leave the model as it was
    # the plain spelling works (backend by name, transformers' default mode ignored)
    model.init_continuous_batching(GEN, cb_config(varlen_compile_config=CompileConfig(backend="kvcompile")))


@pytest.mark.slow
def test_a_compiled_forward_whose_mask_does_not_fit_is_refused_with_what_to_lower():
    """A compiled forward traces transformers' SDPA, whose ragged mask (max_batch_tokens x every page's tokens)
    transformers allocates: with its default 8192 batch tokens over the default budget's million tokens of this
    tiny model's pages it does not fit, and the error says what to lower. A smaller budget fits, and compiled
    equals eager."""
    model = kvcompile.apply(tiny(), KIVI)
    cbc = ContinuousBatchingConfig(varlen_compile_config=serving.compile_config("eager"))
    with pytest.raises(KVCompileError, match=r"attention mask takes max_batch_tokens x .* = 8192 x .*lower "
                                              r"max_batch_tokens"):
        model.generate_batch(prompts()[:1], GEN, continuous_batching_config=cbc, progress_bar=False)
    serving.configure(model, budget=2**20)
    got = run(model, ContinuousBatchingConfig(varlen_compile_config=serving.compile_config("eager")),
              prompts()[:2])
    assert got == run(kvcompile.apply(tiny(), KIVI), cb_config(), prompts()[:2])


@pytest.mark.slow
def test_policy_full_compiled_with_transformers_defaults_fits():
    """Under Policy.full() the default budget's pages are cut so that the mask's columns for them cost at most the
    budget (an 8192-token batch over a million tokens of pages would take tens of GiB): the obvious compiled call
    runs, with transformers' own tokens."""
    model = kvcompile.apply(tiny(), Policy.full())
    got = run(model, ContinuousBatchingConfig(varlen_compile_config=serving.compile_config("eager")), prompts()[:2])
    assert got == run(tiny(), cb_config(), prompts()[:2])


def test_a_compiled_cache_refuses_an_eager_forward():
    """If the compiled forward ever ran without Dynamo (an eager fallback), transformers' SDPA would read the
    stand-ins: the cache's update refuses instead."""
    model = kvcompile.apply(tiny(), KIVI)
    manager = model.init_continuous_batching(GEN, compiled_cb())
    bp = manager._create_batch_processor()
    k = torch.zeros(1, 2, 3, 8)
    with pytest.raises(KVCompileError, match="without Dynamo"):
        bp.cache.update(k, k, 0, {})


# --------------------------------------------------------------------------- the pass on small graphs
class _Owner:
    """What a stand-in is registered to (the pass only needs the registry entry)."""


def _pool(owner, layer=0, n=24, h=2, d=8):
    k, v = standin.make_standin((n, h, d), torch.float32, "cpu"), standin.make_standin((n, h, d), torch.float32, "cpu")
    paged_ops.register(k, v, owner, layer)
    return k, v


def _capture(fn, *args):
    """The Dynamo graph of ``fn`` after ``rewrite_paged`` (a copy: the original graph is what runs)."""
    got = {}

    def backend(gm, example_inputs):
        from kvcompile.backend import _own_copy

        mine = _own_copy(gm)
        try:
            got["sites"] = paged.rewrite_paged(mine)
        except KVCompileError as e:
            got["error"] = e
            raise
        got["gm"] = mine
        return gm.forward  # the original runs (the rewritten graph's ops would look for a live cache)

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    except Exception:
        if "error" in got:
            raise got["error"] from None
        raise
    return got


def _transformers_layer(k_cache, v_cache, q, k, v, write_index, read_index, mask):
    """transformers' FullAttentionCacheAllocator.update + sdpa_attention_forward (repeat_kv), as traced."""
    k_cache.index_copy_(0, write_index, k)
    v_cache.index_copy_(0, write_index, v)
    if read_index.numel() == 0:
        ks, vs = k, v
    else:
        ks, vs = torch.index_select(k_cache, 0, read_index), torch.index_select(v_cache, 0, read_index)
    ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (ks, vs))
    ks, vs = (x[:, :, None].expand(1, 2, 2, x.shape[2], 8).reshape(1, 4, x.shape[2], 8) for x in (ks, vs))
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=0.25)


@pytest.mark.parametrize("reads", [True, False], ids=["read_index", "chunk_only"])
def test_the_pass_rewrites_transformers_paged_layer(reads):
    owner = _Owner()
    kc, vc = _pool(owner)
    T, R = 5, (9 if reads else 0)
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    widx, ridx = torch.arange(T), torch.arange(R)
    mask = torch.zeros(1, 1, T, R or T)
    got = _capture(_transformers_layer, kc, vc, q, k, v, widx, ridx, mask)
    (site,) = got["sites"]
    assert (site.k_read is not None) == reads and site.scale == 0.25
    targets = [n.target for n in got["gm"].graph.nodes if n.op in ("call_function", "call_method")]
    assert torch.ops.kvcompile.paged_store.default in targets and torch.ops.kvcompile.paged_attention.default in targets
    assert not {"index_copy_", "index_select", torch.index_select, F.scaled_dot_product_attention} & set(targets)


def test_the_pass_refuses_what_it_cannot_match():
    owner = _Owner()
    kc, vc = _pool(owner)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(5, 2, 8)
    widx = torch.arange(5)

    def no_sdpa(k_cache, v_cache, k, widx):  # attention computed by matmul (another attention implementation)
        k_cache.index_copy_(0, widx, k)
        v_cache.index_copy_(0, widx, k)
        ks, vs = torch.index_select(k_cache, 0, widx), torch.index_select(v_cache, 0, widx)
        return (q[:, :2] @ ks.transpose(0, 1).unsqueeze(0).transpose(-1, -2)) @ vs.transpose(0, 1).unsqueeze(0)

    with pytest.raises(KVCompileError, match="0 scaled_dot_product_attention"):
        _capture(no_sdpa, kc, vc, k, widx)

    def other_use(k_cache, v_cache, k, widx):  # the pool read another way
        k_cache.index_copy_(0, widx, k)
        v_cache.index_copy_(0, widx, k)
        return k_cache[:5].sum()

    with pytest.raises(KVCompileError, match="used by"):
        _capture(other_use, kc, vc, k, widx)

    def no_mask(k_cache, v_cache, k, widx):
        k_cache.index_copy_(0, widx, k)
        v_cache.index_copy_(0, widx, k)
        ks = torch.index_select(k_cache, 0, widx).transpose(0, 1).unsqueeze(0)
        vs = torch.index_select(v_cache, 0, widx).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=True)

    with pytest.raises(KVCompileError, match="without the ragged batch's attn_mask"):
        _capture(no_mask, kc, vc, k, widx)


@pytest.mark.slow
def test_an_eager_and_a_compiled_manager_do_not_share_a_model_at_once():
    """An eager manager switches the model's attention to kvcompile's; a compiled one traces transformers' own
    SDPA. While one kind holds the model the other is refused at its construction, saying what to do; once
    the first stops, the other runs, and gives its tokens. (int8: under Policy.full() the eager attention stays
    transformers' own too.)"""
    model = kvcompile.apply(tiny(), Policy.int8())
    eager = model.init_continuous_batching(GEN, cb_config())
    assert model.config._attn_implementation == serving.ATTN
    with pytest.raises(KVCompileError, match="another continuous-batching manager runs an eager forward"):
        model.init_continuous_batching(GEN, compiled_cb())
    eager.stop()  # never started: it lets go of the model all the same
    assert model.config._attn_implementation == "sdpa"
    compiled = model.init_continuous_batching(GEN, compiled_cb())
    with pytest.raises(KVCompileError, match="another continuous-batching manager runs a compiled or exact"):
        model.init_continuous_batching(GEN, cb_config())
    compiled.stop()
    assert run(model, cb_config()) == run(kvcompile.apply(tiny(), Policy.int8()), cb_config())
