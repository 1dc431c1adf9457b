"""Static cost of the Triton decode kernels for sm_90, without a GPU: registers, spills and the loop's SASS
instructions per byte it reads.

Not a speed measurement: a model of the kernel before it runs. At 4.8 TB/s an H200 SM receives about 18 bytes
a clock and issues 128 thread-instructions a clock, so a loop that issues more than about 7 instructions per
byte it reads cannot keep up with memory (10.8 at the issue's 65 % of peak). Each policy's decode
specialization (one query token, the benchmark's head_dim and GQA, bf16, CUDA's operand precision) is built
as ``launch.attention`` builds it on a GPU -- specialized as Triton's JIT specializes a launch (16-byte
divisible pointers and strides: vectorized loads) -- by Triton's own ptxas, and read back with the cuobjdump
Triton ships. "Loop" is the packed-tile loop (the longest backward branch), "per byte" its instructions times
the program's threads over the bytes one iteration reads (codes, scales, zero points: ``LayerSpec``'s bytes per
token times BLOCK_N).

    python benchmarks/gpu_sass.py                          # both kernels, every policy, the config table's tiles
    python benchmarks/gpu_sass.py --kernel decode --sweep  # every candidate tile; --write-configs keeps the best
    python benchmarks/gpu_sass.py --smoke                  # one policy (checks the script runs)
    python benchmarks/gpu_sass.py --kernel decode --policies int4 --lines 20  # the loop's busiest source lines
    python benchmarks/gpu_sass.py --past                   # the prefill path's read-back of the past
    python benchmarks/gpu_sass.py --runs                   # an engine's rows: a prompt's rows as runs

Triton 3.6 (the GPU image's) from another folder: ``PYTHONPATH=/tmp/triton36 python benchmarks/gpu_sass.py``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are defined: compile for the GPU, do not interpret
os.environ["KVCOMPILE_DOT"] = "tf32"  # CUDA's operand precision for full-precision tiles (not the CPU's "ieee")

import torch  # noqa: E402
import triton  # noqa: E402

from kvcompile import Policy, Quant  # noqa: E402
from kvcompile.store import LayerSpec  # noqa: E402
from kvcompile.templates import common, decode, launch  # noqa: E402

POLICIES = {  # the timing table's formats (benchmarks/gpu_kernels.py): every position packed
    "fp8": Policy(Quant("fp8_e4m3", "token"), Quant("fp8_e4m3", "token"), residual=0),
    "fp8 e5m2": Policy(Quant("fp8_e5m2", "token"), Quant("fp8_e5m2", "token"), residual=0),
    "int8": Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0),
    "int4": Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0),
    "int2": Policy(Quant("int2", "token"), Quant("int2", "token"), residual=0),
    "int4-kivi": Policy.kivi(4, residual=0),  # key groups of 32 tokens, value groups of 32 channels (16 at 80)
    "int2-kivi": Policy.kivi(2, residual=0),
}
CANDIDATES = {"block_n": (64, 128, 256), "warps": (4, 8), "stages": (3,)}  # --stages adds more
ISSUE_PER_BYTE = 128 / (4.8e12 / 132 / 1.98e9)  # thread-instructions an SM issues per byte at full bandwidth


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compiled_decode(policy: Policy, head_dim: int, gqa: int, kernel: str, arch: int = 90, tile=None, n: int = 1,
                    invariant: bool = False, runs: bool = False):
    """The compiled attention kernel of one decode call (B=2, 2 kv heads, 4096 tokens, the default block) as
    ``launch.attention(kernel=...)`` builds it, and its launch options. ``tile`` = (block_n, warps, stages)
    overrides the decode kernel's config (the general kernel takes block_n and warps). ``n`` > 1: a chunk of
    ``n`` queries at the end of 4096 stored tokens (prefill over the quantized past: the general kernel).
    ``invariant``: the row-invariant decode kernel (an engine's rows: ``kvcompile.pages``); ``runs``: its programs
    take runs of a sequence's rows (``decode.run_rows``: the two rows one sequence's)."""
    from kvcompile.templates import attention as kattn
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, got = GPUTarget("cuda", arch, 32), []

    def compiler(k, args, options):
        sig, constexprs, attrs = common._signature(k, args)
        c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                           options=dict(options))
        got.append((k.__name__, c, args, options))

    spec = LayerSpec(policy, 2, head_dim, "bfloat16")
    saved = common._compiler, kattn.num_warps, decode.tile_config
    common._compiler = compiler
    tiles = None
    if tile and kernel == "decode":
        decode.tile_config = lambda *a: dict(block_n=tile[0], warps=tile[1], stages=tile[2], source="sweep")
    elif tile:
        kattn.num_warps = lambda *a: tile[1]
        tiles = (1, tile[0], 2)
    try:
        state = spec.allocate(2, 4096)
        if n > 1:
            state.lengths.fill_(4096)
        groups = None
        if runs:  # a prompt's two last rows
            state.table[1] = state.table[0]
            state.lengths.copy_(torch.tensor([4095, 4096]))
            groups = torch.tensor([0, 2], dtype=torch.int32)
        launch.attention(torch.randn(2, 2 * gqa, n, head_dim), state, spec, kernel=kernel, tiles=tiles,
                         invariant=invariant or runs, groups=groups)
    finally:
        common._compiler, kattn.num_warps, decode.tile_config = saved
    name = "_decode_kernel" if kernel == "decode" else "_attn_kernel"
    _, c, args, options = next(g for g in got if g[0] == name)
    return spec, c, args, options


def _cubin_tool(compiled, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool(args[0]), *args[1:], f.name], capture_output=True, text=True,
                              check=args[0] == "nvdisasm").stdout


def loop_sass(compiled) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every SASS instruction and the longest loop's (the longest backward branch), each as (opcode without
    modifiers, ``file:line`` of its source: ``nvdisasm --print-line-info``)."""
    ops, labels, pending, where = [], {}, [], "?"
    for line in _cubin_tool(compiled, "nvdisasm", "--print-line-info", "-c").splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        src = re.search(r'File "([^"]+)", line (\d+)', line)
        op = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if label:
            pending.append(label.group(1))
        elif src:
            where = f"{os.path.basename(src.group(1))}:{src.group(2)}"
        elif op:
            addr = int(op.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            ops.append((addr, op.group(2).split(".")[0], op.group(3), where))
    loop = (0, -1)
    for addr, op, rest, _ in ops:
        t = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if t and labels.get(t.group(1), addr) < addr and addr - labels[t.group(1)] > loop[1] - loop[0]:
            loop = (labels[t.group(1)], addr)
    every = [(op, where) for _, op, _, where in ops]
    return every, [(op, where) for addr, op, _, where in ops if loop[0] <= addr <= loop[1]]


def sass_stats(compiled) -> dict:
    """Registers, stack, instructions, and the longest loop's instructions and op counts."""
    every, body = loop_sass(compiled)
    res = _cubin_tool(compiled, "cuobjdump", "-res-usage")
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return {"instructions": len(every), "loop": len(body), "ops": collections.Counter(op for op, _ in body),
            "registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None}


def loop_lines(compiled, top: int) -> list[tuple[int, str, str]]:
    """The loop's instructions per source line, the ``top`` busiest: (count, ``file:line``, its most frequent
    opcodes)."""
    per = collections.defaultdict(collections.Counter)
    for op, where in loop_sass(compiled)[1]:
        per[where][op] += 1
    busiest = sorted(per.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    return [(sum(c.values()), where, " ".join(f"{o} {n}" for o, n in c.most_common(4))) for where, c in busiest]


def tile_bytes(spec: LayerSpec, block_n: int) -> int:
    """Bytes one loop iteration reads for one KV head: BLOCK_N tokens' codes, scales and zero points."""
    return block_n * spec.block_nbytes() // (spec.block * spec.heads)


def measure(name: str, head_dim: int, gqa: int, kernel: str, tile=None, invariant: bool = False,
            runs: bool = False) -> dict:
    spec, c, args, options = compiled_decode(POLICIES[name], head_dim, gqa, kernel, tile=tile, invariant=invariant,
                                             runs=runs)
    st = sass_stats(c)
    st["compiled"] = c
    block_n = args["BLOCK_N"]
    threads = 32 * options.get("num_warps", 4)
    st.update(policy=name, kernel=kernel, block_n=block_n, warps=options.get("num_warps", 4),
              stages=args.get("STAGES", options.get("num_stages", 3)),
              per_byte=st["loop"] * threads / tile_bytes(spec, block_n), rows=args.get("RUN", 1))
    return st


def prefill_row(name: str, head_dim: int, gqa: int, n: int) -> str:
    """The general kernel over a chunk of ``n`` queries: its default tiles, registers, spills, the loop's
    instructions a thread and its tensor-core instructions (a warp's; HMMA m16n8k16 or HGMMA), and the loop's
    instructions per (query head, key) pair it scores."""
    spec, c, args, options = compiled_decode(POLICIES[name], head_dim, gqa, "general", n=n)
    st = sass_stats(c)
    threads = 32 * options.get("num_warps", 4)
    pairs = args["BLOCK_Q"] * gqa * args["BLOCK_N"]
    return (f"| {name} | {args['BLOCK_Q']} x {gqa} | {args['BLOCK_N']} | {options.get('num_warps', 4)} | "
            f"{st['registers']} | {st['stack']} | {st['loop']} | {st['ops']['HMMA']} | {st['ops']['HGMMA']} | "
            f"{st['loop'] * threads / pairs:.1f} |")


def past_row(name: str, head_dim: int, dtype: torch.dtype) -> str:
    """``templates.past`` (the prefill path's read-back of the past, CUDA) for one policy: registers, spills,
    instructions a thread, and instructions per element it writes (keys and values) and per byte it moves
    (packed bytes read, bf16 written)."""
    from kvcompile.templates import past
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    got = []

    def compiler(k, args, options):
        sig, constexprs, attrs = common._signature(k, args)
        got.append((triton.compile(ASTSource(fn=k, signature=sig, constexprs=constexprs, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options=dict(options)), args, options))

    spec = LayerSpec(POLICIES[name], 2, head_dim, "bfloat16")
    state = spec.allocate(2, 4096)
    saved, common._compiler = common._compiler, compiler
    try:
        past.launch_past(state, spec, 4096, dtype)
    finally:
        common._compiler = saved
    c, args, options = got[0]
    st = sass_stats(c)
    threads = 32 * options.get("num_warps", 4)
    elements = 2 * args["BLOCK_N"] * head_dim
    moved = tile_bytes(spec, args["BLOCK_N"]) + elements * 2  # packed bytes read, bf16 written
    return (f"| {name} | {args['BLOCK_N']} | {options.get('num_warps', 4)} | {st['registers']} | {st['stack']} | "
            f"{st['instructions']} | {st['instructions'] * threads / elements:.1f} | "
            f"{st['instructions'] * threads / moved:.1f} |")


PAST_HEAD = ("| policy | tokens a program | warps | registers | stack B | instructions | instr / element written | "
             "instr / byte moved |\n|---|---:|---:|---:|---:|---:|---:|---:|")


PREFILL_HEAD = ("| policy | query rows | BLOCK_N | warps | registers | stack B | loop | HMMA | HGMMA | "
                "loop instr / scored pair |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def row(st: dict) -> str:
    alu = sum(st["ops"][o] for o in ("IADD3", "LOP3", "IMAD", "SHF", "ISETP", "SEL", "PRMT", "LEA", "VIADD"))
    return (f"| {st['policy']} | {st['kernel']} | {st['block_n']} | {st['warps']} | {st['stages']} | "
            f"{st['registers']} | {st['stack']} | {st['instructions']} | {st['loop']} | {st['ops']['HMMA']} | "
            f"{st['ops']['FFMA'] + st['ops']['FMUL'] + st['ops']['FADD']} | {alu} | {st['per_byte']:.2f} |")


def runs_row(st: dict, alone: dict) -> str:
    """The row-invariant kernel's programs as a prompt's rows reach it (a run of ``RUN`` rows of a sequence a
    program) beside a program of one row (a decode step's): the loop's instructions per byte of a tile, and per
    byte and row."""
    return (f"| {st['policy']} | {st['block_n']} | {st['registers']} | {st['stack']} | {alone['loop']} | "
            f"{st['loop']} | {st['rows']} | {alone['per_byte']:.2f} | {st['per_byte']:.2f} | "
            f"{st['per_byte'] / st['rows']:.2f} |")


RUNS_HEAD = ("| policy | BLOCK_N | registers | stack B | loop, a row a program | loop, a run a program | rows a run | "
             "instr / byte, a row | instr / byte, a run | instr / byte and row, a run |\n"
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


HEAD = ("| policy | kernel | BLOCK_N | warps | stages | registers | stack B | instructions | loop | HMMA | "
        "FFMA+FMUL+FADD | int ALU | loop instr / byte |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    ap.add_argument("--kernel", choices=["decode", "general", "both"], default="both")
    ap.add_argument("--sweep", action="store_true", help="every candidate tile of the decode kernel")
    ap.add_argument("--write-configs", action="store_true",
                    help="with --sweep: write the best tile per policy (no spill, fewest instructions per byte) "
                         "into templates/decode_configs.json")
    ap.add_argument("--stages", type=int, nargs="+", default=None, help="pipeline depths to sweep (default 3)")
    ap.add_argument("--smoke", action="store_true", help="one policy, to check the script runs")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="the general kernel over a chunk of N queries (prefill over the quantized past) instead")
    ap.add_argument("--past", action="store_true",
                    help="the prefill path's read-back of the past (templates.past, bf16 out) instead")
    ap.add_argument("--runs", action="store_true",
                    help="the row-invariant decode kernel (an engine's rows) beside the decode kernel: a prompt's "
                         "rows a program")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="without --sweep: each policy's N busiest source lines in the loop (instructions each)")
    args = ap.parse_args(argv)
    names = args.policies[:1] if args.smoke else args.policies
    if args.past:
        print(f"past read back into bf16, head_dim={args.head_dim}, sm_90, triton {triton.__version__}: SASS per "
              f"thread (static, not timed; straight-line code, no loop)\n\n{PAST_HEAD}")
        for name in names:
            print(past_row(name, args.head_dim, torch.bfloat16), flush=True)
        return
    if args.prefill:
        print(f"prefill: {args.prefill} queries after 4096 stored tokens, head_dim={args.head_dim}, gqa={args.gqa}, "
              f"bf16, sm_90, triton {triton.__version__}: SASS per thread (static, not timed)\n\n{PREFILL_HEAD}")
        for name in names:
            print(prefill_row(name, args.head_dim, args.gqa, args.prefill), flush=True)
        return
    if args.runs:
        print(f"row-invariant decode, head_dim={args.head_dim}, gqa={args.gqa}, bf16, sm_90, triton "
              f"{triton.__version__}: SASS per thread (static, not timed)\n\n{RUNS_HEAD}")
        for name in names:
            print(runs_row(measure(name, args.head_dim, args.gqa, "decode", runs=True),
                           measure(name, args.head_dim, args.gqa, "decode", invariant=True)), flush=True)
        return
    kernels = ["general", "decode"] if args.kernel == "both" else [args.kernel]
    print(f"decode (n=1), head_dim={args.head_dim}, gqa={args.gqa}, bf16, sm_90, triton {triton.__version__}: "
          f"SASS per thread (static, not timed); full bandwidth leaves {ISSUE_PER_BYTE:.1f} instructions per byte\n")
    print(HEAD)
    best, lines = {}, []
    for name in names:
        for kernel in kernels:
            if kernel == "decode" and args.sweep:
                for bn in CANDIDATES["block_n"]:
                    for w in CANDIDATES["warps"]:
                        for s in args.stages or CANDIDATES["stages"]:
                            st = measure(name, args.head_dim, args.gqa, "decode", (bn, w, s))
                            print(row(st), flush=True)
                            ok = not st["stack"] and st["registers"] is not None and st["registers"] < 255
                            if ok and (name not in best or st["per_byte"] < best[name]["per_byte"]):
                                best[name] = st
            else:
                st = measure(name, args.head_dim, args.gqa, kernel)
                print(row(st), flush=True)
                if args.lines:
                    lines.append((st, loop_lines(st["compiled"], args.lines)))
    for st, busiest in lines:
        print(f"\n{st['policy']} ({st['kernel']}, {st['block_n']} x {st['warps']}): the loop's {st['loop']} "
              f"instructions by source line\n")
        for n, where, ops in busiest:
            print(f"{n:6d}  {where:<18} {ops}")
    if args.sweep:
        print("\nbest per policy (no spill, fewest loop instructions per byte):\n\n" + HEAD)
        for st in best.values():
            print(row(st))
    if args.write_configs and best:
        path = decode.CONFIGS
        with open(path) as f:
            table = json.load(f)
        for name, st in best.items():
            spec = LayerSpec(POLICIES[name], 2, args.head_dim, "bfloat16")
            key = (f"{decode.format_key(spec.policy.key)}/{decode.format_key(spec.policy.value)};"
                   f"D={args.head_dim};G={args.gqa}")
            table["configs"][key] = {"block_n": st["block_n"], "warps": st["warps"], "stages": st["stages"],
                                     "why": f"static (sm_90, triton {triton.__version__}): {st['per_byte']:.2f} loop "
                                            f"instructions per byte, {st['registers']} registers, no spill; the "
                                            f"fewest among {'/'.join(map(str, CANDIDATES['block_n']))} tokens x "
                                            f"{'/'.join(map(str, CANDIDATES['warps']))} warps"}
        with open(path, "w") as f:
            json.dump(table, f, indent=2)
            f.write("\n")
        print(f"\nwrote {len(best)} entries to {path}")


if __name__ == "__main__":
    sys.exit(main())
