"""A small gpt-fast-style Llama (after pytorch-labs/gpt-fast ``model.py``), and kvcompile applied to it.

Nothing in the model knows about kvcompile: its ``KVCache`` is the usual pair of ``k_cache``/``v_cache``
buffers written with ``k_out[:, :, input_pos] = k_val``; grouped-query attention uses ``repeat_interleave``;
attention is ``F.scaled_dot_product_attention`` with a boolean mask over absolute cache positions.
``kvcompile.apply`` swaps the buffers for packed stores and compiles the model so that the write and the
read run through kvcompile's ops.

    python examples/gpt_fast_model.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelArgs:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_local_heads: int = 2   # kv heads (grouped-query attention)
    dim: int = 64
    intermediate_size: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos: Tensor, k_val: Tensor, v_val: Tensor):
        # input_pos: [S], k_val: [B, H, S, D]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
                       xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.wqkv = nn.Linear(a.dim, (a.n_head + 2 * a.n_local_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        a, (B, S, _) = self.a, x.shape
        kv = a.n_local_heads * a.head_dim
        q, k, v = self.wqkv(x).split([a.dim, kv, kv], dim=-1)
        q = apply_rotary_emb(q.view(B, S, a.n_head, a.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(B, S, a.n_local_heads, a.head_dim), freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v.view(B, S, a.n_local_heads, a.head_dim)))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        v = v.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(B, S, a.dim))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(a.dim, a.norm_eps), RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_batch_size = self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=torch.float32):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.a.n_local_heads, self.a.head_dim,
                                           dtype)
        hd = self.a.head_dim
        freqs = 1.0 / (self.a.rope_base ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
        ang = torch.outer(torch.arange(max_seq_length).float(), freqs)
        self.register_buffer("freqs_cis", torch.stack([ang.cos(), ang.sin()], -1), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool)),
                             persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, S, C]: absolute positions
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for b in self.layers:
            x = b(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


@torch.no_grad()
def generate(model, prompt: Tensor, max_new_tokens: int) -> Tensor:
    """Greedy decoding, gpt-fast style: prefill at positions 0..T-1, then one token per step."""
    B, T = prompt.shape
    logits = model(prompt, torch.arange(T))
    out = [prompt, logits[:, -1:].argmax(-1)]
    for i in range(max_new_tokens - 1):
        logits = model(out[-1], torch.tensor([T + i]))
        out.append(logits[:, -1:].argmax(-1))
    return torch.cat(out, 1)


def main():
    import kvcompile
    from kvcompile import Policy

    torch.manual_seed(0)
    model = Transformer(ModelArgs()).eval()
    model.setup_caches(max_batch_size=1, max_seq_length=128)
    full = sum(b.nbytes for _, b in model.named_buffers() if b.dim() == 4)
    model = kvcompile.apply(model, Policy.kivi(bits=4, group=16, residual=16), compiler="eager")
    prompt = torch.randint(0, 256, (1, 12))
    out = generate(model, prompt, 8)
    print(f"prompt token ids:    {prompt[0].tolist()}\ngenerated token ids: {out[0, prompt.shape[1]:].tolist()}")
    print(kvcompile.explain(model))
    packed = kvcompile.nbytes(model)
    print(f"cache bytes after {prompt.shape[1] + 8} tokens: full-precision buffers {full:,}, "
          f"kvcompile {packed:,} ({packed / full:.2f}x; kvcompile holds the blocks written, not the buffers' "
          f"whole length)")


if __name__ == "__main__":
    main()
