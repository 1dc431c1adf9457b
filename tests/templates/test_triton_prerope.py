"""The Triton attention kernel on pre-RoPE keys (``Policy.pre_rope``): it rotates each key it reads by its position
(``kvcompile.store.apply_rope``) in all four of its loops -- sinks, packed codes, the queries' own chunk, the ring.

Runs through Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), on CUDA if present.
Two kinds of check: the rotation itself (``_rope_tile``, what every loop calls on the tile it has formed) equals
``apply_rope`` bit for bit; and whole calls equal float64 attention over the reference's rotated keys within
``reference_and_bound``'s derived bound (about 1e-6 relative: a key rotated by the wrong position, partner or
cos/sin row fails it, as ``test_the_bound_sees_a_rotation_off_by_one_position`` shows).
"""
import copy
import math

import pytest
import torch
import triton
import triton.language as tl

import kvcompile
from kvcompile import Policy, Quant
from kvcompile.store import LayerSpec, Rope, apply_rope, rope_pairing
from kvcompile.templates import attention as kattn
from kvcompile.templates import launch
from kvcompile.templates.common import run
from attention_checks import filled
from tiers import slow_after

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_rope(form, rd, D, T, offsets, seed=0):
    """A ``Rope`` over ``T`` rotary positions: random angles on the first ``rd`` channels (the form's signs on
    the sines, as ``RopeTable`` stores them), cos 1 and sin 0 past them; ``offsets`` per sequence."""
    perm, sign = rope_pairing(form, rd, D)
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(T, rd, generator=g) * (2 * math.pi)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    cos[:, :rd] = theta.cos()
    sin[:, :rd] = theta.sin() * torch.tensor(sign[:rd])
    return Rope(cos, sin, torch.tensor(perm, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32))


def to_dev(rope):
    return Rope(*[t.to(DEV) for t in rope])


def check(q, state, spec, rope, tiles=None, chunk=(None, None), mask=None):
    """The kernel with ``rope`` within the derived bound of float64 attention over the reference's rotated keys,
    elementwise. Returns the kernel's output (on the CPU)."""
    B, Hq, n, D = q.shape
    nsplit = (tiles or kattn.default_tiles(spec, n, Hq // spec.heads, torch.device(DEV), B,
                                           kattn.position_bound(state, spec, mask)))[2]
    k_new, v_new = (None if x is None else x.to(DEV) for x in chunk)
    got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                           None if mask is None else mask.to(DEV), tiles=tiles, k_new=k_new, v_new=v_new,
                           rope=to_dev(rope)).cpu()
    assert got.dtype == q.dtype and got.shape == q.shape
    want, bound = kattn.reference_and_bound(q, state, spec, mask, nsplit=nsplit,
                                            dot=launch.dot_precision(torch.device(DEV)), k_new=chunk[0],
                                            v_new=chunk[1], rope=rope)
    err = (got.double() - want).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst error "
                           f"{err[bad].max():.3g} vs bound {bound[bad][err[bad].argmax()]:.3g}; {spec.name}")
    return got


# (policy, head_dim, rope form, rotary dims, gqa, prefill length (> residual: the chunk is read), offsets)
CASES = [
    # KIVI int2: per-channel keys, sinks and a ring; whole-head "half"; offsets past both ends of the table
    (Policy.kivi(2, group=16, residual=8, sink=2, pre_rope=True), 32, "half", 32, 2, 10, (0, -3, 6)),
    # int4 per-channel keys; values Hadamard-rotated (keys never are, pre-RoPE); partial "pairs"
    (Policy(Quant("int4", "channel", 16), Quant("int4", "token", 16), residual=4, rotate=True, pre_rope=True),
     32, "pairs", 16, 1, 6, (2, 0, -1)),
    # fp8 keys, no ring (every token packed); head_dim 48 (a padded tile: channels 48..63), partial "half"; GQA 3
    (Policy.fp8(residual=0, sink=1, pre_rope=True), 48, "half", 24, 3, 3, (-2, 1, 0)),
    # int8 per-token keys with a ring; whole-head "pairs"; GQA 4
    (Policy(Quant("int8", "token"), Quant("int8", "token"), residual=3, pre_rope=True), 16, "pairs", 16, 4, 5,
     (1, 1, -4)),
]
LENGTHS = [4, 29, 43]


@pytest.mark.parametrize("case", slow_after(1, CASES, several=False),
                         ids=lambda c: f"{c[0].key_str()}-{c[2]}{c[3]}of{c[1]}")
