"""Tensor parallelism through vLLM (``tensor_parallel_size=2``, two CPU worker processes): each rank's pages hold
its own kv heads (vLLM counts twice the blocks in the same memory per rank), and the greedy tokens are the
unsharded run's. (The log probabilities differ from the unsharded run's in their last digits, as vLLM's own do:
its all-reduce sums the ranks' partial products in another order.)"""
from __future__ import annotations

import pytest
from vllm import SamplingParams

from kvcompile import Policy, Quant
from kvcompile import pages as P
from conftest import KV_BYTES, close, engine

PROMPTS = ["def foo(x):", "The class statement", "import os\nimport sys\n" * 9]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


PER_LAYER = Policy(Quant("int4"), Quant("int4"), rotate=True).override({1: Policy.int8()})


KIVI_RING = Policy.kivi(4, residual=0, rotate=True)  # key groups: each rank's pending group in a ring of its own
# a ring in one layer only: pages of two sizes in vLLM's block-outermost layout
PER_LAYER_RING = Policy(Quant("int4"), Quant("int4"), rotate=True).override({1: KIVI_RING})


@pytest.mark.parametrize("policy", [Policy.int8(), PER_LAYER, KIVI_RING, PER_LAYER_RING],
                         ids=["int8", "per-layer", "kivi-ring", "per-layer-ring"])
def test_two_ranks_hold_their_own_heads_and_give_the_unsharded_tokens(tiny, policy):
    # float32: a ring of 32 slots fits a packed page of 256 tokens
    block = 256 if policy in (KIVI_RING, PER_LAYER_RING) else 128
    kw = {"block_size": block}
    one = engine(tiny, policy.to_dict(), **kw)
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        close(one)
    two = engine(tiny, policy.to_dict(), tensor_parallel_size=2, distributed_executor_backend="mp", **kw)
    try:
        blocks = two.llm_engine.vllm_config.cache_config.num_gpu_blocks
        got = [list(o.outputs[0].token_ids) for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        close(two)
    # each rank's page of each layer: 1 of the model's 2 kv heads
    rank_pages = [P.PageLayout(p, 1, 64, "float32", block, window=p.flush > 1).page_bytes
                  for p in policy.resolve(["0", "1"])]  # (a ring's pages share the packed pages' blocks)
    assert blocks == KV_BYTES // sum(rank_pages)
    assert got == want


def test_two_ranks_hold_a_sliding_windows_pages_of_their_own_heads(sliding):
    """The Gemma 3 model (two of four layers a sliding window of 48) under 4 bits: each rank's sliding-window layers
    too hold their window in packed pages of its own kv head, and the tokens are the unsharded run's."""
    prompts = PROMPTS + ["The class statement creates a class object and binds it to a name. " * 4]  # past 48
    one = engine(sliding, "tok+rot:4")
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        close(one)
    two = engine(sliding, "tok+rot:4", tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        blocks = two.llm_engine.vllm_config.cache_config.num_gpu_blocks
        got = [list(o.outputs[0].token_ids) for o in two.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        close(two)
    from kvcompile.presets import named
    # a sliding-window and a full-attention group of two layers each share two tensors of each rank's pages
    assert blocks == KV_BYTES // (2 * P.PageLayout(named("tok+rot:4"), 1, 64, "float32", 128).page_bytes)
    assert got == want


# pipeline parallelism: stage 0 holds layer 0, stage 1 layer 1. Under PIPELINE_MIX layer 0 is 4-bit, layer 1 int8:
# were a stage's layers counted from its own first (both "layer 0"), both stages would hold 4-bit pages
PIPELINE_MIX = Policy.int8().override({0: Policy(Quant("int4"), Quant("int4"), rotate=True)})


@pytest.mark.parametrize("policy", [Policy.int8(), PIPELINE_MIX, Policy.kivi(4, sink=4, rotate=True)],
                         ids=["int8", "per-layer", "kivi-window-sinks"])
def test_two_pipeline_stages_give_the_unsharded_tokens_each_layer_its_own_policy(tiny, policy):
    """``pipeline_parallel_size=2``: each stage builds only its layers (and, under KIVI's window, their window
    caches), and a per-layer policy's selectors name the whole model's layers on every stage
    (``backend.cached_layers``): vLLM's block count, the smallest of the stages', is that of layer 1's pages
    (int8 under the mix, not 4-bit pages in both). (vLLM 0.32's CPU worker makes a later
    stage's input buffers only in its compilation warm-up, so its own pipeline fails under enforce_eager=True:
    these engines compile.)"""
    one = engine(tiny, policy.to_dict())
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        close(one)
    two = engine(tiny, policy.to_dict(), pipeline_parallel_size=2, distributed_executor_backend="mp",
                 enforce_eager=False)
    try:
        blocks = two.llm_engine.vllm_config.cache_config.num_gpu_blocks
        got = [list(o.outputs[0].token_ids) for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        close(two)
    assert got == want
    # a stage's one layer's pages (a window cache's pages, padded to the packed one's size, come from the same pool)
    layers = [P.PageLayout(p, 2, 64, "float32", 128, window=P.needs_window(p)).page_bytes
              for p in policy.resolve(["0", "1"])]
    assert blocks == min(KV_BYTES // b for b in layers) == KV_BYTES // layers[1]


def test_a_per_layer_policy_under_pipeline_stages_names_the_whole_models_layers():
    """What ``cached_layers`` gives a stage: the whole model's names from its own, or a refusal where the names do
    not say one decoder layer each."""
    from kvcompile.vllm.backend import whole_model
    from kvcompile.vllm.config import Refused
    stage = [f"model.layers.{i}.self_attn.attn" for i in range(15, 30)]
    names = whole_model(stage, 15, 30, 30)
    assert names == [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    assert PIPELINE_MIX.resolve(names)[0] != Policy.int8() and PIPELINE_MIX.resolve(names)[15] == Policy.int8()
    for args in [(stage, 14, 29, 30), (stage, 15, 30, 30, False),
                 ([n.replace("layers.", "layers.0.") for n in stage], 15, 30, 30)]:
        with pytest.raises(Refused, match="per-layer policy under pipeline parallelism.*one policy for every layer"):
            whole_model(*args)


def test_a_per_layer_policy_with_window_caches_is_refused_under_pipeline_stages(tiny):
    """Window caches' pages are sized from a stage's own layers, and vLLM 0.32 fails to lay out a stage that lacks
    a kind of window cache another stage has (a StopIteration while allocating): refused by ``LLM(...)`` itself,
    saying what runs instead."""
    from kvcompile.vllm.config import Refused
    windowed = Policy.int8().override({0: Policy.kivi(4, rotate=True)})
    with pytest.raises(Refused, match=r"window caches .*pipeline_parallel_size=2.*one policy for every layer"):
        engine(tiny, windowed.to_dict(), pipeline_parallel_size=2, distributed_executor_backend="mp",
               enforce_eager=False)
