"""Tensor parallelism: kvcompile on a model sharded over ranks (``torch.distributed``, DTensor weights).

A model loaded with transformers' ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``, or sharded by
the user with a ``DeviceMesh`` and ``parallelize_module``, shards its key and value projections by rows
("colwise"): each rank computes its share of the KV heads, and its attention sees only those. Quantization
is per KV head (scales never span two heads; the rotation is per head), so each rank's store holds exactly
its heads, coded exactly as an unsharded store codes them, and a rank's cache is 1/world of the unsharded
one (plus the few per-sequence bytes every store has: lengths, block tables, the stand-ins).

Two things here:

- ``sharding(model, ...)``: the rank's tensor-parallel group and its KV heads, read from the key projection's
  DTensor weight (its local rows / head_dim) -- the ground truth for both transformers' plans and a user's
  ``parallelize_module``. KV heads that do not split into whole heads per rank (fewer KV heads than ranks, or
  a count the world size does not divide) are a ``KVCompileError`` with what to do: transformers shards the
  projection by rows regardless, and the model's own attention cannot run on part of a head either.
- ``Agreement``: the ranks of a tensor-parallel group run the same calls in lockstep, and every collective
  waits for all of them. An error raised on one rank only (a policy that fails there, a cache over its limit,
  a bad input) would leave the others waiting forever in the model's next all-reduce. So before the model
  runs, every rank says whether it is ready and what it is about to run (one ``all_gather`` of a few
  integers); if any rank failed, every rank raises (the failing rank its own error, the others a
  ``RankError`` naming it), and if the ranks were given different calls, every rank raises that.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from .errors import RankError, UnsupportedError
from .hf import KVCompileCache, KVCompileLayer
from .store import CapacityError

KEY_PROJECTIONS = ("k_proj", "key_proj", "wk")  # separate key projections (fused qkv: transformers' helper)




def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover  (torch without distributed)
        return None
    return DTensor


@dataclass(frozen=True)
class Sharding:
    """One rank's place in a tensor-parallel model: its group, and the KV heads its attention computes."""

    group: object   # the tensor-parallel ProcessGroup
    world: int      # ranks in it
    rank: int       # this rank's index in it
    heads: int      # this rank's KV heads per layer
    kv_heads: int   # the model's


def _group_of(t, shard_dim: int | None = None):
    """The process group of a DTensor's mesh: the mesh's only dimension, or the one ``t`` is sharded over."""
    mesh = t.device_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh.get_group("tp")
    from torch.distributed.tensor import Shard
    dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard) and (shard_dim is None or p.dim == shard_dim)]
    if len(dims) != 1:
        raise UnsupportedError(
            f"kvcompile cannot tell which dimension of this {mesh.ndim}-D device mesh is the tensor-parallel one "
            f"(placements {t.placements}, dimension names {names or 'none'}): name it 'tp' (init_device_mesh(..., "
            f"mesh_dim_names=(..., 'tp'))), or shard the key projection over one mesh dimension only")
    return mesh.get_group(dims[0])