def test_triton_pre_rope_attention_equals_float64_attention(case):
    """Decode (split-K: one and three splits) and chunked prefill reading its own chunk, over ragged rows that
    cross the sinks, packed blocks and the ring, with per-sequence rotary offsets (some keys' positions clamp to
    the table's first row, some to its last)."""
    policy, D, form, rd, G, n, offsets = case
    H = 2
    B = len(LENGTHS)
    T = max(LENGTHS) - 2  # the longest row's last positions (and offset 6) clamp to row T - 1
    rope = make_rope(form, rd, D, T, offsets, seed=D + rd)
    g = torch.Generator().manual_seed(D * G)
    spec, state, *chunk1 = filled(policy, LENGTHS, H, D, own=1)
    assert spec.policy.pre_rope and not spec.policy.rotates_keys
    q = torch.randn(B, H * G, 1, D, generator=g)
    check(q, state, spec, rope, tiles=(1, 16, 1), chunk=chunk1)
    check(q, state, spec, rope, tiles=(1, 16, 3), chunk=chunk1)
    spec, state, *chunk = filled(policy, LENGTHS, H, D, own=n)
    check(torch.randn(B, H * G, n, D, generator=g), state, spec, rope, chunk=chunk)


def test_triton_pre_rope_attention_with_a_mask_and_the_models_dtype():
    """A boolean mask and bf16 queries and store (the sinks, ring and chunk hold bf16 keys, rotated in fp32)."""
    policy = Policy.kivi(4, group=16, residual=5, sink=2, pre_rope=True)
    D, H, G = 32, 1, 2
    spec, state, *chunk = filled(policy, LENGTHS, H, D, "bfloat16", own=7)
    rope = make_rope("half", D, D, 64, (0, 3, -2), seed=3)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(len(LENGTHS), 1, 7, 50, generator=g) > 0.3
    check(torch.randn(len(LENGTHS), H * G, 7, D, generator=g).bfloat16(), state, spec, rope, chunk=chunk, mask=mask)


def test_the_bound_sees_a_rotation_off_by_one_position():
    """The check is sharp enough to fail: the kernel's result is outside the bound of attention over keys
    rotated one position off, or not rotated at all."""
    policy = CASES[0][0]
    D, H = 32, 2
    spec, state = filled(policy, LENGTHS, H, D)
    rope = make_rope("half", D, D, 64, (0, 0, 0))
    q = torch.randn(len(LENGTHS), H, 1, D, generator=torch.Generator().manual_seed(2))
    got = check(q, state, spec, rope, tiles=(1, 16, 2))
    shifted = rope._replace(offset=rope.offset + 1)
    for other in (shifted, None):
        want, bound = kattn.reference_and_bound(q, state, spec, nsplit=2, rope=other,
                                                dot=launch.dot_precision(torch.device(DEV)))
        assert ((got.double() - want).abs() > bound).any()
    # one sequence shifted: only its rows leave the bound
    one = rope._replace(offset=torch.tensor([0, 1, 0], dtype=torch.int32))
    want, bound = kattn.reference_and_bound(q, state, spec, nsplit=2, rope=one,
                                            dot=launch.dot_precision(torch.device(DEV)))
    out = ((got.double() - want).abs() > bound).flatten(1).any(1)
    assert out.tolist() == [False, True, False]


# --------------------------------------------------------------------------- the rotation, bit for bit
@triton.jit
def _rope_rows_kernel(k_ptr, o_ptr, p0, N, b, rcos, rsin, rperm, roff, T,
                      D: tl.constexpr, DB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``p0 .. p0 + N - 1`` of sequence ``b`` (``k [N, D]``), loaded as the attention kernel loads a tile
    (padded to DB channels) and rotated by the kernel's own helpers."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, DB)
    ok = (i < N)[:, None] & (c < D)[None, :]
    k = tl.load(k_ptr + i[:, None] * D + c[None, :], mask=ok, other=0.0)
    perm = kattn._rope_perm(rperm, D, DB)
    k = kattn._rope_tile(k, p0 + i, tl.load(roff + b), rcos, rsin, perm, T, D, DB, BLOCK_N)
    tl.store(o_ptr + i[:, None] * D + c[None, :], k, mask=ok)


def kernel_rope_rows(k, rope, p0, b, block_n=16):
    N, D = k.shape
    rt = kattn.rope_tensors(rope, rope.offset.numel(), D, torch.device(DEV))
    out = torch.empty(N, D, device=DEV)
    run(_rope_rows_kernel, (triton.cdiv(N, block_n),),
        dict(k_ptr=k.to(DEV).contiguous(), o_ptr=out, p0=p0, N=N, b=b, rcos=rt[0], rsin=rt[1], rperm=rt[2],
             roff=rt[3], T=rt[0].shape[0], D=D, DB=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n))
    return out.cpu()


@pytest.mark.parametrize("form,rd,D", [("half", 48, 48), ("half", 20, 48), ("pairs", 48, 48), ("pairs", 6, 48),
                                       ("half", 64, 64), ("pairs", 32, 64), ("reversed", 64, 64)])
def test_rope_tile_rotates_keys_as_apply_rope_bit_for_bit(form, rd, D):
    """The rotation every loop of the kernel applies: exactly ``apply_rope``'s fp32 products and sum, for whole
    and partial rotary dims, a padded tile (head_dim 48 in 64 lanes), any partner permutation, and positions
    whose rotary index clamps to either end of the table."""
    T, N = 40, 50
    g = torch.Generator().manual_seed(rd + D)
    if form == "reversed":  # no form the pass knows: a partner permutation taken as given
        perm = torch.arange(D - 1, -1, -1, dtype=torch.int32)
        rope = Rope(torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), perm,
                    torch.tensor([0, -3], dtype=torch.int32))
    else:
        rope = make_rope(form, rd, D, T, (0, -3), seed=rd)
        rope = rope._replace(cos=rope.cos * 1.5)  # not a rotation: any cos/sin table rounds alike
    k = torch.randn(N, D, generator=g) * torch.logspace(-20, 20, D)
    for b, p0 in ((0, 5), (1, 0)):  # positions 5..54 past T (clamped), and 0..49 from -3 (clamped to 0)
        want = apply_rope(k.expand(2, 1, N, D), rope, torch.arange(p0, p0 + N))[b, 0]
        got = kernel_rope_rows(k, rope, p0, b)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()
        assert not torch.equal(got, k)


