"""The HTTP load benchmark runs end to end: both servers as subprocesses on loopback ports, real streaming
clients, every request completed, and the report says what it measured."""
import json

import pytest

from benchmarks import serve_load

pytestmark = pytest.mark.slow  # loads the real SmolLM2 in two servers


def test_serve_load_smoke(tmp_path):
    out = tmp_path / "load.json"
    rows = serve_load.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["contender"] for r in rows] == ["transformers", "kvcompile"]
    for r in rows:
        assert r["completed"] == r["concurrency"] == 2 and r["failed"] == 0 and not r["errors"], r
        assert r["tokens"] > 0 and r["tok_s"] > 0 and r["peak_rss_mib"] > 0
        assert 0 < r["ttft_median_s"] <= r["ttft_p95_s"] <= r["wall_s"]
    kv = rows[1]
    assert 1 <= kv["most_requests_held"] <= 2  # sampled from kvcompile's cache while the requests ran
