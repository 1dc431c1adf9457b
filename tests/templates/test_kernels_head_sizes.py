"""Every preset at every head size of the supported families (80: Phi-2; 96: Phi-3-mini; 112, 120; 128, 256), in
every kernel family: stores bit for bit equal to the reference's, attention within the derived bound
(``kvcompile.templates.attention.reference_and_bound``; Inductor: the template's fp32 tolerance).

What a head that is not a power of two changes: KIVI's default value group fits the head (``Quant.fit``: 16
channels for 80 and 112, 32 for 96, 8 for 120), and the rotation is block-diagonal in blocks of the largest
power of two dividing the head (``kvcompile.store.rotation_block``). The kernels never rotate (the launchers
rotate in torch, as the reference does), so they see the layout only through the groups and ``D``.

The presets keep their formats, groups, sinks and rotation; their residual window is cut to 8 tokens so that
short rows reach packed storage (the window's length does not depend on the head).
"""
import dataclasses

import pytest
import torch

from kvcompile import Policy, PolicyError, Quant
from kvcompile.store import KVStore, LayerSpec, attention_reference, hadamard, rotation_block
from kvcompile.templates import cpu, cpu_store, inductor

from attention_checks import filled
from store_checks import assert_same_store, scrambled
from tiers import slow_after

PRESETS = {"kivi2": Policy.kivi(2), "kivi3+sink+rot": Policy.kivi(3, sink=4, rotate=True),
           "kivi4+rot": Policy.kivi(4, rotate=True), "kivi8": Policy.kivi(8), "fp8": Policy.fp8(),
           "fp8-tensor": Policy.fp8(axis="tensor"), "int8+rot": Policy.int8(rotate=True), "full": Policy.full()}
HEADS = (80, 96, 112, 120, 128, 256)
LENGTHS = [1, 30, 77, 100]  # one row in the window only, the others across flushes and blocks


def short_window(policy):
    return dataclasses.replace(policy, residual=min(policy.residual, 8))


def test_the_presets_fit_every_head():
    """KIVI's default value group (32) shrinks to the largest power of two that divides the head; a group given
    explicitly is kept, or refused where it does not divide; the rotation's blocks are that power of two."""
    for D in HEADS:
        fitted = {80: 16, 112: 16, 120: 8}.get(D, 32)
        for name, p in PRESETS.items():
            spec = LayerSpec(p, 2, D)
            assert spec.policy.value.group_for(D) == (fitted if name.startswith("kivi") else D)
            assert not spec.policy.value.fit  # the layout a store uses names its resolved groups
        assert rotation_block(D) == {80: 16, 96: 32, 112: 16, 120: 8}.get(D, D)
    assert LayerSpec(Policy.kivi(4), 2, 80).name.startswith("k=int4.channel.32.asym.f16;v=int4.token.16.asym")
    with pytest.raises(PolicyError, match=r"group=32 does not divide head_dim=80"):
        LayerSpec(Policy.kivi(4, group=32), 2, 80)


