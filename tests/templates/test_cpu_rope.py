"""The CPU decode kernel's compact rotary table (``cpu.rope_compact``) and its rotation of pre-RoPE keys as they
are dequantized (``cpu.rope_keys``): both exactly ``store.apply_rope``, bit for bit (signs of zero included).

A model's cos/sin table repeats itself ("half": cos[d + h] == cos[d], sin[d + h] == -sin[d]; "pairs": the same
for d + 1), so the kernel reads a copy of half of it -- for the rows that are so bit for bit, from row 0 on, and
never a copy older than the table: tables that are not quite redundant, partial rotary, both forms, a table that
grows (in place and into new tensors) and one written in place.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from kvcompile import Policy, Quant
from kvcompile.store import (KVStore, LayerSpec, Rope, RopeTable, apply_rope, attention_reference,
                             dequantize_reference)
from kvcompile.templates import cpu

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from nonfinite_checks import assert_close  # noqa: E402

pytestmark = pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler on this machine")

D = 64
SPEC = LayerSpec(Policy(pre_rope=True), 2, D)
SPEC.register()
P2 = Policy.kivi(2, group=16, residual=8, sink=2, pre_rope=True)  # int2 keys per channel: rotated as dequantized
P4 = Policy(Quant("int4", "token", 16), Quant("int4", "token", 32), pre_rope=True)  # int4 per token: the same
P3 = Policy(Quant("int3", "channel", 16), Quant("int8", "token"), residual=3, pre_rope=True)  # dequantized, then rotated
P2R0 = Policy(Quant("int2", "channel", 16), Quant("int2", "token", 16), residual=0, sink=2, pre_rope=True)  # no ring


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # torch.equal on floats takes -0.0 for 0.0


def cos_sin(positions: torch.Tensor, form: str, rd: int, base: float = 10000.0):
    """The model's cos/sin of ``positions`` as the capture takes them: transformers' ``[..., rd]`` ("half"),
    gpt-fast's ``[..., rd / 2]`` ("pairs")."""
    inv = 1.0 / (base ** (torch.arange(0, rd, 2).float() / rd))
    f = positions.float()[..., None] * inv
    if form == "half":
        f = torch.cat([f, f], -1)
    return f.cos(), f.sin()


def table(form: str, rd: int, T: int, offsets=(0, -3)) -> Rope:
    """A cache's table with positions 0 .. T - 1 captured (its rows past them: never captured, cos 1, sin +0)."""
    tb = RopeTable()
    c, s = cos_sin(torch.arange(T), form, rd)
    tb.capture(c[None], s[None], form, torch.arange(T).view(1, T), torch.ones(1, T, dtype=torch.bool), D)
    assert tb.cos.shape[0] > T
    return Rope(tb.cos, tb.sin, tb.perm, torch.tensor(offsets, dtype=torch.int32))


