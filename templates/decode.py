"""Decode attention at memory bandwidth: one query token per sequence over the packed store.

Reference: ``kvcompile.store.attention_reference`` for ``n == 1`` (over ``dequantize_reference``), within the
bound ``reference_and_bound(..., decode=True)`` of ``templates.attention`` states. ``templates.attention``'s
general kernel serves every other case (prefill, pre-RoPE keys, int3, token groups of fewer than one byte,
format "none"); ``launch.attention`` chooses (``decode_layout``), and ``templates.decode_configs.json`` says
which tiles each layout gets.

Decode reads each packed byte once and does little per byte: at 4.8 TB/s an H200 SM receives about 18 bytes a
clock and issues 128 thread-instructions, so the loop has about 7 instructions per byte at full bandwidth
(``benchmarks/gpu_sass.py`` counts them). What the kernel does for that:

- **One program per (sequence, KV head, split)**: the ``G`` query heads of the KV head are the rows of every
  ``tl.dot`` (padded to 16; where the products are batched per group, to a power of two only: ``decode_rows``),
  so each byte is read once for all of them. ``nsplit`` programs share a sequence's
  packed positions, in whole tiles, by the sequence's own length read on the device (no host sync; CUDA-graph
  capturable); one more program (``split == nsplit``) takes the full-precision positions (sinks, the residual
  ring, the queries' own chunk), and ``attention._merge_kernel`` merges all of them.
- **bf16 operands, fp32 accumulation**: codes become bf16 exactly; the query and the probabilities are rounded
  to bf16 (the bound says what that costs).
- **Scales on tiles, not elements** (mode TILE: one scale per token-head, fp16 or fp8 scales): with ``x = a c + b``
  per token, ``q.x = a (q.c) + b sum(q)`` and ``sum_n p_n x_n = sum_n (p_n a_n) c_n + sum_n p_n b_n``, so the
  scales multiply the [rows, BLOCK_N] score and probability tiles, never the [BLOCK_N, D] codes. Integers narrower
  than a byte become bf16 as ``128 + c`` by setting bits (``0x4300 | c``, no conversion instruction; on a GPU four
  bytes at a time in inline PTX, ``_UNPACK4`` / ``_UNPACK2``); the 128 is taken back in the key products'
  initial value (``-128 sum(q)``) and the values' row sums (``OFF``), or, where row sums would cost more (modes
  CHAN, GROUPS and ROWS), from the codes (one bf16 subtraction a pair).
  Values in per-token groups (KIVI's) scale the probabilities per group: groups of at least 16 bytes' slots
  take one batched product per group, a warp a group (mode GROUPS; their ``sum_n p_n b_n`` is one tf32 product
  a tile); smaller ones, beside GQA 4 and fewer, make the 16 rows of the products a row per query head and
  group, each keeping its group's channels (mode ROWS), or, from 8 columns a slot, take GROUPS where ROWS cannot
  or the keys are CHAN. Per-channel keys
  in token groups of at least 16 (KIVI's keys beside values on tiles or in GROUPS: mode CHAN) scale the query
  instead: with ``x = a_c c + b_c`` per channel over a group of tokens, ``q.x = sum_c (q_c a_c) c + sum_c q_c
  b_c``, so each group's tokens multiply their codes by ``bf16(q a)`` (a batched product per group) and add the
  group's ``q.b`` -- [rows, D] per group of tokens, not per token. Other layouts
  (smaller groups, per-channel values, fp32 scales) dequantize each element into bf16 (mode ELEM: ``a c + b`` in
  fp32, rounded once). fp8 with one fixed scale (axis="tensor", none stored) is TILE with ``a = 1``, nothing
  loaded; a poisoned token-head holds NaN codes instead of a NaN scale: e4m3's (0x7F, which the interpreter's bit
  trick reads as 480) is selected to NaN in the key tile, and in the value tile NaN codes are read as zeros and
  counted per channel where visible (that channel of the row becomes NaN, as ``attention_reference`` says) --
  compile-time, so other formats pay nothing.
- **No interleave**: a byte of int4 holds channels 2u and 2u+1 (``quant.pack``'s little-endian stream). The
  kernel keeps each of a byte's ``PER`` slots apart: slot ``i`` holds channels ``PER u + i``, u = 0..D/PER-1,
  and the query (and the output) are read (written) in that order. The dot product is the same sum in another
  order, and no unpacked tile is ever reshaped across threads (an interleaving reshape cost 2x the loop's
  instructions in a sm_90 compile: docs/results.md).
- **Padded heads**: a head that is no power of two (Phi-2's 80, Phi-3's 96) or whose byte slots are narrower
  than a dot operand (int2 at 32) is computed over a padded one (``padded_head``): the query zero past the head's
  own channels, the output there dropped, 8-bit codes read under a mask constant along the head's bytes (the
  loads keep their vectors), packed codes, words and value groups clamped to the head's last (``_own``: a mask
  there cost registers and spilled). Its tiles are the padded head's (``tile_config``).
- **Codes read as words**: int4 / int2 key codes reach each thread as 4-byte words (int2: halfwords), int4 values
  as halfwords (``key_words``, ``value_words``): sub-slot ``s`` of a word holds channels ``NS j + s`` (``NS`` =
  codes a word), a product per sub-slot, so that those codes are not loaded and packed into registers byte by
  byte (Triton's dot-operand layouts deliver single bytes otherwise: a load and a byte permute each). Values'
  sub-slots stay at least 32 channels wide, a product's columns for 4 warps.
- **Tiles by bytes**: BLOCK_N tokens per tile from the config table (int2 tiles hold more tokens than int8). A
  tile may span several blocks of the paged store: it starts one (BLOCK_N and every split's share are multiples
  of the block), so each row's offset in its block is the same every tile and only its block id is looked up
  (the next tile's are loaded while this one is computed; CHAN keys' tiles of over 128 tokens recompute the
  offsets, whose registers would spill). Integer codes are read unmasked (``_codes``).
- **Scores in log2 units**: the scale times log2(e) multiplies each token's scale and zero point, so that each
  exponential is one ``ex2.approx.ftz`` (``_exp2``); a split's max is stored times ln 2, the merge's units.
- **A prompt's rows as runs** (row-invariant, an engine's flat batch: ``kvcompile.pages``): the rows the products
  pad hold the query heads of the sequence's next positions, so a tile is read and unpacked once for up to
  16 / G rows (``run_rows``), each row's arithmetic as alone (its bits too: tested against the kernel without
  runs, which a decode step takes).
"""
import functools
import json
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompile.policy import Quant
from kvcompile.store import KVState, LayerSpec

from .attention import (_INTERP, _bf16, _dot, _full_tile, _merge_kernel, _online_step, layout_constexprs,
                        state_args)
from .common import INTERPRET, run, to_device
from .store import _boundary, _e4m3_value, nonempty

BF16_MAX = tl.constexpr(3.3895313892515355e38)  # torch.finfo(torch.bfloat16).max
MODE_TILE, MODE_ELEM, MODE_GROUPS, MODE_CHAN, MODE_ROWS = 0, 1, 2, 3, 4
MODES = {MODE_TILE: "tile", MODE_ELEM: "elem", MODE_GROUPS: "groups", MODE_CHAN: "chan", MODE_ROWS: "rows"}
# mode CHAN scales the query by a key group's scales in bf16: a query beyond this saturates there, so that no
# product with a scale (at most 2**24: fp16's largest, or e4m3 codes' 256 times an fp8 or fp16 scale) leaves bf16
CHAN_QMAX = tl.constexpr(3.3895313892515355e38 / 2.0 ** 24)
ROWS_MAX = 16  # mode ROWS: at most this many rows (query heads, padded to a power of two, times value groups)
CHAN_ROWS_MAX = 8  # ... and beside CHAN keys at most this many (``modes``)
# mode GROUPS: a group's columns in a slot (bytes' slots, D / G / (8 / bits)): from GROUPS_WIDE always, from
# GROUPS_MIN (one n8 product on the tensor cores) where ROWS cannot take the group or the keys are CHAN
GROUPS_WIDE, GROUPS_MIN = 16, 8
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_configs.json")


