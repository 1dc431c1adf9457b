"""The CPU decode benchmark runs end to end (tiny random Llama), and reports what it measured."""
import json
import time

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


def test_gpu_session_script_runs_its_steps_from_a_package_dir(tmp_path):
    """The prepared GPU call (benchmarks/gpu_session.sh) at tiny sizes: kvcompile is imported from the
    script's package dir (the device has no pip install of it), and each step runs and ends in time."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "KVC_SESSION_SMOKE": "1", "BUDGET_S": "400"}
    r = subprocess.run(["bash", str(root / "benchmarks" / "gpu_session.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "session.log").read_text()
    where = next(ln for ln in log.splitlines() if ln.startswith("kvcompile from "))
    assert str(root) not in where, where  # not the checkout's own kvcompile/ (which lacks passes/, templates/)
    for step in ("kernels", "e2e", "tests"):
        assert f"end {step}: exit 0" in log, log
    assert "store exact, attention within bound" in (tmp_path / "kernels.txt").read_text()
    assert (tmp_path / "RESULTS.md").exists()


def test_peak_rss_sees_what_the_decode_window_adds():
    import torch
    mib = 2 ** 20
    with cpu_decode.PeakRSS(interval=0.001) as mem:
        prompt = torch.ones(48 * mib // 4)  # held from before the mark (the filled cache): the decode window's base
        mem.mark()
        step = torch.ones(64 * mib // 4)  # touched pages: RSS really grows
        time.sleep(0.05)
        del step, prompt
    assert 60 * mib <= mem.decode_added < 100 * mib, mem.decode_added / mib
    assert mem.added >= 108 * mib, mem.added / mib


def test_cpu_kernel_ab_smoke():
    """The A/B script builds both versions, checks the new one and times both; a template against itself
    differs by nothing."""
    from benchmarks import cpu_kernel_ab
    from kvcompile.templates import cpu
    rows = cpu_kernel_ab.main(["--smoke", "--base-file", str(cpu.SOURCE),
                               "--policies", "KIVI int4", "fp8 (Policy.fp8)"])
    assert [r["policy"] for r in rows] == ["KIVI int4", "fp8 (Policy.fp8)"]
    assert all(r["max_diff"] == 0.0 and r["min_ns"]["base"] > 0 and r["min_ns"]["new"] > 0 for r in rows)


def test_cpu_kernel_parts_smoke():
    from benchmarks import cpu_kernel_parts
    rows = cpu_kernel_parts.main(["--smoke"])
    assert [r["contender"] for r in rows] == list(cpu_kernel_parts.POLICIES)
    for r in rows:
        assert r["whole"] > 0 and r["dequant_only"] > 0 and r["attention_only"] > 0
        assert r["memory_floor_ns"] > 0 and r["bytes_per_position_head"] < 512


def test_gpu_sass_smoke():
    """The static SASS count of the decode kernel (benchmarks/gpu_sass.py) compiles and reads back one
    specialization; in a subprocess, since it must define the kernels without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # pragma: no cover - a Triton build without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is not available: {e}")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_sass.py"), "--smoke"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(ln.split() for ln in r.stdout.splitlines() if ln.startswith("fp8 e4m3"))
    instructions, ffma, alu = map(int, row[2:5])
    assert instructions > ffma > 0 and alu > 0, r.stdout


def test_windowed_cache_bytes_smoke():
    """At 1K tokens, twice Gemma 3's window: the rings' bytes are transformers' own, the few full layers
    quantized, so kvcompile's cache is smaller than the StaticCache for every policy."""
    from benchmarks import windowed_cache_bytes
    rows = windowed_cache_bytes.main(["--contexts", "1024"])
    assert {r["policy"] for r in rows} == set(windowed_cache_bytes.POLICIES)
    for r in rows:
        assert r["kvcompile"] < r["static"] and r["rings"] in (0, 22)
        standins = 26 * 2 * (1 + 1 + 1024 + 256 - 3) * 2  # every layer's two bf16 stand-ins, at most
        assert r["kvcompile"] <= r["all_stores"] + standins  # a ring only where it is smaller


def test_op_overhead_smoke():
    from benchmarks import op_overhead
    res = op_overhead.main(["--calls", "3", "--tokens", "64"])
    for op in ("store", "attention"):
        assert set(res[op]) == {"dispatcher", "plain", "kernel wrapper"}
    assert res["attention_outputs_equal"]  # the dispatcher, the plain function and the kernel read the same cache


def test_contention_smoke(capsys):
    """The contention benchmark runs both phases (a real competitor process in the second) and reports its
    table and ratios; only the structure and finiteness are checked, never a timing."""
    import math

    from benchmarks import contention
    res = contention.main(["--smoke", "--competitors", "1"])
    names = ["fp32 SDPA", "kvcompile KIVI int4", "kvcompile, torch's threads"]
    assert [(r["phase"], r["contender"]) for r in res["rows"]] == \
        [(p, n) for p in ("uncontended", "contended") for n in names]
    assert [r["competitors"] for r in res["rows"]] == [0] * 3 + [1] * 3
    for r in res["rows"]:
        assert r["tok_s"] > 0 and r["ms_per_token"] > 0 and r["cpu_cores"] >= 0
    for name in names[1:]:
        s = res["ratios"][name]
        assert all(math.isfinite(s[k]) and s[k] > 0 for k in ("uncontended", "contended", "relative"))
    assert res["relative"] == res["ratios"]["kvcompile KIVI int4"]["relative"]
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, ln in enumerate(out) if ln.startswith("phase"))
    assert out[header].split() == ["phase", "contender", "competitors", "background", "tok/s", "ms/token", "CPU"]
    assert [ln.split()[0] for ln in out[header + 1:header + 7]] == ["uncontended"] * 3 + ["contended"] * 3
    assert sum("contended / uncontended =" in ln for ln in out) == 2
    assert set(res["slowdown"]) == set(names)
    assert all(math.isfinite(s["rate"]) and math.isfinite(s["cpu"]) for s in res["slowdown"].values())
    contention.projections(1, 3, 3, 64, 576, 1536)()  # --projections' per-layer matmuls run


def test_tp_bytes_smoke(capsys):
    """The tensor-parallel bytes benchmark runs 2 gloo ranks under torchrun and reports, per policy, the
    unsharded cache, each rank's, and the planner's per-GPU bytes (structure only: tests/test_tp.py checks
    the numbers)."""
    from benchmarks import tp_bytes
    rows = tp_bytes.main(["--smoke"])
    assert [r["policy"] for r in rows] == tp_bytes.SMOKE["policies"]
    for r in rows:
        assert r["world"] == 2 and len(r["per_rank"]) == len(r["rank_stores"]) == 2 and r["heads"] == [1, 1]
        assert 0 < min(r["rank_stores"]) <= max(r["per_rank"]) < r["unsharded"] and r["planned_per_gpu"] > 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, ln in enumerate(out) if ln.startswith("policy"))
    assert out[header].split() == ["policy", "unsharded", "per", "rank", "unsharded/N", "+", "const",
                                   "planned/GPU", "rank", "stores"]