def keys(N: int, seed: int = 0) -> torch.Tensor:
    """Rows of every magnitude, with zeros of both signs (where a rotation's sign of zero shows)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, D, generator=g) * torch.logspace(-3, 3, D)
    k[::3, ::5] = 0.0
    k[1::3, ::7] = -0.0
    return k


def assert_rotates_as_apply_rope(rope: Rope, N: int = 60):
    """Every row the kernel can read -- clamped below row 0 and past the table's end, compact rows and full ones
    -- rotated bit for bit as ``apply_rope``, from the compact table and from the full one."""
    k = keys(N)
    T = rope.cos.shape[0]
    for b, p0 in ((0, 0), (1, 0), (0, T - N // 2)):
        want = apply_rope(k.expand(2, 1, N, D), rope, torch.arange(p0, p0 + N))[b, 0]
        assert torch.equal(bits(cpu.rope_rows(k, SPEC, rope, p0=p0, b=b)), bits(want))
        assert torch.equal(bits(cpu.rope_rows(k, SPEC, rope, p0=p0, b=b, compact=False)), bits(want))


COMPACT = [("half", 64), ("half", 48), ("half", 16), ("pairs", 64), ("pairs", 40), ("pairs", 8)]


@pytest.mark.parametrize("form,rd", COMPACT + [("half", 20), ("pairs", 6)])
def test_model_tables_are_read_from_half_of_each_row_bit_for_bit(form, rd):
    T = 45
    rope = table(form, rd, T)
    cc, tc = cpu.rope_compact(rope, SPEC)
    if (form, rd) in COMPACT:  # every captured row; the first never captured is not redundant (sin +0 twice)
        assert tc == T and cc.shape == (T, rd)
        first = torch.arange(rd // 2) if form == "half" else torch.arange(0, rd, 2)
        assert torch.equal(bits(cc), bits(torch.cat([rope.cos[:T, first], rope.sin[:T, first]], 1)))
    else:  # rotary channels not a multiple of 8 (per half): the full table
        assert cc is None and tc == 0
    assert_rotates_as_apply_rope(rope)


# a pass-through channel (the "tail" changes) exists only under partial rotary (rd < D)
@pytest.mark.parametrize("form,rd,change", [
    (form, rd, change) for form, rd in [("half", 64), ("pairs", 64), ("half", 48), ("pairs", 40)]
    for change in ["cos", "sin", "zero", "tail_cos", "tail_sin"] if rd < D or not change.startswith("tail")])
def test_a_table_that_is_not_exactly_redundant_is_read_whole_from_that_row(form, rd, change):
    """One entry off by one ulp, a sine not negated, a zero of the other sign, a pass-through channel that is not
    exactly cos 1 and sin +0: the compact table stops at that row, and every row still rotates exactly."""
    rope = table(form, rd, 45)
    r, first = 7, 2  # the first channel of a pair, and its second
    second = first + rd // 2 if form == "half" else first + 1
    if change == "cos":
        rope.cos[r, second] = torch.nextafter(rope.cos[r, second], torch.tensor(2.0))
    elif change == "sin":
        rope.sin[r, second] = rope.sin[r, first]
    elif change == "zero":  # position 0: sin(0) = 0, negated to -0.0 in the first channel of each pair
        r = 0
        assert bits(rope.sin[0, first]) != bits(rope.sin[0, second])
        rope.sin[0, first] = 0.0
        assert rope.sin[0, first] == -rope.sin[0, second]  # equal as numbers, not as bits
    elif change == "tail_cos":
        rope.cos[r, rd] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    else:
        rope.sin[r, D - 1] = -0.0
    cc, tc = cpu.rope_compact(rope, SPEC)
    assert tc == r
    assert_rotates_as_apply_rope(rope)


def _store(policy, form, rd, chunks, offsets=(0, -3), H=2, seed=0):
    """A pre-RoPE store filled in ``chunks``, the model's cos/sin captured at positions index + offset; yields
    (store, k_new, v_new) after each chunk."""
    g = torch.Generator().manual_seed(seed)
    spec = LayerSpec(policy, H, D, block_tokens=16)
    spec.register()
    B = len(offsets)
    store = KVStore(spec, B)
    store.set_rope_offsets(list(offsets))
    for n in chunks:
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        k[..., 3] *= 8
        r = torch.tensor(store.lengths).view(B, 1) + torch.arange(n) + torch.tensor(offsets).view(B, 1)
        c, s = cos_sin(r.clamp(min=0), form, rd)
        store.write_keys(True)
        store.capture_rope(c[:, None], s[:, None], form, n)
        store.append(k, v)
        yield store, k, v


def _without_compact(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(cpu, "_compact", lambda lib, e: (None, 0))
        return fn()


@pytest.mark.parametrize("form,rd", [("half", 64), ("pairs", 64), ("half", 32)])
def test_a_growing_table_is_never_read_stale(form, rd, monkeypatch):
    """Decode steps over a store whose table grows in place (each step's position written into its rows) and
    into new tensors (doubling): the compact table covers exactly the rows captured so far, and attention is bit
    for bit what it is from the full table, and the reference's within the kernels' tolerance."""
    g = torch.Generator().manual_seed(1)
    tensors = set()
    for i, (store, k, v) in enumerate(_store(P2, form, rd, (40,) + (1,) * 30)):
        rope = store.rope()
        tensors.add(rope.cos.data_ptr())
        cc, tc = cpu.rope_compact(rope, store.spec)
        assert tc == max(store.lengths) and cc.shape == (tc, rd)
        if i == 0 or (i % 6 and i != 25):  # every few decode steps, and the one that grew the table (64 -> 128 rows)
            continue
        q = torch.randn(2, 6, 1, D, generator=g)
        got = cpu.attention(q, store.state, store.spec, None, None, k_new=k, v_new=v, rope=rope)
        full = _without_compact(monkeypatch, lambda: cpu.attention(q, store.state, store.spec, None, None, k_new=k,
                                                                   v_new=v, rope=rope))
        assert torch.equal(bits(got), bits(full))
        want = attention_reference(q, store.state, store.spec, None, None, k_new=k, v_new=v, rope=rope)
        assert_close(got, want.double(), 2e-6, store.spec.name)
    assert len(tensors) == 2  # it grew once into new tensors


def test_a_table_written_in_place_is_read_as_written():
    rope = table("half", 64, 45)
    assert cpu.rope_compact(rope, SPEC)[1] == 45
    assert_rotates_as_apply_rope(rope)
    rope.cos[5, :32] = rope.cos[5, 32:] = 0.25  # still redundant: the compact copy must follow
    rope.sin[6, :32], rope.sin[6, 32:] = 0.5, -0.5
    cc, tc = cpu.rope_compact(rope, SPEC)
    assert tc == 45 and (cc[5, :32] == 0.25).all() and (cc[6, 32:] == 0.5).all()
    assert_rotates_as_apply_rope(rope)
    rope.sin[9, 40] = 1.0  # no longer redundant from row 9
    assert cpu.rope_compact(rope, SPEC)[1] == 9
    assert_rotates_as_apply_rope(rope)


@pytest.mark.parametrize("policy,fused", [(P2, True), (P4, True), (P3, False)], ids=["int2", "int4", "int3"])
@pytest.mark.parametrize("form,rd", [("half", 64), ("pairs", 64), ("half", 48), ("pairs", 40), ("half", 20)])
def test_packed_keys_are_dequantized_and_rotated_bit_for_bit(policy, fused, form, rd):
    """The kernel's packed tiles (int2/int4 keys: each row rotated as it is dequantized) against ``apply_rope`` of
    the reference's dequantized keys: every block, both sequences (one left-padded: rows clamped to row 0), a
    table captured only up to the middle of the last block (its rows past that: the full table), with and
    without the compact table."""
    *_, (store, _, _) = _store(policy, form, rd, (100,))
    spec, state = store.spec, store.state
    rope = store.rope()
    L = store.lengths[0]
    ref, _ = dequantize_reference(state, spec, torch.float32, rotated=True)
    S, packed = spec.sink, spec.boundary(L) - spec.sink
    rope = Rope(rope.cos[:S + packed - 5], rope.sin[:S + packed - 5], rope.perm, rope.offset)  # a table that ends
    assert packed > 2 * spec.block
    for b in range(2):
        for j in range(spec.blocks_for(L)):
            blk, n = int(state.table[b, j]), min(spec.block, packed - j * spec.block)
            p0 = S + j * spec.block
            for h in range(2):
                want = apply_rope(ref[b:b + 1, h:h + 1, p0:p0 + n], Rope(*rope[:3], rope.offset[b:b + 1]),
                                  torch.arange(p0, p0 + n))[0, 0]
                for compact in (True, False):
                    got, was_fused = cpu.rope_keys(state, spec, blk, h, rope, p0, b=b, compact=compact)
                    assert torch.equal(bits(got[:n]), bits(want)), (b, j, h, compact)
                    assert was_fused == (fused and (form, rd) != ("half", 20))


@pytest.mark.parametrize("form,rd", [("half", 64), ("pairs", 64), ("half", 48)])
def test_decode_attention_reads_the_compact_table_exactly(form, rd, monkeypatch):
    """Whole decode calls (sinks, packed tiles, the ring; splits; a mask; the queries' own chunk in full
    precision, also where it is already packed: that tile is rotated after the chunk replaces its rows): bit for
    bit the kernel's result from the full table, and the reference's within tolerance."""
    g = torch.Generator().manual_seed(2)
    for policy, chunks in ((P2, (90, 3)), (P3, (90, 3)), (P2R0, (95, 3))):
        *_, (store, k, v) = _store(policy, form, rd, chunks)
        spec, rope = store.spec, store.rope()
        assert (spec.boundary(98) == 98) == (policy is P2R0)
        q = torch.randn(2, 4, 3, D, generator=g)
        mask = torch.rand(2, 1, 3, sum(chunks), generator=g) > 0.2
        for nsplit in (1, 3):
            args = (q, store.state, spec, mask, 0.3)
            kw = dict(nsplit=nsplit, k_new=k, v_new=v, rope=rope)
            got = cpu.attention(*args, **kw)
            assert torch.equal(bits(got), bits(_without_compact(monkeypatch, lambda: cpu.attention(*args, **kw))))
            assert_close(got, attention_reference(*args, k_new=k, v_new=v, rope=rope).double(), 2e-6, spec.name)
