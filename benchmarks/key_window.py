"""Can per-token 4-bit keys reach the 4-bit bar with a window of recent keys kept more exactly (and values with
none), at the bytes of 3.5x? A negative result, kept so that it can be run again (docs/results.md, "Serving").

The formats are simulated, not kvcompile's kernels: a ``DynamicCache`` hands attention every stored token
quantized and dequantized (after the Hadamard rotation, per token and KV head), and the call's own tokens in full
precision, as kvcompile's caches do; the held-out protocol is ``kvcompile eval``'s, over ``--windows`` windows.
Two bodies: kvcompile's layout (``f16``: an fp16 scale and minimum per token-head, 4.5 bits at head size 64,
quantized by ``kvcompile.quant`` itself) and a cheaper one (``e4m3``: a scale rounded up to fp8 e4m3 and a 4-bit
integer zero point, 4.19 bits). A trailing ``,c`` centres the keys on the request's mean key first. A key window
of ``W`` tokens holds the last ``W`` keys in full precision (``fp``) or int8 with the cheaper scale (``int8``);
a key leaving it is coded from its original value, as a store that keeps the window as a refinement of the
page's codes would. Bits per element are counted for a 1K-token request. ``lib:SCHEME:BITS`` rows run kvcompile's
own cache for comparison.

    python benchmarks/key_window.py full lib:kivi+rot+sink:4 lib:tok+rot:4 f16 f16,c e4m3 e4m3,c e4m3,128,int8 \\
        e4m3,128,int8,c f16,128,fp --windows 16 --out benchmarks/results/eval_serving/key_window.json
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import DynamicCache

from kvcompile import evaluate as E
from kvcompile import models
from kvcompile.policy import Policy, Quant
from kvcompile.quant import dequantize, quantize as quantize_lib, round_to_dtype
from kvcompile.store import hadamard

REQUEST = 1024  # tokens of the request the bits are counted for
PLAIN = E.make_cache  # kvcompile's own cache, for the lib: rows (main swaps E.make_cache per row)


def e4m3_up(s: torch.Tensor) -> torch.Tensor:
    """``s`` rounded up to fp8 e4m3 as kvcompile stores a scale (``kvcompile.quant.round_to_dtype``): 3 mantissa
    bits down to 2**-6, then steps of 2**-9 (its subnormals; a smaller scale becomes 2**-9), at most 448. (Until
    2026-12-03 this kept 3 mantissa bits at every magnitude, which made small scales finer than e4m3 holds.)"""
    return round_to_dtype(s.float().clamp(0, 448.0), torch.float8_e4m3fn, "up").float()


def quantize(x: torch.Tensor, bits: int, body: str) -> torch.Tensor:
    """``x`` asymmetrically quantized and dequantized over its last dimension: ``f16`` kvcompile's own layout,
    ``e4m3`` a scale rounded up to fp8 e4m3 with a zero point among the codes, ``e4m3z8`` with an int8 one."""
    if body == "f16":  # kvcompile's own layout and rounding
        q = Quant(f"int{bits}", "token")
        return dequantize(*quantize_lib(x, q), q)
    top = 2 ** bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = e4m3_up((hi - lo) / top)  # rounded up: the range still fits once the zero point is rounded
    zmin, zmax = (-128, 127) if body == "e4m3z8" else (0, top)
    zero = torch.clamp(torch.round(-lo / s), zmin, zmax)
    return (torch.clamp(torch.round(x / s) + zero, 0, top) - zero) * s


def bits(body: str, head: int, b: int = 4) -> float:
    return b + (32 if body == "f16" else b + 8) / head


class SimulatedCache(DynamicCache):
    """A ``DynamicCache`` that hands attention the tokens stored before a call as a simulated format holds them
    and the call's own tokens exact, as kvcompile's caches do. A format says what it holds: ``held_keys(K, t,
    layer)`` and ``held_values(V, t, layer)`` the first ``t`` of every key or value written so far (the call's
    own last)."""

    def held_keys(self, K: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def held_values(self, V: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def update(self, k, v, layer_idx, *args, **kwargs):
        new = k.shape[2]
        K, V = super().update(k, v, layer_idx, *args, **kwargs)
        t = K.shape[2] - new
        if t == 0:
            return K, V
        return (torch.cat([self.held_keys(K, t, layer_idx), K[:, :, t:]], 2),
                torch.cat([self.held_values(V, t, layer_idx), V[:, :, t:]], 2))


class WindowCache(SimulatedCache):
    """Stored tokens as the variant would hold them; the call's own tokens exact."""

    def __init__(self, body: str | None, window: int, window_format: str, head: int, centre: bool = False):
        super().__init__()
        self.body, self.window, self.window_format, self.centre = body, window, window_format, centre
        self.H = hadamard(head, dtype=torch.float64).float()
        self.mu = {}  # layer -> the request's mean key (fp16-rounded), taken from its first call

    def stored(self, x: torch.Tensor, window: int) -> torch.Tensor:
        if self.body is None:
            return x
        y = x.float() @ self.H
        out = quantize(y, 4, self.body)
        w = min(window, y.shape[2])
        if w:
            recent = y[:, :, -w:]
            out[:, :, -w:] = recent if self.window_format == "fp" else quantize(recent, 8, "e4m3")
        return (out @ self.H.T).to(x.dtype)

    def held_keys(self, K: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        mu = self.mu.get(layer, 0.0)  # stored as k - mu; adding mu back equals shifting every score alike
        return (self.stored(K[:, :, :t].float() - mu, self.window) + mu).to(K.dtype)

    def held_values(self, V: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        return self.stored(V[:, :, :t], 0)

    def update(self, k, v, layer_idx, *args, **kwargs):
        if self.centre and layer_idx not in self.mu:  # the first token (a sink) left out of the mean
            self.mu[layer_idx] = k[:, :, min(1, k.shape[2] - 1):].float().mean(2, keepdim=True).half().float()
        return super().update(k, v, layer_idx, *args, **kwargs)


def library_row(spec: str):
    """``(make_cache, policy, bits)`` for the rows every simulation script shares, else None: ``full`` (a plain
    ``DynamicCache``) and ``lib:SCHEME:BITS`` or ``lib:POLICY.json`` (kvcompile's own cache; bits not counted)."""
    if spec.startswith("lib:"):
        entry = spec[4:]
        return PLAIN, (Policy.load(entry) if E.is_policy_file(entry) else E.scheme_policy(*E.parse_entry(entry))), None
    if spec == "full":
        return (lambda model, policy, n, fast: DynamicCache()), Policy.full(), 16.0
    return None


def variant(spec: str, head: int):
    """``(make_cache, policy, bits per element)`` for ``full``, ``lib:SCHEME:BITS`` or ``BODY[,W,fp|int8][,c]``
    (``c``: keys centred on the request's mean key, an fp16 vector per layer and KV head taken from its first
    call; exact in full precision, since every score a query reads shifts by the same ``q . mu``)."""
    row = library_row(spec)
    if row:
        return row
    parts = spec.split(",")
    centre = parts[-1] == "c"
    body, window, fmt = (parts[:len(parts) - centre] + ["0", "fp"])[:3]
    window = int(window)
    hi = 16.0 if fmt == "fp" else bits("e4m3", head, 8)
    key_bits = ((REQUEST - window) * bits(body, head) + window * hi) / REQUEST + (16 / REQUEST if centre else 0)
    return ((lambda model, policy, n, fast: WindowCache(body, window, fmt, head, centre)),
            Policy.full(), (key_bits + bits(body, head)) / 2)


def run(variant, doc: str, grammar: str) -> None:
    """The command line of a simulation script: ``variant(spec, head_dim) -> (make_cache, policy, bits)`` for
    each variant named (``grammar`` says how), its held-out loss over ``--windows`` windows, and each one's
    delta over ``full`` with its standard error over the windows, printed and written to ``--out``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help=grammar)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of 2K tokens (kvcompile eval: 4)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--full-from", default=None, metavar="JSON",
                    help="take the full-precision row from an earlier run's --out over as many windows (it is "
                         "deterministic) instead of measuring it again")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = models.load(log=lambda *a: None)
    windows = E.heldout_windows(tok, count=args.windows)
    rows = []
    try:
        for spec in args.variants:
            E.make_cache, policy, b = variant(spec, model.config.head_dim)
            with torch.no_grad():
                losses = E.heldout_loss(model, windows, policy, progress=True)
            rows.append({"variant": spec, "bits": b, "loss": sum(losses) / len(losses), "windows": losses})
            print(f"{spec:28s} loss {rows[-1]['loss']:.5f}" + (f"  {b:.3f} bits, {16 / b:.2f}x" if b else ""),
                  flush=True)
    finally:
        E.make_cache = PLAIN
    if args.full_from and not any(r["variant"] == "full" for r in rows):
        with open(args.full_from) as f:
            earlier = json.load(f)
        if earlier["windows"] != args.windows:
            raise SystemExit(f"--full-from {args.full_from}: {earlier['windows']} windows, not {args.windows}")
        rows.insert(0, next(r for r in earlier["rows"] if r["variant"] == "full"))
    full = next((r for r in rows if r["variant"] == "full"), None)
    for r in rows if full else ():
        r["delta"] = r["loss"] - full["loss"]
        r["delta_windows"] = d = [a - b for a, b in zip(r["windows"], full["windows"])]
        r["delta_sem"] = (sum((x - r["delta"]) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else 0.0
        print(f"{r['variant']:28s} delta {r['delta']:+.5f} +- {r['delta_sem']:.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"windows": args.windows, "request_tokens": REQUEST, "rows": rows}, f, indent=1)


def main() -> None:
    run(variant, __doc__, "full, lib:SCHEME:BITS, or BODY[,WINDOW,fp|int8][,c], BODY f16 or e4m3")


if __name__ == "__main__":
    main()
