"""The CPU store kernel: ``cpu_store.c`` specialized per store layout, compiled with the system C compiler.

``store`` has exactly the contract and effects of ``kvcompile.store.store_reference`` -- the same codes, scales,
zero points, sinks, ring slots and lengths, bit for bit, written into the blocks the state's block table names, and
the same ``CapacityError`` when a block it would write is not reserved -- but does the whole append (every batch
row, every head, keys and values) in one C call: no Python loop over rows, no small torch ops, no host
synchronisation. Rotation (when the policy rotates) runs first, through ``kvcompile.store.rotate`` as in the
reference (on the CPU its C kernel, ``templates.cpu_rotate``). The template is compiled once per layout by
``templates.cpu.compile_template`` (the ``-D`` definitions are those of ``templates.cpu.defines``, without the
attention's GQA ratio) and cached on disk.

Large appends (a prefill) are shared among ``cpu.available_threads()`` OpenMP threads, by (sequence, head,
keys or values, piece of 64 packed tokens, never straddling two blocks); a decode step runs on the calling
thread.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvcompile import quant as Q
from kvcompile.store import KVState, LayerSpec, _state_capacity_check, check_kv, rotate, row_widths

from .cpu import available_threads, compile_template, defines, pool_strides
from kvcompile.errors import ArgumentError, IndexOutOfRange

SOURCE = "cpu_store.c"
_BY_ID: dict[int, tuple] = {}  # id(spec) -> (spec, kernel); the spec is held, so its id is not reused


def key(spec: LayerSpec) -> tuple:
    """The ``-D`` definitions of ``spec``'s store kernel, as ``compile_template`` takes them."""
    return tuple(sorted(dict(defines(spec), H=spec.heads).items()))


def build(spec: LayerSpec):
    """The compiled store kernel of ``spec``'s layout (a ctypes function)."""
    hit = _BY_ID.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    lib = compile_template(SOURCE, key(spec))
    fn = lib.kvc_store
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [P, P] + [I] * 6 + [P] * 13 + [I] * 5 + [ctypes.POINTER(I), I, I]
    fn.restype = I
    for name in ("kvc_round_f16", "kvc_fp8_encode"):  # the numerics helpers (tests)
        getattr(lib, name).argtypes = [P, P, I, I]
        getattr(lib, name).restype = None
    fn.lib = lib
    _BY_ID[id(spec)] = (spec, fn)
    return fn


def _ptr(t: Tensor) -> int | None:
    return t.data_ptr() if t.numel() else None


def store(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
    """Append ``k, v [B, H, n, D]`` (model space) to the store, in place: ``store_reference``'s contract.

    ``n_new`` (int [B], optional): row ``b`` appends only its first ``n_new[b]`` tokens (ragged batches).
    Every block the append writes must be reserved in ``state.table`` (``KVStore.reserve``), else
    ``CapacityError`` and nothing is written. All tensors on the CPU; the pool fields' blocks each dense, at any
    distance apart (``cpu.pool_strides``: pools of their own, or views of an engine's pages), the rest contiguous.
    """
    check_kv(spec, k, v, state.lengths.shape[0])
    B, H, n, D = k.shape
    if k.device.type != "cpu" or v.device.type != "cpu" or state.lengths.device.type != "cpu":
        raise ArgumentError("the CPU store kernel takes CPU tensors")
    fn = build(spec)
    if spec.policy.rotate:
        k, v = rotate(k, spec, keys=True), rotate(v, spec)
    dt = spec.torch_dtype
    if k.dtype != dt:
        k = Q.saturate(k, dt)  # as store_reference: a finite value beyond the model dtype clamps, never inf
    if v.dtype != dt:
        v = Q.saturate(v, dt)
    if k.stride(3) != 1 and n:
        k = k.contiguous()
    if v.stride(3) != 1 and n:
        v = v.contiguous()
    sb = pool_strides(state, "the CPU store kernel")
    table = state.table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B:
        raise ArgumentError(f"the store's block table must be int32 [{B}, blocks]; got {table.dtype} "
                         f"{list(table.shape)}")
    nn = None
    if n_new is not None:
        nn = n_new.to(device="cpu", dtype=torch.int32).contiguous()
    ks, vs = k.stride(), v.stride()
    # the rows' widths, checked to reach every position written (an n_new outside [0, n] is the kernel's to report)
    widths = row_widths(state, spec, n if nn is None else nn.clamp(0, n))
    rc = fn(_ptr(k), _ptr(v), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            *[_ptr(t) for t in state[:10]], state.lengths.data_ptr(), _ptr(table),
            None if nn is None else nn.data_ptr(), B, n, table.shape[1], state.k_codes.shape[0],
            available_threads(), sb, *widths)
    if rc > B:
        b = rc - 1 - B
        bad = [x for x in table[b].tolist() if x >= state.k_codes.shape[0]]
        raise IndexOutOfRange(f"the block table of sequence {b} names block {bad[0]}, but the pool holds "
                         f"{state.k_codes.shape[0]} blocks")
    if rc > 0:
        _state_capacity_check(state, spec, state.lengths,
                              nn if nn is not None else torch.full((B,), n, dtype=torch.int32))
        raise AssertionError(f"the store kernel found a block of sequence {rc - 1} unreserved that the "
                             f"reference check does not see")
    if rc < 0:
        b = -1 - rc
        raise ArgumentError(f"n_new[{b}]={int(nn[b])} is outside [0, {n}]: a row appends at most the chunk's {n} tokens")
