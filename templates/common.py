"""What every kernel family shares: the one place kernels are launched, and an ahead-of-time compile check.

Launchers build their arguments as a name -> value dict and call ``run``. ``compile_only`` swaps ``run``
for a compiler: the same launcher code, fed CPU tensors, then builds each kernel for a GPU target (``sm_90``
by default) with Triton's real compiler and ptxas -- no GPU needed. Tests use it to prove that every
specialization they exercise in the interpreter also lowers to a GPU binary (the interpreter runs Python and
accepts code the compiler rejects).
"""
import contextlib
import functools
import os

import torch
from kvcompile.errors import ArgumentError, ArgumentTypeError, UnsupportedError

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Quant.scale_dtype as the kernels' compile-time code (C: K_SFMT/V_SFMT; Triton: SFMT): fp16, fp32, or an fp8
# e4m3 scale with an int8 zero point.
SCALE_CODES = {"float16": 0, "float32": 1, "fp8_e4m3": 2}
FIXED_SCALE = 3  # the code of a format that stores no scale: fp8 with one fixed scale, 1.0 (Quant axis="tensor")


def inf_to_nan(out):
    """``out`` with every infinity made NaN (the reference's rule for an attention output), in place: one pass
    (``torch.where(torch.isfinite(out), out, nan)`` takes four, ~13x the time on a prefill's rows)."""
    nan = float("nan")
    return out.nan_to_num_(nan=nan, posinf=nan, neginf=nan)


ROTATION_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def rotation_io(x):
    """What both rotation kernels (``cpu_rotate``, ``rotate``) read and write for ``x [..., D]``: ``(src, out, rows,
    block)`` -- ``src`` its rows contiguous in float32 (bf16 and fp16 widen exactly) or float64, ``out`` an empty
    tensor of ``x``'s shape in ``x``'s dtype, or float64 for bf16 / fp16 (the kernel's float64 result, which
    ``out.to(x.dtype)`` then rounds once), ``block = rotation_block(D)``."""
    from kvcompile.store import rotation_block

    if x.dtype not in ROTATION_DTYPES:
        raise ArgumentError(f"the rotation takes float32, float64, bfloat16 or float16 tensors; got {x.dtype}")
    D = x.shape[-1]
    wide = x.dtype in (torch.float32, torch.float64)
    src = (x if wide else x.float()).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if wide else torch.float64, device=x.device)
    return src, out, x.numel() // D if D else 0, rotation_block(D)


def scale_code(q) -> int:
    """``q``'s scale code for the kernels: ``SCALE_CODES[q.scale_dtype]``, or ``FIXED_SCALE`` for axis="tensor"
    (its kernels see a per-token-head format whose scale is 1.0, not loaded, and decode the NaN code to NaN)."""
    return FIXED_SCALE if q.quantized and not q.stores_scale else SCALE_CODES[q.scale_dtype]

# fp-contraction off: a fused multiply-add rounds once where the reference (torch) rounds twice, e.g. in
# dequantization ``code * scale + zero``; keeping two roundings makes the GPU agree with the specification.
OPTIONS = {"enable_fp_fusion": False}

_TRITON_TYPES = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}

_compiler = None  # set by compile_only(): called instead of launching

# The first Triton whose interpreter runs these kernels: up to 3.6 it hands a scalar loaded from memory to
# Python as a one-element array, and the kernels' loops, bounded by per-sequence lengths, then fail inside the
# interpreter. Compiled kernels are not affected (3.6 builds them for sm_90).
INTERPRETER_MIN = (3, 7)


@functools.lru_cache(maxsize=None)
def check_interpreter(version: str | None = None) -> None:
    """Raise a clear error when Triton's interpreter (``version``, default the installed one) is too old to run
    kvcompile's kernels."""
    if version is None:
        import triton
        version = triton.__version__
    found = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    if found < INTERPRETER_MIN:
        want = ".".join(map(str, INTERPRETER_MIN))
        raise UnsupportedError(
            f"TRITON_INTERPRET=1 with Triton {version}: its interpreter cannot run kvcompile's kernels (a scalar "
            f"loaded from memory arrives as a one-element array, which loop bounds reject); Triton >= {want} is "
            f"needed to run them on the CPU. Upgrade Triton (pip install 'triton>={want}'), use kvcompile's C "
            "kernels on the CPU (kvcompile.ops.set_kernels('cpu'), the default there), or run on a GPU, where "
            f"Triton {version} compiles them.")


