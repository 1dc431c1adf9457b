"""Can KIVI's axes (keys per channel over a group of tokens, values per token) fit the serving bars' bytes (3.5x at
4 bits, 6x at 2, counted for 1K-token requests) without KIVI's full-precision window? (docs/results.md, "Serving")

KIVI's quality at 4 bits is full precision's; its bytes are not, for two reasons: an fp16 scale and minimum per 32
elements (5 bits per element at 4 bits), and a window per request of ``residual + group - 1`` tokens in full
precision (its per-channel keys wait for a whole group). Here both are made cheap, and simulated. A group's
scale is rounded up to fp8 e4m3 and its zero point is an integer (``BODY``: ``e4m3``, a zero point among the
codes, 12 bits per group at 4 bits and 10 at 2; ``e4m3z8``, an int8 one, 16 bits, which a channel's offset
needs: a key channel's values over a group often all lie to one side of 0; ``f16``, an fp16 scale and minimum,
32 bits, kvcompile's), keys and values each (``KBODY/VBODY``). There is no residual window: the keys of a group
not yet complete are held in int8 per token (``PEND`` ``int8``, with an e4m3 scale and an int8 zero point) or
exactly (``fp``), a complete group being coded per channel from what the pending store held; values are coded
per token in groups of ``VG`` channels as they arrive. ``S`` first tokens (sinks) stay exact. All after the
Hadamard rotation, as kvcompile's caches do. Bits per element count a 1K-token request: its pages, and a slot
holding ``G - 1`` pending keys and the sinks.

A ``DynamicCache`` hands attention every stored token quantized and dequantized, and the call's own tokens in
full precision; the held-out protocol is ``kvcompile eval``'s, over ``--windows`` windows. A variant is
``chBITS,G,VG,PEND,S,KBODY[/VBODY][,w]`` (e.g. ``ch4,32,64,int8,4,e4m3z8/e4m3``); ``,w`` codes a key group once
its last token is written, before the call that wrote it attends, as kvcompile's store does (without it, at
the start of the next call); ``full`` and ``lib:SCHEME:BITS`` (kvcompile's own cache) as in ``key_window.py``.

    python benchmarks/kivi_pages.py full lib:kivi+rot+sink:4 \\
        lib:benchmarks/results/eval_serving/kivi4-r0-rot-sink.json ch4,32,64,int8,4,e4m3z8/e4m3 \\
        lib:kivi+rot+sink:2 ch2,32,32,int8,4,e4m3z8/e4m3 ch2,32,64,int8,4,e4m3z8/e4m3 \\
        ch4,32,32,int8,4,e4m3z8/e4m3 ch4,32,64,int8,8,e4m3z8/e4m3 ch2,32,32,int8,8,e4m3z8/e4m3 \\
        --windows 16 --out benchmarks/results/eval_serving/kivi_pages.json      # about 45 minutes
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.key_window import REQUEST, SimulatedCache, library_row, quantize, run  # noqa: E402
from kvcompile.policy import Policy  # noqa: E402
from kvcompile.store import hadamard  # noqa: E402


def qdq(x: torch.Tensor, bits: int, body: str) -> torch.Tensor:
    """``x`` asymmetrically quantized and dequantized over its last dimension (one group of any length; the
    e4m3 bodies as ``key_window.quantize`` codes them)."""
    if body != "f16":
        return quantize(x, bits, body)
    top = 2 ** bits - 1  # an fp16 scale and minimum
    lo, hi = x.amin(-1, keepdim=True).half().float(), x.amax(-1, keepdim=True)
    s = ((hi - lo) / top).half().float().clamp_min(2.0 ** -24)
    return torch.clamp(torch.round((x - lo) / s), 0, top) * s + lo


def scale_bits(bits: int, body: str) -> int:
    """Bits of one group's scale and zero point."""
    return {"f16": 32, "e4m3": 8 + bits, "e4m3z8": 16}[body]


