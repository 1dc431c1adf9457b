"""The planner: published capacity figures, and the symbolic layout against the allocated one."""
import json
from dataclasses import replace

import pytest
import sympy as sp
from hypothesis import given, strategies as st

from kvcompile import Policy, Quant
from kvcompile import plan as P
from kvcompile.store import LayerSpec


def test_llama3_8b_reproduces_the_published_counts():
    # Plate: 16.1 GB of BF16 weights, 80 GB at 90 %, 8,192-token conversations, scales ignored.
    shape = P.PRESETS["llama3-8b"]
    avail = P.available_bytes(80 * P.GB, 0.9, shape.weight_bytes)
    got = {bits: P.plan_policy("", bits, shape, 8192, avail).sequences for bits in (16, 8, 4)}
    assert got == {16: 52, 8: 104, 4: 208}


def test_llama3_70b_reproduces_the_published_counts():
    shape = P.PRESETS["llama3-70b"]
    row = P.plan_policy("bf16", 16, shape, 4096, 45 * P.GiB)
    assert row.bytes_per_token == 320 * 1024            # "320 KB per token"
    assert row.sequence_bytes == 1.25 * P.GiB            # "1.25 GB per 4K conversation"
    assert row.sequences == 36                           # "36 fit in 45 GB"


def test_real_overhead_costs_sequences():
    shape = P.PRESETS["llama3-8b"]
    rows = {r.label: r for r in P.plan(shape, 8192)}
    ideal4, kivi4 = rows["ideal 4-bit"], rows["KIVI 4-bit G32 R128"]
    # int4 codes plus an fp16 scale and zero per 32 elements: 4 + 32/32 = 5 bits, plus the bf16 residual
    assert kivi4.bytes_per_token > ideal4.bytes_per_token * 5 / 4
    assert kivi4.sequences < ideal4.sequences
    assert rows["int8 per token"].sequences < rows["ideal 8-bit"].sequences
    # kvcompile's own full-precision store carries a 4-byte length per layer: never more than the ideal
    assert rows["bf16 (kvcompile full)"].sequences <= rows["ideal 16-bit"].sequences


quants = st.builds(
    Quant,
    format=st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "none"]),
    axis=st.sampled_from(["token", "channel"]),
    group=st.sampled_from([8, 16, 32, 64]),
    scale_dtype=st.sampled_from(["float16", "float32", "fp8_e4m3"]),
)


@given(k=quants, v=quants, residual=st.integers(0, 300), sink=st.integers(0, 8), context=st.integers(1, 3000),
       heads=st.integers(1, 4), head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from(["bfloat16", "float32"]))
def test_expression_equals_allocated_layout(k, v, residual, sink, context, heads, head_dim, dtype):
    pol = Policy(k, v, residual=residual, sink=sink)
    el = 2 if dtype == "bfloat16" else 4
    expr = P.layer_bytes_expr(pol, heads, head_dim, el)
    assert expr.subs(P.C, context) == LayerSpec(pol, heads, head_dim, dtype).nbytes(1, context)


def test_overrides_are_summed_per_layer():
    shape = P.ModelShape("tiny", 4, 2, 64, 0)
    pol = Policy.kivi(2).override({0: Policy.int8(), -1: None})
    want = sum(LayerSpec(p, 2, 64, "bfloat16").nbytes(1, 4096)
               for p in pol.resolve([f"model.layers.{i}.self_attn" for i in range(4)]))
    assert P.sequence_bytes_expr(pol, shape).subs(P.C, 4096) == want


def test_sequences_is_symbolic_in_memory():
    shape = P.PRESETS["llama3-8b"]
    M = sp.Symbol("M", positive=True)
    n = P.sequences_expr(P.ideal_sequence_bytes_expr(16, shape).subs(P.C, 8192), M)
    assert n.subs(M, 2 * 2 ** 30 * 2) == 4  # 4 GiB / 1 GiB per sequence


def test_nothing_left_for_the_cache_is_an_error():
    with pytest.raises(ValueError, match="nothing is left"):
        P.available_bytes(16 * P.GB, 0.9, 16.1 * P.GB)


