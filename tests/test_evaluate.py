"""The evaluation harness on a tiny random Llama: exact view, loss alignment, passkey prompts."""
import math

import pytest
import torch
import torch.nn.functional as F

from kvcompile import Policy, PolicyError, Quant
from kvcompile import evaluate as E
from kvcompile.store import dequantize_reference

import transformers  # noqa: E402
from tiers import slow_after  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


POLICIES = [
    Policy.kivi(2, sink=4, rotate=True),
    Policy.kivi(4, group=16, residual=8),
    E.naive(3),
    Policy.fp8(residual=16),
    Policy.int8(),
    Policy.kivi(3, residual=0).override({0: None}),
]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_incremental_view_is_the_reference_view(tiny, policy):
    # The view is the store's contents (dequantize_reference), except the chunk just appended: that is the
    # chunk's own keys and values, as the model computed them (it attends to itself in full precision).
    ids = torch.randint(0, 512, (2, 150))
    cache = E.make_cache(tiny, policy, 160)
    seen = {}  # layer index -> the keys and values of its last update
    for i, layer in enumerate(cache.layers):
        update = layer.update

        def spy(k, v, *a, _update=update, _i=i, **kw):
            seen[_i] = (k.clone(), v.clone())
            return _update(k, v, *a, **kw)
        layer.update = spy
    with torch.no_grad():
        tiny(input_ids=ids[:, :37], use_cache=True, **{E.cache_kwarg(tiny): cache})
        for s in range(37, 150, 11):  # odd chunks: flushes land mid-chunk and across chunks
            tiny(input_ids=ids[:, s:s + 11], use_cache=True, **{E.cache_kwarg(tiny): cache})
            for i, layer in enumerate(cache.layers):
                k, v = dequantize_reference(layer.store.state, layer.spec, torch.float32, end=160)
                n, c = int(layer.cumulative_length), seen[i][0].shape[2]
                k[:, :, n - c:n], v[:, :, n - c:n] = seen[i]
                assert torch.equal(k, layer._k) and torch.equal(v, layer._v)
                assert layer.get_mask_sizes(5) == (int(layer.cumulative_length) + 5, 0)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_stored_view_reads_every_position_as_stored(tiny, policy):
    # own="stored": no exception for the chunk just appended -- every position, its own included, is the store's
    ids = torch.randint(0, 512, (2, 150))
    cache = E.make_cache(tiny, policy, 160, own="stored")
    with torch.no_grad():
        tiny(input_ids=ids[:, :37], use_cache=True, **{E.cache_kwarg(tiny): cache})
        for s in range(37, 150, 11):
            tiny(input_ids=ids[:, s:s + 11], use_cache=True, **{E.cache_kwarg(tiny): cache})
            for layer in cache.layers:
                n = int(layer.cumulative_length)
                k, v = dequantize_reference(layer.store.state, layer.spec, torch.float32, end=n)
                assert torch.equal(k, layer._k[:, :, :n]) and torch.equal(v, layer._v[:, :, :n])