def check_groups(groups, state, n: int, k_new, rope, rings=None) -> torch.Tensor:
    """``attention``'s ``groups`` (and ``rings``) describe its rows: the kernels that read a run's packed tiles once
    for its rows (the C kernels' ``kvc_attention_rows``, the Triton decode kernel's runs: ``decode.run_rows``)
    read tables, lengths and rings by them. Returns the offsets (int64) on the state's device, where the check
    put them."""
    B = state.lengths.shape[0]
    if not isinstance(groups, torch.Tensor) or (rings is not None and not isinstance(rings, torch.Tensor)):
        raise ArgumentError(f"row groups (and rings) must be int32 tensors; got {type(groups).__name__}"
                            f"{'' if rings is None else ' and ' + type(rings).__name__}")
    if rings is not None and (rings.dtype != torch.int32 or rings.shape != (B,) or not rings.is_contiguous()
                              or bool(((rings < 0) | (rings >= state.k_res.shape[0])).any())):
        raise ArgumentError(f"rings must be int32 [{B}] indices of the state's {state.k_res.shape[0]} rings; got "
                            f"{rings.dtype} {list(rings.shape)}")
    if n != 1 or k_new is not None or rope is not None:
        raise ArgumentError("row groups take one query a row (causal, or as its row of the mask says), keys after "
                            "RoPE: no chunk of their own, no rotary tables")
    if groups.dtype != torch.int32 or groups.dim() != 1 or len(groups) < 2 or int(groups[0]) != 0 \
            or int(groups[-1]) != B or bool((groups[1:] <= groups[:-1]).any()):
        raise ArgumentError(f"row groups must be int32 offsets from 0 to the {B} rows, increasing; got "
                            f"{groups.tolist()}")
    g = to_device(groups, state.table.device).long()  # (the state's device: CUDA's for the Triton kernels)
    head = torch.repeat_interleave(g[:-1], g[1:] - g[:-1], output_size=B)
    L = state.lengths.long()
    ok = (state.table == state.table[head]).all() & ((L[1:] > L[:-1]) | (head[1:] != head[:-1])).all()
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ArgumentError(GROUPS_UNSHARED)
    else:  # no host sync on a GPU (a prompt's every call through vLLM checks these): the device raises
        torch._assert_async(ok, GROUPS_UNSHARED)
    return g


GROUPS_UNSHARED = "the rows of a group must share their block table and have lengths in ascending order"


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` on ``device``. A host tensor reaches a GPU through pinned memory, without waiting: a copy from
    pageable memory synchronizes the stream, a host sync (``kvcompile.pages`` makes several a layer's call)."""
    device = torch.device(device)
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def run(kernel, grid, args: dict, **options) -> None:
    """Launch ``kernel[grid](**args, **options)`` (or compile it, inside ``compile_only``)."""
    options = {**OPTIONS, **options}
    if _compiler is not None:
        _compiler(kernel, args, options)
        return
    if INTERPRET:  # the interpreter takes no compile options
        check_interpreter()
        options = {}
    kernel[grid](**args, **options)


def _signature(kernel, args: dict):
    """(signature, constexprs, attrs) of a launch, specialized as Triton's JIT specializes a real launch: an
    integer argument equal to 1 becomes a constant, and pointers and integers divisible by 16 are marked so
    (``tt.divisibility``), which lets the compiler vectorize loads. Without that a compile-only build is a
    different, slower binary than the one a GPU runs."""
    sig, constexprs, attrs = {}, {}, {}
    params = {p.name: p for p in kernel.params}
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - another Triton: typed by hand, unspecialized
        native_specialize_impl = None
    for i, name in enumerate(kernel.arg_names):
        value = args[name]
        p = params[name]
        if p.is_constexpr:
            sig[name] = "constexpr"
            constexprs[(i,)] = value
        elif native_specialize_impl is not None and isinstance(value, (torch.Tensor, int, float)):
            ty, key = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                             not p.do_not_specialize_on_alignment)
            sig[name] = ty
            if ty == "constexpr":
                constexprs[(i,)] = value
            elif isinstance(key, str) and BaseBackend.parse_attr(key):
                attrs[(i,)] = BaseBackend.parse_attr(key)
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i64" if not -2**31 <= value < 2**31 else "i32"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise ArgumentTypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    return sig, constexprs, attrs


@contextlib.contextmanager
def compile_only(arch: int = 90, log: list | None = None):
    """Within this block, ``run`` compiles each kernel for ``cuda:sm_{arch}`` instead of launching it.

    Needs TRITON_INTERPRET unset when the kernels were defined. ``log`` collects (kernel name, constexprs).
    Launches are specialized as the JIT would specialize them with these arguments (``_signature``).
    """
    global _compiler
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    built = set()  # a specialization launched again (another batch, length or store) is built once

    def compiler(kernel, args, options):
        sig, constexprs, attrs = _signature(kernel, args)
        key = (kernel.__name__, tuple(sig.items()), tuple(sorted(constexprs.items())), tuple(sorted(attrs)),
               tuple(sorted(options.items())))
        if key not in built:
            triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                           options={k: v for k, v in options.items()})
            built.add(key)
        if log is not None:
            log.append((kernel.__name__, {kernel.arg_names[i[0]]: v for i, v in constexprs.items()}))

    previous, _compiler = _compiler, compiler
    try:
        yield
    finally:
        _compiler = previous
