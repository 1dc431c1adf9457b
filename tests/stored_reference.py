"""An independent measure of what an engine that reads every position from its pages computes (kvcompile inside
vLLM; ``kvcompile eval --own stored``): written apart from the pages, the plugin, the kernels and the evaluation's
cache, from kvcompile's reference store and transformers' own attention masks. Used by tests/test_evaluate.py and
tests_vllm/test_plugin.py."""
from __future__ import annotations

import dataclasses

import torch

from kvcompile import Policy
from kvcompile.store import KVState, store_reference


def stored_loss(path: str, windows, policy: Policy, sliding_in_full: bool = False) -> list[float]:
    """The held-out loss of transformers' model at ``path`` (float32) with every layer -- a sliding window's too --
    reading the store as it stood when each query's token was the newest (what the plugin computes): the mean loss
    of each window's second half, from one forward over the window. Written independently of the plugin and the
    kernels: each layer's keys and values go through kvcompile's reference store with the policy packing every
    whole group at once (a group's bytes depend on its tokens alone) and come back dequantized (``store.dequantize_reference``); query ``p`` reads positions
    ``[sink, Q(p + 1))`` dequantized and the others as given (``Policy.boundary``), under transformers' own SDPA
    masks (causal, and a sliding window's). ``sliding_in_full``: the sliding-window layers read every key and value
    in full precision instead (kvcompile's own engines keep them so). A per-layer ``policy`` is resolved among the
    model's layers by index (``model.layers.<i>.self_attn.attn``, vLLM's names); a layer it leaves in full precision
    reads every key and value as given."""
    import torch.nn.functional as F
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvcompile.store import LayerSpec, dequantize_reference
    layers = transformers.AutoConfig.from_pretrained(path).num_hidden_layers
    policies = policy.resolve([f"model.layers.{i}.self_attn.attn" for i in range(layers)]) if policy.overrides \
        else [policy] * layers

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        policy = policies[module.layer_idx]
        if sliding_in_full and getattr(module, "sliding_window", None) or policy in (None, Policy.full()):
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        pack = dataclasses.replace(policy, residual=0)
        B, H, n, D = key.shape
        sp = LayerSpec(pack, H, D, "float32", block_tokens=64)
        rows = sp.rows(B, -(-n // 64))
        rows[-1].copy_(torch.arange(B * rows[-1].shape[1], dtype=torch.int32).view(B, -1))
        st = KVState(*sp.pool(B * rows[-1].shape[1]), *rows)
        store_reference(st, sp, key.float(), value.float())
        kd, vd = dequantize_reference(st, sp)
        at = torch.arange(n)
        packed = (at[None, :] >= policy.sink) & (at[None, :] < policy.boundary(at + 1)[:, None])  # [query, key]
        G = query.shape[1] // H
        k, v, kd, vd = (x.float().repeat_interleave(G, 1) for x in (key, value, kd, vd))
        q = query.float() * (scaling if scaling is not None else D ** -0.5)
        sc = torch.where(packed, q @ kd.transpose(-1, -2), q @ k.transpose(-1, -2))
        if attention_mask is None:
            sc = sc.masked_fill(at[None, :] > at[:, None], float("-inf"))
        elif attention_mask.dtype == torch.bool:
            sc = sc.masked_fill(~attention_mask, float("-inf"))
        else:
            sc = sc + attention_mask
        pr = sc.softmax(-1)
        out = (pr * packed) @ vd + (pr * ~packed) @ v
        return out.transpose(1, 2).contiguous().to(query.dtype), None

    transformers.AttentionInterface.register("kvcompile_stored", attend)  # (the latest call's policy)
    AttentionMaskInterface.register("kvcompile_stored", sdpa_mask)  # SDPA's masks (else no sliding window's)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="kvcompile_stored").eval()
    half = windows.shape[1] // 2
    with torch.no_grad():
        logits = model(windows).logits[:, half - 1:-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, half:].reshape(-1), reduction="none")
    return nll.view(len(windows), -1).mean(1).tolist()
