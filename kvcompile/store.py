"""The quantized KV store of one layer: its paged layout, the block manager, and the reference append /
crop / read / attention. This module is the specification every kernel follows bit for bit.

Position ``p`` of sequence ``b`` lives in exactly one place, decided by that sequence's length ``L`` alone
(so appending the same tokens in any chunking gives the same bytes)::

    p < S                          sink        full precision   k_sink[b, :, p]
    S <= p < Q(L)                  packed      codes, paged     block table[b, j // BS], row j % BS, j = p - S
    Q(L) <= p < L                  residual    full precision   k_res[b, :, p % W]   (a ring)

    Q(L) = S + floor(max(0, L - S - R) / F) * F        R = policy.residual, F = policy.flush
    W    = R + F - 1                                   (the most tokens the residual can hold)

``F`` is the per-channel group size (1 if nothing is quantized per channel): a per-channel scale covers F
tokens, so tokens enter packed storage only in whole groups (KIVI). The ring never needs data movement:
each append first flushes ``[Q(L), Q(L'))`` into codes, then writes the newcomers at ``p % W``.

**Pages.** Packed tokens live in a pool of blocks of ``BS`` tokens (``LayerSpec.block``: 64, or the group
size ``F`` if larger, so a per-channel group never straddles two blocks), shared by every sequence of the
store. Each sequence's block table lists the blocks of its packed tokens in order. A block holds, per kv
head, ``BS`` packed rows and their scales and zero points: ``[BS, D/g]`` per token (axis="token") or
``[BS/F, D]`` per channel group (axis="channel"). The sinks, the ring and the lengths are per sequence. So
a sequence holds what it has written (its blocks, rounded up to a whole block), sequences of a batch need
not have the same length, and forking or reordering sequences moves block ids, not blocks.

``KVStore`` manages one layer's pool on the host: it reserves the blocks an append will write before the
kernel runs (growing the pool when it is full), shares blocks between sequences forked from one another
(``select``: beam search, parallel sampling), copies a shared block before anything writes into it, and
crops (``crop``: speculative and assisted decoding). Kernels see only the ``KVState`` tensors.

Rotation (``policy.rotate``) multiplies keys, values and queries by an orthonormal Hadamard matrix before
anything else (``rotate``); everything in the store is in rotated space, and attention un-rotates its
output. Rotation runs in torch (not in the kernels), so kernel and reference see identical inputs. With
``policy.pre_rope`` only values are rotated (``Policy.rotates_keys``): keys stay in model space.

**Pre-RoPE keys** (``policy.pre_rope``, KVQuant). The store then holds keys as the layer computed them before
its rotary embedding, when the FX pass found that embedding on the key write (``KVStore.rope_keys``; else the
keys written, post-RoPE). Attention rotates each key, after dequantization, by its position:
``key' = key * cos[r] + key[..., perm] * sin[r]`` (``apply_rope``), ``r = p + offset[b]`` the rotary
position of index ``p`` of sequence ``b`` (clamped to the table: a left-padded row's pads, ``r < 0``, are
never visible). ``cos``/``sin`` are what the model computed for each position, captured at write time
(``RopeTable``, shared by a cache's layers); ``sin`` carries the sign of the rotate-half (or pair) formula
and ``perm`` names each channel's partner, so one formula serves every recognised form.

**Finite in, finite out; NaN where it belongs.** Every conversion to a narrower dtype on the way in and out
(the chunk to the model dtype, the rotation's result, a crop's dequantized values, ``dequantize_reference``
to ``dtype``, attention's output) saturates a finite value to the dtype's largest (``quant.saturate``), and
packed groups saturate their scales (``quant``, "Saturation"): a finite input never becomes inf or NaN in
the store or in what it reads back. A NaN or inf input is kept where the store keeps full precision (sinks,
ring, format "none"), makes its whole group NaN in packed storage (``quant``: a token's channel group, or
for per-channel keys one channel of ``group`` tokens), and attention makes exactly the outputs NaN that see
it (``attention_reference``); with rotation an element first spreads to its token's whole head (the
Hadamard mixes channels).
"""
from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from . import quant as Q
from .errors import ArgumentError, CapacityError, IndexOutOfRange, KeyNotFound, RopeError, UnsupportedError
from .policy import Policy, PolicyError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
BLOCK_TOKENS = 64  # packed tokens per block, unless the policy's flush group is larger (then one group)
ROW_TOKENS = 64  # a store's rings and sinks grow in steps of this many positions (``LayerSpec.row_widths``)


def normal_tensors(fn):
    """``fn`` run outside ``torch.inference_mode``: the tensors it makes for a cache are ordinary ones. A cache
    made inside inference mode (a ``generate`` under ``with torch.inference_mode():``) is written in place by
    every later call, and an inference tensor may not be written in place outside inference mode, so a chat
    continued in that cache under ``torch.no_grad()`` would fail. Ordinary tensors may be written in both. For
    functions that make tensors only: a write in place into a tensor made inside inference mode must stay in it."""
    return torch.inference_mode(False)(fn)




class KVState(NamedTuple):
    """The tensors of one layer's store, in the order every kernel takes them.

    k_codes:  uint8 [NB, H, BS, D*bits/8] the pool of packed blocks (model dtype [NB, H, BS, D] for "none")
    k_scale:  scale dtype [NB, H, BS, D/g] (axis="token") or [NB, H, BS/g, D] (axis="channel"); empty if none
              (or axis="tensor": its scale is fixed)
    k_zero:   same shape as k_scale for asymmetric integers (int8 with fp8 scales), else empty
    v_*:      the same for values
    k_res:    model dtype [B, H, W, D] full-precision ring of the most recent tokens (slot p % W)
    v_res:    same
    k_sink:   model dtype [B, H, S, D] the first S tokens
    v_sink:   same
    lengths:  int32 [B] tokens held per sequence
    table:    int32 [B, MB] block ids of each sequence's packed tokens, in order; -1 where none is reserved
    """

    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    k_res: Tensor
    v_res: Tensor
    k_sink: Tensor
    v_sink: Tensor
    lengths: Tensor
    table: Tensor


POOL_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
ROW_FIELDS = ("k_res", "v_res", "k_sink", "v_sink", "lengths", "table")


class SavedRow(NamedTuple):
    """One sequence of a store, copied out (``KVStore.save``): its blocks' contents in table order (one tensor
    per pool field), its ring and sinks (``k_res, v_res, k_sink, v_sink``), its length and rotary offset."""

    pool: tuple
    row: tuple
    length: int
    rope_offset: int

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.pool) + state_nbytes(self.row)


