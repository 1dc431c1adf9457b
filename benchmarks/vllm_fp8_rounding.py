"""How vLLM's own fp8 KV cache rounds on this machine: its page beside its ``auto`` page of the same tokens.

    /path/to/vllm-env/bin/python benchmarks/vllm_fp8_rounding.py

Run in the vLLM environment (docs/vllm.md), on a CPU where vLLM runs ``kv_cache_dtype="fp8"`` (AVX-512 or AMX).
One prompt goes through the plugin tests' tiny model (``tests_vllm/conftest.py``: 2 layers, 2 kv heads of 64
channels, nothing downloaded) twice, in float32: with vLLM's own ``auto`` cache and with its ``fp8`` cache, and the
first layer's written page of each is read back. The fp8 page's nonzero bytes, as e4m3 values, are compared as a
multiset (vLLM's two caches order a page differently) with the ``auto`` page's values rounded each candidate way:
to nearest (vLLM's CUDA kernels, and ``Quant("fp8_e4m3", "tensor")``), through bf16 or fp16 first, or toward zero.
Prints which candidates match exactly.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests_vllm"))

E4M3 = torch.float8_e4m3fn


def written_page(model: str, kv_cache_dtype: str) -> torch.Tensor:
    """The first layer's one written page (the engine's own cache tensor) after a one-token generation."""
    from conftest import caches, close, engine
    from vllm import SamplingParams
    llm = engine(model, None, dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    try:
        llm.generate(["def f(x): return x + 1 and more words here"], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        cache = next(iter(caches(llm).values())).clone()
    finally:
        close(llm)
    raw = cache.view(torch.uint8).flatten(1)
    used = [i for i in range(cache.shape[0]) if raw[i].any()]
    if len(used) != 1:
        raise SystemExit(f"expected one written page, found {len(used)}")
    return cache[used[0]]


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as the e4m3 value of largest magnitude not beyond it (saturating at 448)."""
    near = x.clamp(-448, 448).to(E4M3)
    bits = near.view(torch.uint8)
    beyond = near.float().abs() > x.abs()
    return torch.where(beyond & ((bits & 0x7F) > 0), bits - 1, bits).view(E4M3)


def values(x: torch.Tensor) -> torch.Tensor:
    """The sorted nonzero e4m3 values of ``x``."""
    v = x.float().flatten()
    return torch.sort(v[x.view(torch.uint8).flatten() != 0])[0]


def main() -> dict:
    from conftest import make_tiny
    model = str(make_tiny(Path(tempfile.mkdtemp())))
    auto, fp8 = written_page(model, "auto"), written_page(model, "fp8")
    got = values(fp8.view(torch.uint8).view(E4M3))
    x = auto[auto != 0].float()
    candidates = {
        "nearest (vLLM CUDA; fp8-tensor)": x.clamp(-448, 448).to(E4M3),
        "nearest through bf16": x.to(torch.bfloat16).float().clamp(-448, 448).to(E4M3),
        "nearest through fp16": x.to(torch.float16).float().clamp(-448, 448).to(E4M3),
        "toward zero": toward_zero(x),
    }
    out = {}
    print(f"vLLM fp8 page: {got.numel()} nonzero of {x.numel()} values written")
    for name, c in candidates.items():
        want = values(c)
        out[name] = want.numel() == got.numel() and torch.equal(want, got)
        print(f"  {name}: {'the same multiset' if out[name] else 'differs'}")
    return out


if __name__ == "__main__":
    main()
