"""The paged pass: transformers' continuous-batching cache traffic in a Dynamo graph -> kvcompile's paged ops.

A compiled continuous-batching forward (``kvcompile.serving`` with ``varlen_compile_config``) is traced with
transformers' own paged update (``FullAttentionCacheAllocator.update``) and its own SDPA attention. Per layer
the graph holds, on the two page-pool views that ``PagedKVCompileCache`` replaced by stand-ins
(``kvcompile.paged_ops.register``; graph placeholders whose example is the stand-in):

    k_cache.index_copy_(0, write_index, k)          # k [T, H, D]: the forward's new keys (T padded)
    v_cache.index_copy_(0, write_index, v)
    ks = torch.index_select(k_cache, 0, read_index)  # the batch's whole sequences, in full precision
    vs = torch.index_select(v_cache, 0, read_index)  #   (absent when no request has a past: then SDPA reads k, v)
    out = SDPA(q, repeat_kv(ks^T), repeat_kv(vs^T), attn_mask=<the ragged batch's mask>, scale=s)

which becomes

    token = kvcompile.paged_store(k_cache, v_cache, k, v, write_index)
    out = kvcompile.paged_attention(q, k_cache, v_cache, token, read_index, mask, s)

(quantize-on-write into each request's row of the layer's store; attention over the packed rows where they
lie). Each step is a small function; ``counters`` counts what was found and replaced, and ``reports`` keeps,
per rewritten graph, which layer's writes, reads and SDPA were rewritten. A graph with paged stand-ins the
pass cannot match completely (another attention implementation, a graph break inside a layer, a model
variant) is an error naming what was found: never a graph that would read the stand-ins.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from kvcompile import paged_ops

from kvcompile.errors import UnsupportedError

from .kv_cache import (_arg, _copy_meta, _example, _impure, _op_name, _scale as sdpa_scale, _src,
                       _val, find_reads, is_shape_query, layer_name, replace_node, sdpa_args)

counters: Counter = Counter()
reports: list = []  # one list per rewritten graph: a dict per layer (see PagedSite.report)


@dataclass
class PagedSite:
    """One layer of a compiled continuous-batching forward: two writes, zero or two reads, one SDPA."""

    layer: int
    k_cache: Node
    v_cache: Node
    k_write: Node
    v_write: Node
    write_index: Node
    k_src: Node
    v_src: Node
    k_read: Node | None
    v_read: Node | None
    read_index: Node | None
    sdpa: Node
    query: Node
    mask: Node
    scale: float

    def report(self) -> dict:
        return dict(layer=self.layer, module=layer_name(self.sdpa), writes=2,
                    reads=0 if self.k_read is None else 2, sdpa=1)


def paged_caches(gm: GraphModule) -> dict[int, dict[str, Node]]:
    """The graph's placeholders that are a ``PagedKVCompileCache``'s stand-ins: ``{layer: {"k": node, "v": node}}``."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        hit = paged_ops.lookup(_example(n))
        if hit is not None:
            _, layer, role = hit
            if role in out.setdefault(layer, {}):
                raise UnsupportedError(f"layer {layer}: two graph inputs stand for its {role} page pool")
            out[layer][role] = n
    return out


def _is_index_copy(n: Node, cache: Node) -> bool:
    return (n.op == "call_method" and n.target == "index_copy_" and n.args[:1] == (cache,)) or \
        (n.op == "call_function" and n.target in (torch.Tensor.index_copy_,) and n.args[:1] == (cache,))


def _is_index_select(n: Node, cache: Node) -> bool:
    return ((n.op == "call_function" and n.target in (torch.index_select, torch.Tensor.index_select))
            or (n.op == "call_method" and n.target == "index_select")) and n.args[:1] == (cache,)


def find_cache_uses(layer: int, role: str, cache: Node) -> tuple[Node, Node | None]:
    """The one ``index_copy_`` along dim 0 into the cache, and the (at most one) ``index_select`` along dim 0
    of it; any other use is an error."""
    writes, reads, other = [], [], []
    for u in cache.users:
        if _is_index_copy(u, cache):
            writes.append(u)
        elif _is_index_select(u, cache):
            reads.append(u)
        elif not is_shape_query(u):
            other.append(u)
    what = f"layer {layer}: the {'keys' if role == 'k' else 'values'} page pool {_src(cache)}"
    if other:
        raise UnsupportedError(f"{what} is used by {', '.join(f'{u.name} ({_op_name(u)})' for u in other)}; the paged "
                             f"pass rewrites index_copy_ writes and index_select reads only")
    if len(writes) != 1 or len(reads) > 1:
        raise UnsupportedError(f"{what} is written {len(writes)} times and read {len(reads)} times in one forward; the "
                             f"paged pass expects one write through write_index and at most one read")
    for n, kind in [(writes[0], "index_copy_")] + [(r, "index_select") for r in reads]:
        if _arg(n, 1, "dim") not in (0,):
            raise UnsupportedError(f"{what}: {kind} along dim {_arg(n, 1, 'dim')}, not the pool's token axis 0")
    return writes[0], (reads[0] if reads else None)


