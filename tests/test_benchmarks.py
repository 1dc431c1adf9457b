"""The CPU decode benchmark runs end to end (tiny random Llama), and reports what it measured."""
import json
import time

from benchmarks import cpu_decode
from kvcompile import Policy
from kvcompile.store import LayerSpec


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
    # 164 tokens of a 2-layer, 2-kv-head, head_dim-32 fp32 model. The DynamicCache holds fp32 tensors; the
    # int8 store, per layer, codes + fp16 scale and zero point (36 of 128 bytes per token-head) in whole
    # 64-token blocks, 3 of them (192 positions), one int32 length and 3 int32 table entries; and each layer's
    # two stand-ins (B + H + C + D fp32 elements, C at most 256).
    L, H, D, T = 2, 2, 32, 164
    assert by["dynamic"]["cache_bytes"] == L * 2 * H * D * 4 * T
    spec = LayerSpec(Policy.int8(), heads=H, head_dim=D, dtype="float32")
    assert spec.nbytes(1, T) == 2 * H * 192 * (D + 4) + 4 + 3 * 4
    standins = by["kvc-int8"]["cache_bytes"] - L * spec.nbytes(1, T)
    assert 0 < standins <= L * 2 * 4 * (1 + H + 256 + D)
    assert by["kvc-int8"]["cache_bytes"] < 0.4 * by["dynamic"]["cache_bytes"]


def test_json_mode_cost_smoke():
    """The JSON-mode cost benchmark writes its replies under the constraint (a random model over SmolLM2's
    tokenizer) and times one mask per token generated."""
    from benchmarks import json_mode_cost

    rows = json_mode_cost.main(["--random", "--tokens", "6"])
    assert [r["fields"] for r in rows] == ["JSON mode", "the bounded schema"]
    for r in rows:
        assert r["reply"].startswith("{") and r["tokens"] == 6 and r["mask"]["median_us"] > 0
    assert '"title' in rows[1]["reply"]  # the schema's first property, begun