def test_shape_from_config_folder(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=256).save_pretrained(
        tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    s = P.shape_from_config(tmp_path)
    assert (s.layers, s.kv_heads, s.head_dim, s.weight_bytes) == (3, 2, 64, 1000)


def test_plot_and_json(tmp_path):
    shape = P.PRESETS["llama3-8b"]
    avail = P.available_bytes(80 * P.GB, 0.9, shape.weight_bytes)
    png = P.plot(shape, avail, tmp_path / "plan.png", contexts=(1024, 8192))
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = P.plan(shape, 8192, available=avail)
    data = json.loads(P.to_json(rows, shape, 8192, avail))
    assert [r["sequences"] for r in data["rows"]][:3] == [52, 104, 208]


@pytest.mark.parametrize("policy", [Policy.int8(), Policy.kivi(4, group=4, residual=4), Policy.full()])
def test_windowed_layers_plan_what_the_cache_allocates(policy):
    """A Gemma-3-like config (five of six layers over a 16-token window): the planner's bytes per sequence equal
    what KVCompileCache holds once a sequence has that many tokens (rings where they are smaller, stores
    elsewhere; stand-ins aside), below, at and past the window and the crossover; the ideal count caches at
    most the window in windowed layers."""
    import torch
    from transformers import Gemma3TextConfig
    from kvcompile.hf import KVCompileCache, KVCompileLayer

    cfg = Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           hidden_size=32, sliding_window=16, max_position_embeddings=512)
    shape = P.shape_from_config(cfg, weight_bytes=0)
    assert shape.windows == tuple((i, 16) for i in range(5))
    expr = P.sequence_bytes_expr(policy, shape)
    for cap in (8, 16, 17, 30, 64, 300):
        cache = KVCompileCache(cfg, policy, cap, batch_size=1, dtype=torch.bfloat16)
        x = torch.randn(1, 2, cap, 8, dtype=torch.bfloat16)
        for layer in cache.layers:  # every layer holds a sequence of `cap` tokens (under Policy.full() the
            layer.update(x, x)       # windowed ones are transformers' own sliding-window layers)
        held = sum(layer.store.nbytes if isinstance(layer, KVCompileLayer)
                   else layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert expr.subs(P.C, cap) == held, (cap, cache.rings)
    assert P.ideal_sequence_bytes_expr(16, shape).subs(P.C, 300) == 2 * 2 * 8 * 2 * (5 * 16 + 300)


# --------------------------------------------------------------------------- the serving pool (plan --serving)
SERVING_POLICIES = {
    "full": Policy.full(), "int8": Policy.int8(), "fp8-r0": Policy.fp8(residual=0), "fp8": Policy.fp8(),
    "kivi4": Policy.kivi(4), "kivi2": Policy.kivi(2), "kivi4+rot+sink": Policy.kivi(4, sink=4, rotate=True),
    "tok+rot:4": "tok+rot:4", "tok+rot:2": "tok+rot:2", "tok+rot+sym:8": "tok+rot+sym:8",
    "tok+rot+sink:4": "tok+rot+sink:4",
    "mixed": Policy.kivi(2).override({0: Policy.int8(), -1: None}),  # per-layer blocks differ: one block for all
}


def _policy(p):
    from kvcompile.evaluate import scheme_policy
    return scheme_policy(*p.split(":")[0:1], int(p.split(":")[1])) if isinstance(p, str) else p


def _small_config(layers=4):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=3, num_key_value_heads=3, head_dim=64)


def _check_planner_equals_allocation(cfg, policy, budget, tokens, dtype, max_requests=None, page_size=256,
                                     shared_tokens=0, max_batch_tokens=P.MAX_BATCH_TOKENS):
    import torch
    from kvcompile import serving

    shape = P.shape_from_config(cfg, weight_bytes=0)
    if dtype == torch.float32:
        shape = replace(shape, dtype_bytes=4)
    row = P.serving_pool("p", policy, shape, budget, tokens, max_requests, shared_tokens, max_batch_tokens)
    theirs = P.transformers_pool(shape, budget, tokens, page_size, shared_tokens)
    got = serving.capacity(cfg, policy, budget, dtype, request_tokens=tokens, page_size=page_size,
                           max_requests=max_requests, shared_tokens=shared_tokens, max_batch_tokens=max_batch_tokens)
    ours, tf = got["kvcompile"], got["transformers"]
    assert (row.slots, row.blocks, row.block_tokens, row.tokens, row.requests, row.nbytes) == (
        ours["slots"], ours["blocks"], ours["block_tokens"], ours["tokens"], ours["requests"], ours["allocated"])
    assert ours["allocated"] <= budget
    assert (theirs.pages, theirs.tokens, theirs.requests, theirs.nbytes) == (
        tf["blocks"], tf["tokens"], tf["requests"], tf["data"])
    return row, theirs


