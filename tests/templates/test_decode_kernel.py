"""The bandwidth decode kernel (``templates.decode``) against float64 attention over the reference store.

The bound is ``templates.attention.reference_and_bound(..., decode=True)``: derived from the kernel's bf16
operands and fp32 accumulation (``launch.reference_and_bound`` picks it for whatever ``launch.attention``
runs). Every layout the kernel serves is drawn: fp8, int8, int4, int2; scales on the score and probability
tiles (one scale per token-head) and per element (per-channel keys and values, token groups, fp32 scales);
sinks, a residual ring, the query's own token from the chunk; masks; tiles that lie in one block and tiles
that span several; splits.
"""
import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile.errors import ArgumentError, UnsupportedError
from kvcompile.store import attention_reference
from kvcompile.templates import decode, launch
from attention_checks import filled
from nonfinite_checks import assert_nan_pattern
from store_checks import bad_store, scrambled
from tiers import slow_after

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def check(q, state, spec, mask=None, scale=None, tiles=None, chunk=(None, None)):
    """The decode kernel's output within its derived bound of float64 attention, elementwise, with exactly the
    reference's NaN pattern."""
    k_new, v_new = (None if x is None else x.to(DEV) for x in chunk)
    got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                           None if mask is None else mask.to(DEV), scale, tiles=tiles, k_new=k_new, v_new=v_new,
                           kernel="decode").cpu()
    assert got.dtype == q.dtype and got.shape == q.shape
    want, bound = launch.reference_and_bound(q, state, spec, mask, scale, tiles=tiles, k_new=chunk[0],
                                             v_new=chunk[1], kernel="decode", device=DEV)
    assert torch.equal(got.isnan(), want.isnan()), spec.name
    ok = ~want.isnan()
    err = (got.double() - want).abs()
    bad = ok & (err > bound)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs outside the bound; worst error "
                           f"{err[bad].max():.3g} vs bound {bound[bad][err[bad].argmax()]:.3g}; {spec.name}")
    return err, bound


TOK = dict(axis="token")
LAYOUTS = [  # (policy, head_dim, G): every mode and format; ragged rows around tile and split boundaries
    (Policy(Quant("fp8_e4m3", **TOK), Quant("fp8_e4m3", **TOK), residual=0), 64, 4),
    (Policy(Quant("fp8_e5m2", **TOK), Quant("int8", "token", None, True), residual=3, sink=2), 64, 3),
    (Policy(Quant("int8", **TOK), Quant("int8", **TOK), residual=0), 64, 1),
    (Policy(Quant("int4", **TOK), Quant("int4", **TOK), residual=0), 64, 8),
    # int4 / int2 codes read as words and halfwords at head_dim 128 (decode.key_words, value_words)
    (Policy(Quant("int4", **TOK), Quant("int4", **TOK), residual=2, sink=1), 128, 4),
    (Policy(Quant("int2", **TOK), Quant("int4", "token", None, True), residual=0), 128, 2),
    (Policy(Quant("int2", **TOK), Quant("int2", "token", None, True), residual=0), 64, 2),
    (Policy.kivi(4, group=16, residual=8, sink=2), 64, 4),  # per-channel keys, token groups of 16
    (Policy.kivi(2, group=32, residual=0), 128, 4),  # values in 8-byte groups: GROUPS, 4 rows; keys: CHAN
    (Policy.kivi(4, group=32, residual=0), 64, 4),  # values in token groups of 32: GROUPS; keys: CHAN
    (Policy.kivi(4, group=32, residual=4, sink=1), 128, 8),  # GROUPS' codes as halfwords
    (Policy.kivi(2, group=32, residual=0, sink=1), 64, 3),  # 3 rows padded to 4 beside CHAN and GROUPS
    # values in groups of 8 columns beside keys on tiles: GROUPS where ROWS cannot take them (8 x 4 rows)
    (Policy(Quant("int4", **TOK), Quant("int4", "token", 16), residual=1), 128, 4),
    (Policy(Quant("int8", "token"), Quant("fp8_e4m3", "token", 16, scale_dtype="fp8_e4m3"), residual=0), 64, 8),
    # keys per channel in token groups of 16 and 32 beside values per token-head: CHAN, fp8 scales and fp8 codes
    (Policy(Quant("int4", "channel", 16, scale_dtype="fp8_e4m3"), Quant("int2", "token"), residual=2, sink=1), 128,
     4),
    (Policy(Quant("fp8_e4m3", "channel", 32), Quant("fp8_e4m3", "token"), residual=0), 64, 2),
    (Policy(Quant("fp8_e4m3", "channel", 8), Quant("int8", "token", 16, True, "fp8_e4m3"), residual=0, sink=1), 64,
     2),
    (Policy(Quant("int4", "token", None, False, "fp8_e4m3"), Quant("int2", "channel", 16, False, "fp8_e4m3"),
            residual=0), 64, 2),  # fp8 scales with int8 zero points; per-channel values
    (Policy(Quant("int8", "token", 16, False, "float32"), Quant("fp8_e5m2", "token", 16, scale_dtype="float32"),
            residual=2), 32, 3),  # fp32 scales: elementwise
    # one fixed scale (1.0), none stored (axis="tensor"): on the tiles, as a per-token-head scale of 1
    (Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=0, sink=1), 64, 2),
    # values in small per-token groups: a row per query head and group (ROWS), heads padded to a power of two
    (Policy(Quant("int4", "token"), Quant("int4", "token", 16), residual=0), 64, 3),
    (Policy(Quant("fp8_e5m2", "token"), Quant("fp8_e4m3", "token", 8, scale_dtype="fp8_e4m3"), residual=2, sink=1),
     64, 1),
    (Policy(Quant("int8", "channel", 16), Quant("int2", "token", 8, False, "fp8_e4m3"), residual=0), 64, 2),
    (Policy(Quant("fp8_e5m2", "tensor"), Quant("fp8_e4m3", "tensor"), residual=3, rotate=True), 128, 4),
    # heads padded to a power of two (``decode.padded_head``): Phi-2's 80 and Phi-3's 96, int2 at 32 (slots of 8)
    (Policy(Quant("int8", **TOK), Quant("int8", **TOK), residual=0), 80, 2),
    (Policy(Quant("int4", **TOK), Quant("int4", **TOK), residual=2, sink=1), 96, 4),  # int4 keys as words
    (Policy.kivi(4, residual=8, sink=2), 80, 4),  # CHAN keys, GROUPS values in 16-groups: 5 of 8 groups real
    (Policy.kivi(2, residual=4), 96, 3),  # 3 value groups of 32, padded to 4
    (Policy(Quant("int4", **TOK), Quant("int4", "token", 16), residual=0), 80, 2),  # ROWS: 5 of 8 groups a head
    (Policy(Quant("int2", **TOK), Quant("fp8_e4m3", "tensor"), residual=3), 32, 1),
    (Policy(Quant("int8", "token", 16, False, "float32"), Quant("int4", "token", None, False, "float32"), residual=2),
     80, 3),  # fp32 scales: per element, a value scale a token-head over the padded head
    (Policy(Quant("int4", "channel", 4), Quant("int8", "channel", 16), residual=0), 96, 2),  # ELEM, per channel
    # CHAN keys beside ROWS values of at most 8 rows: 8 groups (5 real) a head at 80, 4 groups x 2 heads at 64
    (Policy.kivi(4, residual=3, sink=1), 80, 1),
    (Policy.kivi(2, group=16, residual=0), 64, 2),
]


