"""The vLLM benchmarks run end to end on the tiny model (their numbers are the benchmarks' business, not a test's)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_vllm_prefill_smoke(tiny, tmp_path):
    from benchmarks import vllm_prefill

    # prompts longer than a page (128 tokens): one seen before would be served from vLLM's prefix cache
    out = vllm_prefill.main(["--model", tiny, "--prompts", "2", "--tokens", "160", "--reps", "2", "--eager",
                             "--kv-mib", "32", "--only", "vLLM auto", "kvcompile fp8-tensor+rot",
                             "--out", str(tmp_path / "p.json")])
    assert [r["label"] for r in out["results"]] == ["vLLM auto", "kvcompile fp8-tensor+rot"]
    for r in out["results"]:
        assert "failed" not in r, r.get("failed")
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"]) and r["prompt_tokens_per_s"] > 0
        assert r["prefix_cache_hits"] == 0  # every timed prompt computed
    assert json.loads((tmp_path / "p.json").read_text())["results"] == out["results"]


def test_vllm_sliding_model_has_gemma3_1bs_attention(tiny, tmp_path):
    import torch
    import transformers

    from benchmarks import vllm_sliding_model
    from benchmarks.windowed_cache_bytes import gemma3_1b_shape
    out = vllm_sliding_model.main(["--out", str(tmp_path / "m"), "--tokenizer", tiny])
    got, want = transformers.AutoConfig.from_pretrained(out), gemma3_1b_shape()
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                  "layer_types"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.torch_dtype == torch.bfloat16 and (out / "tokenizer.json").exists()