@pytest.mark.parametrize("name", list(SERVING_POLICIES))
def test_serving_plan_equals_the_allocated_pool(name):
    """kvcompile plan --serving predicts, from the layout formulas alone, what kvcompile.serving.capacity counts
    in the tensors it allocates (both caches): pool blocks, tokens, slots, requests, bytes; and transformers'
    pages, tokens and requests. Budgets and request lengths around page boundaries, bf16 and fp32, slots sized
    to the requests or given."""
    import torch

    cfg, policy = _small_config(), _policy(SERVING_POLICIES[name])
    for budget, tokens, dtype, slots in ((3 * 2**20, 256, torch.bfloat16, None), (5 * 2**20 + 7, 1000, torch.bfloat16, None),
                                         (7 * 2**20, 64, torch.float32, None), (6 * 2**20, 257, torch.bfloat16, 3),
                                         (24 * 2**20, 64, torch.bfloat16, None)):  # more blocks than a table's columns
        _check_planner_equals_allocation(cfg, policy, budget, tokens, dtype, slots)


def test_block_tables_are_as_wide_as_the_longest_request_not_the_pool():
    """A slot's block table has a column for each block one request can hold (the model's positions), not for
    every block of the pool: at a budget of a thousand requests a table as wide as the pool (an int32 per slot
    and block, each layer) would take more bytes than the pages. So the requests a large budget holds follow
    the bits per element: 16 / 2.5 = 6.4 at int2 per token-head, less the tables' 128 columns (0.4 %)."""
    from kvcompile.evaluate import scheme_policy
    from kvcompile.serving import table_width

    shape = P.PRESETS["smollm2-135m"]
    budget = 1000 * 1024 * 23_040  # a thousand 1K-token requests in bf16 pages
    row = P.serving_pool("tok+rot:2", scheme_policy("tok+rot", 2), shape, budget, 1024)
    theirs = P.transformers_pool(shape, budget, 1024)
    assert theirs.requests == 1000 and row.blocks > 100_000
    assert 6.3 <= row.requests / theirs.requests <= 6.4
    specs = [LayerSpec(scheme_policy("tok+rot", 2), 3, 64, "bfloat16")] * 30
    assert table_width(specs, row.blocks, 8192) == 8192 // specs[0].block == 128
    assert table_width(specs, 10, 8192) == 10 and table_width(specs, row.blocks) == row.blocks


