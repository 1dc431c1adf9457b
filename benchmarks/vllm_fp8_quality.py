"""vLLM's own fp8 KV cache beside kvcompile's 8-bit formats: held-out loss, in PyTorch, on the same texts.

    python benchmarks/vllm_fp8_quality.py --windows 16 --out benchmarks/results/vllm_fp8_quality.json \
        --plot docs/vllm_fp8_quality.png

vLLM's CPU build refuses ``kv_cache_dtype="fp8"`` on a CPU without AVX-512 or AMX (this machine), so its quality
cannot be measured through vLLM here. Its arithmetic is simple enough to write down: each key (after the rotary
embedding) and value element is divided by the layer's scale and cast to fp8 e4m3 with saturation, and attention
reads it back times the scale. The scale is 1.0 unless the checkpoint carries one (vLLM 0.32 no longer computes
one at run time); a checkpoint's scales (e.g. llm-compressor's) are the layer's largest magnitude over a
calibration text / 448, the contender "scales from calibration" here (windows of the held-out text other than
the scored ones).

Every contender runs the same way: the model's attention (transformers' SDPA) reads keys and values rounded to
the format, every position including the query's own -- what a store read at every position gives (``kvcompile
eval --own stored``, and the plugin's pages). kvcompile's formats are rounded by ``kvcompile.quant`` (the
reference the kernels are tested against, bit for bit), post-RoPE as the plugin stores them, without rotation
but for ``fp8-tensor+rot`` (the store's Hadamard rotation before the rounding, and back after: attention is
unchanged by it in full precision). ``fp8-tensor`` is vLLM's fp8 arithmetic at scale 1.0 exactly, a check of
the two written-out roundings against each other.
Loss: the second half of each 2,048-token held-out window of ``kvcompile eval`` (``heldout_windows``), as a delta
over full precision, per window, so that differences between contenders are paired. Bytes per element as vLLM's
capacity counts them, head_dim 64 (SmolLM2) and 128.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcompile import models, pages, quant  # noqa: E402
from kvcompile.evaluate import heldout_windows  # noqa: E402
from kvcompile.hf import model_shape  # noqa: E402
from kvcompile.policy import Policy, Quant  # noqa: E402
from kvcompile.store import _rotate  # noqa: E402

E4M3_MAX = 448.0
NAME = "kvcompile_fp8_sim"


def vllm_fp8(x, scale: float):
    """vLLM's fp8 cache: ``x / scale`` cast to e4m3 with saturation, read back times ``scale``."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float().mul(scale).to(x.dtype)


def reference(x, q: Quant):
    """kvcompile's reference rounding of ``x [B, H, T, D]`` to ``q`` and back."""
    codes, scale, zero = quant.quantize(x, q)
    return quant.dequantize(codes, scale, zero, q).to(x.dtype)


def bytes_per_element(q: Quant | None, head_dim: int) -> float:
    """What vLLM's page holds per element with keys and values in ``q`` (the plugin's page layout,
    ``kvcompile.pages``); vLLM's fp8 (None): one byte, the scale is the layer's."""
    if q is None:
        return 1.0
    layout = pages.PageLayout(Policy(q, q, residual=0), 1, head_dim, "bfloat16", 128)
    return layout.token_head_bytes / (2 * head_dim)


CONTENDERS = {  # label -> (kind, format or None); the kind's arithmetic is below
    "vLLM fp8 (scale 1.0)": ("vllm", None),
    "vLLM fp8, scales from calibration": ("vllm-calibrated", None),
    "kvcompile fp8-r0 (fp16 scale a token-head)": ("kvcompile", Quant("fp8_e4m3", "token", symmetric=True)),
    "kvcompile fp8, one-byte scale a token-head": ("kvcompile", Quant("fp8_e4m3", "token", symmetric=True,
                                                                       scale_dtype="fp8_e4m3")),
    "kvcompile fp8-tensor (no scale stored)": ("kvcompile", Quant("fp8_e4m3", "tensor")),
    "kvcompile fp8-tensor+rot (no scale stored, rotated)": ("kvcompile-rot", Quant("fp8_e4m3", "tensor")),
    "kvcompile int8 symmetric (fp16 scale)": ("kvcompile", Quant("int8", "token", symmetric=True)),
    "kvcompile int8 (Policy.int8: scale and zero point)": ("kvcompile", Quant("int8", "token", symmetric=False)),
}