@pytest.mark.parametrize("policy,D,G", slow_after(1, LAYOUTS), ids=[f"{p.key_str()}-D{d}-G{g}" for p, d, g in LAYOUTS])
def test_decode_kernel_grid(policy, D, G):
    lengths = [1, 15, 17, 40, 63]
    spec, state = filled(policy, lengths, 2, D)
    assert launch.plan(state, spec, (len(lengths), 2 * G, 1, D)).decode
    g = torch.Generator().manual_seed(D + G)
    q = torch.randn(len(lengths), 2 * G, 1, D, generator=g)
    check(q, state, spec)
    check(q.to(torch.bfloat16), state, spec, tiles=(1, 32, 2))  # a bf16 query: no rounding of the query
    keep = torch.rand(len(lengths), 1, 1, 70, generator=g) > 0.3
    check(q, state, spec, mask=keep, tiles=(1, 64, 1))
    soft = torch.where(torch.rand(1, 2 * G, 1, 50, generator=g) > 0.2, torch.randn(1, 2 * G, 1, 50, generator=g),
                       -torch.inf)
    check(q, state, spec, mask=soft, scale=0.3)


def test_chan_keys_on_256_token_tiles():
    """KIVI's keys (CHAN) on 256-token tiles over 32-token blocks, the tile the table gives them at GQA 4: the rows'
    offsets in their blocks recomputed every tile (fixed on shorter tiles); within the bound, one split or two."""
    for bits, D in ((4, 64), (2, 128)):
        spec, state = filled(Policy.kivi(bits, group=32, residual=0), [300, 530], 2, D)
        q = torch.randn(2, 8, 1, D, generator=torch.Generator().manual_seed(bits))
        check(q, state, spec, tiles=(1, 256, 1))
        check(q, state, spec, tiles=(1, 256, 2))


@st.composite
def quants(draw, D):
    fmt = draw(st.sampled_from(["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]))
    if fmt.startswith("fp8") and draw(st.integers(0, 2)) == 0:
        return Quant(fmt, "tensor")  # one fixed scale (1.0), none stored
    per = 8 // int(fmt[-1]) if fmt.startswith("int") else 1
    axis = draw(st.sampled_from(["token", "channel"]))
    if axis == "token":
        group = draw(st.sampled_from([None] + [g for g in (per, 8, 16, 32) if per <= g <= D and D % g == 0]))
    else:
        group = draw(st.sampled_from([1, 2, 4, 16]))
    sym = True if fmt.startswith("fp8") else draw(st.booleans())
    return Quant(fmt, axis, group, sym, draw(st.sampled_from(["float16", "float16", "float32", "fp8_e4m3"])))


@st.composite
def decode_cases(draw):
    D = draw(st.sampled_from([64, 128, 80, 96]))
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 0, 3, 16])),
                    sink=draw(st.sampled_from([0, 2])), rotate=draw(st.booleans()))
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 4, 8]))
    lengths = [draw(st.integers(1, 90)) for _ in range(B)]
    tiles = draw(st.sampled_from([None, (1, 16, 1), (1, 32, 2), (1, 64, 3), (1, 128, 1)]))
    mask = draw(st.sampled_from([None, None, "bool", "float"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    own = draw(st.booleans())
    block = draw(st.sampled_from([16, 64, 256]))  # tiles of 32-128 tokens span several 16-token blocks
    return policy, B, H, G, D, lengths, tiles, mask, dtype, own, block, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@settings(max_examples=12)
@given(decode_cases())
def test_decode_kernel_equals_float64_attention(case):
    policy, B, H, G, D, lengths, tiles, mask_kind, dtype, own, block, seed = case
    g = torch.Generator().manual_seed(seed)
    spec, state, *chunk = filled(policy, lengths, H, D, dtype, seed, own=1, block=block)
    C = max(lengths) + 4
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 1, C, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.where(torch.rand(1, H * G, 1, C, generator=g) > 0.3, torch.randn(C, generator=g), -torch.inf)
    q = torch.randn(B, H * G, 1, D, generator=g).to(spec.torch_dtype)
    check(q, state, spec, mask, scale=float(torch.rand((), generator=g)) + 0.05, tiles=tiles,
          chunk=chunk if own else (None, None))


@pytest.mark.parametrize("policy", slow_after(1, [
    Policy(Quant("int8", "channel", 4), Quant("int4", "token", 16), residual=3, sink=2),  # ELEM both
    Policy(Quant("fp8_e4m3", "token"), Quant("int4", "token"), residual=2, sink=1),  # TILE both
    Policy(Quant("int4", "channel", 4, scale_dtype="fp8_e4m3"), Quant("int8", "channel", 4, scale_dtype="fp8_e4m3"),
           residual=0, sink=2),  # fp8 scales: a poisoned group's scale byte is 0x7F
    Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=2, sink=1),  # NaN codes, no scale
    Policy(Quant("fp8_e5m2", "tensor"), Quant("fp8_e4m3", "tensor"), residual=0, rotate=True),
    # per-channel keys in groups of 16 (CHAN): a poisoned group's scale reaches the query scaled by it
    Policy(Quant("int4", "channel", 16, scale_dtype="fp8_e4m3"), Quant("int8", "token"), residual=0, sink=2),
    Policy(Quant("int4", "channel", 16), Quant("int4", "token", 16), residual=4),
]))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
def test_decode_kernel_non_finite_values_poison_what_the_reference_says(policy):
    """NaN, +inf and -inf keys and values in sinks, packed groups' edges and the residual ring: NaN exactly
    where ``attention_reference`` is (a poisoned group: its NaN scale), never inf, the rest within the bound;
    masks hide some of them."""
    _poisoned(policy, 32)


@pytest.mark.parametrize("policy", [
    Policy(Quant("int4", "channel", 16), Quant("int4", "token", 16), residual=4),  # CHAN keys, GROUPS values
    Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=2, sink=1),  # NaN codes, no scale
    Policy(Quant("int8", "channel", 4), Quant("int4", "token", 16), residual=3, sink=2),  # ELEM keys, ROWS values
])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_padded_heads_poisoned_positions_stay_in_their_own_channels(policy):
    """head_dim 80 over a padded head of 128: the channels and groups past the head's own are masked, so a
    poisoned group's NaN scale or an fp8 NaN code next to them (the next token's, the next group's) reaches no
    other output than ``attention_reference`` says."""
    _poisoned(policy, 80)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_padded_head_reads_no_code_of_the_next_token():
    """fp8 keys with no scale at head_dim 80: a token's padded channels lie where the next token's codes are. A
    NaN code there (the next token's first channel), hidden from every head by the mask, must leave the rows
    finite: the kernel reads zeros past the head's own channels (0 times NaN would be NaN)."""
    from kvcompile.store import LayerSpec
    D, L = 80, 40
    spec = LayerSpec(Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e4m3", "tensor"), residual=0), 1, D, "float32",
                     block_tokens=16)
    spec.register()
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 1, L, D, generator=g), torch.randn(2, 1, L, D, generator=g)
    k[:, :, 6, 0] = float("nan")  # token 6's first channel: token 5's padded channels read it
    store = scrambled(spec, 2, 8, seed=3)
    store.append(k, v, torch.tensor([L, L]))
    keep = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keep[..., 6] = False
    q = torch.randn(2, 2, 1, D, generator=g)
    assert launch.plan(store.state, spec, (2, 2, 1, D)).decode
    err, _ = check(q, store.state, spec, mask=keep)
    assert err.isfinite().all()