_VIEWS = {"transpose", "unsqueeze", "squeeze", "reshape", "view", "expand", "contiguous"}


def _walk_back(x, stops: set[Node]) -> tuple[Node | None, list[str]]:
    """From SDPA's key (or value) back through views and head replication (``repeat_kv``: ``[:, :, None]``,
    expand, reshape) to the first node in ``stops``; (None, the ops seen) if another op is in the way."""
    seen = []
    while isinstance(x, Node):
        if x in stops:
            return x, seen
        name = _op_name(x)
        seen.append(name)
        src = x.args[0] if x.args else None
        if name in _VIEWS or (name == "getitem" and isinstance(x.args[1], tuple)):
            x = src
            continue
        break
    return None, seen


def _scale(a: dict, q) -> float:
    """SDPA's scale as the generate pass reads it (``kv_cache._scale``), which must be a number here."""
    s = sdpa_scale(a, _val(q))
    if isinstance(s, Node):
        raise UnsupportedError(f"SDPA's scale {s.name} is not a number the paged pass can pass on")
    return s


def match_layer(layer: int, k_cache: Node, v_cache: Node, sdpas: list[Node]) -> PagedSite:
    """The layer's writes, reads and the one SDPA that consumes them, checked; a clear error otherwise."""
    k_write, k_read = find_cache_uses(layer, "k", k_cache)
    v_write, v_read = find_cache_uses(layer, "v", v_cache)
    write_index = _arg(k_write, 2, "index")
    if _arg(v_write, 2, "index") is not write_index:
        raise UnsupportedError(f"layer {layer}: keys and values are written through different write indices")
    k_src, v_src = _arg(k_write, 3, "source"), _arg(v_write, 3, "source")
    if (k_read is None) != (v_read is None):
        raise UnsupportedError(f"layer {layer}: only one of the keys and values is read back from the page pool")
    read_index = None
    if k_read is not None:
        read_index = _arg(k_read, 2, "index")
        if _arg(v_read, 2, "index") is not read_index:
            raise UnsupportedError(f"layer {layer}: keys and values are read through different read indices")
    # what SDPA must read: the pool through read_index, or (no request has a past) the chunk just written
    k_root, v_root = (k_read, v_read) if k_read is not None else (k_src, v_src)
    found = []
    for s in sdpas:
        a = sdpa_args(s)
        kr, kseen = _walk_back(a["key"], {k_root})
        vr, vseen = _walk_back(a["value"], {v_root})
        if kr is k_root and vr is v_root:
            found.append(s)
    if len(found) != 1:
        raise UnsupportedError(
            f"layer {layer}: {len(found)} scaled_dot_product_attention calls read its page pool "
            f"({'through read_index' if k_read is not None else 'chunk'}); the paged pass expects exactly one. The "
            f"compiled continuous-batching forward must use transformers' own 'sdpa' attention, with no graph "
            f"break inside the layer.")
    sdpa = found[0]
    a = sdpa_args(sdpa)
    if a.get("dropout_p", 0.0) not in (0, 0.0):
        raise UnsupportedError(f"layer {layer}: SDPA with dropout_p={a['dropout_p']} is not rewritten")
    if a.get("is_causal", False) or a.get("attn_mask") is None:
        raise UnsupportedError(f"layer {layer}: SDPA reads the page pool without the ragged batch's attn_mask "
                             f"(is_causal={a.get('is_causal', False)}); the paged pass rewrites the masked read "
                             f"transformers' continuous batching makes")
    q, kc = _val(a["query"]), _val(k_cache)
    src = _val(k_src)
    if q is None or q.dim() != 4 or q.shape[0] != 1 or src is None or src.dim() != 3:
        raise UnsupportedError(f"layer {layer}: SDPA's query {None if q is None else list(q.shape)} / the written "
                             f"keys {None if src is None else list(src.shape)} are not [1, Hq, T, D] / [T, H, D]")
    if str(q.shape[2]) != str(src.shape[0]) or q.shape[1] % kc.shape[1] or q.shape[3] != kc.shape[2]:
        raise UnsupportedError(f"layer {layer}: SDPA's query {list(q.shape)} does not match the written chunk "
                             f"{list(src.shape)} and the pool's heads {list(kc.shape[1:])}")
    return PagedSite(layer, k_cache, v_cache, k_write, v_write, write_index, k_src, v_src, k_read, v_read,
                     read_index, sdpa, a["query"], a["attn_mask"], _scale(a, a["query"]))


