"""benchmarks/gpu_kernels.py runs end to end at tiny size (on the CPU through the interpreter): its
correctness stage passes and it prints every table, so the GPU run is one command away."""
import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.slow
def test_gpu_benchmark_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--smoke", "--out", str(tmp_path / "kernels.md")])
    assert report.count("store exact, attention within bound (decode+general kernels") == 3
    assert report.count("; head_dim 64)") == 2 and report.count("; head_dim 80)") == 1  # a padded head too
    assert "| 1 | 128 | bf16 sdpa (flash) |" in report and "| 1 | 128 | int4-kivi |" in report
    assert "| 1 | 128 | int4 (general kernel) |" in report
    # prefill (the path "auto" takes on the CPU, and the general kernel once more), store
    assert "| 48 | int4 (general) |" in report and "| 48 | int4 (general, for comparison) |" in report
    assert "| 1 | 1 | int4 |" in report
    assert "| 1 | 48 | int4 |" in report  # the prefill path's read-back of the past
    assert "ok  runs int4" in report  # a prompt's rows as runs of the sequence: each row's bits as alone
    assert "| 48 | int4 | 8 |" in report  # ... and timed (2 query heads a KV head: 8 rows a program)
    assert (tmp_path / "kernels.md").read_text() == report and (tmp_path / "kernels.json").exists()
