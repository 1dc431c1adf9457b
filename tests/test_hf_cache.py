"""What users do with an applied model's cache, the way transformers' own docs do it.

transformers' "Re-use Cache to continue generation" recipe: one forward over a shared prefix into a cache (the
docs create it as ``DynamicCache(config=model.config)``; earlier ones as a ``StaticCache``), then for each continuation ``copy.deepcopy`` of that
cache and ``generate`` from the copy. Its "Iterative generation" recipe: one ``DynamicCache()`` passed to every
turn of a chat, filled in place. And the ``Cache`` methods users call themselves (``crop``, ``get_seq_length``,
``batch_repeat_interleave``, ``reorder_cache``, ...).

The contract, as everywhere: under ``Policy.full()`` the applied model gives exactly the unmodified model's
tokens and logits (its own DynamicCache used the same way); under a quantized policy a copied cache is an
independent cache holding the same tokens, so every continuation equals the one from a cache built afresh, and
the logits stay within the bound of ``test_generate.test_quantized_policies_stay_close_on_a_forced_sequence``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import kvcompile
from kvcompile import KVCompileError, Policy
from kvcompile.hf import KVCompileCache
from test_generate import PROMPT, pair, windowed_pair
from tiers import slow_after

KIVI8 = Policy.kivi(8, group=4, residual=4)  # tokens past the 4-token window and whole groups of 4 are packed
SUFFIXES = ([3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [30, 31, 32, 33, 34, 35])
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)


def logits(out) -> torch.Tensor:
    return torch.stack(out.logits)


def within_bound(got, want) -> None:
    """The bound of the quantized-policy tests (``test_generate``): 5 % of the largest logit."""
    err = (logits(got) - logits(want)).abs().max()
    assert err < 0.05 * logits(want).abs().max(), err


def prompt_cache(model):
    """The recipe's first step: one forward over the shared prefix, into the cache the docs create."""
    with torch.no_grad():
        return model(PROMPT, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values


@pytest.fixture(scope="module")
def full():
    return pair(Policy.full())


@pytest.fixture(scope="module")
def kivi():
    return pair(KIVI8)


# --------------------------------------------------------------------------- transformers' prompt-reuse recipe
@pytest.mark.parametrize("duplicate", [copy.deepcopy, copy.copy], ids=["deepcopy", "copy"])
def test_prompt_reuse_recipe_gives_the_unmodified_models_tokens(full, duplicate):
    ref, model = full
    cache, ref_cache = prompt_cache(model), prompt_cache(ref)
    assert isinstance(cache, KVCompileCache)  # the caller's empty DynamicCache became the model's cache
    with torch.no_grad():
        for suffix in SUFFIXES:
            ids = torch.cat([PROMPT, torch.tensor([suffix])], 1)
            want = ref.generate(ids, past_key_values=copy.deepcopy(ref_cache), **GEN)
            got = model.generate(ids, past_key_values=duplicate(cache), **GEN)
            assert torch.equal(got.sequences, want.sequences)
            assert torch.equal(logits(got), logits(want))
    assert cache.get_seq_length() == PROMPT.shape[1]  # the prompt cache itself never grew


@pytest.mark.parametrize("duplicate", slow_after(1, [copy.deepcopy, copy.copy]), ids=["deepcopy", "copy"])
def test_a_copied_quantized_cache_holds_the_same_tokens(kivi, duplicate):
    """Each continuation from a copy equals the continuation from a prompt cache built afresh (a copy is
    lossless and independent: the continuations before it wrote into their own copies), and stays within the
    quantized bound of the unmodified model's."""
    ref, model = kivi
    cache = prompt_cache(model)
    before = [t.clone() for layer in cache.layers for t in layer.store.state]
    with torch.no_grad():
        for suffix in SUFFIXES:
            ids = torch.cat([PROMPT, torch.tensor([suffix])], 1)
            got = model.generate(ids, past_key_values=duplicate(cache), **GEN)
            fresh = model.generate(ids, past_key_values=prompt_cache(model), **GEN)
            assert torch.equal(got.sequences, fresh.sequences) and torch.equal(logits(got), logits(fresh))
            within_bound(got, ref.generate(ids, **GEN))
    after = [t for layer in cache.layers for t in layer.store.state]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("policy", slow_after(1, [Policy.full(), KIVI8]), ids=["full", "kivi8"])
def test_prompt_reuse_with_sliding_window_rings(policy):
    """Gemma 3's windowed layers keep transformers' ring (under a quantized policy kvcompile's RingLayer): a copy's
    ring is the model's own too (the pass must leave it alone), and the prefix is longer than the window (16), so
    the copies' rings slide."""
    ref, model = windowed_pair(policy)
    prefix = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model(prefix, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
        if policy != Policy.full():  # (Policy.full(): the model's own layers, transformers' rings)
            assert cache.rings == {0: 16, 2: 16}
        for suffix in SUFFIXES[:2]:
            ids = torch.cat([prefix, torch.tensor([suffix])], 1)
            got = model.generate(ids, past_key_values=copy.deepcopy(cache), **GEN)
            if policy == Policy.full():
                ref_cache = ref(prefix, past_key_values=DynamicCache(config=ref.config)).past_key_values
                want = ref.generate(ids, past_key_values=ref_cache, **GEN)
                assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))
            else:
                fresh = model(prefix, past_key_values=DynamicCache(config=model.config)).past_key_values
                again = model.generate(ids, past_key_values=fresh, **GEN)
                assert torch.equal(got.sequences, again.sequences) and torch.equal(logits(got), logits(again))