@pytest.mark.parametrize("D", HEADS)
def test_the_rotation_is_orthonormal_and_block_diagonal(D):
    H = hadamard(D, dtype=torch.float64)
    b = rotation_block(D)
    assert torch.allclose(H @ H, torch.eye(D, dtype=torch.float64), atol=1e-12) and torch.equal(H, H.T)
    assert torch.equal(H, torch.block_diag(*[H[:b, :b]] * (D // b)))  # no channel mixes with another block
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < b:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    assert torch.equal(H[:b, :b], sylvester / b ** 0.5)  # each block (a power of two: the whole head) is Sylvester's


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stores_match(kernel, policy, D, seed=0, triton=False):
    """The same appends (a prefill in chunks, then decode steps) through the reference and through ``kernel``
    (a Triton kernel's store and inputs on DEV), into scrambled blocks: equal bit for bit after each."""
    spec = LayerSpec(short_window(policy), 2, D)
    ref = scrambled(spec, 3, 3 * (spec.blocks_for(110) + 1), seed)
    got = ref.copy(DEV if triton else "cpu")
    g = torch.Generator().manual_seed(seed)
    for n in (33, 40, 1, 1, 30):
        k = torch.randn(3, 2, n, D, generator=g)
        k[..., 3] *= 8
        v = torch.randn(3, 2, n, D, generator=g)
        ref.append(k, v)
        got.append(k.to(DEV if triton else "cpu"), v.to(DEV if triton else "cpu"), kernel=kernel)
        assert_same_store(ref.state, got.state, ref.spec)


# Every preset at Phi-2's and Phi-3-mini's heads; at the other heads the presets whose layouts differ most (int3's
# eight-code units with sinks and rotation, int2, fp8 per head): each case builds its own C kernels (seconds each
# in CI), and powers of two are the other kernel tests' shapes already.
C_CASES = ([(name, D) for D in (80, 96) for name in PRESETS]
           + [(name, D) for D in (112, 120) for name in ("kivi3+sink+rot", "kivi2", "fp8")]
           + [("kivi3+sink+rot", D) for D in (128, 256)])


@pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("name, D", slow_after(1, C_CASES))
def test_c_kernels_at_every_head_size(name, D):
    from test_cpu_kernels import check
    _stores_match(cpu_store.store, PRESETS[name], D)
    spec, state = filled(short_window(PRESETS[name]), LENGTHS, 2, D, chunk=33)
    g = torch.Generator().manual_seed(D)
    check(torch.randn(4, 4, 1, D, generator=g), state, spec)  # decode, GQA 2
    check(torch.randn(4, 4, 1, D, generator=g), state, spec, nsplit=3)
    check(torch.randn(4, 4, 3, D, generator=g), state, spec, prefill=True)


@pytest.mark.parametrize("D", slow_after(1, [80, 96]))
@pytest.mark.parametrize("name", slow_after(1, ["kivi2", "kivi3+sink+rot", "fp8", "int8+rot", "fp8-tensor"]))
def test_triton_kernels_at_non_power_of_two_heads(name, D):
    """Through Triton's interpreter on the CPU (about 15 s a case): the formats and groups that reach the
    kernels differently, each head padded to 128 channels (decode: the decode kernel's padded head, int3 aside;
    several queries: the general kernel's tile)."""
    from kvcompile.templates import launch
    from test_attention_kernel import check
    _stores_match(launch.store, PRESETS[name], D, triton=True)
    spec, state = filled(short_window(PRESETS[name]), LENGTHS, 2, D, chunk=33)
    g = torch.Generator().manual_seed(D)
    check(torch.randn(4, 4, 1, D, generator=g), state, spec)
    check(torch.randn(4, 4, 3, D, generator=g), state, spec)


@pytest.mark.parametrize("D", [80, 96, 120])
@pytest.mark.parametrize("name", PRESETS)
def test_inductor_attention_at_non_power_of_two_heads(name, D):
    from test_inductor_attention import TOL
    spec, state, k_new, v_new = filled(short_window(PRESETS[name]), LENGTHS, 2, D, chunk=33, own=1)
    g = torch.Generator().manual_seed(D)
    q = torch.randn(4, 4, 1, D, generator=g)
    expect = attention_reference(q, state, spec, None, None, torch.float64, k_new=k_new, v_new=v_new)
    got = inductor.attention(q, state, spec, None, None, k_new, v_new)
    assert (got.double() - expect).abs().max() <= TOL * (1 + expect.abs().max())


def test_a_store_of_a_fitted_preset_is_a_store_of_its_resolved_groups():
    """A store made with KIVI's default group at head 80 holds exactly what one with values in groups of 16 holds."""
    g = torch.Generator().manual_seed(0)
    fitted = short_window(Policy.kivi(4))
    explicit = dataclasses.replace(fitted, value=Quant("int4", "token", 16))
    a, b = KVStore(LayerSpec(fitted, 2, 80), 1), KVStore(LayerSpec(explicit, 2, 80), 1)
    assert a.spec == b.spec
    k, v = torch.randn(1, 2, 70, 80, generator=g), torch.randn(1, 2, 70, 80, generator=g)
    a.append(k, v)
    b.append(k, v)
    assert_same_store(a.state, b.state, a.spec)