def grouped(x: torch.Tensor, group: int, bits: int, body: str) -> torch.Tensor:
    """Per token, in groups of ``group`` channels."""
    *lead, D = x.shape
    return qdq(x.reshape(*lead, D // group, group), bits, body).reshape(x.shape)


class ChannelCache(SimulatedCache):
    def __init__(self, bits, group, vgroup, pend, sink, kbody, vbody, head, at_write=False):
        super().__init__()
        self.bits, self.group, self.vgroup, self.pend, self.sink = bits, group, vgroup, pend, sink
        self.kbody, self.vbody = kbody, vbody
        self.H = hadamard(head, dtype=torch.float64).float()
        # at_write: a key group is coded as soon as its last token is written, before the call that wrote it
        # attends (kvcompile's store: write, then read); else at the start of the next call
        self.at_write = at_write

    def keys(self, k: torch.Tensor, t: int) -> torch.Tensor:
        """The first ``t`` keys of ``k [B, H, T, D]`` as held: complete groups coded per channel, the rest
        pending; the groups complete among all of ``k`` are coded (``k``: the stored keys, or every key written
        so far when groups are coded at write)."""
        y = k.float() @ self.H
        S, G = self.sink, self.group
        out = y[:, :, :t].clone()
        body = y[:, :, S:]
        if self.pend == "int8":  # what the pending store holds, and a complete group is coded from
            body = grouped(body, y.shape[-1], 8, "e4m3")
        n = max(0, y.shape[2] - S) // G * G
        m = min(n, max(0, t - S))  # the stored tokens in complete groups
        if n:
            g = body[:, :, :n].reshape(*y.shape[:2], n // G, G, y.shape[-1]).transpose(-1, -2)
            coded = qdq(g, self.bits, self.kbody).transpose(-1, -2).reshape(*y.shape[:2], n, -1)
            out[:, :, S:S + m] = coded[:, :, :m]
        out[:, :, S + m:] = body[:, :, m:max(0, t - S)]
        return (out @ self.H.T).to(k.dtype)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        y = v.float() @ self.H
        out = y.clone()
        out[:, :, self.sink:] = grouped(y[:, :, self.sink:], self.vgroup, self.bits, self.vbody)
        return (out @ self.H.T).to(v.dtype)

    def held_keys(self, K: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        return self.keys(K if self.at_write else K[:, :, :t], t)

    def held_values(self, V: torch.Tensor, t: int, layer: int) -> torch.Tensor:
        return self.values(V[:, :, :t])


def variant(spec: str, head: int):
    """``(make_cache, policy, bits per element at 1K tokens or None)``."""
    row = library_row(spec)
    if row:
        return row
    parts = spec.split(",")
    at_write = parts[-1] == "w"
    name, G, VG, pend, S, body = parts[:6]
    b, G, VG, S = int(name[2:]), int(G), int(VG), int(S)
    kbody, _, vbody = body.partition("/")
    vbody = vbody or kbody
    bodies = ("f16", "e4m3", "e4m3z8")
    if (pend not in ("int8", "fp") or kbody not in bodies or vbody not in bodies or not name.startswith("ch")
            or len(parts) != 6 + at_write):
        raise SystemExit(f"{spec!r}: expected chBITS,G,VG,int8|fp,S,KBODY[/VBODY][,w] with bodies {bodies}")
    pend_bits = 16.0 if pend == "fp" else 8 + 16 / head
    per_token = 2 * b + scale_bits(b, kbody) / G + scale_bits(b, vbody) / VG  # keys + values, per channel
    total = (REQUEST - S) * per_token + (G - 1) * pend_bits + S * 32  # a slot holds the pending keys, the sinks
    make = lambda model, policy, n, fast: ChannelCache(b, G, VG, pend, S, kbody, vbody, head, at_write)  # noqa: E731
    return make, Policy.full(), total / (2 * REQUEST)


def main() -> None:
    run(variant, __doc__, "full, lib:SCHEME:BITS or lib:POLICY.json, or chBITS,G,VG,int8|fp,S,KBODY[/VBODY][,w]")


if __name__ == "__main__":
    main()
