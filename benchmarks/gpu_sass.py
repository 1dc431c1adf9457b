"""Static cost of the Triton decode kernels for sm_90, without a GPU: SASS instructions and registers per thread.

Not a speed measurement: instruction counts are a proxy for the work a kernel does per tile (the loop body is
unrolled over a tile), useful to judge a change to the dequantization while no GPU is at hand. Each policy's
decode specialization (``n=1``, the benchmark's head_dim and GQA), specialized as Triton's JIT specializes a
launch with these arguments (16-byte-divisible pointers and strides: vectorized loads), is compiled by Triton's
own ptxas and read back with the cuobjdump Triton ships.

    python benchmarks/gpu_sass.py                 # every policy below, D=128, GQA 4, bf16
    python benchmarks/gpu_sass.py --smoke         # one policy (the test suite runs this)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are defined: compile for the GPU, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402

from kvcompile import Policy, Quant  # noqa: E402
from kvcompile.store import LayerSpec  # noqa: E402
from kvcompile.templates import common, launch  # noqa: E402

POLICIES = {
    "fp8 e4m3": Policy(Quant("fp8_e4m3", "token"), Quant("fp8_e4m3", "token"), residual=0),
    "fp8 e5m2": Policy(Quant("fp8_e5m2", "token"), Quant("fp8_e5m2", "token"), residual=0),
    "int8": Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0),
    "int4 per token": Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0),
    "KIVI int4": Policy.kivi(4, residual=0),
    "KIVI int2": Policy.kivi(2, residual=0),
}


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def decode_kernel(policy: Policy, head_dim: int, gqa: int, arch: int, block_n: int | None = None,
                  warps: int | None = None):
    """The compiled ``_attn_kernel`` of one decode call (B=2, 2 kv heads, 4096 tokens, the default block);
    ``block_n`` and ``warps`` override the launcher's choice of tile length and warps."""
    from kvcompile.templates import attention as kattn
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, got = GPUTarget("cuda", arch, 32), []

    def compiler(kernel, args, options):
        sig, constexprs, attrs = common._signature(kernel, args)
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=target, options=dict(options))
        got.append((kernel.__name__, compiled))

    previous, common._compiler = common._compiler, compiler
    previous_warps = kattn.num_warps
    if warps:
        kattn.num_warps = lambda *a: warps
    try:
        spec = LayerSpec(policy, 2, head_dim, "bfloat16")
        state = spec.allocate(2, 4096)
        k, v = torch.randn(2, 2, 2, 1, head_dim)
        launch.store(state, spec, k, v)
        tiles = None
        if block_n:
            tiles = kattn.default_tiles(spec, 1, gqa, torch.device("cpu"), 2, kattn.position_bound(state, spec, None))
            tiles = (tiles[0], block_n, tiles[2])
        launch.attention(torch.randn(2, 2 * gqa, 1, head_dim), state, spec, None, k_new=k, v_new=v, tiles=tiles)
    finally:
        common._compiler, kattn.num_warps = previous, previous_warps
    return next(c for name, c in got if name == "_attn_kernel")


def sass_stats(compiled) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = [m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)]
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return {"instructions": len(ops), "ops": collections.Counter(ops),
            "registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    ap.add_argument("--block-n", type=int, help="tile length (default: the launcher's)")
    ap.add_argument("--warps", type=int, help="warps per program (default: the launcher's)")
    ap.add_argument("--smoke", action="store_true", help="one policy, to check the script runs")
    args = ap.parse_args(argv)
    names = args.policies[:1] if args.smoke else args.policies
    print(f"_attn_kernel, decode (n=1), head_dim={args.head_dim}, gqa={args.gqa}, sm_{args.arch}, "
          f"triton {triton.__version__}, block_n {args.block_n or 'default'}, warps {args.warps or 'default'}: "
          f"SASS per thread (static, not timed)")
    print(f"{'policy':16} {'instructions':>12} {'FFMA':>6} {'int ALU':>8} {'registers':>9} {'stack B':>7}")
    for name in names:
        st = sass_stats(decode_kernel(POLICIES[name], args.head_dim, args.gqa, args.arch, args.block_n, args.warps))
        alu = sum(st["ops"][o] for o in ("IADD3", "LOP3", "IMAD", "SHF", "ISETP", "SEL", "PRMT", "LEA", "VIADD"))
        print(f"{name:16} {st['instructions']:>12} {st['ops']['FFMA']:>6} {alu:>8} {st['registers'] or '?':>9} "
              f"{st['stack'] if st['stack'] is not None else '?':>7}")


if __name__ == "__main__":
    sys.exit(main())
