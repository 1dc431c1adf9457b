"""Checks shared by the store kernels' tests (Triton: test_store_kernel.py, C: test_cpu_store.py): what
"bit-exact with the reference store" means, and the strategy drawing a tensor's quantization."""
import torch
from hypothesis import strategies as st

from kvcompile import Quant
from kvcompile import quant as Q
from kvcompile.store import KVStore, LayerSpec, dequantize_reference

EXACT_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_sink", "v_sink", "lengths",
                "table")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (so -0.0 != 0.0 and NaN == NaN): exact equality means the same bytes."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same_store(ref, got, spec):
    """Everything the layout specifies is equal bit for bit: codes, scales, zeros, sinks, lengths, and the live
    ring slots (dead slots are unspecified); and so is what the store reads back."""
    for name in EXACT_FIELDS:
        a, b = getattr(ref, name), getattr(got, name)
        assert torch.equal(bits(a), bits(b.to(a.device))), (name, spec.name, (bits(a) != bits(b.cpu())).sum())
    W, S = spec.ring, spec.sink
    for row, L in enumerate(ref.lengths.tolist()):
        live = [p % W for p in range(max(spec.boundary(L), S), L)]
        for res in ("k_res", "v_res"):
            a, b = getattr(ref, res)[row, :, live], getattr(got, res)[row, :, live].cpu()
            assert torch.equal(bits(a), bits(b)), (res, row, L, spec.name)
    for a, b in zip(dequantize_reference(ref, spec), dequantize_reference(got.__class__(*[t.cpu() for t in got]), spec)):
        assert torch.equal(bits(a), bits(b))


@st.composite
def quants(draw, D):
    fmt = draw(st.sampled_from(["int8", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "none"]))
    if fmt.startswith("fp8") and draw(st.integers(0, 2)) == 0:
        return Quant(fmt, "tensor")  # one fixed scale (1.0), none stored
    axis = draw(st.sampled_from(["token", "channel"]))
    if axis == "token":
        group = draw(st.sampled_from([None] + [g for g in (1, 2, 8, 16, 32) if D % g == 0]))
    else:
        group = draw(st.sampled_from([1, 2, 4, 8, 16]))
    sym = True if fmt.startswith("fp8") else draw(st.booleans())
    return Quant(fmt, axis, group, sym, draw(st.sampled_from(["float16", "float16", "float32", "fp8_e4m3"])))


def tie_rows(fmt: str, sym: bool, D: int) -> torch.Tensor:
    """One row of D values whose quantization scale is exactly 1, so that most values are ties: half-integers
    for integers, midpoints between neighbouring fp8 values for fp8 (round half to even decides them)."""
    q = Quant(fmt, "token", None, sym)
    if q.is_fp8:
        vals = torch.arange(256, dtype=torch.uint8).view(Q.FP8_DTYPES[fmt]).float()
        vals = vals[vals.isfinite() & (vals > 0) & (vals < Q.FP8_MAX[fmt])].sort().values
        mids = ((vals[1:] + vals[:-1]) / 2)[:: max(1, len(vals) // (D - 1))]
        row = torch.cat([torch.tensor([Q.FP8_MAX[fmt]]), mids, -mids])
    elif sym:
        qs = 2 ** (q.bits - 1) - 1
        half = torch.arange(-qs, qs) + 0.5
        row = torch.cat([torch.tensor([float(qs), -float(qs)]), half.repeat(D)])
    else:
        qa = 2 ** q.bits - 1
        row = torch.cat([torch.tensor([0.0, float(qa)]), (torch.arange(qa) + 0.5).repeat(D)])
    return row[:D]


def around(values: torch.Tensor) -> torch.Tensor:
    """Each fp32 value, its midpoints with its neighbours in the list, and one fp32 ulp either side of all."""
    v = values.float().unique().sort().values
    mids = (v[1:].double() + v[:-1].double()) / 2
    pts = torch.cat([v, mids.float()])
    pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, float("inf"))),
                     torch.nextafter(pts, torch.full_like(pts, float("-inf")))])
    return torch.cat([pts, -pts]).unique()


def scrambled(spec, batch, blocks, seed, device="cpu") -> KVStore:
    """An empty ``KVStore`` whose pool of ``blocks`` blocks hands them out in a random order, so that a
    sequence's blocks are neither contiguous nor in order: kernels must follow the block table."""
    st = KVStore(spec, batch, device, blocks=blocks)
    g = torch.Generator().manual_seed(seed)
    st.free = [st.free[i] for i in torch.randperm(len(st.free), generator=g).tolist()]
    return st


def with_history(policy, B, H, D, dtype, history, chunks, seed, device="cpu", block=16):
    """A store prefilled per row (ragged ``history``) by the reference, its blocks scrambled, and an identical
    copy on ``device`` for the kernel. Returns (spec, ref, got, generator, scale): ``ref`` and ``got`` are
    ``KVStore``s (append the chunks with ``ref.append(k, v, n)`` and ``got.append(k, v, n, kernel=...)``:
    both reserve the same blocks), the generator and key scale draw the chunks. Blocks hold ``block``
    packed tokens (or the policy's flush group): small, so that short histories span several."""
    g = torch.Generator().manual_seed(seed)
    spec = LayerSpec(policy, H, D, dtype, max(block, policy.flush))
    spec.register()
    total = max(history) + sum(chunks) + 1
    ref = scrambled(spec, B, B * (spec.blocks_for(total) + 1), seed)
    m = max(history)
    scale = float(torch.rand((), generator=g) * 20 + 0.01)  # magnitudes over several binades
    ref.append(torch.randn(B, H, m, D, generator=g) * scale, torch.randn(B, H, m, D, generator=g),
               torch.tensor(history))
    return spec, ref, ref.copy(device), g, scale


def bad_store(policy, dtype, B: int, H: int, D: int, L: int, kernel=None):
    """A scrambled-pool store of 16-token blocks holding NaN, +inf and -inf keys and values at every placement
    (``nonfinite_checks.bad_inputs``) for two sequences of ``L`` and ``L - 13`` tokens, written by ``kernel``
    (default: the reference). Returns (spec, store, k, v)."""
    from nonfinite_checks import bad_inputs

    spec = LayerSpec(policy, H, D, dtype, block_tokens=16)
    spec.register()
    k, v = bad_inputs(spec, B, L, 3, 1.0, extremes=False)
    store = scrambled(spec, B, 2 * B * spec.blocks_for(L), seed=3)
    store.append(k, v, torch.tensor([L, L - 13]), **({"kernel": kernel} if kernel else {}))
    return spec, store, k, v