def group_of(model):
    """The tensor-parallel process group of ``model`` (its first DTensor parameter's), or None: not a module,
    torch.distributed not initialized, or no DTensor weights (nothing to agree on)."""
    DTensor = _dtensor_cls()
    if _dist() is None or DTensor is None or not isinstance(model, torch.nn.Module):
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return _group_of(p)
    return None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def sharding(model, attention_modules, kv_heads: int, head_dim: int) -> Sharding | None:
    """This rank's ``Sharding`` of ``model``, or None when it is not sharded (no DTensor weights).

    ``attention_modules``: (name, module) of each attention layer. Each layer's key projection (``k_proj``)
    says how many KV heads the rank computes: its weight's local rows / head_dim (all of them when it is
    replicated or a plain tensor). A model with a fused qkv projection is read with transformers' own helper
    (``get_kv_heads_per_rank`` on ``model.tp_plan``)."""
    DTensor = _dtensor_cls()
    group = group_of(model)
    if group is None:
        return None
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    from torch.distributed.tensor import Shard
    per_layer = []
    for name, m in attention_modules:
        proj = next(((k, getattr(m, k)) for k in KEY_PROJECTIONS if isinstance(getattr(m, k, None), torch.nn.Module)),
                    None)
        w = getattr(proj[1], "weight", None) if proj else None
        if proj is None or not isinstance(w, torch.Tensor):
            per_layer.append((name, _heads_from_plan(model, kv_heads, world, name)))
            continue
        sharded = isinstance(w, DTensor) and any(isinstance(p, Shard) and p.dim in (0, -w.dim())
                                                 for p in w.placements)
        if not sharded:
            per_layer.append((name, kv_heads))
            continue
        rows = w.to_local().shape[0]
        if rows % head_dim or rows == 0:
            fewer = (f"fewer KV heads ({kv_heads}) than ranks ({world})" if kv_heads < world else
                     f"{kv_heads} KV heads, which {world} ranks cannot split evenly")
            raise UnsupportedError(
                f"tensor parallelism over {world} ranks: this model has {fewer}. Its key projection "
                f"{name}.{proj[0]} is sharded by rows, so rank {rank} holds {rows} of the {kv_heads * head_dim} "
                f"rows of keys ({rows / head_dim:g} heads of {head_dim}), not whole heads: neither the model's "
                f"attention nor a per-head cache can run on part of a head (transformers shards the projection by "
                f"rows; it does not replicate KV heads). Run with a tensor-parallel size that divides {kv_heads} "
                f"({_divisors(kv_heads)}), or without tensor parallelism.")
        per_layer.append((name, rows // head_dim))
    heads = {h for _, h in per_layer}
    if len(heads) > 1:
        raise UnsupportedError(
            f"tensor parallelism: this rank's attention layers compute different numbers of KV heads "
            f"({', '.join(f'{n}: {h}' for n, h in per_layer)}); kvcompile's cache has one head count for every "
            f"layer. Shard every layer's key and value projections alike.")
    return Sharding(group, world, rank, heads.pop() if heads else kv_heads, kv_heads)


def _heads_from_plan(model, kv_heads: int, world: int, name: str) -> int:
    """KV heads per rank of a layer without a separate key projection, as transformers computes them."""
    plan = getattr(model, "tp_plan", None) or {}
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank
    except ImportError:  # pragma: no cover  (older transformers)
        get_kv_heads_per_rank = None
    heads = get_kv_heads_per_rank(plan, kv_heads, world) if get_kv_heads_per_rank else None
    if heads is None:
        raise UnsupportedError(
            f"tensor parallelism over {world} ranks: kvcompile cannot tell how many of the {kv_heads} KV heads "
            f"layer {name} computes on this rank (no separate key projection, and transformers' plan does not say, "
            f"or cannot split {kv_heads} heads over {world} ranks). Run with a tensor-parallel size that divides "
            f"{kv_heads} ({_divisors(kv_heads)}).")
    return int(heads)


# --------------------------------------------------------------------------- agreeing before a collective
INFO = 4  # integers each rank says about the call it is about to run


class Agreement:
    """Every rank of ``group`` exchanges, exactly once, either "ready to run this" (``agree``) or "failed"
    (an exception leaving the ``with`` block before ``agree``). Then each rank knows whether all are ready
    and running the same thing, and raises on every rank if not. After ``agree``, exceptions pass through
    untouched (the ranks are running the model; its own collectives decide)."""

    def __init__(self, group, what: str):
        self.group, self.what, self.done = group, what, False

    def __enter__(self) -> "Agreement":
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None and not self.done and isinstance(err, Exception):
            self._exchange(err, ())
        return False  # the failing rank raises its own error

    def agree(self, *info: int) -> None:
        """This rank is ready to run a call described by ``info`` (a few integers: every rank must give the
        same). Raises on every rank if any rank failed or described another call."""
        if not self.done:
            self._exchange(None, info)

    def _device(self):
        dist = _dist()
        backend = str(dist.get_backend(self.group)).lower()
        if "gloo" in backend or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _exchange(self, err, info) -> None:
        self.done = True
        dist = _dist()
        group = self.group
        world = dist.get_world_size(group)
        row = [0 if err is None else 1, *info, *([-1] * INFO)][:1 + INFO]
        mine = torch.tensor(row, dtype=torch.int64, device=self._device())
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=group)
        rows = [r.tolist() for r in rows]
        failed = [i for i, r in enumerate(rows) if r[0]]
        if failed:
            msgs = [None] * world
            dist.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}", group=group)
            if err is not None:
                return  # this rank's own error propagates (from __exit__)
            i = failed[0]
            g = dist.get_global_rank(group, i) if hasattr(dist, "get_global_rank") else i
            raise RankError(f"{self.what} failed on rank {g} of the tensor-parallel group ({msgs[i]}); this rank "
                            f"stops too, rather than wait for it in the model's next collective", g, msgs[i])
        if any(r[1:] != rows[0][1:] for r in rows):
            said = "; ".join(f"rank {dist.get_global_rank(group, i) if hasattr(dist, 'get_global_rank') else i}: "
                             f"{_describe(r[1:])}" for i, r in enumerate(rows))
            raise UnsupportedError(
                f"{self.what}: the ranks of the tensor-parallel group were given different calls ({said}). Every "
                f"rank runs its share of the same computation: pass every rank the same input_ids (and generate "
                f"arguments), and its own cache from the same calls.")


