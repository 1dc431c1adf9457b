"""Packed KV pages inside a serving engine's own cache: the core interface an engine integration builds on.

A paged serving engine (vLLM; later kvcompile's own serving) owns each layer's cache as fixed-size pages -- one
flat byte buffer per layer, page ``i`` holding ``block`` consecutive tokens of one sequence for every kv head --
and gives each sequence a block table (its pages, in order) and a length. It allocates, shares (prefix caching),
frees and evicts pages itself; kvcompile only says how big a page is and what is in it, writes tokens into it
and attends over it:

    layout = PageLayout(policy, heads=8, head_dim=128, dtype="bfloat16", block=128)
    layout.page_bytes                    # what the engine allocates per page (a multiple of heads * block)
    pools = layout.views(pages)          # the store's pool tensors, viewed in place in the engine's buffer
    store(layout, pages, k, v, lengths, table)                    # quantize on write, at the tokens' slots
    out = attention(layout, pages, q, lengths, table, k, v)       # the queries over their sequences' pages

A page holds exactly the ``KVStore`` block of ``LayerSpec(policy, heads, head_dim, dtype, block_tokens=block)``
(``kvcompile.store``): the packed codes of keys and values, and their scales and zero points, per kv head -- the
same bytes, field by field, that the reference store writes into a block of its own pool. The fields lie one after
the other in the page, each ``[heads, rows, X]`` dense and starting at a multiple of ``ALIGN`` bytes (``fields``);
the kernels read them in place (``cpu.pool_strides``: a field's blocks are one page apart). Position ``p`` of a
sequence lives in page ``table[p // block]``, row ``p % block``: the engine's own slot for it.

**What fits in a page.** A page holds packed tokens only. A policy that keeps tokens in full precision beside its
packed blocks -- a recent window (``residual``), per-channel key groups (KIVI: up to ``group - 1`` tokens wait in
full precision until their group is complete) -- needs a second cache from the engine: each sequence's newest
``window_tokens`` positions in full precision, in pages of their own (``PageLayout(..., window=True)``;
``store_windowed`` and ``attention_windowed``, below; vLLM manages it as a sliding-window layer). Sinks (the first
``sink`` tokens in full precision) live at the start of each sequence's first page, which then holds nothing else:
packed position ``p`` (``j = p - sink``) lives in page ``table[1 + j // block]``, row ``j % block``, so a page's
packed tokens lag its own positions by ``block - sink`` and wait that long in the window cache (a window of
``residual >= block - sink``), and every page is final once its own positions are written (``packing_spec``).
Pre-RoPE keys need the rotary embedding, which an engine applies before the cache sees the keys.
``refusal(policy, block, window)`` says what pages cannot hold (a ``Refusal``), and ``PageLayout`` refuses it
(``PageError``, with the reason and what to use instead), never storing something other than what was asked.

The batch forms (``store``, ``attention``) take ``[B, H, n, D]`` chunks of equal length; the ragged forms
(``store_ragged``, ``attention_ragged``) take an engine's flat batch: ``[T, H, D]`` tokens, request ``i`` owning
tokens ``query_start[i] .. query_start[i + 1]``, the last ``n_i`` of its ``seq_lens[i]`` positions; a sliding-window
layer's (``attention_ragged(..., window=W)``) reads each query's last ``W`` positions and never a page before them,
which the engine frees. Kernels:
``kvcompile.ops.backend`` (the C kernels on the CPU, Triton on CUDA, or the reference), as everywhere else.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .templates.common import to_device
from .errors import ArgumentError, UnsupportedError
from .policy import Policy
from .store import (DTYPE_NAMES, DTYPES, POOL_FIELDS, FlatRecent, KVState, LayerSpec, check_chunk, describe,
                    map_rows)

ALIGN = 16  # bytes: each field of a page starts at a multiple of this (every element type the fields hold)
_VIEWS = WeakIdKeyDictionary()  # an engine's buffer -> {layout: ((where it lies), its pool views)}


class Refusal(enum.Enum):
    """Why a policy's cache cannot live in an engine's fixed-size pages (``refusal``)."""

    WINDOW = "residual"        # a full-precision window of recent tokens per sequence
    PER_CHANNEL = "channel"    # per-channel groups: the newest tokens wait in full precision for their group
    SINKS = "sink"             # the first tokens of each sequence in full precision
    PRE_ROPE = "pre_rope"      # keys stored before the rotary embedding the engine has already applied
    OVERRIDES = "overrides"    # per-layer choices: a layout is one layer's (resolve the policy first)
    BLOCK = "block"            # the engine's page size is not a block kvcompile's kernels take


class PageError(UnsupportedError):
    """A policy (or page size) whose cache cannot live in an engine's pages; ``kind`` is the ``Refusal``."""

    def __init__(self, message: str, kind: Refusal):
        super().__init__(message)
        self.kind = kind


def needs_window(policy: Policy) -> bool:
    """Whether ``policy`` (one layer's) keeps positions in full precision beside its packed ones that an engine's
    window cache can hold: a recent window (``residual``) or per-channel groups waiting to fill (``flush > 1``);
    ``window_tokens`` of them, the store's ring."""
    return bool(policy.residual) or policy.flush > 1


def packs_sliding_window(policy: Policy, window: int) -> bool:
    """Whether a sliding-window layer of ``window`` positions keeps its window in pages of ``policy`` (one layer's;
    ``attention_ragged`` / ``attention_windowed``'s ``window``): a per-token policy always; one with a window cache
    when that cache is shorter than the window (else it would pack positions the window has left, into pages the
    engine frees -- and it holds the window in full precision anyway)."""
    return not needs_window(policy) or policy.ring < window


def refusal(policy: Policy, block: int, window: bool = False) -> tuple[Refusal, str] | None:
    """Why ``policy`` (one layer's, no overrides) cannot be kept in pages of ``block`` tokens, as
    ``(kind, reason)``; None when it can. ``window``: the engine also keeps each sequence's newest tokens in full
    precision, in pages of its own (``window_tokens``), so a recent window and per-channel groups can be kept. The
    reason says what was found and what to use instead."""
    per_token = ("a per-token policy with no window and no sinks, e.g. Policy.int8(), "
                 "Policy.fp8(residual=0), or the presets int8, fp8-r0, fp8-tensor+rot, tok+rot:4, tok+rot:2")
    if policy.overrides:
        return Refusal.OVERRIDES, ("a page layout is one layer's: resolve the per-layer policy first "
                                   "(policy.resolve(layer names)) and make one layout per layer")
    if policy.pre_rope:
        return Refusal.PRE_ROPE, ("pre_rope=True stores keys before the rotary embedding, but an engine's cache "
                                  "receives keys after it: use the same policy with pre_rope=False")
    if policy.sink and not (window and policy.residual >= block - policy.sink):
        # the sinks take a sequence's first page, so its packed tokens start a page later and wait that long in
        # the window cache: a window shorter than that would leave positions neither packed nor in the window
        fit = 1 << (policy.residual + policy.sink).bit_length() - 1 if policy.residual + policy.sink >= 16 else 0
        eg = " (e.g. kivi+rot+sink:4's 128)" if block - policy.sink <= 128 else ""
        how = (f"a window of residual >= {block - policy.sink}{eg}"
               f"{'' if window else ', kept in a window cache (window=True)'}")
        if fit and policy.residual:
            how = f"give the engine pages of at most {fit} tokens, or use {how}"
        else:
            how = f"use {how}"
        return Refusal.SINKS, (f"sink={policy.sink} keeps each sequence's first tokens in full precision in its first "
                               f"page, so its packed tokens are kept one page ({block} tokens) later and wait in the "
                               f"window cache until then, which residual={policy.residual} does not cover: {how}, "
                               f"or use the same policy with sink=0")
    if not window and policy.residual:
        return Refusal.WINDOW, (f"residual={policy.residual} keeps each sequence's newest tokens in full precision "
                                f"beside its packed blocks, and a page holds only packed tokens: use {per_token}")
    if not window and policy.flush > 1:
        return Refusal.PER_CHANNEL, (f"per-channel groups of {policy.flush} tokens (KIVI keys) keep up to "
                                     f"{policy.flush - 1} tokens per sequence in full precision until their group "
                                     f"is complete, and a page holds only packed tokens: use {per_token}")
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 16 and not block & (block - 1)):
        return Refusal.BLOCK, (f"pages of {block!r} tokens: kvcompile's kernels take blocks of a power of two >= 16 "
                               f"tokens; give the engine such a block size (e.g. 16, 32, 64 or 128)")
    if block % policy.flush:
        return Refusal.BLOCK, (f"pages of {block} tokens do not hold whole per-channel groups of {policy.flush} "
                               f"tokens; give the engine a block size that is a multiple of {policy.flush}")
    return None


