"""What the store and attention do with NaN, inf and values near a dtype's largest, written independently of
the code under test, for the reference's, the kernels' and the torture tests.

``oracle`` is ``attention_reference``'s documented rule for non-finite values written out per query row in
float64 over what the store holds (``dequantize_reference``): the positions a row sees, its scores; a
non-finite visible score makes the row NaN; else the softmax over the visible positions, with a channel NaN
where a visible value is not finite. ``placements`` lists where a bad value can sit: sinks, packed groups
(their first and last token and channel), the residual window, the queries' own chunk.
"""
from __future__ import annotations

import math

import torch

from kvcompile import Policy, Quant
from kvcompile.store import dequantize_reference, hadamard, with_chunk

# Every format, both axes, every scale dtype, sinks, residuals and rotation: the policies each kernel family's
# non-finite tests store and read.
NONFINITE_POLICIES = [
    Policy(Quant("int4", "channel", 4), Quant("int8", "token", 8), residual=3, sink=2),
    Policy(Quant("int3", "token", None, True, "float32"), Quant("int2", "channel", 4, True), residual=0, sink=1),
    Policy(Quant("fp8_e4m3", "channel", 4, scale_dtype="float32"), Quant("fp8_e5m2", "token", 8), residual=2,
           rotate=True),
    Policy(Quant("int2", "channel", 4, scale_dtype="fp8_e4m3"), Quant("int4", "token", 8, scale_dtype="fp8_e4m3"),
           residual=0, sink=2),
    Policy(Quant("fp8_e5m2", "channel", 4, scale_dtype="fp8_e4m3"),
           Quant("int8", "token", None, True, "fp8_e4m3"), residual=3, rotate=True),
    Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=2, sink=1),
]

BAD = (float("nan"), float("inf"), -float("inf"))
DTYPE_MAX = {torch.float32: torch.finfo(torch.float32).max, torch.bfloat16: torch.finfo(torch.bfloat16).max,
             torch.float16: 65504.0}


def oracle(q, state, spec, mask=None, scale=None, k_new=None, v_new=None) -> torch.Tensor:
    """float64 ``[B, Hq, n, D]``: attention over the stored values by the documented rule, one row at a time."""
    B, Hq, n, D = q.shape
    H = spec.heads
    lengths = state.lengths.tolist()
    C = mask.shape[-1] if mask is not None else max(lengths)
    C = max(C, max(lengths))
    k, v = dequantize_reference(state, spec, torch.float64, rotated=True, end=C)
    if k_new is not None:
        k, v = with_chunk(k, v, state, spec, k_new, v_new)
    qr = q.float()
    if spec.policy.rotate:  # the query rotated in fp32, as every implementation does
        qr = qr @ hadamard(D, q.device)
    qr = qr.double()
    sc_scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, Hq, n, D, dtype=torch.float64)
    for b in range(B):
        L = lengths[b]
        for hq in range(Hq):
            for i in range(n):
                ps, add = [], []
                for p in range(L):
                    if mask is None:
                        if p <= L - n + i:
                            ps.append(p), add.append(0.0)
                        continue
                    if p >= mask.shape[-1]:
                        continue
                    mv = mask[min(b, mask.shape[0] - 1), min(hq, mask.shape[1] - 1), min(i, mask.shape[2] - 1), p]
                    if mask.dtype == torch.bool:
                        if bool(mv):
                            ps.append(p), add.append(0.0)
                    elif float(mv) != float("-inf"):
                        ps.append(p), add.append(float(mv))
                if not ps:
                    continue
                kk, vv = k[b, hq // (Hq // H), ps], v[b, hq // (Hq // H), ps]
                s = (kk @ qr[b, hq, i]) * sc_scale + torch.tensor(add, dtype=torch.float64)
                if not bool(torch.isfinite(s).all()) or not bool(torch.isfinite(kk).all()):
                    out[b, hq, i] = float("nan")
                    continue
                w = torch.softmax(s, 0)
                o = w @ torch.where(torch.isfinite(vv), vv, 0.0)
                o[~torch.isfinite(vv).all(0)] = float("nan")
                out[b, hq, i] = o
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device, torch.float64)
    return out


def assert_nan_pattern(got, want, what=""):
    """``got`` is NaN exactly where ``want`` is, and never +-inf (every non-finite output is NaN)."""
    assert not torch.isinf(got).any(), f"{what}: {int(torch.isinf(got).sum())} infinite outputs"
    g, w = got.isnan(), want.isnan()
    assert torch.equal(g, w), (f"{what}: NaN at {int(g.sum())} outputs, expected {int(w.sum())}; first "
                               f"differences at {(g != w).nonzero()[:4].tolist()}")


def assert_close(got, want, rtol=1e-5, what=""):
    """The NaN pattern, and every other output within ``rtol`` of ``want``'s scale (its row's largest)."""
    assert_nan_pattern(got, want, what)
    ok = ~want.isnan()
    if ok.any():
        scale = torch.where(ok, want, 0.0).abs().amax(-1, keepdim=True).expand_as(want)[ok]
        err = (got.double()[ok] - want[ok]).abs()
        assert (err <= rtol * (1 + scale)).all(), f"{what}: worst error {(err - rtol * (1 + scale)).max():.3g}"


def placements(spec, L: int) -> dict[str, list[tuple[int, int]]]:
    """(position, channel) pairs of a sequence of ``L`` tokens, by region: the sinks, the packed positions on
    a flush group's first or last token and a channel group's first or last channel, the residual window."""
    S, F, D = spec.sink, spec.flush, spec.head_dim
    g = spec.policy.value.group_for(D) if spec.policy.value.quantized else D
    g = g if spec.policy.value.axis == "token" else 8
    Q = spec.boundary(L)
    chans = sorted({0, g - 1, min(g, D - 1), D - 1})
    out = {"sink": [(p, c) for p in range(min(S, L)) for c in chans[:2]],
           "packed": [(p, c) for p in sorted({S, S + F - 1, Q - F, Q - 1}) if S <= p < Q for c in chans],
           "residual": [(p, c) for p in sorted({max(Q, S), L - 1}) if max(Q, S) <= p < L for c in chans[:2]]}
    return {k: v for k, v in out.items() if v}


def bad_inputs(spec, B: int, L: int, seed: int, magnitude: float, bad=BAD, dtype=None, extremes=True):
    """Keys and values ``[B, H, L, D]`` in the model dtype: randn times ``magnitude`` (clamped to the dtype's
    largest value, which two elements take exactly when ``extremes``), rows scaled over four decades, and --
    unless ``bad`` is empty -- NaN, +inf and -inf placed in turn at every ``placements`` spot (keys in even,
    values in odd)."""
    dtype = dtype or spec.torch_dtype
    g = torch.Generator().manual_seed(seed)
    top = DTYPE_MAX[dtype]
    H, D = spec.heads, spec.head_dim
    x = torch.randn(2, B, H, L, D, generator=g, dtype=torch.float64) * magnitude
    x = x * 10.0 ** -(torch.rand(2, B, H, L, 1, generator=g, dtype=torch.float64) * 4)
    if extremes:
        x[0, 0, 0, L // 2, 1], x[1, -1, -1, L // 3, 2] = top, -top
    x = x.clamp(-top, top).to(dtype)
    if bad:
        spots = [pc for pcs in placements(spec, L).values() for pc in pcs]
        for i, (p, c) in enumerate(spots):
            x[i % 2, (i // 2) % B, (i // 4) % H, p, c] = bad[i % len(bad)]
    return x[0], x[1]
