"""Every generation mode of transformers' ``generate`` on an applied model, the way a user calls it.

The contract: under ``Policy.full()`` an applied model gives exactly the tokens of the unmodified model in
every mode (the cache grows, is cropped, forked and reordered through kvcompile's paged store, and nothing of
that may change a token); under quantized policies it runs and stays close (a bound on the logits of a forced
sequence). The kernels are the defaults users get (the C kernels on the CPU). Tiny random Llamas here; the
family tests and the SmolLM2 tests repeat the core modes on other architectures and the real model.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from tiers import slow_after
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, TextIteratorStreamer

import kvcompile
from kvcompile import CapacityError, KVCompileError, Policy
from kvcompile.hf import KVCompileCache
from kvcompile.hf_model import cache_kwarg
from kvcompile.passes import counters

KIVI = Policy.kivi(4, group=4, residual=8)


def tiny(layers=2, seed=0, dtype=torch.float32, max_pos=8192, vocab=64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_pos,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


def pair(policy=Policy.full(), **kw):
    """(unmodified model, applied twin with the same weights)."""
    ref = tiny(**kw)
    model = tiny(**kw)
    model.load_state_dict(ref.state_dict())
    return ref, kvcompile.apply(model, policy)


def graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    dynamo_utils.counters.clear()
    yield


@pytest.fixture(scope="module")
def models():
    """One pair for the mode tests (their compiled graphs are shared, as a user's would be)."""
    return pair()


def same(ref, model, seed=0, **kw):
    """generate on both, from the same random state (sampling), with the same arguments."""
    with torch.no_grad():
        torch.manual_seed(seed)
        want = ref.generate(**kw)
        torch.manual_seed(seed)
        got = model.generate(**kw)
    w = want if isinstance(want, torch.Tensor) else want.sequences
    g = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(g, w), (g, w)
    return got


PROMPT = torch.tensor([[5, 9, 13, 9, 13, 22, 7, 9, 13, 31, 17, 9, 13, 22]])


# --------------------------------------------------------------------------- Policy.full(): exactly the model's tokens
@pytest.mark.parametrize("mode", [
    dict(max_new_tokens=12, do_sample=False),
    dict(do_sample=False),                                                    # transformers' default length
    dict(max_new_tokens=12, do_sample=True, top_k=10),
    dict(max_new_tokens=10, num_beams=4, do_sample=False),
    dict(max_new_tokens=10, num_beams=4, num_return_sequences=3, do_sample=False),
    dict(max_new_tokens=10, num_return_sequences=3, do_sample=True),
    dict(max_new_tokens=12, prompt_lookup_num_tokens=3, do_sample=False),     # crops the cache
    dict(max_new_tokens=10, num_beams=3, do_sample=True, early_stopping=True),
    dict(max_new_tokens=12, prefill_chunk_size=5, do_sample=False),          # the prompt in chunks of 5, 5, 4
], ids=["greedy", "default-length", "sampling", "beam", "beam-return-3", "sample-return-3", "prompt-lookup",
        "beam-sample", "chunked-prefill"])
def test_full_policy_gives_the_unmodified_models_tokens(models, mode):
    ref, model = models
    same(ref, model, input_ids=PROMPT, **mode)


def test_calling_conventions(models):
    """Positional ids, inputs=, inputs_embeds=, a GenerationConfig object, attention_mask, a dict return."""
    ref, model = models
    with torch.no_grad():
        want = ref.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), want)
        assert torch.equal(model.generate(inputs=PROMPT, max_new_tokens=6, do_sample=False), want)
        gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2)
        assert torch.equal(model.generate(PROMPT, generation_config=gc), want)
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        assert torch.equal(out.sequences, want) and len(out.scores) == 6
    emb = ref.model.embed_tokens(PROMPT).detach()
    same(ref, model, inputs_embeds=emb, max_new_tokens=6, do_sample=False)


