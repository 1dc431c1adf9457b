"""Torture: magnitudes up to each model dtype's largest value, NaN and +-inf at group edges, in sinks and in
the residual window, every format and axis, through every kernel family at once.

Each example appends the same ragged chunks to one store per kernel family -- the reference
(``store_reference``), the C store and the Triton store (Triton's interpreter on the CPU) -- and checks:

- the three stores are equal bit for bit (codes, scales, zero points, sinks, live ring slots, lengths);
- finite in, finite out: without a NaN or inf in the input, every stored scale and zero point and every value
  read back (in fp32 and in the model dtype) is finite;
- attention: the reference, the C decode kernel (one split and two), the C prefill path, the Triton kernel
  and the Inductor template (eager) are NaN at exactly the outputs ``attention_reference``'s rule names (and
  never inf), and every other output is within the derived bound of float64 attention.

Bounded to run in about a minute on a loaded two-core machine: six fixed layouts (so at most twelve C builds,
cached on disk afterwards), small shapes, few examples. Queries are scaled so that scores stay O(1) (a score
beyond fp32 is outside the finite-out guarantee: it is NaN by the rule, but where it overflows depends on the
summation order), and attention is checked only where the values cannot overflow an fp32 sum of the positions
(``N * max|v| < 3.4e38``); the store is checked at every magnitude.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from kvcompile import Policy, Quant
from kvcompile.store import LayerSpec, attention_reference, dequantize_reference
from kvcompile.templates import attention as kattn
from kvcompile.templates import cpu, cpu_store, inductor, launch
from kvcompile.templates import prefill as kprefill
import profiles
from nonfinite_checks import DTYPE_MAX, assert_nan_pattern, placements

sys.path.insert(0, str(Path(__file__).parent / "templates"))
from store_checks import assert_same_store, scrambled  # noqa: E402

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")

# Every format, both axes, symmetric and not, both scale dtypes, every model dtype, sinks, residuals, rotation.
LAYOUTS = [
    (Policy(Quant("int8", "token", None, False, "float16"), Quant("int4", "channel", 4, True, "float32"),
            residual=3, sink=2), "float32"),
    (Policy(Quant("int2", "channel", 4, False, "float16"), Quant("int3", "token", 8, False, "float16"),
            residual=0, sink=1), "float16"),
    (Policy(Quant("fp8_e4m3", "token", 8), Quant("fp8_e5m2", "channel", 4, scale_dtype="float32"), residual=2),
     "bfloat16"),
    (Policy(Quant("int4", "token", None, True, "float32"), Quant("none"), residual=4, sink=2, rotate=True),
     "float32"),
    (Policy(Quant("int3", "channel", 4, True), Quant("int8", "channel", 4, False, "float32"), residual=1),
     "bfloat16"),
    (Policy(Quant("fp8_e5m2", "token"), Quant("int2", "token", 8, True, "float32"), residual=2, sink=1), "float16"),
]
H, G, D = 1, 2, 16
SPECS = []
for _policy, _dtype in LAYOUTS:
    SPECS.append(LayerSpec(_policy, H, D, _dtype, block_tokens=16))
    SPECS[-1].register()


@st.composite
def cases(draw):
    spec = SPECS[draw(st.integers(0, len(SPECS) - 1))]
    dtype = spec.torch_dtype
    top = math.log10(DTYPE_MAX[dtype])
    lengths = [draw(st.integers(1, 36)), draw(st.integers(1, 36))]
    # magnitudes: keys and values each at 10**e, e up to the dtype's largest (rows spread over 4 decades)
    ek, ev = draw(st.floats(0.0, top)), draw(st.floats(0.0, top))
    L = max(lengths)
    spots = [pc for pcs in placements(spec, L).values() for pc in pcs]
    bad = draw(st.lists(st.tuples(st.sampled_from("kv"), st.integers(0, 1), st.sampled_from(spots),
                                  st.sampled_from(["nan", "inf", "-inf", "max", "-max"])),
                        min_size=draw(st.sampled_from([0, 1, 1, 2])), max_size=4))
    first = draw(st.integers(1, L))  # the first append (a prefill); the rest as decode steps and a chunk
    n = draw(st.sampled_from([1, 3]))
    mask = draw(st.sampled_from([None, "bool", "float"]))
    return spec, lengths, ek, ev, bad, first, n, mask, draw(st.integers(0, 2 ** 31 - 1))


def _inputs(spec, lengths, ek, ev, bad, seed):
    dtype, top = spec.torch_dtype, DTYPE_MAX[spec.torch_dtype]
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    out = []
    for e in (ek, ev):
        x = torch.randn(2, H, L, D, generator=g, dtype=torch.float64) * 10.0 ** e
        x = x * 10.0 ** -(torch.rand(2, H, L, 1, generator=g, dtype=torch.float64) * 4)
        out.append(x.clamp(-top, top))
    k, v = out
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "max": top, "-max": -top}
    for which, b, (p, c), what in bad:
        (k if which == "k" else v)[b, 0, p, c] = value[what]
    return k.to(dtype), v.to(dtype)


def ref_nan_expected(bad) -> bool:
    return any(what in ("nan", "inf", "-inf") for *_, what in bad)


def _append_all(stores, k, v, lengths, first):
    """The same appends into each store: a ragged prefill, decode steps, then the rest as one chunk."""
    L = max(lengths)
    cuts = [0, first] + [t for t in range(first + 1, min(first + 3, L) + 1)] + [L]
    cuts = sorted(set(cuts))
    for a, b in zip(cuts, cuts[1:]):
        n_new = torch.tensor([max(0, min(Lr, b) - a) for Lr in lengths], dtype=torch.int32)
        for st, kernel in stores:
            st.append(k[:, :, a:b], v[:, :, a:b], n_new, kernel=kernel)


@pytest.mark.slow
@profiles.KERNEL
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN operands
@given(cases())
def test_torture(case):
    spec, lengths, ek, ev, bad, first, n, mask_kind, seed = case
    k, v = _inputs(spec, lengths, ek, ev, bad, seed)
    ref = scrambled(spec, 2, 2 * spec.blocks_for(max(lengths)) + 2, seed % 97)
    c_store, t_store = ref.copy(), ref.copy()
    _append_all([(ref, None), (c_store, cpu_store.store), (t_store, launch.store)], k, v, lengths, first)
    assert_same_store(ref.state, c_store.state, spec)
    assert_same_store(ref.state, t_store.state, spec)
    state = ref.state
    held = dequantize_reference(state, spec, torch.float64, rotated=True)
    if not any(what in ("nan", "inf", "-inf") for *_, what in bad):  # finite in, finite out
        assert all(torch.isfinite(t.float()).all() for t in state[:10])
        for dt in (torch.float32, spec.torch_dtype):
            assert all(torch.isfinite(x).all() for x in dequantize_reference(state, spec, dt))

    # attention: scores O(1), and only where an fp32 sum of the values cannot overflow
    kmax = max(1.0, float(torch.where(held[0].isfinite(), held[0], 0).abs().max()))
    vmax = float(torch.where(held[1].isfinite(), held[1], 0).abs().max())
    if vmax * max(lengths) * 4 > torch.finfo(torch.float32).max:
        event("attention skipped: values could overflow an fp32 sum")
        return
    event(f"attention checked ({'with' if ref_nan_expected(bad) else 'no'} non-finite input)")
    g = torch.Generator().manual_seed(seed + 1)
    B, L = 2, max(lengths)
    q = (torch.randn(B, H * G, n, D, generator=g, dtype=torch.float64) / kmax).to(spec.torch_dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, n, L + 1, generator=g) > 0.4
    elif mask_kind == "float":
        mask = torch.where(torch.rand(B, 1, n, L + 1, generator=g) > 0.4, torch.randn(B, 1, n, L + 1, generator=g),
                           -torch.inf)
    ref_out = attention_reference(q, state, spec, mask, None, torch.float64)
    assert_nan_pattern(attention_reference(q, state, spec, mask, None), ref_out, "reference fp32")

    def within(got, nsplit, what, bound=None):
        assert_nan_pattern(got, ref_out, f"{what} {spec.name}")
        want, tol = bound or kattn.reference_and_bound(q, state, spec, mask, None, nsplit=nsplit)
        ok = ~want.isnan()
        err = (got.double() - want).abs()
        assert (err[ok] <= tol[ok]).all(), f"{what} {spec.name}: worst {float((err - tol)[ok].max()):.3g}"

    for nsplit in (1, 2):
        within(cpu.attention(q, state, spec, mask, None, nsplit=nsplit), nsplit, "C decode")
    within(kprefill.prefill_attention(q, state, spec, mask, None), max(L, 1), "C prefill")
    # the kernel launch.attention chooses (the decode kernel serves many decode layouts), and its bound
    within(launch.attention(q, t_store.state, spec, mask, None), None, "Triton",
           launch.reference_and_bound(q, t_store.state, spec, mask, None))
    within(inductor.attention(q, state, spec, mask, None), max(L, 1), "Inductor")