class Field(NamedTuple):
    """One pool field inside a page: ``name`` (``POOL_FIELDS``), its byte ``offset`` in the page, its per-page
    ``shape`` ``(heads, rows, X)`` and ``dtype``; ``shape`` is None for a field the policy does not store."""

    name: str
    offset: int
    shape: tuple | None
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _esize(self.dtype) if self.shape else 0


@dataclass(frozen=True)
class PageLayout:
    """How one layer's packed cache lives in an engine's pages of ``block`` tokens.

    policy:   the layer's policy (resolved: no overrides); ``refusal`` says which ones pages cannot hold.
    heads:    the kv heads the engine keeps in this layer's cache (a tensor-parallel rank's own).
    head_dim: channels per head.
    dtype:    the model's dtype, "float32", "bfloat16" or "float16" (what unquantized codes are kept in).
    block:    tokens per page (the engine's block size): a power of two >= 16.
    window:   the engine keeps each sequence's newest ``window_tokens`` in full precision in a second cache of
              pages (``window_views``), which lets a layout hold a recent window (``residual``), per-channel
              key groups (KIVI) and, beside a window of at least ``block - sink`` tokens, sinks (in each
              sequence's first page); ``store_windowed`` and ``attention_windowed`` then write and read both.
    """

    policy: Policy
    heads: int
    head_dim: int
    dtype: str
    block: int
    window: bool = False

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            if self.dtype not in DTYPE_NAMES:
                raise ArgumentError(f"PageLayout.dtype={self.dtype}: expected one of {sorted(DTYPES)} (the model's "
                                    f"dtype)")
            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])
        if not isinstance(self.policy, Policy):
            raise ArgumentError(f"PageLayout.policy={self.policy!r}: expected a kvcompile.Policy")
        why = refusal(self.policy, self.block, self.window)
        if why is not None:
            raise PageError(f"kvcompile policy {self.policy} cannot be kept in pages of {self.block!r} tokens: "
                            f"{why[1]}.", why[0])
        self.spec  # validates heads, head_dim, dtype and the policy against head_dim (PolicyError)
        if self.sink_bytes > self.page_bytes:
            raise PageError(f"kvcompile policy {self.policy} cannot be kept in pages of {self.block} tokens: its "
                            f"{self.policy.sink} sinks in full precision ({self.sink_bytes} bytes) do not fit the "
                            f"first page ({self.page_bytes} bytes): use fewer sinks or larger pages.", Refusal.SINKS)

    @functools.cached_property
    def spec(self) -> LayerSpec:
        """The store layout whose blocks the pages hold (``block_tokens`` = the page's tokens)."""
        return LayerSpec(self.policy, self.heads, self.head_dim, self.dtype, block_tokens=self.block)

    @functools.cached_property
    def fields(self) -> tuple[Field, ...]:
        """The pool fields in ``POOL_FIELDS`` order, each at an ``ALIGN``-byte offset of the page."""
        out, at = [], 0
        shapes = [s for which in ("k", "v") for s in self.spec._block_shapes(which)]
        for name, (shape, dt) in zip(POOL_FIELDS, shapes):
            f = Field(name, at, shape, dt)
            out.append(f)
            at = -(-(at + f.nbytes) // ALIGN) * ALIGN
        return tuple(out)

    @property
    def content_bytes(self) -> int:
        """Bytes of a page's fields, their alignment padding included (``LayerSpec.block_nbytes`` plus padding)."""
        return max(f.offset + f.nbytes for f in self.fields)

    @property
    def token_head_bytes(self) -> int:
        """Bytes per (kv head, token) of a page: ``page_bytes / (heads * block)``. An engine that sizes a page as
        heads x block x C (vLLM's ``state_content_bytes``) takes this as C."""
        return -(-self.content_bytes // (self.heads * self.block))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: the fields, padded to a whole ``heads * block * token_head_bytes``."""
        return self.heads * self.block * self.token_head_bytes

    @functools.cached_property
    def packing_spec(self) -> LayerSpec:
        """``spec`` without the recent window: its store packs every whole ``flush``-group at once (a group's bytes
        depend on its tokens alone, so they are ``spec``'s), keeping only the pending group in its ring -- how
        ``store_windowed`` fills the pages. With sinks it keeps a window of ``block - sink`` tokens: packed
        position ``j`` (``sink + j``) lives in the sequence's page ``1 + j // block`` (``state``), which the engine
        gives it once the sequence reaches ``sink + j + block - sink`` tokens, so a group is packed when that page
        is its and final once the page's own positions are all written (what prefix caching needs)."""
        lag = max(0, self.block - self.policy.sink) if self.policy.sink else 0
        return LayerSpec(dataclasses.replace(self.policy, residual=lag), self.heads, self.head_dim, self.dtype,
                         block_tokens=self.block)

    @property
    def sink_bytes(self) -> int:
        """Bytes of a sequence's sinks at the start of its first page: keys then values ``[heads, sink, head_dim]``
        in the model's dtype (0 without sinks). That page holds nothing else: packed tokens start in the next."""
        return 2 * self.heads * self.policy.sink * self.head_dim * _esize(DTYPES[self.dtype])

    @property
    def window_tokens(self) -> int:
        """Positions per sequence the window cache must keep, its newest: ``residual + flush - 1`` (the store's
        ring; 0 for a layout without a window). A query at position ``p`` reads positions ``> p - window_tokens``
        from it, and every packed position before those from the pages."""
        return self.spec.ring if self.window else 0

    def window_page_bytes(self, block: int) -> int:
        """Bytes of one page of ``block`` tokens of the window cache: every kv head's keys and values in the
        model's dtype."""
        return 2 * self.heads * block * self.head_dim * _esize(DTYPES[self.dtype])

    def window_views(self, window: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``[NB, H, block, D]`` (model dtype) viewed in place in the engine's window cache
        ``window`` (``[NB, ...]``, each page at least ``window_page_bytes(block)`` dense bytes from its start;
        pages any distance apart). What they hold is ``kvcompile.store.as_stored``: the policy's rotated space."""
        if not isinstance(window, Tensor) or window.dim() < 2:
            raise ArgumentError(f"window: expected the engine's window cache [pages, ...]; got {describe(window)}")
        dt, H, D = DTYPES[self.dtype], self.heads, self.head_dim
        es = _esize(dt)
        u8 = window.view(torch.uint8) if window.dtype != torch.uint8 else window
        inner = u8.shape[1:]
        if math.prod(inner) < self.window_page_bytes(block) or not _dense(inner, u8.stride()[1:]) \
                or u8.stride(0) % es or u8.storage_offset() % es:
            raise ArgumentError(f"window: each page must hold {self.window_page_bytes(block)} dense bytes "
                                f"({block} tokens of {H} heads' keys and values, {self.dtype}); got {describe(window)}")
        flat = u8.as_strided((u8.shape[0], self.window_page_bytes(block)), (u8.stride(0), 1)).view(dt)
        kv = flat.view(u8.shape[0], 2, H, block, D)
        return kv[:, 0], kv[:, 1]

    # ---- the engine's buffer
    def _bytes(self, pages: Tensor) -> Tensor:
        """``pages`` as ``uint8 [NB, page_bytes]``, in place (each page ``page_bytes`` dense bytes, its dimensions in
        any order; pages any distance apart)."""
        if not isinstance(pages, Tensor) or pages.dtype not in (torch.uint8, torch.int8) or pages.dim() < 2:
            raise ArgumentError(f"pages: expected the engine's uint8 or int8 buffer [pages, ...] of {self.page_bytes} "
                                f"bytes a page; got {describe(pages)}")
        inner = pages.shape[1:]
        if math.prod(inner) != self.page_bytes or not _dense(inner, pages.stride()[1:]):
            raise ArgumentError(f"pages: each page must be {self.page_bytes} dense bytes (this layout's page_bytes: "
                                f"{self.policy}, {self.heads} heads x {self.block} tokens x {self.token_head_bytes} "
                                f"bytes); got {describe(pages)}")
        u8 = pages if pages.dtype == torch.uint8 else pages.view(torch.uint8)
        return u8.as_strided((u8.shape[0], self.page_bytes), (u8.stride(0), 1))

    def views(self, pages: Tensor) -> tuple[Tensor, ...]:
        """The store's pool tensors (``KVState``'s first six, ``POOL_FIELDS`` order) viewed in place in the
        engine's buffer ``pages`` (``[NB, ...]`` uint8 or int8, each page ``page_bytes`` dense bytes, e.g. vLLM's
        ``[NB, heads, block, token_head_bytes]``): field ``f`` is ``[NB, heads, rows, X]`` of its dtype, page ``i``
        its block ``i``; a field the policy does not store is an empty tensor, as ``LayerSpec.pool`` gives.
        Made once per buffer (an engine passes each layer's the same every step) and layout."""
        where = (pages.data_ptr(), tuple(pages.shape), pages.stride(), pages.dtype)
        known = _VIEWS.get(pages, {}).get(self)
        if known is not None and known[0] == where:
            return known[1]
        views = self._views(pages)
        _VIEWS.setdefault(pages, {})[self] = (where, views)
        return views

    def _views(self, pages: Tensor) -> tuple[Tensor, ...]:
        flat = self._bytes(pages)
        out = []
        for f in self.fields:
            if f.shape is None:
                out.append(torch.empty(0, dtype=f.dtype, device=pages.device))
                continue
            out.append(_typed(flat, f.offset, f.shape, f.dtype, f"field {f.name}"))
        return tuple(out)

    def sinks(self, pages: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[NB, H, sink, D]`` (model dtype, the store's space) at the start of every page, viewed
        in place: a sequence's sinks are those of its first page."""
        kv = _typed(self._bytes(pages), 0, (2, self.heads, self.policy.sink, self.head_dim), DTYPES[self.dtype],
                    "the sinks")
        return kv[:, 0], kv[:, 1]

    def state(self, pages: Tensor, lengths: Tensor, table: Tensor) -> KVState:
        """A ``KVState`` over the pages: the pool views, no rings (pages hold none), ``lengths`` (int32 ``[B]``,
        tokens each sequence holds) and ``table`` (int32 ``[B, MB]``, each sequence's pages in order), both as given
        (the store advances ``lengths`` in place). With sinks: each sequence's sinks, copied from its first page
        (``sinks``; ``_put_sinks`` writes them back), and its packed blocks from its second page on."""
        B, H, D, dt = lengths.shape[0], self.heads, self.head_dim, DTYPES[self.dtype]
        none = torch.empty(B, H, 0, D, dtype=dt, device=pages.device)
        if not self.policy.sink:
            return KVState(*self.views(pages), none, none, none, none, lengths, table)
        first = table[:, 0].long().clamp_min(0)
        ks, vs = self.sinks(pages)
        # the packed blocks from the second page on (the first moved to the end keeps the table's width; a
        # sequence's packed tokens never reach its last page: they lag it by a page)
        shifted = torch.cat([table[:, 1:], table[:, :1]], 1)
        return KVState(*self.views(pages), none, none, ks.index_select(0, first), vs.index_select(0, first), lengths,
                       shifted)

    def _put_sinks(self, pages: Tensor, st: KVState, table: Tensor, which: Tensor) -> None:
        """Write back the sinks of sequences ``which`` (bool ``[B]``: those whose sinks this store wrote) from
        ``st`` into their first pages."""
        if not self.policy.sink or not bool(which.any()):
            return
        rows = which.nonzero().squeeze(1).to(pages.device)
        ks, vs = self.sinks(pages)
        first = table[:, 0].long().to(pages.device).index_select(0, rows)
        ks[first] = st.k_sink.index_select(0, rows)
        vs[first] = st.v_sink.index_select(0, rows)


def _typed(flat: Tensor, offset: int, shape: tuple, dtype: torch.dtype, what: str) -> Tensor:
    """``[NB, *shape]`` of ``dtype`` viewed in place at byte ``offset`` of every page of ``flat`` (uint8
    ``[NB, page_bytes]``); an error naming ``what`` when its elements would not be aligned."""
    es = _esize(dtype)
    if flat.stride(0) % es or (flat.storage_offset() + offset) % es:
        raise ArgumentError(f"pages: {what} ({dtype}) would start at a byte not aligned to its {es}-byte elements "
                            f"(pages {flat.stride(0)} bytes apart, offset {flat.storage_offset()}); give the pages an "
                            f"aligned buffer")
    return flat[:, offset:offset + math.prod(shape) * es].view(dtype).view(flat.shape[0], *shape)


def _dense(shape, strides) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` covers one run of contiguous elements, its dimensions in any
    order (an engine may order a page's heads, tokens and bytes as its kernels like)."""
    run = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1):
        if stride != run:
            return False
        run *= size
    return True


def _esize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def _rows(lengths: Tensor, table: Tensor, B: int, device) -> tuple[Tensor, Tensor]:
    if lengths.shape != (B,) or table.dim() != 2 or table.shape[0] != B:
        raise ArgumentError(f"lengths must be [{B}] and table [{B}, pages per sequence]; got {list(lengths.shape)} "
                            f"and {list(table.shape)}")
    return (lengths.to(device=device, dtype=torch.int32).contiguous(),
            table.to(device=device, dtype=torch.int32).contiguous())


def prepare(layout: PageLayout, device) -> None:
    """Build the kernels ``layout``'s calls will run on ``device`` now (the C compiler takes a few seconds a
    kernel, once per layout and machine), so that an engine's first request does not wait for them."""
    if ops.kernels(torch.device(device)) == "cpu":
        from .templates import cpu, cpu_store
        cpu_store.build(layout.spec)
        cpu.build(tuple(sorted(cpu.defines(layout.spec).items())))


# --------------------------------------------------------------------------- equal-length chunks
def store(layout: PageLayout, pages: Tensor, k: Tensor, v: Tensor, lengths: Tensor, table: Tensor,
          n_new: Tensor | None = None) -> None:
    """Quantize ``k, v [B, H, n, D]`` (the model's keys and values) into the pages, in place.

    ``lengths`` int ``[B]``: tokens sequence ``b`` held before (its new tokens go at positions ``lengths[b] ..``,
    i.e. page ``table[b][p // block]``, row ``p % block``); ``table`` int ``[B, MB]``: its pages, which must cover
    every position written (``CapacityError`` otherwise; nothing is written). ``n_new`` int ``[B]``: row ``b``
    stores only its first ``n_new[b]`` tokens (default: all ``n``). The bytes are exactly those
    ``kvcompile.store.store_reference`` writes into a store of ``layout.spec`` with the same table."""
    B = k.shape[0]
    lengths, table = _rows(lengths, table, B, pages.device)
    st = layout.state(pages, lengths.clone(), table)
    ops.backend(pages.device).store(st, layout.spec, k, v, n_new)
    wrote = (n_new.to(lengths.device) > 0) if n_new is not None else torch.ones_like(lengths, dtype=torch.bool)
    layout._put_sinks(pages, st, table, (lengths < layout.policy.sink) & wrote)


def attention(layout: PageLayout, pages: Tensor, q: Tensor, lengths: Tensor, table: Tensor,
              k_new: Tensor | None = None, v_new: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Attention of ``q [B, Hq, n, D]`` -- the last ``n`` tokens of each sequence, already stored -- over the
    sequences' pages, causally; ``[B, Hq, n, D]`` in q's dtype. ``lengths`` int ``[B]``: tokens each sequence holds
    (the queries' own included); ``table`` int ``[B, MB]``: its pages. ``k_new, v_new [B, H, n, D]``: the queries'
    own keys and values, read in full precision at their positions (a prefill attends to itself unquantized);
    without them every position is read from the pages. ``kvcompile.store.attention_reference``'s contract over
    the store the pages hold (a query that sees no key gets zeros; non-finite values as it says)."""
    B = q.shape[0]
    lengths, table = _rows(lengths, table, B, pages.device)
    check_chunk(q, k_new, v_new, layout.spec)
    st = layout.state(pages, lengths, table)
    return ops.backend(pages.device).attention(q, st, layout.spec, None, scale, k_new=k_new, v_new=v_new)


# --------------------------------------------------------------------------- an engine's flat batch
class Ragged(NamedTuple):
    """A flat batch of ``T`` tokens from ``B`` sequences (how engines batch), prepared once for every layer.

    query_start: int ``[B + 1]``, sequence ``i`` owns tokens ``query_start[i] .. query_start[i + 1]``
    seq_lens:    int ``[B]``, positions each sequence holds once its tokens are stored
    table:       int32 ``[B, MB]``, each sequence's pages in order
    n:           host list of each sequence's token count; before: host list of the positions each held before
    starts:      host list of ``query_start`` (``B + 1``)
    plans:       what the layers' calls derive from the batch (``_each_query``'s rows), made by the first layer that
                 needs it and read by the others: no layer repeats the host work or its copies to the device
    """

    query_start: Tensor
    seq_lens: Tensor
    table: Tensor
    n: list
    before: list
    starts: list
    plans: dict

    @classmethod
    def of(cls, query_start: Tensor, seq_lens: Tensor, table: Tensor) -> "Ragged":
        qs = query_start.to("cpu", torch.int64).tolist()
        sl = seq_lens.to("cpu", torch.int64).tolist()
        B = len(sl)
        if len(qs) != B + 1 or table.dim() != 2 or table.shape[0] < B:
            raise ArgumentError(f"a flat batch needs query_start [B + 1], seq_lens [B] and a table of B rows; got "
                                f"{len(qs)}, {B} and {list(table.shape)}")
        n = [b - a for a, b in zip(qs, qs[1:])]
        before = [L - x for L, x in zip(sl, n)]
        if any(x < 0 for x in n) or any(x < 0 for x in before):
            raise ArgumentError(f"a flat batch's sequences must hold at least their own tokens: query lengths {n}, "
                                f"seq_lens {sl}")
        return cls(query_start, seq_lens, table[:B].to(torch.int32), n, before, qs, {})

    def groups(self) -> dict[int, list[int]]:
        """The sequences grouped by their token count (each group is one equal-length call)."""
        out: dict[int, list[int]] = {}
        for i, x in enumerate(self.n):
            if x:
                out.setdefault(x, []).append(i)
        return out

    def tokens(self) -> tuple[Tensor, Tensor, Tensor]:
        """(row of the flat batch, sequence, position) of every token, as int64 CPU tensors."""
        before = torch.tensor(self.before, dtype=torch.long)
        seq, pos = _spans(before, before + torch.tensor(self.n, dtype=torch.long))
        first = torch.tensor(self.starts[:len(self.n)], dtype=torch.long)
        return first[seq] + pos - before[seq], seq, pos

    def padded(self, x: Tensor) -> Tensor:
        """``x [T, H, D]`` as ``[B, H, nmax, D]`` (zeros past a sequence's own tokens); a view when every sequence
        has the same count."""
        B, nmax = len(self.n), max(self.n, default=0)
        T, H, D = x.shape
        if all(c == nmax for c in self.n) and T >= B * nmax:
            return x[:B * nmax].view(B, nmax, H, D).transpose(1, 2)
        out = x.new_zeros(B, nmax, H, D)
        rows = torch.repeat_interleave(torch.arange(B), torch.tensor(self.n))
        cols = torch.cat([torch.arange(c) for c in self.n]) if B else torch.zeros(0, dtype=torch.long)
        out[rows.to(x.device), cols.to(x.device)] = x[:sum(self.n)]
        return out.transpose(1, 2)


def _spans(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(span, position) of every position of the spans ``[lo[r], hi[r])``, span by span (int64 CPU tensors)."""
    cnt = (hi - lo).clamp_min(0)
    span = torch.repeat_interleave(torch.arange(len(cnt)), cnt)
    return span, lo[span] + torch.arange(len(span)) - (torch.cumsum(cnt, 0) - cnt)[span]


def store_ragged(layout: PageLayout, pages: Tensor, k: Tensor, v: Tensor, batch: Ragged) -> None:
    """``store`` for a flat batch: ``k, v [T, H, D]``, sequence ``i``'s tokens at its positions
    ``seq_lens[i] - n_i ..`` (``Ragged``). Tokens past the batch's (an engine's padding) are not stored."""
    if not batch.n:
        return
    kp, vp = batch.padded(k), batch.padded(v)
    before = torch.tensor(batch.before, dtype=torch.int32)
    n_new = torch.tensor(batch.n, dtype=torch.int32)
    store(layout, pages, kp, vp, before, batch.table, n_new)


# Read from the pages, every query of a flat batch is computed as the decode step of its own position would compute
# it: one row of the decode kernel, over the positions up to its own. The kernels' result for a row depends on that
# row's length alone (not on the batch beside it: ``templates.cpu.splits``; on CUDA the Triton decode kernel's
# row-invariant splits, ``invariant=True``), so a token's attention is the same bits
# however the engine cut the work -- decoded, in a prompt prefilled whole or in chunks, after a cached prefix, or
# recomputed after preemption. (One call over a prompt's queries would round differently from the decode steps,
# and in bf16/fp16 that difference, carried through the layers, changed greedy tokens after a recomputation.) A
# prefill thus costs the decode kernel's reads, quadratic in the prompt (docs/vllm.md measures it).
ROWS_PER_CALL = 4096  # query rows x kv heads per kernel call (bounds the kernel's per-row scratch)
RING_BYTES = 64 << 20  # the per-row rings one windowed call builds, at most (about)


def _starts(*keys: Tensor) -> Tensor:
    """Which rows begin a run of equal ``keys`` (bool, one per row; the first row always)."""
    new = torch.zeros(len(keys[0]), dtype=torch.bool)
    new[:1] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    return new


def _runs(seq: Tensor, *also: Tensor) -> Tensor | None:
    """Offsets (int32) of the runs of one sequence among rows whose sequences are ``seq`` (a flat batch's tokens:
    each sequence's adjacent, in order of position), which the kernels may read shared tiles once for
    (``ops.Backend``); with ``also``, runs of rows equal in those too (a sliding window's rows whose tables start
    at the same page, ``_slide``); None when no run has two rows (a decode step)."""
    new = _starts(seq, *also)
    if bool(new.all()):
        return None
    return torch.cat([new.nonzero().flatten(), torch.tensor([len(seq)])]).to(torch.int32)


def _sliding(window) -> bool:
    """Whether an attention call's ``window`` names a sliding window (None: every position); a ``window`` that is
    no count of positions is refused."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ArgumentError(f"window={window!r}: expected the sliding window's positions, an int >= 1")
    return window is not None


def _slide(table: Tensor, lo: Tensor, window: int, block: int, sink: int = 0) -> tuple[Tensor, Tensor]:
    """Rows of a sliding window of ``window`` positions over pages of ``block`` tokens: ``(table, shift)``, each
    row's pages from the one holding its first visible position ``lo`` on (those before it are never read:
    an engine frees them and gives them to other sequences), and the positions it skips (int64 CPU ``[rows]``), by
    which the row's positions are counted from there. Every row then reads at most ``_slid_width`` positions.

    With ``sink`` sinks (in the sequence's first page, its packed positions lagging a page: ``PageLayout``) the
    shift is whole pages of packed positions past the sinks, the first page stays first (the sinks' place: a row
    whose window has left them reads zeros there, masked, ``_each_query``), and a row counted from there still has
    its sinks at positions ``0 .. sink - 1`` and the packed positions after them where the kernels read them."""
    shift = (lo - sink).clamp_min(0) // block * block
    width = _slid_width(window, block, sink) // block
    cols = (shift[:, None] // block + torch.arange(width)).clamp_max(table.shape[1] - 1)
    if sink:  # the sinks' page first, then the packed pages (table[1 + j // block]) from the shifted one on
        cols = torch.cat([torch.zeros_like(cols[:, :1]), (cols[:, :-1] + 1).clamp_max(table.shape[1] - 1)], 1)
    return table.gather(1, cols.to(table.device)), shift


def _slid_width(window: int, block: int, sink: int = 0) -> int:
    """Positions a row of a sliding window reads at most, from the start of its first page: whole pages (and with
    sinks, their page first)."""
    return (-(-(window - 1 + block) // block) + bool(sink)) * block


def _window_mask(L: Tensor, lo: Tensor, width: int, device) -> Tensor:
    """The additive mask ``[R, 1, 1, width]`` of rows that see positions ``lo .. L - 1`` (int64 CPU tensors) and no
    other. Its width is the same for every call of a layer, so a row's result never depends on the rows beside it
    (the kernels size nothing of a row by the call's longest)."""
    at = torch.arange(width)
    hide = (at < lo[:, None]) | (at >= L[:, None])
    return torch.zeros(len(L), 1, 1, width).masked_fill_(hide[:, None, None], float("-inf")).to(device)


def _shifted(ring: Tensor, shift: Tensor) -> Tensor:
    """Rings ``[R, H, width, D]`` whose slot ``p % width`` holds position ``p``, as slot ``(p - shift) % width``: the
    rings of rows whose positions are counted ``shift`` later (``_slide``)."""
    width = ring.shape[2]
    if not width or not bool(shift.any()):
        return ring
    at = ((torch.arange(width) + shift[:, None]) % width).to(ring.device)
    return ring.gather(2, at[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3]))


class _Call(NamedTuple):
    """One kernel call of ``_each_query``: its rows (of the batch's tokens, on the query's device), their
    lengths and tables on the pages' device, runs of one sequence's rows, a sliding window's mask and the sinks it
    has left, each row's sequence and shift (host), and (windowed) the rings' rows: ``(seq, lo, hi, shift,
    rings)`` of the rows that build a ring (of a run whose full precision begins at the same position, the last
    row's: it holds every position the others read) and which ring each row reads (None: its own). ``memo``:
    what the layers gather the rings with (``_ring``), made by the first."""
    rows: Tensor
    lengths: Tensor
    table: Tensor
    runs: Tensor | None
    mask: Tensor | None
    gone: Tensor | None
    seq: Tensor
    shift: Tensor
    rings: tuple | None
    memo: dict


def _query_calls(layout: PageLayout, pages: Tensor, q: Tensor, batch: Ragged, windowed: bool,
                 window: int | None) -> list[_Call]:
    """``_each_query``'s calls for ``batch``: made once a step for every layer of this layout (``Ragged.plans``),
    their indices copied to the device without waiting for it (``to_device``)."""
    key = (layout, pages.device, q.device, windowed, window)
    if key in batch.plans:
        return batch.plans[key]
    sp = layout.spec
    idx, seq, pos = batch.tokens()
    L = pos + 1
    dev = pages.device
    table = to_device(batch.table, dev).index_select(0, to_device(seq, dev))
    step = max(1, ROWS_PER_CALL // layout.heads)
    lo = None
    if windowed:
        dt = DTYPES[layout.dtype]
        lo = sp.boundary(L)
        step = max(1, min(step, RING_BYTES // (2 * layout.heads * max(sp.ring, 1) * layout.head_dim * _esize(dt))))
    shift = torch.zeros_like(L)
    S = layout.policy.sink
    first = None
    if window is not None:
        first = (L - window).clamp_min(0)  # each row's first visible position
        table, shift = _slide(table, first, window, layout.block, S)
    calls = []
    for a in range(0, len(idx), step):
        r = slice(a, a + step)
        # runs of a sequence's rows reading the same table (a sliding window's: those whose window starts in the
        # same page, each masked to its own), whose tiles the kernels may read once
        mask = gone = None
        if window is not None:
            mask = _window_mask(L[r] - shift[r], first[r] - shift[r], _slid_width(window, layout.block, S), dev)
            if S:  # sinks the window has left: zeros (their page may be freed and hold anything), never seen
                gone = to_device(first[r] >= S, dev)
        runs = _runs(seq[r], shift[r])
        rings = None
        if windowed:
            s_, lo_, hi_, by, own = seq[r], lo[r], L[r], shift[r], None
            if runs is not None:
                new = _starts(s_, by, lo_)
                lead = new.nonzero().flatten()
                last = torch.cat([lead[1:] - 1, torch.tensor([len(s_) - 1])])
                own = (new.cumsum(0) - 1).to(torch.int32)
                s_, lo_, hi_, by = s_[lead], lo_[lead], hi_[last], by[lead]
            rings = (s_, lo_, hi_, by, own)
        calls.append(_Call(to_device(idx[r], q.device), to_device((L[r] - shift[r]).to(torch.int32), dev),
                           table[r], runs, mask, gone, seq[r], shift[r], rings, {}))
    batch.plans[key] = calls
    return calls


def _each_query(layout: PageLayout, pages: Tensor, q: Tensor, batch: Ragged, scale: float | None, out: Tensor,
                recent: Recent | None = None, window: int | None = None) -> Tensor:
    """Every query of ``batch`` as one decode row over the positions up to its own (with ``recent``: and a ring
    of its own holding its full-precision positions, ``attention_windowed``; with ``window``: only the last
    ``window`` of them), into ``out``. A row of a sliding window is read from its window's first page on, its
    positions counted from there (``_slide``): the packed boundary moves with them (the shift is whole pages, so
    whole per-channel groups, and at most ``L - residual``: ``attention_windowed`` checks), and its ring is
    re-slotted (``_shifted``). The calls' rows are the step's, for every layer (``_query_calls``)."""
    sp = layout.spec
    dt = DTYPES[layout.dtype]
    for c in _query_calls(layout, pages, q, batch, recent is not None, window):
        st = layout.state(pages, c.lengths, c.table)
        runs, rings = c.runs, None
        if c.gone is not None:
            st = st._replace(k_sink=st.k_sink.masked_fill(c.gone[:, None, None, None], 0),
                             v_sink=st.v_sink.masked_fill(c.gone[:, None, None, None], 0))
        flat = None
        if recent is not None and recent.k is not None:
            # the full-precision positions are the step's own rows (the window's, then its tokens'): each row reads
            # its own where they lie (``Recent.rows``' rule; a sliding window's rows count from their shift), the
            # C kernels in place, others from rings gathered out of them (``store.flat_rings``)
            by = c.shift
            flat = FlatRecent(recent.k, recent.v, recent.row_map(c.seq) + torch.stack([by, by, -by], 1))
        elif recent is not None:
            # the query's own position too comes from its ring (or, once packed, from the pages): a query whose own
            # token is already packed (no window, a group it completed) reads it packed, as the store holds it.
            # Rows of a run whose full precision begins at the same position share a ring (``_Call.rings``).
            s_, lo_, hi_, by, rings = c.rings
            rk, rv = _ring(layout, recent, s_, lo_, hi_, sp.ring, dt, c.memo)
            st = st._replace(k_res=_shifted(rk, by), v_res=_shifted(rv, by))
        got = ops.backend(pages.device).attention(q.index_select(0, c.rows).unsqueeze(2), st, sp, c.mask, scale,
                                                  invariant=True, groups=runs, rings=rings, flat=flat)
        out.index_copy_(0, c.rows.to(out.device), got.squeeze(2).to(out.dtype))
    return out


def attention_ragged(layout: PageLayout, pages: Tensor, q: Tensor, k: Tensor | None, v: Tensor | None,
                     batch: Ragged, scale: float | None = None, out: Tensor | None = None,
                     window: int | None = None) -> Tensor:
    """``attention`` for a flat batch: ``q [T, Hq, D]``, and ``k, v [T, H, D]`` the same tokens' own keys and
    values (read in full precision at their positions: sequences with the same token count are one call; None:
    every position from the pages, each query one decode row, above). Returns ``out [T, Hq, D]`` (written in
    place when given; rows past the batch's tokens are left as they are).

    ``window``: a sliding-window layer's, each query at position ``p`` attending to positions ``p - window + 1 ..
    p`` only (vLLM's and transformers' convention: ``window`` positions, its own included). Pages wholly before a
    query's window are never read, so an engine may free them (and their table entries name another sequence's
    page, or none); every position from the pages (``k = v = None``), in a layout without a window cache."""
    T, Hq, D = q.shape
    if out is None:
        out = q.new_zeros(T, Hq, D)
    if _sliding(window) and (k is not None or v is not None or layout.window):
        raise ArgumentError(f"a sliding window reads every position from the pages (k = v = None) of a layout "
                            f"without a window cache; got k={describe(k)}, v={describe(v)}, window cache {layout.window} "
                            f"({layout.policy})")
    if k is None and v is None:  # every query its own decode row (see ROWS_PER_CALL)
        return _each_query(layout, pages, q, batch, scale, out, window=window)
    qs = batch.query_start.to("cpu", torch.int64).tolist()
    for n, rows in batch.groups().items():
        idx = torch.tensor([qs[i] + j for i in rows for j in range(n)], device=q.device)
        def take(x):
            return x.index_select(0, idx).view(len(rows), n, x.shape[1], D).transpose(1, 2)
        sel = torch.tensor(rows, device=batch.table.device)
        got = attention(layout, pages, take(q), batch.seq_lens.index_select(0, sel.to(batch.seq_lens.device)),
                        batch.table.index_select(0, sel), take(k) if k is not None else None,
                        take(v) if v is not None else None, scale)
        out.index_copy_(0, idx, got.transpose(1, 2).reshape(len(rows) * n, Hq, D).to(out.dtype))
    return out


# --------------------------------------------------------------------------- a window of full-precision tokens
# With ``PageLayout.window`` the engine keeps a second cache: each sequence's newest ``window_tokens`` positions in
# full precision (``as_stored``: what the store's ring holds), under a block table of its own (``wbatch``: the same
# sequences and lengths as ``batch``), either
#   - as a sliding window (``ring=False``): pages of ``wblock`` tokens, position ``p`` in page
#     ``wtable[p // wblock]``, row ``p % wblock`` (the engine frees pages behind the window, and may give a step
#     no page -- its ``null_page`` -- for positions no later step reads: those are not written), or
#   - as a ring (``ring=True``): one page of ``wblock >= window_tokens`` slots per sequence, ``wtable[0]``, position
#     ``p`` in slot ``p % wblock`` (only the newest ``wblock`` positions are kept).
# The packed pages take every whole ``flush``-group as soon as its last token is written, so a page is final once
# all its positions are; a query at position ``p`` reads the store as it stood when ``p`` was its newest token --
# positions ``< Q(p + 1)`` packed, the rest in full precision (``kvcompile.store``'s ``Q``) -- which is what
# decoding one token at a time gives, whatever the engine's chunks, cached prefixes or recomputations.
class Recent(NamedTuple):
    """What a step's windowed attention reads in full precision: ``k, v [N, H, D]`` (the store's space and dtype),
    the window cache's positions each sequence held before the step (read before the step's write), then the
    step's own tokens in batch order; sequence ``i``'s positions ``lo[i] .. before[i]`` start at row ``start[i]``,
    its own at row ``own + query_start[i]``. Made by ``store_windowed``, read by ``attention_windowed``.

    Or, when the window cache itself holds every position the step reads once its tokens are written (a decode
    step; ``store_windowed`` checks), ``k`` and ``v`` are None and ``cache`` says where they are: the window's
    keys and values ``[pages, H, wblock, D]`` (``PageLayout.window_views``), each sequence's window table (int64,
    on their device), ``wblock`` and ``ring`` -- the rings are then gathered straight from the cache."""

    k: Tensor | None
    v: Tensor | None
    lo: Tensor           # the int64 CPU tensors here: one entry per sequence
    start: Tensor | None
    own: int
    before: Tensor
    query_start: Tensor
    cache: tuple | None = None

    def rows(self, seq: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """For spans ``(seq[r], lo[r], hi[r])`` (int64 CPU tensors): (span, position, row of ``k``/``v``) of every
        position of every span, int64 CPU tensors."""
        span, pos = _spans(lo, hi)
        return span, pos, map_rows(self.row_map(seq)[span], pos)

    def row_map(self, seq: Tensor) -> Tensor:
        """The ``store.FlatRecent`` map ``[R, 3]`` of sequences ``seq``: held positions from ``start``, the step's
        own from ``own + query_start`` (``store.map_rows`` gives a position's row of ``k``/``v``)."""
        return torch.stack([self.start[seq] - self.lo[seq], self.own + self.query_start[seq] - self.before[seq],
                            self.before[seq]], 1)


def _locate(table: Tensor, seqs: Tensor, pos: Tensor, wblock: int, ring: bool) -> tuple[Tensor, Tensor]:
    """(page, row) of positions ``pos`` of sequences ``seqs`` in the window cache whose table is ``table`` (int64
    CPU tensors all)."""
    return table[seqs, torch.zeros_like(pos) if ring else pos // wblock], pos % wblock


class _Window(NamedTuple):
    """What ``store_windowed`` derives from a step's two batches and no layer's keys or values -- where the step's
    tokens go in the window cache, which of its positions the step reads, what it packs -- made by the step's first
    layer of a layout and read by the others (``Ragged.plans`` of the window cache's batch): the window table is
    read back once a step, every index reaches the device once a step, and no layer repeats the host work."""
    batch: Ragged        # the packed pages' batch it was made for
    qs: Tensor           # int64 CPU tensors: query_start, the positions each sequence held before the step,
    held_to: Tensor      # its tokens, and the first position before the step that it reads
    n: Tensor
    lo: Tensor
    writes: tuple | None  # (row of the step's tokens, page, row) on the tokens' device: the window cache's writes
    wtable: Tensor | None  # the window table on the device, when the step's rings come from the cache (a decode step)
    reads: tuple | None  # else (page, row) on the device of the positions before the step that it reads,
    start: Tensor | None  # and where each sequence's begin among them (int64 CPU)
    held: int
    packs: tuple | None  # what ``_pack`` writes with (done, its device copy, sinks, table, held_to int32 on the
    # pages' device: the store advances a copy), or None: the step completes no group and writes no sinks


def _window_plan(layout: PageLayout, pages: Tensor, dev: torch.device, wblock: int, batch: Ragged, wbatch: Ragged,
                 ring: bool, null_page: int | None) -> _Window:
    """``store_windowed``'s plan for this step (``_Window``), made once for the layers of ``layout``."""
    key = ("window", layout, pages.device, dev, wblock, ring, null_page)
    plan = wbatch.plans.get(key)
    if plan is not None and plan.batch is batch:
        return plan
    sp, sp0 = layout.spec, layout.packing_spec
    qs = torch.tensor(batch.starts, dtype=torch.long)
    held_to = torch.tensor(batch.before, dtype=torch.long)  # positions each sequence held before the step
    n = torch.tensor(batch.n, dtype=torch.long)
    wtab = wbatch.table.to("cpu", torch.long)  # the window's table, where the writes and the reads find pages

    # the step's tokens into the window cache (a ring keeps only its newest ``wblock``)
    end = held_to + n
    seqs, pos = _spans(torch.maximum(held_to, end - wblock) if ring else held_to, end)
    page, row = _locate(wtab, seqs, pos, wblock, ring)
    if null_page is not None:
        given = page != null_page
        seqs, pos, page, row = seqs[given], pos[given], page[given], row[given]
    writes = None
    if len(pos):
        writes = tuple(to_device(x, dev) for x in (qs[seqs] + pos - held_to[seqs], page, row))

    # the positions before the step that it reads
    lo = torch.where(n > 0, torch.minimum(sp0.boundary(held_to), sp.boundary(held_to + 1)), held_to)
    lo = torch.minimum(lo, held_to)  # (a sequence still short of its sinks reads none of its positions from here)
    wtable = reads = start = None
    held = 0
    if _in_cache(wtab, null_page, lo, end, wblock, ring):  # a decode step: the rings come from the cache
        wtable = to_device(wtab, dev)
    else:
        seqs, pos = _spans(lo, held_to)
        held = len(pos)
        if held:
            page, row = _locate(wtab, seqs, pos, wblock, ring)
            if null_page is not None and bool((page == null_page).any()):
                i = int((page == null_page).nonzero()[0])
                raise ArgumentError(f"the window cache has no page for position {int(pos[i])} of sequence "
                                    f"{int(seqs[i])}, which this step reads (its window: the {layout.window_tokens} "
                                    f"positions before its newest); the engine freed or never gave that page")
            reads = to_device(page, dev), to_device(row, dev)
        count = held_to - lo
        start = torch.cumsum(count, 0) - count

    # the groups the step's write completes (``_pack``)
    packs = None
    if any(batch.n):
        done = (sp0.boundary(end) > sp0.boundary(held_to)).nonzero().flatten()
        sinks = (held_to < layout.policy.sink) & (n > 0)  # sequences whose sinks this step writes
        if len(done) or bool(sinks.any()):  # (most decode steps: none, and the store would keep nothing it wrote)
            packs = (done, to_device(done, dev), sinks, batch.table.to(pages.device),
                     to_device(held_to.to(torch.int32), pages.device))
    plan = wbatch.plans[key] = _Window(batch, qs, held_to, n, lo, writes, wtable, reads, start, held, packs)
    return plan


def store_windowed(layout: PageLayout, pages: Tensor, window: Tensor, wblock: int, k: Tensor, v: Tensor,
                   batch: Ragged, wbatch: Ragged, ring: bool = False, null_page: int | None = None) -> Recent:
    """``store_ragged`` for a layout with a window: the tokens ``k, v [T, H, D]`` go in full precision into the
    window cache (``wbatch``'s pages; ``ring``: see above; positions on page ``null_page`` are not written, and
    reading one is an error), and every ``flush``-group they complete into the packed pages (``batch``'s) -- the
    bytes ``kvcompile.store.store_reference`` writes for those positions. Returns what ``attention_windowed`` reads
    for the same step (``Recent``). The step's indices are planned by its first layer (``_Window``)."""
    if not layout.window:
        raise ArgumentError("store_windowed takes a layout with window=True; use store_ragged")
    from .store import as_stored
    sp = layout.spec
    wk, wv = layout.window_views(window, wblock)
    dt, dev = wk.dtype, k.device
    plan = _window_plan(layout, pages, dev, wblock, batch, wbatch, ring, null_page)
    T = batch.starts[-1] if batch.starts else 0
    own_k = as_stored(k[:T].transpose(0, 1)[None], sp, dt, keys=True)[0].transpose(0, 1)  # [T, H, D]
    own_v = as_stored(v[:T].transpose(0, 1)[None], sp, dt)[0].transpose(0, 1)

    def write():  # the step's tokens into the window cache
        if plan.writes is not None:
            idx, page, row = plan.writes
            wk[page, :, row] = own_k.index_select(0, idx)
            wv[page, :, row] = own_v.index_select(0, idx)

    if plan.wtable is not None:  # a decode step: the rings come from the cache
        write()
        recent = Recent(None, None, plan.lo, None, 0, plan.held_to, plan.qs[:-1], (wk, wv, plan.wtable, wblock, ring))
        return _pack(layout, pages, batch, recent, plan, k, v, dt)
    # A sliding window's pages can be another request's in this very step (vLLM hands a prompt's pages to the
    # prefix cache as soon as they are scheduled): written first, then read. A ring is its request's alone, and
    # the step's tokens may overwrite slots it still reads: read first.
    if not ring:
        write()
    if plan.reads is not None:
        page, row = plan.reads
        held_k, held_v = wk[page, :, row], wv[page, :, row]
    else:
        held_k = held_v = own_k[:0]
    recent = Recent(torch.cat([held_k, own_k]), torch.cat([held_v, own_v]), plan.lo, plan.start, plan.held,
                    plan.held_to, plan.qs[:-1])
    if ring:
        write()
    return _pack(layout, pages, batch, recent, plan, k, v, dt)


def _in_cache(table: Tensor, null_page: int | None, lo: Tensor, end: Tensor, wblock: int, ring: bool) -> bool:
    """Whether, once a step's tokens are written, the window cache (its table: int64 CPU) holds every position
    ``[lo[i], end[i])`` of each sequence in it: a ring its newest ``wblock`` positions, a sliding window every
    page given."""
    live = end > lo
    if not bool(live.any()):
        return False
    if ring:
        return bool((lo >= end - wblock)[live].all())
    seqs, pos = _spans(lo, end)
    if len(pos) and int((pos // wblock).max()) >= table.shape[1]:
        return False
    return null_page is None or not bool((_locate(table, seqs, pos, wblock, ring)[0] == null_page).any())


def _pack(layout: PageLayout, pages: Tensor, batch: Ragged, recent: Recent, plan: _Window, k: Tensor, v: Tensor,
          dt) -> Recent:
    """The groups a step's write completes, packed now: a store of the same layout without the recent window packs
    every whole group at once (the bytes of a group depend on its tokens alone), its ring the pending group."""
    if plan.packs is None:
        return recent  # (most decode steps: no group completes, and the store would keep nothing it wrote)
    sp0 = layout.packing_spec
    done, at, sinks, table, lengths = plan.packs
    held_to = plan.held_to
    # the pending group's positions, for the sequences whose write completes a group (the others pack nothing, and
    # what the store writes into their rings is not kept: the window cache holds their positions)
    some, sv = _ring(layout, recent, done, sp0.boundary(held_to)[done], held_to[done], sp0.ring, dt)
    rk = some.new_zeros(len(held_to), *some.shape[1:])
    rv = torch.zeros_like(rk)
    if len(done):
        rk[at], rv[at] = some, sv
    st = layout.state(pages, lengths.clone(), table)._replace(k_res=rk, v_res=rv)  # (the store advances them)
    ops.backend(pages.device).store(st, sp0, batch.padded(k), batch.padded(v), plan.n.to(torch.int32))
    layout._put_sinks(pages, st, table, sinks)
    return recent


def _ring(layout: PageLayout, recent: Recent, seq: Tensor, lo: Tensor, hi: Tensor, width: int, dtype,
          memo: dict | None = None):
    """Rings ``[len(seq), H, width, D]`` (slot ``p % width``, as the store's) holding positions ``[lo[r], hi[r])`` of
    sequence ``seq[r]`` from ``recent`` (from the window cache itself: the slots before ``lo[r]`` then hold older
    positions, or whatever the cache holds there -- never read). ``memo``: where the layers of a step keep the
    window cache's indices of these rings (made by the first: ``_Call.memo``)."""
    H, D = layout.heads, layout.head_dim
    if recent.cache is not None:
        wk, wv, wtable, wblock, ring = recent.cache
        dev = wk.device
        if not width:
            return (torch.zeros(len(seq), H, 0, D, dtype=dtype, device=dev),) * 2
        got = memo.get("ring") if memo is not None else None
        if got is None or got[0] is not wtable or got[1] != (wblock, ring, width):
            got = (wtable, (wblock, ring, width), _ring_index(seq, hi, wtable, wblock, ring, width))
            if memo is not None:
                memo["ring"] = got
        page, at = got[2]
        if at is None:  # the cache's ring is the kernels' (slot p % width): copied as it lies
            return wk.index_select(0, page), wv.index_select(0, page)
        return (wk.transpose(1, 2)[page, at].transpose(1, 2).contiguous(),
                wv.transpose(1, 2)[page, at].transpose(1, 2).contiguous())
    dev = recent.k.device
    rk = torch.zeros(len(seq), H, width, D, dtype=dtype, device=dev)
    rv = torch.zeros_like(rk)
    span, pos, row = recent.rows(seq, lo, hi)
    if width and len(pos):
        r, slot, idx = to_device(span, dev), to_device(pos % width, dev), to_device(row, dev)
        rk[r, :, slot] = recent.k.index_select(0, idx)
        rv[r, :, slot] = recent.v.index_select(0, idx)
    return rk, rv


def _ring_index(seq: Tensor, hi: Tensor, wtable: Tensor, wblock: int, ring: bool, width: int):
    """Where rings of ``width`` slots ending before ``hi[r]`` of sequences ``seq`` (int64 CPU) lie in the window
    cache whose table ``wtable`` is on its device: ``(page, None)`` where the cache's ring is the kernels' (one page
    a row), else ``(page, row)`` ``[rows, width]`` of every slot, on the table's device."""
    dev = wtable.device
    if ring and wblock == width:
        return wtable[to_device(seq, dev), 0], None
    start = (hi - width).unsqueeze(1)
    pos = (start + (torch.arange(width) - start) % width).clamp_min(0)  # [rows, width]: slot j's position
    page = wtable[to_device(seq.unsqueeze(1), dev), 0 if ring else to_device(pos // wblock, dev)]
    return page, to_device(pos % wblock, dev)


def attention_windowed(layout: PageLayout, pages: Tensor, q: Tensor, batch: Ragged, recent: Recent,
                       scale: float | None = None, out: Tensor | None = None, window: int | None = None) -> Tensor:
    """``attention_ragged`` for a layout with a window, after ``store_windowed`` (its ``recent``): each query at
    position ``p`` attends to positions ``< Q(p + 1)`` packed and the rest in full precision -- the store as it stood
    when ``p`` was its newest token -- as one decode row of its own (``attention_ragged``'s rule), with a ring of
    its own holding its full-precision positions.

    ``window``: a sliding-window layer's (``attention_ragged``'s): each query reads only its last ``window``
    positions, never a page wholly before them. It must be longer than ``layout.window_tokens``: the positions
    ``store_windowed`` packs in a step are then inside the window of the step's first query, so it never writes a
    page the engine freed (with sinks a page's packed positions lag its own, so it is freed later still, and the
    sinks' page only once they have left every window)."""
    if not layout.window:
        raise ArgumentError("attention_windowed takes a layout with window=True; use attention_ragged")
    if _sliding(window) and not packs_sliding_window(layout.policy, window):
        raise ArgumentError(f"a sliding window of {window} positions over {layout.policy}: it must be longer than the "
                            f"{layout.window_tokens} full-precision positions the window cache keeps")
    T, Hq, D = q.shape
    if out is None:
        out = q.new_zeros(T, Hq, D)
    return _each_query(layout, pages, q, batch, scale, out, recent, window)