def test_batched_prompts_with_left_padding(models):
    ref, model = models
    ids = torch.randint(3, 64, (3, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    ids[2, :1], mask[2, :1] = 0, 0
    same(ref, model, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    same(ref, model, input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False)


@pytest.mark.slow
def test_assisted_generation_with_an_assistant_applied_or_not():
    ref, model = pair()
    plain_assistant = tiny(layers=1, seed=5)
    same(ref, model, input_ids=PROMPT, max_new_tokens=12, do_sample=False, assistant_model=plain_assistant)
    applied_assistant = kvcompile.apply(tiny(layers=1, seed=5), Policy.full())
    same(ref, model, input_ids=PROMPT, max_new_tokens=12, do_sample=False, assistant_model=applied_assistant)
    # a quantized assistant proposes other tokens, never other results: the target verifies every one
    quantized_assistant = kvcompile.apply(tiny(layers=1, seed=5), Policy.kivi(2, group=4, residual=4))
    same(ref, model, input_ids=PROMPT, max_new_tokens=12, do_sample=False, assistant_model=quantized_assistant)


def test_streamer_and_pipeline(models):
    from transformers import TextStreamer, pipeline  # noqa: F401

    ref, model = models

    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            self.done = True

    s = Collect()
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=5, do_sample=False, streamer=s)
    assert s.done and s.tokens == out[0].tolist()  # the prompt, then each new token as it comes
    assert TextIteratorStreamer  # (text streamers need a tokenizer: the SmolLM2 tests use one)


def test_a_conversation_grows_past_the_first_allocation_without_recompiling():
    """A chat continued in the cache generate returned: past several mask widths (256 tokens each), no
    CapacityError, no new graph, and still exactly the unmodified model's tokens (its cache used the same
    way)."""
    ref, model = pair()
    kw = cache_kwarg(model)
    gen = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    seq_r = seq_m = PROMPT
    cache_r = cache_m = None
    with torch.no_grad():
        for turn in range(6):
            more = torch.randint(3, 64, (1, 150), generator=torch.Generator().manual_seed(turn))
            seq_r, seq_m = torch.cat([seq_r, more], 1), torch.cat([seq_m, more], 1)
            r = ref.generate(seq_r, **gen, **({kw: cache_r} if cache_r is not None else {}))
            m = model.generate(seq_m, **gen, **({kw: cache_m} if cache_m is not None else {}))
            if turn == 1:
                before = graphs()
            seq_r, cache_r = r.sequences, r.past_key_values
            seq_m, cache_m = m.sequences, m.past_key_values
            assert torch.equal(seq_m, seq_r)
            assert isinstance(cache_m, KVCompileCache)
    assert cache_m.tokens == seq_m.shape[1] - 1 > 3 * 256
    assert graphs() == before  # turns 2-5: longer prompts, a wider cache, nothing compiled


@pytest.mark.slow
def test_a_changing_load_compiles_nothing_more(monkeypatch):
    """On a busy machine the cores other processes leave free change from call to call. torch's thread count
    is one of Dynamo's guards, so a compiled model keeps the count its first compiled call took: a load that
    swings between one and two free cores recompiles nothing (it did: one graph more per count)."""
    from kvcompile.templates import cpu
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so that a cap of one thread is a change
    calls = []

    def swinging():
        calls.append(1)
        return 2 - len(calls) % 2
    monkeypatch.setattr(cpu, "available_threads", swinging)
    try:
        model = kvcompile.apply(tiny(), Policy.kivi(4, group=4, residual=8), prefill="compiled")
        with torch.no_grad():
            for n in (5, 40, 90):
                ids = torch.randint(3, 64, (1, n), generator=torch.Generator().manual_seed(n))
                model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert graphs() == 2 and len(model._kvcompile.reports) == 2  # one prefill, one decode graph
        assert len(calls) >= 4  # the load swung at least twice each way while the model ran
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_one_prefill_and_one_decode_graph_serve_every_length():
    """Five prompt lengths over several thousand tokens, each in a fresh cache: one prefill and one decode graph
    in all (prefill="compiled"; by default on the CPU a first prefill runs eagerly, and only the decode graph is
    compiled). A new batch size adds its own graphs, once."""
    for prefill, per_batch in (("compiled", 2), ("auto", 1)):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        model = kvcompile.apply(tiny(), Policy.kivi(4, group=4, residual=8), prefill=prefill)
        with torch.no_grad():
            for n in (5, 300, 1100, 2500, 4100):
                ids = torch.randint(3, 64, (1, n), generator=torch.Generator().manual_seed(n))
                model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            assert graphs() == per_batch and len(model._kvcompile.reports) == per_batch
            for n in (7, 600):
                model.generate(torch.randint(3, 64, (2, n)), max_new_tokens=3, min_new_tokens=3, do_sample=False)
            assert graphs() == 2 * per_batch
    assert not dynamo_utils.counters["graph_break"]


@pytest.mark.slow
def test_cache_bytes_grow_with_the_tokens_written():
    """A sequence holds what it has written: after N tokens, within one block (and its table entry) of the
    token-exact accounting for N per layer, not a cache of max_position_embeddings."""
    _, model = pair(KIVI)
    with torch.no_grad():
        cache = model(PROMPT, use_cache=True).past_key_values
        for n in (14, 14 + 100, 14 + 700):
            if n > 14:
                cache = model(torch.randint(3, 64, (1, n - cache.tokens)), use_cache=True,
                              **{cache_kwarg(model): cache}).past_key_values
            spec = cache.layers[0].spec
            exact = 2 * spec.exact_nbytes(1, n)  # two layers
            held = sum(x.store.nbytes for x in cache.layers)
            assert exact <= held <= exact + 2 * (spec.block_nbytes() + 4), (n, exact, held)
    fp32 = 2 * 2 * 2 * 8 * 4  # bytes per token of the full-precision cache (keys and values, 2 layers, 2 heads)
    assert held < 0.5 * fp32 * 714 and held < fp32 * 8192 / 20


@pytest.mark.slow
def test_generate_allocates_its_pool_once():
    """generate tells the cache how far it goes (max_length): each layer's pool is allocated once, for every
    sequence to reach it, instead of doubling (a copy of the pool each time) while decoding; a chat continued in
    the returned cache sizes it again, once, for the longer conversation."""
    _, model = pair(KIVI)
    with torch.no_grad():
        ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))
        out = model.generate(ids, max_new_tokens=90, min_new_tokens=90, do_sample=False, return_dict_in_generate=True)
        cache = out.past_key_values
        spec = cache.layers[0].spec
        assert cache.tokens == 20 + 90 - 1  # the last token is returned, not cached
        assert all(x.store.blocks == 2 * spec.blocks_for(20 + 90 - 1) for x in cache.layers)
        more = torch.cat([out.sequences, torch.randint(3, 64, (2, 30))], 1)
        model.generate(more, max_new_tokens=60, min_new_tokens=60, do_sample=False,
                       **{cache_kwarg(model): cache})
        assert all(x.store.blocks == 2 * spec.blocks_for(more.shape[1] + 60 - 1) for x in cache.layers)