def rewrite_site(gm: GraphModule, s: PagedSite) -> None:
    """The two writes -> ``paged_store``; the SDPA (and, by dead-code elimination, the reads and the head
    replication feeding it) -> ``paged_attention``."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    later = max(s.k_write, s.v_write, key=order.__getitem__)
    with g.inserting_before(later):
        token = g.call_function(torch.ops.kvcompile.paged_store.default,
                                (s.k_cache, s.v_cache, s.k_src, s.v_src, s.write_index))
    _copy_meta(token, later)
    for w, cache in ((s.k_write, s.k_cache), (s.v_write, s.v_cache)):
        w.replace_all_uses_with(cache)  # index_copy_ returns the pool itself
        g.erase_node(w)
        counters["write_index_copy_"] += 1
    if getattr(paged_ops.lookup(_example(s.k_cache))[0], "exact", False):
        _read_exact(g, s, token)
        return
    with g.inserting_before(s.sdpa):
        q = g.call_method("contiguous", (s.query,))
        att = g.call_function(torch.ops.kvcompile.paged_attention.default,
                              (q, s.k_cache, s.v_cache, token, s.read_index, s.mask, s.scale))
    replace_node(g, s.sdpa, att)
    counters["sdpa_rewritten"] += 1
    counters["read_index_select"] += 0 if s.k_read is None else 2
    counters["layers_without_read"] += s.k_read is None


def _read_exact(g, s: PagedSite, token: Node) -> None:
    """Every layer exact (``Policy.full()``): the two reads through ``read_index`` -> ``paged_read``, the values
    transformers' own pool would give; the SDPA (and everything between) stays transformers' own, so the layer
    computes what transformers' compiled forward computes, bit for bit."""
    if s.k_read is not None:
        with g.inserting_before(token.next):
            pair = g.call_function(torch.ops.kvcompile.paged_read.default,
                                   (s.k_cache, s.v_cache, token, s.read_index))
            k, v = (g.call_function(operator.getitem, (pair, i)) for i in (0, 1))
        for new, old in ((pair, s.k_read), (k, s.k_read), (v, s.v_read)):
            _copy_meta(new, old)
        for new, old in ((k, s.k_read), (v, s.v_read)):
            if "example_value" in old.meta:
                new.meta["example_value"] = old.meta["example_value"]
            old.replace_all_uses_with(new)
            g.erase_node(old)
        counters["read_index_select"] += 2
    counters["exact_layers"] += 1
    counters["layers_without_read"] += s.k_read is None


def check_rewritten(gm: GraphModule, caches: dict) -> None:
    """After the rewrite: the stand-ins are used by kvcompile's paged ops (and shape queries) only."""
    mine = {torch.ops.kvcompile.paged_store.default, torch.ops.kvcompile.paged_attention.default,
            torch.ops.kvcompile.paged_read.default}
    for layer, pair in caches.items():
        for n in pair.values():
            left = [f"{u.name} ({_op_name(u)})" for u in n.users
                    if not is_shape_query(u) and not (u.op == "call_function" and u.target in mine)]
            if left:
                raise UnsupportedError(f"layer {layer}: the page pool {_src(n)} is still used by {', '.join(left)} "
                                     f"after the paged rewrite; it is a stand-in. Report this graph.")


def rewrite_paged(gm: GraphModule) -> list[PagedSite]:
    """Rewrite every layer of a compiled continuous-batching forward over a ``PagedKVCompileCache``; a graph
    without its stand-ins is left as it is (returns [])."""
    caches = paged_caches(gm)
    if not caches:
        return []
    counters["graphs_seen"] += 1
    for layer, pair in caches.items():
        if set(pair) != {"k", "v"}:
            raise UnsupportedError(f"layer {layer}: the graph takes only its {set(pair)} page pool")
    sdpas = find_reads(gm)
    sites = [match_layer(layer, pair["k"], pair["v"], sdpas) for layer, pair in sorted(caches.items())]
    if len({s.sdpa for s in sites}) != len(sites):
        raise UnsupportedError("two layers' page pools are read by the same SDPA call")
    for s in sites:
        rewrite_site(gm, s)
    gm.graph.eliminate_dead_code(is_impure_node=_impure)
    check_rewritten(gm, caches)
    for s in sites:
        if s.k_read is not None and (s.k_read in gm.graph.nodes or s.v_read in gm.graph.nodes):
            raise UnsupportedError(f"layer {s.layer}: the full-precision read of the page pool is still in the graph "
                                 f"after the rewrite (another use of it remains)")
    gm.graph.lint()
    gm.recompile()
    counters["graphs_rewritten"] += 1
    reports.append([s.report() for s in sites])
    return sites
