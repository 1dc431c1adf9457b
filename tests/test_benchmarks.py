"""The CPU decode benchmark runs end to end (tiny random Llama), and reports what it measured."""
import json
import time

import pytest

from benchmarks import cpu_decode
from kvcompile import Policy
from kvcompile.store import LayerSpec


@pytest.mark.slow
def test_cpu_decode_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    png = tmp_path / "smoke.png"
    rows = cpu_decode.main(["--smoke", "--out", str(out), "--plot", str(png)])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(out.read_text())["rows"] == rows
    by = {r["contender"]: r for r in rows}
    assert set(by) == {"dynamic", "kvc-int8", "kvc-int4"}
    for r in rows:  # each rate is reported against the first contender's, measured in the same run
        base = next(x for x in rows if x["contender"] == "dynamic" and (x["context"], x["batch"]) == (r["context"], r["batch"]))
        assert r["speed_vs_first"] == pytest.approx(r["decode_tok_s"] / base["decode_tok_s"])
        assert r["cache_vs_first"] == pytest.approx(r["cache_bytes"] / base["cache_bytes"])
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


@pytest.mark.slow
def test_a_failing_run_reports_its_own_error_not_the_memory_meters(monkeypatch):
    """``cpu_decode.py --device cuda`` on the first GPU run: a store's device assert surfaced as
    ``AttributeError: 'PeakCUDA' object has no attribute 'mark_base'``. Both meters now let the run's own error
    through, whether it comes before ``mark()`` or after it (CUDA's allocator counters faked: no GPU here)."""
    import pytest
    import torch

    counters = {"now": 100, "peak": 100}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: counters["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: counters["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: counters.update(peak=counters["now"]))
    for meter in (cpu_decode.PeakCUDA, cpu_decode.PeakRSS):
        for marked in (False, True):
            with pytest.raises(ValueError, match="the run's own error"):
                with meter() as mem:
                    if marked:
                        mem.mark()
                    raise ValueError("the run's own error")
    with cpu_decode.PeakCUDA() as mem:  # and a run that succeeds still measures
        counters.update(now=160, peak=190)
        mem.mark()
        counters.update(now=170, peak=230)
    assert (mem.added, mem.decode_added) == (130, 70)