def _poisoned(policy, D):
    B, H, G, L = 2, 1, 2, 40
    spec, store, k, v = bad_store(policy, "float32", B, H, D, L)
    state = store.state
    assert launch.plan(state, spec, (B, H * G, 1, D)).decode
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H * G, 1, D, generator=g)
    keep = torch.rand(B, 1, 1, L + 2, generator=g) > 0.5
    heads = torch.rand(B, H * G, 1, L + 2, generator=g) > 0.5  # a poisoned position seen by one head, not the other
    for mask in (None, keep, torch.where(keep, torch.randn(B, 1, 1, L + 2, generator=g), -torch.inf), heads):
        got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                               None if mask is None else mask.to(DEV), kernel="decode").cpu()
        assert_nan_pattern(got, attention_reference(q, state, spec, mask, None, torch.float64), spec.name)
        check(q, state, spec, mask)


def test_which_layouts_the_decode_kernel_serves():
    """``launch.attention`` runs the decode kernel for one query over the layouts it serves, and the general one
    otherwise (prefill, pre-RoPE keys, int3, format "none", slots narrower than a dot operand, a group inside a
    byte); ``kernel="decode"`` refuses the rest with the reason."""
    tok = Quant("int4", "token")
    assert decode.tensor_mode(tok, 128) == decode.MODE_TILE
    assert decode.tensor_mode(Quant("fp8_e4m3", "token", scale_dtype="fp8_e4m3"), 64) == decode.MODE_TILE
    assert decode.tensor_mode(Quant("int4", "token", scale_dtype="float32"), 64) == decode.MODE_ELEM
    for fmt in ("fp8_e4m3", "fp8_e5m2"):  # one fixed scale, none stored: a tile scale of 1
        assert decode.tensor_mode(Quant(fmt, "tensor"), 64) == decode.tensor_mode(Quant(fmt, "tensor"), 64, 4) \
            == decode.MODE_TILE
    # per-channel keys in token groups of 16 or more: the query scaled per group; values, small groups, fp32
    # scales: per element
    assert decode.tensor_mode(Quant("int4", "channel", 32), 128) == decode.MODE_CHAN
    assert decode.tensor_mode(Quant("fp8_e4m3", "channel", 16, scale_dtype="fp8_e4m3"), 64) == decode.MODE_CHAN
    assert decode.tensor_mode(Quant("int4", "channel", 32), 128, 4) == decode.MODE_ELEM
    assert decode.tensor_mode(Quant("int4", "channel", 8), 128) == decode.MODE_ELEM
    assert decode.tensor_mode(Quant("int8", "channel", 32, scale_dtype="float32"), 128) == decode.MODE_ELEM
    assert decode.tensor_mode(Quant("int2", "token", 8), 64) == decode.MODE_ELEM
    kivi_v = Quant("int4", "token", 32)  # values: a batched product per group; as keys: per element
    assert decode.tensor_mode(kivi_v, 128, 4) == decode.tensor_mode(kivi_v, 128, 16) == decode.MODE_GROUPS
    assert decode.tensor_mode(kivi_v, 128) == decode.MODE_ELEM
    # values in groups of fewer than 16 bytes' slots: a row per query head (padded to a power of two) and group,
    # up to 16 rows; beyond, a product per group of at least 8 columns, else per element
    kivi2_v = Quant("int2", "token", 32)  # 8 bytes a group, 4 groups a head
    assert [decode.tensor_mode(kivi2_v, 128, g) for g in (1, 2, 3, 4, 5, 8)] == [decode.MODE_ROWS] * 4 + [
        decode.MODE_GROUPS] * 2
    assert decode.tensor_mode(Quant("int4", "token", 8), 64, 2) == decode.MODE_ROWS  # 8 groups x 2 heads
    assert decode.tensor_mode(Quant("int4", "token", 8), 64, 4) == decode.MODE_ELEM  # 4 columns a group
    assert decode.tensor_mode(Quant("int4", "token", 8, scale_dtype="float32"), 64, 1) == decode.MODE_ELEM
    for q, D in ((Quant("int3", "token"), 128), (Quant("none"), 128), (Quant("int4", "token", 1), 128),
                 (Quant("int2", "token", 2), 96)):
        assert decode.tensor_mode(q, D) is None, (q, D)
    # a head that is no power of two (Phi-2's 80, Phi-3's 96), or whose slots are narrower than a dot operand (int2
    # at 32: 8 channels a slot), is padded: the kernel computes over the padded head, the rest masked
    assert decode.tensor_mode(tok, 96) == decode.tensor_mode(Quant("int2", "token"), 32) == decode.MODE_TILE
    assert [decode.padded_head((q,), D) for q, D in ((tok, 80), (tok, 96), (tok, 128), (Quant("int8", "token"), 32),
                                                     (Quant("int2", "token"), 32), (Quant("int2", "token"), 80))] \
        == [128, 128, 128, 32, 64, 128]
    assert decode.modes(Policy.kivi(4), 80, 4) == (decode.MODE_CHAN, decode.MODE_GROUPS)  # value groups of 16 fit 80
    # beside CHAN keys, ROWS in up to 8 rows (one or two query heads a KV head over narrow value groups)
    assert decode.modes(Policy.kivi(4), 80, 1) == decode.modes(Policy.kivi(2, group=16), 64, 2) == (
        decode.MODE_CHAN, decode.MODE_ROWS)
    assert decode.modes(Policy.kivi(2, group=16), 64, 3) == (decode.MODE_ELEM, decode.MODE_ROWS)  # 16 rows
    assert decode.modes(Policy(tok, Quant("int4", "token", 16)), 80, 2) == (decode.MODE_TILE, decode.MODE_ROWS)
    spec = _spec(Policy(tok, tok, residual=0), 128)
    assert decode.decode_layout(spec, 1, False, 4) == (decode.MODE_TILE, decode.MODE_TILE)
    # KIVI: the keys scale the query per group beside values scaled per group, int2's 8-byte groups included
    # (beside keys on tiles those take ROWS where it fits); beside values per element or in ROWS (groups under 8
    # columns) the keys are per element (the scaled queries' registers cost more than they save)
    kivi4, kivi2 = _spec(Policy.kivi(4, group=32), 128), _spec(Policy.kivi(2, group=32), 128)
    assert decode.decode_layout(kivi4, 1, False, 4) == decode.decode_layout(kivi4, 1, False, 8) == (
        decode.MODE_CHAN, decode.MODE_GROUPS)
    assert decode.decode_layout(kivi2, 1, False, 4) == decode.decode_layout(kivi2, 1, False, 8) == (
        decode.MODE_CHAN, decode.MODE_GROUPS)
    tile_g16 = _spec(Policy(tok, Quant("int4", "token", 16)), 128)  # 8 columns a group, 8 groups
    assert decode.decode_layout(tile_g16, 1, False, 2) == (decode.MODE_TILE, decode.MODE_ROWS)
    assert decode.decode_layout(tile_g16, 1, False, 4) == (decode.MODE_TILE, decode.MODE_GROUPS)
    narrow = _spec(Policy(Quant("int4", "channel", 32), Quant("int2", "token", 16)), 64)  # 4 columns a group
    assert decode.decode_layout(narrow, 1, False, 3) == (decode.MODE_ELEM, decode.MODE_ROWS)
    assert decode.decode_layout(spec, 2, False, 4) is None and decode.decode_layout(spec, 1, True, 4) is None
    state = spec.allocate(1, 64)
    assert launch.plan(state, spec, (1, 4, 1, 128)).decode and not launch.plan(state, spec, (1, 4, 3, 128)).decode
    assert not launch.plan(state, spec, (1, 4, 1, 128), kernel="general").decode
    with pytest.raises(ValueError, match="decode kernel does not serve 3 queries"):
        launch.plan(state, spec, (1, 4, 3, 128), kernel="decode")
    with pytest.raises(ValueError, match="kernel='fast' is not valid"):
        launch.plan(state, spec, (1, 4, 1, 128), kernel="fast")


