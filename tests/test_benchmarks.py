"""The CPU decode benchmark runs end to end (tiny random Llama), and reports what it measured."""
import json

from benchmarks import cpu_decode


def test_cpu_decode_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    png = tmp_path / "smoke.png"
    rows = cpu_decode.main(["--smoke", "--out", str(out), "--plot", str(png)])
    assert png.stat().st_size > 0
    assert json.loads(out.read_text())["rows"] == rows
    by = {r["contender"]: r for r in rows}
    assert set(by) == {"dynamic", "kvc-int8", "kvc-int4"}
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["cache_bytes"] > 0 and r["first_token_s"] > 0 and r["step_ms_median"] > 0
    # 164 tokens of a 2-layer, 2-kv-head, head_dim-32 fp32 model: the int8 store holds codes + fp16 scales,
    # the DynamicCache fp32 tensors; measured from the tensors on both sides.
    assert by["kvc-int8"]["cache_bytes"] < 0.35 * by["dynamic"]["cache_bytes"]


def test_cpu_kernels_smoke():
    from benchmarks import cpu_kernels
    rows = cpu_kernels.main(["--smoke"])
    assert {r["contender"] for r in rows} >= {"fp32 SDPA", "KIVI int4", "KIVI int2", "int8 (Policy.int8)"}
    by = {r["contender"]: r for r in rows}
    assert all(r["us"] > 0 for r in rows)
    assert by["KIVI int2"]["bytes_per_position_head"] < by["fp32 SDPA"]["bytes_per_position_head"] == 512
