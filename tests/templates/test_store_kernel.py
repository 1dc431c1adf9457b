"""The quantize-on-write Triton kernels equal the reference store bit for bit.

Runs through Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), on CUDA if present.
"""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile import quant as Q
from kvcompile.store import CapacityError, KVStore, LayerSpec, store_reference
from kvcompile.templates import launch
from kvcompile.templates import store as kstore
import profiles
from store_checks import around, assert_same_store, bits, quants, scrambled, tie_rows, with_history
from tiers import slow_after

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def store_cases(draw):
    D = draw(st.sampled_from([16, 32, 48, 64]))  # 48: a head that is not a power of two
    policy = Policy(draw(quants(D)), draw(quants(D)), residual=draw(st.sampled_from([0, 1, 5, 16])),
                    sink=draw(st.sampled_from([0, 0, 3])), rotate=D != 48 and draw(st.booleans()))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    history = [draw(st.integers(0, 40)) for _ in range(B)]  # ragged prefix, appended by the reference
    chunks = draw(st.lists(st.sampled_from([1, 1, 2, 7, 16, 33]), min_size=1, max_size=3))
    ragged = draw(st.booleans())  # kernel appends of per-row lengths (n_new)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    block = draw(st.sampled_from([16, 16, 32, 64]))  # packed tokens per block (or the flush group if larger)
    return policy, B, H, D, dtype, history, chunks, ragged, block, draw(st.integers(0, 2**31 - 1))


@profiles.KERNEL
@given(store_cases())
def test_store_kernel_equals_reference(case):
    """Ragged histories and chunks over scrambled block tables: every row spans several blocks, handed out in
    random order, so a kernel that did not follow the table would write the wrong block."""
    policy, B, H, D, dtype, history, chunks, ragged, block, seed = case
    spec, ref, got, g, scale = with_history(policy, B, H, D, dtype, history, chunks, seed, DEV, block)
    for n in chunks:
        k = torch.randn(B, H, n, D, generator=g) * scale
        v = torch.randn(B, H, n, D, generator=g) + torch.randn(B, H, 1, D, generator=g) * 4  # offset: asym zeros
        if n > 2:
            v[:, :, 1] = 3.25  # a constant token: scale 0, codes exact
            k[:, :, 2] = 0.0   # all-zero token
        n_new = torch.randint(0, n + 1, (B,), generator=g, dtype=torch.int32) if ragged else None
        ref.append(k, v, n_new)
        got.append(k.to(DEV), v.to(DEV), None if n_new is None else n_new.to(DEV), kernel=launch.store)
        assert_same_store(ref.state, got.state, spec)


@pytest.mark.parametrize("policy", slow_after(1, [Policy.kivi(2, group=4, residual=3, sink=2), Policy.fp8(residual=0),
                                                 Policy.fp8("fp8_e5m2", residual=2, axis="tensor", sink=1)]))
def test_store_kernel_decode_steps_cross_every_boundary(policy):
    """Token by token through sinks, the residual, several flushes, block ends and the ring's wrap-around."""
    B, H, D, C = 2, 1, 16, 40
    spec = LayerSpec(policy, H, D, block_tokens=16)
    ref, got = spec.allocate(B, C), spec.allocate(B, C, DEV)
    g = torch.Generator().manual_seed(0)
    for _ in range(C):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        store_reference(ref, spec, k, v)
        launch.store(got, spec, k.to(DEV), v.to(DEV))
        assert_same_store(ref, got, spec)