@pytest.mark.slow
def test_a_copy_of_a_cache_of_pre_rope_keys_has_its_own_rotary_table():
    """Pre-RoPE keys: the cache's layers share one cos/sin table; a copy shares one of its own (a continuation
    that captures new positions into it leaves the prompt cache's as it was), and continues as a fresh cache."""
    _, model = pair(Policy.kivi(8, group=4, residual=4, pre_rope=True))
    cache = prompt_cache(model)
    dup = copy.deepcopy(cache)
    tables = {id(layer.store.rope_table) for layer in dup.layers} | {id(layer.rope_table) for layer in dup.layers}
    assert len(tables) == 1 and tables.isdisjoint({id(cache.layers[0].store.rope_table)})
    rows = int(cache.layers[0].store.rope_table.filled.sum())
    ids = torch.cat([PROMPT, torch.tensor([SUFFIXES[0]])], 1)
    with torch.no_grad():
        got = model.generate(ids, past_key_values=dup, **GEN)
        want = model.generate(ids, past_key_values=prompt_cache(model), **GEN)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))
    assert int(cache.layers[0].store.rope_table.filled.sum()) == rows  # the original's table untouched


def test_a_cache_copied_under_inference_mode_goes_on_under_no_grad(kivi):
    _, model = kivi
    ids = torch.cat([PROMPT, torch.tensor([SUFFIXES[0]])], 1)
    with torch.inference_mode():
        cache = prompt_cache(model)
        dup = copy.deepcopy(cache)
    with torch.no_grad():
        got = model.generate(ids, past_key_values=dup, **GEN)
        want = model.generate(ids, past_key_values=prompt_cache(model), **GEN)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))


