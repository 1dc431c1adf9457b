"""Can KVQuant's recipe reach the 4-bit bar at 3.5x for 1K-token requests, with no window of recent tokens?
(docs/results.md, "Serving": every window-free layout tried before is above +0.003.)

KVQuant stores keys before the rotary embedding, where their outlier channels are sharp and stable, and quantizes
each key channel against a range calibrated offline, so a key is coded alone when it is written (no group of tokens
to wait for, no window); the few elements outside the range are kept exactly in a sparse side store
("dense-and-sparse"); the 16 levels may be non-uniform, fitted to where the calibration keys lie. Simulated here
in a ``DynamicCache`` (stored tokens quantized and dequantized, the call's own tokens exact, the held-out protocol
of ``kvcompile eval``), with a page-friendly sparse store: ``k`` slots per token and KV head, each an exact fp16
value and its 6-bit channel index (22 bits), holding the ``k`` elements farthest outside the range (any others
are clamped into it).

A variant is ``KEYS/VALUES/S``:

- ``KEYS``: ``pre`` or ``post`` (the rotary embedding undone on the stored keys, positions 0.. as the protocol
  feeds them, or not), then ``:qQ`` (the range per layer, KV head and channel between the ``Q`` and ``1 - Q``
  quantiles of the calibration keys; ``q0`` their minimum and maximum), ``:kK`` (outlier slots) and ``:nuq``
  (16 levels per layer from Lloyd's algorithm on the calibration keys in their ranges, instead of uniform);
  or ``tok`` (kvcompile's per-token keys after the Hadamard rotation, fp16 scale and minimum: tok+rot:4's).
- ``VALUES``: ``rot`` (per token-head after the rotation, kvcompile's layout, an fp16 scale and minimum) or
  ``rot8`` (the scale rounded up to e4m3, an int8 zero point: 16 bits a token-head), with ``:kK`` outlier slots
  taken before the rotation (then none is applied).
- ``S``: sinks, first tokens kept exact.

The ranges come from ``kvcompile.calibrate``'s calibration text (2,048 tokens, not the held-out text). Bits per
element count a 1K-token request (codes, scales, outlier slots, sinks; static ranges are per model, not request).

    python benchmarks/dense_sparse.py pre:q0:k0/rot/4 pre:q0.001:k1/rot/4 pre:q0.001:k1:nuq/rot/4 \\
        post:q0.001:k1/rot/4 --windows 16 --full-from benchmarks/results/eval_serving/key_window.json \\
        --out benchmarks/results/eval_serving/dense_sparse.json                    # about 7 minutes a row

A negative result (docs/results.md, "KVQuant's recipe"): the best row, +0.0098 at 3.58x, is three quarters of tok+rot:4's
loss and three times the 4-bit bar's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.key_window import REQUEST, SimulatedCache, library_row, quantize, run  # noqa: E402
from kvcompile.calibrate import calibration_windows  # noqa: E402
from kvcompile import evaluate as E  # noqa: E402
from kvcompile.policy import Policy  # noqa: E402
from kvcompile.store import hadamard  # noqa: E402

SLOT_BITS = 16 + 6  # an exact fp16 value and its channel index (head size 64)
LEVELS = 16


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class Rope:
    """The model's rotary embedding at positions 0..n, to undo and redo it on stored keys."""

    def __init__(self, model):
        self.model = model
        self.cos = self.sin = None

    def table(self, n: int):
        if self.cos is None or self.cos.shape[-2] < n:
            x = torch.zeros(1, 1, dtype=torch.float32)
            cos, sin = self.model.model.rotary_emb(x, torch.arange(max(n, 4096))[None])
            self.cos, self.sin = cos[0].float(), sin[0].float()  # [T, D]
        return self.cos[:n], self.sin[:n]

    def undo(self, k: torch.Tensor) -> torch.Tensor:
        cos, sin = self.table(k.shape[-2])
        return k * cos - rotate_half(k) * sin

    def redo(self, k: torch.Tensor) -> torch.Tensor:
        cos, sin = self.table(k.shape[-2])
        return k * cos + rotate_half(k) * sin


