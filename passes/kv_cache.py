"""The KV-cache pass: find each layer's cache write and its attention read, and fuse them into kvcompile ops.

Where it runs: on the **Dynamo graph** (``torch.fx``, pre-autograd, what a ``torch.compile`` backend receives),
before AOTAutograd and Inductor. Three reasons:

- The cache writes are still *in place* there: ``cache.index_copy_(2, pos, k)`` (HF StaticCache),
  ``cache[:, :, pos] = k`` (gpt-fast; ``operator.setitem``), ``cache.index_put_((None, None, pos), k)`` and
  ``cache[:, :, a:b] = k`` (torchtune), each on the placeholder of the cache tensor. After AOTAutograd they
  are functional ``index_put`` nodes plus a ``copy_`` epilogue into the input, and the read goes through the
  functionalized value, so "which read sees which write" has to be reconstructed.
- Each node carries ``meta["nn_module_stack"]``, which names the layer, and each placeholder carries
  ``meta["grapharg"]`` whose ``example`` is the real tensor: the stand-in (unit strides, a few KB) that
  ``kvcompile.apply`` put in place of the cache, which keys the layer's packed store.
- The rewritten graph still goes on to Inductor (or runs as is): the rest of the model is compiled as usual
  and kvcompile's ops are opaque custom ops to it.

The pass is small functions that each find or replace one thing; every replacement bumps ``counters``, and
``check_fused`` verifies afterwards that no write or read of a rewritten cache is left.
"""
from __future__ import annotations

import math
import operator
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from kvcompile import ops as _ops  # noqa: F401  (registers torch.ops.kvcompile)
from kvcompile.errors import KVCompileError, UnsupportedError

counters: Counter = Counter()

SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.scaled_dot_product_attention}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")




# --------------------------------------------------------------------------- what the pass finds
@dataclass
class Write:
    node: Node
    src: Node       # the new keys/values [B, H, n, D]
    pos: Any        # a tensor Node of positions, or ("slice", start, stop) for slice assignment
    idiom: str      # "index_copy_", "setitem", "index_put_", "slice"


@dataclass
class RopeMatch:
    """The rotary embedding applied to a layer's keys just before their cache write: ``key`` (the keys before
    it, ``[B, H, n, D]``), the ``cos``/``sin`` it multiplies by, its form ("half": transformers'
    ``rotate_half``, ``cos``/``sin`` ``[B or 1, 1, n, rotary_dim]``; "pairs": gpt-fast's complex multiply,
    ``[B or 1, 1, n, rotary_dim / 2]``) and how many leading channels it rotates (the rest pass through:
    partial rotary). ``tokens_first``: the embedding was applied before the transpose to ``[B, H, n, D]`` (gpt-fast),
    so ``key`` is ``[B, n, H, D]`` and ``cos``/``sin`` ``[B or 1, n, 1, .]``; the rewrite transposes all three."""

    key: Node
    cos: Node
    sin: Node
    form: str
    rotary_dim: int
    tokens_first: bool = False

    @property
    def name(self) -> str:
        return f"{self.form}:{self.rotary_dim}"


@dataclass
class Site:
    """One layer: a cache written once for keys and once for values, then read by one SDPA."""

    layer: str
    read: Node
    k_cache: Node
    v_cache: Node
    k_write: Write
    v_write: Write
    query: Node
    mask: Node | None
    scale: float
    gqa: int            # query heads per kv head
    repeat: str         # how the heads were replicated: "none", "repeat_kv", "repeat_interleave", "enable_gqa"
    read_len: Any       # None when SDPA reads the whole cache, else the end of a [:, :, :end] slice
    shape: tuple        # the cache's [B, H, C, D] (C may be symbolic: one graph serves every capacity)
    dtype: torch.dtype
    spec_name: str | None = None
    causal_prefix: bool = False  # no mask, is_causal=True over cache[:, :, :n], n queries (CAUSAL_PREFIX)
    rope: RopeMatch | None = None  # the rotary embedding on the key write (match_rope), if recognised
    rope_why: str = ""             # else why not


@dataclass
class Skipped:
    """A read (or write) the pass leaves as it is, and why. ``uses``: the ops that stood in the way, when the
    reason is that the cache has other uses (a transformers ring's ``roll``, say), for callers to act on."""

    layer: str
    node: str
    reason: str
    uses: tuple = ()


@dataclass
class Analysis:
    sites: list[Site] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    unpaired_writes: list[Skipped] = field(default_factory=list)
    reads_found: int = 0
    layers: list[str] = field(default_factory=list)  # every layer with an SDPA read, in graph order


def _val(n):
    if not isinstance(n, Node):
        return n
    return n.meta.get("example_value", n.meta.get("val"))


def _example(ph: Node):
    ga = ph.meta.get("grapharg")
    return getattr(ga, "example", None) if ga is not None else _val(ph)