def _spec(policy, D, block=None):
    from kvcompile.store import LayerSpec
    return LayerSpec(policy, 2, D, "bfloat16", block)


def _run_ptx(asm: str, regs: dict) -> dict:
    """The PTX subset of ``decode._UNPACK4`` / ``_UNPACK2`` (prmt's default mode, lop3, shr on b32), run on Python
    ints as the PTX ISA defines them: ``regs`` maps ``$N`` and the scratch names to values."""
    def val(x):
        x = x.strip()
        return regs[x] if x in regs else int(x, 0)
    for ins in asm.strip("{} ").split(";"):
        op, _, args = ins.strip().partition(" ")
        a = [t.strip() for t in args.split(",")]
        if op == "prmt.b32":  # result byte i: byte (selector nibble i & 7) of {b, a}, a the low four
            pool, sel = val(a[1]) | (val(a[2]) << 32), val(a[3])
            regs[a[0]] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":  # bit k: the truth table at (a_k, b_k, c_k)
            x, y, z, lut = (val(t) for t in a[1:])
            regs[a[0]] = sum(((lut >> (((x >> k & 1) << 2) | ((y >> k & 1) << 1) | (z >> k & 1))) & 1) << k
                             for k in range(32))
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        else:
            assert op in ("", ".reg"), op
    return regs


@pytest.mark.parametrize("bits", [4, 2])
def test_the_gpu_unpack_spells_each_slots_codes_as_the_interpreter_does(bits):
    """On a GPU the decode kernel unpacks int4 / int2 bytes with inline PTX (``decode._UNPACK4`` / ``_UNPACK2``;
    Triton's interpreter cannot run it): its output ``$0 ..`` are each slot's four codes as bf16 ``128 + c``
    (slot ``s`` in ``$2s`` and ``$2s+1``, element ``j`` of the four in half ``j % 2``), its input the word of four
    bytes after them, as ``tl.inline_asm_elementwise`` orders them. Every byte value in every position spells what
    ``_code_tile`` (the interpreter's path) gives."""
    asm = (decode._UNPACK4 if bits == 4 else decode._UNPACK2).value
    slots = 8 // bits
    g = torch.Generator().manual_seed(bits)
    words = [[b, 255 - b, (b * 7) & 255, (b * 13 + 5) & 255] for b in range(256)]
    words += torch.randint(0, 256, (64, 4), generator=g).tolist()
    for w in words:
        out = _run_ptx(asm, {f"${2 * slots}": sum(b << (8 * j) for j, b in enumerate(w))})
        for slot in range(slots):
            for j, b in enumerate(w):
                half = (out[f"${2 * slot + j // 2}"] >> (16 * (j % 2))) & 0xFFFF
                assert half == 0x4300 | ((b >> (bits * slot)) & ((1 << bits) - 1)), (w, slot, j, hex(half))


