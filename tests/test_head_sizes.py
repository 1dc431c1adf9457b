"""The presets on transformers models whose heads are not a power of two, applied as a user would: a Phi-style
model (head_dim 80, partial rotary: Phi-2's head) and a Phi-3-style one (head_dim 96: Phi-3-mini's). KIVI's
default value group fits the head and the rotation is block-diagonal (tests/templates/test_kernels_head_sizes.py checks
every kernel family at every head size); here the whole path runs: the pass, the C kernels, generate.

Under Policy.full() the unmodified model's tokens and logits; with one layer quantized, compiled equals the
eager reference cache (as tests/passes/test_model_families.py, whose reason for one layer holds here); with
every layer quantized, within the bound of test_generate's quantized-policy test.
"""
import pytest
import torch
import transformers

import kvcompile
from kvcompile import Policy
from kvcompile.hf import KVCompileCache
from kvcompile.hf_model import cache_kwarg

CONFIGS = {
    "phi-80": ("Phi", dict(hidden_size=160, num_attention_heads=2, num_key_value_heads=2)),
    "phi3-96": ("Phi3", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1)),
}
PRESETS = {"kivi2": Policy.kivi(2), "kivi3+sink+rot": Policy.kivi(3, sink=4, rotate=True),  # fitted groups, blocks
           "fp8-tensor+rot": Policy.fp8(residual=0, axis="tensor", rotate=True)}  # no scale stored, rotated in blocks
PROMPT = torch.randint(3, 64, (1, 180), generator=torch.Generator().manual_seed(0))  # past the 128-token window
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)


def tiny(name):
    family, sizes = CONFIGS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=64, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa", **sizes)
    return getattr(transformers, f"{family}ForCausalLM")(cfg).eval()


def twin(model):
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    return other


def logits(out):
    return torch.stack(out.logits)


@pytest.mark.parametrize("name", CONFIGS)
def test_full_policy_gives_the_unmodified_models_tokens(name):
    model = tiny(name)
    ref = twin(model)
    kvcompile.apply(model, Policy.full())
    with torch.no_grad():
        want, got = ref.generate(PROMPT, **GEN), model.generate(PROMPT, **GEN)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(logits(got), logits(want))


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", CONFIGS)
def test_a_quantized_layer_compiled_equals_the_eager_reference(name, preset):
    policy = Policy.full().override({0: PRESETS[preset]})
    model = tiny(name)
    ref = twin(model)
    with torch.no_grad():
        want = ref.generate(PROMPT, **GEN, **{cache_kwarg(ref): KVCompileCache(ref.config, policy)})
        got = kvcompile.apply(model, policy, compiler="eager").generate(PROMPT, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(logits(got), logits(want))
    spec = got.past_key_values.layers[0].spec  # the layout layer 0's store has: this head's, groups resolved
    assert spec.head_dim == {"phi-80": 80, "phi3-96": 96}[name] and spec.policy == PRESETS[preset].for_head_dim(
        spec.head_dim)
    assert len(kvcompile.explain(model).sites) == 2  # both layers rewritten (layer 1 stored in full precision)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_every_layer_quantized_stays_within_the_bound(name):
    model = tiny(name)
    ref = twin(model)
    kvcompile.apply(model, Policy.kivi(4, sink=4, rotate=True))
    with torch.no_grad():
        want, got = ref.generate(PROMPT, **GEN), model.generate(PROMPT, **GEN)
    err = (logits(got) - logits(want)).abs().max()
    assert err < 0.05 * logits(want).abs().max(), err
