"""Load over HTTP. The benchmark runs end to end (slow: both servers on the real SmolLM2). And out of pages: more
streaming clients than the cache holds, on the tiny model -- every request completes, with the text it gets
alone, while the cache's pages run out and transformers' scheduler queues requests and evicts some
(re-prefilled later)."""
import asyncio
import json

import httpx
import pytest
from test_serve_http import start_server, stats, stop_server

from benchmarks import serve_load

# servers under load: the benchmark loads the real SmolLM2 in two servers, the out-of-pages test streams 300
# tokens to 4 clients (30 s and more each)
pytestmark = pytest.mark.slow


def test_serve_load_smoke(tmp_path):
    out = tmp_path / "load.json"
    rows = serve_load.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["contender"] for r in rows] == ["transformers", "kvcompile"]
    for r in rows:
        assert r["completed"] == r["concurrency"] == 2 and r["failed"] == 0 and not r["errors"], r
        assert r["completed"] <= r["tokens"] <= r["completed"] * 4, r  # --smoke asks 4 new tokens a request
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["wall_s"]) and r["peak_rss_mib"] > 100, r
        assert 0 < r["ttft_median_s"] <= r["ttft_p95_s"] <= r["wall_s"]
    kv = rows[1]
    assert 1 <= kv["most_requests_held"] <= 2  # sampled from kvcompile's cache while the requests ran


CLIENTS, NEW, WORDS = 4, 300, 40
ALONE: dict = {}  # model: what each client gets alone, full precision (the same with offload or without)


async def stream(client, base, name, i) -> tuple[str, int, str | None]:
    """One greedy streaming chat completion read to its end: (text, completion tokens, error)."""
    body = {"model": name, "stream": True, "max_tokens": NEW, "temperature": 0,
            "messages": [{"role": "user", "content": f"story {i}: " + " ".join(f"w{(7 * i + k) % 50}"
                                                                              for k in range(WORDS))}]}
    text, tokens = [], None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return "", 0, f"{r.status_code}: {(await r.aread())[:300]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return "".join(text), 0, str(d["error"])
            tokens = (d.get("usage") or {}).get("completion_tokens", tokens)
            text += [c["delta"].get("content") or "" for c in d.get("choices", [])]
    return "".join(text), tokens, None


@pytest.mark.parametrize("offload", [0, 4], ids=["re-prefilled", "offloaded"])
def test_out_of_pages_every_request_completes_with_its_own_text(tiny_dir, tmp_path, offload):
    """Evicted requests are prefilled again, or (``--cpu-offload-mib``) their caches wait in host memory and
    come back as they were."""
    from kvcompile import Policy

    # the full-precision store: a re-prefilled request computes exactly what it had (a quantized store would
    # change it: the chunk's keys are exact in prefill, packed in decode), so the texts can be compared
    Policy.full().save(tmp_path / "full.json")
    proc, base = start_server("--model", tiny_dir, "--policy", tmp_path / "full.json", "--budget-mib", 1,
                              "--max-requests", CLIENTS, "--cpu-offload-mib", offload)
    name = str(tiny_dir)
    try:
        async def run():
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                alone = ALONE.get(name) or [await stream(client, base, name, i) for i in range(CLIENTS)]
                ALONE[name] = alone
                seen = []

                async def watch():
                    while True:
                        seen.append((await client.get(f"{base}/kvcompile/stats")).json())
                        await asyncio.sleep(0.05)

                w = asyncio.create_task(watch())
                together = await asyncio.wait_for(
                    asyncio.gather(*(stream(client, base, name, i) for i in range(CLIENTS))), 120)
                w.cancel()
                return alone, together, seen

        alone, together, seen = asyncio.run(run())
        end = stats(base)
    finally:
        log = stop_server(proc)
    for i, ((a, na, ea), (t, nt, et)) in enumerate(zip(alone, together)):
        assert ea is None and et is None, (i, ea, et, log[-3000:])
        assert na == nt == NEW and a == t, (i, a, t)  # every request completes, its text as when alone ...
    # ... though the pages ran out: requests waited for them, and some were evicted (and re-prefilled)
    seen = [s for s in seen if s["cache"]]  # (none until the first request started the engine)
    assert max(s["pages_held"] for s in seen) > 0.8 * end["pages"], end
    assert max(s["waiting"] for s in seen) > 0 and end["evicted"] > 0, end
    if offload:  # each evicted request's cache went to host memory and came back
        assert end["offloaded"] == end["restored"] == end["evicted"], end
    else:
        assert end["offloaded"] == 0, end
    assert end["pages_held"] == end["requests"] == 0 and end["free_blocks"] == end["blocks"]  # all back


def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(tiny_dir, monkeypatch):
    """The benchmark's servers and the tests' start on a port found free a moment before; a process that takes
    it meanwhile (another test process's server) answers there, but is not the server started: it is started
    again on another port, and the one that answers is its own."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):  # answers every route, as a server would
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    ports = iter([taken])
    real = serve_load.free_port
    monkeypatch.setattr(serve_load, "free_port", lambda: next(ports, None) or real())
    try:
        with serve_load.Server("kvcompile", str(tiny_dir), 2, "full", 0) as server:
            assert server.port != taken and serve_load.listening(server.proc.pid, server.port)
            assert "manager" in httpx.get(f"{server.base}/kvcompile/stats", timeout=10).json()  # not the other
        assert not serve_load.listening(server.proc.pid, taken)
    finally:
        other.shutdown()
