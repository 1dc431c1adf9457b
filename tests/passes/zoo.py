"""A zoo of KV-cache modules: write idioms x GQA styles x mask styles, in one tiny decoder.

Each cache module has ``update(input_pos, start, k, v) -> (k_all, v_all)``; the attention module replicates
heads one way and calls SDPA with one kind of mask. ``RefCache`` has the same interface and stores through
the reference quantized store (``kvcompile.QuantizedKV``), returning its dequantized contents: swapping it in
gives the eager reference that the compiled model must equal.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvcompile import QuantizedKV

WRITES = ("setitem", "index_put_", "index_copy_", "slice")
GQA = ("repeat_interleave", "repeat_kv", "enable_gqa")
MASKS = ("bool", "float")


class Cache(nn.Module):
    def __init__(self, write: str, B: int, H: int, C: int, D: int, dtype=torch.float32):
        super().__init__()
        self.write = write
        self.register_buffer("k_cache", torch.zeros(B, H, C, D, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(B, H, C, D, dtype=dtype))

    def update(self, input_pos: Tensor, start: int, k: Tensor, v: Tensor):
        kc, vc = self.k_cache, self.v_cache
        if self.write == "setitem":        # gpt-fast
            kc[:, :, input_pos] = k
            vc[:, :, input_pos] = v
        elif self.write == "index_put_":
            torch.ops.aten.index_put_(kc, [None, None, input_pos], k)
            torch.ops.aten.index_put_(vc, [None, None, input_pos], v)
        elif self.write == "index_copy_":  # transformers StaticLayer
            kc.index_copy_(2, input_pos, k)
            vc.index_copy_(2, input_pos, v)
        else:                              # torchtune-style slice assignment
            kc[:, :, start:start + k.shape[2]] = k
            vc[:, :, start:start + k.shape[2]] = v
        return kc, vc


class RefCache(nn.Module):
    """The eager reference: the reference store, read back dequantized (zeros past the length)."""

    def __init__(self, policy, B, H, C, D, dtype=torch.float32):
        super().__init__()
        self.kv = QuantizedKV(policy, B, H, C, D, dtype)
        self.C = C

    def update(self, input_pos, start, k, v):
        self.kv.append(k, v)
        k_all, v_all = self.kv.dequantized(k.dtype, end=self.C)
        return k_all, v_all


def repeat_kv(x: Tensor, n: int) -> Tensor:
    B, H, C, D = x.shape
    return x if n == 1 else x[:, :, None, :, :].expand(B, H, n, C, D).reshape(B, H * n, C, D)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, gqa: str, mask: str):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, dim // heads
        self.gqa, self.mask = gqa, mask
        self.q = nn.Linear(dim, heads * self.d, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, dim, bias=False)
        self.cache = None

    def forward(self, x, input_pos, start, mask):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2 * self.kvh, self.d).transpose(1, 2).chunk(2, dim=1)
        k, v = self.cache.update(input_pos, start, k, v)
        n = self.h // self.kvh
        kw = {}
        if self.gqa == "repeat_interleave":
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        elif self.gqa == "repeat_kv":
            k, v = repeat_kv(k, n), repeat_kv(v, n)
        elif n > 1:
            kw["enable_gqa"] = True
        if self.mask == "float":
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class Decoder(nn.Module):
    def __init__(self, write="setitem", gqa="repeat_interleave", mask="bool", layers=2, dim=32, heads=4,
                 kv_heads=2, vocab=64, batch=1, capacity=32, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(Attention(dim, heads, kv_heads, gqa, mask) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        for a in self.attn:
            a.cache = Cache(write, batch, kv_heads, capacity, dim // heads, dtype)
        self.register_buffer("causal", torch.tril(torch.ones(capacity, capacity, dtype=torch.bool)))
        self.to(dtype)

    def forward(self, idx, input_pos, start: int = 0):
        mask = self.causal[None, None, input_pos]
        x = self.emb(idx)
        for a, m in zip(self.attn, self.mlp):
            x = x + a(x, input_pos, start, mask)
            x = x + torch.tanh(m(x))
        return self.head(x)


def reference(model: Decoder, policy) -> Decoder:
    """A copy of ``model`` whose caches go through the reference store (per-layer policies resolved)."""
    ref = copy.deepcopy(model)
    names = [f"attn.{i}.cache" for i in range(len(ref.attn))]
    for a, pol in zip(ref.attn, policy.resolve(names)):
        B, H, C, D = a.cache.k_cache.shape
        a.cache = RefCache(pol, B, H, C, D, a.cache.k_cache.dtype)
    return ref


def run(model, tokens: Tensor, prefill: int):
    """Prefill ``tokens[:, :prefill]``, then decode the rest one token at a time; all logits, concatenated."""
    outs = [model(tokens[:, :prefill], torch.arange(prefill), 0)]
    for p in range(prefill, tokens.shape[1]):
        outs.append(model(tokens[:, p:p + 1], torch.tensor([p]), p))
    return torch.cat(outs, 1)