class Rounding:
    """What the attention hook does to keys and values: ``kind`` per CONTENDERS, or None (full precision)."""

    def __init__(self):
        self.kind, self.fmt, self.scales, self.amax = None, None, {}, None

    def __call__(self, x, which: str, layer: int):
        if self.amax is not None:  # calibrating: the largest magnitude each layer's keys and values reach
            key = (layer, which)
            self.amax[key] = max(self.amax.get(key, 0.0), float(x.abs().amax()))
            return x
        if self.kind is None:
            return x
        if self.kind == "vllm":
            return vllm_fp8(x, 1.0)
        if self.kind == "vllm-calibrated":
            return vllm_fp8(x, self.scales[(layer, which)])
        if self.kind == "kvcompile-rot":  # the plugin's rotation (store._rotate, its own inverse) around the rounding
            return _rotate(reference(_rotate(x), self.fmt))
        return reference(x, self.fmt)


def install(model, rounding: Rounding) -> None:
    """Make the model's attention read keys and values through ``rounding`` (transformers' attention registry)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, *args, **kwargs):
        i = module.layer_idx
        return sdpa_attention_forward(module, query, rounding(key, "k", i), rounding(value, "v", i), *args, **kwargs)

    AttentionInterface.register(NAME, attend)
    model.set_attn_implementation(NAME)


@torch.no_grad()
def losses(model, windows) -> list[float]:
    out = []
    for w in windows:
        n = w.shape[0]
        logits = model(w[None]).logits[0, n // 2 - 1:-1]
        out.append(F.cross_entropy(logits.float(), w[n // 2:]).item())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model kvcompile.models resolves (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--calibration", type=int, default=4, help="windows of 512 tokens the calibrated scales see")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)

    from tqdm import tqdm
    model, tok = models.load(args.model, torch.float32, log=lambda *a: None)
    rounding = Rounding()
    install(model, rounding)
    windows = heldout_windows(tok, args.window, args.windows)
    # calibration text: 512-token windows between the scored ones (none of them a scored window's)
    cal = heldout_windows(tok, 512, 4 * args.calibration + 1)[2::4][:args.calibration]
    rounding.amax = {}
    with torch.no_grad():
        for w in cal:
            model(w[None])
    rounding.scales = {k: a / E4M3_MAX for k, a in rounding.amax.items()}
    rounding.amax = None

    t0 = time.time()
    bar = tqdm(total=len(CONTENDERS) + 1, desc="contenders")
    base = losses(model, windows)
    bar.update()
    rows = []
    hd = model_shape(model.config)[2]
    for label, (kind, fmt) in CONTENDERS.items():
        rounding.kind, rounding.fmt = kind, fmt
        got = losses(model, windows)
        rounding.kind = None
        delta = [g - b for g, b in zip(got, base)]
        rows.append({"label": label, "loss": sum(got) / len(got), "delta": sum(delta) / len(delta),
                     "delta_per_window": delta,
                     "bytes_per_element": {str(hd): bytes_per_element(fmt, hd), "128": bytes_per_element(fmt, 128)}})
        bar.update()
    bar.close()
    ref = rows[0]["delta_per_window"]
    for r in rows:
        d = [a - b for a, b in zip(r["delta_per_window"], ref)]
        m = sum(d) / len(d)
        var = sum((x - m) ** 2 for x in d) / max(len(d) - 1, 1)
        r["minus_vllm_fp8"] = m
        r["minus_vllm_fp8_se"] = (var / len(d)) ** 0.5
    res = {"command": " ".join(["python", "benchmarks/vllm_fp8_quality.py", *(argv or sys.argv[1:])]),
           "date": date.today().isoformat(), "torch": torch.__version__, "model": str(args.model or "SmolLM2"),
           "head_dim": hd, "windows": args.windows, "window": args.window, "full_precision_loss": sum(base) / len(base),
           "seconds": round(time.time() - t0), "results": rows}
    print(f"| contender | bytes an element (head_dim {hd} / 128) | x bf16 | loss delta | minus vLLM fp8 (paired, se) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        b = r["bytes_per_element"]
        print(f"| {r['label']} | {b[str(hd)]:.3f} / {b['128']:.3f} | {2 / b[str(hd)]:.2f} / {2 / b['128']:.2f} | "
              f"{r['delta']:+.4f} | {r['minus_vllm_fp8']:+.4f} ({r['minus_vllm_fp8_se']:.4f}) |")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    if args.plot:
        plot(res, args.plot)
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hd = str(res["head_dim"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in res["results"]:
        x = 2 / r["bytes_per_element"][hd]
        se = r["minus_vllm_fp8_se"]
        ax.errorbar(x, r["delta"], yerr=se, fmt="o" if r["label"].startswith("vLLM") else "s", capsize=3,
                    label=r["label"])
    ax.set_xlabel(f"tokens held x bf16 (head_dim {hd})")
    ax.set_ylabel("held-out loss over full precision (nats/token)")
    ax.set_title(f"8-bit KV caches on {res['model']}, {res['windows']} windows (error bar: paired s.e. vs vLLM fp8)",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