def _round_trip_attention(policy):
    """An attention that reads each key and value as a per-token policy stores it, wherever the position: the
    model run once over the whole window computes what own="stored" specifies, with no cache at all."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from kvcompile import quant as Q

    def trip(x, q):
        return Q.dequantize(*Q.quantize(x, q), q, x.dtype) if q.quantized else x

    def attend(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, trip(key, policy.key), trip(value, policy.value), *args, **kwargs)
    return attend


@pytest.mark.parametrize("policy", [Policy.int8(), Policy(Quant("int4", "token"), Quant("int4", "token", 32)),
                                    Policy(Quant("int2", "token"), Quant("none"))], ids=str)
def test_stored_loss_is_the_model_reading_every_position_as_stored(tiny, policy, monkeypatch):
    # An engine that reads every position from its pages (kvcompile inside vLLM) computes this, however it splits
    # the window into calls; kvcompile's own convention (own="full") reads each call's own tokens unquantized.
    W = torch.randint(0, 512, (2, 96))
    stored = {c: E.heldout_loss(tiny, W, policy, chunk=c, own="stored") for c in (1, 16, 48)}
    full = {c: E.heldout_loss(tiny, W, policy, chunk=c) for c in (16, 48)}
    import transformers
    monkeypatch.setitem(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "kvtrip",
                        transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    transformers.AttentionInterface.register("kvtrip", _round_trip_attention(policy))
    monkeypatch.setattr(tiny.config, "_attn_implementation", "kvtrip")
    with torch.no_grad():
        lg = tiny(input_ids=W).logits
    want = F.cross_entropy(lg[:, 47:-1].transpose(1, 2), W[:, 48:], reduction="none").mean(1).tolist()
    tol = 1e-5  # float32 sums in another order
    for c in stored:
        assert stored[c] == pytest.approx(want, abs=tol), c
    # the tolerance tells the protocols apart: "full" reads each call's own tokens unquantized
    for c in (16, 48):
        assert max(abs(a - b) for a, b in zip(full[c], want)) > 2 * tol, c


def test_a_windowed_policy_is_measured_stored_one_token_a_call(tiny):
    # A window or per-channel key groups: which positions a token reads in full precision depends on the split into
    # calls, so "stored" feeds one token a call (each token reads the store as it stood when it was the newest: what
    # the vLLM plugin's window cache computes, tests_vllm); any chunk then gives the same numbers, "full" others.
    assert E.one_at_a_time(Policy.kivi(4)) and E.one_at_a_time(Policy.kivi(4, residual=0))
    assert E.one_at_a_time(Policy.int8().override({1: Policy.fp8()})) and E.one_at_a_time(Policy.int8(sink=4))
    assert not E.one_at_a_time(Policy.int8()) and not E.one_at_a_time(Policy.full())
    W = torch.randint(0, 512, (2, 96))
    policy = Policy.kivi(4, group=16, residual=16)
    stored = [E.heldout_loss(tiny, W, policy, chunk=c, own="stored") for c in (5, 48)]
    assert stored[0] == stored[1]  # the same calls, one token each
    full = E.heldout_loss(tiny, W, policy, chunk=48)
    assert max(abs(a - b) for a, b in zip(full, stored[0])) > 1e-4


def test_stored_is_refused_where_it_cannot_be_measured(tiny):
    W = torch.randint(0, 512, (1, 32))
    with pytest.raises(E.ArgumentError, match="own='pages'.*'full', 'stored'"):
        E.heldout_loss(tiny, W, Policy.int8(), own="pages")
    with pytest.raises(E.ArgumentError, match="fast eager cache only: pass fast=True"):
        E.heldout_loss(tiny, W, Policy.int8(), fast=False, own="stored")
    with pytest.raises(E.ArgumentError, match="pre_rope=True"):
        E.heldout_loss(tiny, W, Policy.kivi(4, pre_rope=True, residual=0), own="stored")


def test_merge_refuses_rows_of_two_protocols():
    row = {"scheme": "int8", "bits": 8, "loss": 1.0, "loss_delta": 0.0}
    a = {"window": 64, "windows": 1, "rows": [row], "passkey": {}}
    b = dict(a, own="stored")
    assert E.merge([b, dict(b, rows=[dict(row, scheme="naive")])])["own"] == "stored"
    assert E.merge([a, dict(a, passkey={"full:16": {}})])["own"] == "full"  # runs older than own read "full"
    assert E.merge([b, {"window": 64, "windows": 1, "rows": [], "passkey": {}}])["own"] == "stored"
    with pytest.raises(E.ArgumentError, match="different protocols \\(own: full, stored\\)"):
        E.merge([a, b])


def test_fast_and_reference_cache_give_the_same_loss(tiny):
    W = torch.randint(0, 512, (2, 128))
    pol = Policy.kivi(2, residual=16)
    fast = E.heldout_loss(tiny, W, pol, chunk=16, fast=True)
    slow = E.heldout_loss(tiny, W, pol, chunk=16, fast=False)
    # the same stored values; attention over the held positions only sums in another order
    assert fast == pytest.approx(slow, abs=1e-6) and fast != E.heldout_loss(tiny, W, Policy.full(), chunk=16)


def test_full_precision_loss_is_the_model_loss_on_the_second_half(tiny):
    W = torch.randint(0, 512, (3, 96))
    got = E.heldout_loss(tiny, W, Policy.full(), chunk=10, batch=2)  # chunk does not divide the half
    with torch.no_grad():
        lg = tiny(input_ids=W).logits
    want = F.cross_entropy(lg[:, 47:-1].transpose(1, 2), W[:, 48:], reduction="none").mean(1)
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want.double(), atol=1e-5)


def test_quantization_costs_loss(tiny):
    # A random model still reacts to its cache: 2-bit naive rounding must move the loss.
    W = torch.randint(0, 512, (1, 96))
    full = E.heldout_loss(tiny, W, Policy.full(), chunk=16)[0]
    bad = E.heldout_loss(tiny, W, E.naive(2), chunk=16)[0]
    assert abs(bad - full) > 1e-4


def test_schemes():
    assert E.scheme_policy("fp8", 4) is None
    assert E.scheme_policy("int8", 8) == Policy.int8()
    assert E.scheme_policy("kivi", 2) == Policy.kivi(2)
    n = E.naive(4)
    assert n.residual == 0 and n.key.symmetric and n.key.group is None and n.key.axis == "token"
    with pytest.raises(ValueError, match="unknown scheme"):
        E.scheme_policy("nope", 4)
    assert E.parse_entry("kivi+rot:3") == ("kivi+rot", 3)
    with pytest.raises(ValueError):
        E.parse_entry("kivi")


def test_passkey_trials_are_random_and_stratified():
    ts = E.passkey_trials([1024, 2048], trials=20, seed=3)
    assert len(ts) == 40
    d = sorted(t.depth for t in ts if t.length == 1024)
    assert all(i / 20 <= x < (i + 1) / 20 for i, x in enumerate(d))
    assert len({t.key for t in ts}) > 30 and all(10000 <= t.key < 100000 for t in ts)
    assert E.passkey_trials([1024], 5, seed=3) == E.passkey_trials([1024], 5, seed=3)


class _CharTok:
    """A byte-level stand-in tokenizer: one token per character."""
    bos_token_id = 1

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [min(ord(c), 511) for c in s]}

    def decode(self, ids):
        return "".join(chr(c) for c in ids)


@pytest.mark.parametrize("depth", [0.0, 0.37, 0.999])
def test_passkey_prompt_has_the_length_and_the_needle(depth):
    tok = _CharTok()
    t = E.PasskeyTrial(1024, depth, 48213)
    prompt, answer = E.passkey_prompt(tok, t)
    assert len(prompt) == 1024 - E.PASSKEY_NEW_TOKENS  # room for the answer inside the 1024 positions
    text = "".join(chr(c) for c in prompt[1:])
    at = text.index("The pass key is 48213")
    before, units = text[:at].count("The grass is green"), text.count("The grass is green")
    assert abs(before / units - depth) <= 1 / units  # the needle sits at a sentence boundary near the depth
    assert "".join(chr(c) for c in answer) == " 48213"


def test_passkey_scoring_matches_greedy_generation(tiny):
    tok = _CharTok()
    ts = E.passkey_trials([400], 2, seed=1)
    got = E.passkey_retrieved(tiny, tok, ts, Policy.full(), chunk=64)
    for t, hit in zip(ts, got):
        prompt, _ = E.passkey_prompt(tok, t)
        out = tiny.generate(torch.tensor([prompt]), max_new_tokens=E.PASSKEY_NEW_TOKENS, do_sample=False)
        assert hit == (str(t.key) in tok.decode(out[0, len(prompt):].tolist()))
    # A model that answers "7777..." whatever it is asked: it retrieves the key 77777 and no other one.
    sevens, other = E.PasskeyTrial(400, 0.5, 77777), E.PasskeyTrial(400, 0.5, 77771)
    with torch.no_grad():
        bias = torch.full((512,), -1e4)
        bias[ord("7")] = 1e4
        tiny.lm_head.bias = torch.nn.Parameter(bias)
        try:
            assert E.passkey_retrieved(tiny, tok, [sevens, other], Policy.full(), chunk=64) == [True, False]
            det = {}
            E.passkey_retrieved_shared(tiny, tok, [sevens], Policy.kivi(2, residual=16), chunk=64, details=det)
            assert det[0]["hit"] and det[0]["answer"] == "77777"  # generation stops once the key is out
        finally:
            tiny.lm_head.bias = None


def test_write_json_and_plot(tmp_path):
    res = {"model": "tiny", "window": 64, "windows": 1, "rows": [
        {"scheme": "full", "bits": 16, "policy": "p", "loss": 2.0, "loss_delta": 0.0, "bytes_per_token_bf16": 10,
         "ratio_to_bf16": 1.0},
        {"scheme": "kivi", "bits": 4, "policy": "p", "loss": 2.01, "loss_delta": 0.01, "bytes_per_token_bf16": 3,
         "ratio_to_bf16": 0.3},
        {"scheme": "kivi", "bits": 2, "policy": "p", "loss": 2.2, "loss_delta": 0.2, "bytes_per_token_bf16": 2,
         "ratio_to_bf16": 0.2}],
        "passkey": {"full:16": {"policy": "p", "accuracy": {"1024": 1.0, "2048": 0.95}}}}
    js, png = E.write(res, tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "kivi" in E.format_table(res) and "100 95" in E.format_table(res)


def test_shared_prefix_passkey_feeds_each_prompt(tiny, monkeypatch):
    # Record what each branch's cache ends up holding: exactly the prompt, token for token, then the
    # generated tokens one at a time (the last one is only predicted).
    tok = _CharTok()
    ts = E.passkey_trials([400], 3, seed=2)
    seen = []
    real_fork = E._fork

    def fork(cache, model, policy):
        new = real_fork(cache, model, policy)
        seen.append(new)
        return new
    monkeypatch.setattr(E, "_fork", fork)
    fed = []
    real_forward = E._forward
    monkeypatch.setattr(E, "_forward", lambda m, ids, cache, keep=0: (fed.append((id(cache), ids[0].tolist())),
                                                                      real_forward(m, ids, cache, keep))[1])
    shared = E.passkey_retrieved_shared(tiny, tok, ts, Policy.kivi(2, residual=16), chunk=64)
    trunk = [ids for c, ids in fed if c not in {id(s) for s in seen}]
    for t, branch in zip(sorted(ts, key=lambda t: t.depth), seen):
        prompt, _ = E.passkey_prompt(tok, t)
        mine = [ids for c, ids in fed if c == id(branch)]
        n = int(branch.layers[0].cumulative_length)
        head = sum(trunk, [])[:n - sum(map(len, mine))]
        assert (head + sum(mine, []))[:len(prompt)] == prompt  # the prompt, then the generated tokens
        assert n == len(prompt) + sum(len(ids) == 1 for ids in mine)
    monkeypatch.undo()
    assert E.passkey_retrieved_shared(tiny, tok, ts, Policy.full()) == E.passkey_retrieved(tiny, tok, ts,
                                                                                          Policy.full())


def _fresh_logprobs(model, tok, trials, policy, chunk):
    """Each trial alone, from an empty cache: the protocol without any sharing."""
    out = []
    for t in trials:
        prompt, _ = E.passkey_prompt(tok, t)
        cache = E.make_cache(model, policy, t.length)
        out.append(E._answer(model, tok, torch.tensor([prompt]), cache, t.key, chunk)[2])
    return out


@pytest.mark.parametrize("policy", slow_after(1, [Policy.kivi(2, residual=16, sink=2), Policy.fp8(residual=8)]),
                         ids=str)
def test_shared_trunk_gives_the_numbers_of_separate_runs_when_quantized(tiny, policy):
    # The trunk must stop at a chunk boundary: a prefill split at the needle instead would store (and attend
    # to) other values than the protocol's aligned chunks, and quantized results would depend on the depth.
    tok = _CharTok()
    ts = E.passkey_trials([700], 4, seed=5)
    det = {}
    E.passkey_retrieved_shared(tiny, tok, ts, policy, chunk=128, details=det)
    assert {det[i]["needle"][0] // 128 for i in range(4)} != {0}  # some trials did share a trunk
    want = _fresh_logprobs(tiny, tok, ts, policy, 128)
    assert [det[i]["logprob"] for i in range(4)] == pytest.approx(want, abs=1e-5)


def test_passkey_layout_and_needle_region(tiny):
    tok = _CharTok()
    shallow, deep = E.PasskeyTrial(600, 0.0, 11111), E.PasskeyTrial(600, 0.999, 22222)
    for t in (shallow, deep):
        prompt, answer, a, b = E.passkey_layout(tok, t)
        assert "".join(chr(c) for c in prompt[a:b]).strip().startswith(f"The pass key is {t.key}.")
    pol = Policy.kivi(2, residual=64, sink=4)
    cache = E.make_cache(tiny, pol, 610)
    a, b = E.passkey_layout(tok, shallow)[2:]
    assert E.needle_region(cache, a, b, 600) == "packed"
    a, b = E.passkey_layout(tok, deep)[2:]
    assert E.needle_region(cache, a, b, 600) == "residual"  # the needle is among the 64 recent tokens
    assert E.needle_region(cache, 2, 20, 600) == "sink"
    assert E.needle_region(E.make_cache(tiny, Policy.full(), 606), a, b, 600) == "full"
    # one quantized layer holding it in its residual is enough to say "residual"
    mixed = E.make_cache(tiny, Policy.kivi(2, residual=0).override({1: Policy.kivi(2, residual=64)}), 606)
    assert E.needle_region(mixed, a, b, 600) == "residual"


def test_passkey_details_are_recorded(tiny):
    tok = _CharTok()
    det = {}
    acc = E.passkey_accuracy(tiny, tok, Policy.kivi(2, residual=16), lengths=[400], trials=3, chunk=64, details=det)
    assert list(det) == [400] and len(det[400]) == 3
    assert acc[400] == sum(d["hit"] for d in det[400]) / 3
    assert all(d["region"] in ("packed", "residual") and d["logprob"] <= 0 and d["answer"] for d in det[400])
    assert E.packed_accuracy(det[400])[1] == sum(d["region"] == "packed" for d in det[400])


def test_k3v2_scheme_stays_within_the_bytes_of_2bit_kivi():
    from kvcompile.accounting import bytes_per_token
    k3v2, kivi2 = E.scheme_policy("kivi-k3v2", 2), E.scheme_policy("kivi+rot+sink", 2)
    assert E.scheme_policy("kivi-k3v2", 4) is None
    for L in (1024, 1030, 2048, 4096, 8192, 8198):
        assert bytes_per_token(k3v2, 30, 3, 64, L) <= bytes_per_token(kivi2, 30, 3, 64, L)


def test_merge_joins_passkey_lengths_of_one_protocol():
    def run(lengths, chunk=2048, acc=1.0):
        return {"rows": [], "passkey": {"kivi:2": {"policy": "p", "trials": 20, "prefill_chunk": chunk,
                                                   "accuracy": {str(L): acc for L in lengths},
                                                   "trials_detail": {str(L): [] for L in lengths}}}}
    m = E.merge([run([1024, 4096]), run([2048], acc=0.5)])
    assert m["passkey"]["kivi:2"]["accuracy"] == {"1024": 1.0, "2048": 0.5, "4096": 1.0}
    assert list(m["passkey"]["kivi:2"]["trials_detail"]) == ["1024", "2048", "4096"]
    m = E.merge([run([1024]), run([2048], chunk=64)])  # another protocol replaces, never mixes
    assert m["passkey"]["kivi:2"]["accuracy"] == {"2048": 1.0}


@pytest.mark.slow
def test_pre_rope_rows_are_measured_through_the_applied_model(tiny):
    """``kvcompile eval`` measures a pre_rope policy through ``compiled_copy`` (only the pass stores keys before
    the rotary embedding): in full precision that is the model's own loss, quantized it is not post-RoPE's,
    and the eager cache path refuses the policy instead of silently storing rotated keys."""
    W = torch.randint(0, 512, (2, 96))
    full = E.heldout_loss(tiny, W, Policy.full(), chunk=16)
    pre_full = Policy(pre_rope=True)
    got = E.heldout_loss(E.compiled_copy(tiny, pre_full), W, pre_full, chunk=16, fast=False)
    assert got == pytest.approx(full, abs=1e-5)
    post = Policy.kivi(2, group=16, residual=8)
    pre = Policy.kivi(2, group=16, residual=8, pre_rope=True)
    assert E.stores_pre_rope(pre) and not E.stores_pre_rope(post)
    q_pre = E.heldout_loss(E.compiled_copy(tiny, pre), W, pre, chunk=16, fast=False)
    q_post = E.heldout_loss(tiny, W, post, chunk=16)
    assert all(math.isfinite(x) for x in q_pre) and q_pre != pytest.approx(q_post, abs=1e-6)
    assert E.heldout_loss(tiny, W, Policy.full(), chunk=16) == full  # the copy left the model as it was
    with pytest.raises(PolicyError, match="fast eager cache cannot store keys before the rotary embedding") as e:
        E.heldout_loss(tiny, W, pre, chunk=16)
    assert type(e.value) is PolicyError


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A random Gemma 3 whose layers alternate a sliding window of 32 tokens and full attention, saved."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, initializer_range=0.05,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sliding")
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("policy", [Policy.int8(), Policy.kivi(4, group=16, residual=0, rotate=True),
                                    Policy.kivi(4, group=16, residual=8, sink=2)], ids=str)
def test_stored_loss_reads_sliding_window_layers_as_stored_too(sliding, policy):
    """``own="stored"`` measures what kvcompile inside vLLM computes, whose pages hold the sliding-window layers'
    windows too (where the policy's window cache is shorter than the window): the evaluation's cache keeps those
    layers as stores (``own="full"``, kvcompile's own engines: transformers' full-precision ring where smaller), and
    the loss is the independent reference's (tests/stored_reference.py), not that of the model whose sliding-window
    layers read every position in full precision."""
    from stored_reference import stored_loss
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    W = torch.randint(0, 512, (2, 160), generator=torch.Generator().manual_seed(1))
    kinds = {own: [type(layer).__name__ for layer in E._EvalCache(model.config, policy, 160, own).layers]
             for own in ("stored", "full")}
    assert kinds["stored"] == ["_EvalLayer"] * 4
    if policy == Policy.int8():  # at 160 tokens the ring of 32 holds fewer bytes than the store
        assert kinds["full"] == ["RingLayer", "_EvalLayer"] * 2
    got = E.heldout_loss(model, W, policy, chunk=16, own="stored")
    want = stored_loss(sliding, W, policy)
    assert got == pytest.approx(want, abs=3e-4)  # chunks against one forward: float32 sums, now and then a code
    kept = stored_loss(sliding, W, policy, sliding_in_full=True)
    near, far = (max(abs(a - b) for a, b in zip(got, ref)) for ref in (want, kept))
    assert far > 3 * near, (near, far)  # the sliding-window layers' quantization is in what was measured


def test_stored_loss_of_a_per_layer_policy_beside_sliding_window_layers(sliding):
    # each layer read as its own policy stores it (a sliding-window layer in full precision, another int8 beside
    # KIVI's ring and 4-bit full-attention layers): what the vLLM plugin computes under a per-layer policy
    from stored_reference import stored_loss
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    W = torch.randint(0, 512, (2, 160), generator=torch.Generator().manual_seed(1))
    policy = Policy(Quant("int4"), Quant("int4"), rotate=True).override(
        {0: None, 2: Policy.int8(), 3: Policy.kivi(4, group=16, residual=0, rotate=True)})
    got = E.heldout_loss(model, W, policy, chunk=16, own="stored")
    assert got == pytest.approx(stored_loss(sliding, W, policy), abs=3e-4)
    base = stored_loss(sliding, W, policy.base())
    assert max(abs(a - b) for a, b in zip(got, base)) > 1e-3  # the overrides are in what was measured


def test_a_window_cache_as_long_as_the_sliding_window_keeps_the_ring(sliding):
    # KIVI's 159 full-precision positions cover the window of 32: vLLM keeps the layer's own cache, and so does this
    model = transformers.AutoModelForCausalLM.from_pretrained(sliding, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    layers = E._EvalCache(model.config, Policy.kivi(4), 160, "stored").layers
    assert [type(layer).__name__ for layer in layers] == ["RingLayer", "_EvalLayer"] * 2