@pytest.mark.parametrize("name", ["int8", "kivi2", "tok+rot:4", "tok+rot+sink:4"])
def test_a_budget_of_exactly_n_requests(name):
    """The budget that holds exactly N requests, from the store's layout (each request: its slot's ring, sinks
    and length, the blocks its store writes -- ceil(T / block) without a window or sinks, fewer with: those
    tokens are in the slot -- and their table columns in every slot's row of the table, here narrower than the
    2,048 positions' 32 columns):
    the planner and the allocation hold N there, allocating every byte, and N - 1 one byte below. The same for
    transformers' pages."""
    import torch
    from kvcompile.serving import specs_for

    cfg, policy = _small_config(), _policy(SERVING_POLICIES[name])
    tokens, n = 300, 5
    specs = specs_for(policy.resolve([f"model.layers.{i}.self_attn" for i in range(4)]), 3, 64, "bfloat16")
    sp = specs[0]
    pages = -(-(sp.boundary(tokens) - sp.sink) // sp.block)  # the packed tokens' blocks
    assert pages == {"kivi2": 3}.get(name, 5)  # KIVI: 300 tokens, 128 + 12 of them in the window
    exact = sum(n * s.row_nbytes() + n * pages * s.block_nbytes() + 4 * n * (n * pages) for s in specs)
    row, _ = _check_planner_equals_allocation(cfg, policy, exact, tokens, torch.bfloat16)
    assert (row.requests, row.slots, row.blocks, row.nbytes) == (n, n, n * pages, exact)
    row, _ = _check_planner_equals_allocation(cfg, policy, exact - 1, tokens, torch.bfloat16)
    assert row.requests == n - 1
    page = 4 * 2 * 3 * 64 * 2 * 256  # transformers: bytes of a 256-token page, every layer, bf16
    _, theirs = _check_planner_equals_allocation(cfg, policy, 2 * 2 * page, tokens, torch.bfloat16)
    assert (theirs.pages, theirs.requests) == (4, 2)  # 300 tokens take 2 pages
    _, theirs = _check_planner_equals_allocation(cfg, policy, 2 * 2 * page - 1, tokens, torch.bfloat16)
    assert (theirs.pages, theirs.requests) == (3, 1)


@pytest.mark.parametrize("name", ["int8", "kivi2", "tok+rot:4", "tok+rot+sink:4"])
def test_a_shared_prompt_prefix_is_held_once(name):
    """Requests of 300 tokens whose first 200 are the same prompt: at 64 tokens a forward its 3 whole 64-token
    pages are held once, so N requests take 3 + 2N pages (N x 5 unshared) -- where the policy shares pages (no
    window, no sinks); a policy with a window or sinks plans as unshared. At 256 tokens a forward (the default)
    a quantized policy reads a shared prompt in whole 256-token pieces (``pool.shareable_tokens``): none of the
    200. transformers' 256-token pages: none of it is a whole page. Planner == allocation, and the exact budget
    of N requests."""
    import torch
    from kvcompile.serving import shares_pages, specs_for

    cfg, policy = _small_config(), _policy(SERVING_POLICIES[name])
    specs = specs_for(policy.resolve([f"model.layers.{i}.self_attn" for i in range(4)]), 3, 64, "bfloat16")
    share, n = shares_pages(specs), 6
    assert share == (name in ("int8", "tok+rot:4"))
    pages = 3 + 2 * n if share else {"kivi2": 3}.get(name, 5) * n  # KIVI: 300 tokens in 3 blocks and its window
    exact = sum(n * s.row_nbytes() + pages * s.block_nbytes() + 4 * n * pages for s in specs)
    row, _ = _check_planner_equals_allocation(cfg, policy, exact, 300, torch.bfloat16, shared_tokens=200,
                                              max_batch_tokens=64)
    assert (row.requests, row.slots, row.blocks, row.shared_tokens) == (n, n, pages, 192 if share else 0)
    row, _ = _check_planner_equals_allocation(cfg, policy, exact - 1, 300, torch.bfloat16, shared_tokens=200,
                                              max_batch_tokens=64)
    assert row.requests == n - 1
    row, _ = _check_planner_equals_allocation(cfg, policy, exact, 300, torch.bfloat16, shared_tokens=200)
    assert row.shared_tokens == 0 and (row.requests < n if share else row.requests == n)
    page = 4 * 2 * 3 * 64 * 2 * 256
    _, theirs = _check_planner_equals_allocation(cfg, policy, 5 * page, 700, torch.bfloat16, shared_tokens=600)
    assert (theirs.pages, theirs.requests) == (5, 3)  # 700 tokens take 3 pages; the first 2 are shared
    with pytest.raises(P.PlanError, match="shared_tokens=300"):
        P.serving_pool("p", policy, P.shape_from_config(cfg, weight_bytes=0), exact, 300, None, 300)


def test_serving_plan_refuses_what_it_cannot_plan():
    shape = P.shape_from_config(_small_config(), weight_bytes=0)
    with pytest.raises(P.PlanError, match=r"holds no request of 4,096 tokens \(one takes [\d,]+ bytes"):
        P.serving_pool("int8", Policy.int8(), shape, 2**20, 4096)
    with pytest.raises(P.PlanError, match=r"does not hold one block after 400 request slots.*lower max_requests"):
        P.serving_pool("kivi", Policy.kivi(4), shape, 2**20, 100, max_requests=400)
    with pytest.raises(P.PlanError, match=r"with 30 request slots .* fewer than the 16 one request of 1,024"):
        P.serving_pool("int8", Policy.int8(), shape, 2**20, 1024, max_requests=30)
    with pytest.raises(P.PlanError, match="request_tokens=0: expected a positive whole number"):
        P.serving_pool("int8", Policy.int8(), shape, 2**20, 0)
    # one GPU of 2 holds its 4 of Llama 3 8B's 8 KV heads: the requests a whole model's pool holds in twice the
    # budget, but for the block tables (their bytes do not shrink with the heads: one request fewer here)
    one, whole = (P.serving_pool("int8", Policy.int8(), sh, b, 1000)
                  for sh, b in ((P.shard(P.PRESETS["llama3-8b"], 2), 2**30), (P.PRESETS["llama3-8b"], 2**31)))
    assert whole.requests - 1 <= one.requests <= whole.requests and one.block_tokens == whole.block_tokens
    assert one.nbytes <= 2**30 < 2 * one.nbytes
    # a row that holds no request is left out with its reason; none holding one is an error
    theirs, rows, left = P.plan_serving(shape, 2**20, 1024, {"int8": Policy.int8(), "tok2": _policy("tok+rot:2")})
    assert [r.label for r in rows] == ["tok2"] and left[0][0] == "int8" and "holds no request" in left[0][1]
    with pytest.raises(P.PlanError, match="no policy's serving pool holds a request"):
        P.plan_serving(shape, 2**16, 1024, {"int8": Policy.int8()})


def per_byte(policy, tokens):
    """Requests of ``tokens`` tokens SmolLM2's serving pool holds under ``policy`` over transformers' own, at a
    budget of a thousand of transformers' requests (bf16 pages), so that whole requests do not round the ratio."""
    shape = P.PRESETS["smollm2-135m"]
    budget = 1000 * tokens * 23_040
    assert P.transformers_pool(shape, budget, tokens).requests == 1000
    return P.serving_pool("policy", policy, shape, budget, tokens).requests / 1000


def test_long_requests_amortise_kivis_window():
    """KIVI's window (residual + group - 1 recent tokens per request, in full precision) is paid once a request:
    at SmolLM2's longest requests (8,192 tokens) it is 2 % of one, and KIVI int4 with one-byte scales in groups
    of 64 (4.25 bits an element, 16 / 4.25 = 3.76x at most) holds 3.5x transformers' requests per byte (counted
    at a budget of a thousand of its requests, so that whole requests do not round the ratio); at 1K tokens the
    window is a sixth of a request and the same policy holds under 2.5x."""
    from kvcompile.evaluate import scheme_policy

    policy = scheme_policy("kivi-g64+rot+sink+fp8s", 4)
    assert str(policy).startswith("k=int4.channel.64.asym.e4m3;v=int4.token.64.asym.e4m3;r=128;s=4")
    assert 3.5 <= per_byte(policy, 8192) < 16 / 4.25
    assert per_byte(policy, 1024) < 2.5


def test_per_layer_bits_for_long_requests_hold_6x_at_2_bits():
    """The policy `kvcompile calibrate --bits-per-element 2.66 --context 8192` chose from 2- and 3-bit KIVI (groups of 64,
    one-byte scales, residual 64; docs/results.md, "2 bits at 6x"): 3-bit codes on 11 of the 60 layer sides, and
    6x transformers' requests of 8K tokens per byte, and 137 of them in 4 GiB where transformers holds 22."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks/results/eval_serving/kivi-g64-r64-fp8s-cal-8k.json"
    shape, policy = P.PRESETS["smollm2-135m"], Policy.load(path)
    layers = policy.resolve([f"model.layers.{i}" for i in range(shape.layers)])
    assert sum((p.key.bits == 3) + (p.value.bits == 3) for p in layers) == 11
    assert all(p.key.bits in (2, 3) and p.value.bits in (2, 3) and p.residual == 64 for p in layers)
    assert 6.0 <= per_byte(policy, 8192) < 6.47  # uniform int2's
    gib4 = 4 * 2**30
    ours, theirs = P.serving_pool("cal", policy, shape, gib4, 8192), P.transformers_pool(shape, gib4, 8192)
    assert (ours.requests, theirs.requests) == (137, 22)
