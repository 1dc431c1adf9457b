"""benchmarks/gpu_kernels.py runs end to end at tiny size (on the CPU through the interpreter): its
correctness stage passes and it prints a table, so the GPU run is one command away."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


def test_gpu_benchmark_smoke_run():
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--smoke"])
    assert report.count("store exact, attention within bound") == 3
    assert "| 1 | 256 | bf16 sdpa" in report and "| 1 | 256 | int4-kivi |" in report