@pytest.mark.parametrize("policy", [Policy.full(), KIVI8], ids=["full", "kivi8"])
def test_a_cropped_cache_is_reused(policy, full, kivi):
    """generate grows the prompt cache itself; ``crop`` back to the prefix (a negative count, transformers 5.2x's
    convention) and it serves the next continuation as a fresh prompt cache would: under Policy.full() exactly
    the unmodified model's DynamicCache cropped the same way."""
    ref, model = full if policy == Policy.full() else kivi
    cache, ref_cache = prompt_cache(model), prompt_cache(ref)
    with torch.no_grad():
        for suffix in SUFFIXES:
            ids = torch.cat([PROMPT, torch.tensor([suffix])], 1)
            got = model.generate(ids, past_key_values=cache, **GEN)
            if policy == Policy.full():
                want = ref.generate(ids, past_key_values=ref_cache, **GEN)
                ref_cache.crop(PROMPT.shape[1] - ref_cache.get_seq_length())
                assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))
            else:  # a crop into packed storage re-quantizes what returns to the window (KVStore.crop): bounded
                want = ref.generate(ids, **GEN)
                assert torch.equal(got.sequences, want.sequences)
                within_bound(got, want)
            cache.crop(PROMPT.shape[1] - cache.get_seq_length())
            assert cache.get_seq_length() == PROMPT.shape[1]


# --------------------------------------------------------------------------- a DynamicCache the caller passes
def test_one_dynamic_cache_through_a_whole_chat(full):
    """transformers' iterative-generation recipe: ``cache = DynamicCache()`` once, passed to every turn's generate,
    which fills it in place. The caller's object becomes the model's kvcompile cache and keeps growing."""
    ref, model = full
    mine, theirs = DynamicCache(), DynamicCache()
    seq = PROMPT
    with torch.no_grad():
        for turn in range(3):
            want = ref.generate(seq, past_key_values=theirs, **GEN)
            got = model.generate(seq, past_key_values=mine, **GEN)
            assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))
            assert isinstance(mine, KVCompileCache) and got.past_key_values is mine
            assert mine.get_seq_length() == theirs.get_seq_length() == got.sequences.shape[1] - 1
            seq = torch.cat([got.sequences, torch.randint(3, 64, (1, 5))], 1)


def test_the_recipe_with_a_static_cache(full):
    """transformers' earlier prompt-reuse recipe creates a StaticCache (``max_cache_len=...``) for the prefix: an
    empty one becomes the model's kvcompile cache too, limited to its length (no full-precision copy of it is
    allocated). A kvcompile cache computes as transformers' default cache does (the tokens held, not a static
    width): under Policy.full() its copies continue with the unmodified model's tokens from its own StaticCache
    copies, and its tokens and logits with its DynamicCache (a static width changes the last bits of the
    unmodified model's own logits)."""
    from transformers import StaticCache
    ref, model = full
    with torch.no_grad():
        cache = model(PROMPT, past_key_values=StaticCache(config=model.config, max_cache_len=64)).past_key_values
        static = ref(PROMPT, past_key_values=StaticCache(config=ref.config, max_cache_len=64)).past_key_values
        dynamic = prompt_cache(ref)
        assert isinstance(cache, KVCompileCache) and cache.max_cache_len == 64
        for suffix in SUFFIXES:
            ids = torch.cat([PROMPT, torch.tensor([suffix])], 1)
            got = model.generate(ids, past_key_values=copy.deepcopy(cache), **GEN)
            assert torch.equal(got.sequences, ref.generate(ids, past_key_values=copy.deepcopy(static), **GEN).sequences)
            want = ref.generate(ids, past_key_values=copy.deepcopy(dynamic), **GEN)
            assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))


def test_a_dynamic_cache_that_holds_tokens_is_refused(full):
    ref, model = full
    with torch.no_grad():
        held = ref(PROMPT, past_key_values=DynamicCache(config=ref.config)).past_key_values
        with pytest.raises(KVCompileError, match=r"DynamicCache that already holds 14 tokens, kept in full precision"):
            model.generate(PROMPT, past_key_values=held, max_new_tokens=2)
        with pytest.raises(KVCompileError, match=r"already holds 14 tokens"):
            model(PROMPT[:, :3], past_key_values=held)


