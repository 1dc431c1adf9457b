"""``kvcompile.window``: a sliding-window layer's rings under continuous batching, checked against the
specification -- attention over the whole sequence under the sliding-window mask (query ``p`` sees the keys at
``p - window + 1 .. p``) -- with requests fed in chunks as the engine feeds them (``before``, then ``write``, then
``window_attention``), chunks shorter and longer than the window. The rings keep the model's dtype, so the only
difference is the order of the sums: float32 here, within a few ulps of the attention's magnitude.

The end-to-end serving tests (a Gemma 3-style model's tokens equal transformers' own continuous batching) are in
tests/test_serving.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcompile.errors import ArgumentError, UnsupportedError
from kvcompile.window import WindowRing, WindowSpec, window_attention

W, H, HQ, D = 8, 2, 4, 16  # a window of 8 tokens, GQA: 4 query heads over 2 KV heads
TOL = dict(rtol=0, atol=1e-5)  # float32 sums of up to 8 terms of |v| <= ~4 in another order


def whole(q, k, v, start):
    """The specification: queries at positions ``start ..`` over all the keys ``0 ..`` under the window mask."""
    qpos = start + torch.arange(q.shape[2])
    gap = qpos[:, None] - torch.arange(k.shape[2])[None, :]
    mask = (gap >= 0) & (gap < W)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def chunked(ring, slot, q, k, v, chunks):
    """Feed one request (``q [1, HQ, T, D]``, ``k, v [1, H, T, D]``) into ``slot`` in chunks of the given sizes,
    as the engine does; the attention outputs of all the chunks ``[1, HQ, T, D]``."""
    out, p = [], ring.lengths[slot]
    rows = torch.tensor([slot])
    for n in chunks:
        kc, vc, qc = k[:, :, p:p + n], v[:, :, p:p + n], q[:, :, p:p + n]
        past = torch.tensor([p])
        k_old, v_old, pos = ring.before(rows, past)
        ring.write([slot], [p], kc, vc)
        out.append(window_attention(qc, k_old, v_old, pos, kc, vc, past, W, None))
        assert ring.lengths[slot] == p + n
        p += n
    return torch.cat(out, 2)


def draw(T, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HQ, T, D, generator=g), torch.randn(1, H, T, D, generator=g),
            torch.randn(1, H, T, D, generator=g))


@pytest.mark.parametrize("chunks", [[1] * 20, [5, 1, 1, 13], [20], [3, 9, 2, 1, 7]],
                         ids=["decode", "prefill-then-decode", "one-chunk-longer-than-the-window", "mixed"])
def test_chunks_through_a_ring_are_the_sliding_window_attention(chunks):
    q, k, v = draw(sum(chunks), 0)
    ring = WindowRing(WindowSpec(W, H, D, "float32", 16), slots=3)
    got = chunked(ring, 1, q, k, v, chunks)
    torch.testing.assert_close(got, whole(q, k, v, 0), **TOL)
    assert ring.lengths == [0, sum(chunks), 0]  # the other slots untouched


def test_two_slots_in_one_forward_each_see_only_their_own_tokens():
    """Two requests at different lengths in one ``before``/``write``/``window_attention`` call (the engine's
    group of rows with the same chunk length)."""
    (qa, ka, va), (qb, kb, vb) = draw(14, 1), draw(14, 2)
    ring = WindowRing(WindowSpec(W, H, D, "float32", 16), slots=2)
    chunked(ring, 0, qa, ka, va, [11])  # slot 0 is 11 tokens in, slot 1 only 2
    chunked(ring, 1, qb, kb, vb, [2])
    rows, past, n = torch.tensor([0, 1]), torch.tensor([11, 2]), 3
    k = torch.cat([ka[:, :, 11:14], kb[:, :, 2:5]])
    v = torch.cat([va[:, :, 11:14], vb[:, :, 2:5]])
    q = torch.cat([qa[:, :, 11:14], qb[:, :, 2:5]])
    k_old, v_old, pos = ring.before(rows, past)
    ring.write([0, 1], [11, 2], k, v)
    got = window_attention(q, k_old, v_old, pos, k, v, past, W, None)
    torch.testing.assert_close(got[:1], whole(qa, ka, va, 0)[:, :, 11:14], **TOL)
    torch.testing.assert_close(got[1:], whole(qb[:, :, :5], kb[:, :, :5], vb[:, :, :5], 0)[:, :, 2:5], **TOL)
    assert ring.lengths == [11 + n, 2 + n]


def test_a_forked_saved_or_restored_row_goes_on_as_the_original():
    q, k, v = draw(24, 3)
    ring = WindowRing(WindowSpec(W, H, D, "float32", 16), slots=3)
    chunked(ring, 0, q, k, v, [10])
    saved = ring.save(0)
    assert saved.length == 10 and saved.nbytes == WindowSpec(W, H, D, "float32", 16).row_nbytes()
    ring.fork(0, 2)
    want = whole(q, k, v, 0)[:, :, 10:]
    torch.testing.assert_close(chunked(ring, 0, q, k, v, [4, 1, 9]), want, **TOL)
    torch.testing.assert_close(chunked(ring, 2, q, k, v, [14]), want, **TOL)  # the fork, after its source moved on
    ring.clear([0])
    ring.restore(0, saved)
    torch.testing.assert_close(chunked(ring, 0, q, k, v, [1] * 14), want, **TOL)


def test_a_ring_is_a_store_without_pages():
    spec = WindowSpec(W, H, D, "bfloat16", 16)
    assert spec.row_nbytes() == 2 * H * W * D * 2 and spec.blocks_for(10_000) == 0 and spec.block_nbytes() == 0
    ring = WindowRing(spec, slots=2)
    assert all(t.dtype == torch.bfloat16 and t.shape == (2, H, W, D) for t in ring.state)
    with pytest.raises(UnsupportedError, match="prefix sharing is off"):
        ring.set_length(0, 4)


@pytest.mark.parametrize("field, value", [("window", 0), ("heads", True), ("head_dim", 2.0), ("dtype", "float64")])
def test_a_bad_window_spec_says_which_field(field, value):
    kw = dict(window=W, heads=H, head_dim=D, dtype="float32", block=16) | {field: value}
    with pytest.raises(ArgumentError, match=f"WindowSpec {field}="):
        WindowSpec(**kw)
