"""CPU decode attention over pre-RoPE keys (``Policy(pre_rope=True)``) against post-RoPE storage, one layer.

    python benchmarks/prerope_decode.py                              # KIVI int2, SmolLM2's layer, 1K and 4K
    python benchmarks/prerope_decode.py --before 6fee693             # adds the kernel as of a git revision
    python benchmarks/prerope_decode.py --bits 4 --contexts 2048 --threads 2
    python benchmarks/prerope_decode.py --smoke                      # tiny, seconds

Both stores hold the same random keys (channel 3 an outlier) and values under ``Policy.kivi(bits, sink=4)``
(``--rotate``: with the Hadamard rotation, which pre-RoPE storage applies to values only); the pre-RoPE
store also holds the rotary cos/sin of every position (a transformers-style ``rotate_half`` embedding, base
10,000), and its kernel rotates each dequantized key by its position. One query token per sequence. Each
kernel's output is first checked against the reference. A sample is the mean of ``--inner`` calls; samples
are taken round-robin across contenders (the order reversed every other round) and the table shows their
medians, and each contender's ratio to post-RoPE. ``--before REV`` builds ``templates/cpu_attention.c`` as it
was at git revision REV (same kernel ABI) as one more pre-RoPE contender.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvcompile import Policy
from kvcompile.store import KVStore, LayerSpec, attention_reference
from kvcompile.templates import cpu

ROOT = Path(__file__).resolve().parents[1]


def rope_cos_sin(L: int, D: int, base: float = 10000.0):
    """transformers' default rotary embedding for positions 0 .. L - 1: (cos, sin) [1, 1, L, D]."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    f = torch.arange(L).float()[:, None] * inv
    e = torch.cat([f, f], -1)
    return e.cos()[None, None], e.sin()[None, None]


def filled_store(pol: Policy, k, v) -> KVStore:
    B, H, L, D = k.shape
    spec = LayerSpec(pol, H, D)
    spec.register()
    st = KVStore(spec, B)
    if pol.pre_rope:
        st.write_keys(True)
        cos, sin = rope_cos_sin(L, D)
        st.capture_rope(cos, sin, "half", L)
    st.append(k, v)
    return st


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--rotate", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--gqa", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--before", metavar="REV", help="also time templates/cpu_attention.c as of this git revision")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.contexts, a.repeats, a.inner = [256], 3, 2
    torch.set_num_threads(a.threads)
    B, H, G, D = a.batch, a.heads, a.gqa, a.head_dim
    sources = {"pre-RoPE": cpu.SOURCE}
    tmp = None
    if a.before:
        tmp = tempfile.TemporaryDirectory()
        old = Path(tmp.name) / "cpu_attention.c"
        old.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{a.before}:templates/cpu_attention.c"],
                                      check=True, capture_output=True, text=True).stdout)
        sources[f"pre-RoPE @{a.before}"] = old
    print(f"KIVI int{a.bits}, sink 4{', rotate' if a.rotate else ''}; B={B} kv heads={H} gqa={G} head_dim={D} "
          f"threads={a.threads}; median of {a.repeats} samples of {a.inner} calls")
    print(f"{'contender':<26}{'ctx':>7}{'us/call':>10}{'x post':>8}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in a.contexts:
        k, v = torch.randn(2, B, H, L, D, generator=g)
        k[..., 3] *= 8
        q = torch.randn(B, H * G, 1, D, generator=g)
        post = filled_store(Policy.kivi(a.bits, sink=4, rotate=a.rotate), k, v)
        pre = filled_store(Policy.kivi(a.bits, sink=4, rotate=a.rotate, pre_rope=True), k, v)
        calls = {"post-RoPE": lambda: cpu.attention(q, post.state, post.spec, None, None)}
        for name, src in sources.items():
            calls[name] = lambda src=src: cpu.attention(q, pre.state, pre.spec, None, None, source=src,
                                                        rope=pre.rope())
        for name, fn in calls.items():  # builds each kernel, and checks it: a fast wrong kernel measures nothing
            st = post if name == "post-RoPE" else pre
            want = attention_reference(q, st.state, st.spec, rope=st.rope())
            if not torch.allclose(fn(), want, atol=1e-4, rtol=1e-4):
                raise AssertionError(f"{name}: the kernel disagrees with the reference at {L} positions")
        times = {n: [] for n in calls}
        for i in range(a.repeats):
            for name, fn in list(calls.items())[::1 if i % 2 else -1]:
                t = time.perf_counter()
                for _ in range(a.inner):
                    fn()
                times[name].append((time.perf_counter() - t) / a.inner)
        base = statistics.median(times["post-RoPE"])
        for name in calls:
            t = statistics.median(times[name])
            print(f"{name:<26}{L:>7}{t * 1e6:>10.1f}{t / base:>8.2f}")
            rows.append({"contender": name, "context": L, "us": t * 1e6, "ratio_to_post": t / base})
    if tmp is not None:
        tmp.cleanup()
    return rows


if __name__ == "__main__":
    main()