@pytest.mark.parametrize("bits,width", [(4, 4), (4, 2), (2, 2)])
def test_the_gpu_unpack_of_words_spells_each_sub_slots_codes_as_the_interpreter_does(bits, width):
    """On a GPU, int4 / int2 key codes read as words or halfwords (``decode.key_words``; int4 values as
    halfwords) are unpacked by ``decode._unpack_words``' PTX: two elements in (two words, or two halfwords in one
    register), sub-slot ``s = k * (8 // bits) + i`` out in ``$s`` (byte ``k`` of each element, its ``i``-th
    code), the first element's in the low half. Every byte value in every position spells what ``_word_tile``
    (the interpreter's path: ``(word >> (8 k + bits i)) & mask``) gives."""
    asm = {(4, 4): decode._UNPACK_W4_INT4, (4, 2): decode._UNPACK_W2_INT4, (2, 2): decode._UNPACK_W2_INT2}[
        (bits, width)].value
    per = 8 // bits
    n = per * width
    g = torch.Generator().manual_seed(bits * width)
    pairs = [[b, (b * 7) & 255, 255 - b, (b * 13 + 5) & 255, (b * 3 + 1) & 255, b ^ 0x5A, (b * 11) & 255, ~b & 255]
             for b in range(256)]
    pairs += torch.randint(0, 256, (64, 8), generator=g).tolist()
    for bytes_ in pairs:
        elems = [sum(b << (8 * k) for k, b in enumerate(bytes_[e * width:(e + 1) * width])) for e in range(2)]
        regs = {f"${n}": elems[0], f"${n + 1}": elems[1]} if width == 4 else {f"${n}": elems[0] | elems[1] << 16}
        out = _run_ptx(asm, regs)
        for k in range(width):
            for i in range(per):
                for e in range(2):
                    half = (out[f"${k * per + i}"] >> (16 * e)) & 0xFFFF
                    code = (elems[e] >> (8 * k + bits * i)) & ((1 << bits) - 1)
                    assert half == 0x4300 | code, (bytes_, k, i, e, hex(half))


def test_codes_read_as_words_only_where_a_tensor_allows(monkeypatch):
    """Words need the codes' rows 4-byte aligned: a store's own tensors always are; codes in a view that is not
    (an odd offset into a buffer) are read byte by byte, within the same bound."""
    policy = Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0)
    assert (decode.key_words(policy.key, 128, decode.MODE_TILE), decode.value_words(policy.value, 128,
                                                                                     decode.MODE_TILE)) == (4, 2)
    assert decode.key_words(Quant("int2", "token"), 128, decode.MODE_TILE) == 2
    assert decode.key_words(Quant("int4", "token"), 64, decode.MODE_TILE) == 2
    assert decode.key_words(Quant("int2", "token"), 64, decode.MODE_TILE) == 1  # 8 sub-slots of 8: too narrow
    assert decode.value_words(Quant("int2", "token"), 128, decode.MODE_TILE) == 1
    # GROUPS: a warp a group, each sub-slot's product at least 8 columns of the group
    assert decode.value_words(Quant("int4", "token", 32), 64, decode.MODE_GROUPS) == 2
    assert decode.value_words(Quant("int4", "token", 16), 128, decode.MODE_GROUPS) == 1
    assert decode.key_words(Quant("int4", "channel", 32), 128, decode.MODE_CHAN) == 1
    assert decode.key_words(Quant("int8", "token"), 128, decode.MODE_TILE) == 1
    spec, state = filled(policy, [9, 40], 2, 128)
    seen = []
    config = decode.decode_config

    def spy(*a, **k):
        key, kw = config(*a, **k)
        seen.append((kw["K_W"], kw["V_W"]))
        return key, kw
    monkeypatch.setattr(decode, "decode_config", spy)
    q = torch.randn(2, 8, 1, 128, generator=torch.Generator().manual_seed(3))
    check(q, state, spec)

    def odd(t):  # the same values at an address that is 1 mod 4
        buf = torch.zeros(t.numel() + 1, dtype=t.dtype)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out
    moved = state._replace(k_codes=odd(state.k_codes), v_codes=odd(state.v_codes))
    assert moved.k_codes.data_ptr() % 4 == 1
    check(q, moved, spec)
    assert seen == [(4, 2), (1, 1)]


def test_tiles_come_from_the_config_table_or_its_rule(monkeypatch):
    """The table (``templates/decode_configs.json``) names tiles per layout; other layouts get the rule: tiles of
    about ``tile_bytes`` bytes of codes (so int2 tiles hold more tokens than int8), within the bounds. Splits
    follow the batch and the positions, never a capacity: about 4 programs per SM, no split under 4 tiles."""
    table = decode.config_table()
    assert {"tile_bytes", "max_block_n", "elem_max_block_n", "elem_keys_max_block_n", "chan_max_block_n", "warps",
            "stages"} <= set(table["default"])
    for entry in table["configs"].values():
        assert {"block_n", "warps", "stages"} <= set(entry)
    rule = table["default"]
    tok = {b: Policy(Quant(f"int{b}", "token"), Quant(f"int{b}", "token"), residual=0) for b in (8, 4, 2)}
    got = {b: decode.tile_config(_spec(tok[b], 128), 5) for b in tok}  # G=5: no table entry
    assert all(c["source"] == "rule" for c in got.values())
    assert got[8]["block_n"] < got[4]["block_n"] < got[2]["block_n"] <= rule["max_block_n"]
    assert got[8]["block_n"] * 2 * 128 <= rule["tile_bytes"]
    elem = decode.tile_config(_spec(Policy(tok[2].key, Quant("int2", "token", 8), residual=0), 128), 5)
    assert elem["block_n"] == rule["elem_max_block_n"] < got[2]["block_n"]  # per-element values: capped
    rows = decode.tile_config(_spec(Policy(Quant("int4", "channel", 8), Quant("int2", "token", 16)), 64), 3)
    assert rows["source"] == "rule" and rows["block_n"] == rule["elem_keys_max_block_n"] > rule["elem_max_block_n"]
    kivi2 = decode.tile_config(_spec(Policy.kivi(2, group=32, residual=0), 128), 5)  # CHAN keys: capped
    assert kivi2["source"] == "rule" and kivi2["block_n"] == rule["chan_max_block_n"] < got[2]["block_n"]
    # a padded head without an entry of its own: the entry of the head it is padded to, else the rule over its
    # padded bytes (int8 at 96 and at 128 take the same registers a token)
    key = "int8.token.head/int8.token.head;D={};G=8"
    assert key.format(96) not in table["configs"] and key.format(128) in table["configs"]
    assert decode.tile_config(_spec(tok[8], 96), 8) == dict(table["configs"][key.format(128)], source="table")
    assert decode.tile_config(_spec(tok[8], 96), 5) == got[8]
    monkeypatch.setattr(decode, "INTERPRET", False)
    spec = _spec(tok[4], 128)
    bn = decode.tile_config(spec, 4)["block_n"]
    assert decode.decode_tiles(spec, 4, 1, 1 << 20, torch.device("cpu"))[1] == 8  # 4 SMs off CUDA: 16 programs
    assert decode.decode_tiles(spec, 4, 64, 1 << 20, torch.device("cpu"))[1] == 1  # the batch fills the GPU
    assert decode.decode_tiles(spec, 4, 1, 2 * bn, torch.device("cpu"))[1] == 1  # no split under 4 tiles
    kivi = _spec(Policy.kivi(4, group=32, residual=0), 128)
    assert decode.decode_tiles(kivi, 4, 1, 4096, torch.device("cpu"), (16, 2)) == (32, 2)  # whole groups


