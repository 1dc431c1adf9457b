"""A model with Gemma 3 1B's attention for vLLM's capacity count: random bf16 weights, saved with a tokenizer.

    /path/to/vllm-env/bin/python benchmarks/vllm_sliding_model.py --out /tmp/gemma3-1b-attention
    /path/to/vllm-env/bin/python benchmarks/vllm_side_by_side.py --model /tmp/gemma3-1b-attention --capacity-only ...

The attention is ``windowed_cache_bytes.gemma3_1b_shape()``'s (26 layers, every sixth full attention, the others a
sliding window of 512 tokens; 4 query heads over 1 kv head of 256 channels); what does not shape the cache is
shrunk so that vLLM loads and profiles it in seconds on a CPU (hidden size 256, MLP 512). The tokenizer is
``--tokenizer``'s (by default SmolLM2's, which ``kvcompile.models`` converts from the GGUF it ships).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.windowed_cache_bytes import gemma3_1b_shape  # noqa: E402


def main(argv=None) -> Path:
    import transformers
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", help="a directory with a tokenizer (default: SmolLM2's, from kvcompile.models)")
    a = ap.parse_args(argv)
    if a.tokenizer is None:
        from kvcompile import models
        a.tokenizer = str(models.convert_default())
    tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer)
    cfg = gemma3_1b_shape()
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = len(tok), 256, 512
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id or 0
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"{a.out}: {cfg.num_hidden_layers} layers, {cfg.layer_types.count('sliding_attention')} with a "
          f"{cfg.sliding_window}-token window, {cfg.num_key_value_heads} kv head of {cfg.head_dim}")
    return a.out


if __name__ == "__main__":
    main()