@dataclass(frozen=True)
class LayerSpec:
    """Everything that fixes a store's layout; its ``name`` keys compiled kernels and op calls.

    The layout does not depend on the batch or on how many tokens the store holds: one compiled kernel
    serves every batch size and length.
    """

    policy: Policy
    heads: int
    head_dim: int
    dtype: str = "float32"
    block_tokens: int | None = None  # packed tokens per block; None: BLOCK_TOKENS, or the flush group if larger

    def __post_init__(self):
        if not isinstance(self.policy, Policy):
            raise PolicyError(f"LayerSpec.policy={self.policy!r} is not valid: expected a kvcompile.Policy")
        if self.policy.overrides:
            raise PolicyError("LayerSpec needs a resolved per-layer policy (call policy.resolve first)")
        if self.dtype not in DTYPES:
            raise PolicyError(f"dtype={self.dtype!r} is not supported: expected one of {sorted(DTYPES)}")
        for f in ("heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PolicyError(f"LayerSpec.{f}={v!r} is not valid: expected a positive integer")
        self.policy.check(self.head_dim)
        # groups that fit the head (Quant.fit) resolved: the layout, its name and its kernels are this head size's
        object.__setattr__(self, "policy", self.policy.for_head_dim(self.head_dim))
        bt = self.block_tokens
        if bt is not None and (not isinstance(bt, int) or isinstance(bt, bool) or bt < 16 or bt & (bt - 1)
                               or bt % self.flush):
            raise PolicyError(f"LayerSpec.block_tokens={bt!r} is not valid: expected a power of two >= 16 and a "
                              f"multiple of the policy's flush group ({self.flush}), or None")

    # ---- geometry
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def sink(self) -> int:
        return self.policy.sink

    @property
    def flush(self) -> int:
        return self.policy.flush

    @property
    def ring(self) -> int:
        return self.policy.ring

    @property
    def block(self) -> int:
        """Packed tokens per block (a power of two >= 16, a multiple of the flush group)."""
        return self.block_tokens or max(BLOCK_TOKENS, self.flush)

    def boundary(self, L: int) -> int:
        """Q(L): tokens at positions [sink, Q(L)) are in packed storage once the sequence holds L tokens."""
        return self.policy.boundary(L)

    def blocks_for(self, L):
        """Blocks a sequence of ``L`` tokens holds (an int, or an integer tensor: each's)."""
        return -(-(self.boundary(L) - self.sink) // self.block)

    @property
    def name(self) -> str:
        return f"{self.policy.key_str()};H={self.heads};D={self.head_dim};dt={self.dtype};BS={self.block}"

    @staticmethod
    def from_name(name: str) -> "LayerSpec":
        """The spec registered under ``name`` (ops receive the spec as this string)."""
        try:
            return _SPECS[name]
        except KeyError:
            raise KeyNotFound(f"no kvcompile store layout named {name!r} was created in this process") from None

    def register(self) -> str:
        _SPECS[self.name] = self
        return self.name

    # ---- allocation
    def _block_shapes(self, which: str):
        """Per block, in ``POOL_FIELDS`` order for keys or values: (shape, dtype) of the codes, the scales and the
        zero points; shape None where the tensor is empty."""
        q = self.policy.key if which == "k" else self.policy.value
        H, D, BS = self.heads, self.head_dim, self.block
        sdt, zdt = Q.SCALE_TORCH_DTYPE[q.scale_dtype], Q.zero_dtype(q)
        if not q.quantized:
            return [((H, BS, D), self.torch_dtype), (None, sdt), (None, zdt)]
        ss = (H, *Q.scale_shape(q, BS, D)) if q.stores_scale else None  # axis="tensor": no scale is stored
        return [((H, BS, Q.packed_bytes(D, q.bits)), torch.uint8), (ss, sdt), (ss if q.has_zero else None, zdt)]

    @normal_tensors
    def pool(self, blocks: int, device="cpu") -> list[Tensor]:
        """Zero-filled pool tensors of ``blocks`` blocks, in ``POOL_FIELDS`` order."""
        return [torch.zeros((blocks, *shape) if shape else (0,), dtype=dt, device=device)
                for which in ("k", "v") for shape, dt in self._block_shapes(which)]

    def row_widths(self, tokens: int | None = None) -> tuple[int, int]:
        """``(ring slots, sink rows)`` a store allocates per (sequence, head) while its sequences hold at most
        ``tokens`` tokens (None: the whole window and sinks): both grow in steps of ``ROW_TOKENS`` positions up
        to the policy's ``ring`` and ``sink``, so a 24-token sequence under 100,000 sinks holds 64 sink rows, not
        100,000. Enough: while ``L <= ring`` every position ``p < L`` has slot ``p % ring = p``. The one place
        this rule is written; ``KVStore`` allocates by it and ``nbytes`` counts by it."""
        if tokens is None:
            return self.ring, self.sink
        step = -(-max(tokens, 0) // ROW_TOKENS) * ROW_TOKENS
        return min(self.ring, step), min(self.sink, step)

    @normal_tensors
    def rows(self, batch: int, table_width: int = 0, device="cpu", tokens: int | None = None) -> list[Tensor]:
        """Zero-filled per-sequence tensors (ring, sinks, lengths; the table filled with -1), ``ROW_FIELDS``;
        the ring and sinks as wide as sequences of ``tokens`` tokens need (``row_widths``; None: all of them)."""
        H, D, dt = self.heads, self.head_dim, self.torch_dtype
        ring, sink = self.row_widths(tokens)
        return [torch.zeros(batch, H, ring, D, dtype=dt, device=device),
                torch.zeros(batch, H, ring, D, dtype=dt, device=device),
                torch.zeros(batch, H, sink, D, dtype=dt, device=device),
                torch.zeros(batch, H, sink, D, dtype=dt, device=device),
                torch.zeros(batch, dtype=torch.int32, device=device),
                torch.full((batch, table_width), -1, dtype=torch.int32, device=device)]

    def allocate(self, batch: int, capacity: int, device="cpu") -> KVState:
        """A zero-filled store of ``batch`` sequences with blocks for ``capacity`` tokens each, reserved in
        order (sequence ``b`` owns blocks ``b*MB .. (b+1)*MB - 1``). For kernels and tests that want a plain
        state; a cache that grows, forks and crops is a ``KVStore``."""
        mb = self.blocks_for(capacity)
        rows = self.rows(batch, mb, device)
        rows[-1].copy_(torch.arange(batch * mb, dtype=torch.int32).view(batch, mb))
        return KVState(*self.pool(batch * mb, device), *rows)

    def block_nbytes(self) -> int:
        """Bytes of one block: packed codes, scales and zero points of keys and values, every kv head."""
        return sum(math.prod(shape) * _esize(dt) for which in ("k", "v") for shape, dt in self._block_shapes(which)
                   if shape)

    def position_nbytes(self) -> int:
        """Bytes of one position of a sequence's ring or sinks: its key and value, every kv head, model dtype."""
        return 2 * self.heads * self.head_dim * _esize(self.torch_dtype)

    def row_nbytes(self, tokens: int | None = None) -> int:
        """Bytes each sequence holds besides its blocks: ring and sinks of keys and values (as wide as
        ``row_widths(tokens)``: None, the whole window and sinks), its length."""
        return sum(self.row_widths(tokens)) * self.position_nbytes() + 4

    def exact_nbytes(self, batch: int, tokens: int) -> int:
        """The bytes ``batch`` sequences of ``tokens`` tokens need, counted token by token (no whole blocks, no
        table, window and sinks only as far as the tokens reach): what a store holding them cannot go below.
        ``nbytes`` is at most one block (and its table entry) more per sequence, and ``ROW_TOKENS - 1`` more
        positions each of its window and its sinks (they grow in steps: ``row_widths``)."""
        packed = self.boundary(tokens) - self.sink
        rows = (min(self.ring, tokens) + min(self.sink, tokens)) * self.position_nbytes()
        return batch * (rows + 4 + packed * self.block_nbytes() // self.block)

    def nbytes(self, batch: int, tokens: int) -> int:
        """Exact bytes a store of ``batch`` sequences of ``tokens`` tokens each holds (``KVStore.nbytes``):
        per sequence, its fixed part (``row_nbytes(tokens)``), its blocks, and one table entry (int32) per
        block."""
        return batch * (self.row_nbytes(tokens) + self.blocks_for(tokens) * (self.block_nbytes() + 4))


def _esize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


_SPECS: dict[str, LayerSpec] = {}


def state_nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state)


# --------------------------------------------------------------------------- pre-RoPE keys
class Rope(NamedTuple):
    """What attention needs to rotate pre-RoPE keys (``apply_rope``), in the order kernels take it.

    cos:    fp32 [T, D] per rotary position, as the model computed it (1 past the rotary dims)
    sin:    fp32 [T, D] signed for the form: ``key' = key * cos[r] + key[..., perm] * sin[r]`` (0 past them)
    perm:   int32 [D] the channel each channel is paired with
    offset: int32 [B] rotary position minus cache index, per sequence (left padding: minus the pads)
    """

    cos: Tensor
    sin: Tensor
    perm: Tensor
    offset: Tensor


ROPE_FORMS = ("half", "pairs")  # rotate_half (transformers), adjacent pairs (gpt-fast's complex multiply)


def rope_pairing(form: str, rotary_dim: int, D: int) -> tuple[list[int], list[float]]:
    """Each channel's partner and the sign its partner's sine takes, for ``form`` over the first
    ``rotary_dim`` channels (the rest pass through: partner itself, sine 0).

    "half": ``cat(-x2, x1)`` over halves of the rotary dims (transformers' ``rotate_half``);
    "pairs": ``(x0, x1) -> (x0 c - x1 s, x1 c + x0 s)`` over adjacent pairs (gpt-fast)."""
    if form not in ROPE_FORMS or not (0 < rotary_dim <= D) or rotary_dim % 2:
        raise ArgumentError(f"rope form {form!r} over {rotary_dim} of {D} channels is not valid: expected one of "
                         f"{ROPE_FORMS} over an even number of channels <= {D}")
    perm, sign = list(range(D)), [0.0] * D
    h = rotary_dim // 2
    for d in range(rotary_dim):
        if form == "half":
            perm[d], sign[d] = (d + h, -1.0) if d < h else (d - h, 1.0)
        else:
            perm[d], sign[d] = (d ^ 1, -1.0 if d % 2 == 0 else 1.0)
    return perm, sign


def check_rope_tables(cos: Tensor, sin: Tensor, perm: Tensor, offset: Tensor, B: int, D: int,
                      partners: bool = True) -> None:
    """A ``ValueError`` unless the kernels' pre-RoPE tables are cos, sin ``[T, D]`` (T > 0), perm ``[D]`` and
    offsets ``[B]`` (``Rope``), and, with ``partners``, every partner channel lies in the head (a read of the
    partners: callers on a GPU, or that checked these partners before, pass False)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or perm.shape != (D,) or offset.shape != (B,):
        raise ArgumentError(f"rope tables must be cos, sin [T, {D}], perm [{D}] and offsets [{B}]; got "
                         f"{list(cos.shape)}, {list(sin.shape)}, {list(perm.shape)}, {list(offset.shape)}")
    if cos.shape[0] == 0:
        raise ArgumentError("rope tables: the cos/sin table is empty (no rotary position was captured)")
    if partners and not bool(((perm >= 0) & (perm < D)).all()):
        raise ArgumentError(f"rope tables: a partner channel outside the head [0, {D}): {perm.tolist()}")


def apply_rope(k: Tensor, rope: Rope, positions: Tensor) -> Tensor:
    """Keys ``k [B, H, P, D]`` (fp32, pre-RoPE) at cache indices ``positions [B, P]`` (or ``[P]``) rotated:
    ``k * cos[r] + k[..., perm] * sin[r]``, ``r = positions + offset[b]`` clamped to the table. The one
    statement of the formula; every kernel computes these products and this sum in fp32, in this order."""
    B = k.shape[0]
    T = rope.cos.shape[0]
    pos = positions.to(k.device).long()
    if pos.dim() == 1:
        pos = pos.view(1, -1)
    r = (pos + rope.offset.to(k.device).long().view(-1, 1)).clamp(0, max(T - 1, 0))  # [B, P]
    r = r.expand(B, r.shape[-1])
    c = rope.cos.to(k.device)[r].unsqueeze(1)  # [B, 1, P, D]
    s_ = rope.sin.to(k.device)[r].unsqueeze(1)
    return k * c + k[..., rope.perm.to(k.device).long()] * s_




class RopeTable:
    """The rotary embedding's cos and sin per rotary position, as the model computed them: captured from each
    write of pre-RoPE keys (``capture``) and read by attention for every stored key. Shared by the layers of
    a cache (one row per position, whatever the batch); grows by doubling."""

    @normal_tensors
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.form: tuple | None = None  # (form, rotary_dim, D)
        self.cos = torch.empty(0, 0)
        self.sin = torch.empty(0, 0)
        self.filled = torch.zeros(0, dtype=torch.bool)
        self.perm: Tensor | None = None
        self.sign: Tensor | None = None

    @normal_tensors
    def _setup(self, form: str, rotary_dim: int, D: int) -> None:
        key = (form, rotary_dim, D)
        if self.form is None:
            perm, sign = rope_pairing(form, rotary_dim, D)
            self.form = key
            self.perm = torch.tensor(perm, dtype=torch.int32, device=self.device)
            self.sign = torch.tensor(sign, dtype=torch.float32, device=self.device)
            self.cos = torch.ones(0, D, device=self.device)
            self.sin = torch.zeros(0, D, device=self.device)
        elif self.form != key:
            raise RopeError(f"one cache's layers apply different rotary embeddings ({self.form} and {key}); pre-RoPE "
                            f"keys need one form per cache. Use a policy without pre_rope for this model.")

    @property
    def nbytes(self) -> int:
        """Bytes the table holds for the positions captured so far (cos and sin rows, fp32, and their flag)."""
        rows = int(self.filled.sum()) if self.filled.numel() else 0
        return rows * (self.cos.shape[1] * 2 * self.cos.element_size() + 1) if self.cos.dim() == 2 else 0

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated (the table grows by doubling)."""
        return sum(t.numel() * t.element_size() for t in (self.cos, self.sin, self.filled))

    @normal_tensors
    def _grow(self, T: int) -> None:
        old = self.cos.shape[0]
        if T <= old:
            return
        new = max(T, 2 * old, 64)
        D = self.cos.shape[1]
        cos = torch.ones(new, D, device=self.device)
        sin = torch.zeros(new, D, device=self.device)
        filled = torch.zeros(new, dtype=torch.bool, device=self.device)
        cos[:old], sin[:old], filled[:old] = self.cos, self.sin, self.filled
        self.cos, self.sin, self.filled = cos, sin, filled

    def capture(self, cos: Tensor, sin: Tensor, form: str, r: Tensor, valid: Tensor, D: int) -> None:
        """Record ``cos, sin`` (broadcastable to ``[B, n, rotary_dim]``; "pairs": ``[..., n, rotary_dim/2]``)
        for the rotary positions ``r [B, n]`` where ``valid``. A position captured before must get the same
        values (else ``RopeError``: the positions are not what the store assumes, or the embedding changed)."""
        rd = cos.shape[-1] * (2 if form == "pairs" else 1)
        self._setup(form, rd, D)
        self._grow(1)  # never empty (a write of pads only captures nothing; their keys are never visible)
        B, n = r.shape
        c, s = cos.float(), sin.float()
        if form == "pairs":
            c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        c = c.reshape(-1, *c.shape[-2:]).expand(B, n, rd) if c.dim() >= 2 else c.expand(B, n, rd)
        s = s.reshape(-1, *s.shape[-2:]).expand(B, n, rd) if s.dim() >= 2 else s.expand(B, n, rd)
        if not bool(valid.any()):
            return
        rv = r[valid].to(self.device)
        cv = c.to(self.device)[valid.to(c.device)]
        sv = s.to(self.device)[valid.to(s.device)] * self.sign[:rd]
        self._grow(int(rv.max()) + 1)
        old = self.filled[rv]
        if bool(old.any()):
            ro = rv[old]
            same = torch.equal(self.cos[ro, :rd], cv[old]) and torch.equal(self.sin[ro, :rd], sv[old])
            if not same:
                raise RopeError(
                    "pre-RoPE keys: the rotary embedding's cos/sin for a position differ from those captured for it "
                    "earlier, so the model's positions are not the cache index plus a per-sequence offset (left "
                    "padding outside kvcompile.apply's forward, or position_ids that jump), or its rotary embedding "
                    "depends on the sequence length (dynamic NTK scaling). Use a policy without pre_rope here.")
        self.cos[rv, :rd] = cv
        self.sin[rv, :rd] = sv
        if not (torch.equal(self.cos[rv, :rd], cv) and torch.equal(self.sin[rv, :rd], sv)):
            raise RopeError("pre-RoPE keys: two sequences of one write give one rotary position different cos/sin "
                            "(position_ids that are not the cache index plus a per-sequence offset). Use a policy "
                            "without pre_rope here.")
        self.filled[rv] = True


# --------------------------------------------------------------------------- the block manager
class KVStore:
    """One layer's paged store and its host-side block manager.

    >>> st = KVStore(spec, batch=2)
    >>> st.append(k, v)            # reserves the blocks it writes, then stores (reference, or ``kernel``)
    >>> st.select([0, 0, 1, 1])    # fork: four sequences, blocks shared until written
    >>> st.crop(100)               # every sequence keeps its first 100 tokens (see ``crop``)

    max_tokens: the most tokens a sequence may hold (``CapacityError`` beyond; None: no limit).
    max_blocks: the most blocks the pool may hold (``CapacityError`` when an append needs more; None: the
                pool grows, doubling, as long as memory lasts).
    whole_rows: allocate every sequence's full-precision window and sinks now (a serving pool, whose budget pays
                for them up front); by default they grow as the sequences reach them (``LayerSpec.row_widths``).
    The state (``.state``) is replaced when the pool or the rows grow: read it at each use, never keep it.
    """

    def __init__(self, spec: LayerSpec, batch: int, device="cpu", max_tokens: int | None = None,
                 max_blocks: int | None = None, blocks: int = 0, table_width: int = 0, whole_rows: bool = False):
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ArgumentError(f"KVStore batch={batch!r} is not valid: expected a positive integer")
        self.spec, self.device = spec, torch.device(device)
        self.max_tokens, self.max_blocks = max_tokens, max_blocks
        blocks = min(blocks, max_blocks) if max_blocks is not None else blocks
        # the rings and sinks grow with the sequences (``_grow_rows``); ``whole_rows``: allocated whole now (a
        # serving pool, whose budget pays for every slot's window and sinks up front)
        self.state = KVState(*spec.pool(blocks, self.device),
                             *spec.rows(batch, table_width, self.device, tokens=None if whole_rows else 0))
        self.refs = [0] * blocks
        self.free = list(range(blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self.lengths = [0] * batch                   # host mirror of state.lengths
        self.tables: list[list[int]] = [[] for _ in range(batch)]  # host mirror of state.table
        # pre-RoPE keys (policy.pre_rope): whether the keys written are pre-RoPE (None until the first write
        # says), the cos/sin per rotary position (shared by a cache's layers), and each sequence's offset
        self.rope_keys: bool | None = None
        self.rope_table: RopeTable | None = None
        self.rope_offset: list[int] = [0] * batch
        self._rope_offset_t: Tensor | None = None
        # blocks owned by a serving engine (``engine_owns_blocks``): rows get their tables from ``set_tables``
        self.engine_blocks = False

    # ---- sizes
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def blocks(self) -> int:
        """Blocks in the pool (used or free)."""
        return len(self.refs)

    @property
    def used_blocks(self) -> int:
        if self.engine_blocks:
            return len({blk for t in self.tables for blk in t})
        return len(self.refs) - len(self.free)

    @property
    def nbytes(self) -> int:
        """Bytes the sequences hold: their blocks (a shared block counted once), rings and sinks (as far as they
        have grown), lengths and table entries. Within one block per sequence of ``LayerSpec.nbytes`` for their
        lengths."""
        sp = self.spec
        return (state_nbytes(self.state[6:11]) + self.used_blocks * sp.block_nbytes()
                + 4 * sum(len(t) for t in self.tables))

    # ---- rows
    def _grow_rows(self, tokens: int) -> None:
        """Widen the rings and sinks for sequences of up to ``tokens`` tokens (``LayerSpec.row_widths``): new
        tensors, what the old ones held copied in (a few times per sequence: once per ``ROW_TOKENS`` tokens, up to
        the window and the sinks)."""
        ring, sink = self.spec.row_widths(tokens)
        st = self.state
        if ring <= st.k_res.shape[2] and sink <= st.k_sink.shape[2]:
            return
        ring, sink = max(ring, st.k_res.shape[2]), max(sink, st.k_sink.shape[2])
        with torch.inference_mode(False):  # (``normal_tensors``)
            rows = []
            for t, w in zip(st[6:10], (ring, ring, sink, sink)):
                if t.shape[2] == w:
                    rows.append(t)
                    continue
                new = t.new_zeros(t.shape[0], t.shape[1], w, t.shape[3])
                new[:, :, :t.shape[2]] = t
                rows.append(new)
        self.state = KVState(*st[:6], *rows, *st[10:])

    @property
    def reserved_nbytes(self) -> int:
        """Bytes allocated: the whole pool (free blocks included) and every per-sequence tensor."""
        return state_nbytes(self.state)

    # ---- blocks
    def _grow(self, need: int, exact: bool = False) -> None:
        """Make at least ``need`` free blocks: the pool doubles (or grows to what is needed; ``exact``: to just
        what is needed)."""
        if len(self.free) >= need:
            return
        old = self.blocks
        want = old + need - len(self.free)
        new = want if exact else max(want, 2 * old)
        if self.max_blocks is not None:
            if want > self.max_blocks:
                raise CapacityError(
                    f"KV cache out of blocks: an append needs {need} free blocks of {self.spec.block} tokens, "
                    f"{len(self.free)} are free and the pool is limited to {self.max_blocks} blocks "
                    f"({self.max_blocks * self.spec.block_nbytes()} bytes). Give the cache a larger budget, or "
                    f"free sequences.")
            new = min(new, self.max_blocks)
        pool = self.spec.pool(new, self.device)
        for dst, src in zip(pool, self.state[:6]):
            if src.numel():
                dst[:old].copy_(src)
        self.state = KVState(*pool, *self.state[6:])
        self.refs += [0] * (new - old)
        self.free = list(range(new - 1, old - 1, -1)) + self.free

    def _take(self) -> int:
        if self.engine_blocks:
            raise CapacityError(
                "KVStore: an append needs a block its sequence's table does not have, and this store's blocks are "
                "handed out by the serving engine (set_tables): the engine allocated fewer pages than the tokens "
                "it scheduled")
        blk = self.free.pop()
        self.refs[blk] = 1
        return blk

    def _share(self, blocks: Sequence[int]) -> None:
        """One more sequence holds each of ``blocks`` (a fork, a reorder); an engine that owns them counts."""
        if self.engine_blocks:
            return
        for blk in blocks:
            self.refs[blk] += 1

    def _release(self, blk: int) -> None:
        if self.engine_blocks:
            return
        self.refs[blk] -= 1
        if self.refs[blk] == 0:
            self.free.append(blk)

    def _sync_rows(self, rows: Sequence[int] | None = None) -> None:
        """Write the host tables (and lengths) into ``state.table``/``state.lengths``."""
        width = max((len(t) for t in self.tables), default=0)
        table = self.state.table
        if table.shape[1] < width:
            with torch.inference_mode(False):  # (``normal_tensors``)
                table = torch.full((self.batch, max(width, 2 * table.shape[1])), -1, dtype=torch.int32,
                                   device=self.device)
            rows = None
        host = torch.full((self.batch if rows is None else len(rows), table.shape[1]), -1, dtype=torch.int32)
        for i, b in enumerate(range(self.batch) if rows is None else rows):
            host[i, :len(self.tables[b])] = torch.tensor(self.tables[b], dtype=torch.int32)
        if rows is None:
            table.copy_(host)
        else:
            table[list(rows)] = host.to(self.device)
        if table is not self.state.table:
            self.state = self.state._replace(table=table)

    # ---- blocks owned by a serving engine
    def engine_owns_blocks(self) -> None:
        """From now on a serving engine (transformers' continuous batching) owns the pool's blocks: it hands
        them to sequences (``set_tables``), shares a complete block between sequences (forks, a common prompt
        prefix) and frees it; the store never takes, copies on write or frees a block. Only a block with no
        sequence writing into it may be shared (a complete block, whose tokens are all packed)."""
        if self.used_blocks:
            raise UnsupportedError("KVStore.engine_owns_blocks: the store already holds blocks")
        self.engine_blocks = True

    def set_tables(self, tables: dict[int, list[int]]) -> None:
        """Sequence ``b``'s blocks become ``tables[b]`` (pool block ids, in order; ``engine_owns_blocks``)."""
        if not self.engine_blocks:
            raise UnsupportedError("KVStore.set_tables: the store owns its blocks (see engine_owns_blocks)")
        changed = [b for b, t in tables.items() if self.tables[b] != t]
        for b in changed:
            blocks = list(tables[b])
            if blocks and not (0 <= min(blocks) and max(blocks) < self.blocks):
                raise IndexOutOfRange(f"KVStore.set_tables: blocks {blocks} outside the pool's {self.blocks}")
            self.tables[b] = blocks
        if changed:
            self._sync_rows(changed)

    def set_length(self, b: int, length: int) -> None:
        """Sequence ``b`` holds ``length`` tokens, all in the blocks its table already has (an engine that gave
        it a shared prefix of whole blocks): only for layouts that keep nothing outside the blocks (no ring,
        no sinks)."""
        sp = self.spec
        if sp.ring or sp.sink:
            raise UnsupportedError(f"KVStore.set_length: {sp.policy} keeps tokens outside the blocks (ring, sinks)")
        if sp.blocks_for(length) > len(self.tables[b]) or self.lengths[b]:
            raise UnsupportedError(f"KVStore.set_length({b}, {length}): the sequence holds {self.lengths[b]} tokens "
                               f"in {len(self.tables[b])} blocks")
        self.lengths[b] = length
        self.state.lengths[b] = length

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block ``dst[i]`` becomes a copy of block ``src[i]`` (copy on write; an engine forking a sequence copies
        the blocks it does not share)."""
        if len(src) != len(dst):
            raise ArgumentError(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        if not src:
            return
        s = torch.tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        for t in self.state[:6]:
            if t.numel():
                t.index_copy_(0, d, t.index_select(0, s))

    def expect(self, tokens: int) -> None:
        """Size the pool, once, for every sequence to reach ``tokens`` tokens (at most ``max_tokens``) without
        growing again: a caller that knows how far its sequences go (``generate``: its ``max_length``) avoids
        the pool's doublings, each a copy of the pool beside the old one, while it decodes. The blocks stay
        free until written: ``nbytes`` counts what the sequences hold, ``reserved_nbytes`` the allocation.
        A store limited to ``max_blocks`` takes no more than that."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ArgumentError(f"KVStore.expect tokens={tokens!r} is not valid: expected a whole number of tokens >= 0")
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens)
        need = sum(max(0, self.spec.blocks_for(tokens) - len(t)) for t in self.tables)
        if self.max_blocks is not None:
            need = min(need, self.max_blocks - self.used_blocks)
        self._grow(need, exact=True)
        self._grow_rows(tokens)

    def reserve(self, n_new: int | Sequence[int]) -> None:
        """Make room for each sequence to append ``n_new`` (one count, or one per sequence) tokens: reserve
        the blocks the append will write, and copy any of them that is shared with another sequence."""
        ns = [n_new] * self.batch if isinstance(n_new, int) else [int(x) for x in n_new]
        if len(ns) != self.batch:
            raise ArgumentError(f"reserve: {len(ns)} counts for a store of {self.batch} sequences")
        sp = self.spec
        self._grow_rows(max((L + n for L, n in zip(self.lengths, ns)), default=0))
        if self.max_tokens is not None:
            for b, (L, n) in enumerate(zip(self.lengths, ns)):
                if L + n > self.max_tokens:
                    raise CapacityError(
                        f"KV cache overflow: sequence {b} holds {L} tokens and appends {n}, but the cache is "
                        f"limited to {self.max_tokens} tokens. Allow a larger cache (max_cache_len) or shorten "
                        f"the sequence.")
        plans, need = [], 0
        for b, (L, n) in enumerate(zip(self.lengths, ns)):
            q0, q1 = sp.boundary(L) - sp.sink, sp.boundary(L + n) - sp.sink
            if q1 <= q0:
                continue
            first, last = q0 // sp.block, -(-q1 // sp.block)
            have = len(self.tables[b])
            shared = [j for j in range(first, min(last, have)) if self.refs[self.tables[b][j]] > 1]
            plans.append((b, shared, max(0, last - have)))
            need += len(shared) + max(0, last - have)
        if not plans:
            return
        self._grow(need)
        olds, news = [], []  # copy on write, all at once: every source is read before any block is written
        for b, shared, extra in plans:
            tbl = self.tables[b]
            for j in shared:
                olds.append(tbl[j])
                news.append(self._take())
                self._release(tbl[j])
                tbl[j] = news[-1]
            tbl.extend(self._take() for _ in range(extra))
        self.copy_blocks(olds, news)
        self._sync_rows([b for b, *_ in plans])

    def append_rows(self, rows: Tensor, k: Tensor, v: Tensor, kernel=None) -> KVState:
        """Append ``k, v [R, H, n, D]`` to sequences ``rows`` (``[R]``, ascending) only, the others untouched (a
        serving engine's group of requests with ``n`` new tokens each): reserve, then store with
        ``kernel(state, spec, k, v, None)`` (default: ``store_reference``) on the rows' state, which is returned
        for the attention that reads them (``ops.Backend.attention``): the pool's fields, and the rows' own --
        views of the store's when ``rows`` are consecutive, else copies whose writes are put back."""
        n, ids = k.shape[2], rows.tolist()
        counts = [0] * self.batch
        for b in ids:
            counts[b] = n
        self.reserve(counts)
        state, own = self.state, len(POOL_FIELDS)
        if ids == list(range(ids[0], ids[0] + len(ids))):  # in place
            sub = KVState(*state[:own], *(t[ids[0]:ids[0] + len(ids)] for t in state[own:]))
            (kernel or store_reference)(sub, self.spec, k, v, None)
        else:  # gathered, and the rows' written fields put back
            sub = KVState(*state[:own], *(t.index_select(0, rows) for t in state[own:]))
            (kernel or store_reference)(sub, self.spec, k, v, None)
            for t, s in zip(state[own:-1], sub[own:-1]):  # (the table is the store's to write, not the kernel's)
                t.index_copy_(0, rows, s)
        for b in ids:
            self.lengths[b] += n
        return sub

    def append(self, k: Tensor, v: Tensor, n_new: Tensor | None = None, kernel=None) -> None:
        """Append ``k, v [B, H, n, D]`` (row ``b``: its first ``n_new[b]`` tokens): reserve, then store with
        ``kernel(state, spec, k, v, n_new)`` (default: ``store_reference``)."""
        n = k.shape[2]
        ns = [n] * self.batch if n_new is None else [int(x) for x in n_new.tolist()]
        if any(x < 0 or x > n for x in ns):
            raise ArgumentError(f"n_new={ns} must be within [0, {n}] for a chunk of {n} tokens")
        self.reserve(ns)
        (kernel or store_reference)(self.state, self.spec, k, v, n_new)
        self.lengths = [L + x for L, x in zip(self.lengths, ns)]

    # ---- pre-RoPE keys
    def set_rope_offsets(self, offsets: Sequence[int]) -> None:
        """Each sequence's rotary position minus its cache index (``-pads`` for a left-padded row), kept through
        ``select``, ``fork`` and ``crop``; 0 after ``reset``. Set before its first write."""
        offsets = [int(x) for x in offsets]
        if len(offsets) != self.batch:
            raise ArgumentError(f"set_rope_offsets: {len(offsets)} offsets for a store of {self.batch} sequences")
        if offsets != self.rope_offset:
            self.rope_offset, self._rope_offset_t = offsets, None

    def write_keys(self, pre_rope: bool) -> None:
        """A write says whether its keys are pre-RoPE; every write into a store must say the same (a
        pre_rope policy whose graph had no recognised rotary embedding stores post-RoPE keys throughout)."""
        if self.rope_keys is None or not any(self.lengths):
            self.rope_keys = pre_rope
        elif self.rope_keys != pre_rope:
            raise RopeError(f"this store holds {'pre' if self.rope_keys else 'post'}-RoPE keys, but a write brings "
                            f"{'pre' if pre_rope else 'post'}-RoPE keys (one graph of the model had its rotary "
                            f"embedding recognised by the pass, another not). Use a policy without pre_rope here.")

    def capture_rope(self, cos: Tensor, sin: Tensor, form: str, n: int, n_new: Tensor | None = None) -> None:
        """Record the cos/sin of the ``n``-token chunk about to be appended (before ``append``): token ``t`` of
        sequence ``b`` is at rotary position ``lengths[b] + t + offset[b]``."""
        if self.rope_table is None:
            self.rope_table = RopeTable(self.device)
        L = torch.tensor(self.lengths, dtype=torch.int64).view(-1, 1)
        off = torch.tensor(self.rope_offset, dtype=torch.int64).view(-1, 1)
        t = torch.arange(n, dtype=torch.int64).view(1, -1)
        r = L + t + off
        ns = torch.full((self.batch, 1), n) if n_new is None else n_new.cpu().long().view(-1, 1)
        self.rope_table.capture(cos, sin, form, r, (r >= 0) & (t < ns), self.spec.head_dim)

    def rope(self) -> Rope | None:
        """The kernels' ``rope`` argument: None unless the store holds pre-RoPE keys."""
        if not self.rope_keys or self.rope_table is None or self.rope_table.form is None:
            return None
        if self._rope_offset_t is None:
            with torch.inference_mode(False):  # (``normal_tensors``)
                self._rope_offset_t = torch.tensor(self.rope_offset, dtype=torch.int32, device=self.device)
        tb = self.rope_table
        return Rope(tb.cos, tb.sin, tb.perm, self._rope_offset_t)

    def exact_view(self, width: int) -> tuple[Tensor, Tensor]:
        """Positions ``[0, width)`` of every sequence as ``k, v [B, H, width, D]``, contiguous, in the model's
        dtype, for an exact layout (``Policy.exact``: every token is in the blocks as the model wrote it): the
        values written, bit for bit, and zeros past each sequence's length -- what a full-precision cache of
        ``width`` slots holds (a ``StaticCache``; a ``DynamicCache`` when ``width`` is the length). The
        model's own attention reads it (``Policy.full()`` keeps the model's arithmetic)."""
        sp = self.spec
        if not sp.policy.exact:
            raise ArgumentError(f"KVStore.exact_view: the layout {sp.name} does not hold the values as written")
        B, H, D, BS = self.batch, sp.heads, sp.head_dim, sp.block
        k_pool, v_pool = self.state.k_codes, self.state.v_codes
        if width == 0 or not k_pool.shape[0]:
            z = torch.zeros(B, H, width, D, dtype=sp.torch_dtype, device=self.device)
            return z, z.clone()
        p = torch.arange(width, device=self.device)
        table = self.state.table
        cols = -(-width // BS)
        if table.shape[1] < cols:  # slots past every sequence's blocks (a static width): nothing written there
            table = torch.nn.functional.pad(table, (0, cols - table.shape[1]), value=-1)
        blk = table[:, p // BS].long().clamp(min=0)  # [B, width]; a slot with no block is masked below
        row = (p % BS).expand(B, width)
        out = []
        for pool in (k_pool, v_pool):
            x = pool.permute(1, 0, 2, 3)[:, blk, row].permute(1, 0, 2, 3).contiguous()  # [B, H, width, D]
            if min(self.lengths) < width:  # zeros past each length, as a zero-filled static cache holds
                live = p.view(1, 1, width, 1) < self.state.lengths.view(B, 1, 1, 1)
                x = torch.where(live, x, torch.zeros((), dtype=x.dtype, device=x.device))
            out.append(x)
        return out[0], out[1]

    def crop(self, length: int) -> None:
        """Every sequence keeps its first ``length`` tokens (sequences shorter than that are unchanged).

        What a cropped sequence reads afterwards, position by position:
          - sinks and the positions still in the full-precision ring (``p >= Q(L)`` before the crop) are
            exact: the values appended;
          - positions that had been packed but belong to the ring at the new length (``Q(length) <= p <
            Q(L)``) go back to the ring with the values the store held for them -- their dequantized values,
            rounded to the model's dtype (for a float32 model exactly what attention read for them before the
            crop; with format "none", such as ``Policy.full()``, exactly the values appended). When they leave
            the ring again they are quantized from those values, so a crop that reaches into packed storage
            can cost those tokens a second rounding;
          - everything before ``Q(length)`` is untouched.
        Blocks no longer needed are freed; a shared block is copied before it is written again.
        """
        crop_reference(self, length)

    def select(self, index) -> None:
        """Sequence ``i`` becomes what sequence ``index[i]`` was (reorder, fork, drop): beam search's
        reorder, ``num_return_sequences`` and parallel sampling. Blocks are shared, not copied, until a
        sequence writes into a shared one (``reserve`` copies it then). The batch becomes ``len(index)``."""
        idx = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch):
            raise IndexOutOfRange(f"select: index {idx.tolist()} outside the store's {self.batch} sequences")
        ix = idx.tolist()
        tables = [list(self.tables[i]) for i in ix]
        for t in tables:
            self._share(t)
        for t in self.tables:
            for blk in t:
                self._release(blk)
        self.tables = tables
        self.lengths = [self.lengths[i] for i in ix]
        self.rope_offset = [self.rope_offset[i] for i in ix]
        self._rope_offset_t = None
        dev = idx.to(self.device)
        with torch.inference_mode(False):  # (``normal_tensors``)
            rows = [t.index_select(0, dev) for t in self.state[6:11]]
            table = torch.full((len(ix), self.state.table.shape[1]), -1, dtype=torch.int32, device=self.device)
        self.state = KVState(*self.state[:6], *rows, table)
        self._sync_rows()

    def __deepcopy__(self, memo) -> "KVStore":
        """``copy.deepcopy``: ``copy`` (every tensor cloned), with the cos/sin table copied once for all the stores
        of a cache that share it (``memo``)."""
        out = self.copy()
        memo[id(self)] = out
        out.rope_table = copy.deepcopy(self.rope_table, memo)
        return out

    @normal_tensors
    def copy(self, device=None) -> "KVStore":
        """An independent copy (every tensor cloned, on ``device``; default: the same device)."""
        out = KVStore.__new__(KVStore)
        out.__dict__.update(self.__dict__)
        out.device = torch.device(device) if device is not None else self.device
        out.state = KVState(*[t.to(out.device, copy=True) for t in self.state])
        out.refs, out.free, out.lengths = list(self.refs), list(self.free), list(self.lengths)
        out.tables = [list(t) for t in self.tables]
        out.rope_offset, out._rope_offset_t = list(self.rope_offset), None
        return out

    def clear(self, rows: Sequence[int]) -> None:
        """Empty the sequences ``rows`` (their blocks return to the pool); the others are untouched. A serving
        engine's slot is cleared when its request finishes, and reused by the next one."""
        rows = [int(b) for b in rows]
        for b in rows:
            for blk in self.tables[b]:
                self._release(blk)
            self.tables[b] = []
            self.lengths[b] = 0
            self.rope_offset[b] = 0
        self._rope_offset_t = None
        if rows:
            self.state.lengths[rows] = 0
            self._sync_rows(rows)

    def fork(self, src: int, dst: int) -> None:
        """Sequence ``dst`` becomes a copy of sequence ``src`` (parallel sampling): blocks are shared, as by
        ``select``, and copied before either writes into a shared one; ring and sinks are copied. Whatever
        ``dst`` held is released first."""
        self.clear([dst])
        self.tables[dst] = list(self.tables[src])
        self._share(self.tables[dst])
        self.lengths[dst] = self.lengths[src]
        self.rope_offset[dst], self._rope_offset_t = self.rope_offset[src], None
        for t in self.state[6:11]:
            t[dst] = t[src]
        self._sync_rows([dst])

    def save(self, b: int, device="cpu") -> SavedRow:
        """A copy of sequence ``b`` on ``device`` (a serving engine moving an evicted request's cache to host
        memory): its blocks' packed contents in table order, its ring and sinks, its length. ``restore`` puts it
        back, into any blocks and row."""
        blocks = torch.tensor(self.tables[b], dtype=torch.long, device=self.device)
        pool = tuple(t.index_select(0, blocks).to(device) if t.numel() else t.new_empty(0, device=device)
                     for t in self.state[:6])
        row = tuple(t[b].to(device, copy=True) for t in self.state[6:10])  # a copy: the row is reused
        return SavedRow(pool, row, self.lengths[b], self.rope_offset[b])

    def restore(self, b: int, saved: SavedRow, blocks: Sequence[int]) -> None:
        """Sequence ``b`` becomes what ``save`` copied: its contents go to the first blocks of ``blocks`` (its
        table from now on; an engine hands them out), its ring, sinks and length to row ``b``."""
        n = saved.pool[0].shape[0]
        if len(blocks) < n:
            raise UnsupportedError(f"KVStore.restore: {n} blocks saved, {len(blocks)} given")
        self.clear([b])
        self.tables[b] = list(blocks)
        self._share(self.tables[b])
        dst = torch.tensor(list(blocks[:n]), dtype=torch.long, device=self.device)
        for t, s in zip(self.state[:6], saved.pool):
            if t.numel() and n:
                t.index_copy_(0, dst, s.to(self.device))
        self._grow_rows(saved.length)
        for t, s in zip(self.state[6:10], saved.row):  # the rows as far as the sequence reaches (both hold that)
            w = min(t.shape[2], s.shape[1])
            t[b, :, :w] = s[:, :w].to(self.device)
        self.lengths[b], self.state.lengths[b] = saved.length, saved.length
        self.rope_offset[b], self._rope_offset_t = saved.rope_offset, None
        self._sync_rows([b])

    def reset(self) -> None:
        """Empty every sequence (the pool is kept for reuse)."""
        for t in self.tables:
            for blk in t:
                self._release(blk)
        self.tables = [[] for _ in range(self.batch)]
        self.lengths = [0] * self.batch
        self.rope_offset, self._rope_offset_t = [0] * self.batch, None
        self.rope_keys = None
        self.state.lengths.zero_()
        self.state.table.fill_(-1)


def describe(t) -> str:
    """A tensor's dtype, shape and strides for an error message (a non-tensor: its type)."""
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} strides {list(t.stride())}"


def map_rows(m: Tensor, pos: Tensor) -> Tensor:
    """The rows of positions ``pos`` under ``FlatRecent`` maps ``m`` (``[..., 3]``, broadcast against ``pos``)."""
    return torch.where(pos < m[..., 2], m[..., 0] + pos, m[..., 1] + pos)


class FlatRecent(NamedTuple):
    """Each row's full-precision positions ``[Q(L), L)`` as rows of one flat tensor, read in place of the state's
    rings (``kvcompile.pages``: a windowed step's, whose positions are the window's and the step's own): keys and
    values ``[N, H, D]`` (the model dtype, as stored, contiguous) and ``map`` int64 ``[B, 3]``: position ``p`` of
    row ``b`` is row ``p < map[b, 2] ? map[b, 0] + p : map[b, 1] + p`` of them."""

    k: Tensor
    v: Tensor
    map: Tensor


def flat_rings(state: KVState, spec: LayerSpec, flat: FlatRecent | None) -> KVState:
    """``state`` with rings ``[B, H, spec.ring, D]`` (slot ``p % spec.ring``, the store's) holding each row's
    full-precision positions from ``flat`` -- what the C kernels read in place (``templates.cpu.attention``'s
    ``flat``), for the kernels that read rings; ``state`` itself for None. A slot whose position the row does not
    read (before ``Q(L)``) holds zeros; a position the map puts outside ``flat`` is an ``ArgumentError``."""
    if flat is None:
        return state
    k, v, m = flat
    B, W = state.lengths.shape[0], spec.ring
    if not W:
        return state
    L = state.lengths.to("cpu", torch.long)
    lo = spec.policy.boundary(L)
    start = (L - W)[:, None]
    pos = (start + (torch.arange(W) - start) % W).clamp_min(0)  # [B, W]: slot j's position, the newest of its class
    read = (pos >= lo[:, None]) & (pos < L[:, None])
    m = m.to("cpu", torch.long)
    row = map_rows(m[:, None, :], pos)
    bad = read & ((row < 0) | (row >= k.shape[0]))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ArgumentError(f"the full-precision rows ({k.shape[0]}) hold no row {int(row[b, j])} for position "
                            f"{int(pos[b, j])} of row {b} ({int(L[b])} positions), which it reads: its map "
                            f"{m[b].tolist()}")
    row = torch.where(read, row, 0).to(k.device)
    keep = read.to(k.device)[:, None, :, None]

    def rings(x):  # [B, W, H, D] gathered, then [B, H, W, D]; unread slots zero
        return torch.where(keep, x[row].transpose(1, 2), 0).contiguous()
    return state._replace(k_res=rings(k), v_res=rings(v))


def row_rings(state: KVState, spec: LayerSpec, rings: Tensor | None = None, flat: FlatRecent | None = None) -> KVState:
    """``state`` with a ring of its own for every row holding its full-precision positions: from ``flat``
    (``flat_rings``) or the shared rings ``rings`` names (``own_rings``) -- what a kernel that reads rings takes
    for ``ops.Backend``'s ``rings`` and ``flat``."""
    return own_rings(flat_rings(state, spec, flat), rings)


def own_rings(state: KVState, rings: Tensor | None) -> KVState:
    """``state`` with a ring of its own for every row: row ``b``'s is ring ``rings[b]`` of ``k_res, v_res`` (rows
    that share rings, ``ops.Backend``'s ``rings``), or ``state`` itself for None."""
    if rings is None:
        return state
    i = rings.to(device=state.k_res.device, dtype=torch.long)
    return state._replace(k_res=state.k_res.index_select(0, i), v_res=state.v_res.index_select(0, i))


def row_widths(state: KVState, spec: LayerSpec, n_new: Tensor | int = 0, rings: bool = True) -> tuple[int, int]:
    """``(ring slots, sink rows)`` allocated per (sequence, head) in ``state`` -- the strides a kernel takes for
    the rows --, checked to hold every position its sequences reach after appending ``n_new`` (one count, or
    one per sequence): a narrower row would be written or read past its end. ``rings=False``: the rings are not
    read (a ``FlatRecent`` holds those positions), only the sinks are checked."""
    ring, sink = state.k_res.shape[2], state.k_sink.shape[2]
    if state.lengths.numel():
        ends = state.lengths.cpu().long() + (n_new.cpu().long() if isinstance(n_new, Tensor) else int(n_new))
        need_ring, need_sink = min(spec.ring, int(ends.max())) if rings else 0, min(spec.sink, int(ends.max()))
        if ring < need_ring or sink < need_sink:
            raise CapacityError(f"the store's rows hold {ring} ring slots and {sink} sinks per sequence, but its "
                                f"sequences reach {int(ends.max())} tokens ({need_ring} and {need_sink} needed): "
                                f"grow them first (KVStore.reserve)")
    return ring, sink


def _state_capacity_check(state: KVState, spec: LayerSpec, lengths: Tensor, n_new: Tensor) -> None:
    """Every row's table must cover the blocks its append writes (``KVStore.reserve`` makes sure). Tensor ops over
    the rows (the host side of a store on CPU tensors runs it at every append: an engine's every layer)."""
    ends = lengths.to("cpu", torch.long) + n_new.to("cpu", torch.long)
    need = spec.blocks_for(ends)
    tbl = state.table.cpu()
    unreserved = (torch.arange(tbl.shape[1]) < need[:, None]) & (tbl < 0)
    short = (need > tbl.shape[1]) | unreserved.any(1)
    if bool(short.any()):
        b = int(short.nonzero()[0])
        nb, cap = int(need[b]), int((tbl[b] >= 0).sum())
        raise CapacityError(
            f"KV cache overflow: sequence {b} holds {int(lengths[b])} tokens and appends {int(n_new[b])}, "
            f"which needs {nb} blocks of {spec.block} packed tokens, but {cap} are reserved for it. Reserve "
            f"them first (KVStore.reserve), or allocate a larger store.")


# --------------------------------------------------------------------------- rotation
def rotation_block(D: int) -> int:
    """Channels one Hadamard block mixes: the largest power of two dividing ``D`` (``D`` itself when it is one;
    16 for 80 and 112, 32 for 96, 8 for 120). The rotation is block-diagonal: ``D / block`` Sylvester
    Hadamard blocks along the diagonal, what a fast Walsh-Hadamard transform of log2(block) butterfly stages
    computes. Each block is orthonormal, so the rotation is exact in full precision and its own inverse."""
    return D & -D


@functools.lru_cache(maxsize=None)
def _signs_cpu(D: int) -> Tensor:
    """The rotation's +-1 (and 0) matrix [D, D], float64: block-diagonal Sylvester blocks (``rotation_block``)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < rotation_block(D):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h] * (D // h.shape[0]))


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(D: int) -> Tensor:
    return _signs_cpu(D) / math.sqrt(rotation_block(D))


def hadamard(D: int, device=None, dtype=torch.float32) -> Tensor:
    """The orthonormal rotation matrix [D, D] (built in float64): block-diagonal Sylvester Hadamard blocks of
    ``rotation_block(D)`` channels (one block when ``D`` is a power of two); symmetric, its own inverse."""
    return _hadamard_cpu(D).to(device=device, dtype=dtype)


def rotate_reference(x: Tensor) -> Tensor:
    """The rotation's specification: ``x @ H`` along the last dimension, computed by the fast Walsh-Hadamard
    transform in float64 and rounded once to ``x``'s dtype (finite values saturate: ``quant.saturate``).

    Each block of ``b = rotation_block(D)`` channels goes through log2(b) butterfly stages -- stage ``h``
    (1, 2, 4, ...) replaces each pair ``(x[j], x[j + h])`` of a group of ``2h`` channels with their sum and
    difference -- and the result is multiplied by ``1 / sqrt(b)``. Every step is one float64 operation in a fixed
    order, so a row's result does not depend on the batch around it (a float32 ``x @ H`` rounds a row
    differently as one row, gemv, than beside others, and a KV head stored alone -- a tensor-parallel rank's --
    got other bits than beside the others). For float32 (or narrower) input the sums of up to 256 values are
    exact unless the row's magnitudes span more than about 2**21, so the result is then also ``x @ H`` rounded
    once; beyond that it is this tree's, bit for bit, on every device and in every kernel."""
    D = x.shape[-1]
    b = rotation_block(D)
    shape = x.shape
    y = x.double().reshape(-1, b)
    N, h = y.shape[0], 1
    while h < b:
        y = y.view(N, b // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), 2)
        h *= 2
    return Q.saturate(y.reshape(shape) * (1 / math.sqrt(b)), x.dtype)


def _rotate(x: Tensor) -> Tensor:
    """``rotate_reference(x)``'s bits, computed by the kernels that run for ``x`` (``kvcompile.ops.kernels``): the
    Triton kernel ``templates.rotate`` (one launch) under "triton" -- on CUDA by default --, the C kernel
    ``templates.cpu_rotate`` (one pass, ~7x faster than a float64 matrix product) on the CPU; the specification
    itself under "reference". While Dynamo traces (the "inductor" family's attention rotates its chunk) the
    kernel is the operator ``kvcompile::rotate``."""
    if not x.numel():
        return rotate_reference(x)
    from . import ops

    family = ops.kernels(x.device)
    if family == "triton" and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        kernel = "triton"
    elif family != "reference" and x.device.type == "cpu":
        kernel = "cpu"
    else:
        return rotate_reference(x)
    if torch.compiler.is_compiling():
        return torch.ops.kvcompile.rotate(x, kernel)
    return ops._rotate(x, kernel)


def rotate(x: Tensor, spec: LayerSpec, keys: bool = False) -> Tensor:
    """Values (and keys: ``keys=True``) into the store's space: ``x @ H`` (``_rotate``), in ``x``'s dtype.
    Keys only when the policy rotates them (``Policy.rotates_keys``: not when they are stored pre-RoPE)."""
    if not (spec.policy.rotates_keys if keys else spec.policy.rotate):
        return x
    return _rotate(x)


def unrotate(x: Tensor, spec: LayerSpec) -> Tensor:
    if not spec.policy.rotate:
        return x
    return _rotate(x)  # H is symmetric and orthonormal


# --------------------------------------------------------------------------- reference append
def check_kv(spec: LayerSpec, k: Tensor, v: Tensor, batch: int) -> None:
    """``k, v`` must be ``[batch, heads, n, head_dim]`` of one shape (the one check every store path makes)."""
    B, H, n, D = k.shape if k.dim() == 4 else (None,) * 4
    if (B, H, D) != (batch, spec.heads, spec.head_dim) or v.shape != k.shape:
        raise ArgumentError(f"store expects k, v of shape [{batch}, {spec.heads}, n, {spec.head_dim}]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")


def store_reference(state: KVState, spec: LayerSpec, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
    """Append ``k, v [B, H, n, D]`` (model space) to the store, in place.

    ``n_new`` (int [B], optional): row ``b`` appends only its first ``n_new[b]`` tokens (ragged batches);
    the default appends all ``n``. Tokens go at positions ``lengths[b] ...``; ``lengths`` advances. Every
    row's table must already hold the blocks the append writes, and its ring and sinks reach the positions it
    writes (``KVStore.reserve`` sees to both), else ``CapacityError``.
    """
    check_kv(spec, k, v, state.lengths.shape[0])
    B, H, n, D = k.shape
    if n_new is None:
        n_new = torch.full((B,), n, dtype=torch.int32)
    n_new = n_new.to(torch.int32).cpu()
    if bool(((n_new < 0) | (n_new > n)).any()):
        raise ArgumentError(f"n_new={n_new.tolist()} must be within [0, {n}] for a chunk of {n} tokens")
    lengths_cpu = state.lengths.cpu()
    _state_capacity_check(state, spec, lengths_cpu, n_new)
    row_widths(state, spec, n_new)  # the rings and sinks reach every position written (``KVStore.reserve`` grows them)
    k, v = rotate(k, spec, keys=True), rotate(v, spec)
    for b in range(B):
        L, nb = int(lengths_cpu[b]), int(n_new[b])
        _append_row(state, spec, b, L, k[b, :, :nb], v[b, :, :nb])
        state.lengths[b] = L + nb


def _append_row(state: KVState, spec: LayerSpec, b: int, L: int, k: Tensor, v: Tensor) -> None:
    n = k.shape[1]
    L2 = L + n
    S, W, dt = spec.sink, spec.ring, spec.torch_dtype
    q0, q1 = spec.boundary(L), spec.boundary(L2)
    dev = k.device
    # sinks
    if L < S:
        state.k_sink[b, :, L:min(L2, S)] = Q.saturate(k[:, :min(L2, S) - L], dt)
        state.v_sink[b, :, L:min(L2, S)] = Q.saturate(v[:, :min(L2, S) - L], dt)
    # flush [q0, q1) into packed storage, from the ring (p < L) or from the chunk (p >= L)
    if q1 > q0:
        old = torch.arange(q0, max(q0, min(L, q1)), device=dev)
        def window(res, x):
            return torch.cat([res[b, :, old % max(W, 1)], Q.saturate(x[:, max(L, q0) - L:max(L, q1) - L], dt)], dim=1)
        table = state.table[b].tolist()
        _write_quantized(state.k_codes, state.k_scale, state.k_zero, spec.policy.key, window(state.k_res, k),
                         table, q0 - S, spec.block)
        _write_quantized(state.v_codes, state.v_scale, state.v_zero, spec.policy.value, window(state.v_res, v),
                         table, q0 - S, spec.block)
    # the newcomers that stay in full precision, at p % W in the ring
    new = torch.arange(max(L, S, q1), max(L, S, q1, L2), device=dev)
    state.k_res[b, :, new % max(W, 1)] = Q.saturate(k[:, new - L], dt)
    state.v_res[b, :, new % max(W, 1)] = Q.saturate(v[:, new - L], dt)


def _segments(start: int, T: int, BS: int):
    """The packed index range ``[start, start + T)`` cut at block boundaries: (block slot j, row in the
    block, offset in the range, count) for each piece."""
    j = start
    while j < start + T:
        cnt = min(BS - j % BS, start + T - j)
        yield j // BS, j % BS, j - start, cnt
        j += cnt


def _write_quantized(codes, scale, zero, q, x: Tensor, table: list[int], start: int, BS: int) -> None:
    """Quantize ``x [H, T, D]`` (packed indices start..start+T of one sequence) into its blocks."""
    T = x.shape[1]
    if not q.quantized:
        for j, r, o, c in _segments(start, T, BS):
            codes[table[j], :, r:r + c] = x[:, o:o + c]
        return
    cd, s, z = Q.quantize(x, q)
    packed = Q.pack(cd, q.bits)
    per = q.group if q.axis == "channel" else 1  # tokens per scale row
    for j, r, o, c in _segments(start, T, BS):
        blk = table[j]
        codes[blk, :, r:r + c] = packed[:, o:o + c]
        if not q.stores_scale:
            continue
        scale[blk, :, r // per:(r + c) // per] = s[:, o // per:(o + c) // per]
        if z is not None:
            zero[blk, :, r // per:(r + c) // per] = z[:, o // per:(o + c) // per]


def crop_reference(store: "KVStore", length: int) -> None:
    """``KVStore.crop``'s specification (see its docstring): every sequence keeps ``min(L, length)`` tokens."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ArgumentError(f"crop(length={length!r}): expected a number of tokens >= 0")
    sp, st = store.spec, store.state
    S, W = sp.sink, max(sp.ring, 1)
    rows = []
    for b, L in enumerate(store.lengths):
        if L <= length:
            continue
        q_old, q_new = sp.boundary(L), sp.boundary(length)
        lo, hi = max(q_new, S), min(length, q_old)  # packed positions that return to the ring
        if hi > lo:
            k, v = _dequantize_row(st, sp, b, lo, hi, torch.float32)
            pos = torch.arange(lo, hi, device=st.k_res.device) % W
            st.k_res[b, :, pos] = Q.saturate(k, sp.torch_dtype)
            st.v_res[b, :, pos] = Q.saturate(v, sp.torch_dtype)
        keep = sp.blocks_for(length)
        for blk in store.tables[b][keep:]:
            store._release(blk)
        del store.tables[b][keep:]
        store.lengths[b] = length
        st.lengths[b] = length
        rows.append(b)
    if rows:
        store._sync_rows(rows)


# --------------------------------------------------------------------------- reference read
def _gather_packed(state: KVState, spec: LayerSpec, which: str, rows, j0: int, j1: int, dtype) -> Tensor:
    """Dequantized packed indices ``[j0, j1)`` (multiples of the flush group, within reserved blocks) of the
    sequences ``rows``: ``[len(rows), H, j1 - j0, D]`` in ``dtype``, the store's rotated space."""
    q = spec.policy.key if which == "k" else spec.policy.value
    codes, scale, zero = state[:3] if which == "k" else state[3:6]
    BS, D, H = spec.block, spec.head_dim, spec.heads
    b0, b1 = j0 // BS, -(-j1 // BS)
    blk = state.table[rows][:, b0:b1].long().clamp(min=0)  # [R, nb]; unreserved slots are never read
    R, nb = blk.shape

    def paged(t):  # [NB, H, X, Y] -> [R, H, nb * X, Y]
        g = t[blk]  # [R, nb, H, X, Y]
        return g.permute(0, 2, 1, 3, 4).reshape(R, H, nb * t.shape[2], t.shape[3])

    off = j0 - b0 * BS
    c = paged(codes)[:, :, off:off + j1 - j0]
    if not q.quantized:
        return Q.saturate(c, dtype)
    if q.stores_scale:
        per = q.group if q.axis == "channel" else 1
        s = paged(scale)[:, :, off // per:(off + j1 - j0) // per]
        z = paged(zero)[:, :, off // per:(off + j1 - j0) // per] if q.has_zero else None
    else:  # axis="tensor": the fixed scale, 1.0
        s, z = c.new_ones((*c.shape[:-1], 1), dtype=torch.float32), None
    return Q.dequantize(Q.unpack(c, q.bits, D), s, z, q, dtype)


def _dequantize_row(state: KVState, spec: LayerSpec, b: int, lo: int, hi: int, dtype):
    """Packed positions ``[lo, hi)`` of sequence ``b`` dequantized, rotated space: ``[H, hi - lo, D]`` each."""
    S, F = spec.sink, spec.flush
    j0, j1 = ((lo - S) // F) * F, -(-(hi - S) // F) * F
    out = []
    for which in ("k", "v"):
        x = _gather_packed(state, spec, which, [b], j0, j1, dtype)[0]
        out.append(x[:, lo - S - j0:hi - S - j0])
    return out[0], out[1]


def dequantize_reference(state: KVState, spec: LayerSpec, dtype=torch.float32, rotated: bool = False,
                         start: int = 0, end: int | None = None):
    """What the store holds at positions ``[start, end)`` (default: up to the longest sequence), as
    ``k^, v^ [B, H, end-start, D]`` in ``dtype``; positions >= a row's length are zero.

    In model space unless ``rotated=True`` (the store's own space, which attention works in). Only the packed
    rows inside the range are unpacked, so refreshing a few recent positions is cheap.
    """
    B, H, D, S = state.lengths.shape[0], spec.heads, spec.head_dim, spec.sink
    W, F = spec.ring, spec.flush
    lengths = state.lengths.tolist()
    end = max(lengths, default=0) if end is None else end
    # packed indices to unpack: the range, widened to whole flush groups so per-channel scales line up, and
    # no further than the longest sequence's packed region
    j0 = (max(start - S, 0) // F) * F
    j1 = min(spec.boundary(max(lengths, default=0)) - S, -(-(max(end, S) - S) // F) * F)
    out = []
    for which, res, sink in (("k", state.k_res, state.k_sink), ("v", state.v_res, state.v_sink)):
        full = torch.zeros(B, H, max(end - start, 0), D, dtype=dtype, device=res.device)
        deq = _gather_packed(state, spec, which, slice(None), j0, j1, dtype) if j1 > j0 else None
        for b in range(B):
            L = min(lengths[b], end)
            qb = spec.boundary(lengths[b])
            lo, hi = max(start, 0), min(L, S)  # sinks
            if hi > lo:
                full[b, :, lo - start:hi - start] = Q.saturate(sink[b, :, lo:hi], dtype)
            lo, hi = max(start, S), min(qb, L)  # packed
            if hi > lo:
                full[b, :, lo - start:hi - start] = deq[b, :, lo - S - j0:hi - S - j0]
            live = torch.arange(max(qb, S, start), max(qb, S, start, L), device=res.device)  # residual ring
            full[b, :, live - start] = Q.saturate(res[b, :, live % max(W, 1)], dtype)
        if not rotated and (spec.policy.rotates_keys if which == "k" else spec.policy.rotate):
            full = Q.saturate(full.double() @ hadamard(D, full.device, torch.float64), dtype)
        out.append(full)
    return out[0], out[1]


def chunk_needed(spec: LayerSpec, n: int) -> bool:
    """Whether the ``n`` newest tokens can be in packed storage right after they were appended.

    They cannot when ``n <= residual`` (``Q(L) <= max(S, L - R)``: the newest ``R`` tokens are always in the
    ring or the sinks, which hold exactly ``rotate(k).to(dtype)``, the chunk's own full-precision values), or
    when nothing is quantized. Kernels use it to skip reading the chunk; the result is the same either way.
    """
    quantized = spec.policy.key.quantized or spec.policy.value.quantized
    return quantized and n > spec.policy.residual


def as_stored(x: Tensor, spec: LayerSpec, dtype=torch.float32, keys: bool = False) -> Tensor:
    """Keys (``keys=True``) or values exactly as the store keeps them in full precision (``rotate(x).to(model
    dtype)``), in ``dtype``: what the sinks and the ring hold, and what attention reads for the queries' own
    chunk."""
    return Q.saturate(rotate(x, spec, keys), spec.torch_dtype).to(dtype)


def stored_chunk(spec: LayerSpec, k_new: Tensor | None, v_new: Tensor | None, n: int,
                 dtype=torch.float32) -> tuple[Tensor, Tensor] | None:
    """The chunk ``as_stored`` (contiguous) for a kernel to read, or None when none was given or none of its
    positions can be in packed storage (``chunk_needed``: the kernel's store reads give the same values)."""
    if k_new is None or not chunk_needed(spec, n):
        return None
    return as_stored(k_new, spec, dtype, keys=True).contiguous(), as_stored(v_new, spec, dtype).contiguous()


def check_chunk(q: Tensor, k_new: Tensor | None, v_new: Tensor | None, spec: LayerSpec) -> None:
    if (k_new is None) != (v_new is None):
        raise ArgumentError("attention takes the chunk's keys and values together (k_new and v_new), or neither")
    if k_new is None:
        return
    B, _, n, D = q.shape
    want = (B, spec.heads, n, spec.head_dim)
    if tuple(k_new.shape) != want or tuple(v_new.shape) != want:
        raise ArgumentError(f"k_new and v_new must be the {n} queries' own keys and values, of shape {list(want)}; "
                         f"got {list(k_new.shape)} and {list(v_new.shape)}")


def with_chunk(k: Tensor, v: Tensor, state: KVState, spec: LayerSpec, k_new: Tensor,
               v_new: Tensor) -> tuple[Tensor, Tensor]:
    """``k, v [B, H, P, D]`` (the store's rotated space, positions ``0 .. P``) with each row's newest ``n``
    positions ``[L - n, L)`` replaced by the chunk ``k_new, v_new [B, H, n, D]`` (model space) ``as_stored``.
    Returns new tensors."""
    B, H, n, D = k_new.shape
    P = k.shape[2]
    first = state.lengths.to(k.device).long().view(B, 1, 1, 1) - n  # the chunk's first position
    j = torch.arange(P, device=k.device).view(1, 1, P, 1) - first  # index into the chunk
    inside = (j >= 0) & (j < n)
    idx = j.clamp(0, n - 1).expand(B, H, P, D)
    out = []
    for full, new, keys in ((k, k_new, True), (v, v_new, False)):
        out.append(torch.where(inside, as_stored(new, spec, full.dtype, keys).gather(2, idx), full))
    return out[0], out[1]


def positions(state: KVState, mask: Tensor | None) -> int:
    """How many absolute positions attention scores: the mask's width, or the longest sequence without one."""
    if mask is not None:
        return mask.shape[-1]
    return int(state.lengths.max()) if state.lengths.numel() else 0


def cover(mask: Tensor | None, state: KVState, longest: int | None = None) -> Tensor | None:
    """``mask`` widened to every position a sequence holds: positions past its width are invisible (what SDPA
    over ``cache[:, :, :width]`` computes). Kernels take masks at least as wide as the longest sequence.
    ``longest``: that length, when the caller knows it (``KVStore.lengths``, on the host); else read from
    ``state``."""
    if longest is None:
        longest = int(state.lengths.max()) if state.lengths.numel() else 0
    if mask is None or mask.shape[-1] >= longest:
        return mask
    fill = False if mask.dtype == torch.bool else float("-inf")
    return torch.nn.functional.pad(mask, (0, longest - mask.shape[-1]), value=fill)


def attention_reference(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None = None,
                        scale: float | None = None, compute_dtype=torch.float32,
                        k_new: Tensor | None = None, v_new: Tensor | None = None, rope: Rope | None = None) -> Tensor:
    """Attention of ``q [B, Hq, n, D]`` over the store; returns ``[B, Hq, n, D]`` in q's dtype.

    ``rope`` (``KVStore.rope``): the store holds pre-RoPE keys; each key (the chunk's too) is rotated by its
    position after dequantization (``apply_rope``), before the scores.

    The ``n`` queries are the sequence's last ``n`` tokens (positions ``L-n .. L-1``, already stored).
    Key ``p`` is visible to query ``i`` when ``p < L`` and
      - with no mask: ``p <= L - n + i`` (causal);
      - with a mask (bool, or float added to the scores; broadcastable to ``[B, Hq, n, P]`` over
        absolute positions ``0 .. P-1``): as the mask says; positions ``p >= P`` are invisible (``cover``).
    A query that sees no key returns zeros. ``Hq`` must be a multiple of the store's heads (GQA).

    ``k_new, v_new [B, H, n, D]``: the chunk just appended (the queries' own keys and values). Given, the
    chunk's positions ``[L-n, L)`` are read from them in full precision, not from the store: a prefill
    attends to its own tokens unquantized, as KIVI does, and only later calls see them quantized (the
    kv-cache pass always passes them). Without them every position is read from the store.

    **Non-finite values** (what the store holds, ``dequantize_reference``: see ``quant`` for how a NaN or inf
    input is stored). Visibility is as above, and with an additive mask a position whose mask value is
    -inf is not visible either (so a masked position never reads its key or value). For each query row:
      - if any visible position's score ``q.k * scale (+ mask)`` is not finite (NaN or +-inf: a non-finite
        key or query element, or a score beyond fp32), the whole row is NaN;
      - otherwise the softmax runs over the visible positions, and output channel ``d`` is NaN if any
        visible position holds a non-finite value in channel ``d`` (whatever its weight);
      - every other output is the softmax-weighted sum, and is finite unless the fp32 arithmetic overflows;
        any non-finite output is returned as NaN (never +-inf). Rows that see nothing return zeros.
    Positions a row does not see never affect it. Full-precision SDPA (torch 2.13, CPU) spreads further: a
    NaN or inf value at a masked position reaches every row (its weight 0 times NaN), and a NaN key under a
    boolean mask poisons every row; it spreads less in one case: a visible key whose score is -inf gets
    weight 0, where this rule makes the row NaN. With ``rotate=True`` the output is un-rotated, so a NaN
    channel spreads to the row's every channel. Every kernel family returns NaN at exactly these outputs.
    """
    B, Hq, n, D = q.shape
    H = spec.heads
    if Hq % H:
        raise ArgumentError(f"query heads {Hq} are not a multiple of the cache's kv heads {H}")
    check_chunk(q, k_new, v_new, spec)
    mask = cover(mask, state)
    C = positions(state, mask)
    k, v = dequantize_reference(state, spec, compute_dtype, rotated=True, end=C)
    if k_new is not None:
        k, v = with_chunk(k, v, state, spec, k_new, v_new)
    if rope is not None:
        k = apply_rope(k, rope, torch.arange(C, device=q.device))
    qr = q.to(compute_dtype)
    if spec.policy.rotates_keys:
        qr = qr @ hadamard(D, q.device).to(compute_dtype)
    k = k.repeat_interleave(Hq // H, dim=1)
    v = v.repeat_interleave(Hq // H, dim=1)
    sc = (qr @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(D))
    pos = torch.arange(C, device=q.device)
    L = state.lengths.to(q.device).long().view(B, 1, 1, 1)
    visible = pos.view(1, 1, 1, C) < L
    if mask is None:
        qpos = L - n + torch.arange(n, device=q.device).view(1, 1, n, 1)
        visible = visible & (pos.view(1, 1, 1, C) <= qpos)
    elif mask.dtype == torch.bool:
        visible = visible & mask[..., :C]
    else:
        m = mask[..., :C].to(compute_dtype)
        visible = visible & (m != float("-inf"))
        sc = sc + m
    # a row that sees a non-finite score is NaN (a non-finite key or query element always gives one)
    poisoned = ~torch.isfinite(sc) | ~torch.isfinite(k).all(-1).unsqueeze(-2) | ~torch.isfinite(qr).all(-1, True)
    row_nan = (visible & poisoned).any(-1, keepdim=True)
    sc = sc.masked_fill(~visible | poisoned, float("-inf"))
    p = torch.softmax(sc, dim=-1).nan_to_num(0.0)  # a query that sees nothing (finite) gets zeros, not NaN
    finite_v = torch.isfinite(v)
    if bool(finite_v.all()):
        out = p @ v
    else:  # invisible positions' values must not reach the row (0 * NaN); visible ones poison their channel
        out = p @ torch.where(finite_v, v, 0.0)
        out = out.masked_fill((visible.to(v.dtype) @ (~finite_v).to(v.dtype)) > 0, float("nan"))
    out = out.masked_fill(row_nan, float("nan"))
    if spec.policy.rotate:
        out = out @ hadamard(D, q.device).to(compute_dtype)
    out = torch.where(torch.isfinite(out), out, float("nan"))
    return Q.saturate(out, q.dtype)


# --------------------------------------------------------------------------- the user-facing store
class QuantizedKV:
    """One layer's quantized KV store (reference implementation, any device): a ``KVStore`` with the
    reference kernels.

    >>> kv = QuantizedKV(Policy.kivi(4), batch=1, heads=3, head_dim=64)
    >>> kv.append(k, v)             # k, v: [1, 3, n, 64]; the store grows as tokens come
    >>> k_hat, v_hat = kv.dequantized()

    capacity: the most tokens a sequence may hold (``CapacityError`` beyond); None: no limit.
    """

    def __init__(self, policy: Policy, batch: int, heads: int, capacity: int | None = None, head_dim: int = 64,
                 dtype=torch.float32, device="cpu"):
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ArgumentError(f"QuantizedKV capacity={capacity!r} is not valid: expected a positive number of "
                             f"tokens, or None for no limit")
        self.spec = LayerSpec(policy, heads, head_dim, DTYPE_NAMES[dtype])
        self.store = KVStore(self.spec, batch, device, max_tokens=capacity)

    @property
    def state(self) -> KVState:
        return self.store.state

    @property
    def lengths(self) -> Tensor:
        return self.state.lengths

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def append(self, k: Tensor, v: Tensor, n_new: Tensor | None = None) -> None:
        self.store.append(k, v, n_new)

    def dequantized(self, dtype=torch.float32, end: int | None = None):
        return dequantize_reference(self.state, self.spec, dtype, end=end)

    def attention(self, q: Tensor, mask: Tensor | None = None, scale: float | None = None,
                  k_new: Tensor | None = None, v_new: Tensor | None = None) -> Tensor:
        return attention_reference(q, self.state, self.spec, mask, scale, k_new=k_new, v_new=v_new)

    def crop(self, length: int) -> None:
        self.store.crop(length)

    def select(self, index) -> None:
        self.store.select(index)

    def reset(self) -> None:
        self.store.reset()