def test_decode_keys_spell_out_the_specialization():
    key, kw = decode.decode_config(Policy.kivi(4, group=32, residual=16, sink=4), 128, 4, 32, 47, 64, 8, 128, 3,
                                   0, "tf32", False, True)
    assert key == ("decode[k=int4.channel.32.asym.f16:chan;v=int4.token.32.asym.f16:groups;S=4;R=16;F=32;W=47;"
                   "BS=64;D=128;gqa=8;bn=128;stages=3;mask=0;dot=tf32;chunk=0;full=1;words=1,2;invariant=0;run=1]")
    assert kw["M"] == 8 and kw["K_CHANNEL"] and not kw["V_CHANNEL"] and kw["V_G"] == 32 and kw["FULL"]
    tok4 = Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0)
    key, kw = decode.decode_config(tok4, 128, 0, 1, 0, 16, 4, 64, 3, 0, "tf32", False, False)
    assert key.endswith(";words=4,2;invariant=0;run=1]") and (kw["K_W"], kw["V_W"]) == (4, 2)  # words, halfwords
    assert kw["M"] == 16  # one product for all tokens: rows padded to 16 (``decode.decode_rows``)
    key, kw = decode.decode_config(tok4, 128, 0, 1, 0, 16, 4, 64, 3, 0, "tf32", False, False, True, True, True)
    assert key.endswith(";invariant=1;run=4]") and kw["RUN"] == 4  # a run of rows: the padding holds 3 more rows
    key, kw = decode.decode_config(tok4, 128, 0, 1, 0, 16, 4, 64, 3, 0, "tf32", False, False, True, True)
    assert key.endswith(";invariant=1;run=1]")  # row-invariant without runs (a decode step): the padding dropped
    assert decode.decode_config(Policy.kivi(4, group=32), 128, 0, 32, 0, 64, 4, 128, 3, 0, "tf32", False, False,
                                True, True, True)[1]["RUN"] == 1  # per-group products: rows not padded
    key, kw = decode.decode_config(tok4, 128, 0, 1, 0, 16, 4, 64, 3, 0, "tf32", False, False, False)
    assert ";words=1,1;" in key and (kw["K_W"], kw["V_W"]) == (1, 1)  # rows not 4-byte aligned
    key, kw = decode.decode_config(Policy.fp8("fp8_e5m2", residual=0, axis="tensor"), 128, 0, 1, 0, 16, 4, 64, 3, 0,
                                   "tf32", False, False)
    assert key.startswith("decode[k=fp8_e5m2.tensor:tile;v=fp8_e5m2.tensor:tile;")
    assert kw["K_SFMT"] == kw["V_SFMT"] == 3 and kw["K_G"] == 128 and not kw["K_CHANNEL"]  # no scale, per head


@pytest.mark.parametrize("n", slow_after(1, [5, 12]))
def test_prefill_with_bf16_operands_over_the_quantized_past(n, monkeypatch):
    """The general kernel as it runs on CUDA (``launch.packed_precision``): a chunked prefill whose packed
    positions' products take bf16 operands, within the bound derived for them; the full-precision positions
    keep theirs. ``n = 12`` also reads its own chunk in full precision."""
    from attention_checks import LENGTHS, MIXED
    monkeypatch.setenv("KVCOMPILE_PACKED_DOT", "bf16")
    H, G, D = 2, 3, 64
    spec, state, *chunk = filled(MIXED, LENGTHS, H, D, own=n)
    q = torch.randn(len(LENGTHS), H * G, n, D, generator=torch.Generator().manual_seed(n))
    pl = launch.plan(state, spec, q.shape)
    assert not pl.decode
    got = launch.attention(q.to(DEV), type(state)(*[t.to(DEV) for t in state]), spec,
                           k_new=chunk[0].to(DEV), v_new=chunk[1].to(DEV)).cpu()
    want, bound = launch.reference_and_bound(q, state, spec, k_new=chunk[0], v_new=chunk[1], device=DEV)
    assert ((got.double() - want).abs() <= bound).all()
    monkeypatch.setenv("KVCOMPILE_PACKED_DOT", "ieee")  # the same call with exact operands: a tighter bound
    tight = launch.reference_and_bound(q, state, spec, k_new=chunk[0], v_new=chunk[1])[1]
    assert (tight <= bound * (1 + 1e-9)).all() and (tight < bound).any()


@pytest.mark.parametrize("policy", [Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0),
                                    Policy.kivi(4, group=16, residual=8, sink=2)], ids=["int4", "kivi-sinks-ring"])
def test_row_invariant_splits_give_a_row_the_same_bits_in_any_batch(policy):
    """``launch.attention(..., invariant=True)`` (what ``kvcompile.pages`` asks for: an engine's rows must not
    depend on the batch beside them): a row's output is the same bits alone, beside a much longer row (the launch
    then has more splits and the short row's last ones are empty; the full-precision slot moves), and beside
    shorter ones -- and within the bound. The launch's own splits (about 4 programs an SM on a GPU, so they follow
    the batch) give the same row other bits with another split count: what the invariant splits remove."""
    lengths = [70, 300, 5, 130]
    spec, host = filled(policy, lengths, 2, 64)
    g = torch.Generator().manual_seed(3)
    qh = torch.randn(4, 4, 1, 64, generator=g)

    def rows(idx, dev):  # a batch of these rows on ``dev``, its table as wide as its longest row needs (the bound)
        sel = torch.tensor(idx)
        width = spec.blocks_for(max(lengths[i] for i in idx))
        st = host._replace(k_res=host.k_res[sel], v_res=host.v_res[sel], k_sink=host.k_sink[sel],
                           v_sink=host.v_sink[sel], lengths=host.lengths[sel], table=host.table[sel, :width].contiguous())
        return type(st)(*[t.to(dev) for t in st]), qh[sel].to(dev)

    def attend(idx, invariant=True, tiles=None):
        st, q = rows(idx, DEV)
        return launch.attention(q.to(DEV), st, spec, tiles=tiles, invariant=invariant).cpu()

    alone = attend([0], invariant=True)
    assert launch.plan(rows([0], "cpu")[0], spec, (1, 4, 1, 64), invariant=True).nsplit < \
        launch.plan(rows([0, 1], "cpu")[0], spec, (2, 4, 1, 64), invariant=True).nsplit  # other launches
    for idx in ([0, 1], [2, 0], [3, 0, 1, 2]):
        assert torch.equal(attend(idx, invariant=True)[idx.index(0)], alone[0]), idx
    got = attend([0, 1, 2, 3], invariant=True)
    want, bound = launch.reference_and_bound(qh, *rows([0, 1, 2, 3], "cpu")[:1], spec, invariant=True, device=DEV)
    assert not ((got.double() - want).abs() > bound).any()
    assert not torch.equal(attend([0], False, (1, 16, 2)), attend([0], False, (1, 16, 5)))


