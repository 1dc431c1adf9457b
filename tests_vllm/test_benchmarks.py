"""The vLLM benchmarks run end to end on the tiny model (their numbers are the benchmarks' business, not a test's)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_vllm_prefill_smoke(tiny, tmp_path):
    from benchmarks import vllm_prefill

    out = vllm_prefill.main(["--model", tiny, "--prompts", "2", "--tokens", "16", "--reps", "2", "--eager",
                             "--kv-mib", "32", "--only", "vLLM auto", "kvcompile fp8-tensor+rot",
                             "--out", str(tmp_path / "p.json")])
    assert [r["label"] for r in out["results"]] == ["vLLM auto", "kvcompile fp8-tensor+rot"]
    for r in out["results"]:
        assert "failed" not in r, r.get("failed")
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"]) and r["prompt_tokens_per_s"] > 0
    assert json.loads((tmp_path / "p.json").read_text())["results"] == out["results"]