def _describe(info) -> str:
    batch, tokens, held = info[:3]
    return f"batch {batch} x {tokens} tokens, cache holding {held}"


def agreed(fn):
    """Decorate ``fn(model, ...)`` (``kvcompile.apply``): an exception on any rank of the model's
    tensor-parallel group is raised on every rank (the others raise ``RankError``), so that no rank goes on to
    run the model while another has stopped."""
    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        group = group_of(model)
        if group is None:
            return fn(model, *args, **kwargs)
        with Agreement(group, f"kvcompile.{fn.__name__}") as a:
            out = fn(model, *args, **kwargs)
            a.agree()
        return out
    return wrapper


class Guard:
    """The forward of an applied, sharded model: each call is one ``Agreement``. ``call`` wraps the whole
    forward (an error anywhere before the model runs is exchanged); ``run`` wraps what runs the model (the
    original forward, the compiled one): before it, the cache's limit is checked for the call's tokens, and
    the ranks agree on (batch, tokens, tokens the cache holds)."""

    def __init__(self, sharding: Sharding, cache_kw: str, what: str):
        self.sharding, self.cache_kw, self.what = sharding, cache_kw, what
        self.local = threading.local()

    def call(self, forward):
        @functools.wraps(forward)
        def guarded(*args, **kwargs):
            if getattr(self.local, "agreement", None) is not None:  # re-entered: the outer call agrees
                return forward(*args, **kwargs)
            with Agreement(self.sharding.group, self.what) as a:
                self.local.agreement = a
                try:
                    return forward(*args, **kwargs)
                finally:
                    self.local.agreement = None
        return guarded

    def run(self, fn):
        @functools.wraps(fn)
        def running(*args, **kwargs):
            a = getattr(self.local, "agreement", None)
            if a is not None and not a.done:
                ids = kwargs.get("input_ids", args[0] if args else None)
                ids = kwargs.get("inputs_embeds") if ids is None else ids
                cache = kwargs.get(self.cache_kw)
                batch, n = (ids.shape[0], ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else (-1, -1)
                check_capacity(cache, n)
                a.agree(batch, n, _held(cache))
            return fn(*args, **kwargs)
        return running


def _held(cache) -> int:
    if isinstance(cache, KVCompileCache):
        return cache.tokens
    if cache is None:
        return -1
    try:
        return int(cache.get_seq_length())
    except Exception:  # a cache without a length: nothing to compare
        return -1


def check_capacity(cache, n: int) -> None:
    """The ``CapacityError`` the store would raise inside the model for ``n`` more tokens, raised before it
    runs (where the ranks can still agree that one of them cannot go on)."""
    if not isinstance(cache, KVCompileCache) or n < 0:
        return
    for layer in cache.layers:
        if isinstance(layer, KVCompileLayer) and layer.is_initialized and layer.limit is not None:
            for b, L in enumerate(layer.store.lengths):
                if L + n > layer.limit:
                    raise CapacityError(
                        f"KV cache overflow: sequence {b} holds {L} tokens and appends {n}, but the cache is "
                        f"limited to {layer.limit} tokens. Allow a larger cache (max_cache_len) or shorten the "
                        f"sequence.")
