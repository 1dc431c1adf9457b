"""``kvcompile serve`` under faults, through the real CLI and a real server on a loopback port (the tiny random
model): a configuration that cannot serve one request is refused at start-up with one line and a non-zero exit;
a stop signal lets the requests in flight finish for the grace period, then ends the rest cleanly (a stream gets
an error event and its end, a reply waited for a 503 in OpenAI's shape), and the server exits 0 without a
traceback; a second signal ends them at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_serve_http import start_server, stop_server

from benchmarks.serve_load import free_port
from kvcompile import Policy

# every test starts the server (or the CLI) in a process of its own: tens of seconds each
pytestmark = pytest.mark.slow

CLI_S = 600  # a refused start: the CLI imports torch and transformers and loads the model (minutes on a busy machine)


def serve_cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcompile", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=CLI_S, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def assert_one_line_refusal(r: subprocess.CompletedProcess, *says: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvcompile serve: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    for s in says:
        assert s in lines[0], lines[0]
    return lines[0]


def test_a_configuration_that_cannot_serve_one_request_is_refused_at_start_up(tiny_dir, tmp_path):
    # a budget that one slot's window and sinks take whole (KIVI's 159-token window and 2000 sinks, two layers of
    # two 32-channel heads in fp32: 2.2 MB): it started, then answered every request with a 500
    Policy.kivi(4, sink=2000).save(tmp_path / "sinks.json")
    line = assert_one_line_refusal(
        serve_cli("--model", tiny_dir, "--policy", tmp_path / "sinks.json", "--budget-mib", 1, "--port", free_port()),
        "a budget of 1,048,576 bytes does not hold one block after 1 request slot", "raise the budget to at least")
    assert "(3 MiB)" in line
    # a port no socket can have: argparse's line (it was a 78-line OverflowError from uvicorn)
    assert_one_line_refusal(serve_cli("--port", 70000), "--port: '70000' is not a port number from 1 to 65535")
    # a kernel cache the first request's kernels cannot be built in (a file where its directory goes): said at
    # start-up, when the engine serves its first request, not to every client
    (tmp_path / "file").write_text("")
    assert_one_line_refusal(
        serve_cli("--model", tiny_dir, "--policy", "int8", "--budget-mib", 1, "--port", free_port(),
                  env={"KVCOMPILE_CACHE_DIR": str(tmp_path / "file")}),
        "could not serve a first request at start-up", "is a regular file, not a directory")


# --------------------------------------------------------------------------- stopping
def chat_stream(base, name, max_tokens, out, key):
    """A streamed chat completion read to its end: ``out[key] = (status, the data lines, seconds)``, or the
    exception a broken connection raises."""
    t0 = time.time()
    try:
        with httpx.Client(timeout=120) as c:
            body = {"model": name, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"story {key}"}]}
            with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        out[key] = (r.status_code, lines, time.time() - t0)
    except Exception as e:  # noqa: BLE001 -- a reset or an incomplete stream: what the test must not see
        out[key] = e


def chat_plain(base, name, max_tokens, out, key):
    t0 = time.time()
    try:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                       json={"model": name, "max_tokens": max_tokens, "temperature": 0,
                             "messages": [{"role": "user", "content": f"story {key}"}]})
        out[key] = (r.status_code, r.json(), time.time() - t0)
    except Exception as e:  # noqa: BLE001
        out[key] = e


def run_clients(base, name, clients):
    """Start ``clients`` (key: (function, max_tokens)); wait until every one is being generated or has finished (a
    short one can finish before the last one starts on a fast machine)."""
    out: dict = {}
    threads = [threading.Thread(target=fn, args=(base, name, n, out, key), daemon=True)
               for key, (fn, n) in clients.items()]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while httpx.get(f"{base}/kvcompile/stats", timeout=10).json()["active"] + len(out) < len(clients):
        assert time.time() < deadline, "the requests never all ran"
        time.sleep(0.1)
    return out, threads


def ended_cleanly(result):
    """A stream the server ended: HTTP 200, its last event the error that says why (the stream closed properly:
    httpx read it to its end)."""
    assert not isinstance(result, Exception), repr(result)
    status, lines, _ = result
    assert status == 200 and lines, result
    last = json.loads(lines[-1][6:])
    assert "shutting down" in last["error"], last
    return len(lines)


def stopped_server(tiny_dir, grace):
    return start_server("--model", tiny_dir, "--policy", "kivi:4", "--budget-mib", 2, "--max-requests", 4,
                        "--shutdown-grace", grace)


def test_sigterm_lets_requests_finish_for_the_grace_period_then_ends_the_rest_cleanly(tiny_dir):
    """SIGTERM (``kill PID``): new connections are refused at once; requests that finish within the grace period
    get their whole replies; those still running at its end are ended -- a stream with an error event and its end,
    a reply waited for with a 503 in OpenAI's shape -- and the server exits 0 without a traceback. (uvicorn alone
    waited for every request without limit: a supervisor's 30 s kill came first.)"""
    proc, base = stopped_server(tiny_dir, 4)
    name = str(tiny_dir)
    try:
        out, threads = run_clients(base, name, {"short": (chat_stream, 12), "long": (chat_stream, 3000),
                                                "waited": (chat_plain, 3000)})
        t0 = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{base}/health", timeout=5)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=120) == 0
        took = time.time() - t0
    finally:
        log = stop_server(proc)
    assert "Traceback" not in log, log[-3000:]
    assert "ended 2 request(s) still running" in log, log[-3000:]
    status, lines, _ = out["short"]  # finished within the grace period: its whole reply, ended as usual
    assert status == 200 and json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == "length", lines[-1]
    assert ended_cleanly(out["long"]) < 3000
    status, body, seconds = out["waited"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert 4 <= seconds and took < 4 + 60, (seconds, took)  # ended after the grace period, not at its reply's end


def test_a_second_signal_ends_the_requests_at_once(tiny_dir):
    """Two SIGINTs (Ctrl+C twice): the second ends the requests in flight at once (the grace period is long), as
    cleanly as the grace period's end does; no traceback (they logged one per request cut), exit 0."""
    proc, base = stopped_server(tiny_dir, 600)
    name = str(tiny_dir)
    try:
        out, threads = run_clients(base, name, {"a": (chat_stream, 3000), "b": (chat_stream, 3000),
                                                "waited": (chat_plain, 3000)})
        t0 = time.time()
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)
        os.kill(proc.pid, signal.SIGINT)
        for t in threads:
            t.join(timeout=60)
        ended = time.time() - t0
        assert proc.wait(timeout=120) == 0
    finally:
        log = stop_server(proc)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert ended < 60, ended  # not the 600 s grace period
    ended_cleanly(out["a"]), ended_cleanly(out["b"])
    assert out["waited"][0] == 503, out["waited"]