def layer_name(node: Node) -> str:
    """The module path of the innermost module that issued ``node``, e.g. ``model.layers.3.self_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)  # the compiled callable itself: L['self'], L['args'][0]
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or node.name


def _order(gm: GraphModule) -> dict[Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _op_name(n: Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return n.op


def _arg(n: Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def sdpa_args(n: Node) -> dict:
    out = dict(zip(SDPA_ARGS, n.args))
    out.update(n.kwargs)
    return out


def find_reads(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]


# --------------------------------------------------------------------------- from SDPA's key back to the cache
_FULL = slice(None, None, None)


def _is_full(s) -> bool:
    return s == _FULL or s is Ellipsis


_FACTORIES = {torch.zeros, torch.empty, torch.full, torch.ones}


def is_factory(n: Node) -> bool:
    """A 4-D tensor the graph allocates (a transformers StaticCache initializing lazily inside the compiled
    region): a cache root like a placeholder; the rewrite allocates it as a stand-in."""
    if n.op != "call_function" or n.target not in _FACTORIES:
        return False
    v = _val(n)
    return v is not None and v.dim() == 4


def _walk_to_cache(x: Node):
    """Follow SDPA's key/value argument back through head replication to the cache: a placeholder, or a
    tensor the graph allocates (``is_factory``).

    Returns ``(cache node, repeat, read_len, chain)`` or ``(None, reason, None, chain)``. Accepted on the way:
    ``repeat_kv`` (``[:, :, None]`` + expand + reshape), ``unsqueeze(2)``, ``repeat_interleave(n, dim=1)``,
    ``contiguous``, and one ``[:, :, :end]`` slice of the cache. These replicate each kv head over consecutive
    query heads, which is the GQA layout kvcompile's attention uses; anything else is reported.
    """
    repeat, read_len, chain = "none", None, []
    while True:
        if x.op == "placeholder" or is_factory(x):
            return x, repeat, read_len, chain
        chain.append(x)
        name = _op_name(x)
        src = x.args[0] if x.args else None
        if name in ("contiguous", "reshape", "view", "expand") and isinstance(src, Node):
            x = src
            continue
        if name == "unsqueeze" and _arg(x, 1, "dim") in (2, -3):
            repeat, x = "repeat_kv", src
            continue
        if name == "repeat_interleave" and isinstance(src, Node) and _arg(x, 2, "dim") in (1, -3):
            repeat, x = "repeat_interleave", src
            continue
        if name == "getitem" and isinstance(src, Node) and isinstance(x.args[1], tuple):
            idx = x.args[1]
            if len(idx) == 5 and idx[2] is None and all(_is_full(s) for s in idx[:2] + idx[3:]):
                repeat, x = "repeat_kv", src
                continue
            if (len(idx) in (3, 4) and all(_is_full(s) for s in idx[:2] + idx[3:])
                    and isinstance(idx[2], slice) and idx[2].start in (None, 0) and idx[2].step in (None, 1)
                    and read_len is None):
                read_len, x = idx[2].stop, src
                continue
        return None, f"{x.op} {name}", None, chain


# --------------------------------------------------------------------------- writes into a cache placeholder
def _as_write(n: Node, cache: Node) -> Write | None:
    """``n`` as a write of new tokens along the sequence axis of ``cache``, or None."""
    name = _op_name(n)
    if n.op == "call_method" and name == "index_copy_" and n.args[0] is cache:
        dim = _arg(n, 1, "dim")
        if dim in (2, -2):
            return Write(n, _arg(n, 3, "source"), _arg(n, 2, "index"), "index_copy_")
    if name == "index_put_" and n.op in ("call_method", "call_function") and n.args[0] is cache:
        idx = tuple(_arg(n, 1, "indices"))
        if len(idx) == 3 and idx[0] is None and idx[1] is None and isinstance(idx[2], Node):
            return Write(n, _arg(n, 2, "values"), idx[2], "index_put_")
    if n.op == "call_function" and n.target is operator.setitem and n.args[0] is cache:
        idx = n.args[1]
        if isinstance(idx, tuple) and len(idx) in (3, 4) and all(_is_full(s) for s in idx[:2] + idx[3:]):
            if isinstance(idx[2], Node):
                return Write(n, n.args[2], idx[2], "setitem")
            if isinstance(idx[2], slice) and idx[2].step in (None, 1) and idx[2].stop is not None:
                return Write(n, n.args[2], ("slice", idx[2].start or 0, idx[2].stop), "slice")
    return None


_SHAPE_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.int,
                    torch.ops.aten.sym_numel.default}


def is_shape_query(n: Node) -> bool:
    """A use that reads only the cache's metadata (its shape), never its data: harmless after a rewrite,
    since the stand-in keeps the cache's shape. Dynamo emits these once it treats a size as dynamic (after
    it has seen two different cache lengths for the same code in one process)."""
    if n.op == "call_method":
        return n.target in ("size", "dim", "stride", "numel")
    if n.op == "call_function":
        return n.target in _SHAPE_FUNCTIONS or (n.target is getattr and n.args[1:2] in (("shape",), ("ndim",)))
    return False


def find_writes(cache: Node, reads: set[Node]) -> tuple[list[Write], list[Node]]:
    """The writes into ``cache``, and its other uses that are neither a write, a read nor a shape query."""
    writes, other = [], []
    for u in cache.users:
        if u in reads or is_shape_query(u) or (u.op == "output" and is_factory(cache)):
            continue  # (a tensor the graph allocates is returned to be kept: harmless, it becomes a stand-in)
        w = _as_write(u, cache)
        if w is not None:
            writes.append(w)
        else:
            other.append(u)
    return writes, other


def _looks_like_cache_write(n: Node) -> Node | None:
    """The 4-D placeholder that ``n`` writes into in place, if it is one (for the unpaired-write report)."""
    if n.op in ("call_method", "call_function") and _op_name(n) in ("index_copy_", "index_put_", "copy_"):
        tgt = n.args[0]
    elif n.op == "call_function" and n.target is operator.setitem:
        tgt = n.args[0]
    else:
        return None
    if isinstance(tgt, Node) and (tgt.op == "placeholder" or is_factory(tgt)) and \
            getattr(_val(tgt), "dim", lambda: 0)() == 4:
        return tgt
    return None


# --------------------------------------------------------------------------- the rotary embedding on the keys
_MUL = {operator.mul, torch.mul, "mul"}
_ADD = {operator.add, torch.add, "add"}
_NEG = {operator.neg, torch.neg, "neg"}
_CAT = {torch.cat, "cat"}


def _is(n, kinds) -> bool:
    if not isinstance(n, Node):
        return False
    if n.op == "call_function":
        return n.target in kinds
    return n.op == "call_method" and n.target in kinds


def _two(n: Node):
    """The two operands of a binary op node (positional), or None."""
    if len(n.args) == 2 and not n.kwargs:
        return n.args
    return None


def _last_index(idx: tuple, ndim: int):
    """The last dimension's entry of an index tuple ``(..., i)`` or ``(:, ..., :, i)`` over ``ndim`` dims, else
    None (a ``None`` entry -- a new axis -- is no last-dimension index either)."""
    if len(idx) == 2 and idx[0] is Ellipsis:
        return idx[1]
    if len(idx) == ndim and all(_is_full(i) for i in idx[:-1]):
        return idx[-1]
    return None


def _last_dim_slice(n, D):
    """``x[..., a:b]`` (or ``x[:, :, :, a:b]``) of a 4-D ``x`` as ``(x, a, b)``, or None."""
    if not (_is(n, {operator.getitem}) and isinstance(n.args[1], tuple)):
        return None
    x, idx = n.args
    if not isinstance(x, Node):
        return None
    xv = _val(x)
    if xv is None or xv.dim() != 4:
        return None
    sl = _last_index(idx, 4)
    if not isinstance(sl, slice) or sl.step not in (None, 1):
        return None
    w = int(xv.shape[-1])
    a = 0 if sl.start is None else sl.start
    b = w if sl.stop is None else sl.stop
    if not (isinstance(a, int) and isinstance(b, int)):
        return None
    return x, (a + w if a < 0 else a), min(b + w if b < 0 else b, w)


def _rotate_half_of(n) -> Node | None:
    """``x`` when ``n`` is transformers' ``rotate_half(x)``: ``cat((-x[..., h:], x[..., :h]), dim=-1)``."""
    if not _is(n, _CAT):
        return None
    parts = _arg(n, 0, "tensors")
    dim = _arg(n, 1, "dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and dim in (-1, 3)):
        return None
    neg, x1 = parts
    if not _is(neg, _NEG):
        return None
    s2, s1 = _last_dim_slice(neg.args[0], 0), _last_dim_slice(x1, 0)
    if s2 is None or s1 is None or s2[0] is not s1[0]:
        return None
    x, w = s1[0], int(_val(s1[0]).shape[-1])
    if w % 2 or (s1[1], s1[2]) != (0, w // 2) or (s2[1], s2[2]) != (w // 2, w):
        return None
    return x


def _rope_full(n) -> tuple | None:
    """``(x, cos, sin)`` when ``n`` is ``x * cos + rotate_half(x) * sin`` (operands in either order)."""
    if not _is(n, _ADD) or _two(n) is None:
        return None
    for a, b in (_two(n), _two(n)[::-1]):
        if not (_is(a, _MUL) and _is(b, _MUL) and _two(a) and _two(b)):
            continue
        for rh, sin in (_two(b), _two(b)[::-1]):
            x = _rotate_half_of(rh)
            if x is None:
                continue
            for xx, cos in (_two(a), _two(a)[::-1]):
                if xx is x and isinstance(cos, Node) and isinstance(sin, Node):
                    return x, cos, sin
    return None


def _broadcast_ok(t, key, rd: int) -> bool:
    """cos/sin of shape ``[B or 1, 1, n, rd]``: one row per (sequence, token), shared by the heads."""
    tv, kv = _val(t), _val(key)
    if tv is None or kv is None or tv.dim() != 4:
        return False
    return (_same_size(tv.shape[0], kv.shape[0]) or tv.shape[0] == 1) and tv.shape[1] == 1 \
        and _same_size(tv.shape[2], kv.shape[2]) and tv.shape[3] == rd


_SUB = {operator.sub, torch.sub, "sub"}
_STACK = {torch.stack, "stack"}


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _is_transpose_12(n) -> bool:
    """``x.transpose(1, 2)`` of a 4-D ``x`` (``[B, n, H, D]`` <-> ``[B, H, n, D]``)."""
    if not (_is(n, {torch.transpose, "transpose"}) and len(n.args) == 3 and not n.kwargs):
        return False
    return {d % 4 for d in n.args[1:] if isinstance(d, int)} == {1, 2}


def _pick(n):
    """``(t, i)`` when ``n`` is ``t[..., i]`` of a 5-D ``t`` whose last dim is 2, ``i`` 0 or 1; else None."""
    if not (_is(n, {operator.getitem}) and isinstance(n.args[0], Node) and isinstance(n.args[1], tuple)):
        return None
    t, idx = n.args
    tv = _val(t)
    if tv is None or tv.dim() != 5 or tv.shape[-1] != 2:
        return None
    i = _last_index(idx, 5)
    return (t, i) if isinstance(i, int) and not isinstance(i, bool) and i in (0, 1, -1, -2) else None


def _pick_pair(m):
    """The two ``(tensor, index)`` picks a ``mul`` node multiplies (``t[..., i] * u[..., j]``), or None."""
    if not (_is(m, _MUL) and _two(m)):
        return None
    a, b = (_pick(x) for x in _two(m))
    if a is None or b is None:
        return None
    return tuple((t, i % 2) for t, i in (a, b))


def _pairs_input(xs, shape):
    """The 4-D keys ``x`` (of ``shape``) when ``xs`` is ``x.float().reshape(*x.shape[:-1], -1, 2)``."""
    if not (_is(xs, {"reshape", "view", torch.reshape}) and isinstance(xs.args[0], Node)):
        return None
    x = xs.args[0]
    if _is(x, {"float"}) and len(x.args) == 1 and not x.kwargs:
        x = x.args[0]
    elif _is(x, {"to"}) and len(x.args) == 2 and x.args[1] is torch.float32 and not x.kwargs:
        x = x.args[0]
    xv, xsv = _val(x), _val(xs)
    if not isinstance(x, Node) or xv is None or xsv is None or xv.dim() != 4 or not _same_shape(xv.shape, shape):
        return None
    D = int(xv.shape[-1])
    if D % 2 or not _same_shape(xsv.shape, (*xv.shape[:-1], D // 2, 2)):
        return None  # (a row-major reshape of the last dim into [D/2, 2]: adjacent channel pairs)
    return x


def _rope_pairs(src, sv):
    """gpt-fast's ``apply_rotary_emb`` as Dynamo traces it, on the keys written ``src`` (value ``sv``):
    ``stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(3).type_as(x)``, ``x0, x1 = xs[..., 0], xs[..., 1]``
    the adjacent channel pairs of ``xs = x.float().reshape(..., -1, 2)``, ``c, s = fc[..., 0], fc[..., 1]``,
    applied on ``[B, n, H, D]`` and transposed after (gpt-fast) or on ``[B, H, n, D]``. Returns ``(RopeMatch,
    "")``, ``(None, why)`` for a complex multiply the pass will not take, or None when ``src`` is not one."""
    n = src
    tokens_first = _is_transpose_12(n)
    if tokens_first:
        n = n.args[0]
    if _is(n, {"type_as", "float"}) or (_is(n, {"to"}) and len(n.args) == 2 and isinstance(n.args[1], torch.dtype)):
        n = n.args[0]  # gpt-fast's cast back to the keys' dtype (see docs/design.md: a no-op in fp32)
    if not (isinstance(n, Node) and (_is(n, {"flatten", torch.flatten}) or _is(n, {"reshape", "view"}))):
        return None
    st = n.args[0]
    if not (_is(st, _STACK) and isinstance(st, Node)):
        return None
    parts, dim = _arg(st, 0, "tensors"), _arg(st, 1, "dim", 0)
    stv, nv = _val(st), _val(n)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and stv is not None and nv is not None
            and stv.dim() == 5 and dim in (-1, 4)):
        return None
    B, A1, A2, D = (sv.shape[0], sv.shape[2], sv.shape[1], int(sv.shape[3])) if tokens_first else \
        (*sv.shape[:3], int(sv.shape[3]))
    if D % 2 or not (_same_shape(nv.shape, (B, A1, A2, D)) and _same_shape(stv.shape, (B, A1, A2, D // 2, 2))):
        return None  # (flatten(3) of [.., D/2, 2] back to [.., D]: the pairs in place)
    a, b = parts
    if not (_is(a, _SUB) and _is(b, _ADD) and _two(a) and _two(b)):
        return None
    m1, m2 = (_pick_pair(m) for m in _two(a))
    m3, m4 = (_pick_pair(m) for m in _two(b))
    if None in (m1, m2, m3, m4):
        return None
    why = "a complex-multiply rotary embedding (gpt-fast's form) "
    for (X, i), (Fc, j) in (m1, m1[::-1]):
        if i or j or X is Fc:
            continue
        if set(m2) != {(X, 1), (Fc, 1)} or {frozenset(m3), frozenset(m4)} != {frozenset({(X, 1), (Fc, 0)}),
                                                                                 frozenset({(X, 0), (Fc, 1)})}:
            continue
        x = _pairs_input(X, (B, A1, A2, D))
        if x is None:
            continue
        fv = _val(Fc)
        n_axis, h_axis = (1, 2) if tokens_first else (2, 1)
        seq = sv.shape[2]
        if not (fv is not None and (_same_size(fv.shape[0], 1) or _same_size(fv.shape[0], B))
                and _same_size(fv.shape[h_axis], 1) and _same_size(fv.shape[n_axis], seq)
                and _same_shape(fv.shape[3:], (D // 2, 2))):
            return None, why + ("with cos/sin of a shape kvcompile does not read (one row per token, shared by "
                                "the heads)")
        mults = [a.args[0], a.args[1], b.args[0], b.args[1]]
        if any(getattr(_val(t), "dtype", None) != torch.float32 for t in mults + [a, b, st, X]):
            return None, why + "not computed in fp32 (the kernels rotate keys in fp32, as gpt-fast's x.float() does)"
        if _val(x).dtype != sv.dtype:
            return None, why + f"whose result is cast to {sv.dtype}, not back to the keys' own {_val(x).dtype}"
        cos = next(t for t in _two(a.args[0]) if _pick(t)[0] is Fc)  # fc[..., 0] of x0 * c
        sin = next(t for t in _two(a.args[1]) if _pick(t)[0] is Fc)  # fc[..., 1] of x1 * s
        return RopeMatch(x, cos, sin, "pairs", int(D), tokens_first=tokens_first), ""
    return None


def match_rope(src) -> tuple[RopeMatch | None, str]:
    """The rotary embedding that computes the keys a layer writes, or ``(None, why not)``. Recognised (as
    Dynamo traces them): transformers' ``apply_rotary_pos_emb``, ``k * cos + rotate_half(k) * sin``, over the
    whole head, or over its first ``rotary_dim`` channels with the rest concatenated after (partial rotary:
    ``cat((rope(k[..., :rd]), k[..., rd:]), dim=-1)``, GPT-NeoX, Phi); gpt-fast's ``apply_rotary_emb``, the
    complex multiply of adjacent channel pairs in fp32 (``_rope_pairs``; "pairs", the whole head)."""
    sv = _val(src)
    if not isinstance(src, Node) or sv is None or sv.dim() != 4:
        return None, "the keys written are not a traced [B, H, n, D] tensor"
    D = int(sv.shape[-1])
    pairs = _rope_pairs(src, sv)
    if pairs is not None:
        return pairs
    full = _rope_full(src)
    if full is not None:
        x, cos, sin = full
        xv = _val(x)
        if xv is not None and tuple(xv.shape) == tuple(sv.shape) and _broadcast_ok(cos, x, D) \
                and _broadcast_ok(sin, x, D):
            return RopeMatch(x, cos, sin, "half", D), ""
        return None, "a rotate_half rotary embedding with cos/sin of a shape kvcompile does not read"
    if _is(src, _CAT):
        parts, dim = _arg(src, 0, "tensors"), _arg(src, 1, "dim", 0)
        if isinstance(parts, (list, tuple)) and len(parts) == 2 and dim in (-1, 3):
            rot, rest = parts
            full, tail = _rope_full(rot), _last_dim_slice(rest, 0)
            if full is not None and tail is not None:
                x, cos, sin = full
                head = _last_dim_slice(x, 0)
                rd = tail[1]
                if head is not None and head[0] is tail[0] and (head[1], head[2]) == (0, rd) and tail[2] == D \
                        and _broadcast_ok(cos, x, rd) and _broadcast_ok(sin, x, rd) \
                        and tuple(_val(head[0]).shape) == tuple(sv.shape):
                    return RopeMatch(head[0], cos, sin, "half", rd), ""
    what = f"{src.op} {_op_name(src)}" if isinstance(src, Node) else repr(src)
    return None, (f"the keys written are computed by {what} ({getattr(src, 'name', src)}), not a rotary embedding "
                  f"the pass recognises (k * cos + rotate_half(k) * sin, on the whole head or on its first "
                  f"rotary_dim channels; gpt-fast's apply_rotary_emb on the whole head)")


# --------------------------------------------------------------------------- matching
class _Reject(Exception):
    """A check's verdict that a read cannot be rewritten: the reason, and the ops that stood in the way."""

    def __init__(self, reason: str, uses: tuple = ()):
        super().__init__(reason)
        self.reason, self.uses = reason, uses


def _cache_roots(a: dict, left):
    """The cache tensor behind SDPA's key and value (through head replication and one prefix slice)."""
    roots = []
    for which in ("key", "value"):
        root, repeat, read_len, chain = _walk_to_cache(a[which])
        why = left(root) if left is not None and root is not None else None
        if why:
            raise _Reject(why)
        if root is None:
            raise _Reject(f"SDPA's {which} does not come from a cache tensor (it is computed by {repeat}); only a "
                          f"cache written in place can be rewritten")
        roots.append((root, repeat, read_len, chain))
    if roots[0][0] is roots[1][0]:
        raise _Reject("keys and values are read from the same tensor")
    return roots


def _check_writes(kc: Node, vc: Node, chains: set, read: Node, order: dict) -> tuple[Write, Write]:
    """Each cache is written exactly once, before the read, and used by nothing else."""
    out = []
    for name, cache in (("keys", kc), ("values", vc)):
        ws, other = find_writes(cache, chains)
        if other:
            raise _Reject(f"the {name} cache {_src(cache)} is also used by "
                          f"{', '.join(f'{u.name} ({_op_name(u)})' for u in other)}", tuple(_op_name(u) for u in other))
        if len(ws) != 1:
            raise _Reject(f"the {name} cache {_src(cache)} is written {len(ws)} times before this read; the pass "
                          f"expects exactly one write")
        if order[ws[0].node] > order[read]:
            raise _Reject(f"the {name} cache is written after it is read")
        out.append(ws[0])
    return out[0], out[1]


def _check_chunk(shape, writes, qv) -> None:
    """What the layer writes is the queries' own chunk, ``[B, H, n, D]`` (attention reads it from there)."""
    B, H, _, D = shape
    for name, w in zip(("keys", "values"), writes):
        sv = _val(w.src)
        ok = sv is not None and sv.dim() == 4 and _same_size(sv.shape[0], B) and _same_size(sv.shape[1], H)
        if not (ok and _same_size(sv.shape[2], qv.shape[-2]) and _same_size(sv.shape[3], D)):
            got = list(sv.shape) if sv is not None else "an unknown shape"
            raise _Reject(f"the {name} written ({got}) are not the {qv.shape[-2]} queries' own [{B}, {H}, n, {D}] "
                          f"chunk; kvcompile's attention reads each query's chunk from what the layer writes")


def _check_mask(mask, is_causal: bool, k_len, v_len, n, C) -> bool:
    """Which positions the read may see is known: a mask over the positions, is_causal over the whole cache,
    or is_causal over ``cache[:, :, :n]`` (transformers' prefill shortcut: returns True, ``CAUSAL_PREFIX``)."""
    causal_prefix = False
    if mask is None:
        if is_causal and k_len is not None and _same_size(k_len, n) and _same_size(v_len, n):
            causal_prefix = True
        elif not (is_causal and k_len is None and _same_size(n, C)):
            raise _Reject("SDPA reads the cache with no attn_mask"
                          + (" and is_causal=True over a cache longer than the query" if is_causal else "")
                          + ": unwritten slots would be attended. kvcompile rewrites reads that pass a mask (bool or "
                            "additive) over the cache positions, is_causal=True over the whole cache, or "
                            "is_causal=True over cache[:, :, :n] for n queries")
    elif is_causal:
        raise _Reject("SDPA with both attn_mask and is_causal=True")
    if k_len != v_len and not causal_prefix:  # (a causal prefix has both equal to n)
        raise _Reject("keys and values are read over different lengths")
    return causal_prefix


def _check_gqa(hq, H: int, enable_gqa: bool, replicated: str) -> str:
    """Query heads are a whole multiple of the cache's, replicated in the layout kvcompile's attention uses."""
    if hq % H:
        raise _Reject(f"{hq} query heads are not a multiple of the cache's {H} kv heads")
    return "enable_gqa" if enable_gqa else (replicated if hq != H else "none")


def _scale(a: dict, qv):
    """SDPA's scale: given, or 1/sqrt(D); a symbolic one (dynamic shapes) stays a graph value unless known."""
    scale = a.get("scale")
    if scale is None:
        return 1.0 / math.sqrt(qv.shape[-1])
    if isinstance(scale, Node):
        ex = _val(scale)
        return float(ex) if isinstance(ex, (int, float)) else scale
    return float(scale)


def _match_read(gm: GraphModule, read: Node, order: dict, left=None) -> Site | Skipped:
    """The read as a ``Site``, or why it cannot be rewritten: each condition is one small check above."""
    a = sdpa_args(read)
    layer = layer_name(read)
    try:
        (kc, k_rep, k_len, k_chain), (vc, _, v_len, v_chain) = _cache_roots(a, left)
        if a.get("dropout_p", 0.0) not in (0, 0.0):
            raise _Reject(f"SDPA with dropout_p={a['dropout_p']} (training) is not rewritten")
        wk, wv = _check_writes(kc, vc, set(k_chain) | set(v_chain) | {read}, read, order)
        kval = _val(kc)
        if kval is None or kval.dim() != 4 or tuple(_val(vc).shape) != tuple(kval.shape):
            raise _Reject("the key and value caches are not two [B, H, C, D] tensors of one shape")
        shape = (int(kval.shape[0]), int(kval.shape[1]), kval.shape[2], int(kval.shape[3]))
        qv = _val(a["query"])
        _check_chunk(shape, (wk, wv), qv)
        causal_prefix = _check_mask(a.get("attn_mask"), bool(a.get("is_causal", False)), k_len, v_len,
                                    qv.shape[-2], shape[2])
        repeat = _check_gqa(qv.shape[1], shape[1], bool(a.get("enable_gqa", False)), k_rep)
    except _Reject as r:
        return Skipped(layer, read.name, r.reason, r.uses)
    rope, rope_why = match_rope(wk.src)
    return Site(layer, read, kc, vc, wk, wv, a["query"], a.get("attn_mask"), _scale(a, qv), qv.shape[1] // shape[1],
                repeat, k_len, shape, kval.dtype, causal_prefix=causal_prefix, rope=rope, rope_why=rope_why)


def _same_size(a, b) -> bool:
    """Whether the slice end ``a`` (an int or a graph node of a SymInt) is the size ``b`` (int or SymInt)."""
    a = _val(a) if isinstance(a, Node) else a
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return str(a) == str(b)  # the same symbol (no guard is added by comparing expressions as text)
    return False


def _src(ph: Node) -> str:
    ga = ph.meta.get("grapharg")
    return ga.source.name if ga is not None and hasattr(ga, "source") else ph.name


def analyze(gm: GraphModule, left=None) -> Analysis:
    """Every (write, read) site in the graph, what was skipped and why, and cache writes no read pairs with.

    ``left(placeholder)``: why a cache placeholder is the model's own business (a reason string), or None;
    reads of such caches are reported as skipped with that reason, and writes into them are not reported."""
    order = _order(gm)
    out = Analysis()
    reads = find_reads(gm)
    out.reads_found = len(reads)
    out.layers = list(dict.fromkeys(layer_name(r) for r in reads))
    counters["reads_found"] += len(reads)
    paired = set()
    writes = [(n, tgt) for n in gm.graph.nodes if (tgt := _looks_like_cache_write(n)) is not None]
    left_of = {tgt: left(tgt) for _, tgt in writes} if left is not None else {}
    # layers whose cache the model keeps itself (a sliding-window ring): their reads are skipped for that reason
    # even when SDPA reads the chunk rather than the ring (a prefill longer than the window)
    left_layers = {}
    for n, tgt in writes:
        if left_of.get(tgt):
            left_layers.setdefault(layer_name(n), left_of[tgt])
    for r in reads:
        why = left_layers.get(layer_name(r))
        m = Skipped(layer_name(r), r.name, why) if why else _match_read(gm, r, order, left)
        if isinstance(m, Site):
            out.sites.append(m)
            paired |= {m.k_cache, m.v_cache}
            counters["sites_matched"] += 1
        else:
            out.skipped.append(m)
            counters["reads_skipped"] += 1
    for n, tgt in writes:
        if tgt not in paired and not left_of.get(tgt):
            users = sorted({_op_name(u) for u in tgt.users if u is not n})
            out.unpaired_writes.append(Skipped(layer_name(n), n.name, (
                f"{_src(tgt)} is written by {_op_name(n)} but no scaled_dot_product_attention reads it "
                f"(its other uses: {', '.join(users) or 'none'})")))
    counters["unpaired_writes"] += len(out.unpaired_writes)
    return out


# --------------------------------------------------------------------------- rewriting
def _slice_positions(start, stop, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, stop, device=like.device)


def _copy_meta(new: Node, old: Node) -> None:
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in old.meta:
            new.meta[k] = old.meta[k]


def replace_node(g, old: Node, new: Node) -> None:
    """``new`` takes ``old``'s place: its metadata (and traced value), then every use; ``old`` is erased."""
    _copy_meta(new, old)
    if "example_value" in old.meta:
        new.meta["example_value"] = old.meta["example_value"]
    old.replace_all_uses_with(new)
    g.erase_node(old)


def replace_allocation(gm: GraphModule, cache: Node) -> Node:
    """A cache the graph allocates (``torch.zeros([B, H, C, D])``) -> ``kvcompile.standin(shape, dtype,
    device)``: the tensor the model keeps (a lazily initialized StaticCache stores it) holds no full-precision
    memory; its packed store is created by the first ``kvcompile.store`` that writes it."""
    val = _val(cache)
    with gm.graph.inserting_before(cache):
        new = gm.graph.call_function(torch.ops.kvcompile.standin.default,
                                     (list(val.shape), val.dtype, val.device))
    _copy_meta(new, cache)
    new.meta["example_value"] = val
    cache.replace_all_uses_with(new)
    gm.graph.erase_node(cache)
    counters["allocation_standin"] += 1
    return new


def pre_rope(site: Site):
    """The rotary embedding whose input the layer's store keeps (its policy asks for pre-RoPE keys and the pass
    recognised it), or None: the keys written are stored."""
    from kvcompile.store import LayerSpec
    if site.rope is None or not LayerSpec.from_name(site.spec_name).policy.pre_rope:
        return None
    return site.rope


def stored_keys(site: Site) -> Node:
    """The keys the store receives and attention reads as the chunk: pre-RoPE ones when ``pre_rope``."""
    rope = pre_rope(site)
    return rope.key if rope is not None else site.k_write.src


def replace_writes(gm: GraphModule, site: Site) -> Node:
    """The two cache writes -> one ``kvcompile.store(k_cache, v_cache, k, v, pos, spec[, cos, sin, rope])``,
    whose token the read takes (with pre-RoPE keys: the keys before their rotary embedding, and its cos/sin)."""
    g = gm.graph
    order = _order(gm)
    later = max(site.k_write.node, site.v_write.node, key=order.__getitem__)
    rope = pre_rope(site)
    if rope is not None and rope.tokens_first:  # [B, n, H, .] -> [B, H, n, .]: the store's and attention's layout
        moved = {}
        with g.inserting_before(later):
            for f in ("key", "cos", "sin"):
                t = getattr(rope, f)
                moved[f] = g.call_method("transpose", (t, 1, 2))
                _copy_meta(moved[f], later)
                if _val(t) is not None:
                    moved[f].meta["example_value"] = _val(t).transpose(1, 2)
        rope = site.rope = replace(rope, tokens_first=False, **moved)
    with g.inserting_before(later):
        pos = site.k_write.pos
        if isinstance(pos, tuple):
            pos = g.call_function(_slice_positions, (pos[1], pos[2], site.k_write.src))
        args = (site.k_cache, site.v_cache, stored_keys(site), site.v_write.src, pos, site.spec_name)
        if rope is not None:
            args += (rope.cos, rope.sin, rope.name)
            counters["pre_rope_keys"] += 1
        store = g.call_function(torch.ops.kvcompile.store.default, args)
    _copy_meta(store, later)
    for w, cache in ((site.k_write, site.k_cache), (site.v_write, site.v_cache)):
        w.node.replace_all_uses_with(cache)  # index_copy_ returns the cache itself
        g.erase_node(w.node)
        counters[f"write_{w.idiom}"] += 1
    counters["stores_inserted"] += 1
    return store


CAUSAL_PREFIX = """\
transformers' SDPA integration (``sdpa_attention_forward``, 5.1x and 5.2x) drops the mask of a prefill into an
empty static cache: it calls ``SDPA(q, key[:, :, :n], value[:, :, :n], attn_mask=None, is_causal=True)``, n the
query length, which is right when the n new tokens sit in slots 0..n-1. This happens when the mask reaching
the model is None -- ``masking_utils`` skips it when it can read the offset eagerly and sees 0 -- which is
the case under ``generate`` for models whose config has ``layer_types`` (Qwen2, Qwen3, ...): generate builds
their masks eagerly, *outside* the compiled forward, and passes ``{"full_attention": None}``. (For Llama and
Mistral it returns a bare None, which generate drops, so the model builds the mask inside the graph, where a
traced offset forbids the skip.) The pass rewrites this read with the mask it stands for, over absolute
positions: query i sees slot p iff p <= i -- exactly what the SDPA over the slice computed, whatever the
store held before (on an empty store, the same as the op's own causal rule)."""


def causal_prefix_mask(q, width):
    """``[1, 1, n, width]`` bool: query ``i`` (of ``n``) sees position ``p`` iff ``p <= i`` (see ``CAUSAL_PREFIX``)."""
    n = q.shape[-2]
    i = torch.arange(n, device=q.device).view(1, 1, n, 1)
    p = torch.arange(width, device=q.device).view(1, 1, 1, width)
    return p <= i


def replace_read(gm: GraphModule, site: Site, token: Node) -> Node:
    """SDPA over the (replicated) cache -> ``kvcompile.attention(q, k_cache, v_cache, token, mask, scale, spec,
    k, v)``, where ``k, v`` are what the layer's writes stored (the queries' own chunk, read in full precision).

    The mask covers absolute positions ``0 .. width-1``: SDPA's own mask does (a read of ``cache[:, :, :end]``
    with a mask of width ``end`` scores exactly those positions, which hold every written token).
    """
    g = gm.graph
    with g.inserting_before(site.read):
        mask = site.mask
        if site.causal_prefix:
            mask = g.call_function(causal_prefix_mask, (site.query, site.read_len))
            counters["mask_causal_prefix"] += 1
        # The op returns a contiguous [B, Hq, n, D]; its fake returns empty_like(q), so q must be contiguous
        # for the two to agree (q is usually a transposed view). A copy of the queries only: n tokens.
        q = g.call_method("contiguous", (site.query,))
        att = g.call_function(torch.ops.kvcompile.attention.default,
                              (q, site.k_cache, site.v_cache, token, mask, site.scale, site.spec_name,
                               stored_keys(site), site.v_write.src))
        counters["attention_op"] += 1
    replace_node(g, site.read, att)
    counters["attention_rewritten"] += 1
    counters[f"gqa_{site.repeat}"] += 1
    return att


def replace_read_exact(gm: GraphModule, site: Site, token: Node) -> Node:
    """For an exact layout (``Policy.exact``): the cache tensors, as the read uses them, -> ``kvcompile.exact_view(
    k_cache, v_cache, token, spec)``, the values written (zeros past each length) in a full-precision tensor of the
    cache's shape. The read itself -- head replication, slices, the mask, SDPA and its arguments -- stays the
    graph's own, so the layer computes what the unmodified model computes over a full-precision cache of that
    width, bit for bit."""
    g = gm.graph
    order = _order(gm)
    early = [u.name for c in (site.k_cache, site.v_cache) for u in c.users
             if u is not token and not is_shape_query(u) and order[u] < order[token]]
    if early:  # (the pass accepted the site: its read chains follow both writes, so this is a bug of the pass)
        raise KVCompileError(f"layer {site.layer}: {', '.join(early)} read the cache before its store")
    with g.inserting_before(token.next):  # (inserting_after would put each new node before the last one)
        view = g.call_function(torch.ops.kvcompile.exact_view.default,
                               (site.k_cache, site.v_cache, token, site.spec_name))
        k, v = (g.call_function(operator.getitem, (view, i)) for i in (0, 1))
    for n in (view, k, v):
        _copy_meta(n, site.read)
    for cache, full in ((site.k_cache, k), (site.v_cache, v)):
        ex = _val(cache)
        if ex is not None:
            full.meta["example_value"] = ex
        for u in list(cache.users):
            if u is not token and u is not view and not is_shape_query(u):
                u.replace_input_with(cache, full)
    counters["exact_view"] += 1
    counters["exact_causal_prefix"] += site.causal_prefix  # (its SDPA over view[:, :, :n] stays, is_causal=True)
    counters["attention_rewritten"] += 1  # (rewritten: it reads the store; attention_op counts kvcompile's attention)
    counters[f"gqa_{site.repeat}"] += 1
    return view


def _impure(n: Node) -> bool:
    if n.is_impure():
        return True
    if n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("__"):
        return True  # in-place tensor methods (cumulative_length.add_, ...) in a Dynamo graph
    if n.op == "call_function":
        if n.target is operator.setitem or n.target is torch.ops.kvcompile.store.default:
            return True
        name = getattr(n.target, "__name__", "")
        return name.endswith("_") and not name.startswith("__")
    return False


_KVC_OPS = {torch.ops.kvcompile.store.default, torch.ops.kvcompile.attention.default,
            torch.ops.kvcompile.exact_view.default}


def check_fused(gm: GraphModule, sites: list[Site]) -> None:
    """After rewriting: nothing but kvcompile's ops may still read or write a rewritten cache tensor."""
    for s in sites:
        for cache in (s.k_cache, s.v_cache):
            left = [f"{u.name} ({_op_name(u)})" for u in cache.users
                    if not is_shape_query(u) and not (u.op == "call_function" and u.target in _KVC_OPS)
                    and not (u.op == "output" and cache.op != "placeholder")]
            if left:
                raise UnsupportedError(
                    f"layer {s.layer}: the cache {_src(cache)} is still used by {', '.join(left)} after the rewrite; "
                    f"its contents live in the packed store, so this use would see a stand-in. Report this graph.")
    counters["checked_fused"] += len(sites)


def rewrite(gm: GraphModule, sites: list[Site]) -> GraphModule:
    """Rewrite every site (each must have ``spec_name`` set): writes into a store, reads from it, and caches
    the graph allocates into stand-ins."""
    allocated = {c for s in sites for c in (s.k_cache, s.v_cache) if c.op != "placeholder"}
    from kvcompile.store import LayerSpec
    for s in sites:
        token = replace_writes(gm, s)
        if LayerSpec.from_name(s.spec_name).policy.exact:
            replace_read_exact(gm, s, token)
        else:
            replace_read(gm, s, token)
    for c in allocated:
        new = replace_allocation(gm, c)
        for s in sites:  # the sites now name the stand-in
            s.k_cache = new if s.k_cache is c else s.k_cache
            s.v_cache = new if s.v_cache is c else s.v_cache
    gm.graph.eliminate_dead_code(is_impure_node=_impure)
    check_fused(gm, sites)
    gm.graph.lint()
    gm.recompile()
    counters["graphs_rewritten"] += 1
    return gm