def calibration_keys(model, tok, rope: Rope, skip: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the calibration text's keys ``[H, N, D]`` after and before the rotary embedding (the first
    ``skip`` tokens of each window, the sinks, left out)."""
    windows = calibration_windows(tok)
    seen: dict[int, list[torch.Tensor]] = {}

    class Record(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            seen.setdefault(layer_idx, []).append(k.float())
            return super().update(k, v, layer_idx, *args, **kwargs)

    with torch.no_grad():
        for w in windows:
            E._forward(model, w[None], Record(), keep=1)
    out = []
    for i in sorted(seen):
        ks = [k[0] for k in seen[i]]  # each [H, T, D] from one window, positions 0..T-1
        post = torch.cat([k[:, skip:] for k in ks], 1)
        pre = torch.cat([rope.undo(k)[:, skip:] for k in ks], 1)
        out.append((post, pre))
    return out


def lloyd(x: torch.Tensor, levels: int = LEVELS, steps: int = 30) -> torch.Tensor:
    """``levels`` points minimising the squared error of ``x`` (1-D, in [0, 1]) to its nearest point."""
    c = torch.linspace(0, 1, levels)
    for _ in range(steps):
        idx = (x[:, None] - c[None]).abs().argmin(1)
        for j in range(levels):
            m = x[idx == j]
            if len(m):
                c[j] = m.mean()
        c, _ = c.sort()
    return c


class StaticRanges:
    """Per layer, KV head and channel: a range ``[lo, hi]`` and (nuq) 16 levels per layer in it."""

    def __init__(self, keys: list[torch.Tensor], q: float, nuq: bool):
        self.lo, self.hi, self.levels = [], [], []
        for k in keys:  # [H, N, D]
            lo = torch.quantile(k, q, dim=1, keepdim=True) if q else k.amin(1, keepdim=True)
            hi = torch.quantile(k, 1 - q, dim=1, keepdim=True) if q else k.amax(1, keepdim=True)
            self.lo.append(lo[None])  # [1, H, 1, D]: broadcast over [B, H, T, D]
            self.hi.append(hi[None])
            if nuq:
                u = ((k - lo) / (hi - lo).clamp_min(1e-8)).clamp(0, 1).flatten()
                u = u[torch.randperm(len(u), generator=torch.Generator().manual_seed(0))[:200_000]]
                self.levels.append(lloyd(u))
            else:
                self.levels.append(torch.linspace(0, 1, LEVELS))


def outliers_exact(x: torch.Tensor, coded: torch.Tensor, excursion: torch.Tensor, k: int) -> torch.Tensor:
    """``coded`` with the ``k`` elements of largest ``excursion`` (over the last dimension) put back exact."""
    if k == 0:
        return coded
    top = excursion.topk(k, -1).indices
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top, True) & (excursion > 0)
    return torch.where(keep, x, coded)


def static_code(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor, k: int) -> torch.Tensor:
    """``x [B, H, T, D]`` coded against the static range per channel, ``k`` outliers per token-head exact."""
    span = (hi - lo).clamp_min(1e-8)
    u = ((x - lo) / span).clamp(0, 1)
    idx = (u[..., None] - levels).abs().argmin(-1)
    coded = levels[idx] * span + lo
    excursion = torch.maximum(lo - x, x - hi)
    return outliers_exact(x, coded, excursion, k)


class DenseSparseCache(SimulatedCache):
    def __init__(self, keys: str, ranges: StaticRanges | None, kslots: int, values: str, vslots: int, sink: int,
                 rope: Rope, head: int):
        super().__init__()
        self.kmode, self.ranges, self.kslots = keys, ranges, kslots
        self.vmode, self.vslots, self.sink, self.rope = values, vslots, sink, rope
        self.H = hadamard(head, dtype=torch.float64).float()

    def keys(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        x = k.float()
        if self.kmode == "tok":
            out = quantize(x @ self.H, 4, "f16") @ self.H.T
        else:
            pre = self.kmode == "pre"
            y = self.rope.undo(x) if pre else x
            r = self.ranges
            out = static_code(y, r.lo[layer], r.hi[layer], r.levels[layer], self.kslots)
            out = self.rope.redo(out) if pre else out
        out[:, :, :self.sink] = x[:, :, :self.sink]
        return out.to(k.dtype)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        x = v.float()
        body = "f16" if self.vmode == "rot" else "e4m3z8"
        if self.vslots:  # outliers from the raw values (largest deviation from the token-head's median), no rotation
            dev = (x - x.median(-1, keepdim=True).values).abs()
            top = dev.topk(self.vslots, -1).indices
            keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top, True)
            rest = torch.where(keep, x.median(-1, keepdim=True).values, x)  # out of the dense range
            out = torch.where(keep, x, quantize(rest, 4, body))
        else:
            out = quantize(x @ self.H, 4, body) @ self.H.T
        out[:, :, :self.sink] = x[:, :, :self.sink]
        return out.to(v.dtype)

    def held_keys(self, K: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        return self.keys(K[:, :, :t], layer)

    def held_values(self, V: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        return self.values(V[:, :, :t])


_CAL: dict = {}


def variant(spec: str, head: int):
    """``(make_cache, policy, bits per element at 1K tokens or None)``."""
    row = library_row(spec)
    if row:
        return row
    try:
        kspec, vspec, sink = spec.split("/")
        kparts, vparts = kspec.split(":"), vspec.split(":")
        kmode, vmode, sink = kparts[0], vparts[0], int(sink)
        kopt = {p[:1] if p != "nuq" else "nuq": p for p in kparts[1:]}
        q = float(kopt.get("q", "q0")[1:])
        kslots = int(kopt.get("k", "k0")[1:])
        nuq = "nuq" in kopt
        vslots = int(next((p[1:] for p in vparts[1:] if p.startswith("k")), 0))
        assert kmode in ("pre", "post", "tok") and vmode in ("rot", "rot8")
    except (ValueError, AssertionError):
        raise SystemExit(f"{spec!r}: expected KEYS/VALUES/S, e.g. pre:q0.001:k1:nuq/rot:k1/4") from None
    kbits = 4 + (32 / head if kmode == "tok" else kslots * SLOT_BITS / head)
    vbits = 4 + (32 if vmode == "rot" else 16) / head + vslots * SLOT_BITS / head
    total = ((REQUEST - sink) * (kbits + vbits) + sink * 32) / (2 * REQUEST)

    def make(model, policy, n, fast):
        if "rope" not in _CAL:
            from transformers import AutoTokenizer

            from kvcompile import models
            _CAL["rope"] = Rope(model)
            tok = AutoTokenizer.from_pretrained(models.resolve(log=lambda *a: None))
            _CAL["keys"] = calibration_keys(model, tok, _CAL["rope"])
        ranges = None
        if kmode != "tok":
            key = (kmode, q, nuq)
            if key not in _CAL:
                _CAL[key] = StaticRanges([k[1] if kmode == "pre" else k[0] for k in _CAL["keys"]], q, nuq)
            ranges = _CAL[key]
        return DenseSparseCache(kmode, ranges, kslots, vmode, vslots, sink, _CAL["rope"], head)

    return make, Policy.full(), total


def main() -> None:
    run(variant, __doc__, "full, lib:SCHEME:BITS or lib:POLICY.json, or KEYS/VALUES/S (see the module's doc)")


if __name__ == "__main__":
    main()
