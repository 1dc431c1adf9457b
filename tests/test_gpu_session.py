"""benchmarks/gpu_session.sh, the prepared GPU call: its plumbing runs here (no GPU, no kvcompile install: the
package is laid out from the tree as the device machine gets it), it refuses what it does not know, and it cuts
its steps off at the budget instead of running past the device call's limit."""
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def run(tmp_path, *args, budget="5"):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(OUT=str(tmp_path), BUDGET_S=budget, KVC_SESSION_SMOKE="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))  # this Python as `python`
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_session_script_imports_kvcompile_from_the_tree_and_stops_at_its_budget(tmp_path):
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "session.log").read_text()
    where = next(line for line in log.splitlines() if line.startswith("kvcompile from ")).split()[2]
    assert where.endswith("/kvcompile/__init__.py") and not where.startswith(str(SCRIPT.parents[1]))  # laid out
    assert "skip kernels" in log and "skip tests" in log and "done;" in log  # 5 s: every step skipped


def test_session_script_refuses_an_unknown_argument(tmp_path):
    r = run(tmp_path, "--fast")
    assert r.returncode == 2 and "unknown argument --fast" in r.stdout