def test_quantized_policies_stay_close_on_a_forced_sequence():
    """Teacher-forced logits of the quantized cache against the unmodified model: bounded, in every mode
    of cache use (a prefill, decode steps, a crop and a re-append, a fork)."""
    ref, model = pair(Policy.kivi(8, group=4, residual=4))
    ids = torch.randint(3, 64, (1, 60), generator=torch.Generator().manual_seed(3))
    kw = cache_kwarg(model)
    with torch.no_grad():
        want = ref(ids).logits
        out = model(ids[:, :40], use_cache=True)
        cache = out.past_key_values
        steps = [out.logits]
        for p in range(40, 50):
            steps.append(model(ids[:, p:p + 1], use_cache=True, **{kw: cache}).logits)
        cache.crop(-5)  # back to 45 tokens, then the same tokens again
        steps = steps[:-5]
        steps.append(model(ids[:, 45:60], use_cache=True, **{kw: cache}).logits)
        got = torch.cat(steps, 1)
    err = (got - want).abs().max()
    assert err < 0.05 * want.abs().max(), err  # int8 keys and values: a few tenths of a percent here
    assert not torch.equal(got, want)  # (it is quantized)


# --------------------------------------------------------------------------- the cache across calls
def test_model_to_another_dtype_after_apply():
    ref, model = pair()
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    same(ref, model, input_ids=PROMPT, max_new_tokens=6, do_sample=False)
    with torch.no_grad():  # a cache made for the float32 model, given to the bfloat16 one: said at once
        cache = KVCompileCache(model.config, Policy.full(), dtype=torch.float32)
        with pytest.raises(ValueError, match=r"stores torch.float32, but the model runs in torch.bfloat16"):
            model(PROMPT, use_cache=True, **{cache_kwarg(model): cache})