# --------------------------------------------------------------------------- which layouts, which mode
def padded_head(quants, head_dim: int) -> int:
    """The head the decode kernel computes over: ``head_dim`` padded to a power of two, and far enough that each
    quantized tensor's byte slots (``D / (8 / bits)`` channels) are at least one dot operand (16) wide (head_dim 80
    and 96, Phi-2's and Phi-3's, compute over 128; int2 at 32 over 64). The query is zero in the padded channels
    and the output's there are dropped; what the loads read there is zeros (8-bit codes, per-channel scales) or
    the token's own last byte, word or group again (``_own``), never another token's."""
    per = max([8 // q.bits for q in quants if q.quantized] or [1])
    return max(triton.next_power_of_2(head_dim), 16 * per)


def tensor_mode(q: Quant, head_dim: int, gqa: int | None = None, padded: int | None = None) -> int | None:
    """How the decode kernel reads one tensor stored as ``q``: the keys (``gqa`` None) or the values of a KV
    head read by ``gqa`` query heads. None: it cannot (the general kernel runs). ``padded``: the head the kernel
    computes over (``padded_head`` of both tensors; default: of this one).

    TILE: one scale per token-head (``group`` the whole head) with fp16 or fp8 scales (fp32 scales could
    overflow fp32 once the ``128 + c`` offset multiplies them), or none stored (fp8, axis="tensor": always TILE,
    a scale of 1.0 and the NaN codes of a poisoned token-head handled there). GROUPS (values only): per-token
    groups of at least ``GROUPS_WIDE`` bytes' slots (KIVI int4's values in 32-groups), the probabilities scaled
    per group, one batched product per group. ROWS (values only): smaller per-token groups of whole bytes where
    the query heads (padded to a power of two) times the groups are at most ``ROWS_MAX`` (int4 values in
    16-groups beside GQA 2): each row of the products is one query head's probabilities scaled by one group's
    scales and keeps that group's channels. Beyond that, GROUPS again from ``GROUPS_MIN`` slots (``modes`` also
    prefers it to ROWS beside CHAN keys: KIVI int2's 8-byte groups). CHAN (keys only):
    per-channel scales over token groups of at least 16 tokens (KIVI's keys), fp16 or fp8 scales, the query scaled
    per group. ELEM: any other grouping whose groups cover whole bytes. Formats: fp8, int8, int4, int2 (int3's
    3-byte units and format "none" are the general kernel's). Any head whose codes fill whole bytes: its channels
    are padded to ``padded`` (power-of-two groups tile it)."""
    if not q.quantized or q.format == "int3":
        return None
    per = 8 // q.bits
    if head_dim % per:
        return None  # a token's codes end inside a byte
    padded = padded or padded_head((q,), head_dim)
    g = q.group_for(head_dim)
    token = q.axis != "channel"  # axis="tensor" reads as per token-head, its scale 1.0 (not stored)
    values = gqa is not None
    if token and g == head_dim and q.scale_dtype != "float32":
        return MODE_TILE
    if not values and not token and g >= 16 and q.scale_dtype != "float32":
        return MODE_CHAN
    if token and g < per:
        return None  # a group inside a byte: its slots would need different scales
    if values and token and g // per >= GROUPS_WIDE and q.scale_dtype != "float32":
        return MODE_GROUPS
    if values and token and q.scale_dtype != "float32" and value_rows(padded, g, gqa) <= ROWS_MAX:
        return MODE_ROWS
    if values and token and g // per >= GROUPS_MIN and q.scale_dtype != "float32":
        return MODE_GROUPS
    return MODE_ELEM


def value_rows(head_dim: int, group: int, gqa: int) -> int:
    """Mode ROWS' rows: the query heads padded to a power of two, times the values' groups in a (padded) head."""
    return triton.next_power_of_2(gqa) * (head_dim // group)


def decode_rows(key_mode: int, value_mode: int, head_dim: int, value_group: int, gqa: int) -> int:
    """The rows of the kernel's products (``head_dim``: the padded head): the query heads padded to a power of
    two (mode ROWS: times the values' groups). Padded to 16 besides, except with CHAN keys or GROUPS values: their
    batched products put a warp on each group (of tokens, or of channels), and a product of fewer rows is padded
    inside the tensor cores only, so that the softmax, the scaled queries and the probabilities per group are
    computed for the real heads alone (sm_90, KIVI int4 at GQA 4: 12.63 loop instructions a byte at 16 rows,
    11.03 at 4). Layouts with one product for all tokens (TILE, ELEM) keep 16: with fewer rows Triton's layouts
    replicate their unpacking across warps (int4 at 4 rows: 18.08 against 7.05)."""
    rows = value_rows(head_dim, value_group, gqa) if value_mode == MODE_ROWS else triton.next_power_of_2(gqa)
    return rows if key_mode == MODE_CHAN or value_mode == MODE_GROUPS else max(16, rows)


def decode_layout(spec: LayerSpec, n: int, rope: bool, gqa: int) -> tuple[int, int] | None:
    """(key mode, value mode) when ``templates.decode`` serves this call (``gqa`` query heads a KV head), else
    None (the general kernel)."""
    pair = modes(spec.policy, spec.head_dim, gqa)
    return None if n != 1 or rope or None in pair else pair


def modes(policy, head_dim: int, gqa: int) -> tuple[int | None, int | None]:
    """(key mode, value mode) for this policy's layout read by ``gqa`` query heads a KV head: ``tensor_mode`` of
    each (None where the decode kernel cannot read that tensor) over the head both pad to (``padded_head``),
    except where the keys are CHAN. Beside them, ROWS stays where it takes at most ``CHAN_ROWS_MAX`` rows (KIVI
    with value groups of 16 channels beside one or two query heads a KV head, sm_90: int4 at head_dim 80, GQA 1,
    13.8 loop instructions a byte against 36.2 for GROUPS; int2 in 16-groups at 64, GQA 2, 18.3 against 30.5 for
    ROWS beside per-element keys; KIVI int2's 32-groups at 128, GQA 1, 14.1 against GROUPS' 13.9, the one case
    measured where it cost); with more rows CHAN spilled beside it. Then values in groups of ``GROUPS_MIN`` to
    ``GROUPS_WIDE`` columns take GROUPS (KIVI int2 at 128, GQA 4: 17.2 against 22.9 for ROWS beside per-element
    keys), and beside values ELEM or ROWS the keys are ELEM: there the scaled queries' registers cost more than
    they save. Beside TILE keys ROWS stays (int4 keys, int4 values in 16-groups, GQA 2: 9.3 against 17.0)."""
    padded = padded_head((policy.key, policy.value), head_dim)
    km, vm = tensor_mode(policy.key, head_dim, None, padded), tensor_mode(policy.value, head_dim, gqa, padded)
    v = policy.value
    if km == MODE_CHAN and vm == MODE_ROWS and value_rows(padded, v.group_for(head_dim), gqa) <= CHAN_ROWS_MAX:
        return km, vm
    if km == MODE_CHAN and vm == MODE_ROWS and v.group_for(head_dim) // (8 // v.bits) >= GROUPS_MIN:
        vm = MODE_GROUPS
    if km == MODE_CHAN and vm in (MODE_ELEM, MODE_ROWS):
        km = MODE_ELEM
    return km, vm


def format_key(q: Quant) -> str:
    """A tensor's format as the config table names it: format and grouping, not the scale dtype."""
    return f"{q.format}.{q.axis}.{'head' if q.group is None else q.group}"


@functools.lru_cache(maxsize=None)
def config_table() -> dict:
    with open(CONFIGS) as f:
        return json.load(f)


def tile_config(spec: LayerSpec, gqa: int) -> dict:
    """The tile (BLOCK_N tokens, warps, pipeline stages) for this layout: the table's entry for the keys' and
    values' formats, head_dim and GQA group, else the table's rule: tiles of about ``tile_bytes`` bytes of codes,
    at most ``max_block_n`` tokens (``elem_max_block_n`` where the values are dequantized per element: their
    scales and values spread over the tile take registers, KIVI int2 at 256 spilled 1.1 KB per thread on sm_90;
    ``elem_keys_max_block_n`` where only the keys are: KIVI int2 beside ROWS values never spilled at 128 tokens,
    head_dim 64 and 128, every GQA group that gives ROWS, and did at 256; ``chan_max_block_n`` for CHAN keys:
    KIVI int2 beside GROUPS values spilled at 256 tokens at GQA 2, 4 and 8, never at 128). A padded head
    (``padded_head``) without an entry of its own takes the entry of the head it is padded to, whose registers
    its tiles take (head_dim 96, fp8 at 128 tokens as the rule's bytes give it: 254 registers, 10.9 loop
    instructions a byte against 9.3 at the 128 head's 64 tokens), and the rule counts its padded bytes."""
    table = config_table()
    pk, pv = spec.policy.key, spec.policy.value
    padded = padded_head((pk, pv), spec.head_dim)
    for D in dict.fromkeys((spec.head_dim, padded)):
        key = f"{format_key(pk)}/{format_key(pv)};D={D};G={gqa}"
        if key in table["configs"]:
            return dict(table["configs"][key], source="table")
    bits = pk.bits + pv.bits  # bytes of codes per token: bits * D / 8
    per_token = bits * padded // 8
    rule = table["default"]
    km, vm = modes(spec.policy, spec.head_dim, gqa)
    top = rule["elem_max_block_n"] if vm == MODE_ELEM else rule["elem_keys_max_block_n"] if km == MODE_ELEM \
        else rule["chan_max_block_n"] if km == MODE_CHAN else rule["max_block_n"]
    block_n = max(16, min(top, triton.next_power_of_2(max(1, rule["tile_bytes"] // per_token))))
    return dict(block_n=block_n, warps=rule["warps"], stages=rule["stages"], source="rule")


# --------------------------------------------------------------------------- codes and affine terms
# On a GPU codes are unpacked by the hardware's instructions: int4 / int2 by inline PTX (``_UNPACK4`` /
# ``_UNPACK2``), e4m3 by its conversion; Triton's interpreter cannot run PTX and spells the same values in integer
# ops. KVCOMPILE_PTX_UNPACK=0 does that on a GPU too (and ``_exp2`` takes Triton's exp2): to tell them apart there.
_PTX = tl.constexpr(not INTERPRET and os.environ.get("KVCOMPILE_PTX_UNPACK", "1") != "0")
# what ``_affine`` multiplies an e4m3 scale by: ``_code_f32`` gives the value itself on a GPU, else over 2**8
_E4M3_SCALE = tl.constexpr(1.0 if _PTX.value else 256.0)


@triton.jit
def _code_f32(byte, I: tl.constexpr, BITS: tl.constexpr, KIND: tl.constexpr, E4M3: tl.constexpr):
    """The exact fp32 value of the code in slot ``I`` of each byte (int32 in [0, 256)): an integer code
    (through 2**23's mantissa, no conversion instruction), or an fp8 value (e4m3: the value over 2**8, except on a
    GPU, where the hardware's conversion, ``cvt.rn.f16x2.e4m3x2``, gives the value itself in a third of the
    instructions: ``_affine`` scales by ``_E4M3_SCALE`` to match)."""
    if KIND == 2:
        if E4M3 and _PTX:
            return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if E4M3:
            h = ((byte << 7) & 0x3F80) | ((byte << 8) & 0x8000)
        else:
            h = byte << 8
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if BITS == 8:
        c = byte
    else:
        c = (byte >> (BITS * I)) & ((1 << BITS) - 1)
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _code_tile(byte, I: tl.constexpr, BITS: tl.constexpr, KIND: tl.constexpr, E4M3: tl.constexpr):
    """bf16 codes of slot ``I`` for mode TILE: an integer narrower than a byte as ``128 + c`` (bits set into
    bf16's 128 binade: exact, ``OFF`` = 128 taken back later), anything else its exact value."""
    if KIND != 2 and BITS < 8:
        c = (byte >> (BITS * I)) & ((1 << BITS) - 1)
        return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return _code_f32(byte, I, BITS, KIND, E4M3).to(tl.bfloat16)


# A word of 4 code bytes -> each slot's 4 codes as bf16 ``128 + c``, two bf16x2 registers a slot: bytes 0, 1 spread
# into the word's halves (and bytes 2, 3: prmt, zeros from the second operand), then per slot a shift and
# ``(w & mask) | 0x43004300`` (lop3, 0xEA = (a & b) | c): about one instruction a code, where the same in Triton's
# integer ops (zero-extend, shift, mask, or, narrow, pair up) costs about three.
_UNPACK_HEAD = ("{.reg .b32 lo, hi, s; prmt.b32 lo, $$IN, 0, 0x4140; prmt.b32 hi, $$IN, 0, 0x4342; ")
_UNPACK4 = tl.constexpr(
    _UNPACK_HEAD.replace("$$IN", "$4")
    + "lop3.b32 $0, lo, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, hi, 0x000F000F, 0x43004300, 0xEA; "
    + "shr.b32 s, lo, 4; lop3.b32 $2, s, 0x000F000F, 0x43004300, 0xEA; "
    + "shr.b32 s, hi, 4; lop3.b32 $3, s, 0x000F000F, 0x43004300, 0xEA; }")
_UNPACK2 = tl.constexpr(
    _UNPACK_HEAD.replace("$$IN", "$8")
    + "lop3.b32 $0, lo, 0x00030003, 0x43004300, 0xEA; lop3.b32 $1, hi, 0x00030003, 0x43004300, 0xEA; "
    + "".join(f"shr.b32 s, lo, {2 * i}; lop3.b32 ${2 * i}, s, 0x00030003, 0x43004300, 0xEA; "
              f"shr.b32 s, hi, {2 * i}; lop3.b32 ${2 * i + 1}, s, 0x00030003, 0x43004300, 0xEA; " for i in (1, 2, 3))
    + "}")


@triton.jit
def _code_tiles(byte, BITS: tl.constexpr, KIND: tl.constexpr, E4M3: tl.constexpr):
    """``_code_tile`` of every slot of the bytes (4 tiles; slots past ``8 // BITS`` repeat slot 0). On a GPU an
    integer narrower than a byte is unpacked by ``_UNPACK4`` / ``_UNPACK2`` (the same bits); in Triton's
    interpreter, and for the other formats, slot by slot."""
    if _PTX and KIND != 2 and BITS == 4:
        t0, t1 = tl.inline_asm_elementwise(_UNPACK4, "=r,=r,=r,=r,r", [byte.to(tl.uint8)],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return t0, t1, t0, t0
    if _PTX and KIND != 2 and BITS == 2:
        return tl.inline_asm_elementwise(_UNPACK2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte.to(tl.uint8)],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=4)
    t0 = _code_tile(byte, 0, BITS, KIND, E4M3)
    t1 = t0
    t2 = t0
    t3 = t0
    if BITS < 8:
        t1 = _code_tile(byte, 1, BITS, KIND, E4M3)
    if BITS < 4:
        t2 = _code_tile(byte, 2, BITS, KIND, E4M3)
        t3 = _code_tile(byte, 3, BITS, KIND, E4M3)
    return t0, t1, t2, t3


@triton.jit
def _less_off(t, BITS: tl.constexpr, KIND: tl.constexpr):
    """A ``_code_tile`` tile with each code exactly its value: ``128 + c`` less 128, one bf16 subtraction a pair
    of codes (where a tile's row sums would cost more than that: modes CHAN and GROUPS)."""
    if KIND != 2 and BITS < 8:
        if _INTERP:  # Triton's interpreter does bf16 arithmetic on the bit patterns (as in ``attention._dot``)
            t = (t.to(tl.float32) - 128.0).to(tl.bfloat16)
        else:
            t = t - 128.0
    return t


@triton.jit
def _less_off4(t0, t1, t2, t3, BITS: tl.constexpr, KIND: tl.constexpr):
    """``_less_off`` of four slots' tiles."""
    return _less_off(t0, BITS, KIND), _less_off(t1, BITS, KIND), _less_off(t2, BITS, KIND), _less_off(t3, BITS, KIND)


@triton.jit
def _code_tiles_exact(byte, BITS: tl.constexpr, KIND: tl.constexpr, E4M3: tl.constexpr):
    """``_code_tiles`` with each code exactly its value (``_less_off``)."""
    t0, t1, t2, t3 = _code_tiles(byte, BITS, KIND, E4M3)
    return _less_off4(t0, t1, t2, t3, BITS, KIND)


def _unpack_words(bits: int, width: int) -> str:
    """PTX: two elements of ``width`` bytes (``pack=2``: two registers of words, or one of two halfwords) -> each
    sub-slot's two codes as bf16 ``128 + c`` in one register, sub-slot ``s = k * (8 // bits) + i`` (byte ``k`` of
    each element, its ``i``-th code), the first element's in the low half: per byte a prmt gathers the two
    elements' byte ``k`` into the halves, then per code a shift and one lop3, ``(w & mask) | 0x43004300``."""
    per, mask = 8 // bits, (1 << bits) - 1
    n = per * width
    asm = "{.reg .b32 d, s; "
    for k in range(width):
        if width == 4:  # $n, $n+1: the two words; prmt's bytes 0-3 are the first's, 4-7 the second's
            asm += f"prmt.b32 d, ${n}, ${n + 1}, {hex(k | k << 4 | (k + 4) << 8 | (k + 4) << 12)}; "
        else:  # $n: the two halfwords, the first in bytes 0-1
            asm += f"prmt.b32 d, ${n}, 0, {hex(k | k << 4 | (k + 2) << 8 | (k + 2) << 12)}; "
        for i in range(per):
            src = "d" if i == 0 else "s"
            if i:
                asm += f"shr.b32 s, d, {bits * i}; "
            asm += f"lop3.b32 ${k * per + i}, {src}, {hex(mask | mask << 16)}, 0x43004300, 0xEA; "
    return asm + "}"


def key_words(q: Quant, head_dim: int, mode: int | None, padded: int | None = None) -> int:
    """Bytes a mode-TILE key tile reads as one element (4, 2, or 1): int4 / int2 codes as words or halfwords of
    ``8 // bits * width`` sub-slots, each at least a dot operand (16 channels) wide in the ``padded`` head and at
    most 8 of them, a token's codes whole words. A word
    of a token's row reaches a thread whole (its byte loads and the packing of bytes into words gone) and feeds
    ``_unpack_words``' PTX (``_word_tiles``)."""
    if mode != MODE_TILE or not q.is_int or q.bits >= 8:
        return 1
    per, padded = 8 // q.bits, padded or head_dim
    return next((w for w in (4, 2) if per * w <= 8 and padded // (per * w) >= 16 and head_dim % (per * w) == 0), 1)


def value_words(q: Quant, head_dim: int, mode: int | None, padded: int | None = None) -> int:
    """Bytes a value tile in mode TILE, ROWS or GROUPS reads as one element (2 or 1): int4 codes as halfwords,
    four sub-slots. TILE and ROWS: sub-slots of at least 32 channels of the ``padded`` head (a product's columns
    for 4 warps: narrower, each warp would unpack them all). GROUPS (a warp a group): a group's sub-slots at least
    8 channels wide (one product's columns on the tensor cores)."""
    if not q.is_int or q.bits != 4:
        return 1
    if mode in (MODE_TILE, MODE_ROWS):
        return 2 if (padded or head_dim) // 4 >= 32 and head_dim % 4 == 0 else 1
    return 2 if mode == MODE_GROUPS and q.group_for(head_dim) // 4 >= GROUPS_MIN else 1


_UNPACK_W4_INT4 = tl.constexpr(_unpack_words(4, 4))
_UNPACK_W2_INT4 = tl.constexpr(_unpack_words(4, 2))
_UNPACK_W2_INT2 = tl.constexpr(_unpack_words(2, 2))


@triton.jit
def _word_tile(word, S: tl.constexpr, BITS: tl.constexpr):
    """Sub-slot ``S`` of the words (int32 or int16): code ``S % (8 // BITS)`` of byte ``S // (8 // BITS)``, as
    bf16 ``128 + c`` (``_code_tile``'s bits)."""
    PER: tl.constexpr = 8 // BITS
    c = (word.to(tl.int32) >> (8 * (S // PER) + BITS * (S % PER))) & ((1 << BITS) - 1)
    return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _word_tiles(word, BITS: tl.constexpr, W: tl.constexpr):
    """The sub-slots of int4 / int2 words (``key_words``: 8, or 4 for int4 halfwords; the rest repeat sub-slot
    0): on a GPU by ``_unpack_words``' PTX, in the interpreter by ``_word_tile``."""
    if _PTX and W == 4:
        return tl.inline_asm_elementwise(_UNPACK_W4_INT4, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [word],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    if _PTX and BITS == 2:
        return tl.inline_asm_elementwise(_UNPACK_W2_INT2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [word],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    if _PTX:
        t0, t1, t2, t3 = tl.inline_asm_elementwise(_UNPACK_W2_INT4, "=r,=r,=r,=r,r", [word],
                                                   dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        return t0, t1, t2, t3, t0, t0, t0, t0
    t0 = _word_tile(word, 0, BITS)
    t1 = _word_tile(word, 1, BITS)
    t2 = _word_tile(word, 2, BITS)
    t3 = _word_tile(word, 3, BITS)
    if (8 // BITS) * W > 4:
        return t0, t1, t2, t3, _word_tile(word, 4, BITS), _word_tile(word, 5, BITS), _word_tile(word, 6, BITS), \
            _word_tile(word, 7, BITS)
    return t0, t1, t2, t3, t0, t0, t0, t0


@triton.jit
def _query_sub(qb_ptr, qok, j, S: tl.constexpr, NS: tl.constexpr):
    """The query's channels ``NS j + S`` (a key sub-slot), saturated at and rounded to bf16, transposed:
    [channels, rows]."""
    x = tl.load(qb_ptr + NS * j[None, :] + S, mask=qok, other=0.0)
    return tl.trans(_bf16(tl.minimum(tl.maximum(x, -BF16_MAX), BF16_MAX)))


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_EX2 = tl.constexpr("ex2.approx.ftz.f32 $0, $1;")


@triton.jit
def _exp2(x):
    """2**x: on a GPU one ``ex2.approx.ftz`` (Triton's exp2 adds the steps that keep results below 2**-126
    subnormal: three more instructions a score, for probabilities that weigh nothing beside the row's largest, 1),
    elsewhere ``tl.exp2``."""
    if _PTX:
        y = tl.inline_asm_elementwise(_EX2, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _codes(ptr, ok, lane, KIND: tl.constexpr, PAD: tl.constexpr):
    """A tile's codes. An integer format's are read unmasked: a position past the tile's end lies in its row's
    block (or block 0, where the table has none: the block id's load is masked), so it reads finite codes whose
    scores and probabilities the visibility masks (the scales stay masked). fp8's are masked (a stale byte may be
    a NaN code, and 0 times NaN is NaN). PAD (8-bit codes of a padded head): ``lane`` masks the bytes past the
    head's own, which read zeros -- never the next token's (a mask constant along the head's own bytes keeps the
    loads' vectors, where clamping the lanes to the last byte, ``_own``, cost them: fp8 at head_dim 96, 13.2 loop
    instructions a byte against 10.0)."""
    if KIND == 2:
        if PAD:
            x = tl.load(ptr, mask=ok & lane, other=0)
        else:
            x = tl.load(ptr, mask=ok, other=0)
    elif PAD:
        x = tl.load(ptr, mask=lane, other=0)
    else:
        x = tl.load(ptr)
    return x


@triton.jit
def _own(i, n: tl.constexpr, PAD: tl.constexpr):
    """Lane indices ``i`` as a padded head's loads take them (PAD): the lanes past the head's own ``n`` (bytes,
    words, channels, groups) read its last one again -- the token's own data, so nothing past its row is read and
    nothing non-finite arrives there that the token's own lanes do not already carry. The query is zero in those
    lanes (masked) and the outputs there are dropped, so what they read weighs nothing; no mask in the loop."""
    if PAD:
        i = tl.minimum(i, n - 1)
    return i


@triton.jit
def _fixed_nan(byte, E4M3: tl.constexpr):
    """Where a byte holds an fp8 NaN code (int32 bytes): e4m3fn's 0x7F / 0xFF, e5m2's 0x7D-0x7F / 0xFD-0xFF. With
    one fixed scale (SFMT 3) a poisoned token-head's codes are 0x7F; e4m3's decodes (``_code_f32``) to 480, not
    NaN, so the kernel selects NaN there; e5m2's is an fp16 NaN already."""
    if E4M3:
        return (byte & 0x7F) == 0x7F
    return (byte & 0x7F) > 0x7C


@triton.jit
def _affine(s_ptr, z_ptr, off, ok, KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr,
            SFMT: tl.constexpr):
    """``(a, b)`` fp32 with ``x^ = a * code + b`` (``quant.dequantize``), from the scale and zero point at
    ``off``: asymmetric ``(s, z)``, or ``(s, -z s)`` with fp8 scales and int8 zero points; symmetric
    ``(s, -2**(bits-1) s)``; fp8 ``(s, 0)`` (e4m3: ``s * _E4M3_SCALE``, the unit of ``_code_f32``). A poisoned
    group's NaN scale makes both NaN. Masked-out entries are (0, 0). SFMT 3 (fp8, axis="tensor"): the fixed
    scale, 1.0, nothing loaded (``s_ptr`` is a placeholder); its NaN codes are the caller's (``_fixed_nan``)."""
    if SFMT == 3:
        one = tl.where(ok, 1.0, 0.0) + tl.zeros_like(off).to(tl.float32)  # [off's shape]
        if E4M3:
            return one * _E4M3_SCALE, one * 0.0
        return one, one * 0.0
    if SFMT == 2:
        sb = tl.load(s_ptr + off, mask=ok, other=0).to(tl.int32)
        s = tl.where(sb == 0x7F, float("nan"), _e4m3_value(sb))
    else:
        s = tl.load(s_ptr + off, mask=ok, other=0.0).to(tl.float32)
    if KIND == 0:
        if SFMT == 2:
            z = tl.load(z_ptr + off, mask=ok, other=0).to(tl.float32)
            return s, -(z * s)
        return s, tl.load(z_ptr + off, mask=ok, other=0.0).to(tl.float32)
    elif KIND == 1:
        return s, -(s * float(1 << (BITS - 1)))
    elif E4M3:
        return s * _E4M3_SCALE, s * 0.0
    return s, s * 0.0


# --------------------------------------------------------------------------- the kernel
@triton.jit
def _decode_kernel(
    q_ptr, ws_acc, ws_ml, run_ptr,
    kc, ks, kz, vc, vs, vz, kr, vr, ksk, vsk, len_ptr, tbl_ptr, mask_ptr, kn, vn,
    sq_b, sq_h,  # q [B, Hq, 1, D] fp32, unit stride along D
    skc_nb, skc_h, skc_t, sks_nb, sks_h, sks_t,  # key codes, key scale/zero: per block [NB, H, ...]
    svc_nb, svc_h, svc_t, svs_nb, svs_h, svs_t,  # value codes, value scale/zero
    sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t,  # rings, sinks
    st_b,  # block table [B, MB]
    sm_b, sm_h, sm_c, P,  # mask [B, Hq, 1, P]
    H, Hq, sm_scale, nsplit, split_min, split_max,
    D: tl.constexpr, DR: tl.constexpr, S: tl.constexpr, R: tl.constexpr, F: tl.constexpr, W: tl.constexpr,
    BS: tl.constexpr, K_MODE: tl.constexpr, K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_E4M3: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_G: tl.constexpr, K_SFMT: tl.constexpr, K_W: tl.constexpr, V_W: tl.constexpr,
    V_MODE: tl.constexpr, V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_E4M3: tl.constexpr,
    V_CHANNEL: tl.constexpr, V_G: tl.constexpr, V_SFMT: tl.constexpr,
    G: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr,
    CHUNK: tl.constexpr, FULL: tl.constexpr, STAGES: tl.constexpr, NGV: tl.constexpr, WGV: tl.constexpr,
    INVARIANT: tl.constexpr, RUN: tl.constexpr,
):
    """Program (b*H + h, split): rows = the G query heads of KV head h (padded to M = 16); channels: D, the head's
    DR padded (``padded_head``; PAD: the channels from DR on are masked: zeros in, dropped out); in mode ROWS the
    values' NGV groups times those heads (padded to M // NGV): row ``j * (M // NGV) + i`` is query head ``i``
    weighted by group ``j``'s scales, and keeps group ``j``'s channels. With RUN (``run_rows``), ``b`` is a run
    of up to RUN batch rows of one sequence (``run_ptr``: offsets), row ``r * (M // RUN) + i`` query head ``i``
    of its ``r``-th: they share the run's block table and tiles, each masks the positions past its own end.

    Splits ``0 .. nsplit-1`` read the packed positions ``[S, Q(L))`` (up to ``L - 1`` with CHUNK: the query's
    own token comes from the chunk), ``ceil`` of an equal share each in whole tiles; split ``nsplit`` (with
    FULL) reads the full-precision positions as ``attention._attn_kernel`` does (DOT operands). Each writes its
    partial ``(acc, max, sum)`` to ``ws_acc [B, Hq, 1, nsplit + FULL, D]`` / ``ws_ml`` for ``_merge_kernel``.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    PAD: tl.constexpr = DR < D
    b = bh // H
    h = bh % H
    m = tl.arange(0, M)
    GR: tl.constexpr = M // NGV  # ROWS: the rows of one value group
    if RUN > 1:  # a run of up to RUN rows of one sequence (``run_rows``): row ``r`` of it takes rows r GP .. + GP
        GP: tl.constexpr = M // RUN
        first = tl.load(run_ptr + b)
        cnt = tl.load(run_ptr + b + 1) - first  # 0 past the call's runs (``run_offsets``: the grid is a bound)
        mh = m % GP
        mg = m * 0
        rb = first + tl.minimum(m // GP, cnt - 1)  # [M] each row's batch row (past the run's: its last, masked)
        b = first + tl.minimum(cnt - 1, 0)  # the run's block table: one sequence's (no run: the last row's, unread)
        row_ok = (mh < G) & (m // GP < cnt)
    else:
        if V_MODE == 4:  # ROWS: NGV copies of the query heads, one a value group
            mh = m % GR
            mg = m // GR
        else:
            mh = m
            mg = m * 0
        rb = b
        row_ok = mh < G
    row_one = row_ok & (mg == 0)  # each query head once: the rows whose max and sum are written
    nslots = nsplit + FULL
    L, end, QL, hq, mask_rows, w_row = _row_frame(len_ptr, mask_ptr, rb, mh, h, split, nslots, sm_b, sm_h, Hq, P,
                                                  G, S, R, F, MASK_KIND)  # [M] each
    if split < nsplit:
        if CHUNK:
            stop = tl.minimum(tl.minimum(QL, end), tl.maximum(L - 1, S))
        else:
            stop = tl.minimum(QL, end)
        if RUN > 1:  # the rows' splits are the same (``run_rows``): the longest row's (no rows: none, no tiles)
            top = tl.max(tl.where(row_ok, stop, S), 0)
        else:
            top = stop
        if INVARIANT:  # the row's own splits (SPLIT_MIN_TILES, SPLIT_MAX): one past its positions is empty
            per = tl.maximum(split_min, tl.cdiv(tl.cdiv(tl.maximum(top - S, 0), split_max), BLOCK_N) * BLOCK_N)
        else:
            per = tl.cdiv(tl.cdiv(tl.maximum(top - S, 0), nsplit), BLOCK_N) * BLOCK_N
        lo = S + split * per
        hi_row = tl.minimum(lo + per, stop)  # [M] with RUN: each row's end, which its visibility masks
        hi = tl.minimum(lo + per, top)
        PK: tl.constexpr = 8 // K_BITS
        PV: tl.constexpr = 8 // V_BITS
        UK: tl.constexpr = D // PK
        UV: tl.constexpr = D // PV
        uk = tl.arange(0, UK)
        uv = tl.arange(0, UV)
        VNS: tl.constexpr = PV * V_W  # the values' (sub-)slots, channel VNS j + s (``value_words``)
        jv = tl.arange(0, D // VNS)
        # the query in slot order (channel PK u + i), fp32 and rounded to bf16; the rows' sums for TILE
        qok = row_ok[:, None]
        klane = (uk < DR // PK)[None, :]  # the head's own channels (PK u + i < DR), its key bytes
        qlane = qok & klane
        qb_ptr = q_ptr + (rb.to(tl.int64) * sq_b + hq.to(tl.int64) * sq_h)[:, None]
        # (a query beyond bf16's range saturates there, as the elements do: inf would turn finite scores to NaN)
        q0 = tl.minimum(tl.maximum(tl.load(qb_ptr + PK * uk[None, :], mask=qlane, other=0.0), -BF16_MAX), BF16_MAX)
        qb0 = _bf16(q0)
        qsum = tl.sum(q0, 1)
        qbsum = tl.sum(qb0.to(tl.float32), 1)
        if PK > 1:
            q1 = tl.minimum(tl.maximum(tl.load(qb_ptr + PK * uk[None, :] + 1, mask=qlane, other=0.0), -BF16_MAX),
                             BF16_MAX)
            qb1 = _bf16(q1)
            qsum += tl.sum(q1, 1)
            qbsum += tl.sum(qb1.to(tl.float32), 1)
        else:
            qb1 = qb0
        if PK > 2:
            q2 = tl.minimum(tl.maximum(tl.load(qb_ptr + PK * uk[None, :] + 2, mask=qlane, other=0.0), -BF16_MAX),
                             BF16_MAX)
            q3 = tl.minimum(tl.maximum(tl.load(qb_ptr + PK * uk[None, :] + 3, mask=qlane, other=0.0), -BF16_MAX),
                             BF16_MAX)
            qb2 = _bf16(q2)
            qb3 = _bf16(q3)
            qsum += tl.sum(q2, 1) + tl.sum(q3, 1)
            qbsum += tl.sum(qb2.to(tl.float32), 1) + tl.sum(qb3.to(tl.float32), 1)
        else:
            qb2 = qb0
            qb3 = qb0
        qt0 = tl.trans(qb0)
        qt1 = tl.trans(qb1)
        qt2 = tl.trans(qb2)
        qt3 = tl.trans(qb3)
        KNS: tl.constexpr = PK * K_W  # K_W > 1: the keys' sub-slots, channel KNS j + s (``key_words``)
        jw = tl.arange(0, D // KNS)
        # a padded head's loads: 8-bit codes masked past the head's own (``_codes``); packed codes, words and
        # value groups clamped to its last (``_own``; masks there cost registers: int4 words at head_dim 80 spilled
        # 1.1 KB a thread, int2 bytes at 96 0.6 KB)
        KM: tl.constexpr = PAD & (PK == 1)
        VM: tl.constexpr = PAD & (PV == 1)
        vlane = (uv < DR // PV)[None, :]
        ukl = _own(uk, DR // PK, PAD & (PK > 1))
        uvl = _own(uv, DR // PV, PAD & (PV > 1))
        qwok = qok & (jw < DR // KNS)[None, :]  # the query's own channels in key words
        jwl = _own(jw, DR // KNS, PAD)
        jvl = _own(jv, DR // VNS, PAD)
        gvl = _own(tl.arange(0, NGV), DR // V_G, PAD)
        if K_W > 1:
            qw0 = _query_sub(qb_ptr, qwok, jw, 0, KNS)
            qw1 = _query_sub(qb_ptr, qwok, jw, 1, KNS)
            qw2 = _query_sub(qb_ptr, qwok, jw, 2, KNS)
            qw3 = _query_sub(qb_ptr, qwok, jw, 3, KNS)
            if KNS > 4:
                qw4 = _query_sub(qb_ptr, qwok, jw, 4, KNS)
                qw5 = _query_sub(qb_ptr, qwok, jw, 5, KNS)
                qw6 = _query_sub(qb_ptr, qwok, jw, 6, KNS)
                qw7 = _query_sub(qb_ptr, qwok, jw, 7, KNS)
            else:
                qw4 = qw0
                qw5 = qw0
                qw6 = qw0
                qw7 = qw0
        if K_MODE == 3:  # CHAN: the fp32 query slots, [U, rows], saturated so that q a stays inside bf16
            qf0 = tl.trans(tl.minimum(tl.maximum(q0, -CHAN_QMAX), CHAN_QMAX))
            qf1 = qf0
            qf2 = qf0
            qf3 = qf0
            if PK > 1:
                qf1 = tl.trans(tl.minimum(tl.maximum(q1, -CHAN_QMAX), CHAN_QMAX))
            if PK > 2:
                qf2 = tl.trans(tl.minimum(tl.maximum(q2, -CHAN_QMAX), CHAN_QMAX))
                qf3 = tl.trans(tl.minimum(tl.maximum(q3, -CHAN_QMAX), CHAN_QMAX))

        # scores in log2 units (exp2 is one instruction): the scale times log2(e); the max stored times ln(2)
        qk_scale = sm_scale * LOG2E
        if K_MODE == 0 and K_KIND != 2 and K_BITS < 8:  # TILE keys' codes are 128 + c: products start at -q OFF
            qinit = tl.zeros([BLOCK_N, M], tl.float32) - (qbsum * 128.0)[None, :]
        else:
            qinit = None
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        bsum = tl.zeros([M], tl.float32)  # TILE / ROWS values: sum of p b (TILE: less OFF sum p' for 128 + c)
        acc0 = tl.zeros([M, D // VNS], tl.float32)
        acc1 = tl.zeros([M, D // VNS], tl.float32)
        acc2 = tl.zeros([M, D // VNS], tl.float32)
        acc3 = tl.zeros([M, D // VNS], tl.float32)
        gv = tl.arange(0, NGV)  # GROUPS values: per group of channels, [groups, rows, group's U-columns]
        wv = tl.arange(0, WGV // V_W)  # a group's (half)words; sub-slot s: the group's channels VNS w + s
        accg0 = tl.zeros([NGV, M, WGV // V_W], tl.float32)
        accg1 = tl.zeros([NGV, M, WGV // V_W], tl.float32)
        accg2 = tl.zeros([NGV, M, WGV // V_W], tl.float32)
        accg3 = tl.zeros([NGV, M, WGV // V_W], tl.float32)
        bsumg = tl.zeros([NGV, M], tl.float32)
        hit0 = tl.zeros([M, D // VNS], tl.float32)  # ELEM values: visible poisoned positions per channel
        hit1 = tl.zeros([M, D // VNS], tl.float32)
        hit2 = tl.zeros([M, D // VNS], tl.float32)
        hit3 = tl.zeros([M, D // VNS], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        tbl = tbl_ptr + b.to(tl.int64) * st_b
        kch = kc + h.to(tl.int64) * skc_h
        if K_W > 1:  # the key codes as words (``key_words``), their strides in words
            kcw = kch.to(tl.pointer_type(tl.int32 if K_W == 4 else tl.int16))
            wk_nb = skc_nb // K_W
            wk_t = skc_t // K_W
        vch = vc + h.to(tl.int64) * svc_h
        if V_W > 1:  # the value codes as halfwords (``value_words``), their strides in halfwords
            vcw = vch.to(tl.pointer_type(tl.int16))
            wv_nb = svc_nb // V_W
            wv_t = svc_t // V_W
        ksh = h.to(tl.int64) * sks_h
        vsh = h.to(tl.int64) * svs_h
        # the first tile's block (ONE_BLOCK: a tile lies in one block, BLOCK_N <= BS) or each row's block; the
        # loop loads the next tile's while it computes this one
        ONE_BLOCK: tl.constexpr = BLOCK_N <= BS
        if ONE_BLOCK:
            blk = tl.load(tbl + (lo - S) // BS, mask=lo < hi, other=0).to(tl.int64)
        else:
            blk = tl.load(tbl + (lo - S) // BS + offs // BS, mask=lo + offs < hi, other=0).to(tl.int64)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            p = start + offs
            kv_ok = p < hi
            nxt = start + BLOCK_N
            if ONE_BLOCK:
                row = (start - S) % BS + offs
                blk_next = tl.load(tbl + (nxt - S) // BS, mask=nxt < hi, other=0).to(tl.int64)
            else:
                # a tile starts a block (BLOCK_N and the splits are multiples of BS), so the rows' offsets are
                # fixed; CHAN keys' 256-token tiles recompute them each tile (their registers: KIVI int4 spilled)
                if K_MODE == 3 and BLOCK_N > 128:
                    row = (p - S) % BS
                else:
                    row = offs % BS
                blk_next = tl.load(tbl + (nxt - S) // BS + offs // BS, mask=nxt + offs < hi, other=0).to(tl.int64)
            # ---- scores
            if K_W == 1:
                kbyte = _codes(kch + (blk * skc_nb + row * skc_t)[:, None] + ukl[None, :], kv_ok[:, None], klane,
                               K_KIND, KM).to(tl.int32)
            if K_MODE == 0:
                ka, kb = _affine(ks, kz, blk * sks_nb + ksh + row * sks_t, kv_ok, K_KIND, K_BITS, K_E4M3, K_SFMT)
                # tokens as the rows (M) of the products: the codes are the A operand, made in registers
                if K_W > 1:  # whole words of each token's row, their sub-slots
                    kword = _codes(kcw + (blk * wk_nb + row * wk_t)[:, None] + jwl[None, :], kv_ok[:, None], None,
                                   K_KIND, False)
                    kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7 = _word_tiles(kword, K_BITS, K_W)
                    raw = _qk_slots(qinit, kw0, kw1, kw2, kw3, qw0, qw1, qw2, qw3, 4)
                    if KNS > 4:
                        raw = _qk_slots(raw, kw4, kw5, kw6, kw7, qw4, qw5, qw6, qw7, 4)
                else:
                    kt0, kt1, kt2, kt3 = _code_tiles(kbyte, K_BITS, K_KIND, K_E4M3)
                    if K_SFMT == 3 and K_E4M3:  # a NaN code (a poisoned token-head): its scores are NaN
                        kt0 = tl.where(_fixed_nan(kbyte, True), float("nan"), kt0.to(tl.float32)).to(tl.bfloat16)
                    raw = _qk_slots(qinit, kt0, kt1, kt2, kt3, qt0, qt1, qt2, qt3, PK)
                raw = tl.trans(raw)  # q (c + OFF) less q OFF (the products' initial value)
                s = raw * (ka * qk_scale)[None, :] + qsum[:, None] * (kb * qk_scale)[None, :]
            elif K_MODE == 3:  # a product per group of K_G tokens, its query scaled by the group's scales
                NT: tl.constexpr = BLOCK_N // K_G
                kc0, kc1, kc2, kc3 = _code_tiles_exact(tl.reshape(kbyte, (NT, K_G, UK)), K_BITS, K_KIND, K_E4M3)
                raw3 = tl.zeros([NT, K_G, M], tl.float32)
                corr = tl.zeros([NT, M], tl.float32)
                raw3, corr = _chan_qk(raw3, corr, kc0, qf0, 0, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh,
                                      sks_nb, sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_G, K_KIND, K_BITS, K_E4M3,
                                      K_SFMT, DR)
                if PK > 1:
                    raw3, corr = _chan_qk(raw3, corr, kc1, qf1, 1, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh,
                                          sks_nb, sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_G, K_KIND, K_BITS, K_E4M3,
                                          K_SFMT, DR)
                if PK > 2:
                    raw3, corr = _chan_qk(raw3, corr, kc2, qf2, 2, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh,
                                          sks_nb, sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_G, K_KIND, K_BITS, K_E4M3,
                                          K_SFMT, DR)
                    raw3, corr = _chan_qk(raw3, corr, kc3, qf3, 3, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh,
                                          sks_nb, sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_G, K_KIND, K_BITS, K_E4M3,
                                          K_SFMT, DR)
                s = tl.trans(tl.reshape((raw3 + corr[:, None, :]) * qk_scale, (BLOCK_N, M)))
            else:
                raw = _elem_qk(None, qt0, kbyte, 0, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh, sks_nb, sks_t,
                               uk, tbl, PK, UK, BLOCK_N, BS, K_CHANNEL, K_G, K_KIND, K_BITS, K_E4M3, K_SFMT, DR)
                if PK > 1:
                    raw = _elem_qk(raw, qt1, kbyte, 1, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh, sks_nb,
                                   sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_CHANNEL, K_G, K_KIND, K_BITS, K_E4M3,
                                   K_SFMT, DR)
                if PK > 2:
                    raw = _elem_qk(raw, qt2, kbyte, 2, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh, sks_nb,
                                   sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_CHANNEL, K_G, K_KIND, K_BITS, K_E4M3,
                                   K_SFMT, DR)
                    raw = _elem_qk(raw, qt3, kbyte, 3, ks, kz, blk, row, start - S, hi - S, kv_ok, ksh, sks_nb,
                                   sks_t, uk, tbl, PK, UK, BLOCK_N, BS, K_CHANNEL, K_G, K_KIND, K_BITS, K_E4M3,
                                   K_SFMT, DR)
                s = tl.trans(raw) * qk_scale
            # ---- visibility and online softmax (as attention._online_step, without its value checks)
            if RUN > 1:  # past a row's own end its positions are another row's (finite codes: ``run_rows``)
                vis = row_ok[:, None] & (p[None, :] < hi_row[:, None])
            else:
                vis = row_ok[:, None] & kv_ok[None, :]
            if MASK_KIND == 1:
                mv = tl.load(mask_rows + p.to(tl.int64)[None, :] * sm_c, mask=vis, other=0)
                vis = vis & (mv != 0)
            elif MASK_KIND == 2:
                mv = tl.load(mask_rows + p.to(tl.int64)[None, :] * sm_c, mask=vis, other=0.0).to(tl.float32)
                vis = vis & (mv != float("-inf"))
                s = s + mv * LOG2E
            fin = tl.abs(s) < float("inf")
            bad = tl.max(tl.where(vis & ~fin, 1, 0), 1) > 0
            s = tl.where(vis & fin, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = _exp2(m_i - m_use)
            pr = _exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            l_i = tl.where(bad, float("nan"), l_i)
            m_i = m_new
            # ---- values
            if V_MODE == 2:  # p' per group: [groups, rows, BLOCK_N] against [groups, BLOCK_N, group's columns]
                va, vb = _affine(vs, vz, (blk * svs_nb + vsh + row * svs_t)[:, None] + gvl[None, :], kv_ok[:, None],
                                 V_KIND, V_BITS, V_E4M3, V_SFMT)  # [BLOCK_N, groups]
                pa3 = _bf16(tl.where(vis[None, :, :], pr[None, :, :] * tl.trans(va)[:, None, :], 0.0))
                # sum_n p b per group: one tf32 product. A poisoned group's NaN reaches the rows that see it through
                # pa3; with a mask, rows that do not see it must not get it here (without one, every row sees it)
                if MASK_KIND != 0:
                    vb = tl.where(vb == vb, vb, 0.0)
                bsumg = bsumg * alpha[None, :] + tl.trans(tl.dot(pr, vb, input_precision="tf32"))
                if V_W > 1:
                    vword3 = _codes(vcw + (blk * wv_nb + row * wv_t)[None, :, None]
                                    + (gvl[:, None, None] * (WGV // V_W) + wv[None, None, :]), kv_ok[None, :, None],
                                    None, V_KIND, False)
                    vg0, vg1, vg2, vg3, _, _, _, _ = _word_tiles(vword3, V_BITS, V_W)
                    vg0, vg1, vg2, vg3 = _less_off4(vg0, vg1, vg2, vg3, V_BITS, V_KIND)
                else:
                    vbyte3 = _codes(vch + (blk * svc_nb + row * svc_t)[None, :, None]
                                    + (gvl[:, None, None] * WGV + wv[None, None, :]), kv_ok[None, :, None],
                                    None, V_KIND, False).to(tl.int32)
                    vg0, vg1, vg2, vg3 = _code_tiles_exact(vbyte3, V_BITS, V_KIND, V_E4M3)
                accg0, accg1, accg2, accg3 = _pv_slots(accg0, accg1, accg2, accg3, pa3, vg0, vg1, vg2, vg3,
                                                       alpha[None, :, None], VNS)
            elif V_W > 1:
                vword = _codes(vcw + (blk * wv_nb + row * wv_t)[:, None] + jvl[None, :], kv_ok[:, None], None,
                               V_KIND, False)
            else:
                vbyte = _codes(vch + (blk * svc_nb + row * svc_t)[:, None] + uvl[None, :], kv_ok[:, None], vlane,
                               V_KIND, VM).to(tl.int32)
            if V_MODE == 4:  # each row's own group's scales: [rows, BLOCK_N]
                va, vb = _affine(vs, vz, (blk * svs_nb + vsh + row * svs_t)[None, :] + gvl[:, None], kv_ok[None, :],
                                 V_KIND, V_BITS, V_E4M3, V_SFMT)  # [groups, BLOCK_N]
                va = tl.reshape(tl.broadcast_to(va[:, None, :], (NGV, GR, BLOCK_N)), (M, BLOCK_N))
                vb = tl.reshape(tl.broadcast_to(vb[:, None, :], (NGV, GR, BLOCK_N)), (M, BLOCK_N))
                pa = _bf16(tl.where(vis, pr * va, 0.0))  # hidden positions: never NaN * 0
                bsum = bsum * alpha + tl.sum(tl.where(vis, pr * vb, 0.0), 1)
                if V_W > 1:
                    vt0, vt1, vt2, vt3, _, _, _, _ = _word_tiles(vword, V_BITS, V_W)
                    vt0, vt1, vt2, vt3 = _less_off4(vt0, vt1, vt2, vt3, V_BITS, V_KIND)
                else:
                    vt0, vt1, vt2, vt3 = _code_tiles_exact(vbyte, V_BITS, V_KIND, V_E4M3)
                acc0, acc1, acc2, acc3 = _pv_slots(acc0, acc1, acc2, acc3, pa, vt0, vt1, vt2, vt3, alpha[:, None], VNS)
            elif V_MODE == 0:
                va, vb = _affine(vs, vz, blk * svs_nb + vsh + row * svs_t, kv_ok, V_KIND, V_BITS, V_E4M3, V_SFMT)
                pa = _bf16(tl.where(vis, pr * va[None, :], 0.0))  # hidden positions: never NaN * 0
                if V_KIND != 2 and V_BITS < 8:
                    bsum = bsum * alpha + tl.sum(tl.where(vis, pr * vb[None, :], 0.0) - 128.0 * pa.to(tl.float32), 1)
                else:
                    bsum = bsum * alpha + tl.sum(tl.where(vis, pr * vb[None, :], 0.0), 1)
                if V_W > 1:
                    vt0, vt1, vt2, vt3, _, _, _, _ = _word_tiles(vword, V_BITS, V_W)
                else:
                    vt0, vt1, vt2, vt3 = _code_tiles(vbyte, V_BITS, V_KIND, V_E4M3)
                if V_SFMT == 3:  # NaN codes (a poisoned token-head) read as zeros, counted per channel where visible
                    vnan = _fixed_nan(vbyte, V_E4M3)
                    if tl.max(tl.max(vnan.to(tl.int32), 1), 0) > 0:
                        hit0 = hit0 + _dot(vis.to(tl.float32).to(tl.bfloat16), vnan.to(tl.float32).to(tl.bfloat16),
                                           None)
                        vt0 = tl.where(vnan, 0.0, vt0.to(tl.float32)).to(tl.bfloat16)
                acc0, acc1, acc2, acc3 = _pv_slots(acc0, acc1, acc2, acc3, pa, vt0, vt1, vt2, vt3, alpha[:, None], VNS)
            elif V_MODE == 1:
                pb = _bf16(pr)
                acc0, hit0 = _elem_pv(acc0, hit0, alpha, pb, vis, vbyte, 0, vs, vz, blk, row, start - S, hi - S, kv_ok,
                                      vsh, svs_nb, svs_t, uv, tbl, PV, UV, BLOCK_N, BS, V_CHANNEL, V_G, V_KIND, V_BITS,
                                      V_E4M3, V_SFMT, DR)
                if PV > 1:
                    acc1, hit1 = _elem_pv(acc1, hit1, alpha, pb, vis, vbyte, 1, vs, vz, blk, row, start - S, hi - S,
                                          kv_ok, vsh, svs_nb, svs_t, uv, tbl, PV, UV, BLOCK_N, BS, V_CHANNEL, V_G,
                                          V_KIND, V_BITS, V_E4M3, V_SFMT, DR)
                if PV > 2:
                    acc2, hit2 = _elem_pv(acc2, hit2, alpha, pb, vis, vbyte, 2, vs, vz, blk, row, start - S, hi - S,
                                          kv_ok, vsh, svs_nb, svs_t, uv, tbl, PV, UV, BLOCK_N, BS, V_CHANNEL, V_G,
                                          V_KIND, V_BITS, V_E4M3, V_SFMT, DR)
                    acc3, hit3 = _elem_pv(acc3, hit3, alpha, pb, vis, vbyte, 3, vs, vz, blk, row, start - S, hi - S,
                                          kv_ok, vsh, svs_nb, svs_t, uv, tbl, PV, UV, BLOCK_N, BS, V_CHANNEL, V_G,
                                          V_KIND, V_BITS, V_E4M3, V_SFMT, DR)
            blk = blk_next
        if V_MODE == 2:
            fixg = bsumg[:, :, None]
            base3 = ws_acc + w_row[None, :, None] * D + gv[:, None, None] * V_G + VNS * wv[None, None, :]
            ok3 = row_ok[None, :, None]
            tl.store(base3, accg0 + fixg, mask=ok3)
            if VNS > 1:
                tl.store(base3 + 1, accg1 + fixg, mask=ok3)
            if VNS > 2:
                tl.store(base3 + 2, accg2 + fixg, mask=ok3)
                tl.store(base3 + 3, accg3 + fixg, mask=ok3)
        base = ws_acc + w_row[:, None] * D
        if V_MODE != 2:  # ROWS: each row keeps its group's channels
            ch = VNS * jv[None, :]
            tl.store(base + ch, tl.where(hit0 > 0, float("nan"), acc0 + bsum[:, None]),
                     mask=qok & ((ch // V_G == mg[:, None]) | (V_MODE != 4)))
        if VNS > 1 and V_MODE != 2:
            tl.store(base + ch + 1, tl.where(hit1 > 0, float("nan"), acc1 + bsum[:, None]),
                     mask=qok & (((ch + 1) // V_G == mg[:, None]) | (V_MODE != 4)))
        if VNS > 2 and V_MODE != 2:
            tl.store(base + ch + 2, tl.where(hit2 > 0, float("nan"), acc2 + bsum[:, None]),
                     mask=qok & (((ch + 2) // V_G == mg[:, None]) | (V_MODE != 4)))
            tl.store(base + ch + 3, tl.where(hit3 > 0, float("nan"), acc3 + bsum[:, None]),
                     mask=qok & (((ch + 3) // V_G == mg[:, None]) | (V_MODE != 4)))
        tl.store(ws_ml + w_row * 2, m_i * LN2, mask=row_one)  # the merge's (natural) units
        tl.store(ws_ml + w_row * 2 + 1, l_i, mask=row_one)
    elif RUN > 1:  # each row of the run's full-precision positions, as a program of its own computes them
        for r in range(0, cnt):
            Lr, end_r, QLr, hq_r, mask_r, w_r = _row_frame(len_ptr, mask_ptr, first + r, m, h, split, nslots, sm_b,
                                                           sm_h, Hq, P, G, S, R, F, MASK_KIND)
            _full_program(q_ptr, ws_acc, ws_ml, kr, vr, ksk, vsk, kn, vn, first + r, h, hq_r, m < G, Lr, QLr, end_r,
                          w_r, mask_r, sq_b, sq_h, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t, sm_c, H, sm_scale, D, S, W,
                          M, MASK_KIND, DOT, CHUNK, DR)
    else:  # the full-precision positions: sinks, the query's own token (CHUNK), the residual ring
        _full_program(q_ptr, ws_acc, ws_ml, kr, vr, ksk, vsk, kn, vn, b, h, hq, row_one, L, QL, end, w_row, mask_rows,
                      sq_b, sq_h, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t, sm_c, H, sm_scale, D, S, W, M, MASK_KIND, DOT,
                      CHUNK, DR)


@triton.jit
def _qk_slots(raw, k0, k1, k2, k3, q0, q1, q2, q3, NS: tl.constexpr):
    """``raw`` (None: nothing yet) plus the first ``NS`` of four key (sub-)slots' ``k q`` (tokens as the rows)."""
    raw = _dot(k0, q0, raw)
    if NS > 1:
        raw = _dot(k1, q1, raw)
    if NS > 2:
        raw = _dot(k2, q2, raw)
        raw = _dot(k3, q3, raw)
    return raw


@triton.jit
def _pv_slots(acc0, acc1, acc2, acc3, pa, vt0, vt1, vt2, vt3, alpha, NS: tl.constexpr):
    """Each of the ``NS`` value (sub-)slots' ``acc * alpha + pa vt`` (``alpha`` broadcast against the accumulators:
    ``[rows, 1]`` in modes TILE and ROWS, ``[1, rows, 1]`` in GROUPS)."""
    acc0 = _dot(pa, vt0, acc0 * alpha)
    if NS > 1:
        acc1 = _dot(pa, vt1, acc1 * alpha)
    if NS > 2:
        acc2 = _dot(pa, vt2, acc2 * alpha)
        acc3 = _dot(pa, vt3, acc3 * alpha)
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_frame(len_ptr, mask_ptr, rb, mh, h, split, nslots, sm_b, sm_h, Hq, P, G: tl.constexpr, S: tl.constexpr,
               R: tl.constexpr, F: tl.constexpr, MASK_KIND: tl.constexpr):
    """Batch row ``rb``'s (length L, end of the positions it may see, packed boundary Q(L)) and, for its query
    heads ``mh`` (of KV head ``h``), their heads' indices, mask rows and workspace rows: one program's rows, or
    each row of a run's in its full-precision program."""
    L = tl.load(len_ptr + rb)
    if MASK_KIND == 0:
        end = L
    else:
        end = tl.minimum(L, P)  # positions past the mask's width are invisible
    hq = h * G + mh
    mask_rows = mask_ptr + (rb.to(tl.int64) * sm_b + hq.to(tl.int64) * sm_h)[:, None]
    return L, end, _boundary(L, S, R, F), hq, mask_rows, (rb.to(tl.int64) * Hq + hq) * nslots + split


@triton.jit
def _full_program(q_ptr, ws_acc, ws_ml, kr, vr, ksk, vsk, kn, vn, b, h, hq, row_ok, L, QL, end, w_row, mask_rows,
                  sq_b, sq_h, sr_b, sr_h, sr_t, ssk_b, ssk_h, ssk_t, sm_c, H, sm_scale, D: tl.constexpr,
                  S: tl.constexpr, W: tl.constexpr, M: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr,
                  CHUNK: tl.constexpr, DR: tl.constexpr):
    """The decode kernel's program ``split == nsplit``: attention over the full-precision positions (sinks, the
    query's own token from the chunk, the ring) in fp32 with ``DOT`` operands, as ``attention._attn_kernel``
    reads them (``_full_tile``, ``_online_step``), written to the workspace like a split's (D channels, the
    head's own DR and zeros past them)."""
    c = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + hq.to(tl.int64)[:, None] * sq_h + c[None, :],
                mask=row_ok[:, None] & (c < DR)[None, :], other=0.0)
    qpos = tl.full([M], 0, tl.int32) + (L - 1)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    FN: tl.constexpr = 16
    offs = tl.arange(0, FN)
    if S > 0:
        sk = ksk + b.to(tl.int64) * ssk_b + h.to(tl.int64) * ssk_h
        sv = vsk + b.to(tl.int64) * ssk_b + h.to(tl.int64) * ssk_h
        stop = tl.minimum(end, S)
        for start in range(0, stop, FN):
            p = start + offs
            kv_ok = p < stop
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, _full_tile(sk, p, kv_ok, ssk_t, DR, D),
                                         _full_tile(sv, p, kv_ok, ssk_t, DR, D), p, kv_ok, qpos, row_ok,
                                         mask_rows, sm_c, sm_scale, MASK_KIND, DOT)
    if CHUNK:
        first = tl.maximum(L - 1, S)
        if first < tl.minimum(QL, end):  # the query's own token, packed: read from the chunk
            kcn = kn + (b.to(tl.int64) * H + h) * DR
            vcn = vn + (b.to(tl.int64) * H + h) * DR
            p = first + offs
            kv_ok = offs < 1
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, _full_tile(kcn, offs, kv_ok, DR, DR, D),
                                         _full_tile(vcn, offs, kv_ok, DR, DR, D), p, kv_ok, qpos, row_ok,
                                         mask_rows, sm_c, sm_scale, MASK_KIND, DOT)
    if W > 0:
        rk = kr + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
        rv = vr + b.to(tl.int64) * sr_b + h.to(tl.int64) * sr_h
        for start in range(tl.maximum(QL, S), end, FN):
            p = start + offs
            kv_ok = p < end
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, _full_tile(rk, p % W, kv_ok, sr_t, DR, D),
                                         _full_tile(rv, p % W, kv_ok, sr_t, DR, D), p, kv_ok, qpos, row_ok,
                                         mask_rows, sm_c, sm_scale, MASK_KIND, DOT)
    tl.store(ws_acc + w_row[:, None] * D + c[None, :], acc, mask=row_ok[:, None])
    tl.store(ws_ml + w_row * 2, m_i, mask=row_ok)
    tl.store(ws_ml + w_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _elem_compact(s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl, I: tl.constexpr,
                  PER: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                  CHANNEL: tl.constexpr, G: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                  E4M3: tl.constexpr, SFMT: tl.constexpr, DR: tl.constexpr):
    """``(a, b)`` of slot ``I`` (channels PER u + I) of a tile as stored, before they are spread over the tile:
    per channel (CHANNEL) ``[BLOCK_N / G, U]``, one row of scales per group of G tokens (a group never
    straddles two blocks); per token ``[BLOCK_N, D / G]``, one per group of G channels. A padded head's channels
    past its own ``DR`` are (0, 0); its groups past them read its last again (``_own``)."""
    if CHANNEL:
        NT: tl.constexpr = BLOCK_N // G
        jt = j0 + tl.arange(0, NT) * G  # each group's first packed index (the tile starts at a multiple of G)
        gok = jt < jend
        tb = tl.load(tbl + jt // BS, mask=gok, other=0).to(tl.int64)
        off = (tb * s_nb + hoff + ((jt % BS) // G) * s_t)[:, None] + (PER * u + I)[None, :]
        ok = gok[:, None]
        if DR < U * PER:
            ok = ok & (PER * u + I < DR)[None, :]
        a, b = _affine(s_ptr, z_ptr, off, ok, KIND, BITS, E4M3, SFMT)
    else:
        NG: tl.constexpr = U * PER // G
        gi = _own(tl.arange(0, NG), (DR + G - 1) // G, DR < U * PER)
        off = (blk * s_nb + hoff + row * s_t)[:, None] + gi[None, :]
        a, b = _affine(s_ptr, z_ptr, off, kv_ok[:, None], KIND, BITS, E4M3, SFMT)
    return a, b


@triton.jit
def _spread(x, PER: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, CHANNEL: tl.constexpr,
            G: tl.constexpr):
    """``_elem_compact``'s ``[BLOCK_N / G, U]`` or ``[BLOCK_N, D / G]`` spread over the tile's ``[BLOCK_N, U]``."""
    if CHANNEL:
        NT: tl.constexpr = BLOCK_N // G
        return tl.reshape(tl.broadcast_to(x[:, None, :], (NT, G, U)), (BLOCK_N, U))
    else:
        NG: tl.constexpr = U * PER // G
        WG: tl.constexpr = G // PER  # U-columns of one group
        return tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, NG, WG)), (BLOCK_N, U))


@triton.jit
def _bf16_saturated(x, SFMT: tl.constexpr):
    """A dequantized element in bf16. With fp32 scales an element can lie beyond bf16's largest (fp32's range),
    which rounding would make inf: it saturates there instead, as every conversion of the store does
    (``quant.saturate``; within bf16's rounding error of the element). fp16 and fp8 scales cannot get there."""
    if SFMT == 1:
        x = tl.minimum(tl.maximum(x, -BF16_MAX), BF16_MAX)
    return _bf16(x)


@triton.jit
def _elem_qk(raw, qt, byte, I: tl.constexpr, s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl,
             PER: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, CHANNEL: tl.constexpr,
             G: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr, SFMT: tl.constexpr,
             DR: tl.constexpr):
    """``raw + k . q`` over slot ``I`` of a key tile in mode ELEM (``raw`` None: the first slot; ``qt``: the query
    slot transposed, tokens as the rows as in mode TILE): each element ``a * code + b`` in fp32, rounded to bf16
    once. A poisoned group's NaN reaches the scores, where ``_online_step``'s rule takes it."""
    a, b = _elem_compact(s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl, I, PER, U, BLOCK_N, BS,
                         CHANNEL, G, KIND, BITS, E4M3, SFMT, DR)
    k = _code_f32(byte, I, BITS, KIND, E4M3) * _spread(a, PER, U, BLOCK_N, CHANNEL, G) + _spread(b, PER, U, BLOCK_N,
                                                                                                  CHANNEL, G)
    return _dot(_bf16_saturated(k, SFMT), qt, raw)


@triton.jit
def _chan_qk(raw3, corr, codes, qf, I: tl.constexpr, s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl,
             PER: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
             KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr, SFMT: tl.constexpr, DR: tl.constexpr):
    """Slot ``I`` of a key tile in mode CHAN, added to ``raw3 [BLOCK_N / G, G, rows]`` (the tile's groups of G
    tokens, each token's ``q' . c``) and ``corr [BLOCK_N / G, rows]`` (each group's ``q . b``): ``q' = bf16(q a)``,
    the fp32 query slot ``qf [U, rows]`` times the group's scales, so that the slot's ``codes`` (bf16, exact:
    ``_code_tiles_exact``) enter the product as they are and no element is dequantized. A poisoned group's NaN
    scale makes its tokens' scores NaN, as ``attention_reference`` does."""
    a, b = _elem_compact(s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl, I, PER, U, BLOCK_N, BS,
                         True, G, KIND, BITS, E4M3, SFMT, DR)  # [BLOCK_N / G, U]
    qs = _bf16(qf[None, :, :] * a[:, :, None])  # [BLOCK_N / G, U, rows]
    raw3 = _dot(codes, qs, raw3)
    return raw3, corr + tl.sum(qf[None, :, :] * b[:, :, None], 1)


@triton.jit
def _elem_pv(acc, hit, alpha, pb, vis, byte, I: tl.constexpr, s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb,
             s_t, u, tbl, PER: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
             CHANNEL: tl.constexpr, G: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, E4M3: tl.constexpr,
             SFMT: tl.constexpr, DR: tl.constexpr):
    """``(acc * alpha + p v, hit)`` for slot ``I`` of a value tile in mode ELEM. A poisoned group (NaN scale) is
    read as zeros, and ``hit`` counts, per row and channel, the visible positions that hold one: the channels
    with a count become NaN at the end (``attention_reference``: NaN in the rows that see it and nowhere else).
    Only a tile that holds one computes the count (the check is on the scales as loaded)."""
    a, b = _elem_compact(s_ptr, z_ptr, blk, row, j0, jend, kv_ok, hoff, s_nb, s_t, u, tbl, I, PER, U, BLOCK_N, BS,
                         CHANNEL, G, KIND, BITS, E4M3, SFMT, DR)
    nan = (a != a) | (b != b)
    v = _bf16_saturated(_code_f32(byte, I, BITS, KIND, E4M3) * _spread(tl.where(nan, 0.0, a), PER, U, BLOCK_N,
                                                                        CHANNEL, G)
                        + _spread(tl.where(nan, 0.0, b), PER, U, BLOCK_N, CHANNEL, G), SFMT)
    acc = _dot(pb, v, acc * alpha[:, None])
    if tl.max(tl.max(nan.to(tl.int32), 1), 0) > 0:
        poisoned = _spread(nan.to(tl.float32), PER, U, BLOCK_N, CHANNEL, G).to(tl.bfloat16)
        hit = hit + _dot(vis.to(tl.float32).to(tl.bfloat16), poisoned, None)
    return acc, hit


# --------------------------------------------------------------------------- launcher
@functools.lru_cache(maxsize=None)
def decode_config(policy, head_dim: int, sink: int, flush: int, ring: int, block: int, gqa: int, block_n: int,
                  stages: int, mask_kind: int, dot: str, chunk: bool, full: bool,
                  words: bool = True, invariant: bool = False, runs: bool = False) -> tuple[str, dict]:
    """The constexprs of one ``_decode_kernel`` specialization and the key that spells it out (memoised).
    ``words``: the key codes may be read as words (``key_words``; their tensor's pointer and strides are
    multiples of 4 bytes). ``invariant``: row-invariant splits; ``runs`` (with it): a program a run of rows where
    the layout allows (``run_rows``)."""
    D = head_dim
    DP = padded_head((policy.key, policy.value), D)
    kw = layout_constexprs(policy, D, sink, flush, ring, block)  # (quantized formats only: their groups, axes)
    del kw["DB"]  # the general kernel's padded head; this kernel's is DP (``padded_head``)
    kw.update(D=DP, DR=D)  # D: the channels computed over; DR: the head's own (the rest masked)
    for pre, q in (("K_", policy.key), ("V_", policy.value)):
        if q.quantized and q.axis != "channel" and kw[pre + "G"] == D:
            kw[pre + "G"] = DP  # one scale a token-head: a group of the padded head (its extra channels zeros)
    kw["K_MODE"], kw["V_MODE"] = modes(policy, D, gqa)
    kw["K_W"] = key_words(policy.key, D, kw["K_MODE"], DP) if words else 1
    kw["V_W"] = value_words(policy.value, D, kw["V_MODE"], DP) if words else 1
    groups = kw["V_MODE"] == MODE_GROUPS  # values' groups and each group's columns per slot (GROUPS only)
    rows = kw["V_MODE"] == MODE_ROWS  # a row per query head and value group
    M = decode_rows(kw["K_MODE"], kw["V_MODE"], DP, kw["V_G"], gqa)
    kw.update(G=gqa, M=M, BLOCK_N=block_n, MASK_KIND=mask_kind, DOT=dot, CHUNK=chunk, FULL=full, STAGES=stages,
              NGV=DP // kw["V_G"] if groups or rows else 1, WGV=kw["V_G"] // (8 // kw["V_BITS"]) if groups else 16,
              INVARIANT=invariant, RUN=run_rows(kw["V_MODE"], M, gqa) if invariant and runs else 1)
    key = (f"decode[k={policy.key.key()}:{MODES[kw['K_MODE']]};v={policy.value.key()}:{MODES[kw['V_MODE']]};"
           f"S={sink};R={policy.residual};F={flush};W={ring};BS={block};D={D};gqa={gqa};bn={block_n};"
           f"stages={stages};mask={mask_kind};dot={dot};chunk={int(chunk)};full={int(full)};"
           f"words={kw['K_W']},{kw['V_W']};invariant={int(invariant)};run={kw['RUN']}]")
    return key, kw


def run_rows(value_mode: int, rows: int, gqa: int) -> int:
    """Rows of an engine's flat batch one program of the row-invariant kernel takes (``launch_decode``'s
    ``groups``): where the products' rows are padded to 16 (``decode_rows``), the padding holds the query heads
    of the next positions of the same sequence, so that each packed tile is read and unpacked once for all of them
    (a prompt's queries, each a decode row: ``kvcompile.pages``). Each row's arithmetic is the same as alone --
    its own scores, softmax and sums, in the same tiles, splits and layouts, the same operations in the same
    order (the run adds rows, not steps) -- so its bits are too. A call without runs (a decode step) takes the
    kernel without them, where the compiler drops the padding's rows (a run's loop is 12-34 % longer). 1 where
    the rows are not padded (per-group products: CHAN keys, GROUPS or ROWS values) or already hold 16 heads."""
    heads = triton.next_power_of_2(gqa)
    return rows // heads if rows == 16 and heads < 16 and value_mode != MODE_ROWS else 1


def layer_run_rows(spec: LayerSpec, gqa: int) -> int:
    """``run_rows`` of a layer read by ``gqa`` query heads a KV head: the rows a program of the row-invariant
    kernel takes from a call's ``groups`` (1: a row a program; the decode kernel must serve the layout)."""
    kw = decode_config(spec.policy, spec.head_dim, spec.sink, spec.flush, spec.ring, spec.block, gqa, 16, 3, 0,
                       "ieee", False, False)[1]  # (tile, stages, mask and dot do not change the rows)
    return run_rows(kw["V_MODE"], kw["M"], gqa)


def split_share(stop, sink: int, block_n: int):
    """The packed positions each split of a row-invariant row takes (the kernel's ``per``, INVARIANT), from the
    row's packed end ``stop`` (an int, or an integer tensor: each row's): ``SPLIT_MIN_TILES`` tiles, or more where
    ``SPLIT_MAX`` splits would not cover it."""
    if isinstance(stop, Tensor):
        per = -(-(stop - sink).clamp_min(0) // SPLIT_MAX)
        return (-(-per // block_n) * block_n).clamp_min(SPLIT_MIN_TILES * block_n)
    return max(SPLIT_MIN_TILES * block_n, -(-(-(-max(stop - sink, 0) // SPLIT_MAX)) // block_n) * block_n)


def run_offsets(groups: Tensor, stops: Tensor, rows: int, sink: int, block_n: int) -> Tensor:
    """The row-invariant kernel's programs from a call's rows, on their device with no host sync: int32
    ``[B + 1]``, program ``k`` taking rows ``out[k] .. out[k + 1] - 1``, B (no rows) past the last. The runs of
    ``groups`` (offsets of runs of one sequence's rows, checked: ``common.check_groups``; on ``stops``' device)
    are cut into pieces of at most ``rows`` rows whose splits are the same (``split_share`` of each row's packed
    end, ``stops`` [B]): a piece starts at each run's first row and where the share changes, then every ``rows``
    rows. The launcher's grid is B programs, a bound: those past the pieces read nothing."""
    B = stops.shape[0]
    dev = stops.device
    share = split_share(stops.long(), sink, block_n)
    i = torch.arange(B, device=dev)
    start = torch.zeros(B, dtype=torch.bool, device=dev)
    start[groups[:-1].long()] = True
    start[1:] |= share[1:] != share[:-1]
    first = torch.cummax(torch.where(start, i, 0), 0).values  # each row's piece of equal share begins here
    pieces = torch.cumsum((i - first) % rows == 0, 0)  # the pieces begun up to each row
    # piece k begins at the first row where k + 1 have begun; past the last, B
    out = torch.searchsorted(pieces, torch.arange(1, B + 2, device=dev))
    return out.to(torch.int32)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_tiles(spec: LayerSpec, gqa: int, batch: int, positions: int, device: torch.device,
                 tiles: tuple[int, int] | None = None, invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_N, NSPLIT) from host-known sizes only (``positions``: ``attention.position_bound``).

    BLOCK_N: the config table's (``tile_config``), or 16 in the interpreter (each op costs Python time; small
    tiles also make short test rows cross tiles), at least a per-channel group (a tile holds whole groups, whose
    scales it loads once). NSPLIT: about 4 programs per SM (132 on an H200) so that enough bytes are in flight,
    but no split shorter than 4 tiles; 3 in the interpreter. ``tiles`` overrides both.

    ``invariant``: each row's splits depend on that row alone (the kernel's INVARIANT: a share of its packed
    positions of at least ``SPLIT_MIN_TILES`` tiles, at most ``SPLIT_MAX`` of them), so that a row's result is the
    same bits in any batch (the merge then sums in order); NSPLIT is the most any row of ``positions`` needs, and a
    shorter row's last splits are empty."""
    if tiles is not None:
        block_n, nsplit = tiles
    else:
        block_n = 16 if INTERPRET else tile_config(spec, gqa)["block_n"]
        nsplit = None
    block_n = max([block_n] + [q.group for q in (spec.policy.key, spec.policy.value) if q.axis == "channel"])
    if invariant:  # the most splits any row of at most ``positions`` positions has
        return block_n, min(SPLIT_MAX, -(-max(positions - spec.sink, 1) // (SPLIT_MIN_TILES * block_n)))
    if nsplit is None:
        if INTERPRET:
            nsplit = 3
        else:
            want = triton.cdiv(4 * _sm_count(device), batch * spec.heads)
            nsplit = max(1, min(want, triton.cdiv(positions, 4 * block_n)))
    return block_n, nsplit


# Row-invariant splits (``decode_tiles(..., invariant=True)``): a row of ``n`` packed positions is cut in splits of
# ``max(SPLIT_MIN_TILES tiles, its n / SPLIT_MAX rounded up to whole tiles)``, so at most SPLIT_MAX of them.
SPLIT_MIN_TILES = 2 if INTERPRET else 4
SPLIT_MAX = 8 if INTERPRET else 64


def launch_decode(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None, scale: float, dot: str,
                  block_n: int, nsplit: int, chunk: tuple[Tensor, Tensor] | None = None,
                  invariant: bool = False, groups: Tensor | None = None) -> Tensor:
    """Decode attention of ``q [B, Hq, 1, D]`` (fp32, rotated) over ``state``; fp32 [B, Hq, 1, D].

    ``dot``: operand precision of the full-precision positions' products (the packed ones are bf16).
    ``block_n``, ``nsplit``: ``decode_tiles``. ``chunk``: the query's own key and value (fp32 [B, H, 1, D], as
    stored), read instead of the codes at position L - 1. ``mask``: None, or bool / float already broadcast to
    [B, Hq, 1, P]. ``groups`` (with ``invariant``): offsets (integers; ``launch.attention`` passes them checked and
    on the device) of runs of rows that are one sequence's positions in ascending order, its block table in each:
    a program takes up to ``run_rows`` of them."""
    B, Hq, n, D = q.shape
    H = spec.heads
    G = Hq // H
    cfg = tile_config(spec, G)
    full = spec.sink > 0 or spec.ring > 0 or chunk is not None
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    # words need 4-byte aligned rows (always, for the store's own tensors)
    words = all(c.numel() > 0 and c.data_ptr() % 4 == 0 and all(x % 4 == 0 for x in c.stride()[:3])
                for c in (state.k_codes, state.v_codes))
    _, kw = decode_config(spec.policy, D, spec.sink, spec.flush, spec.ring, spec.block, G, block_n, cfg["stages"],
                          mask_kind, dot, chunk is not None, full, words, invariant,
                          invariant and groups is not None and chunk is None)
    q = q.contiguous()
    dev = q.device
    slots = nsplit + int(full)
    DP = kw["D"]  # the padded head (``padded_head``): the workspace's and the merge's columns
    out = torch.empty(B, Hq, 1, DP, dtype=torch.float32, device=dev)
    ws_acc = torch.empty(B, Hq, 1, slots, DP, dtype=torch.float32, device=dev)
    ws_ml = torch.empty(B, Hq, 1, slots, 2, dtype=torch.float32, device=dev)
    if mask is None:
        mask_t, mstr, P = state.lengths, (0, 0, 0, 0), 0
    else:
        mask_t = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mstr, P = mask_t.stride(), mask_t.shape[-1]

    runs = state.lengths  # (a placeholder: each row a program of its own)
    if kw["RUN"] > 1:  # B programs at most, cut on the device (the rows' packed ends set their splits)
        L = state.lengths.long()
        stops = torch.minimum(spec.boundary(L), L)
        if mask is not None:  # positions past the mask's width are invisible
            stops = stops.clamp_max(mask.shape[-1])
        runs = run_offsets(to_device(groups, dev), stops, kw["RUN"], spec.sink, block_n)
    args = dict(
        q_ptr=q, ws_acc=ws_acc, ws_ml=ws_ml, run_ptr=runs, **state_args(state), mask_ptr=nonempty(mask_t),
        kn=state.lengths if chunk is None else chunk[0], vn=state.lengths if chunk is None else chunk[1],
        sq_b=q.stride(0), sq_h=q.stride(1),
        sm_b=mstr[0], sm_h=mstr[1], sm_c=mstr[3], P=P,
        H=H, Hq=Hq, sm_scale=float(scale), nsplit=nsplit, split_min=SPLIT_MIN_TILES * block_n,
        split_max=SPLIT_MAX, **kw,
    )
    # fp contraction on: a fused multiply-add rounds once where two operations round twice, which the bound
    # allows for (the decode kernel is not bit-exact with anything; the store kernels keep it off)
    run(_decode_kernel, (B * H, slots), args, num_warps=cfg["warps"], enable_fp_fusion=True)
    run(_merge_kernel, (B * Hq,), dict(out_ptr=out, ws_acc=ws_acc, ws_ml=ws_ml, nsplit=slots,
                                       NSPLIT_B=max(16, triton.next_power_of_2(slots)), DB=DP, IN_ORDER=invariant))
    return out if DP == D else out[..., :D].contiguous()


# --------------------------------------------------------------------------- what the bound needs
def packed_positions(state: KVState, spec: LayerSpec, C: int, own: int = 0) -> Tensor:
    """bool ``[B, C]``: the positions a kernel reads from the codes, ``S <= p < Q(L)``, except the ``own`` last
    ones (``p >= L - own``: the queries' own chunk, read in full precision)."""
    lengths = state.lengths.long()
    dev = lengths.device
    pos = torch.arange(C, device=dev)
    QL = spec.boundary(lengths)
    top = torch.minimum(QL, lengths - own)
    return (pos[None, :] >= spec.sink) & (pos[None, :] < top[:, None])


def affine_terms(state: KVState, spec: LayerSpec, which: str, C: int, own: int = 0):
    """Per element of positions ``0 .. C-1``, float64 ``[B, H, C, D]`` each: the code value ``c`` and the
    ``(a, b)`` of ``x^ = a c + b`` as ``_code_f32`` / ``_affine`` read them (fp8: the code's value and its scale),
    and ``packed_positions`` (``own``: the queries' own positions, read from the chunk). Zeros elsewhere. For
    ``attention.reference_and_bound``."""
    from kvcompile import quant as Q

    q = spec.policy.key if which == "k" else spec.policy.value
    codes, scale, zero = state[:3] if which == "k" else state[3:6]
    B, H, D, S, BS = state.lengths.shape[0], spec.heads, spec.head_dim, spec.sink, spec.block
    dev = state.lengths.device
    out = [torch.zeros(B, H, C, D, dtype=torch.float64, device=dev) for _ in range(3)]
    packed = packed_positions(state, spec, C, own)
    P = C - S
    if P <= 0 or not q.quantized or not bool(packed.any()):
        return (*out, packed)
    j = torch.arange(P, device=dev)
    col = (j // BS).clamp(max=max(state.table.shape[1] - 1, 0))
    blk = state.table.long()[:, col].clamp(min=0) if state.table.shape[1] else torch.zeros(B, P, dtype=torch.long)
    row = (j % BS).expand(B, P)
    c = Q.unpack(codes[blk, :, row], q.bits, D)  # [B, P, H, D]
    if q.is_fp8:
        c = c.view(Q.FP8_DTYPES[q.format])
    c = c.double()
    if not q.stores_scale:  # axis="tensor": the fixed scale, 1.0
        s, z = torch.ones_like(c), torch.zeros_like(c)
    else:
        srow = row if q.axis != "channel" else row // q.group
        s = scale[blk, :, srow].double()
        z = zero[blk, :, srow].double() if q.has_zero else torch.zeros_like(s)
        if q.axis != "channel":
            g = q.group_for(D)
            s, z = s.repeat_interleave(g, -1), z.repeat_interleave(g, -1)
    if q.has_zero and q.zero_counts_steps:
        a, b = s, -z * s
    elif q.has_zero:
        a, b = s, z
    elif q.is_fp8:
        a, b = s, torch.zeros_like(s)
    else:
        a, b = s, -(2.0 ** (q.bits - 1)) * s
    keep = packed[:, S:, None, None]
    for t, x in zip(out, (c, a, b)):
        t[:, :, S:] = torch.where(keep, x, 0.0).permute(0, 2, 1, 3)
    return (*out, packed)