RUNS = [  # (policy, G, mask, D): layouts whose products' rows are padded to 16, where a program takes a run of rows
    (Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0), 4, None, 32),
    (Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0, sink=3), 2, "bool", 32),
    (Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e4m3", "tensor"), residual=0), 3, "float", 32),  # NaN codes
    (Policy(Quant("int4", "token", 8), Quant("int8", "channel", 16), residual=0), 1, None, 32),  # ELEM keys, values
    (Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0, sink=2), 2, "bool", 80),  # a padded head
]


@pytest.mark.parametrize("policy,G,mask_kind,D", RUNS,
                         ids=["int4", "int8-sinks-bool", "fp8-tensor-float", "elem", "int4-D80-sinks-bool"])
def test_a_run_of_one_sequences_rows_gives_each_row_its_bits_alone(policy, G, mask_kind, D, monkeypatch):
    """``launch.attention(..., invariant=True, groups=...)`` (a prompt's queries, each a decode row of one sequence:
    ``kvcompile.pages``): a program takes up to ``decode.run_rows`` of the rows (their query heads fill the products'
    padding) and reads each packed tile once for all of them -- and each row's output is the same bits as in a
    call of its own (a decode step: the kernel without runs). The rows cross a change of their split share (the longest rows' splits are longer), so the
    runs are cut there; a poisoned token (NaN codes with the fixed fp8 scale) lies where only the longer rows see
    it; masks hide positions per row."""
    H, N = 2, 300
    spec, st = filled(policy, [N], H, D, seed=5)
    if spec.policy.key.axis == "tensor":  # a poisoned token-head at 280: NaN codes, as the store writes them
        from kvcompile.quant import FP8_NAN
        blk, row = int(st.table[0, 280 // spec.block]), 280 % spec.block
        st.k_codes[blk, 1, row] = FP8_NAN
        st.v_codes[blk, 1, row] = FP8_NAN
    lengths = [120, 121, 200, 250, 258, 259, 262, 270, 279, 281, 290, 300]  # share 32 up to 256 + S packed, then 48
    B = len(lengths)
    rep = [0] * B
    state = st._replace(k_res=st.k_res[rep], v_res=st.v_res[rep], k_sink=st.k_sink[rep], v_sink=st.v_sink[rep],
                        lengths=torch.tensor(lengths, dtype=torch.int32), table=st.table[rep].contiguous())
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H * G, 1, D, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 1, N, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.where(torch.rand(B, 1, 1, N, generator=g) > 0.3, 0.0, float("-inf"))
    grids = []
    launch_run = decode.run
    monkeypatch.setattr(decode, "run", lambda k, grid, args, **kw: (grids.append((k.__name__, grid, args)),
                                                                     launch_run(k, grid, args, **kw)))
    dev_state = type(state)(*[t.to(DEV) for t in state])
    runs = launch.attention(q.to(DEV), dev_state, spec, None if mask is None else mask.to(DEV), invariant=True,
                            groups=torch.tensor([0, B], dtype=torch.int32)).cpu()
    rows = decode.layer_run_rows(spec, G)
    assert rows == 16 // triton.next_power_of_2(G) > 1
    # runs, cut where the share changes: B programs launched (a bound, no host sync), those past the pieces empty
    name, grid, args = grids[0]
    offsets = args["run_ptr"].cpu().tolist()
    pieces = offsets[:offsets.index(B) + 1]
    assert name == "_decode_kernel" and grid[0] == B * H and len(offsets) == B + 1 and set(offsets[len(pieces):]) <= {B}
    assert 1 < len(pieces) - 1 < B and pieces == _pieces_one_by_one(
        torch.tensor([0, B]), [min(spec.boundary(x), x) for x in lengths], rows, spec.sink, 16)
    for i in range(B):
        one = state._replace(**{f: getattr(state, f)[i:i + 1] for f in ("k_res", "v_res", "k_sink", "v_sink",
                                                                          "lengths", "table")})
        alone = launch.attention(q[i:i + 1].to(DEV), type(one)(*[t.to(DEV) for t in one]), spec,
                                 None if mask is None else mask[i:i + 1].to(DEV), invariant=True).cpu()
        assert torch.equal(alone.isnan(), runs[i:i + 1].isnan()), i
        assert torch.equal(alone.nan_to_num(), runs[i:i + 1].nan_to_num()), i
    want, bound = launch.reference_and_bound(q, state, spec, mask, invariant=True, device=DEV)
    assert torch.equal(runs.isnan(), want.isnan())
    ok = ~want.isnan()
    assert not ((runs.double() - want).abs() > bound)[ok].any()


UNSERVED = [  # (policy, head_dim, G): layouts the decode kernel does not serve
    (Policy(Quant("int4", "token", 1), Quant("int8", "token"), residual=0), 80, 2),  # a key group inside a byte
    (Policy.kivi(3, sink=2), 32, 4),  # int3, key groups, a ring and sinks
    (Policy(Quant("int2", "token", 2), Quant("int2", "token", 2), residual=0), 32, 1),  # int2 in groups of 2
]


@pytest.mark.parametrize("policy,D,G", UNSERVED, ids=["int4-g1-D80", "kivi3-sinks", "int2-g2-D32"])
def test_rows_of_a_layout_the_decode_kernel_does_not_serve_are_row_invariant_on_the_general_kernel(
        policy, D, G, monkeypatch):
    """``invariant=True`` (an engine's flat batch: ``kvcompile.pages`` on CUDA) over a layout the decode kernel does
    not serve runs the general kernel with one program a row, no splits -- its tiles start at position 0 and its
    loop ends at the row's own end -- so each row is the same bits as in a call of its own, within the bound; it
    used to be refused, which stopped vLLM on CUDA at its first step for every such model. Splits are refused."""
    from kvcompile.templates import attention as general
    H, N = 2, 150
    spec, st = filled(policy, [N], H, D, seed=3)
    assert decode.decode_layout(spec, 1, False, G) is None
    lengths = [1, 20, 47, 48, 100, 129, 150]
    B = len(lengths)
    rep = [0] * B
    state = st._replace(k_res=st.k_res[rep], v_res=st.v_res[rep], k_sink=st.k_sink[rep], v_sink=st.v_sink[rep],
                        lengths=torch.tensor(lengths, dtype=torch.int32), table=st.table[rep].contiguous())
    q = torch.randn(B, H * G, 1, D, generator=torch.Generator().manual_seed(1))
    grids = []
    launch_run = general.run
    monkeypatch.setattr(general, "run", lambda k, grid, args, **kw: (grids.append((k.__name__, grid)),
                                                                      launch_run(k, grid, args, **kw)))
    dev_state = type(state)(*[t.to(DEV) for t in state])
    rows = launch.attention(q.to(DEV), dev_state, spec, invariant=True).cpu()
    assert grids == [("_attn_kernel", (B * H, 1, 1))]
    for i in range(B):
        one = state._replace(**{f: getattr(state, f)[i:i + 1] for f in ("k_res", "v_res", "k_sink", "v_sink",
                                                                          "lengths", "table")})
        alone = launch.attention(q[i:i + 1].to(DEV), type(one)(*[t.to(DEV) for t in one]), spec, invariant=True)
        assert torch.equal(alone.cpu(), rows[i:i + 1]), i
    want, bound = launch.reference_and_bound(q, state, spec, invariant=True, device=DEV)
    assert not ((rows.double() - want).abs() > bound).any()
    with pytest.raises(ArgumentError, match="whose rows take no splits: got tiles=.1, 16, 2.; give NSPLIT 1"):
        launch.attention(q.to(DEV), dev_state, spec, invariant=True, tiles=(1, 16, 2))
    with pytest.raises(UnsupportedError, match="takes one query a row; got 2 queries a row"):
        launch.attention(torch.cat([q, q], 2).to(DEV), dev_state, spec, invariant=True)
    with pytest.raises(ArgumentError, match="not kernel='sdpa'"):
        launch.attention(q.to(DEV), dev_state, spec, invariant=True, kernel="sdpa")


def test_runs_are_cut_at_a_sequence_a_count_and_a_share():
    """``decode.run_offsets``: a program's rows are one sequence's, at most ``rows`` of them, with one split
    share; past the pieces, programs with no rows (B: the grid is B programs)."""
    g = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    stops = [10, 11, 12, 13, 14, 15, 40, 41, 300]  # row 8's share is larger (interpreter: 2 x 16 tokens, 8 splits)
    assert decode.run_offsets(g, torch.tensor(stops), 2, 0, 16).tolist() == [0, 2, 4, 5, 6, 8, 9, 9, 9, 9]
    assert decode.run_offsets(g, torch.tensor(stops), 4, 0, 16).tolist() == [0, 4, 5, 6, 8, 9, 9, 9, 9, 9]


def _pieces_one_by_one(groups, stops, rows, sink, block_n):
    """``decode.run_offsets``' rule, a row at a time: a piece ends at its run's end, after ``rows`` rows, or
    before a row whose split share differs from the piece's first."""
    share = [decode.split_share(x, sink, block_n) for x in stops]
    edges, out = groups.tolist(), [0]
    for a, b in zip(edges, edges[1:]):
        for i in range(a + 1, b):
            if i - out[-1] == rows or share[i] != share[out[-1]]:
                out.append(i)
        out.append(b)
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_runs_are_cut_by_tensor_ops_as_a_row_at_a_time(data):
    """``run_offsets`` cuts a prompt's thousands of rows with tensor ops on their device -- no Python loop a row, no
    host sync (it runs at every layer of every step through vLLM); its pieces are the rule's, a row at a time, for
    runs of any length and shares that change inside a run, then B; ``split_share`` of a tensor is each int's."""
    B = data.draw(st.integers(1, 48))
    cuts = sorted(data.draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    groups = torch.tensor([0, *cuts, B], dtype=torch.int32)
    stops = data.draw(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 20000)), min_size=B, max_size=B))
    rows = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    sink, block_n = data.draw(st.sampled_from([0, 4])), data.draw(st.sampled_from([16, 64, 256]))
    want = _pieces_one_by_one(groups, stops, rows, sink, block_n)
    got = decode.run_offsets(groups.to(DEV), torch.tensor(stops, dtype=torch.int32, device=DEV), rows, sink, block_n)
    assert got.dtype == torch.int32 and got.device == torch.device(DEV)
    assert got.tolist() == want + [B] * (B + 1 - len(want))
    assert decode.split_share(torch.tensor(stops), sink, block_n).tolist() == \
        [decode.split_share(x, sink, block_n) for x in stops]


