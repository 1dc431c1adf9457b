"""benchmarks/gpu_e2e.py runs end to end at tiny shapes on the CPU (its ``--device cpu --tiny`` dry run), writes
its JSON, and cuts off at its budget: the GPU run is one call with no second chance."""
import json

import pytest

from benchmarks import gpu_e2e


@pytest.mark.slow
def test_decode_and_first_token_cases_run_and_are_recorded(tmp_path):
    out = tmp_path / "e2e.json"
    got = gpu_e2e.main(["--device", "cpu", "--tiny", "--only", "kvc-kivi4-apply", "--shapes", "2x256", "max@256",
                        "--steps", "2", "--warmup", "1", "--first-context", "32", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(got["rows"], default=str))
    assert got["done"] and not got["skipped"], got["skipped"]
    by = {(r["case"], r.get("shape")): r for r in got["rows"]}
    decode = by[("decode", "2x256")]
    assert decode["decode_tok_s"] > 0 and decode["batch"] == 2 and decode["context"] == 256
    # 2 layers, KIVI int4 at 256 + 4 tokens: what the layout says a store of them holds
    from kvcompile.store import LayerSpec
    spec = LayerSpec(gpu_e2e.policy("kivi4"), 2, 32, "bfloat16")
    assert decode["cache_bytes"] >= 2 * spec.nbytes(2, 256)
    biggest = by[("decode", "max@256")]
    assert biggest["batch"] > 4  # the pretend device holds 4 bf16 sequences: int4 holds more
    assert by[("first", None)]["first_token_s"] > 0


def test_a_budget_that_is_spent_skips_the_rest_saying_why(tmp_path):
    got = gpu_e2e.main(["--device", "cpu", "--tiny", "--only", "kvc-kivi4-apply", "--budget", "1",
                        "--out", str(tmp_path / "e2e.json")])
    assert got["done"] and not got["rows"]
    assert got["skipped"] and all("budget" in s["reason"] for s in got["skipped"])