@pytest.mark.parametrize("fmt,sym", [("int8", False), ("int4", False), ("int3", True), ("int2", False),
                                     ("int2", True), ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_store_kernel_rounds_ties_to_even(fmt, sym):
    """Every row and every column of x holds the group's extremes (scale 1) and ties: per-token keys and
    per-channel values both round half to even, as torch.round and torch's fp8 cast do."""
    D = 16
    row = tie_rows(fmt, sym, D)
    x = torch.stack([row.roll(t) for t in range(D)])[None, None]  # [1, 1, 16 tokens, 16 channels]
    policy = Policy(Quant(fmt, "token", None, sym), Quant(fmt, "channel", D, sym), residual=0)
    spec = LayerSpec(policy, 1, D)
    ref, got = spec.allocate(1, D), spec.allocate(1, D, DEV)
    store_reference(ref, spec, x, x)
    launch.store(got, spec, x.to(DEV), x.to(DEV))
    assert_same_store(ref, got, spec)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_store_kernel_fixed_scale_fp8_rounds_and_saturates_as_the_reference(fmt):
    """axis="tensor" (one fixed scale, 1.0, not stored): each element becomes its nearest fp8 value, bit for bit as
    the reference (torch's cast after a clamp to the format's largest) -- every fp8 value, every midpoint (ties to
    even) and one fp32 ulp either side, subnormals, -0.0, and values beyond the largest, which saturate to it
    (never NaN or inf). No scale is stored: the pool has none."""
    D, fmax = 16, Q.FP8_MAX[fmt]
    every = torch.arange(256, dtype=torch.uint8).view(Q.FP8_DTYPES[fmt]).float()
    x = around(every[every.isfinite()])
    beyond = torch.tensor([fmax + 1, fmax * 1.0001, fmax * 1.5, fmax * 2, 1e6, 1e30, 3e38])
    x = torch.cat([x, beyond, -beyond, torch.tensor([0.0, -0.0, 2.0 ** -20, -(2.0 ** -30)])])
    x = torch.cat([x, torch.zeros(-x.numel() % D)]).view(1, 1, -1, D)
    T = x.shape[2]
    spec = LayerSpec(Policy(Quant(fmt, "tensor"), Quant(fmt, "tensor"), residual=0), 1, D)
    ref, got = spec.allocate(1, T), spec.allocate(1, T, DEV)
    store_reference(ref, spec, x, x.flip(2))
    launch.store(got, spec, x.to(DEV), x.flip(2).to(DEV))
    assert_same_store(ref, got, spec)
    assert got.k_scale.numel() == got.v_scale.numel() == got.k_zero.numel() == 0
    codes = got.k_codes.cpu()
    top = torch.tensor([fmax]).to(Q.FP8_DTYPES[fmt]).view(torch.uint8)
    assert ((codes & 0x7F) == top).sum() > 2 * len(beyond) and not ((codes & 0x7F) > top).any()  # saturated


def test_store_kernel_unreserved_block_raises_like_the_reference():
    """An append whose packed tokens need a block the table does not hold fails before anything is written,
    with the reference's message; appends within the reserved (scrambled) blocks equal the reference."""
    spec, ref, got, g, _ = with_history(Policy.kivi(4, group=4, residual=2), 1, 1, 16, "float32", [6], [12], 5,
                                        DEV)
    k, v = torch.randn(1, 1, 12, 16, generator=g), torch.randn(1, 1, 12, 16, generator=g)
    ref.append(k, v)
    got.append(k.to(DEV), v.to(DEV), kernel=launch.store)
    assert_same_store(ref.state, got.state, spec)
    assert len(got.tables[0]) == 1  # 18 tokens: packed 0..15, one block
    # on the host (a CUDA state fails on the device instead, which would end this process's CUDA context)
    state = got.copy("cpu").state
    before = [t.clone() for t in state]
    with pytest.raises(CapacityError, match="holds 18 tokens and appends 4, which needs 2 blocks of 16 packed "
                                            "tokens, but 1 are reserved"):  # not reserved: KVStore.reserve skipped
        launch.store(state, spec, torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))  # host: fails before a kernel
    assert all(torch.equal(a, b) for a, b in zip(before, state))


def test_store_kernel_never_writes_an_unreserved_block():
    """The kernel itself (as on CUDA, where the launcher does not read the table on the host) leaves tokens
    whose block is -1, past the table or outside the pool unwritten, and raises its error flag."""
    policy = Policy(Quant("int8", "token"), Quant("int4", "channel", 16), residual=0)
    spec = LayerSpec(policy, 1, 16, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 48, 16, generator=g), torch.randn(1, 1, 48, 16, generator=g)
    n = torch.tensor([48], dtype=torch.int32)  # three blocks of 16 packed tokens (no residual, no sinks)
    # the second block: -1 / past the table / not one of the pool's 3 blocks; the others name blocks 2 and 0
    k, v, n = k.to(DEV), v.to(DEV), n.to(DEV)
    for table in ([[2, -1, 0]], [[2, 0]], [[2, 3, 0]]):
        state = spec.allocate(1, 48, DEV)._replace(table=torch.tensor(table, dtype=torch.int32, device=DEV))
        for t in state[:6]:
            t.fill_(7) if t.dtype == torch.uint8 else t.fill_(0.5)
        assert int(kstore.launch_store(state, spec, k, v, n)) == 1, table
        codes, scale = state.k_codes.cpu(), state.v_scale.cpu()
        assert (codes[1] == 7).all() and (scale[1] == 0.5).all(), table  # untouched
        for blk in (0, 2):  # written
            assert (codes[blk] != 7).any() and (scale[blk] != 0.5).all(), (table, blk)
    assert int(kstore.launch_store(spec.allocate(1, 48, DEV), spec, k, v, n)) == 0
    if DEV == "cpu":  # the launcher raises on the host; on CUDA the device asserts (ending the CUDA context)
        bad = spec.allocate(1, 48)._replace(table=torch.tensor([[0, 5, 1]], dtype=torch.int32))
        with pytest.raises(CapacityError, match="not in the pool"):
            launch.store(bad, spec, k, v)  # host: DEV is the CPU here


@pytest.mark.parametrize("block", slow_after(1, [16, 32, 64]))
def test_store_kernel_follows_forks_crops_and_reorders(block):
    """KVStore's life on the kernel, against the reference store: a ragged history over scrambled blocks,
    ``select([0, 0, 1])`` (two rows share every block until one is written: the append copies the shared last
    block and must write the copy), appends across block ends, ``crop`` back into packed storage, appends
    after it, and a reorder that drops a row."""
    policy = Policy(Quant("int4", "channel", 8), Quant("int2", "token", 8), residual=5, sink=2)
    chunks = [block + 3, 7, 1, block + 1]
    spec, ref, got, g, scale = with_history(policy, 2, 1, 16, "float32", [block + 17, 21], chunks, 3, DEV, block)

    def append(n, n_new=None):
        k = torch.randn(ref.batch, 1, n, 16, generator=g) * scale
        v = torch.randn(ref.batch, 1, n, 16, generator=g)
        ref.append(k, v, n_new)
        got.append(k.to(DEV), v.to(DEV), n_new, kernel=launch.store)
        assert ref.tables == got.tables
        assert_same_store(ref.state, got.state, spec)

    for st_ in (ref, got):
        st_.select([0, 0, 1])
    # row 0 held one full block and 8 rows of a second; rows 0 and 1 both write into that second one
    append(block + 3, torch.tensor([block + 3, 9, 1]))
    assert ref.tables[0][0] == ref.tables[1][0] and ref.tables[0][1] != ref.tables[1][1]  # still shared; copied
    for st_ in (ref, got):
        st_.crop(block - 3)
    append(7)
    append(1)
    for st_ in (ref, got):
        st_.select([2, 0])
    append(block + 1, torch.tensor([block + 1, 4]))


def test_unsupported_head_dim_names_the_policy():
    spec = LayerSpec(Policy.kivi(4), 1, 512)
    with pytest.raises(NotImplementedError, match=r"head_dim <= 256.*k=int4\.channel\.32"):
        launch.store(spec.allocate(1, 64), spec, torch.zeros(1, 1, 1, 512),  # host: refused before any kernel
                     torch.zeros(1, 1, 1, 512))


def test_specialization_keys_spell_out_the_format():
    key, kw = kstore.flush_config(Quant("int3", "channel", 16), 128, 4, 128, 16, 143)
    assert key == "store.flush[int3.channel.16.asym.f16;D=128;S=4;R=128;F=16;W=143]"
    assert kw["BITS"] == 3 and kw["CHANNEL"] and kw["G"] == 16 and kw["HAS_ZERO"]
    assert kstore.flush_config(Quant("int3", "channel", 16), 128, 4, 128, 16, 143)[1] is kw  # built once


# --------------------------------------------------------------------------- the numeric helpers, exhaustively
@triton.jit
def _fp8_kernel(x_ptr, o_ptr, N: tl.constexpr, E4M3: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, kstore._fp8_encode(tl.load(x_ptr + i), E4M3).to(tl.uint8))


@triton.jit
def _round_kernel(x_ptr, up_ptr, down_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(up_ptr + i, kstore._round_scale(x, True, True))
    tl.store(down_ptr + i, kstore._round_scale(x, False, True))


def _run_padded(kernel, x, outs, **kw):
    N = triton.next_power_of_2(x.numel())
    xp = torch.zeros(N, dtype=x.dtype)
    xp[: x.numel()] = x
    bufs = [torch.zeros(N, dtype=o) for o in outs]
    args = [t.to(DEV) for t in [xp, *bufs]]
    kernel[(1,)](*args, N=N, **kw)
    return [a.cpu()[: x.numel()] for a in args[1:]]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_encode_equals_torch_cast_at_every_rounding_boundary(fmt):
    """Every fp8 value, every midpoint (ties to even), one ulp either side, subnormals, up to the format's max:
    the reachable inputs (quantization divides by absmax / max, so |x / scale| <= max)."""
    dt = Q.FP8_DTYPES[fmt]
    every = torch.arange(256, dtype=torch.uint8).view(dt).float()
    every = every[every.isfinite() & (every.abs() <= Q.FP8_MAX[fmt])]
    x = around(every)
    x = x[x.abs() <= Q.FP8_MAX[fmt]]
    x = torch.cat([x, torch.randn(4000) * 100, torch.rand(2000) * 2.0 ** -8, torch.tensor([0.0, -0.0])])
    (got,) = _run_padded(_fp8_kernel, x, [torch.uint8], E4M3=fmt == "fp8_e4m3")
    want = x.to(dt).view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:8]


def test_fp16_directed_rounding_equals_reference():
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[halves.isfinite()]
    x = torch.cat([around(halves[::7]), torch.randn(3000) * 1e-6, torch.randn(3000) * 3e4,
                   torch.tensor([65504.0, 65519.0, 65520.0, 70000.0, 2.0 ** -25, -2.0 ** -25, 0.0])])
    up, down = _run_padded(_round_kernel, x, [torch.float16, torch.float16])
    assert torch.equal(bits(up), bits(Q.round_to_dtype(x, torch.float16, "up")))
    assert torch.equal(bits(down), bits(Q.round_to_dtype(x, torch.float16, "down")))


# --------------------------------------------------------------------------- non-finite and huge inputs
from nonfinite_checks import BAD, NONFINITE_POLICIES, bad_inputs  # noqa: E402


@pytest.mark.parametrize("policy,dtype", slow_after(1, [
    (Policy(Quant("int4", "channel", 4), Quant("int8", "token", 8), residual=3, sink=2), "float16"),
    (Policy(Quant("int3", "token", None, True, "float32"), Quant("int2", "channel", 4, True), residual=0, sink=1),
     "bfloat16"),
    (Policy(Quant("fp8_e4m3", "channel", 4, scale_dtype="float32"), Quant("fp8_e5m2", "token", 8), residual=2),
     "float32"),
    (NONFINITE_POLICIES[3], "bfloat16"),  # fp8 scales, int8 zero points
    (NONFINITE_POLICIES[4], "float16"),
    (NONFINITE_POLICIES[5], "bfloat16"),  # one fixed scale, none stored: a poisoned token-head's codes are NaN codes
    (Policy(Quant("fp8_e5m2", "tensor"), Quant("fp8_e4m3", "tensor"), residual=3, sink=2, rotate=True), "float32"),
]))
def test_store_kernel_non_finite_and_huge_inputs_equal_reference(policy, dtype):
    """The Triton store: NaN, +inf and -inf in sinks, on packed groups' first and
    last tokens and channels and in the residual window, among values up to the model dtype's largest, are
    stored bit for bit as the reference stores them (saturated scales, poisoned groups); without the bad values
    everything stored is finite."""
    B, H, D, L = 2, 1, 16, 40
    spec = LayerSpec(policy, H, D, dtype, block_tokens=16)
    top = torch.finfo(spec.torch_dtype).max
    for magnitude, bad in ((1.0, BAD), (top, BAD), (top / 4, ())):
        k, v = bad_inputs(spec, B, L, 7, magnitude, bad=bad)
        ref = scrambled(spec, B, 2 * B * spec.blocks_for(L), seed=2)
        got = ref.copy(DEV)
        at = 0
        for n in (7, 1, 20, 12):
            ref.append(k[:, :, at:at + n], v[:, :, at:at + n])
            got.append(k[:, :, at:at + n].to(DEV), v[:, :, at:at + n].to(DEV), kernel=launch.store)
            assert_same_store(ref.state, got.state, spec)
            at += n
        if not bad:
            assert all(torch.isfinite(t.float()).all() for t in got.state[:10])
