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

from .common import rotation_io
from .cpu import available_threads, compile_template

SOURCE = "cpu_rotate.c"
MAX_BLOCK = 1024  # the largest rotation block the template spells stages for (a head of 1,024 channels)


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
    if x.device.type != "cpu":
        raise ArgumentError(f"the CPU rotation kernel takes CPU tensors; got one on {x.device}")
    src, out, rows, block = rotation_io(x)
    D = x.shape[-1]
    if block > MAX_BLOCK:
        raise ArgumentError(f"the CPU rotation kernel rotates blocks of at most {MAX_BLOCK} channels; head_dim {D} "
                            f"makes blocks of {block}. Use the reference kernels (kvcompile.ops.set_kernels("
                            f"'reference')) for this model.")
    if rows:
        build(D, block)(src.data_ptr(), int(src.dtype == torch.float64), out.data_ptr(),
                        int(out.dtype == torch.float64), rows, 1 / math.sqrt(block), torch.finfo(x.dtype).max,
                        available_threads())
    return out.to(x.dtype)
