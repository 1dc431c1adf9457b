"""The rotation on CUDA: ``kvcompile.store.rotate_reference`` as one Triton kernel.

``rotate(x)`` gives the specification's bits -- each row's fast Walsh-Hadamard transform in float64 (blocks of
``rotation_block(D)`` channels, stage ``h`` replacing each pair ``(x[j], x[j + h])`` of a group of ``2h`` with
their sum and difference), one multiplication by ``1 / sqrt(block)``, finite values clamped to the dtype's
range, one rounding -- in a single launch, where the pure-torch specification takes three launches a stage.
A program transforms ``ROWS`` rows held as one ``[ROWS, DP]`` float64 tile (``DP``: ``D`` rounded up to a power
of two; the padding is whole zero blocks, never mixed with a channel): each stage views the tile as pairs
``[.., 2, h]``, splits them, and joins their sum and difference back in place. Every step is one IEEE float64
operation, so the result does not depend on the tile, the GPU or the interpreter.

bf16 and fp16 rows enter as their exact fp32 values and leave as float64 for torch to round once (as the C
kernel ``templates.cpu_rotate`` and the specification do).
"""
# No `from __future__ import annotations`: Triton reads `tl.constexpr` annotations as objects, not strings.
import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor


from .common import rotation_io, run


@triton.jit
def _stage(t, ROWS: tl.constexpr, DP: tl.constexpr, H: tl.constexpr):
    """One butterfly stage of the transform on the tile ``t [ROWS, DP]``: pairs ``H`` channels apart."""
    p = tl.permute(tl.reshape(t, (ROWS * DP // (2 * H), 2, H)), (0, 2, 1))  # [.., H, 2]: a pair's two ends
    a, c = tl.split(p)
    p = tl.join(a + c, a - c)
    return tl.reshape(tl.permute(p, (0, 2, 1)), (ROWS, DP))


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, c_ptr, rows, D: tl.constexpr, DP: tl.constexpr, BLK: tl.constexpr,
                   LOG_BLK: tl.constexpr, ROWS: tl.constexpr, OUT_F64: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, DP)
    ok = (r[:, None] < rows) & (c[None, :] < D)
    off = r[:, None] * D + c[None, :]
    t = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float64)
    for i in tl.static_range(LOG_BLK):
        t = _stage(t, ROWS, DP, 1 << i)
    v = t * tl.load(c_ptr)
    lim = tl.load(c_ptr + 1)
    inf = float("inf")
    v = tl.where((v > lim) & (v < inf), lim, tl.where((v < -lim) & (v > -inf), -lim, v))
    if OUT_F64:
        tl.store(y_ptr + off, v, mask=ok)
    else:
        tl.store(y_ptr + off, v.to(tl.float32), mask=ok)


@functools.lru_cache(maxsize=None)
def _constants(block: int, dtype: torch.dtype, device) -> Tensor:
    """``[1 / sqrt(block), the largest finite value of dtype]`` in float64 on ``device`` (a kernel's float
    argument would arrive as fp32); float64 rows saturate at inf, i.e. never."""
    hi = float("inf") if dtype == torch.float64 else torch.finfo(dtype).max
    return torch.tensor([1 / math.sqrt(block), hi], dtype=torch.float64, device=device)


def rotate(x: Tensor) -> Tensor:
    """``x @ H`` along the last dimension with ``kvcompile.store.rotate_reference``'s bits, in ``x``'s dtype."""
    src, out, rows, block = rotation_io(x)
    D = x.shape[-1]
    if rows:
        DP = triton.next_power_of_2(D)
        R = max(1, min(16, 2048 // DP))
        run(_rotate_kernel, (triton.cdiv(rows, R),),
            dict(x_ptr=src, y_ptr=out, c_ptr=_constants(block, x.dtype, x.device), rows=rows,
                 D=D, DP=DP, BLK=block, LOG_BLK=block.bit_length() - 1, ROWS=R, OUT_F64=out.dtype == torch.float64))
    return out.to(x.dtype)