# --------------------------------------------------------------------------- a cache of another policy
def test_a_cache_of_another_policy_is_refused(kivi):
    _, model = kivi
    other = KVCompileCache(model.config, Policy.int8())
    with torch.no_grad():
        with pytest.raises(KVCompileError, match=r"created with the policy .*int8.* but the model was applied with"):
            model(PROMPT, past_key_values=other)
        with pytest.raises(KVCompileError, match=r"created with the policy"):
            model.generate(PROMPT, past_key_values=KVCompileCache(model.config, Policy.full()), max_new_tokens=2)
        layered = KVCompileCache(model.config, KIVI8.override({1: Policy.int8()}))
        with pytest.raises(KVCompileError, match=r"layer 1: the cache has .*int8"):
            model(PROMPT, past_key_values=layered)
        same = KVCompileCache(model.config, KIVI8)  # the model's own policy: taken
        model(PROMPT, past_key_values=same)
    assert same.get_seq_length() == PROMPT.shape[1]


# --------------------------------------------------------------------------- the Cache methods users call
def test_the_cache_methods_users_call_match_dynamic_caches(full):
    """``get_seq_length``, ``batch_repeat_interleave``, ``reorder_cache``, ``batch_select_indices`` and ``crop`` on
    the applied model's cache, then generate from it: under Policy.full() exactly what the unmodified model does
    with its DynamicCache handled the same way."""
    ref, model = full
    with torch.no_grad():
        cache, theirs = prompt_cache(model), prompt_cache(ref)
        for c in (cache, theirs):
            c.batch_repeat_interleave(3)
            c.reorder_cache(torch.tensor([2, 0, 1]))
            c.batch_select_indices(torch.tensor([1, 2]))
            c.crop(-4)
        assert cache.get_seq_length() == theirs.get_seq_length() == PROMPT.shape[1] - 4
        ids = torch.cat([PROMPT[:, :-4], torch.tensor([[3, 4]])], 1).repeat(2, 1)
        got = model.generate(ids, past_key_values=cache, **GEN)
        want = ref.generate(ids, past_key_values=theirs, **GEN)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))


def test_reading_the_cache_back(full, kivi):
    """Iterating over the cache yields what each layer holds in the model's space, as a DynamicCache yields it:
    under Policy.full() the unmodified model's keys and values, so ``DynamicCache(cache)`` is a full-precision
    copy the unmodified model continues from; under a quantized policy what the store dequantizes to."""
    from kvcompile.store import dequantize_reference
    ref, model = full
    with torch.no_grad():
        cache, theirs = prompt_cache(model), prompt_cache(ref)
        for (k, v, w), (k2, v2, w2) in zip(cache, theirs):
            assert torch.equal(k, k2) and torch.equal(v, v2) and w is w2 is None
        legacy = cache.to_legacy_cache()  # the tuple format older transformers' DynamicCache returned
        assert len(legacy) == 2 and all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
                                        for (k, v), layer in zip(legacy, theirs.layers))
        ids = torch.cat([PROMPT, torch.tensor([SUFFIXES[1]])], 1)
        got = ref.generate(ids, past_key_values=DynamicCache(cache), **GEN)
        want = ref.generate(ids, past_key_values=theirs, **GEN)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))
        quantized = prompt_cache(kivi[1])
        for layer, (k, v, _) in zip(quantized.layers, quantized):
            want_k, want_v = dequantize_reference(layer.store.state, layer.spec, torch.float32)
            assert torch.equal(k, want_k) and torch.equal(v, want_v) and k.shape[2] == PROMPT.shape[1]


@pytest.mark.parametrize("keep", [8, -4], ids=["keep-8", "remove-4"])
def test_a_crop_reaches_every_layer_of_a_cache_with_rings(keep):
    """``crop`` takes transformers 5.2x's negative count and the older positive length to keep; with sliding-window
    rings beside the stores every layer is cropped alike (a positive count left the last ring uncropped)."""
    _, model = windowed_pair(KIVI8)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache.rings == {0: 16, 2: 16}
    cache.crop(keep)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [8, 8, 8]