def test_runs_that_do_not_describe_the_rows_are_refused():
    """``launch.attention``'s ``groups`` are checked at the call (``common.check_groups``), as the C kernels' are:
    not a tensor, rows of two tables in one run, lengths not ascending, offsets that do not cover the rows."""
    policy = Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0)
    spec, st = filled(policy, [40, 40], 1, 32)
    q = torch.randn(2, 2, 1, 32).to(DEV)
    state = type(st)(*[t.to(DEV) for t in st._replace(lengths=torch.tensor([30, 40], dtype=torch.int32))])
    with pytest.raises(ArgumentError, match="int32 tensors; got list"):
        launch.attention(q, state, spec, invariant=True, groups=[0, 2])
    with pytest.raises(ArgumentError, match="share their block table"):  # the two rows' tables differ
        launch.attention(q, state, spec, invariant=True, groups=torch.tensor([0, 2], dtype=torch.int32))
    shared = st._replace(table=st.table[[0, 0]].contiguous())  # one sequence's table in both rows
    one = type(st)(*[t.to(DEV) for t in shared._replace(lengths=torch.tensor([30, 40], dtype=torch.int32))])
    falling = type(st)(*[t.to(DEV) for t in shared._replace(lengths=torch.tensor([40, 30], dtype=torch.int32))])
    with pytest.raises(ArgumentError, match="ascending"):
        launch.attention(q, falling, spec, invariant=True, groups=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="offsets from 0 to the 2 rows"):
        launch.attention(q, one, spec, invariant=True, groups=torch.tensor([0, 1], dtype=torch.int32))
    launch.attention(q, one, spec, invariant=True, groups=torch.tensor([0, 2], dtype=torch.int32))  # accepted
