"""The CPU rotation kernel: ``cpu_rotate.c`` specialized per head size, compiled with the system C compiler.

``rotate(x)`` is ``kvcompile.store.rotate_reference(x)`` bit for bit -- the fast Walsh-Hadamard transform of each
row in float64, scaled, rounded once to ``x``'s dtype with finite values saturating -- in one C call with no float64
tensor in between: 0.6 ms for the keys and values of 8 prompts of 256 tokens in SmolLM2's layer, where the float64
matrix product it replaced took 4.3 ms (``benchmarks/rotation_cost.py``, this 2-core CPU). Compiled once per ``(D,
block)`` by ``templates.cpu.compile_template`` and cached on disk.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from kvcompile.errors import ArgumentError

from .cpu import available_threads, compile_template

SOURCE = "cpu_rotate.c"
MAX_BLOCK = 1024  # the largest rotation block the template spells stages for (a head of 1,024 channels)
_F64_OUT = (torch.bfloat16, torch.float16)  # results the kernel hands torch in float64 to cast (one rounding)


@functools.lru_cache(maxsize=None)
def build(D: int, block: int):
    """The compiled rotation of ``D`` channels in Hadamard blocks of ``block`` (a ctypes function)."""
    fn = compile_template(SOURCE, (("BLK", block), ("D", D), ("MAX_BLK", MAX_BLOCK))).kvc_rotate
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [P, I, P, I, I, ctypes.c_double, ctypes.c_double, I]
    fn.restype = None
    return fn


def rotate(x: Tensor) -> Tensor:
    """``x @ H`` along the last dimension (``kvcompile.store.rotate_reference``'s bits), in ``x``'s dtype."""
    from kvcompile.store import rotation_block

    if x.device.type != "cpu":
        raise ArgumentError(f"the CPU rotation kernel takes CPU tensors; got one on {x.device}")
    if x.dtype not in (torch.float32, torch.float64, *_F64_OUT):
        raise ArgumentError(f"the rotation takes float32, float64, bfloat16 or float16 tensors; got {x.dtype}")
    D = x.shape[-1]
    block = rotation_block(D)
    if block > MAX_BLOCK:
        raise ArgumentError(f"the CPU rotation kernel rotates blocks of at most {MAX_BLOCK} channels; head_dim {D} "
                            f"makes blocks of {block}. Use the reference kernels (kvcompile.ops.set_kernels("
                            f"'reference')) for this model.")
    src = x if x.dtype in (torch.float32, torch.float64) else x.float()  # bf16 / fp16 -> fp32 is exact
    src = src.contiguous()
    out_t = torch.float64 if x.dtype in _F64_OUT else x.dtype
    out = torch.empty(x.shape, dtype=out_t)
    rows = x.numel() // D if D else 0
    if rows:
        build(D, block)(src.data_ptr(), int(src.dtype == torch.float64), out.data_ptr(),
                        int(out_t == torch.float64), rows, 1 / math.sqrt(block), torch.finfo(x.dtype).max,
                        available_threads())
    return out.to(x.dtype) if out_t != x.dtype else out