# --------------------------------------------------------------------------- torch.inference_mode
@pytest.mark.parametrize("mode", [
    dict(max_new_tokens=10, do_sample=False),
    dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False),
    dict(max_new_tokens=10, prompt_lookup_num_tokens=3, do_sample=False),
], ids=["greedy", "beam-return-2", "prompt-lookup"])
def test_generate_under_inference_mode(models, mode):
    """``with torch.inference_mode():``, where many users generate: the unmodified model's tokens."""
    ref, model = models
    with torch.inference_mode():
        want = ref.generate(PROMPT, **mode)
        got = model.generate(PROMPT, **mode)
    assert torch.equal(got, want)


def windowed_pair(policy):
    """A Gemma 3 whose first and last layers attend over a window of 16 (kept in transformers' ring), and twin."""
    from test_api import windowed

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    return windowed(16, types), kvcompile.apply(windowed(16, types), policy)


@pytest.mark.parametrize("first, then, make, policy", slow_after(3, [
    (torch.inference_mode, torch.no_grad, pair, Policy.full()),
    (torch.no_grad, torch.inference_mode, pair, Policy.full()),
    (torch.inference_mode, torch.no_grad, windowed_pair, Policy.full()),
    (torch.inference_mode, torch.no_grad, pair, KIVI),
    (torch.inference_mode, torch.no_grad, windowed_pair, KIVI),
]), ids=["full-inference-then-no_grad", "full-no_grad-then-inference", "full-gemma3-rings", "kivi",
       "kivi-gemma3-rings"])
def test_a_chat_begun_in_one_grad_mode_goes_on_in_the_other(first, then, make, policy):
    """A cache made under ``torch.inference_mode`` and written again under ``torch.no_grad`` (or the other way
    round), as transformers' own cache allows: under Policy.full() the unmodified model's tokens, under KIVI the
    tokens of the same chat held in one mode throughout."""
    ref, model = make(policy)
    kw = cache_kwarg(model)
    more = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True)

    def chat(m, first, then):
        with first():
            one = m.generate(PROMPT, **gen)
        seq = torch.cat([one.sequences, more], 1)
        with then():
            return m.generate(seq, **gen, **{kw: one.past_key_values}).sequences

    got = chat(model, first, then)
    if policy == Policy.full():
        assert torch.equal(got, chat(ref, first, then))
    else:
        assert torch.equal(got, chat(model, torch.no_grad, torch.no_grad))


def test_a_forward_that_does_not_generate():
    """A loss (labels given, no cache asked for) runs the unmodified model: nothing compiled, no cache; a forward
    with use_cache returns a cache that holds the prompt, not max_position_embeddings."""
    ref, model = pair()
    with torch.no_grad():
        got = model(PROMPT, labels=PROMPT)
        want = ref(PROMPT, labels=PROMPT)
    assert torch.equal(got.loss, want.loss) and got.past_key_values is None and graphs() == 0
    with torch.no_grad():
        cache = model(PROMPT).past_key_values
    assert isinstance(cache, KVCompileCache) and cache.tokens == PROMPT.shape[1]
    spec, standins = cache.layers[0].spec, 2 * cache.layers[0].keys.untyped_storage().nbytes()
    assert cache.reserved_nbytes == cache.nbytes == 2 * (spec.nbytes(1, 14) + standins)  # one block per layer
    assert cache.reserved_nbytes < (2 * 2 * 2 * 8 * 4 * 8192) / 50  # a cache of max_position_embeddings