def test_vllm_fp8_quality_smoke(tiny_dir, tmp_path):
    """The fp8 comparison runs every contender over the same windows and pairs each with vLLM fp8's; vLLM's
    rounding is e4m3 with saturation, and the bytes are the plugin's pages'."""
    import torch

    from benchmarks import vllm_fp8_quality as bench

    x = torch.tensor([0.0, 1e-4, 0.3, -2.7, 500.0, -1e6])
    assert torch.equal(bench.vllm_fp8(x, 1.0), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(bench.vllm_fp8(x, 2.0), (x / 2).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 2)
    res = bench.main(["--model", str(tiny_dir), "--windows", "2", "--window", "256", "--calibration", "1",
                      "--out", str(tmp_path / "fp8.json"), "--plot", str(tmp_path / "fp8.png")])
    assert (tmp_path / "fp8.png").read_bytes()[:4] == b"\x89PNG"
    rows = {r["label"]: r for r in res["results"]}
    assert list(rows) == list(bench.CONTENDERS) and res["head_dim"] == 32
    assert rows["vLLM fp8 (scale 1.0)"]["minus_vllm_fp8"] == 0
    for r in rows.values():
        assert len(r["delta_per_window"]) == 2 and all(abs(d) < 1 for d in r["delta_per_window"])
    # int8 rounds each head's keys to 255 steps of its own range: closer than fp8's 3-bit mantissa
    assert abs(rows["kvcompile int8 (Policy.int8: scale and zero point)"]["delta"]) < \
        abs(rows["vLLM fp8 (scale 1.0)"]["delta"])
    # head_dim 32: an fp16 scale a token-head is 2 bytes over 32 one-byte codes
    assert rows["kvcompile fp8-r0 (fp16 scale a token-head)"]["bytes_per_element"] == {"32": 1 + 2 / 32, "128": 1 + 2 / 128}
    # fp8 with no scale stored is vLLM's fp8 at scale 1.0: the same bytes, the same rounding, the same loss
    tensor = rows["kvcompile fp8-tensor (no scale stored)"]
    assert tensor["bytes_per_element"] == {"32": 1.0, "128": 1.0}
    assert tensor["delta_per_window"] == rows["vLLM fp8 (scale 1.0)"]["delta_per_window"]
    assert rows["kvcompile fp8-tensor+rot (no scale stored, rotated)"]["bytes_per_element"] == {"32": 1.0, "128": 1.0}


def test_cpu_prompt_rows_smoke():
    """The prompt-rows benchmark checks that sharing tiles gives each row its own bits before it times them."""
    from benchmarks import cpu_prompt_rows

    rows = cpu_prompt_rows.main(["--smoke"])
    assert [r["policy"] for r in rows] == cpu_prompt_rows.POLICIES
    assert all(r["alone_ms"] > 0 and r["shared_ms"] > 0 for r in rows)


def test_cpu_prompt_rows_against_a_revision_smoke(tmp_path):
    """With --base, both columns share their tiles: a template file as the revision (the working tree's copy,
    so the bits checked first agree), on Gemma 3 1B's head shape."""
    from benchmarks import cpu_prompt_rows
    from kvcompile.templates import cpu

    rows = cpu_prompt_rows.main(["--smoke", "--shape", "gemma3", "--base-file", str(cpu.SOURCE)])
    assert [(r["policy"], r["shape"]) for r in rows] == [(p, "gemma3") for p in cpu_prompt_rows.POLICIES]
    assert all(r["alone_ms"] > 0 and r["shared_ms"] > 0 for r in rows)


def test_rotation_cost_smoke():
    """The rotation-cost benchmark times the three fp8 policies' store and attention and the rotations."""
    from benchmarks import rotation_cost

    out = rotation_cost.main(["--requests", "1", "--tokens", "32"])
    assert set(out) == set(rotation_cost.POLICIES) | {"rotations_ms"}
    assert all(v["store_ms"] > 0 and v["attention_ms"] > 0 for k, v in out.items() if k != "rotations_ms")


def test_vllm_capacity_plot_draws_the_recorded_run(tmp_path):
    """``vllm_side_by_side.py --capacity-only --plot`` draws its bars from the results it records (here the recorded
    run of docs/results.md; the script itself runs in the vLLM environment: tests_vllm/test_benchmarks.py)."""
    from pathlib import Path

    from benchmarks import vllm_side_by_side
    recorded = Path(__file__).parent.parent / "benchmarks/results/vllm_capacity_sliding.json"
    out = tmp_path / "capacity.png"
    vllm_side_by_side.plot_capacity(json.loads(recorded.read_text())["results"], out, " (test)")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pages_decode_smoke():
    """The pages' decode-step benchmark runs every policy family it compares: per-token pages, KIVI's key groups
    with a ring, and with a recent window in pages of their own."""
    from benchmarks import pages_decode

    rows = pages_decode.main(["--smoke"])
    assert [r["policy"] for r in rows] == pages_decode.POLICIES
    assert [(r["window"], r["ring"]) for r in rows] == [(False, False), (False, False), (True, True), (True, False)]
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_pages_host_smoke():
    """The host-time benchmark of vLLM's prompt path, and of a windowed layout's decode step, runs the Triton
    launchers with their launches counted, not run (its own process: it sets the interpreter flag and replaces the
    launchers)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "pages_host.py"
    out = subprocess.run([sys.executable, str(script), "--tokens", "96", "--layers", "2", "--heads", "4",
                          "--kv-heads", "2", "--head-dim", "32", "--policy", "int8"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "96-token prompt, int8, 4 query / 2 KV heads, head_dim 32: 2 launches a layer (decode and merge; " \
           "calls: 1)" in out
    assert "| first (makes the step's plan) |" in out and "| the others (median of 1) |" in out
    out = subprocess.run([sys.executable, str(script), "--decode", "3", "--tokens", "200", "--layers", "2",
                          "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--policy", "kivi2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "decode step of 3 sequences at 201-203 positions, kivi2 (window cache of 32-token pages), 4 query / 2 KV " \
           "heads, head_dim 64: 2 launches a layer" in out and "| the others (median of 1) |" in out
