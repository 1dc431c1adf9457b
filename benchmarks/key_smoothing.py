"""Does a static per-channel key scale (SmoothQuant-style, as KVQuant calibrates offline) help per-token 4-bit keys
after the Hadamard rotation? A negative result, kept so that it can be run again (docs/results.md, "Serving").

Keys are multiplied by ``t`` and queries divided by it, per layer, KV head and channel (``t`` equal within each
rotary pair, so it commutes with RoPE; folded into q_proj/k_proj here, which leaves the full-precision model's
logits unchanged up to rounding). ``t**2 = sqrt(E[q**2] / E[k**2])`` minimises the variance of ``q . dk`` for
white quantization noise ``dk`` in the scaled space; the statistics come from the calibration text (``data``) or
from the projection weights with the input norm folded in (``weights``); ``alpha`` < 1 applies part of it.

    python benchmarks/key_smoothing.py none,0,k4v8 data,1,k4v8 weights,1,k4v8 data,0.5,k4v8 data,1,tok4
"""
from __future__ import annotations

import importlib
import sys

import torch
from tqdm import tqdm

from kvcompile import evaluate as E
from kvcompile import models
from kvcompile.policy import Policy, Quant


def tq(bits: int) -> Quant:
    return Quant(f"int{bits}", "token", None)


POLICIES = {"k4v8": Policy(tq(4), tq(8), rotate=True), "tok4": Policy(tq(4), tq(4), rotate=True),
            "tok2": Policy(tq(2), tq(2), rotate=True), "full": Policy.full()}


def main(specs: list[str]) -> None:
    C = importlib.import_module("kvcompile.calibrate")
    torch.set_num_threads(1)
    model, tok = models.load(log=lambda *a: None)
    cfg = model.config
    Hq, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // Hq
    layers = model.model.layers
    stats: dict = {}

    def hook(i, which):
        def h(_mod, _inp, out):
            x = out.detach().double().reshape(-1, out.shape[-1])
            s = stats.setdefault((i, which), [0, 0.0])
            s[0] += x.shape[0]
            s[1] = s[1] + (x * x).sum(0)
        return h

    hooks = [m for i, l in enumerate(layers) for m in (l.self_attn.q_proj.register_forward_hook(hook(i, "q")),
                                                        l.self_attn.k_proj.register_forward_hook(hook(i, "k")))]
    with torch.no_grad():
        for w in C.calibration_windows(tok, tokens=2048, window=1024):
            model(w[None])
    for h in hooks:
        h.remove()

    def pair(x):  # mean over rotate_half pairs (c, c + D/2)
        m = (x[..., :D // 2] + x[..., D // 2:]) / 2
        return torch.cat([m, m], -1)

    def scales(mode: str, alpha: float):
        out = []
        for i, l in enumerate(layers):
            a = l.self_attn
            if mode == "data":
                eq = (stats[(i, "q")][1] / stats[(i, "q")][0]).view(Hq, D)
                ek = (stats[(i, "k")][1] / stats[(i, "k")][0]).view(Hk, D)
            else:
                g = l.input_layernorm.weight.double()
                eq = ((a.q_proj.weight.double() * g) ** 2).sum(1).view(Hq, D)
                ek = ((a.k_proj.weight.double() * g) ** 2).sum(1).view(Hk, D)
            eq = eq.view(Hk, Hq // Hk, D).mean(1)
            t = ((pair(eq) / pair(ek)).sqrt().sqrt()) ** alpha
            out.append(t / t.pow(2).mean(-1, keepdim=True).sqrt())
        return out

    orig = [(l.self_attn.q_proj.weight.data.clone(), l.self_attn.k_proj.weight.data.clone()) for l in layers]
    windows = E.heldout_windows(tok)
    base = None
    for spec in tqdm(specs, desc="key smoothing"):
        mode, alpha, name = spec.split(",")
        ts = scales(mode, float(alpha)) if mode != "none" else [None] * len(layers)
        for (qw, kw), l, t in zip(orig, layers, ts):
            a = l.self_attn
            a.q_proj.weight.data.copy_(qw if t is None else qw / t.repeat_interleave(Hq // Hk, 0).reshape(-1, 1).float())
            a.k_proj.weight.data.copy_(kw if t is None else kw * t.reshape(-1, 1).float())
        loss = E.heldout_loss(model, windows, POLICIES[name])
        loss = sum(loss) / len(loss)
        if base is None:
            base = sum(E.heldout_loss(model, windows, Policy.full())) / len(windows) if mode == "none" else None
        tqdm.write(f"{spec:<20} loss {loss:.5f}" + (f"  delta {loss - base:+.5f}" if base is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1:] or ["none,0,k4v8", "data,1,k4v8", "weights,1,k4v8", "data,0.5,k4v8", "data,1,tok4"])
