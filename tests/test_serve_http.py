"""``kvcompile serve`` as a client sees it: a subprocess on a free loopback port, talked to over HTTP with the
``openai`` client and httpx. One chat completion streaming and one not, malformed JSON answered 4xx, the
server up afterwards, and the requests served by kvcompile's continuous-batching cache (its stats endpoint),
which has every block and slot back once they are done."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # loads the real SmolLM2

STARTUP_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "kvcompile", "serve", "--policy", "kivi:4", "--port", str(port),
                             "--budget-mib", "64", "--max-requests", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvcompile serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/kvcompile/stats", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"kvcompile serve did not answer within {STARTUP_S} s")
            time.sleep(1)
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        yield base, models
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def model_name(base) -> str:
    from kvcompile.models import resolve
    return str(resolve(None))


def test_chat_completions_streaming_and_not_over_kvcompiles_cache(server):
    from openai import OpenAI

    base, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    name = model_name(base)
    msg = [{"role": "user", "content": "Name three colors."}]
    out = client.chat.completions.create(model=name, messages=msg, max_tokens=12)
    text = out.choices[0].message.content
    assert isinstance(text, str) and text.strip() and out.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=name, messages=msg, max_tokens=12, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip() and len(chunks) > 2
    stats = httpx.get(f"{base}/kvcompile/stats", timeout=10).json()
    assert stats["manager"] == "KVCompileBatchingManager" and stats["cache"] == "PagedKVCompileCache"
    assert "kivi" in stats["policy"].lower() or "int4" in stats["policy"].lower()
    assert stats["allocated"] <= stats["budget"] == 64 * 2**20
    assert stats["free_blocks"] == stats["blocks"] and stats["requests"] == 0  # everything back


def test_malformed_json_is_a_4xx_and_the_server_stays_up(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "Traceback" not in r.text
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                   json={"model": model_name(base), "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_completions_and_an_unknown_model(server):
    from openai import BadRequestError, OpenAI

    base, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    out = client.completions.create(model=model_name(base), prompt="The capital of France is", max_tokens=6)
    assert out.choices[0].text.strip() and out.usage.completion_tokens == 6
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    stats = httpx.get(f"{base}/kvcompile/stats", timeout=10).json()
    assert stats["free_blocks"] == stats["blocks"] and stats["requests"] == 0