def test_rope_tables_are_checked():
    rope = make_rope("half", 16, 16, 8, (0, 0))
    dev = torch.device(DEV)
    with pytest.raises(ValueError, match="rope tables must be"):
        kattn.rope_tensors(rope, 3, 16, dev)  # offsets for 2 sequences, a batch of 3
    with pytest.raises(ValueError, match="rope tables must be"):
        kattn.rope_tensors(rope._replace(sin=rope.sin[:, :8]), 2, 16, dev)
    with pytest.raises(ValueError, match="empty"):
        kattn.rope_tensors(rope._replace(cos=rope.cos[:0], sin=rope.sin[:0]), 2, 16, dev)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="partner channel"):
            kattn.rope_tensors(rope._replace(perm=rope.perm + 1), 2, 16, dev)
    cos, sin, perm, off = kattn.rope_tensors(rope._replace(perm=rope.perm.long(), cos=rope.cos.double()), 2, 16, dev)
    assert cos.dtype == torch.float32 and perm.dtype == torch.int32 and off.dtype == torch.int32
    key, kw = kattn.attention_config(CASES[0][0], 32, 2, 16, 8, 16, 2, 1, 16, True, 0, "ieee", False, True)
    assert key.endswith(";rope=1]") and kw["ROPE"]
    assert not kattn.attention_config(CASES[0][0], 32, 2, 16, 8, 16, 2, 1, 16, True, 0, "ieee")[1]["ROPE"]
    launch.check_supported(LayerSpec(Policy.kivi(2, pre_rope=True), 2, 64))  # no longer refused


# --------------------------------------------------------------------------- the compiled model
@pytest.mark.slow
def test_compiled_pre_rope_model_on_triton_kernels_equals_the_reference_kernels(monkeypatch):
    """A tiny Llama applied with a quantized pre_rope policy: prefill then decode on the Triton kernels (the
    interpreter on the CPU) gives the reference kernels' logits and tokens, and the kernel was handed the
    cache's rotary tables."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attn_implementation="sdpa")
    base = LlamaForCausalLM(cfg).eval().to(DEV)
    pol = Policy.kivi(2, group=16, residual=4, sink=1, pre_rope=True)
    ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEV)
    calls = []
    real = kattn.launch_attention

    def spy(*a, **kw):
        calls.append(a[8] if len(a) > 8 else kw.get("rope"))
        return real(*a, **kw)

    monkeypatch.setattr(kattn, "launch_attention", spy)
    outs = {}
    for kern in ("triton", "reference"):
        m = copy.deepcopy(base)
        kvcompile.apply(m, pol, compiler="eager")
        kvcompile.ops.set_kernels(kern)
        try:
            with torch.no_grad():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        finally:
            kvcompile.ops.set_kernels("auto")
        outs[kern] = out
        assert [s.keys for s in kvcompile.explain(m).sites] == ["pre-RoPE (half:16)"] * 2
    assert calls and all(isinstance(r, Rope) for r in calls)  # every Triton call read pre-RoPE keys
    assert outs["triton"].sequences.tolist() == outs["reference"].sequences.tolist()
    for x, y in zip(outs["triton"].logits, outs["reference"].logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