def test_a_cache_limit_is_a_clear_error():
    _, model = pair()
    limited = kvcompile.apply(tiny(seed=3), Policy.int8(), max_cache_len=20)
    with torch.no_grad(), pytest.raises(CapacityError, match="limited to 20 tokens"):
        limited.generate(PROMPT, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with pytest.raises(KVCompileError, match=r"cache_implementation='quantized'"):
        model.generate(PROMPT, max_new_tokens=3, cache_implementation="quantized")


def test_wrong_batch_for_a_cache_is_said_at_the_call():
    _, model = pair()
    cache = KVCompileCache(model.config, Policy.full(), batch_size=2, dtype=torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 2 sequences but the call passes a batch of 3"):
        model(torch.randint(3, 64, (3, 4)), use_cache=True, **{cache_kwarg(model): cache})


# --------------------------------------------------------------------------- threads
@pytest.mark.slow
def test_two_threads_generating_on_two_applied_models():
    ref_a, a = pair(seed=1)
    ref_b, b = pair(KIVI, seed=2)
    with torch.no_grad():
        want_a = ref_a.generate(PROMPT, max_new_tokens=8, do_sample=False)
        want_b = b.generate(PROMPT, max_new_tokens=8, do_sample=False)  # alone first
    results, errors = {}, []

    def run(name, model):
        try:
            with torch.no_grad():
                for _ in range(3):
                    results.setdefault(name, []).append(model.generate(PROMPT, max_new_tokens=8, do_sample=False))
        except Exception as e:  # surfaced below
            errors.append(e)

    torch._dynamo.reset()  # both compile at the same time
    ts = [threading.Thread(target=run, args=("a", a)), threading.Thread(target=run, args=("b", b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert all(torch.equal(x, want_a) for x in results["a"])
    assert all(torch.equal(x, want_b) for x in results["b"])


def test_an_eager_cache_while_another_thread_compiles():
    """The unmodified model reading a KVCompileCache eagerly (the reference path) must not take the traced
    branch because another thread is compiling (is_compiling() is process-wide; the layer asks Dynamo's
    trace-time constant instead)."""
    ref = tiny(seed=4)
    _, other = pair(seed=6)
    ids = torch.randint(3, 64, (1, 30))
    with torch.no_grad():
        want = ref(ids, use_cache=True, **{cache_kwarg(ref): KVCompileCache(ref.config, KIVI)}).logits
    stop = threading.Event()

    def compile_forever():
        while not stop.is_set():
            torch._dynamo.reset()
            with torch.no_grad():
                other.generate(torch.randint(3, 64, (1, 6)), max_new_tokens=2, do_sample=False)

    t = threading.Thread(target=compile_forever)
    t.start()
    try:
        with torch.no_grad():
            for _ in range(20):
                got = ref(ids, use_cache=True, **{cache_kwarg(ref): KVCompileCache(ref.config, KIVI)}).logits
                assert torch.equal(got, want)
    finally:
        stop.set()
        t.join()


# --------------------------------------------------------------------------- the backend in transformers' recipes
@pytest.mark.slow
def test_backend_on_a_compiled_forward_with_generates_static_cache():
    """transformers' recipe: the forward compiled by the backend, generate(cache_implementation="static"). The
    StaticCache initializes inside the compiled prefill: its allocation becomes a stand-in, and every token is
    the unmodified model's."""
    ref = tiny()
    model = tiny()
    model.forward = torch.compile(model.forward, backend="kvcompile",
                                  options={"policy": Policy.full(), "compiler": "eager"})
    with torch.no_grad():
        want = ref.generate(PROMPT, max_new_tokens=10, do_sample=False)
        got = model.generate(PROMPT, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    # Policy.full(): the graph's own SDPA reads the store back whole (exact_view), never kvcompile's attention
    assert counters["allocation_standin"] > 0 and counters["exact_view"] > 0 and counters["attention_op"] == 0


def test_backend_through_generates_own_auto_compile():
    """generate's auto-compile (a CompileConfig naming the backend, a static cache): the prefill runs eagerly into
    the StaticCache's full-precision tensors, then the compiled decode takes them over (the prefill's tokens are
    stored first) -- the unmodified model's tokens under Policy.full(), close under a quantized policy."""
    from transformers import CompileConfig

    for policy in (Policy.full(), KIVI):
        ref, model = tiny(), tiny()
        cc = CompileConfig(backend="kvcompile", mode=None, options={"policy": policy, "compiler": "eager"})
        cc._compile_all_devices = True  # transformers compiles only on accelerators unless told to (tests)
        with torch.no_grad():
            want = ref.generate(PROMPT, max_new_tokens=10, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
            got = model.generate(PROMPT, max_new_tokens=10, do_sample=False, cache_implementation="static",
                                 compile_config=cc, output_logits=True, return_dict_in_generate=True)
        if policy == Policy.full():
            assert torch.equal(got.sequences, want.sequences)
        err = (torch.stack(got.logits) - torch.stack(want.logits)).abs().max()
        assert err < 0.1 * torch.stack(want.logits).abs().max(), err
        # (Policy.full(): the graph's own SDPA over exact_view; KIVI: kvcompile's attention op)
        assert counters["exact_view" if policy == Policy.full() else "attention_op"] > 0
